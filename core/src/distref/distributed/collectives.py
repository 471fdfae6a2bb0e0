"""Collectives the impls share: tensors between two ranks with their shape, gathering to rank 0, a mean."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from distref.config import RunConfig
from distref.cost import Predicted
from distref.data import TensorData, eval_batches
from distref.record import node_name
from distref.training.checkpoint import full_state_dict, save_checkpoint
from distref.training.steps import evaluate
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


def save_whole_state(
    path: str, held: dict[str, torch.Tensor], world_size: int, keys: list[str] | None = None
) -> None:
    """Rank 0 gathers every rank's `held` part of a model's state_dict (its stages, its part; replicas
    hold equal copies) and writes the whole model's, in the order of `keys` (the core model's; None: the
    ranks' order, where rank r holds the blocks after rank r-1's)."""
    gathered = gather_to_rank0(held, world_size)
    if gathered:
        merged = {k: v for part in gathered for k, v in part.items()}
        save_checkpoint(path, {k: merged[k] for k in keys or merged})


def evaluate_gathered(
    model: torch.nn.Module,
    eval_model: torch.nn.Module,
    test_set: TensorData,
    device: torch.device,
    cfg: RunConfig,
) -> torch.Tensor:
    """The test set's [loss sum, correct, count] for a model split or sharded over the ranks (FSDP2,
    tensor parallelism: DTensors), each rank scoring its shard of the test set with `eval_model`, a plain
    copy of the model loaded with the gathered parameters: forwards through the split model are
    collectives, and shards may differ in batch count, so they would not pair up across ranks. Buffers
    (BatchNorm's statistics, not sharded) are rank 0's everywhere: the saved model's. A collective."""
    eval_model.load_state_dict(full_state_dict(model))
    eval_model.to(device)  # for the evaluation only: a whole model on every GPU would undo the split
    for buffer in eval_model.buffers():
        dist.broadcast(buffer, src=0)
    batches = eval_batches(test_set, rank=dist.get_rank(), world_size=dist.get_world_size())
    totals = evaluate(eval_model, batches, device, cfg)
    eval_model.to("cpu")
    dist.all_reduce(totals)  # the ranks' sums: the whole test set's
    return totals


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
    """End the run's record with every rank's peak memory (of each device it computes on), model-state
    bytes and communication, measured and `predicted` by the strategy's formulas (distref.cost), gathered
    to rank 0 (the one that writes it; elsewhere the lists stay empty). An impl whose own saved-tensor hooks
    run inside the step (they hide it from the counted step's) gives its `measured_activation_bytes`."""
    counted = TRAFFIC.summary()
    if measured_activation_bytes is not None:
        counted["activation_bytes"] = measured_activation_bytes
    mine = {
        "peak": record.training_peak_memory(),  # one per device it computes on
        "states": state_bytes,
        "counted": counted,
        "predicted": predicted.as_dict(),
        "node": node_name(),
    }
    ranks = gather_to_rank0(mine, world_size)
    if ranks:
        record.set_communication([r["counted"] for r in ranks])
        record.data["environment"]["rank_nodes"] = [r["node"] for r in ranks]
    peaks, states = [int(p) for r in ranks for p in r["peak"]], [r["states"] for r in ranks]
    record.finish(global_batch_size, peaks, states, [r["predicted"] for r in ranks])
