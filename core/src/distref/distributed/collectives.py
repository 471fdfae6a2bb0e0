"""Collectives the impls share: tensors between two ranks with their shape, gathering to rank 0, a mean."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from distref.cost import Predicted
from distref.record import node_name
from distref.training.traffic import TRAFFIC

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)


_HEADER = 8  # int64s: dtype index, number of dims, up to 6 sizes


def send_tensor(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> int:
    """Send a tensor whose shape and dtype the receiver cannot know (batches differ in size, autocast
    changes the dtype): a fixed-size header first, then the data. `dst` is a global rank. Returns the
    bytes sent."""
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
    dist.send(header.to(tensor.device), dst, group=group)
    dist.send(tensor.contiguous(), dst, group=group)
    return header.numel() * header.element_size() + tensor.numel() * tensor.element_size()


def recv_tensor(src: int, device: torch.device, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Receive what `send_tensor` sent from global rank `src`, on `device`."""
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    dtype, dims = _DTYPES[int(header[0])], int(header[1])
    tensor = torch.empty(header[2 : 2 + dims].tolist(), dtype=dtype, device=device)
    dist.recv(tensor, src, group=group)
    return tensor


def gather_to_rank0(obj: Any, world_size: int) -> list:
    """Every rank's picklable `obj` on rank 0, as a list by rank (elsewhere empty). One process: [obj].
    Tensors in it travel as CPU tensors: a pickled CUDA tensor would be unpickled on rank 0 onto the
    sender's GPU index (rank 1's optimizer state onto cuda:1, from rank 0's process)."""
    if world_size == 1:
        return [obj]
    obj = torch.utils._pytree.tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, obj)
    gathered = [None] * world_size if dist.get_rank() == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered or []


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In place, the sum over the ranks (of `group`; default every rank). Each rank's step loss is its part
    of the global batch's mean (its loss sum / the global count of scored targets): the sum is the mean."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def finish_record(
    record: Any,
    global_batch_size: int,
    state_bytes: dict | None,
    world_size: int,
    predicted: Predicted,
    measured_activation_bytes: int | None = None,
) -> None:
    """End the run's record with every rank's peak memory, model-state bytes and communication, measured
    and `predicted` by the strategy's formulas (distref.cost), gathered to rank 0 (the one that writes it;
    elsewhere the lists stay empty). An impl whose own saved-tensor hooks run inside the step (they hide it
    from the counted step's) gives its `measured_activation_bytes`."""
    counted = TRAFFIC.summary()
    if measured_activation_bytes is not None:
        counted["activation_bytes"] = measured_activation_bytes
    mine = {
        "peak": record.training_peak_memory()[0],
        "states": state_bytes,
        "counted": counted,
        "predicted": predicted.as_dict(),
        "node": node_name(),
    }
    ranks = gather_to_rank0(mine, world_size)
    if ranks:
        record.set_communication([r["counted"] for r in ranks])
        record.data["environment"]["rank_nodes"] = [r["node"] for r in ranks]
    peaks, states = [int(r["peak"]) for r in ranks], [r["states"] for r in ranks]
    record.finish(global_batch_size, peaks, states, [r["predicted"] for r in ranks])
