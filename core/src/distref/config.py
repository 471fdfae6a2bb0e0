"""The run contract: the options every impl's train.py accepts, as a frozen `RunConfig`.

Every impl takes the same core options, so the comparison runner and the tests drive any impl alike; an
impl adds its own strategy options as a frozen dataclass of its own (`RunConfig.strategy`). This module
holds the options' names, types and checks that need nothing else; `distref.cli` parses a command line
into a `RunConfig`. It imports no torch (nox reads it).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

MODELS = ("lenet", "resnet18", "gpt", "gpt2")
GPT_MODELS = ("gpt", "gpt2")  # the decoder-only transformers: the tiny one, and GPT-2 small's shape
GPT2_VOCABULARY = 50304  # GPT-2's 50,257 tokens padded to a multiple of 64, as nanoGPT does: faster matmuls
GPT2_CONTEXT = 1024
# Where every impl steps AdamW with torch's fused kernel (distref.training.optim). Not the CPU: there its
# vectorised body and scalar tail round alike elements differently, so a shard of a tensor (FSDP, ZeRO)
# would get other bits than the whole tensor (fsdp ×2 vs single --grad-accum 2: 2.3e-8, not 0).
FUSED_ADAMW_DEVICES = ("cuda",)


DATASETS = ("mnist", "fashion-mnist", "cifar10", "digits", "text", "synthetic", "masked")


# Which datasets each model can train on (image classifiers vs the character-level transformer).
# A model or dataset of your own (MODULE:FUNCTION, `is_factory`) is checked by trying it instead.
MODEL_DATASETS = {
    "lenet": ("mnist", "fashion-mnist", "digits", "synthetic"),
    "resnet18": ("mnist", "fashion-mnist", "cifar10", "digits", "synthetic"),
    "gpt": ("text", "synthetic", "masked"),
    "gpt2": ("text", "synthetic"),
}


FACTORY_FORMAT = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def is_factory(name: str) -> bool:
    """Whether a --model/--dataset value names a function of your own (`my_project.models:mlp`)."""
    return FACTORY_FORMAT.fullmatch(name) is not None


def choice_or_factory(option: str, choices: Sequence[str]):
    """An argparse type: one of `choices`, or MODULE:FUNCTION (a function of your own, imported later)."""

    def parse(text: str) -> str:
        if text in choices or is_factory(text):
            return text
        listed = ", ".join(choices)
        raise argparse.ArgumentTypeError(
            f"{text!r}: choose from {listed}, or give MODULE:FUNCTION of your own"
        )

    parse.__name__ = option  # (argparse names the type in its messages)
    return parse


def first_line(exc: BaseException) -> str:
    """An exception's message, its first line (one-line errors quote what your code raised)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


class FactoryError(ValueError):
    """A MODULE:FUNCTION that cannot be imported, or whose result breaks its contract: the message says
    which, in one line."""


def load_factory(spec: str, option: str):
    """The function a --model/--dataset MODULE:FUNCTION names. MODULE is imported as `python -m` would:
    from the current folder first, then the installed packages (the ranks start in the launcher's folder,
    so they import the same file)."""
    module_name, _, function = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # (a missing module, or yours failing as it is imported)
        raise FactoryError(
            f"{option} {spec}: cannot import {module_name} ({type(exc).__name__}: {first_line(exc)})"
        ) from None
    factory = getattr(module, function, None)
    if not callable(factory):
        raise FactoryError(f"{option} {spec}: {module_name} ({module.__file__}) has no function {function}")
    return factory


