"""Pieces of a training step that are the same for every strategy: device, threads, optimizer,
precision, loss/accuracy and evaluation. The loop itself stays in each impl's train.py, in plain view."""

from __future__ import annotations

import contextlib
import math
import os
import random
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from distref.config import RunConfig, is_first_rank
from distref.data import IGNORE_INDEX


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
    """One device per process: cuda:<local_rank> when CUDA is wanted and present, else the CPU."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:  # numpy is optional (only some datasets need it)
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def total_steps(cfg: RunConfig, num_train_samples: int) -> int:
    from distref.data import steps_per_epoch

    if cfg.steps is not None:
        return cfg.steps
    return cfg.epochs * steps_per_epoch(num_train_samples, cfg.global_batch_size)


def make_optimizer(cfg: RunConfig, params) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def lr_factor(schedule: str, step: int, total: int) -> float:
    """The lr at optimizer step `step` of a `total`-step run, as a fraction of --lr."""
    if schedule == "constant":
        return 1.0
    return 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))  # cosine: from --lr to 0


def make_lr_schedule(
    cfg: RunConfig, optimizer: torch.optim.Optimizer, total: int, start_step: int = 0
) -> torch.optim.lr_scheduler.LambdaLR:
    """Step once per optimizer step. The lr is a pure function of (step, run length): a resumed run builds
    the schedule at the step it resumes from (after loading the optimizer) and has no scheduler state to
    restore or to get wrong; a run resumed with more steps re-plans its cosine over the new length.

    `cosine` (the default) decays from --lr to 0 over the run: with a constant lr the final accuracy swings
    with the data order (lenet/MNIST, 2 epochs: 98.2% to 98.9% over 3 seeds)."""
    # The schedule's base is --lr, not whatever a loaded optimizer state holds (DCP's sharded load, as
    # impls/fsdp does it, fills only the keys of a fresh optimizer's state, which has no initial_lr yet).
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.lr
    # last_epoch = start_step - 1: the scheduler's own first step sets the lr of step `start_step`.
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(cfg.lr_schedule, step, total), last_epoch=start_step - 1
    )


def param_dtype(cfg: RunConfig) -> torch.dtype:
    """The parameters' dtype: float64 under --precision fp64, else float32 (bf16/fp16 are autocast over
    fp32 parameters). In fp64 the rounding that a different summation order leaves (~1e-16 instead of
    ~1e-7) stays negligible even after AdamW normalises tiny gradients: parity holds for any optimizer,
    world size and accumulation."""
    return torch.float64 if cfg.precision == "fp64" else torch.float32


def autocast(cfg: RunConfig, device: torch.device):
    """Mixed precision for forward + loss: bf16 autocast on CPU or CUDA, fp16 autocast on CUDA."""
    if cfg.precision in ("fp32", "fp64"):
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_grad_scaler(cfg: RunConfig, device: torch.device) -> torch.amp.GradScaler:
    """fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none.
    A disabled scaler is a no-op, so the loop is the same for every precision."""
    return torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 logits widened to fp32 for the loss (fp64 stays fp64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


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
            message = (
                f"{prog}: error: the loss is {loss} at step {first_step + i + 1}: training diverged; {hint}. "
                "Checkpoints from before it are kept"
            )
            raise TrainingDiverged(message if is_first_rank() else 1)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every scored target (class labels, or tokens other than IGNORE_INDEX)."""
    return F.cross_entropy(at_least_fp32(logits.flatten(0, -2)), targets.flatten(), ignore_index=IGNORE_INDEX)


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


def model_state_bytes(parameters: Iterable[nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of model state held for `parameters`, measured on the tensors: the parameters, their
    gradients and their optimizer state (AdamW: two moments and a step count per tensor). Call once
    both exist (after an optimizer step, before zero_grad). Communication buffers (DDP's buckets) and
    activations are not model state: peak memory covers them."""
    params = list(parameters)
    return {
        "parameters": sum(held_bytes(p) for p in params),
        "gradients": sum(held_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            held_bytes(t) for p in params for t in optimizer.state.get(p, {}).values() if torch.is_tensor(t)
        ),
    }


def held_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of `tensor`: of a DTensor (FSDP's shards), its local part only."""
    # (DTensor is not imported to test isinstance: importing torch.distributed.tensor costs every process
    # ~0.4 s, and only DTensor has to_local.)
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def unwrap_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The core model's full state_dict on CPU (fp32; fp64 under --precision fp64), whatever wrapper (DDP,
    DataParallel) holds it."""
    inner = getattr(model, "module", model)
    return {
        k: at_least_fp32(v.detach()).cpu().clone() if v.is_floating_point() else v.cpu().clone()
        for k, v in inner.state_dict().items()
    }


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a step's measured time is the step's (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
