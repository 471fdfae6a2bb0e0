"""What a run measures about itself: bytes of model state per rank (any strategy, and DeepSpeed ZeRO's
partitions), activations autograd holds for backward, and device time (IntervalTimer)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from distref.models import PARAMETER_PARTS


def model_state_bytes(parameters: Iterable[nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of model state held for `parameters`, measured on the tensors: the parameters, their
    gradients and their optimizer state (AdamW: two moments and a step count per tensor). Call once
    both exist (after an optimizer step, before zero_grad). Communication buffers (DDP's buckets) and
    activations are not model state: peak memory covers them."""
    params = list(parameters)
    return {
        "parameters": sum(held_bytes(p) for p in params),
        "gradients": sum(held_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            held_bytes(t) for p in params for t in optimizer.state.get(p, {}).values() if torch.is_tensor(t)
        ),
    }


def held_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of `tensor`: of a DTensor (FSDP's shards), its local part only."""
    local = local_part(tensor)
    return local.numel() * local.element_size()


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `tensor`: a DTensor's local part (tensor parallelism's loss under loss
    parallelism is a replicated DTensor: every rank holds the whole loss), a plain tensor itself."""
    # (DTensor is not imported to test isinstance: importing torch.distributed.tensor costs every process
    # ~0.4 s, and only DTensor has to_local.)
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def record_held_shapes(model: nn.Module) -> dict[str, list[int]]:
    """Filled by gpt's first forward under tensor or context parallelism: the shape of what this rank
    holds of the activations between blocks (sequence or context parallel: 1/T or 1/C of the sequence)
    and of the logits (loss parallel: 1/T of the vocabulary; context parallel: 1/C of the sequence).
    Each hook removes itself once it has looked: nothing runs in later steps."""
    shapes: dict[str, list[int]] = {}
    handles: dict[str, torch.utils.hooks.RemovableHandle] = {}
    if hasattr(model, "tp_plan"):  # a model of yours: no gpt blocks to look at
        return shapes
    for name, module in (("between_blocks", model.block0), ("logits", model.head)):

        def note(_module, _args, output, name=name) -> None:  # (returning None keeps the output)
            shapes[name] = list(local_part(output).shape)
            handles.pop(name).remove()

        handles[name] = module.register_forward_hook(note)
    return shapes


class IntervalTimer:
    """Adds up stretches of a device's work or waiting. On the CPU, the host's clock. On CUDA, events on
    the current stream: the host only enqueues kernels, and NCCL's wait() blocks the stream, not the
    host, so a host clock would read ~0 for a wait that idles the GPU. A stretch run under a dispatch mode
    (distref.training.traffic's counted step: every operation through Python, slower) is not added.
    `seconds()` reads the events (after they complete), so call it once the work is done, e.g. at the
    end of the run."""

    def __init__(self, device: torch.device):
        self.device = device
        self._seconds = 0.0
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def measure(self):
        if is_in_torch_dispatch_mode():  # distref.training.traffic's counted step: slower, not timed
            yield
            return
        if self.device.type != "cuda":
            started = time.perf_counter()
            try:
                yield
            finally:
                self._seconds += time.perf_counter() - started
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            self._pending.append((start, end))

    def seconds(self) -> float:
        for start, end in self._pending:
            end.synchronize()
            self._seconds += start.elapsed_time(end) / 1000  # milliseconds
        self._pending.clear()
        return self._seconds

    def reset(self) -> None:
        self._seconds, self._pending = 0.0, []


class SavedActivations:
    """Bytes of activations autograd holds for backward (parameters excluded): `live` now, `peak` the most
    a step added on top of what was held when it started — what GPipe (M micro-batches in flight) and
    1F1B (at most p) differ in. Its pack/unpack go to torch.autograd.graph.saved_tensors_hooks around
    each step; a saved tensor counts until autograd drops it, and the same elements saved several times
    (a ReLU's output is also the next Linear's input, flattened) count once, as memory holds them. (Measured
    from the second step on, as the throughput is: the first pays for warm-up.)"""

    def __init__(self, parameters: Iterable[torch.nn.Parameter] = ()):
        self.parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self.live = self.at_step_start = self.peak = 0
        self.holders: dict[tuple, int] = {}  # (storage, offset, bytes) → how many saved tensors hold it

    def pack(self, tensor: torch.Tensor):
        # Parameters (and FSDP's/ZeRO-3's gathered ones, parameters too, and DTensor ones) are model
        # state, not activations; so is a view of one (a Linear saves weight.t(); of a DTensor parameter,
        # a DTensor view whose local part is a plain view of the parameter's local part).
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's part
        # A collective's result not yet waited for (AsyncCollectiveTensor: a row-wise layer's output that
        # the next layer saves) wraps the tensor it will hold, whose storage it has none of its own
        local = getattr(local, "elem", local)
        if _of_a_parameter(tensor) or _of_a_parameter(local):
            return tensor
        if local.untyped_storage().data_ptr() in self.parameter_storages or _of_a_parameter_part(local):
            return tensor
        return _Saved(tensor, local, self)

    @staticmethod
    def unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed


def _of_a_parameter_part(tensor: torch.Tensor) -> bool:
    """A view of a DTensor parameter's local part (distref.models.local handed it out)."""
    whole = tensor if tensor._base is None else tensor._base
    return PARAMETER_PARTS.get(id(whole)) is whole


def _of_a_parameter(tensor: torch.Tensor) -> bool:
    """A parameter, or a view of one."""
    while tensor._base is not None:
        tensor = tensor._base
    return isinstance(tensor, nn.Parameter)


class _Saved:
    """One saved activation: its elements counted from when autograd first saves them until the last
    saved tensor holding them (a view of the same elements: same storage, offset and size) is let go."""

    __slots__ = ("key", "meter", "nbytes", "tensor")

    def __init__(self, tensor: torch.Tensor, local: torch.Tensor, meter: SavedActivations):
        # Detached: a saved output's grad_fn holds this object, which must not hold the grad_fn back (a
        # cycle through C++ that no garbage collector breaks: with retain_graph, as a split backward's
        # input-gradient pass runs, the tensor would never be freed). Autograd restores the grad_fn on
        # unpacking.
        self.tensor, self.meter = tensor.detach(), meter
        self.nbytes = local.numel() * local.element_size()
        self.key = (local.untyped_storage().data_ptr(), local.storage_offset(), self.nbytes)
        meter.holders[self.key] = meter.holders.get(self.key, 0) + 1
        if meter.holders[self.key] == 1:
            meter.live += self.nbytes
            meter.peak = max(meter.peak, meter.live - meter.at_step_start)

    def __del__(self):
        holders = self.meter.holders
        holders[self.key] -= 1
        if holders[self.key] == 0:
            del holders[self.key]
            self.meter.live -= self.nbytes


def zero_model_state_bytes(engine, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of model state this rank holds, by kind, measured on the tensors (each storage once).

    parameters: what the module's parameters hold here (stage 3: the rank's partition only);
    optimizer: the torch optimizer's states plus the flat fp32 master partitions it steps (ZeRO 1-3
    keep those even in fp32, beside the parameters); gradients: the gradient tensors and DeepSpeed's gradient
    buffers/partitions found on the ZeRO optimizer. Call after the last backward of a step, before
    engine.step() (DeepSpeed frees gradients inside step)."""
    seen: set[int] = set()

    def new_bytes(tensor: torch.Tensor) -> int:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    params = list(engine.module.parameters())
    held = {"parameters": 0, "gradients": 0, "optimizer": 0}
    for p in params:
        # Stage 3: the partition (ds_tensor), plus the whole tensor where it is present between uses (a
        # "persistent" one, below stage3_param_persistence_threshold); released ones hold no storage.
        held["parameters"] += new_bytes(p) + (new_bytes(p.ds_tensor) if hasattr(p, "ds_tensor") else 0)
    # Keyed by the tensors the optimizer steps: the flat fp32 partitions under ZeRO (stage 3 swaps them into
    # param_groups only while stepping, so param_groups may be empty now).
    for master, state in optimizer.state.items():
        held["optimizer"] += new_bytes(master)
        held["optimizer"] += sum(new_bytes(t) for t in state.values() if torch.is_tensor(t))
    for p in params:
        held["gradients"] += new_bytes(p.grad) if p.grad is not None else 0
    for master in optimizer.state:
        held["gradients"] += new_bytes(master.grad) if master.grad is not None else 0

    def walk(obj, depth: int) -> None:  # DeepSpeed's own gradient buffers, held by its optimizer
        if torch.is_tensor(obj):
            held["gradients"] += new_bytes(obj)
        elif depth and isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item, depth - 1)
        elif depth and isinstance(obj, dict):
            for item in obj.values():
                walk(item, depth - 1)

    zero_optimizer = engine.optimizer
    if zero_optimizer is not optimizer:
        for name, value in vars(zero_optimizer).items():
            if "grad" in name or "ipg" in name:
                walk(value, 3)
    return held