@dataclasses.dataclass(frozen=True)
class Launch:
    """What `python train.py` asks the launcher for (not part of the run: the ranks never see it)."""

    nproc_per_node: int
    max_restarts: int


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """gpt's mixture of experts: each block's MLP becomes `experts` MLPs and a router sending each token to
    `top_k` of them (distref.models.MoE). `balance_loss` weighs the load-balancing loss (Switch/GShard),
    averaged over the `sequences_per_step` of the global batch: its gradient is the same whichever rank
    or micro-batch a sequence is in."""

    experts: int
    top_k: int = 2
    balance_loss: float = 0.01
    sequences_per_step: int = 64


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Core options, identical for every impl; the impl's own options are `strategy`, a frozen dataclass
    the impl defines (ddp's `DDPOptions`), or None for an impl without options."""

    model: str = "lenet"
    gpt_layers: int = 2
    dataset: str = "mnist"
    data_root: str = "data"
    sequence_length: int | None = None
    experts: int = 0
    top_k: int = 2
    balance_loss: float = 0.01
    epochs: int | None = None
    steps: int | None = None
    global_batch_size: int = 64
    lr: float = 2e-3
    optimizer: str = "adamw"
    lr_schedule: str = "cosine"
    weight_decay: float = 0.0
    seed: int = 0
    precision: str = "fp32"
    grad_accum: int = 1
    activation_checkpointing: bool = False
    compile: bool = False
    device: str = "auto"
    eval_every: int = 0
    eval_samples: int | None = None
    target_accuracy: float | None = None
    out: str | None = None
    save_final: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: str | None = None
    timeout: float = 600.0
    profile: bool = False
    tensorboard: bool = False
    step_timing: str = "events"
    num_workers: int = 0
    log_every: int = 10
    strategy: Any = None
    launch: Launch | None = None

    @property
    def moe(self) -> MoEConfig | None:
        """gpt's mixture of experts (--experts, --top-k, --balance-loss), or None: dense MLPs."""
        if not self.experts:
            return None
        return MoEConfig(self.experts, self.top_k, self.balance_loss, self.global_batch_size)

    def to_dict(self) -> dict[str, Any]:
        """As records and checkpoints keep it: the core options, then the impl's own and the launch
        under "extra" (the format every record and checkpoint since 0.1 has)."""
        core = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        extra = {**as_dict(core.pop("strategy")), **as_dict(core.pop("launch"))}
        return {**core, "extra": extra}


def as_dict(options: Any) -> dict[str, Any]:
    return dataclasses.asdict(options) if options is not None else {}


# The options that define a run: the model, the data and its order, and the optimizer's trajectory. A
# checkpoint continues only a run equal in all of them (distref.training.checkpoint), and a report compares only
# runs equal in all of them, plus the run's length and data files (distref.report): one list, so the two
# cannot drift apart.
RUN_DEFINING_OPTIONS = (
    "model",
    "gpt_layers",
    "dataset",
    "sequence_length",  # (None: the dataset's own length, as every run before core 0.18.0)
    "experts",  # (0: gpt's dense MLPs, as every run before core 0.19.0)
    "top_k",
    "balance_loss",
    "global_batch_size",
    "seed",
    "optimizer",
    "lr",
    "lr_schedule",
    "weight_decay",
    "precision",
    "data_root",  # for --dataset text only, the file (the others are named by --dataset: defining_value)
)


def defining_value(options: dict[str, Any], key: str) -> Any:
    """What option `key` of a run with these (flat) options says about which run it is: its value, the
    default for options older runs predate, None for the folder a named dataset lies in (MNIST and
    Fashion-MNIST are md5-checked wherever they are; a text file is the data itself), and the sequence's
    length whether given or the data's own (`--sequence-length 16` is gpt's task as it always was)."""
    if key == "data_root" and options.get("dataset") != "text":
        return None
    value = options.get(key, RunConfig.__dataclass_fields__[key].default)
    if key == "sequence_length" and value is None:
        return default_sequence_length(options.get("model", "lenet"), options.get("dataset", "mnist"))
    return value


GPT_TASK_SEQUENCE = 16  # tokens of gpt's synthetic and masked tasks (8 digits, the separator, 7 answered)
TEXT_BLOCK = 64  # characters per --dataset text sequence but gpt2's


def default_sequence_length(model: str, dataset: str) -> int | None:
    """Tokens per sequence of the data when --sequence-length is not given: gpt's tasks 16, text 64,
    gpt2's 1024 (synthetic or text); None for data without one (images, yours)."""
    if dataset == "text":
        return GPT2_CONTEXT if model == "gpt2" else TEXT_BLOCK
    if dataset in ("synthetic", "masked") and model in GPT_MODELS:
        return GPT2_CONTEXT if model == "gpt2" else GPT_TASK_SEQUENCE
    return None


def is_first_rank() -> bool:
    """Rank 0 under torchrun (task 0 under srun), or a process that is no rank: the one that speaks for
    the job when every rank meets the same problem (bad arguments, a diverged loss, an unreadable
    checkpoint)."""
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


SPEAKER_GRACE_S = 5.0


def exit_after_rank_0_spoke(code: int = 2) -> NoReturn:
    """Exit as a rank that leaves the saying to rank 0 (every rank met the same problem), after a pause.
    The launcher (torchrun, srun --kill-on-bad-exit, the tests' run_ranks) stops every rank once one has
    exited: had this rank gone first, rank 0 could be stopped before it wrote its line, and the job would
    end saying nothing (seen under load). Rank 0 exits at once after its line; the launcher then stops
    this one mid-pause, so the pause costs nothing."""
    time.sleep(SPEAKER_GRACE_S)
    sys.exit(code)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints the whole usage block before an error; we print one line, exit code 2."""

    def error(self, message: str) -> NoReturn:
        # Under torchrun every rank parses the same arguments: rank 0 alone says what is wrong.
        if not is_first_rank():
            exit_after_rank_0_spoke(2)
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (impls use it for their own options too)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


MAX_SEED = 2**32 - 1  # numpy's seeds are 32-bit unsigned


def seed_value(text: str) -> int:
    value = int(text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**32 - 1], got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a number > 0 (impls use it for their own options too)."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def under_torchrun() -> bool:
    """Whether this process is a rank started by torchrun (or torch.distributed.run), which sets these, or
    a task of srun or a PyTorchJob pod made one (distref.schedulers.take_rank_from_scheduler)."""
    return "LOCAL_RANK" in os.environ and "MASTER_ADDR" in os.environ


def with_defaults(defaults: dict[str, str], args: Sequence[str]) -> list[str]:
    """`args` preceded by `defaults` ({"--option": value}) for every option that `args` does not give;
    `--steps` given replaces a default `--epochs` (they exclude each other), and the other way round."""
    given = {arg.split("=")[0] for arg in args if arg.startswith("--")}
    if given & {"--steps", "--epochs"}:
        given |= {"--steps", "--epochs"}
    kept = [item for option, value in defaults.items() if option not in given for item in (option, value)]
    return [*kept, *args]


PARSE_TIMES: list[float] = []  # time.perf_counter() at each parse_config call in this process


ROOTED_DATASETS = ("mnist", "fashion-mnist", "cifar10")  # kept as files in a folder under --data-root


def folder_problem(option: str, folder: Path, writes: bool = True) -> str | None:
    """A folder the run writes (--out, --checkpoint-dir) must be a writable folder, or one that can be
    created: said now, not when the first file is written. --data-root (`writes=False`) may be a
    read-only folder that holds the dataset already; a missing one is created and the dataset prepared."""
    if folder.is_symlink() and not folder.exists():
        return f"{option} {folder}: a symbolic link to nothing ({os.readlink(folder)})"
    if folder.exists():
        if not folder.is_dir():
            return f"{option} {folder}: not a directory"
        return f"{option} {folder}: not writable" if writes and not os.access(folder, os.W_OK) else None
    parent = next(p for p in folder.absolute().parents if p.exists())  # the nearest existing ancestor
    if not parent.is_dir():
        return f"{option} {folder}: {parent} is not a directory"
    dangling = next((p for p in folder.absolute().parents if p.is_symlink() and not p.exists()), None)
    if dangling is not None:
        return f"{option} {folder}: {dangling} is a symbolic link to nothing ({os.readlink(dangling)})"
    if not os.access(parent, os.W_OK):
        return f"{option} {folder}: does not exist and cannot be created ({parent} is not writable)"
    try:  # what access() cannot tell (root in /proc or /sys, a read-only mount): make a folder there
        os.rmdir(tempfile.mkdtemp(dir=parent))
    except OSError as exc:
        return f"{option} {folder}: does not exist and cannot be created in {parent} ({exc.strerror})"
    return None


def file_problem(option: str, file: Path) -> str | None:
    """A file the run writes at its end (--save-final): a name in a folder it can write, checked before a
    run trains for hours to find it cannot."""
    if file.is_dir():
        return f"{option} {file}: a directory; give a file name"
    return folder_problem(f"{option} {file}: its folder", file.parent)


def uses_cuda(cfg: RunConfig) -> bool:
    """Whether the run will train on CUDA (--device cuda, or auto with a GPU present)."""
    import torch

    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def fail(message: str, prog: str = "train.py") -> NoReturn:
    """Exit with one line and code 2 (the same shape as a CLI error), e.g. for a missing dataset."""
    sys.stderr.write(f"{prog}: error: {message}\n")
    sys.exit(2)
