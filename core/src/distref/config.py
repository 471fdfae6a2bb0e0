"""The run contract: the command-line options every impl's train.py accepts.

Every impl parses the same core options, so the comparison runner and the tests drive any impl alike;
an impl adds its own strategy options through `add_options`. Bad values fail here, before any training
(and, for the runners that spawn processes, before any process is spawned), with one line on stderr and
exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

MODELS = ("lenet", "resnet18", "gpt")
DATASETS = ("mnist", "fashion-mnist", "cifar10", "digits", "text", "synthetic")
# Which datasets each model can train on (image classifiers vs the character-level transformer).
MODEL_DATASETS = {
    "lenet": ("mnist", "fashion-mnist", "digits", "synthetic"),
    "resnet18": ("mnist", "fashion-mnist", "cifar10", "digits", "synthetic"),
    "gpt": ("text", "synthetic"),
}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Core options, identical for every impl. Strategy options live in `RunConfig.extra`."""

    model: str = "lenet"
    gpt_layers: int = 2
    dataset: str = "mnist"
    data_root: str = "data"
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
    device: str = "auto"
    eval_every: int = 0
    target_accuracy: float | None = None
    out: str | None = None
    save_final: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: str | None = None
    timeout: float = 600.0
    profile: bool = False
    tensorboard: bool = False
    num_workers: int = 0
    log_every: int = 10
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# The options that define a run: the model, the data and its order, and the optimizer's trajectory. A
# checkpoint continues only a run equal in all of them (distref.checkpoint), and a report compares only
# runs equal in all of them, plus the run's length and data files (distref.report): one list, so the two
# cannot drift apart.
RUN_DEFINING_OPTIONS = (
    "model",
    "gpt_layers",
    "dataset",
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
    default for options older runs predate, and None for the folder a named dataset lies in (MNIST and
    Fashion-MNIST are md5-checked wherever they are; a text file is the data itself)."""
    if key == "data_root" and options.get("dataset") != "text":
        return None
    return options.get(key, RunConfig.__dataclass_fields__[key].default)


def is_first_rank() -> bool:
    """Rank 0 under torchrun, or a process that is no rank: the one that speaks for the job when every
    rank meets the same problem (bad arguments, a diverged loss, an unreadable checkpoint)."""
    return os.environ.get("RANK", "0") == "0"


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints the whole usage block before an error; we print one line, exit code 2."""

    def error(self, message: str) -> NoReturn:
        # Under torchrun every rank parses the same arguments: rank 0 alone says what is wrong.
        self.exit(2, f"{self.prog}: error: {message}\n" if is_first_rank() else None)


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (impls use it for their own options too)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


MAX_SEED = 2**32 - 1  # numpy's seeds are 32-bit unsigned


def _seed(text: str) -> int:
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


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description (train.py's docstring, with its usage examples) as written; each option's default
    shown where it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = (
            action.default is not None and action.default is not False and action.default != argparse.SUPPRESS
        )
        if shown and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def under_torchrun() -> bool:
    """Whether this process is a rank started by torchrun (or torch.distributed.run), which sets these."""
    return "LOCAL_RANK" in os.environ and "MASTER_ADDR" in os.environ


def build_parser(
    impl: str,
    add_options: Callable[[argparse.ArgumentParser], None] | None = None,
    description: str | None = None,
    distributed: bool = False,
) -> OneLineErrorParser:
    """The run contract's parser: core options, the process options of multi-process impls
    (`distributed`), then the impl's own (`add_options`), each group under its own heading in --help."""
    parser = OneLineErrorParser(
        prog=f"{impl}/train.py",
        usage="%(prog)s [-h] [options]",
        description=description or f"distref: {impl}",
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # the launcher must tell its own options from train.py's exactly
    )
    contract = parser.add_argument_group("run contract (the same for every impl)")
    p = contract.add_argument
    p("--model", choices=MODELS, default="lenet", help="an ordered list of named blocks (distref.models)")
    p(
        "--gpt-layers",
        metavar="N",
        type=positive_int,
        default=2,
        help="transformer blocks of --model gpt (its blocks: embed, N blocks, head)",
    )
    p("--dataset", choices=DATASETS, default="mnist", help="real MNIST is prepared offline, md5-checked")
    p(
        "--data-root",
        metavar="DIR",
        default=os.environ.get("DISTREF_DATA", "data"),
        help="dataset folder (created and prepared if missing; $DISTREF_DATA); a file for --dataset text",
    )
    length = contract.add_mutually_exclusive_group()
    length.add_argument(
        "--epochs", metavar="N", type=positive_int, help="train this many epochs (default: 1)"
    )
    length.add_argument("--steps", metavar="N", type=positive_int, help="train this many optimizer steps")
    p(
        "--global-batch-size",
        metavar="B",
        type=positive_int,
        default=64,
        help="samples per optimizer step, whatever the world size and --grad-accum",
    )
    p("--lr", metavar="LR", type=positive_float, default=2e-3, help="peak learning rate")
    p("--optimizer", choices=("sgd", "adamw"), default="adamw", help="sgd has momentum 0.9")
    p(
        "--lr-schedule",
        choices=("cosine", "constant"),
        default="cosine",
        help="cosine: from --lr to 0 over the run",
    )
    p(
        "--weight-decay",
        metavar="WD",
        type=_non_negative_float,
        default=0.0,
        help="decoupled (AdamW) or L2 (SGD)",
    )
    p("--seed", metavar="SEED", type=_seed, default=0, help="initial parameters and data order")
    p(
        "--precision",
        choices=("fp32", "bf16", "fp16", "fp64"),
        default="fp32",
        help="bf16/fp16: autocast (fp16 CUDA only); fp64: parameters and data in float64 (parity checks)",
    )
    p("--grad-accum", metavar="K", type=positive_int, default=1, help="micro-steps per optimizer step")
    p(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each block's activations in backward (less memory, more compute)",
    )
    p("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA if available")
    p(
        "--eval-every",
        metavar="N",
        type=_non_negative_int,
        default=0,
        help="evaluate every N steps (0: each epoch end)",
    )
    p(
        "--target-accuracy",
        metavar="A",
        type=_fraction,
        help="test accuracy to reach: the record says when the first evaluation reached it",
    )
    p("--out", metavar="DIR", help="write record.json and steps.jsonl to this folder")
    p(
        "--save-final",
        metavar="PATH",
        help="write the final full fp32 state_dict (core model keys) to this file",
    )
    p("--checkpoint-dir", metavar="DIR", help="write checkpoints to this folder")
    p(
        "--checkpoint-every",
        metavar="N",
        type=_non_negative_int,
        default=0,
        help="checkpoint every N steps (0: never)",
    )
    p(
        "--resume",
        metavar="auto|PATH",
        help="'auto' (newest checkpoint in --checkpoint-dir, if any) or a checkpoint file",
    )
    p("--profile", action="store_true", help="torch.profiler trace of a few steps under --out/profile")
    p("--tensorboard", action="store_true", help="TensorBoard scalars under --out/tensorboard")
    p("--num-workers", metavar="N", type=_non_negative_int, default=0, help="DataLoader worker processes")
    p(
        "--log-every",
        metavar="N",
        type=positive_int,
        default=10,
        help="steps between progress/record flushes",
    )
    if distributed:
        processes = parser.add_argument_group(
            "processes (one per rank; started by torchrun, or by this file when run with python)"
        )
        q = processes.add_argument
        q(
            "--nproc-per-node",
            metavar="N",
            type=positive_int,
            help="with plain `python train.py`: start this many ranks through torch.distributed.run "
            "(default: one per visible GPU with CUDA, else 2); under torchrun, give it to torchrun",
        )
        q(
            "--max-restarts",
            metavar="K",
            type=_non_negative_int,
            default=0,
            help="with plain `python train.py`: restart all ranks this often after a failure "
            "(use with --checkpoint-dir and --resume auto)",
        )
        q(
            "--timeout",
            metavar="SECONDS",
            type=positive_float,
            default=600.0,
            help="seconds a collective may wait before failing",
        )
    if add_options is not None:
        add_options(parser.add_argument_group(f"{impl} options"))
    return parser


LAUNCH_OPTIONS = ("nproc_per_node", "max_restarts")  # the launcher's, not the run's: not in RunConfig


def with_defaults(defaults: dict[str, str], args: Sequence[str]) -> list[str]:
    """`args` preceded by `defaults` ({"--option": value}) for every option that `args` does not give;
    `--steps` given replaces a default `--epochs` (they exclude each other), and the other way round."""
    given = {arg.split("=")[0] for arg in args if arg.startswith("--")}
    if given & {"--steps", "--epochs"}:
        given |= {"--steps", "--epochs"}
    kept = [item for option, value in defaults.items() if option not in given for item in (option, value)]
    return [*kept, *args]


PARSE_TIMES: list[float] = []  # time.perf_counter() at each parse_config call in this process


def parse_config(
    argv: Sequence[str] | None,
    impl: str,
    add_options: Callable[[argparse.ArgumentParser], None] | None = None,
    world_size: int | None = None,
    check: Callable[[RunConfig, int], str | None] | None = None,
    description: str | None = None,
    distributed: bool = False,
    splits_batch: bool = True,
    one_process: Callable[[RunConfig], str | None] | None = None,
) -> RunConfig:
    """Parse and validate (core rules, then the impl's `check`); on bad input print one line and exit 2.

    `world_size` defaults to 1, or for a `distributed` impl to torchrun's WORLD_SIZE under torchrun and
    to the ranks `--nproc-per-node` asks for otherwise (the launcher validates before starting any).
    `splits_batch=False` is for impls whose ranks all see the whole batch (model parallel): the global
    batch then only has to divide into --grad-accum micro-batches. `one_process` says why a run of a
    `distributed` impl is one process after all (model_parallel --devices), or None: the launcher options
    that would start ranks are then refused, not ignored."""
    PARSE_TIMES.append(time.perf_counter())  # a run begins (the record's start-up counts from here on)
    parser = build_parser(impl, add_options, description, distributed)
    ns = vars(parser.parse_args(argv))
    launch = {k: ns.pop(k) for k in LAUNCH_OPTIONS if k in ns}
    core_fields = {f.name for f in dataclasses.fields(RunConfig)} - {"extra"}
    core = {k: v for k, v in ns.items() if k in core_fields}
    extra = {k: v for k, v in ns.items() if k not in core_fields}
    cfg = RunConfig(**core, extra=extra)
    if cfg.epochs is None and cfg.steps is None:
        cfg = dataclasses.replace(cfg, epochs=1)
    if world_size is None and distributed and under_torchrun():
        if launch["nproc_per_node"] is not None or launch["max_restarts"]:
            parser.error(
                "--nproc-per-node/--max-restarts start ranks from plain python; give them to torchrun"
            )
        world_size = int(os.environ["WORLD_SIZE"])
    elif world_size is None and distributed:
        given = [f"--{k.replace('_', '-')}" for k in LAUNCH_OPTIONS if launch[k]]
        if given and one_process is not None and (why := one_process(cfg)):
            parser.error(f"{' and '.join(given)} are for runs of several ranks, but {why}: drop them")
        world_size = launch["nproc_per_node"] or default_ranks(cfg)
        cfg.extra.update(nproc_per_node=world_size, max_restarts=launch["max_restarts"])
    shards = (world_size or 1) if splits_batch else 1
    problem = validate(cfg, shards) or (check(cfg, world_size or 1) if check else None)
    if not problem and distributed and not (one_process and one_process(cfg)):
        problem = gpus_problem(cfg, world_size or 1)
    if problem:
        parser.error(problem)
    return cfg


def gpus_problem(cfg: RunConfig, world_size: int) -> str | None:
    """On CUDA each rank on this machine takes a GPU of its own (its LOCAL_RANK): more ranks here than
    visible GPUs would fail in the rank whose set_device has no device, after the others started."""
    if not uses_cuda(cfg):
        return None
    import torch

    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if under_torchrun() else world_size
    if local_ranks > (gpus := torch.cuda.device_count()):
        return (
            f"{local_ranks} ranks on this machine need a CUDA device each, and {gpus} are visible: "
            f"start at most {gpus} (--nproc-per-node), or run on CPU (--device cpu)"
        )
    return None


def default_ranks(cfg: RunConfig) -> int:
    """Ranks to start on this machine when none are asked for: one per GPU with CUDA, else 2 (each rank
    then runs one thread: more ranks than cores only adds waiting)."""
    import torch

    return max(1, torch.cuda.device_count()) if uses_cuda(cfg) else 2


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
    if not os.access(parent, os.W_OK):
        return f"{option} {folder}: does not exist and cannot be created ({parent} is not writable)"
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


def validate(cfg: RunConfig, world_size: int = 1) -> str | None:
    """Return a one-line description of what is wrong with `cfg`, or None."""
    import torch  # local: the parser itself must stay importable without torch for quick CLI errors

    if cfg.gpt_layers != 2 and cfg.model != "gpt":
        return f"--gpt-layers sets the depth of --model gpt, not of --model {cfg.model}"
    if cfg.dataset not in MODEL_DATASETS[cfg.model]:
        allowed = ", ".join(MODEL_DATASETS[cfg.model])
        return f"--model {cfg.model} does not train on --dataset {cfg.dataset} (use one of: {allowed})"
    shards = world_size * cfg.grad_accum
    if cfg.global_batch_size % shards:
        return (
            f"--global-batch-size {cfg.global_batch_size} must be divisible by world size × --grad-accum "
            f"= {world_size} × {cfg.grad_accum} = {shards}"
        )
    if cfg.dataset == "text" and not Path(cfg.data_root).is_file():
        return f"--dataset text needs --data-root to be a text file; {cfg.data_root!r} is not a file"
    data_root = Path(cfg.data_root)
    if cfg.dataset in ROOTED_DATASETS and (problem := folder_problem("--data-root", data_root, writes=False)):
        return problem
    for option, folder in (("--out", cfg.out), ("--checkpoint-dir", cfg.checkpoint_dir)):
        if folder and (problem := folder_problem(option, Path(folder))):
            return problem
    if cfg.save_final and (problem := file_problem("--save-final", Path(cfg.save_final))):
        return problem
    from distref.data import DataError, train_set_size  # (it imports this module)

    try:
        samples = train_set_size(cfg)
    except DataError as exc:  # a text file that cannot be read, or is too short
        return str(exc)
    if cfg.global_batch_size > samples:
        return (
            f"--global-batch-size {cfg.global_batch_size} is larger than the {cfg.dataset} training set "
            f"({samples} samples): one step would need more samples than there are"
        )
    needs_torchvision = cfg.dataset in ROOTED_DATASETS or cfg.model == "resnet18"
    if needs_torchvision and importlib.util.find_spec("torchvision") is None:
        what = f"--model {cfg.model}" if cfg.model == "resnet18" else f"--dataset {cfg.dataset}"
        # (resnet18 is torchvision's model: --dataset synthetic does not spare it torchvision)
        instead = "--model lenet or gpt" if cfg.model == "resnet18" else "--dataset synthetic"
        return f"{what} needs torchvision: pip install torchvision (pinned with torch), or use {instead}"
    if cfg.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda: no CUDA device is available to this torch build"
    if cfg.precision == "fp16" and not uses_cuda(cfg):
        return "--precision fp16 needs CUDA (GradScaler); on CPU use --precision bf16"
    if cfg.checkpoint_every and not cfg.checkpoint_dir:
        return "--checkpoint-every needs --checkpoint-dir"
    if cfg.resume == "auto" and not cfg.checkpoint_dir:
        return "--resume auto needs --checkpoint-dir"
    if cfg.resume not in (None, "auto") and not Path(cfg.resume).is_file():
        return f"--resume {cfg.resume}: no such checkpoint file"
    if cfg.resume not in (None, "auto"):
        from distref.checkpoint import checkpoint_problem  # (it imports this module)

        if problem := checkpoint_problem(cfg.resume):
            return f"--resume: {problem}"
    if (cfg.profile or cfg.tensorboard) and not cfg.out:
        return "--profile and --tensorboard write under --out; give --out DIR"
    if cfg.resume == "auto" and cfg.checkpoint_dir:
        from distref.checkpoint import checkpoints  # (it imports this module)

        starts_over = not checkpoints(cfg.checkpoint_dir)  # --resume auto without a checkpoint: a new run
    else:
        starts_over = cfg.resume is None
    if cfg.out and starts_over and (Path(cfg.out) / "record.json").exists():
        return (
            f"--out {cfg.out} already holds a record.json; choose another --out, or continue that run "
            "with --resume auto --checkpoint-dir DIR (or --resume CHECKPOINT)"
        )
    return None


def fail(message: str, prog: str = "train.py") -> NoReturn:
    """Exit with one line and code 2 (the same shape as a CLI error), e.g. for a missing dataset."""
    sys.stderr.write(f"{prog}: error: {message}\n")
    sys.exit(2)
