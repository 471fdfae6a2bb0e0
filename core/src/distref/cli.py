"""The command line every impl's train.py shares: `parse_config` parses the core options and the impl's
own, then checks them against each other, the data and the checkpoints. Bad values fail here, before any
training (and before any rank is started), with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from distref.config import (
    DATASETS,
    GPT_MODELS,
    MODEL_DATASETS,
    MODELS,
    PARSE_TIMES,
    ROOTED_DATASETS,
    Launch,
    OneLineErrorParser,
    RunConfig,
    choice_or_factory,
    exit_after_rank_0_spoke,
    fail,
    file_problem,
    folder_problem,
    fraction,
    is_factory,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    seed_value,
    under_torchrun,
    uses_cuda,
)
from distref.data.datasets import sequence_length_problem, train_set_size
from distref.data.tensors import DataError
from distref.schedulers import SchedulerError, srun_task, take_rank_from_scheduler
from distref.training.checkpoint import (
    CHECKPOINT_FILE,
    CHECKPOINT_FOLDER,
    CheckpointError,
    checkpoint_problem,
    checkpoints,
    not_a_checkpoint,
)
from distref.training.monitor import PROFILED_UNTIL
from distref.your_model import own_code_problem


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
    p(
        "--model",
        metavar="{" + ",".join(MODELS) + "} or MODULE:FUNCTION",
        type=choice_or_factory("--model", MODELS),
        default="lenet",
        help="an ordered list of named blocks (distref.models; gpt2: GPT-2 small's shape, 12 × 768, 1024 "
        "tokens by default, to measure speed on a GPU), or a function of yours returning an nn.Module "
        "(docs/own-project.md)",
    )
    p(
        "--gpt-layers",
        metavar="N",
        type=positive_int,
        default=2,
        help="transformer blocks of --model gpt (its blocks: embed, N blocks, head)",
    )
    p(
        "--dataset",
        metavar="{" + ",".join(DATASETS) + "} or MODULE:FUNCTION",
        type=choice_or_factory("--dataset", DATASETS),
        default="mnist",
        help="real MNIST is prepared offline, md5-checked; or a function of yours returning (train, test) "
        "datasets of (input, target) pairs",
    )
    p(
        "--data-root",
        metavar="DIR",
        default=os.environ.get("DISTREF_DATA", "data"),
        help="dataset folder (created and prepared if missing; $DISTREF_DATA); a file for --dataset text",
    )
    p(
        "--sequence-length",
        metavar="N",
        type=positive_int,
        help="tokens per sequence of gpt's and gpt2's data: --dataset synthetic and masked (digits and "
        "their reversal, N/2 each: the answer as far back as the sequence is long), text (N characters). "
        "Default: the dataset's own (16, 64 for text, gpt2's 1024)",
    )
    p(
        "--experts",
        metavar="E",
        type=non_negative_int,
        default=0,
        help="gpt as a mixture of experts: each block's MLP becomes E expert MLPs and a router (top-k, "
        "dropless, the Switch/GShard load-balancing loss); 0: dense (default). Trained by impls/single and "
        "impls/expert_parallel",
    )
    p(
        "--top-k",
        metavar="K",
        type=positive_int,
        help="experts each token is sent to, their outputs weighed by the router's renormalised "
        "probabilities (default 2; 1: Switch's)",
    )
    p(
        "--balance-loss",
        metavar="ALPHA",
        type=non_negative_float,
        help="weight of the load-balancing loss, E·Σ f_i·P_i per sequence, averaged over the global batch "
        "(default 0.01, Switch's)",
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
        type=non_negative_float,
        default=0.0,
        help="decoupled (AdamW) or L2 (SGD)",
    )
    p("--seed", metavar="SEED", type=seed_value, default=0, help="initial parameters and data order")
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
    p(
        "--compile",
        action="store_true",
        help="torch.compile each block (as torchtitan does, before the strategy wraps it); where the "
        "strategy does not compose with it, the impl says so",
    )
    p("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA if available")
    p(
        "--eval-every",
        metavar="N",
        type=non_negative_int,
        default=0,
        help="evaluate every N steps (0: each epoch end)",
    )
    p(
        "--eval-samples",
        metavar="N",
        type=positive_int,
        help="score the first N samples of the test set (default: all of it): quicker evaluations, as "
        "Megatron's --eval-iters; the record's accuracy is theirs",
    )
    p(
        "--target-accuracy",
        metavar="A",
        type=fraction,
        help="test accuracy to reach: the record says when the first evaluation reached it",
    )
    p("--out", metavar="DIR", help="write record.json and steps.jsonl to this folder")
    p(
        "--save-final",
        metavar="PATH",
        help="write the model's final full state_dict (the core model's keys; fp32 parameters, fp64 under "
        "--precision fp64, whatever the training precision) to this file; never over an existing file",
    )
    p(
        "--checkpoint-dir",
        metavar="DIR",
        help="write checkpoints to this folder (one that holds another run's only with --resume)",
    )
    p(
        "--checkpoint-every",
        metavar="N",
        type=non_negative_int,
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
    p(
        "--step-timing",
        choices=("events", "sync"),
        default="events",
        help="how each step is timed on CUDA: events recorded on the stream, read when the losses are "
        "logged (no wait per step); sync: wait for the GPU after every step (diagnostic: the host's view)",
    )
    p("--num-workers", metavar="N", type=non_negative_int, default=0, help="DataLoader worker processes")
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
            type=non_negative_int,
            default=0,
            help="with plain `python train.py`: restart all ranks this often after a failure "
            "(use with --checkpoint-dir and --resume auto)",
        )
        q(
            "--check-ranks",
            metavar="N",
            type=positive_int,
            help="check the options for a run of N ranks in all (every node's), say so in one line, and "
            "exit without starting any: what a job script runs before its launcher "
            "(launch/slurm/torchrun.sbatch), so that bad input is one line, not a failure per rank",
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


def option(help: str, **settings: Any) -> Any:
    """A field of an impl's options dataclass (`RunConfig.strategy`) declared with its command-line option:
    `--<field name>` (underscores as dashes), its `help` and argparse's other `settings` (metavar, type,
    action, choices, default); not given, the field is `default` (None unless set). `add_options_for`
    turns the dataclass into the impl's `add_options`."""
    return dataclasses.field(default=settings.get("default"), metadata={"help": help, **settings})


