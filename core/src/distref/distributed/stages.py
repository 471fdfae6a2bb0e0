"""What a pipeline's schedule does on each rank, measured: its stages' busy time (the bubble is the rest), the
activations held for backward, and one step's timeline (`StageMeter`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from distref.cost.activations import Action, one_stage_order
from distref.distributed.collectives import gather_to_rank0, recv_tensor, send_tensor
from distref.training.device import autocast_for
from distref.training.measure import IntervalTimer, SavedActivations
from distref.training.steps import score


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


class StageMeter:
    """What impls/pipeline measures of its schedule, kept out of the strategy: the time each of this
    rank's stages computes (forward, backward, weight gradients: `wrap` each stage), the rank's time in
    the schedule and the activations autograd holds for backward (`with meter.step(step)` around
    `schedule.step`), and one step's timeline; `gathered` brings every rank's to rank 0 for the record.

    The rest of a rank's time in the schedule it waits on its neighbours or runs the schedule itself: the
    bubble, measured (the optimizer step, outside the schedule, counts neither way). On a GPU the times
    are CUDA events on the stream (IntervalTimer): a host clock sees NCCL's waits as no time. Measured
    from a session's second step on, as the throughput is: the first pays for warm-up."""

    def __init__(self, device: torch.device, activations: bool = True):
        """`activations`: hold the step in saved-tensor hooks that count them (not under --compile:
        dynamo would trace the hooks into the blocks' graphs; the counted step's meter counts them)."""
        self.count_activations = activations
        self.busy = IntervalTimer(device)  # this rank's stages computing
        self.in_schedule = IntervalTimer(device)  # this rank in schedule.step
        self.timeline = ScheduleTimeline(device)
        self.activations = SavedActivations()  # (each wrapped stage's parameters are not activations)
        self.steps = 0

    def wrap(self, stage: PipelineStage) -> PipelineStage:
        """`stage`, its computations timed and put on the timeline by micro-batch (the schedule passes the
        micro-batch's index first to each of the three, torch 2.13)."""
        forward, backward, backward_weight = (
            stage.forward_one_chunk,
            stage.backward_one_chunk,
            stage.backward_weight_one_chunk,
        )
        index = stage.stage_index
        self.activations.parameter_storages |= {
            p.untyped_storage().data_ptr() for p in stage.submod.parameters()
        }

        def forward_one_chunk(chunk: int, *args, **kwargs):
            with self.busy.measure(), self.timeline.work("F", index, chunk):
                return forward(chunk, *args, **kwargs)

        def backward_one_chunk(chunk: int, loss=None, full_backward: bool = True, last_backward=False):
            action = "B" if full_backward else "I"  # "I": input gradients now, weight gradients ("W") later
            with self.busy.measure(), self.timeline.work(action, index, chunk):
                return backward(chunk, loss, full_backward, last_backward)

        def backward_weight_one_chunk(chunk: int, *args, **kwargs):
            with self.busy.measure(), self.timeline.work("W", index, chunk):
                return backward_weight(chunk, *args, **kwargs)

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk
        return stage

    @contextlib.contextmanager
    def step(self, step: int):
        """Measure the schedule's step `step` on this rank (around `schedule.step`)."""
        self.steps += 1
        if self.steps == 2:  # the first step of this session paid for warm-up: measured from the second
            self.busy.reset()
            self.in_schedule.reset()
            self.activations.peak = 0
        self.activations.at_step_start = self.activations.live
        held = (
            torch.autograd.graph.saved_tensors_hooks(self.activations.pack, self.activations.unpack)
            if self.count_activations
            else contextlib.nullcontext()
        )
        with self.timeline.step(step), self.in_schedule.measure(), held:
            yield

    @property
    def peak_activation_bytes(self) -> int | None:
        return self.activations.peak if self.count_activations else None

    def gathered(self, world_size: int) -> dict[str, Any] | None:
        """On rank 0, every rank's measurements for the record (`RunRecord.add_schedule_measurements`):
        its busy share of its time in the schedule, activations held at most and timeline of one step;
        and the bubble, the mean idle share (None where a rank has no time in the schedule). None on the
        other ranks. A collective: every rank calls it."""
        busy_s, schedule_s = self.busy.seconds(), self.in_schedule.seconds()
        mine = {
            "activations": self.peak_activation_bytes,
            "busy_fraction": busy_s / schedule_s if schedule_s else None,
            "timeline": self.timeline.result(),
        }
        ranks = gather_to_rank0(mine, world_size)
        if not ranks:
            return None
        busy = [r["busy_fraction"] for r in ranks]
        return {
            "busy_fraction": busy,
            "peak_activation_bytes": [r["activations"] for r in ranks],
            "timeline": [r["timeline"] for r in ranks],
            "bubble_fraction": 1 - sum(busy) / len(busy) if all(b is not None for b in busy) else None,
        }


def work_order(
    schedule: Any, pp_rank: int, name: str, microbatches: int, n_stages: int, stage: int
) -> list[Action] | None:
    """Pipeline rank `pp_rank`'s work in one step of `schedule` (torch.distributed.pipelining, called
    `name`), in order, as (kind, stage, micro-batch): "F" forward, "B" full backward, "I" and "W" a
    backward split into its input- and weight-gradient passes. The multi-stage schedules hold it
    (`pipeline_order`; DualPipeV's overlapped forward-backward pairs as their parts); GPipe and 1F1B, on
    their one `stage`, follow their rule (distref.cost.activations.one_stage_order)."""
    if isinstance(schedule, PipelineScheduleSingle):
        return one_stage_order(name, microbatches, n_stages, stage)
    return [
        (part.computation_type.value, part.stage_index, part.microbatch_index)
        for action in schedule.pipeline_order[pp_rank]
        if action is not None
        for part in (action.sub_actions or (action,))
    ]


