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
    ):
        """`show`: this process draws the bar and writes TensorBoard (rank 0 of several)."""
        self.record, self.cfg, self.impl, self.cadence = record, cfg, impl, cadence
        self.bar = progress_bar(cadence.n_steps, start_step, enabled=show, desc=desc or impl)
        self.tensorboard = tensorboard_writer(cfg, enabled=show)
        self.losses: list[torch.Tensor] = []  # per-step losses not yet in the record
        self.times: list[float] = []
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

    def step_starts(self, step: int) -> float:
        """A step begins (its time is measured from what this returns); the session's third step has its
        communication counted (distref.training.traffic)."""
        TRAFFIC.step_starts(step)
        return time.perf_counter()

    def step_done(self, loss: torch.Tensor, started: float) -> float:
        """After a step (and its device sync): its loss, as a tensor, and its time since `started`, which
        it returns."""
        TRAFFIC.stop_counting()
        self.times.append(time.perf_counter() - started)
        self.losses.append(loss)
        self.bar.update(1)
        return self.times[-1]

    def flush(self, done: int, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """The pending losses into the record, `done` steps being done. `reduce` turns this rank's losses
        (one tensor, one entry per step) into the run's, e.g. their mean over the ranks."""
        pending = torch.stack(self.losses)
        with TRAFFIC.counting("log"):  # (the first time: what logging adds to communication)
            losses = (reduce(pending) if reduce else pending).tolist()
        first = done - len(losses)
        self.record.add_steps(first, losses, self.times)
        stop_if_diverged(losses, first, self.cfg, self.impl)  # nan/inf: exit 1
        self.bar.set_postfix(loss=f"{losses[-1]:.4f}")
        self.tensorboard.add_scalar("train/loss", losses[-1], done)
        self.losses, self.times = [], []

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
