"""Pieces of a training step that are the same for every strategy: device, threads, optimizer,
precision, loss/accuracy and evaluation. The loop itself stays in each impl's train.py, in plain view."""

from __future__ import annotations

import contextlib
import os
import random

import torch
import torch.nn.functional as F
from torch import nn

from distref.config import RunConfig
from distref.data import IGNORE_INDEX


def configure_cpu_threads(processes_on_this_machine: int = 1) -> int:
    """Give each process its share of the cores (OMP_NUM_THREADS wins if set).

    Several processes each running a full-width OpenMP pool on the same cores spin-wait against each
    other; on a 2-core box two ranks with two threads each were 5-8× slower than with one each.
    """
    if "OMP_NUM_THREADS" in os.environ:
        threads = int(os.environ["OMP_NUM_THREADS"])
    else:
        threads = max(1, (os.cpu_count() or 1) // processes_on_this_machine)
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


def make_lr_schedule(cfg: RunConfig, optimizer: torch.optim.Optimizer, total: int):
    """Step once per optimizer step. `cosine` decays from --lr to 0 over the run: with a constant lr the
    final accuracy swings with the data order (lenet/MNIST, 2 epochs: 98.2% to 98.9% over 3 seeds)."""
    if cfg.lr_schedule == "constant":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)


def autocast(cfg: RunConfig, device: torch.device):
    """Mixed precision for forward + loss: bf16 autocast on CPU or CUDA, fp16 autocast on CUDA."""
    if cfg.precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_grad_scaler(cfg: RunConfig, device: torch.device) -> torch.amp.GradScaler:
    """fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none.
    A disabled scaler is a no-op, so the loop is the same for every precision."""
    return torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every scored target (class labels, or tokens other than IGNORE_INDEX)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE_INDEX)


@torch.no_grad()
def evaluate(model: nn.Module, batches, device: torch.device, cfg: RunConfig) -> torch.Tensor:
    """Sum of loss, correct predictions and scored targets over `batches`, as one float64 tensor
    [loss_sum, correct, count] on `device`, so that ranks can all-reduce it in one call."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(cfg, device):
            logits = model(x)
        flat_logits, flat_y = logits.flatten(0, -2).float(), y.flatten()
        scored = flat_y != IGNORE_INDEX
        totals[0] += F.cross_entropy(flat_logits, flat_y, ignore_index=IGNORE_INDEX, reduction="sum")
        totals[1] += (flat_logits.argmax(-1) == flat_y)[scored].sum()
        totals[2] += scored.sum()
    model.train(was_training)
    return totals


def unwrap_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The core model's full fp32 state_dict on CPU, whatever wrapper (DDP, DataParallel) holds it."""
    inner = getattr(model, "module", model)
    return {
        k: v.detach().float().cpu().clone() if v.is_floating_point() else v.cpu().clone()
        for k, v in inner.state_dict().items()
    }


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a step's measured time is the step's (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
