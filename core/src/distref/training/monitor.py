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


# Steps 3-5 of a session are profiled: after two skipped and one to warm up, the session's third, whose
# communication is counted (distref.training.traffic: a Python dispatch mode around every operator, which
# the table would show as a third of the time).
PROFILED_STEPS = 3
PROFILED_UNTIL = 6  # the steps a run needs for them (cli refuses --profile with fewer)


def profiler(cfg: RunConfig, rank: int):
    """torch.profiler over steps 3-5 (after two skipped and a warm-up step), written under --out/profile, for
    each rank: a Chrome/Perfetto JSON trace that TensorBoard's profiler plugin also reads (the timeline),
    and `time-by-operator.rank<R>.txt`, where those steps' time went, operator by operator, host and
    device in one table (what `python -m torch.utils.bottleneck` summarised, gone in torch 2.13)."""
    if not cfg.profile:
        return contextlib.nullcontext(_Nothing())
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    folder = Path(cfg.out) / "profile"
    write_trace = torch.profiler.tensorboard_trace_handler(str(folder), worker_name=f"rank{rank}")

    def on_trace_ready(prof: torch.profiler.profile) -> None:
        write_trace(prof)
        write_time_table(prof, folder / f"time-by-operator.rank{rank}.txt")

    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=2, warmup=1, active=PROFILED_STEPS, repeat=1),
        on_trace_ready=on_trace_ready,
        record_shapes=True,
        profile_memory=True,
    )


def write_time_table(prof: torch.profiler.profile, path: Path, rows: int = 30) -> None:
    """The profiled steps' operators by their own time (self time: an operator's children are their own
    rows), on the device where one was profiled, else on the host: calls, host time (self and with
    children), device time, memory, one table (torch's `key_averages().table`)."""
    on_device = torch.profiler.ProfilerActivity.CUDA in prof.activities
    by = "self_device_time_total" if on_device else "self_cpu_time_total"
    averages = prof.key_averages()
    steps = sum(event.count for event in averages if event.key == "ProfilerStep*")  # (as many as ran)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"# where {steps} steps' time went, by operator, sorted by {by} (the timeline: the trace beside "
        f"this file)\n{averages.table(sort_by=by, row_limit=rows)}\n"
    )