def add_options_for(options: type) -> Callable[[argparse.ArgumentParser], None]:
    """The `add_options` (`build_parser`) of an options dataclass whose fields are `option`s: each field's
    option, in the fields' order."""

    def add_options(parser: argparse.ArgumentParser) -> None:
        for field in dataclasses.fields(options):
            parser.add_argument("--" + field.name.replace("_", "-"), **field.metadata)

    return add_options


LAUNCH_OPTIONS = (
    "nproc_per_node",
    "max_restarts",
    "check_ranks",
)  # the launcher's, not the run's: not in RunConfig


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
    strategy_options: type | None = None,
    cuts_model: bool = False,
    trains_experts: bool = False,
) -> RunConfig:
    """Parse and validate (core rules, then the impl's `check`); on bad input print one line and exit 2.

    `world_size` defaults to 1, or for a `distributed` impl to torchrun's WORLD_SIZE under torchrun and
    to the ranks `--nproc-per-node` asks for otherwise (the launcher validates before starting any).
    `splits_batch=False` is for impls whose ranks all see the whole batch (model parallel): the global
    batch then only has to divide into --grad-accum micro-batches. `one_process` says why a run of a
    `distributed` impl is one process after all (model_parallel --devices), or None: the launcher options
    that would start ranks are then refused, not ignored. `strategy_options` is the impl's frozen dataclass
    of its own options (those `add_options` adds, by the same names): `cfg.strategy`. `cuts_model`: the
    impl cuts the model between its blocks (its `check` checks a model of your own can be cut).
    `trains_experts`: the impl trains gpt's mixture of experts (--experts); others refuse it."""
    PARSE_TIMES.append(time.perf_counter())  # a run begins (the record's start-up counts from here on)
    try:
        if (
            distributed
        ):  # srun's tasks, a PyTorchJob's pods: ranks, by torchrun's variables (distref.schedulers)
            take_rank_from_scheduler()
        elif srun_task():  # N copies of a one-process run, all writing the same files
            fail(
                f"{impl} runs in one process, and srun started {os.environ.get('SLURM_STEP_NUM_TASKS')} "
                "tasks: submit it with --ntasks 1 (srun.sbatch starts a process per task)",
                "train.py",
            )
    except SchedulerError as exc:
        fail(str(exc), "train.py")
    parser = build_parser(impl, add_options, description, distributed)
    ns = vars(parser.parse_args(argv))
    launch = {k: ns.pop(k) for k in LAUNCH_OPTIONS if k in ns}
    core_fields = {f.name for f in dataclasses.fields(RunConfig)} - {"strategy", "launch"}
    # The experts' options have no argparse default, so that giving one is told from not giving it (at
    # its default value too): without --experts, either given is refused (experts_problem).
    moe_given = [f"--{k.replace('_', '-')}" for k in MOE_SHAPE_OPTIONS if ns[k] is not None]
    ns.update({k: getattr(RunConfig, k) for k in MOE_SHAPE_OPTIONS if ns[k] is None})
    core = {k: v for k, v in ns.items() if k in core_fields}
    own = {k: v for k, v in ns.items() if k not in core_fields}
    cfg = RunConfig(**core, strategy=strategy_options(**own) if strategy_options else None)
    if cfg.epochs is None and cfg.steps is None:
        cfg = dataclasses.replace(cfg, epochs=1)
    checking = launch.get("check_ranks")
    if checking and under_torchrun():
        parser.error("--check-ranks checks options before a launcher starts the ranks, not in a rank")
    if checking and (launch["nproc_per_node"] or launch["max_restarts"]):
        parser.error("--check-ranks N checks a run of N ranks in all: drop --nproc-per-node/--max-restarts")
    if checking and one_process is not None and (why := one_process(cfg)):
        parser.error(f"--check-ranks is for runs of several ranks, but {why}: drop it")
    if checking:
        world_size = checking
    elif world_size is None and distributed and under_torchrun():
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
        cfg = dataclasses.replace(cfg, launch=Launch(world_size, launch["max_restarts"]))
    shards = (world_size or 1) if splits_batch else 1
    problem = (
        f"--experts {cfg.experts}: {impl} does not train gpt's mixture of experts here; impls/single and "
        "impls/expert_parallel do"
        if cfg.experts and not trains_experts
        else None
    )
    problem = (
        problem
        or validate(cfg, shards, cuts_model, processes=world_size or 1, moe_given=moe_given)
        or (check(cfg, world_size or 1) if check else None)
    )
    if not problem and distributed and not checking and not (one_process and one_process(cfg)):
        problem = gpus_problem(cfg, world_size or 1)  # (checked by each node's ranks when checking)
    if problem:
        parser.error(problem)
    if checking:
        print(f"{impl}: the options fit a run of {checking} ranks")
        sys.exit(0)
    return cfg


