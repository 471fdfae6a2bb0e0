"""Checkpoints: written atomically, loaded with `weights_only=True`, resumable mid-epoch.

A checkpoint holds the model and optimizer state, the grad scaler, the optimizer step reached, the run's
length, the RNG state, the run record's history and the run's options. Because the data order and the lr
are pure functions of (seed, step), resuming at step t replays exactly the batches and learning rates an
uninterrupted run would have used: the resumed run ends with the same parameters.

What each option may do on resume (the README's table): options in MUST_MATCH are refused when they differ;
the run's length may grow (a cosine schedule is then re-planned over the new length, and the console and
record say so) but may not end before the checkpoint's step; every other option applies from the resumed
step on and the record lists it under `resumes`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distref.config import RUN_DEFINING_OPTIONS, RunConfig, defining_value, is_factory, is_first_rank
from distref.models import own_model
from distref.training.device import at_least_fp32
from distref.training.optim import lr_factor
from distref.training.traffic import TRAFFIC

CHECKPOINT_NAME = re.compile(r"^step-(\d{8})\.pt$")
# A checkpoint's files: its index step-N.pt, pipeline's step-N.<part>.pt beside it, a folder step-N/
CHECKPOINT_FILE = re.compile(r"^step-\d{8}(\..+)?\.pt$")
CHECKPOINT_FOLDER = re.compile(r"^step-\d{8}$")
# A checkpoint cannot continue a run that differs in any option that defines it. (A new --lr or
# --weight-decay would otherwise be overridden by the optimizer state in the checkpoint while the record
# claimed it.)
MUST_MATCH = RUN_DEFINING_OPTIONS
NOT_COMPARED = ("resume",)  # how this session was started, not what the run is


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


def checkpoints(directory: str | Path) -> list[Path]:
    """The complete checkpoints in `directory`, oldest first (temporary files never match the name)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if CHECKPOINT_NAME.match(p.name))


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint in `directory`."""
    found = checkpoints(directory)
    return found[-1] if found else None


def checkpoint_problem(path: str | Path) -> str | None:
    """Why checkpoint `path`, or a file written beside it for it (pipeline's step-N.<part>.pt), cannot be
    read; None if all can. torch.save writes a zip archive: a truncated file has no central directory and
    a corrupted one fails a member's CRC, both found by reading the bytes, without unpickling anything."""
    path = Path(path)
    for file in [path, *sorted(path.parent.glob(f"{path.stem}.*.pt"))]:
        try:
            with zipfile.ZipFile(file) as archive:
                corrupt = archive.testzip()
        except (OSError, zipfile.BadZipFile, EOFError) as exc:
            return f"{file} is unreadable ({exc})"
        if corrupt is not None:
            return f"{file} is corrupt ({corrupt} fails its CRC check)"
    return None


def holds_a_run(state: Any) -> bool:
    """Whether a loaded file is a checkpoint (a run's step and options), not a --save-final state_dict."""
    return isinstance(state, dict) and {"step", "config"} <= set(state)


def not_a_checkpoint(path: Path) -> str | None:
    """Why the readable file `path`, named as a checkpoint, is not one (a --save-final state_dict copied
    in: parameters only), or None. Read with mmap: the tensors' bytes stay on disk."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # (torch's errors can run to a page)
        return f"{path} cannot be loaded ({str(exc).strip().splitlines()[0]})"
    if not holds_a_run(state):
        return f"{path} is not a checkpoint (parameters only, as --save-final writes)"
    return None


def resume_path(cfg: RunConfig) -> Path | None:
    """The checkpoint to resume from: --resume PATH (checked readable by the config), or for `auto` the
    newest readable one in --checkpoint-dir (None if there is none yet: the run starts). An unreadable
    newer one (a disk error, a copy cut short) or one that is no checkpoint is skipped and rank 0 says so;
    if none is readable, the run stops in one line rather than silently starting over."""
    if cfg.resume is None:
        return None
    if cfg.resume != "auto":
        return Path(cfg.resume)
    say = is_first_rank()
    problems = []
    for path in reversed(checkpoints(cfg.checkpoint_dir)):
        if (problem := checkpoint_problem(path) or not_a_checkpoint(path)) is None:
            if problems and say:
                print(f"--resume auto: {'; '.join(problems)}: falling back to {path}", flush=True)
            return path
        problems.append(problem)
    if problems:
        if say:
            sys.stderr.write(
                f"error: --resume auto: no readable checkpoint in {cfg.checkpoint_dir} ({'; '.join(problems)}); "
                "move them away to start over\n"
            )
        sys.exit(2)
    return None


def options(config: dict[str, Any]) -> dict[str, Any]:
    """A run's options as one flat dict: core options and the impl's own (`extra`) side by side."""
    flat = {k: v for k, v in config.items() if k != "extra"}
    flat.update(config.get("extra", {}))
    return flat


COMMON_KEYS = ("step", "total_steps", "rng", "record", "config")  # in every checkpoint (checkpoint_state)
NOT_RECORDED = "not recorded"  # the impl of a checkpoint written before core 0.20.0
# What a sharded checkpoint's index says of its files (save_sharded_checkpoint, deepspeed_zero's index),
# checked by the loaders that read them, not a layout of the state
INDEX_KEYS = {"folder", "sha256", "world_size", "optimizer_by_parameter_name", "zero_stage"}
# Checkpoint formats an impl no longer reads: a key only that format's index holds, and what to do.
RETIRED_FORMATS = {
    "stage_sha256": "pipeline before 0.10.0 wrote a file per stage rank; it now writes a "
    "torch.distributed.checkpoint folder keyed by parameter name: finish this run with pipeline 0.9, or start "
    "it again",
}


def load_checkpoint(
    path: str | Path, cfg: RunConfig, total_steps: int, holds: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Load on CPU with `weights_only=True` (no arbitrary code from a pickle), check that it is a
    checkpoint in the impl's format (`holds`: the keys the impl reads from it, which another impl's
    checkpoint or a --save-final state_dict lacks) that can continue this run (MUST_MATCH, and a length
    that does not end before it), and add `state["changes"]`: {option: [in the checkpoint, now]} for every
    option this session changes."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # the first line: torch's errors can run to a page
        raise CheckpointError(f"cannot load checkpoint {path}: {str(exc).strip().splitlines()[0]}") from exc
    if not holds_a_run(state):
        raise CheckpointError(
            f"{path} is not a checkpoint (a --save-final file holds parameters only): resume from "
            "--checkpoint-dir's step-N.pt"
        )
    if retired := [why for key, why in RETIRED_FORMATS.items() if key in state]:
        raise CheckpointError(f"checkpoint {path} is in a format this version no longer reads: {retired[0]}")
    whose = f"{state['impl']['name']}'s" if "impl" in state else "another impl's"
    if missing := [key for key in holds if key not in state]:
        own = sorted(set(state) - set(COMMON_KEYS) - {"impl"}) or ["nothing else"]
        raise CheckpointError(
            f"checkpoint {path} is {whose} (it holds {', '.join(own)}, not {', '.join(missing)}): "
            "resume it with the impl that wrote it"
        )
    # A state this impl reads all of, and more that it does not (model_parallel's parts and their cut
    # beside single's keys; pipeline's stages beside fsdp's): another layout, not another run of its own.
    if holds and (foreign := sorted(set(state) - set(COMMON_KEYS) - {"impl"} - set(holds) - INDEX_KEYS)):
        raise CheckpointError(
            f"checkpoint {path} is {whose} (it holds {', '.join(foreign)}, which this impl does not read): "
            "resume it with the impl that wrote it"
        )
    # Options a checkpoint predates (e.g. gpt_layers, added in core 0.3.0) had their default value then.
    defaults = options(RunConfig().to_dict())
    saved, current = {**defaults, **options(state.get("config", {}))}, options(cfg.to_dict())
    different = [k for k in MUST_MATCH if defining_value(saved, k) != defining_value(current, k)]
    if different:
        diffs = ", ".join(
            f"--{k.replace('_', '-')} {defining_value(saved, k)} vs {defining_value(current, k)}"
            for k in different
        )
        raise CheckpointError(f"checkpoint {path} is from a different run ({diffs})")
    if "model" in state and (changed := own_model_changed(cfg.model, state["model"])):
        raise CheckpointError(
            f"checkpoint {path} holds another model than --model {cfg.model} builds now ({changed}): the "
            "function changed since the checkpoint was written"
        )
    if state["step"] > total_steps:
        raise CheckpointError(
            f"checkpoint {path} is at step {state['step']}, past the end of this run ({total_steps} steps): "
            f"ask for at least {state['step']} steps"
        )
    changes = {
        k: [saved.get(k), v] for k, v in current.items() if k not in NOT_COMPARED and saved.get(k) != v
    }
    if state.get("total_steps", total_steps) != total_steps:
        changes["total_steps"] = [state["total_steps"], total_steps]
    state["changes"] = changes
    return state


def own_model_changed(name: str, saved: dict[str, torch.Tensor]) -> str | None:
    """For a model of yours: the first parameter or buffer whose name or shape differs between a
    checkpoint's full state_dict `saved` and what the function builds now (on the meta device: no
    memory), or None. (This project's models change only with a version, which the record names.)"""
    if not is_factory(name) or not isinstance(saved, dict):
        return None
    with torch.device("meta"):
        now = {k: tuple(v.shape) for k, v in own_model(name).state_dict().items()}
    before = {k: tuple(v.shape) for k, v in saved.items() if isinstance(v, torch.Tensor)}
    # (a checkpoint of model_parallel holds its rank's parts: what it holds must be as built now)
    if gone := sorted(before.keys() - now.keys()):
        return f"it holds {gone[0]}, which the model has no more"
    return next(
        (f"{k}: {list(before[k])} then, {list(now[k])} now" for k in before if now[k] != before[k]), None
    )


def describe_resume(path: str | Path, state: dict[str, Any]) -> str:
    """One line for the console: where the run continues, and what this session changes."""
    step, changes = state["step"], state["changes"]
    line = f"resumed from {path} at step {step}"
    shown = {k: v for k, v in changes.items() if k not in ("epochs", "steps")}  # total_steps says it
    if shown:
        line += "; changed: " + ", ".join(f"{k} {was} -> {now}" for k, (was, now) in shown.items())
    schedule = state["config"]["lr_schedule"]
    if "total_steps" in changes and schedule != "constant":
        was, now = changes["total_steps"]
        lr = state["config"]["lr"]
        before, after = lr * lr_factor(schedule, step, was), lr * lr_factor(schedule, step, now)
        line += f"; the {schedule} lr schedule is re-planned over {now} steps: lr {before:.3g} -> {after:.3g}"
    return line


# ---- sharded checkpoints (deepspeed_zero, fsdp): a folder of files beside an index step-N.pt ----------


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def folder_hashes(folder: Path) -> dict[str, str]:
    """The sha256 of every file in `folder`, a sharded checkpoint just written, for its index."""
    return {f.name: file_sha256(f) for f in sorted(folder.iterdir())}


def check_listed_files(index: Path, folder: Path, sha256: dict[str, str], whole_folder: bool = True) -> None:
    """Each file the index `index` lists ({name: sha256}) is in `folder` as it was written: not missing,
    not one copied in from another run or left by a crash before the index was written. With
    `whole_folder`, the folder is the checkpoint's own (a sharded checkpoint's) and holds nothing else;
    pipeline's stage files lie beside other checkpoints' (False). The loaders of sharded folders unpickle
    what they read (DeepSpeed's load_checkpoint: every mp_rank_*_model_states.pt it globs; DCP: its
    .metadata), so this runs before them, in the function that calls them (core/tests/test_security.py
    checks that)."""
    if not sha256:
        raise CheckpointError(f"checkpoint {index} lists no files to verify")
    if (
        whole_folder
        and folder.is_dir()
        and (unlisted := sorted({f.name for f in folder.iterdir()} - set(sha256)))
    ):
        raise CheckpointError(f"checkpoint folder {folder} holds files its index does not list: {unlisted}")
    for name, digest in sha256.items():
        file = folder / name
        if not file.is_file() or file_sha256(file) != digest:
            raise CheckpointError(
                f"checkpoint file {file} is missing or not the one written (sha256 differs)"
            )


# Sharded checkpoints of DTensor models (impls/fsdp, impls/tensor_parallel) with torch.distributed.checkpoint
# (DCP): each rank writes and reads only its own shards, and DCP reshards on load (any world size or mesh).
def save_sharded_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    index: Path,
    state: dict[str, Any],
    is_main: bool,
    by_parameter_name: bool = False,
) -> None:
    """Every rank writes its shards of the model and optimizer state into the folder `index` names (without
    `.pt`); after a barrier, rank 0 writes `state` (step, record, RNG, ...) with the folder's name and the
    sha256 of every file in it as the index, atomically. DCP writes in place: the index is what makes the
    set complete, so a crash mid-save leaves the previous index the newest and `--resume auto` never sees
    the half-written folder. A collective: every rank calls it. `by_parameter_name`: the optimizer's
    state keyed by parameter name too, not by its place in the optimizer (impls/pipeline: ranks holding
    other parameters, a later run cutting the model elsewhere)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    folder = index.parent / index.stem
    # DTensor shards, nothing gathered
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_options(by_parameter_name))
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)
    dist.barrier()  # every rank's files are written before the index says the set is complete
    if is_main:
        # DCP's .metadata is a pickle, read with pickle.load: the hashes taken now are checked on resume
        # before anything is read.
        listed = {"folder": folder.name, "world_size": dist.get_world_size(), "sha256": folder_hashes(folder)}
        listed["optimizer_by_parameter_name"] = by_parameter_name  # (how load_sharded_checkpoint reads it)
        save_checkpoint(index, {**state, **listed})


def load_sharded_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    index: Path,
    state: dict[str, Any],
    by_parameter_name: bool = False,
) -> None:
    """Check the folder beside `index` against the hashes `state` (the index, loaded) lists
    (CheckpointError), then load this rank's shards of the model and optimizer state in place (keyed as
    `save_sharded_checkpoint` wrote them). A parameter no loss reached (unused: no gradient, so no
    optimizer state when it was saved) has none after the load either."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    folder = index.parent / state.get("folder", "")
    if state.get("optimizer_by_parameter_name", False) != by_parameter_name:
        keyed = "by parameter name (impls/pipeline's)" if by_parameter_name is False else "by its place"
        raise CheckpointError(
            f"checkpoint {index} is another impl's (its optimizer state is keyed {keyed}): resume it with the "
            "impl that wrote it"
        )
    check_listed_files(index, folder, state.get("sha256", {}))
    options = _options(by_parameter_name)
    init_saved_optimizer_state(
        model, optimizer, set(dcp.FileSystemReader(folder).read_metadata().state_dict_metadata)
    )
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)  # to fill
    sharded = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(sharded, checkpoint_id=folder)
    set_model_state_dict(model, sharded["model"], options=options)
    # (strict=False: torch would refuse an unused parameter's missing state; every key saved was loaded)
    unused_allowed = dataclasses.replace(options, strict=False)
    set_optimizer_state_dict(model, optimizer, sharded["optimizer"], options=unused_allowed)


