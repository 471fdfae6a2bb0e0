"""A pipeline stage that measures itself (pipeline's bubble) and the timeline of its schedule."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from distref.training.measure import IntervalTimer


class ScheduleTimeline:
    """One rank's work in one step of its schedule, for the report's timeline: every forward ("F"),
    backward ("B": input and weight gradients at once; "I": input gradients only, with the weight
    gradients "W" later: the zero-bubble schedules) its stages ran, with the stage and micro-batch, from
    the start of the step's `schedule.step` (torch's own letters: pipelining.schedules._ComputationType).
    The gaps between them are the rank's idle time: waiting on its neighbours, sends and receives, the
    schedule's own work (the loss is computed there too, outside the stage).

    Every step is recorded and the latest kept, except that a step run under a dispatch mode is kept only
    while there is no other: distref.training.traffic counts one step that way (every operation through
    Python: slower), so the timeline is of the last step not counted (of 3 steps, the second) — steady
    state (shapes, optimizer state, allocator warmed), at full speed; a run of one step has only the
    counted one, kept and marked so ("counted").

    Times: on the CPU the host's clock. On CUDA, events on the current stream (as IntervalTimer): the
    host's clock would read kernel launches, not the work. `started_at` (the host's wall clock when the
    step began) places ranks' rows against each other: on one host exactly, across hosts within their
    clocks' skew; on CUDA the stream is idle when a step starts (the loop synchronizes after each), so
    its first event runs at about that time."""

    def __init__(self, device: torch.device):
        self.device = device
        self._kept: dict[str, Any] | None = None
        self._current: dict[str, Any] | None = None

    def _now(self) -> float | torch.cuda.Event:
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextlib.contextmanager
    def step(self, step: int):
        """Record the schedule's step `step` (around `schedule.step`)."""
        current = {"step": step, "counted": is_in_torch_dispatch_mode(), "work": []}
        current["start"], current["started_at"] = self._now(), time.time()  # (one instant, two clocks)
        self._current = current
        try:
            yield
        finally:
            self._current = None
        current["end"] = self._now()
        if not current["counted"] or self._kept is None or self._kept["counted"]:
            self._kept = current

    @contextlib.contextmanager
    def work(self, action: str, stage: int, micro_batch: int):
        """Time one stage's `action` on `micro_batch` (within a recorded step; else nothing)."""
        current = self._current
        if current is None:
            yield
            return
        start = self._now()
        yield
        current["work"].append((action, stage, micro_batch, start, self._now()))

    def result(self) -> dict[str, Any] | None:
        """The step kept: {"step", "counted" (run under the traffic count), "started_at" (host wall clock,
        s since the epoch), "schedule_s" (the step's time in the schedule), "work": [[action, stage,
        micro-batch, start_s, end_s], ...] in the order run, seconds from the step's start}; None before
        any step ran. On CUDA it waits for the step's events."""
        kept = self._kept
        if kept is None:
            return None
        if self.device.type == "cuda":
            kept["end"].synchronize()

            def since_start(t):
                return kept["start"].elapsed_time(t) / 1000  # milliseconds
        else:

            def since_start(t):
                return t - kept["start"]

        return {
            "step": kept["step"],
            "counted": kept["counted"],
            "started_at": kept["started_at"],
            "schedule_s": since_start(kept["end"]),
            "work": [[a, s, m, since_start(t0), since_start(t1)] for a, s, m, t0, t1 in kept["work"]],
        }


class TimedStage(PipelineStage):
    """A PipelineStage that adds up the time it computes (forward, backward, weight gradients). The rest of
    a rank's time in `schedule.step` it waits on its neighbours or runs the schedule itself: the bubble,
    measured (the optimizer step, outside the schedule, is not counted either way). On a GPU both are
    CUDA events on the stream (IntervalTimer): a host clock sees NCCL's waits as no time. With a
    `timeline` (one per rank, shared by its stages) each piece of work is also put on it, by micro-batch:
    the schedule passes the micro-batch's index first to each of the three (torch 2.13)."""

    def __init__(self, *args, timeline: ScheduleTimeline | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.busy = IntervalTimer(self.device)
        self.timeline = timeline if timeline is not None else ScheduleTimeline(self.device)

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        with self.busy.measure(), self.timeline.work("F", self.stage_index, fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False
    ):
        action = "B" if full_backward else "I"  # "I": input gradients now, weight gradients ("W") later
        with self.busy.measure(), self.timeline.work(action, self.stage_index, bwd_chunk_id):
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        with self.busy.measure(), self.timeline.work("W", self.stage_index, bwd_chunk_id):
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