ONE_STAGE_PER_RANK = ("gpipe", "1f1b")  # the schedules of one stage per rank; the others hold several
V_SHAPED = ("zbv", "dualpipev")  # rank r holds stages r and 2p-1-r


def default_stages_per_rank(schedule: str) -> int:
    """The stages each rank holds when --stages-per-rank is not given: 1 for GPipe and 1F1B, 2 for the
    others (the fewest they run)."""
    return 1 if schedule in ONE_STAGE_PER_RANK else 2


def schedule_problem(schedule: str, microbatches: int, p: int, v: int) -> str | None:
    """What torch 2.13's schedule constructors would refuse for `schedule` on p ranks of `v` stages each
    and M `microbatches`, said before any process starts (a test checks these against the constructors
    themselves); None if they take it."""
    return stages_per_rank_problem(schedule, v) or microbatch_problem(schedule, microbatches, p, p * v)


def stages_per_rank_problem(schedule: str, v: int) -> str | None:
    """Whether `schedule` runs `v` stages per rank."""
    if schedule in ONE_STAGE_PER_RANK and v != 1:
        return f"--schedule {schedule} runs one stage per rank: for {v} use interleaved-1f1b or interleaved-zero-bubble"
    if schedule not in ONE_STAGE_PER_RANK and v == 1:
        return f"--schedule {schedule} needs 2 or more stages per rank (--stages-per-rank 2)"
    if schedule in V_SHAPED and v != 2:
        return f"--schedule {schedule} places exactly 2 stages per rank (a V), not {v}"
    return None


def microbatch_problem(schedule: str, m: int, p: int, n_stages: int) -> str | None:
    """Whether `schedule` runs M micro-batches on p ranks holding `n_stages` stages."""
    if schedule == "1f1b" and m < p:
        return (
            f"--schedule 1f1b needs --microbatches >= the {p} stages (each starts backward after p forwards)"
        )
    if schedule.startswith("interleaved") and m % (rounds := max(1, m // p)):
        return (
            f"--schedule {schedule} needs --microbatches {m} to be a multiple of its {rounds} rounds (M // p)"
        )
    if schedule == "dualpipev" and m < n_stages:
        return f"--schedule dualpipev needs --microbatches >= its {n_stages} stages"
    return None


@torch.no_grad()
def stage_examples(
    model: torch.nn.Module,
    bounds: list[tuple[int, int]],
    example: torch.Tensor,
    device: torch.device,
    precision: str,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each stage's input and output for one micro-batch `example` (their shapes and dtypes are what
    count), from one forward of the whole model, a block at a time on `device` (and back where it was).
    Given to PipelineStage, they spare it its own shape inference at the first step: a train-mode forward
    of a real micro-batch on stage 0 and of uninitialised tensors on the others, which updates
    BatchNorm's running statistics once more than single does. Here in eval mode: BatchNorm reads its
    statistics and writes none. On the run's device and under its autocast, so that dtypes are those the
    stages will send; marked as requiring gradients where training's would (every activation but the
    data), so that each stage expects its gradient."""

    def as_in_training(tensor: torch.Tensor, is_activation: bool) -> torch.Tensor:
        return tensor.detach().requires_grad_(is_activation and tensor.is_floating_point())

    blocks, home = list(model.children()), next(model.parameters()).device
    model.eval()
    examples, x = [], example.to(device)
    with autocast_for(precision, device):
        for first, end in bounds:
            stage_input = x
            for block in blocks[first:end]:
                x = block.to(device)(x)
                block.to(home)
            examples.append((as_in_training(stage_input, first > 0), as_in_training(x, True)))
    model.train()
    return examples


@torch.no_grad()
def evaluate_stages(
    stage_modules: dict[int, torch.nn.Module],
    owner: list[int],
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    precision: str,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """[loss_sum, correct, count] over `batches`, each batch forward through every stage in order (no
    schedule: nothing to overlap without backward): this rank's `stage_modules` by stage index, in order,
    `owner[s]` the global rank holding stage s (in `group`). Activations go to the next stage's rank by point-to-point
    send/recv, or stay here when this rank holds that stage too; the last stage's rank scores."""
    me, last = dist.get_rank(), len(owner) - 1
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for module in stage_modules.values():
        module.eval()
    for x, y in batches:
        kept = None  # an activation for a stage this rank also holds
        for s, module in stage_modules.items():  # in stage order
            if s == 0:
                inputs = x.to(device)
            elif owner[s - 1] == me:
                inputs = kept
            else:
                inputs = recv_tensor(owner[s - 1], device, group)
            with autocast_for(precision, device):
                outputs = module(inputs)
            if s == last:
                totals += score(outputs, y.to(device))
            elif owner[s + 1] == me:
                kept = outputs
            else:
                send_tensor(outputs, owner[s + 1], group)
    for module in stage_modules.values():
        module.train()
    return totals