def init_saved_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved_keys: set[str]
) -> None:
    """Create the optimizer's state for the parameters a checkpoint holds state of (`saved_keys`: its DCP
    keys), and for no others, as torch's get_state_dict would for every parameter: one step with zero
    gradients at lr 0 (nothing moves). A parameter no loss reached (unused) never had a gradient, so has
    no state in the checkpoint: created here, DCP would refuse the checkpoint as missing it, and the run
    would hold state an uninterrupted one does not."""
    if optimizer.state:
        return
    for name, parameter in model.named_parameters():
        if any(key.startswith(f"optimizer.state.{name}.") for key in saved_keys):
            parameter.grad = torch.zeros_like(parameter)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def _options(by_parameter_name: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=by_parameter_name)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state_dict on every rank (plain tensors, fp32 or fp64, on the CPU), gathered from
    a DTensor model's shards: a collective, every rank calls it. Keys are the core model's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {
        k: at_least_fp32(v.detach()).cpu().clone() if v.is_floating_point() else v.cpu()
        for k, v in state.items()
    }


def unwrap_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The core model's full state_dict on CPU (fp32; fp64 under --precision fp64), whatever wrapper (DDP,
    DataParallel) holds it."""
    inner = getattr(model, "module", model)
    return {
        k: at_least_fp32(v.detach()).cpu().clone() if v.is_floating_point() else v.cpu().clone()
        for k, v in inner.state_dict().items()
    }


def checkpoint_state(cfg: RunConfig, done: int, n_steps: int, record: Any, **states: Any) -> dict[str, Any]:
    """A checkpoint: the impl's `states` (model, optimizer, ...), then what every checkpoint holds: the
    steps done and planned, this process's RNG, the record so far, the options (a resume checks them) and
    the impl that wrote it (a resume by another records it). The first checkpoint's communication is
    counted from here to the next step (sharded saves gather)."""
    TRAFFIC.start("checkpoint")
    return {
        **states,
        "step": done,
        "total_steps": n_steps,
        "rng": torch.get_rng_state(),
        "record": record.state(),
        "config": cfg.to_dict(),
        "impl": dict(record.data["impl"]),  # {"name", "version"}
    }


def save_step_checkpoint(cfg: RunConfig, done: int, n_steps: int, record: Any, **states: Any) -> Path:
    """`checkpoint_state` written atomically as <--checkpoint-dir>/step-<done>.pt (one file: single, ddp)."""
    return save_checkpoint(
        checkpoint_path(cfg.checkpoint_dir, done), checkpoint_state(cfg, done, n_steps, record, **states)
    )


def resume_step(state: dict[str, Any], path: Path, record: Any, impl: str, say: bool = True) -> int:
    """After the impl has loaded its model and optimizer from `state`: the rest of a resume (the RNG, the
    record's history, one line where `say`); the step to continue from. The data order and the lr follow
    from the step alone."""
    torch.set_rng_state(state["rng"])
    # Another impl (or version) may continue a checkpoint whose state it reads as its own (load_checkpoint's
    # `holds`; DCP's model and optimizer keys are the core model's in fsdp, context_parallel, ...): the
    # record says which wrote the steps before.
    written_by, now = impl_named(state.get("impl")), impl_named(record.data["impl"])
    if written_by != now:
        state["changes"]["impl"] = [written_by, now]
    record.load_state(state, path)  # the history so far, and what this session changes
    if say:
        print(f"{impl}: {describe_resume(path, state)}")
    return state["step"]


def impl_named(impl: dict[str, str] | None) -> str:
    """ "fsdp 0.11.0" of a record's or checkpoint's {"name", "version"}."""
    return f"{impl['name']} {impl['version']}" if impl else NOT_RECORDED
