"""Communication a rank issues, counted where it really happens: at the dispatcher, where every
collective and point-to-point operation of torch.distributed passes, whoever calls it — DDP's C++ reducer,
FSDP2, DTensor's functional collectives, torch.distributed.pipelining, DeepSpeed, an impl's own
`dist.send` — on gloo, NCCL or the fake backend alike.

Counted per kind (all_reduce, reduce_scatter, all_gather, broadcast, send, recv, all_to_all; reduce, gather,
scatter and barrier where they occur): calls and bytes, the bytes being the sizes of the tensors the rank
passes to the call, for all_gather and reduce_scatter the larger, unsharded side. `bus_bytes` beside them
follows nccl-tests' convention (doc/PERFORMANCE.md, "bus bandwidth"): what one rank moves over its links,
2(n-1)/n of the message for an all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, the message
for broadcast, reduce, send and recv (n: the group's size).

Counting is a TorchDispatchMode (torch.utils._python_dispatch), so every operation in the counted stretch
passes through Python: a step counted runs slower. `Traffic` counts one steady-state step (the third
of a session: the first two build the optimizer's state, pipelining's shapes, DDP's buckets; a session of
fewer steps counts none, and says why) and, apart, set-up, the first loss logging, the first evaluation and
the first checkpoint — a fixed cost of a few steps' time per run.
torch's own CommDebugMode (torch.distributed.tensor.debug) counts calls of collectives but not their
bytes, nor send/recv.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from distref.cost.counts import add
from distref.record import COUNTED_SESSION_STEP
from distref.training.measure import SavedActivations

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "send", "recv", "all_to_all")
PHASES = ("setup", "step", "log", "eval", "checkpoint")

# Dispatcher op name → (kind, how to find the bytes and the group in its arguments).
_C10D = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "reduce_": "reduce",
    "gather_": "gather",
    "scatter_": "scatter",
    "barrier": "barrier",
    "monitored_barrier_": "barrier",
}
_FUNCTIONAL = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}
# Which argument holds the message whose size is counted: for all_gather the output (c10d) or the input
# times the group (functional), for reduce_scatter the input, else what the rank sends or receives.
_C10D_MESSAGE_ARG = {"_allgather_base_": 0, "allgather_": 0, "allgather_coalesced_": 0}
_C10D_MESSAGE_ARG |= {"allgather_into_tensor_coalesced_": 0, "_reduce_scatter_base_": 1}
_C10D_MESSAGE_ARG |= {"reduce_scatter_": 1, "reduce_scatter_tensor_coalesced_": 1, "alltoall_": 1}
_C10D_MESSAGE_ARG |= {"alltoall_base_": 1, "gather_": 1, "scatter_": 0}


def tensor_bytes(value: Any) -> int:
    """Bytes of a tensor, or of the tensors in a (nested) list of them."""
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def _group_size(group: Any) -> int:
    if isinstance(group, str):  # a functional collective names its group
        return torch._C._distributed_c10d._resolve_process_group(group).size()
    if isinstance(group, dist.ProcessGroup):
        return group.size()
    return dist.ProcessGroup.unbox(group).size()  # the dispatcher's boxed ProcessGroup


def describe(func: Any, args: tuple) -> tuple[str, int, int] | None:
    """(kind, bytes, group size) of a dispatcher operation, or None when it is not communication."""
    namespace, name = func.namespace, func._overloadpacket._qualified_op_name.split("::")[-1]
    if namespace == "c10d" and name in _C10D:
        kind = _C10D[name]
        # (a barrier passes a one-byte tensor of its own: the caller passes none)
        message = 0 if kind == "barrier" else tensor_bytes(args[_C10D_MESSAGE_ARG.get(name, 0)])
        group = next(a for a in args[1:] if not torch.is_tensor(a) and not isinstance(a, (list, tuple)))
        return kind, message, _group_size(group)
    if namespace in ("_c10d_functional", "_c10d_functional_autograd") and name in _FUNCTIONAL:
        kind = _FUNCTIONAL[name]
        message = tensor_bytes(args[0])
        if kind == "all_gather":
            message *= args[1]  # (input, group_size, group): the gathered output
        return kind, message, _group_size(args[-1])
    return None


def run_eagerly() -> contextlib.AbstractContextManager:
    """Compiled code (--compile) run as eager code inside: dynamo does not trace under a dispatch mode,
    and a compiled block it met under one (the counted step, set-up's counting) it would run eagerly for
    good after (torch 2.13). `force_eager` keeps dynamo out of those frames (torch 2.6+; before it, a
    no-op). Where dynamo was never imported nothing is compiled: nothing to do, and no second of
    start-up spent importing it."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None or "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    return set_stance("force_eager")


class CountCommunication(TorchDispatchMode):
    """Within it, every communication operation this thread (and the autograd threads it starts) issues
    is added to `counts`: {kind: {"calls", "bytes", "bus_bytes"}}."""

    def __init__(self, counts: dict[str, dict] | None = None):
        super().__init__()
        self.counts = {} if counts is None else counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # A tensor subclass (DTensor) first turns its operation into plain ones, collectives among them:
        # those are the ones counted.
        # Fake tensors (DTensor's shape propagation, under FakeTensorMode) communicate nothing: run them
        # as they are (with this mode off), else no handler would take them.
        if any(issubclass(t, FakeTensor) for t in types):
            return func(*args, **(kwargs or {}))
        if any(t not in (torch.Tensor, torch.nn.Parameter) for t in types):
            return NotImplemented
        if isinstance(func, torch._ops.OpOverload) and (seen := describe(func, args)) is not None:
            add(self.counts, *seen)
        return func(*args, **(kwargs or {}))


class Traffic:
    """What this process communicates during a run, by phase: "setup" (from the process group to the
    first step), "step" (one steady-state optimizer step: the session's third), and the first "log",
    "eval" and "checkpoint". A phase is counted until another begins or counting stops; `counted_step` is
    the step counted, `not_counted` why none was (a session of fewer than 3 steps)."""

    def __init__(self) -> None:
        self.begin_run(count_setup=False)

    def begin_run(self, count_setup: bool = True) -> None:
        """A run begins (its process group exists): forget an earlier run's counts in this process (and
        stop counting, should that run have ended without saying so)."""
        if hasattr(self, "phases"):
            self.stop_counting()
        self.phases: dict[str, dict[str, dict]] = {}
        self.counted_step: int | None = None
        self.not_counted: str | None = None
        self._step_to_count: int | None = None
        self._mode: CountCommunication | None = None
        self._eager: contextlib.AbstractContextManager = contextlib.nullcontext()
        self.activations: SavedActivations | None = None
        self._hooks = None
        self._in_run = count_setup
        self._in_loop = False
        if count_setup:
            self._count("setup")

    def start(self, phase: str) -> None:
        """Count from now on as `phase` (unless it was counted already), ending the phase counted so far;
        only inside a run's loop (`session_starts` to `session_ends`): a checkpoint saved by other code
        (a test, a tool) starts nothing that would outlive it."""
        self.stop_counting()
        if self._in_loop:
            self._count(phase)

    def _count(self, phase: str) -> None:
        if phase not in self.phases:
            self._mode = CountCommunication(self.phases.setdefault(phase, {}))
            self._mode.__enter__()
            self._eager = run_eagerly()
            self._eager.__enter__()

    def stop_counting(self) -> None:
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)
        if self._mode is not None:
            mode, self._mode = self._mode, None
            self._eager.__exit__(None, None, None)
            mode.__exit__(None, None, None)

    @contextlib.contextmanager
    def counting(self, phase: str) -> Iterator[None]:
        """Count what runs inside as `phase` (the first time)."""
        self.start(phase)
        try:
            yield
        finally:
            self.stop_counting()

    def session_starts(self, start_step: int, n_steps: int) -> None:
        """Set-up ends and the loop runs steps `start_step` to `n_steps` - 1: the step to count is the
        session's third (COUNTED_SESSION_STEP); a session of fewer steps counts none, and `not_counted` says
        why (an earlier step's communication differs from the formulas': no step is better than a wrong one)."""
        if not self._in_run:  # a run without a process group (single, dataparallel)
            self.begin_run(count_setup=False)
        self.stop_counting()
        self._in_run = False  # (the next run in this process starts afresh)
        self._in_loop = True
        counted, steps = start_step + COUNTED_SESSION_STEP, max(n_steps - start_step, 0)
        self._step_to_count = counted if counted < n_steps else None
        plural = "" if steps == 1 else "s"
        self.not_counted = (
            f"a session of {steps} step{plural}: a session's third step is the one counted, its first steady one"
            if self._step_to_count is None
            else None
        )

    def session_ends(self) -> None:
        """The loop is over (or failed): nothing more is counted."""
        self.stop_counting()
        self._in_loop = False

    def run_ends(self) -> None:
        """The process group goes (the run is over, or ended before its loop: bad input): nothing more
        is counted, and a run without a process group in this process starts afresh."""
        self.session_ends()
        self._in_run = False

    def step_starts(self, step: int) -> None:
        self.stop_counting()
        if step == self._step_to_count and self._in_loop:
            self.counted_step = step
            self._count("step")
            # ... and the activations autograd holds for backward in that step (saved-tensor hooks: exact,
            # the same on any device; an impl's own hooks inside the step take precedence).
            self.activations = SavedActivations()
            self._hooks = torch.autograd.graph.saved_tensors_hooks(
                self.activations.pack, self.activations.unpack
            )
            self._hooks.__enter__()

    def summary(self) -> dict[str, Any]:
        """This rank's counts: {"step": the step counted or None, "phases": {phase: {kind: counts}},
        "activation_bytes": the most bytes of activations the counted step held for backward,
        "not_counted": why no step was counted, or None}."""
        held = self.activations.peak if self.activations is not None else None
        return {
            "step": self.counted_step,
            "phases": self.phases,
            "activation_bytes": held,
            "not_counted": self.not_counted,
        }


TRAFFIC = Traffic()  # this process's: the process group, the loop and checkpoints count into it