def torchvision_problem() -> str | None:
    """Why torchvision cannot be used here, or None. Any failure to import it counts: PyPI's torchvision
    for a CPU torch is a CUDA build that fails at import (`operator torchvision::nms does not exist`)."""
    if importlib.util.find_spec("torchvision") is None:
        return "it is not installed"
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # (the broken build raises RuntimeError, others OSError or ImportError)
        return f"it fails to import ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return None


# How gpus_problem says that only the GPUs are short (distref.compare reads it: "needs N GPUs").
RANKS_NEED_A_GPU_EACH = "ranks on this machine need a CUDA device each"


def gpus_problem(cfg: RunConfig, world_size: int) -> str | None:
    """On CUDA each rank on this machine takes a GPU of its own (its LOCAL_RANK): more ranks here than
    visible GPUs would fail in the rank whose set_device has no device, after the others started."""
    if not uses_cuda(cfg):
        return None
    import torch

    env = os.environ
    # LOCAL_WORLD_SIZE: torchrun's; LOCAL_SIZE: DeepSpeed's launcher's
    local_ranks = (
        int(env.get("LOCAL_WORLD_SIZE", env.get("LOCAL_SIZE", world_size)))
        if under_torchrun()
        else world_size
    )
    gpus = torch.cuda.device_count()
    if gpus == 1 and under_torchrun() and "SLURM_STEP_ID" in env and "TORCHELASTIC_RUN_ID" not in env:
        return None  # srun bound each task to a GPU of its own (--gpus-per-task, --gpu-bind): cuda:0
    if local_ranks > gpus:
        return (
            f"{local_ranks} {RANKS_NEED_A_GPU_EACH}, and {gpus} are visible: "
            f"start at most {gpus} (--nproc-per-node), or run on CPU (--device cpu)"
        )
    return None


