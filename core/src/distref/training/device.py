"""Where and in what precision a run computes: device, CPU threads, seeds, dtype, autocast."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
from collections.abc import Sequence

import torch

from distref.config import RunConfig
from distref.models import parameter_dtype


def configure_cpu_threads() -> int:
    """One thread per process unless OMP_NUM_THREADS says otherwise; returns the number set.

    Measured here (lenet, 2 cores; `nox -s single-bench`, two runs): 2 threads give 1.4-1.7× on an idle
    machine but run 2.4-2.9× slower than 1 beside one busy process, as OpenMP's spinning threads fight for
    the cores (OMP_WAIT_POLICY=PASSIVE gains nothing idle and still loses 1.6× busy); several ranks with 2
    threads each were 5-8× slower. One thread per process is the default that never collapses, and makes every
    rank of every impl count the same: compare like with like. Set OMP_NUM_THREADS on a machine you own.
    """
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    return threads


def pick_device(requested: str, local_rank: int = 0) -> torch.device:
    """One device per process: cuda:<local_rank> when CUDA is wanted and present, else the CPU. Where a
    rank sees one GPU only, that one is its own (srun's --gpus-per-task or --gpu-bind, a pod of one GPU:
    CUDA_VISIBLE_DEVICES names it), whatever its local rank."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        index = 0 if torch.cuda.device_count() == 1 else local_rank
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:  # numpy is optional (only some datasets need it)
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def seed_step(seed: int, step: int, stream: int = 0, devices: Sequence[torch.device] = ()) -> None:
    """Seed torch's generators for `step`: the CPU's and each CUDA device's of `devices`, from (seed, step,
    stream, device). A step's random numbers (dropout masks) are then a function of the step, not of what
    ran before: a resumed or restarted run draws what an uninterrupted one does, on every rank.

    Ranks, or devices, that compute different samples or different units take different streams: their
    masks must be independent (under DDP, seeded alike, sample i of every rank would get one mask).
    Ranks that compute the same activations (tensor parallelism's replicated region) take the same
    stream: their masks must be equal, or the replicas part. Each impl says which it passes."""
    torch.random.default_generator.manual_seed(stream_seed(seed, step, stream, "cpu"))
    for device in devices:
        if device.type == "cuda":
            torch.cuda.default_generators[device.index or 0].manual_seed(
                stream_seed(seed, step, stream, str(device))
            )


def stream_seed(seed: int, step: int, stream: int, device: str) -> int:
    """A 63-bit seed per (seed, step, stream, device): hashed, so that neighbouring steps or streams do
    not start neighbouring sequences."""
    digest = hashlib.sha256(f"{seed}/{step}/{stream}/{device}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def param_dtype(cfg: RunConfig) -> torch.dtype:
    """The parameters' dtype: float64 under --precision fp64, else float32 (bf16/fp16 are autocast over
    fp32 parameters). In fp64 the rounding that a different summation order leaves (~1e-16 instead of
    ~1e-7) stays negligible even after AdamW normalises tiny gradients: parity holds for any optimizer,
    world size and accumulation."""
    return parameter_dtype(cfg.precision)


def autocast(cfg: RunConfig, device: torch.device):
    """Mixed precision for forward + loss: bf16 autocast on CPU or CUDA, fp16 autocast on CUDA."""
    return autocast_for(cfg.precision, device)


def autocast_for(precision: str, device: torch.device):
    """`autocast` for a --precision value."""
    if precision in ("fp32", "fp64"):
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 logits widened to fp32 for the loss (fp64 stays fp64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a step's measured time is the step's (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
