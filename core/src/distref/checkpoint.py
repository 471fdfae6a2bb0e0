"""Checkpoints: written atomically, loaded with `weights_only=True`, resumable mid-epoch.

A checkpoint holds the model and optimizer state, the grad scaler, the optimizer step reached, the RNG
state and the run record's history. Because the data order is a pure function of (seed, step), resuming
at step t replays exactly the batches an uninterrupted run would have used: the resumed run ends with
the same parameters.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from distref.config import RunConfig

CHECKPOINT_NAME = re.compile(r"^step-(\d{8})\.pt$")
# Options that fix the model, the data order or the optimizer: a checkpoint cannot resume a run that
# differs in any of them.
MUST_MATCH = ("model", "dataset", "global_batch_size", "seed", "optimizer", "lr_schedule", "precision")


class CheckpointError(RuntimeError):
    pass


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}.pt"


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> Path:
    """Write to a temporary file in the same folder, then rename: a crash mid-write never leaves a
    truncated file under a checkpoint's name (rename is atomic on POSIX)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint in `directory` (temporary files never match the name)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found = sorted(p for p in directory.iterdir() if CHECKPOINT_NAME.match(p.name))
    return found[-1] if found else None


def resume_path(cfg: RunConfig) -> Path | None:
    if cfg.resume is None:
        return None
    if cfg.resume == "auto":
        return latest_checkpoint(cfg.checkpoint_dir)
    return Path(cfg.resume)


def load_checkpoint(path: str | Path, cfg: RunConfig) -> dict[str, Any]:
    """Load on CPU with `weights_only=True` (no arbitrary code from a pickle) and check that the
    checkpoint belongs to a run with the same model, data order and optimizer."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot load checkpoint {path}: {exc}") from exc
    saved = state.get("config", {})
    current = cfg.to_dict()
    different = [k for k in MUST_MATCH if saved.get(k) != current[k]]
    if different:
        diffs = ", ".join(f"--{k.replace('_', '-')} {saved.get(k)} vs {current[k]}" for k in different)
        raise CheckpointError(f"checkpoint {path} is from a different run ({diffs})")
    return state