MOE_SHAPE_OPTIONS = ("top_k", "balance_loss")  # what shapes gpt's experts, given --experts


def experts_problem(cfg: RunConfig, given: Sequence[str] | None = None) -> str | None:
    """What is wrong with the mixture-of-experts options (--experts, --top-k, --balance-loss), or None.
    `given`: the options of MOE_SHAPE_OPTIONS the command line gave (None for a RunConfig made in code:
    those that differ from their defaults)."""
    if not cfg.experts:
        if given is None:
            given = [
                f"--{k.replace('_', '-')}"
                for k in MOE_SHAPE_OPTIONS
                if getattr(cfg, k) != getattr(RunConfig, k)
            ]
        shape = "shape" if len(given) > 1 else "shapes"
        return f"{' and '.join(given)} {shape} gpt's experts: give --experts too" if given else None
    if cfg.model not in GPT_MODELS:
        return (
            f"--experts makes gpt's MLPs experts, not --model {cfg.model}'s: use --model "
            f"{' or '.join(GPT_MODELS)}"
        )
    if cfg.top_k > cfg.experts:
        return (
            f"--top-k {cfg.top_k} sends each token to more experts than there are (--experts {cfg.experts}): "
            f"give --top-k {cfg.experts} or fewer (the default is 2)"
        )
    if cfg.precision == "fp16":
        # The load-balancing loss reaches the router as a gradient of its own (distref.models.MoE), which
        # GradScaler does not scale: fp16's loss scaling would leave it out of proportion. bf16 needs none.
        return "--experts with --precision fp16: the load-balancing loss is not loss-scaled here; use bf16"
    return None


def default_ranks(cfg: RunConfig) -> int:
    """Ranks to start on this machine when none are asked for: one per GPU with CUDA, else 2 (each rank
    then runs one thread: more ranks than cores only adds waiting)."""
    import torch

    return max(1, torch.cuda.device_count()) if uses_cuda(cfg) else 2


