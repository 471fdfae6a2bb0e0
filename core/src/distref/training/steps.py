"""The loss, the accuracy, evaluation, and what the loop does with each step's numbers."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from distref.config import RunConfig, is_first_rank
from distref.data.tensors import IGNORE_INDEX
from distref.training.device import at_least_fp32, autocast


class TrainingDiverged(SystemExit):
    """The loss became nan or inf. Nothing trained after that can be trusted, so the run stops: a
    SystemExit, i.e. exit code 1 and one line (the message), not a traceback; the except block of the
    loop has recorded the failure, and every checkpoint written before it is kept."""


def stop_if_diverged(losses: list[float], first_step: int, cfg: RunConfig, prog: str) -> None:
    """Stop the run at the first non-finite loss of `losses` (optimizer steps first_step, first_step+1,
    ...). Called where the losses reach the CPU anyway (every --log-every steps, and before every
    evaluation and checkpoint): no checkpoint or final model is written after a diverged step, and no
    step pays for a device sync. Under torchrun every rank sees the same (all-reduced) losses and stops at
    the same place, and rank 0 alone says why."""
    for i, loss in enumerate(losses):
        if not math.isfinite(loss):
            hint = f"lower --lr (now {cfg.lr:g})"
            if cfg.precision in ("bf16", "fp16"):
                hint += f", or train in fp32 (now --precision {cfg.precision})"
            if first_step + i == 0:  # the first step's loss comes before any update: not the lr's doing
                hint = "the model gives it from its initial parameters, before any update: check its forward"
            message = (
                f"{prog}: error: the loss is {loss} at step {first_step + i + 1}: training diverged; {hint}. "
                "Checkpoints from before it are kept"
            )
            raise TrainingDiverged(message if is_first_rank() else 1)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every scored target (class labels, or tokens other than IGNORE_INDEX) of
    this one batch. Training divides `loss_sum` by the whole global batch's count instead (see there)."""
    return F.cross_entropy(at_least_fp32(logits.flatten(0, -2)), targets.flatten(), ignore_index=IGNORE_INDEX)


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over every scored target of a (micro-)batch. Each impl divides it by the global
    batch's count of scored targets (`distref.data.scored_targets`): the step's loss is then the mean over
    the whole global batch, however it is split, as the mean of per-micro-batch or per-rank means is not
    when the micro-batches score different numbers of targets (padding, prompts, masked tokens)."""
    flat_logits, flat_targets = at_least_fp32(logits.flatten(0, -2)), targets.flatten()
    return F.cross_entropy(flat_logits, flat_targets, ignore_index=IGNORE_INDEX, reduction="sum")


def score(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[loss sum, correct predictions, scored targets] of one batch, as a float64 tensor on the logits'
    device: sums, so that batches, shards and ranks add up (and all-reduce in one call)."""
    flat_logits, flat_targets = at_least_fp32(logits.flatten(0, -2)), targets.flatten()
    scored = flat_targets != IGNORE_INDEX
    return torch.stack(
        [
            F.cross_entropy(flat_logits, flat_targets, ignore_index=IGNORE_INDEX, reduction="sum").double(),
            (flat_logits.argmax(-1) == flat_targets)[scored].sum().double(),
            scored.sum().double(),
        ]
    )


@torch.no_grad()
def evaluate(model: nn.Module, batches, device: torch.device, cfg: RunConfig) -> torch.Tensor:
    """Sum of `score` over `batches`: [loss_sum, correct, count] as one float64 tensor on `device`."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(cfg, device):
            logits = model(x)
        totals += score(logits, y)
    model.train(was_training)
    return totals
