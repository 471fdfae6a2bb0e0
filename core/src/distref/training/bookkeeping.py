"""What every train.py's loop does besides training, in a few lines: when logging, evaluation and
checkpoints are due (`Cadence`), and where each step's numbers go (`StepLog`: the record, the progress
bar, TensorBoard, the divergence check).

The loop itself (forward, backward, optimizer step, every collective) stays in the impl's train.py.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from distref.config import RunConfig
from distref.models import ROUTING
from distref.record import RunRecord
from distref.training.monitor import progress_bar, tensorboard_writer
from distref.training.steps import stop_if_diverged
from distref.training.traffic import TRAFFIC


@dataclasses.dataclass(frozen=True)
class Due:
    """What is due after a step: `done` steps are done (the loop's `step` index + 1)."""

    done: int
    log: bool  # the pending losses go to the record (and the bar, TensorBoard)
    eval: bool  # score the test set
    checkpoint: bool  # write a checkpoint
    last: bool  # the run's last step


class Cadence:
    """When logging, evaluation and checkpoints are due: evaluation every --eval-every steps (else every
    epoch) and at the last step, a checkpoint every --checkpoint-every steps, the losses every --log-every
    steps and before each of those (so that a diverged loss stops the run before anything is written)."""

    def __init__(self, cfg: RunConfig, n_steps: int, epoch_steps: int):
        self.cfg, self.n_steps, self.epoch_steps = cfg, n_steps, epoch_steps

    def after(self, step: int) -> Due:
        cfg, done = self.cfg, step + 1
        last = done == self.n_steps
        evaluate = last or (done % cfg.eval_every == 0 if cfg.eval_every else done % self.epoch_steps == 0)
        checkpoint = bool(cfg.checkpoint_every) and done % cfg.checkpoint_every == 0
        log = done % cfg.log_every == 0 or evaluate or checkpoint or last
        return Due(done, log, evaluate, checkpoint, last)


class StepClock:
    """Each step's time. On the CPU, the host's clock. On CUDA, two events on the stream around the step,
    read when the losses are logged (`times`): the host never waits for the GPU to time a step, and keeps
    queueing the next one. `sync` (--step-timing sync, a diagnostic) waits for the GPU after every step
    instead and reads the host's clock: the time the host saw, waits included."""

    def __init__(self, device: torch.device | None, sync: bool = False):
        cuda = device is not None and device.type == "cuda"
        self.events, self.wait_for = cuda and not sync, device if cuda and sync else None
        self.pending: list[float | tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def start(self) -> float | torch.cuda.Event:
        if not self.events:
            return time.perf_counter()
        started = torch.cuda.Event(enable_timing=True)
        started.record()
        return started

    def stop(self, started: float | torch.cuda.Event) -> float | None:
        """The step begun at `started` is done (its work queued): its time on the host's clock, or None
        for events, which `times` reads."""
        if self.events:
            done = torch.cuda.Event(enable_timing=True)
            done.record()
            self.pending.append((started, done))
            return None
        if self.wait_for is not None:
            torch.cuda.synchronize(self.wait_for)
        self.pending.append(time.perf_counter() - started)
        return self.pending[-1]

    def times(self) -> list[float]:
        """The seconds of each step stopped since the last call (waiting for the last one's events)."""
        seconds = []
        for entry in self.pending:
            if isinstance(entry, tuple):
                started, done = entry
                done.synchronize()
                entry = started.elapsed_time(done) / 1000  # milliseconds
            seconds.append(entry)
        self.pending = []
        return seconds


class StepLog:
    """Where each step's numbers go. A step's loss stays a device tensor until logging is due (no host
    sync per step); then all pending losses reach the host at once, go into the record, the progress bar
    and TensorBoard, and a nan/inf among them stops the run (exit 1: `stop_if_diverged`).

    Used as a context manager around the loop: a run that fails inside says so in its record (and why),
    keeping every file already written; the bar and TensorBoard are closed on every exit path."""

    def __init__(
        self,
        record: RunRecord,
        cfg: RunConfig,
        impl: str,
        cadence: Cadence,
        start_step: int,
        show: bool = True,
        desc: str | None = None,
        device: torch.device | None = None,
    ):
        """`show`: this process draws the bar and writes TensorBoard (rank 0 of several). `device`: where
        the steps compute, timed there (`StepClock`; none: the host's clock, the loop waits itself)."""
        self.record, self.cfg, self.impl, self.cadence = record, cfg, impl, cadence
        self.clock = StepClock(device, sync=cfg.step_timing == "sync")
        self.bar = progress_bar(cadence.n_steps, start_step, enabled=show, desc=desc or impl)
        self.tensorboard = tensorboard_writer(cfg, enabled=show)
        self.losses: list[torch.Tensor] = []  # per-step losses not yet in the record
        # A mixture of experts' routing, per step: (tokens per expert, layers × E; the balance loss)
        self.routing: list[tuple[torch.Tensor, torch.Tensor]] = []
        ROUTING.take()  # (what set-up's forwards routed is not a step's)
        TRAFFIC.session_starts(start_step, cadence.n_steps)  # set-up's communication ends here

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        TRAFFIC.session_ends()
        if exc is not None:  # the record says the run failed, and why; nothing written is lost
            self.record.fail(f"{type(exc).__name__}: {exc}")
        else:  # this rank's communication; distref.distributed.finish_record gathers every rank's
            self.record.set_communication([TRAFFIC.summary()])
        self.bar.close()
        self.tensorboard.close()

    def step_starts(self, step: int) -> float | torch.cuda.Event:
        """A step begins (its time is measured from what this returns); the session's third step has its
        communication counted (distref.training.traffic)."""
        TRAFFIC.step_starts(step)
        return self.clock.start()

    def step_done(self, loss: torch.Tensor, started: float | torch.cuda.Event) -> float | None:
        """After a step: its loss, as a tensor, and its time since `started`, which it returns where the
        host's clock measured it (None: CUDA events, read at the next `flush`)."""
        TRAFFIC.stop_counting()
        self.losses.append(loss)
        if (routed := ROUTING.take()) is not None:
            self.routing.append(routed)
        self.bar.update(1)
        return self.clock.stop(started)

    def flush(self, done: int, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """The pending losses into the record, `done` steps being done. `reduce` turns this rank's losses
        (one tensor, one entry per step) into the run's, e.g. their mean over the ranks; with a mixture of
        experts, its sum: each step's routing (tokens per expert, the balance loss) goes with the losses,
        one row a step, summed over the ranks in the same call."""
        pending = torch.stack(self.losses)
        if (
            self.routing
        ):  # [loss, balance loss, tokens per expert (layers × E)] a step, in fp64 (exact counts)
            pending = torch.stack(
                [
                    torch.cat(
                        [loss.reshape(1).double(), balance.reshape(1).double(), counts.flatten().double()]
                    )
                    for loss, (counts, balance) in zip(self.losses, self.routing, strict=True)
                ]
            )
        with TRAFFIC.counting("log"):  # (the first time: what logging adds to communication)
            rows = (reduce(pending) if reduce else pending).tolist()
        losses = [row[0] for row in rows] if self.routing else rows
        routing = None
        if self.routing:
            layers, experts = self.routing[0][0].shape
            routing = [
                {"balance_loss": row[1], "tokens_per_expert": _table(row[2:], layers, experts)}
                for row in rows
            ]
            self.routing = []
        first = done - len(losses)
        self.record.add_steps(first, losses, self.clock.times(), routing)
        stop_if_diverged(losses, first, self.cfg, self.impl)  # nan/inf: exit 1
        self.bar.set_postfix(loss=f"{losses[-1]:.4f}")
        self.tensorboard.add_scalar("train/loss", losses[-1], done)
        self.losses = []

    def eval_starts(self) -> float:
        """An evaluation begins (its time is measured from what this returns); the first has its
        communication counted."""
        TRAFFIC.start("eval")
        return time.perf_counter()

    def evaluated(self, done: int, totals: torch.Tensor, started: float) -> None:
        """An evaluation's [loss sum, correct, count] (`evaluate`, summed over ranks where they split the
        test set), begun at `started`, into the record, the bar and TensorBoard."""
        TRAFFIC.stop_counting()
        loss_sum, correct, count = totals
        accuracy, loss = (correct / count).item(), (loss_sum / count).item()
        epoch = done / self.cadence.epoch_steps
        self.record.add_eval(done, epoch, accuracy, loss, time.perf_counter() - started)
        n_steps = self.cadence.n_steps
        self.bar.write(f"{self.impl}: step {done}/{n_steps} test accuracy {accuracy:.4f} loss {loss:.4f}")
        self.tensorboard.add_scalar("test/accuracy", accuracy, done)


def _table(values: list[float], rows: int, columns: int) -> list[list[int]]:
    return [[round(v) for v in values[r * columns : (r + 1) * columns]] for r in range(rows)]