def validate(
    cfg: RunConfig,
    world_size: int = 1,
    cuts_model: bool = False,
    processes: int | None = None,
    moe_given: Sequence[str] | None = None,
) -> str | None:
    """Return a one-line description of what is wrong with `cfg`, or None. `world_size`: the ranks the
    batch is split over; `processes`: the ranks in all (default `world_size`), each making its own data.
    `cuts_model`: the impl cuts the model between its blocks (model_parallel, pipeline). `moe_given`: the
    experts' options the command line gave (experts_problem)."""
    import torch  # local: the parser itself must stay importable without torch for quick CLI errors

    if cfg.gpt_layers != 2 and cfg.model != "gpt":
        return f"--gpt-layers sets the depth of --model gpt, not of --model {cfg.model}"
    if problem := experts_problem(cfg, moe_given):
        return problem
    if cfg.precision == "fp16" and not uses_cuda(cfg):  # (before a model of yours is tried in fp16)
        return "--precision fp16 needs CUDA (GradScaler); on CPU use --precision bf16"
    own_code = is_factory(cfg.model) or is_factory(cfg.dataset)
    if not own_code and cfg.dataset not in MODEL_DATASETS[cfg.model]:
        allowed = ", ".join(MODEL_DATASETS[cfg.model])
        return f"--model {cfg.model} does not train on --dataset {cfg.dataset} (use one of: {allowed})"
    if own_code and cfg.dataset != "text" and (problem := own_code_problem(cfg, cuts_model)):
        return problem  # (text: checked below, once the file is known to be there)
    if problem := sequence_length_problem(cfg, processes or world_size):
        return problem
    shards = world_size * cfg.grad_accum
    if cfg.global_batch_size % shards:
        return (
            f"--global-batch-size {cfg.global_batch_size} must be divisible by world size × --grad-accum "
            f"= {world_size} × {cfg.grad_accum} = {shards}"
        )
    if cfg.dataset == "text" and not Path(cfg.data_root).is_file():
        return f"--dataset text needs --data-root to be a text file; {cfg.data_root!r} is not a file"
    if own_code and cfg.dataset == "text" and (problem := own_code_problem(cfg, cuts_model)):
        return problem
    data_root = Path(cfg.data_root)
    if cfg.dataset in ROOTED_DATASETS and (problem := folder_problem("--data-root", data_root, writes=False)):
        return problem
    for option, folder in (("--out", cfg.out), ("--checkpoint-dir", cfg.checkpoint_dir)):
        if folder and (problem := folder_problem(option, Path(folder))):
            return problem
    if cfg.save_final and (problem := file_problem("--save-final", Path(cfg.save_final))):
        return problem

    try:
        samples = train_set_size(cfg)
    except DataError as exc:  # a text file that cannot be read, or is too short
        return str(exc)
    if cfg.global_batch_size > samples:
        return (
            f"--global-batch-size {cfg.global_batch_size} is larger than the {cfg.dataset} training set "
            f"({samples} samples): one step would need more samples than there are"
        )
    # MNIST and Fashion-MNIST are read from their IDX files without torchvision; CIFAR-10's loader and
    # resnet18 are torchvision's (--dataset synthetic does not spare resnet18 torchvision)
    needs_torchvision = cfg.dataset == "cifar10" or cfg.model == "resnet18"
    if needs_torchvision and (why := torchvision_problem()):
        what = f"--model {cfg.model}" if cfg.model == "resnet18" else f"--dataset {cfg.dataset}"
        instead = "--model lenet or gpt" if cfg.model == "resnet18" else "--dataset synthetic or mnist"
        return (
            f"{what} needs torchvision, and {why}: pip install torchvision (the build made for your torch), "
            f"or use {instead}"
        )
    if cfg.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda: no CUDA device is available to this torch build"
    if cfg.checkpoint_every and not cfg.checkpoint_dir:
        return "--checkpoint-every needs --checkpoint-dir"
    if cfg.resume == "auto" and not cfg.checkpoint_dir:
        return "--resume auto needs --checkpoint-dir"
    if cfg.resume not in (None, "auto") and not Path(cfg.resume).is_file():
        return f"--resume {cfg.resume}: no such checkpoint file"
    if cfg.resume not in (None, "auto") and (problem := checkpoint_problem(cfg.resume)):
        return f"--resume: {problem}"
    if (cfg.profile or cfg.tensorboard) and not cfg.out:
        return "--profile and --tensorboard write under --out; give --out DIR"
    if cfg.profile and cfg.steps is not None and cfg.steps < PROFILED_UNTIL:
        return f"--profile traces steps 3-5 of a run (distref.training.monitor): give --steps {PROFILED_UNTIL} or more"
    return written_over_problem(cfg)


