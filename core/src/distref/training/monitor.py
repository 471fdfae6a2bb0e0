"""What a person watches while a run goes: a progress bar on rank 0, TensorBoard scalars, a profiler
trace. Each is a no-op object when disabled, so the loop has no branches for them."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from distref.config import RunConfig


class _Nothing:
    """Stands in for a disabled progress bar / writer / profiler: every call does nothing."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


class _PlainBar(_Nothing):
    def write(self, line: str) -> None:
        print(line)


def progress_bar(total: int, initial: int, enabled: bool, desc: str):
    """tqdm on rank 0 only (other ranks stay quiet); hidden when stderr is not a terminal."""
    if not enabled:
        return _Nothing()
    try:
        from tqdm.auto import tqdm
    except ImportError:  # optional: without tqdm, evaluation lines still print
        return _PlainBar()

    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, disable=None)


def tensorboard_writer(cfg: RunConfig, enabled: bool):
    if not (enabled and cfg.tensorboard):
        return _Nothing()
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # tensorboard is an optional dependency
        raise SystemExit(f"--tensorboard needs the tensorboard package: {exc}") from exc
    return SummaryWriter(log_dir=str(Path(cfg.out) / "tensorboard"))


def profiler(cfg: RunConfig, rank: int):
    """torch.profiler over steps 2-4 (after a wait and a warm-up step), written as a Chrome/Perfetto
    JSON trace that TensorBoard's profiler plugin also reads, one file per rank under --out/profile."""
    if not cfg.profile:
        return contextlib.nullcontext(_Nothing())
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(
            str(Path(cfg.out) / "profile"), worker_name=f"rank{rank}"
        ),
        record_shapes=True,
        profile_memory=True,
    )
