"""The run contract: the command-line options every impl's train.py accepts.

Every impl parses the same core options, so the comparison runner and the tests drive any impl alike;
an impl adds its own strategy options through `add_options`. Bad values fail here, before any training
(and, for the runners that spawn processes, before any process is spawned), with one line on stderr and
exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
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


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints the whole usage block before an error; we print one line, exit code 2."""

    def error(self, message: str) -> NoReturn:
        # Under torchrun every rank parses the same arguments: rank 0 alone says what is wrong.
        self.exit(2, f"{self.prog}: error: {message}\n" if os.environ.get("RANK", "0") == "0" else None)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def build_parser(impl: str, add_options: Callable[[argparse.ArgumentParser], None] | None = None):
    parser = OneLineErrorParser(prog=f"{impl}/train.py", description=f"distref: {impl}")
    p = parser.add_argument
    p("--model", choices=MODELS, default="lenet")
    p("--dataset", choices=DATASETS, default="mnist")
    p(
        "--data-root",
        default=os.environ.get("DISTREF_DATA", "data"),
        help="dataset folder; a file for --dataset text",
    )
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=_positive_int, help="train this many epochs (default 1)")
    length.add_argument("--steps", type=_positive_int, help="train this many optimizer steps")
    p(
        "--global-batch-size",
        type=_positive_int,
        default=64,
        help="samples per optimizer step, any world size",
    )
    p("--lr", type=_positive_float, default=2e-3)
    p("--optimizer", choices=("sgd", "adamw"), default="adamw")
    p(
        "--lr-schedule",
        choices=("cosine", "constant"),
        default="cosine",
        help="cosine: from --lr to 0 over the run",
    )
    p("--weight-decay", type=float, default=0.0)
    p("--seed", type=int, default=0)
    p("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    p("--grad-accum", type=_positive_int, default=1, help="micro-steps per optimizer step")
    p(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each block's activations in backward",
    )
    p("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p("--eval-every", type=_non_negative_int, default=0, help="evaluate every N steps (0: each epoch end)")
    p("--target-accuracy", type=_fraction, help="accuracy whose first reaching the record times")
    p("--out", help="write record.json and steps.jsonl here")
    p("--save-final", help="write the final full fp32 state_dict here")
    p("--checkpoint-dir", help="write checkpoints here")
    p("--checkpoint-every", type=_non_negative_int, default=0, help="checkpoint every N steps (0: never)")
    p("--resume", help="'auto' (newest checkpoint in --checkpoint-dir, if any) or a checkpoint file")
    p("--timeout", type=_positive_float, default=600.0, help="seconds a collective may wait before failing")
    p("--profile", action="store_true", help="torch.profiler trace of a few steps under --out/profile")
    p("--tensorboard", action="store_true", help="TensorBoard scalars under --out/tensorboard")
    p("--num-workers", type=_non_negative_int, default=0, help="DataLoader worker processes")
    p("--log-every", type=_positive_int, default=10, help="steps between progress/record flushes")
    if add_options is not None:
        strategy = parser.add_argument_group(f"{impl} options")
        add_options(strategy)
    return parser


def parse_config(
    argv: Sequence[str] | None,
    impl: str,
    add_options: Callable[[argparse.ArgumentParser], None] | None = None,
    world_size: int = 1,
    check: Callable[[RunConfig, int], str | None] | None = None,
) -> RunConfig:
    """Parse and validate (core rules, then the impl's `check`); on bad input print one line and exit 2."""
    parser = build_parser(impl, add_options)
    ns = vars(parser.parse_args(argv))
    core_fields = {f.name for f in dataclasses.fields(RunConfig)} - {"extra"}
    core = {k: v for k, v in ns.items() if k in core_fields}
    extra = {k: v for k, v in ns.items() if k not in core_fields}
    cfg = RunConfig(**core, extra=extra)
    if cfg.epochs is None and cfg.steps is None:
        cfg = dataclasses.replace(cfg, epochs=1)
    problem = validate(cfg, world_size) or (check(cfg, world_size) if check else None)
    if problem:
        parser.error(problem)
    return cfg


def uses_cuda(cfg: RunConfig) -> bool:
    """Whether the run will train on CUDA (--device cuda, or auto with a GPU present)."""
    import torch

    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def validate(cfg: RunConfig, world_size: int = 1) -> str | None:
    """Return a one-line description of what is wrong with `cfg`, or None."""
    import torch  # local: the parser itself must stay importable without torch for quick CLI errors

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
    if (cfg.profile or cfg.tensorboard) and not cfg.out:
        return "--profile and --tensorboard write under --out; give --out DIR"
    if cfg.out and cfg.resume is None and (Path(cfg.out) / "record.json").exists():
        return f"--out {cfg.out} already holds a record.json; choose another --out (or --resume)"
    return None


def fail(message: str, prog: str = "train.py") -> NoReturn:
    """Exit with one line and code 2 (the same shape as a CLI error), e.g. for a missing dataset."""
    sys.stderr.write(f"{prog}: error: {message}\n")
    sys.exit(2)