def written_over_problem(cfg: RunConfig) -> str | None:
    """What the run would write over that an earlier run left, or None: a run never replaces another's
    files. A run that starts over needs an --out without a record.json, a --checkpoint-dir without
    checkpoints (where it writes any) and a --save-final that does not exist; a resumed run continues its
    own files, but may not write checkpoints over those later than the one it resumes (a branch goes to
    another --checkpoint-dir) nor make a checkpoint a --save-final file."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return None  # (a restarted attempt of this run: what is there, its earlier attempt wrote)
    held = checkpoints(cfg.checkpoint_dir) if cfg.checkpoint_dir else []
    resumes = cfg.resume is not None and not (cfg.resume == "auto" and not held)  # (auto, none yet: starts)
    writes_checkpoints = cfg.checkpoint_every > 0
    continue_it = "continue that run with --resume auto --checkpoint-dir DIR (or --resume CHECKPOINT)"
    if cfg.save_final and (problem := save_final_problem(Path(cfg.save_final), resumes)):
        return problem
    if cfg.out and not resumes and (Path(cfg.out) / "record.json").exists():
        return f"--out {cfg.out} already holds a record.json; choose another --out, or {continue_it}"
    if held and writes_checkpoints and cfg.resume is None:
        return (
            f"--checkpoint-dir {cfg.checkpoint_dir} already holds checkpoints of a run (the newest "
            f"{held[-1].name}), which this one would write over; continue that run with --resume auto, or "
            "choose another --checkpoint-dir"
        )
    if held and writes_checkpoints and cfg.resume not in (None, "auto"):
        resumed = Path(cfg.resume).resolve()
        if resumed.parent != Path(cfg.checkpoint_dir).resolve():
            return (
                f"--checkpoint-dir {cfg.checkpoint_dir} holds checkpoints of another run (the newest "
                f"{held[-1].name}) than the one --resume {cfg.resume} continues; choose another --checkpoint-dir"
            )
        if later := [p.name for p in held if p.name > resumed.name]:
            return (
                f"--resume {cfg.resume} would write over --checkpoint-dir {cfg.checkpoint_dir}'s "
                f"{', '.join(later[:2])}{' ...' if len(later) > 2 else ''}; continue from the newest with "
                "--resume auto, or branch into another --checkpoint-dir"
            )
    return None


def save_final_problem(final: Path, resumes: bool) -> str | None:
    """Why --save-final `final` would write over what a run wrote, or None. Never where a checkpoint or
    a part of one lies (a parameters-only file there is what --resume auto would take for a checkpoint);
    an existing file only in a resumed session, and only a --save-final of an earlier session (parameters
    only), not a checkpoint, a record or anything else."""
    resolved = final.resolve()
    if CHECKPOINT_FILE.match(resolved.name) or any(CHECKPOINT_FOLDER.match(p.name) for p in resolved.parents):
        return (
            f"--save-final {final} is where a checkpoint's files go (step-N.pt, step-N/): a parameters-only "
            "file there would be taken for one, or replace one; choose another name"
        )
    if not final.exists():
        return None
    if not resumes:
        return (
            f"--save-final {final} is a file already there, which this run would write over; choose another "
            "path, or continue that run with --resume auto --checkpoint-dir DIR (or --resume CHECKPOINT)"
        )
    if (problem := not_a_checkpoint(final)) is None or "is not a checkpoint" not in problem:
        return (
            f"--save-final {final} is a file already there that no earlier --save-final wrote (a --save-final "
            "holds parameters only), which this run would write over; choose another path"
        )
    return None


@contextlib.contextmanager
def exit_on_bad_input(impl: str, say: bool = True) -> Iterator[None]:
    """Bad input found after parsing (a dataset that fails its md5, a checkpoint of another run): one
    line on stderr (where `say`: rank 0 of several that all found it) and exit 2, as bad options do."""
    try:
        yield
    except (DataError, CheckpointError) as exc:
        fail(str(exc), impl) if say else exit_after_rank_0_spoke(2)
