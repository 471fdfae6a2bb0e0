"""What impls/model_parallel measures of the hand-offs between its parts (`HandoffMeter`)."""

from __future__ import annotations

from typing import Any

import torch

from distref.distributed.collectives import gather_to_rank0
from distref.training.measure import IntervalTimer
from distref.training.traffic import TRAFFIC


class HandoffMeter:
    """The bytes a rank hands on per step (activations forward, their gradients back: `sent`, as its
    session's first step sent them) and the share of its training time it computes rather than waits for a
    neighbour (`with meter.waiting()` around each receive; `step_done` with each step's time): with one
    micro-batch in flight, the rest is the naive schedule's idle time. Both times leave out the counted
    step (distref.training.traffic: every operation through Python, slower). On a GPU the waits are CUDA
    events on the stream (IntervalTimer): a host clock sees NCCL's waits as no time."""

    def __init__(self, device: torch.device | None = None):
        self.waits = IntervalTimer(device or torch.device("cpu"))
        self.bytes_sent = 0
        self.bytes_per_step: int | None = None
        self.trained_s = 0.0

    def sent(self, nbytes: int) -> None:
        self.bytes_sent += nbytes

    def waiting(self):
        """A context manager: the time inside is spent waiting for a neighbour."""
        return self.waits.measure()

    def step_done(self, step: int, seconds: float) -> None:
        """Step `step` is done; it took `seconds`."""
        if self.bytes_per_step is None:  # the session's first step
            self.bytes_per_step = self.bytes_sent
        if step != TRAFFIC.counted_step:  # (as the waits: IntervalTimer leaves the counted step out)
            self.trained_s += seconds

    def gathered(self, world_size: int) -> dict[str, Any]:
        """On rank 0, every rank's bytes sent per step and busy fraction (None: no step timed), by rank,
        as the record's strategy facts; {} on the other ranks. A collective: every rank calls it."""
        busy = 1 - self.waits.seconds() / self.trained_s if self.trained_s else None
        ranks = gather_to_rank0({"bytes_per_step": self.bytes_per_step, "busy_fraction": busy}, world_size)
        if not ranks:
            return {}
        return {
            "bytes_sent_per_step": [r["bytes_per_step"] for r in ranks],
            "busy_fraction": [r["busy_fraction"] for r in ranks],
        }
