"""The command line: python -m distref.plan."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from distref.config import OneLineErrorParser, positive_int
from distref.distributed.partition import MODEL_DATASETS as PROJECT_DATASETS
from distref.plan.cluster import DEFAULT_MFU, GPUS, RESERVED_BYTES, Cluster, Training
from distref.plan.model import MODELS, Model, PlanError, custom_model, decoder, parameters_only, project_model
from distref.plan.output import plot, render_markdown, render_text
from distref.plan.ranking import make_plan
from distref.plan.simulation import simulate_row
from distref.plan.validate import render_validation, validate


def resolve_model(args: argparse.Namespace) -> Model:
    """The model the options name: a preset, one of this project's, module:function, or --params N; the
    model options that do not apply to it refused."""
    name = args.model
    if args.seq and name not in MODELS:
        raise PlanError(f"--seq is a decoder preset's ({', '.join(MODELS)}); {model_named(args)} has its own")
    if (args.sample_shape or args.tokens) and (name is None or ":" not in name):
        given = "--sample-shape" if args.sample_shape else "--tokens"
        raise PlanError(f"{given} describes a module:function's input; {model_named(args)} has its own")
    if args.tokens and not args.sample_shape:
        raise PlanError("--tokens needs --sample-shape T (the tokens per sample)")
    if args.params is not None:
        return parameters_only(args.params)
    if name in MODELS:
        shape = MODELS[name]
        if args.seq:
            shape = dataclasses.replace(shape, seq=args.seq)
        return decoder(name, shape)
    if name in PROJECT_DATASETS:
        return project_model(name)
    if ":" in name:
        return custom_model(name, args.sample_shape, args.tokens)
    known = ", ".join([*MODELS, *PROJECT_DATASETS])
    raise PlanError(f"unknown model {name!r}: one of {known}, module:function, or --params N")


def model_named(args: argparse.Namespace) -> str:
    return f"--params {args.params}" if args.params is not None else f"--model {args.model}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; argparse's own errors in one line, exit 2 (OneLineErrorParser)."""
    parser = OneLineErrorParser(
        prog="python -m distref.plan",
        description="Which strategy for my model on my GPUs, from the formulas this project proves (docs/plan.md).",
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        help=f"a preset ({', '.join(MODELS)}), lenet, resnet18, gpt, gpt2 (GPT-2 small as the impls train it), or module:function",
    )
    model.add_argument(
        "--params",
        type=parameter_count,
        help="a bare parameter count (7500000000 or 7.5e9): model states only",
    )
    model.add_argument("--seq", type=positive_int, help="sequence length (a preset's: 2048 or 4096)")
    model.add_argument(
        "--sample-shape", type=shape_of, help="module:function's input per sample, e.g. 3,224,224"
    )
    model.add_argument(
        "--tokens", action="store_true", help="module:function takes token ids (its sample: T)"
    )
    hw = parser.add_argument_group("hardware")
    hw.add_argument("--gpu", default="h100-80gb", help=f"one of {', '.join(GPUS)}")
    hw.add_argument("--gpus", type=positive_int, help="GPUs in all (default: one node's)")
    hw.add_argument("--nodes", type=positive_int, help="nodes (GPUs = nodes × GPUs per node)")
    hw.add_argument("--gpus-per-node", type=positive_int)
    hw.add_argument("--tp", type=positive_int, help="only meshes of this tensor-parallel degree")
    hw.add_argument("--pp", type=positive_int, help="only meshes of this many pipeline stage ranks")
    hw.add_argument(
        "--cp", type=positive_int, help="only context-parallel meshes of this degree (ring and Ulysses)"
    )
    hw.add_argument(
        "--ep", type=positive_int, help="only expert-parallel meshes of this degree (a mixture of experts)"
    )
    hw.add_argument("--memory-gb", type=figure(1e9), help="memory per GPU, GB (10⁹ bytes)")
    hw.add_argument("--peak-tflops", type=figure(1e12), help="dense peak in the training's precision")
    hw.add_argument("--intra-node-gbps", type=figure(1e9), help="GB/s per GPU one way within a node")
    hw.add_argument("--inter-node-gbps", type=figure(1e9), help="GB/s per GPU one way between nodes")
    training = parser.add_argument_group("training")
    training.add_argument(
        "--global-batch", type=positive_int, default=256, help="samples (sequences) per step"
    )
    training.add_argument(
        "--micro-batch", type=positive_int, help="samples per GPU per micro-step (default: 1)"
    )
    training.add_argument(
        "--grad-accum", type=positive_int, help="micro-steps per step (sets the micro-batch instead)"
    )
    training.add_argument(
        "--precision",
        choices=["mixed", "autocast", "fp32"],
        default="mixed",
        help="mixed: 16-bit parameters and gradients with fp32 master copies (DeepSpeed's, the ZeRO paper's "
        "bytes); autocast: fp32 parameters computing in bf16 (the impls' --precision bf16); default mixed",
    )
    training.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    training.add_argument("--activation-checkpointing", action="store_true")
    training.add_argument(
        "--mfu", type=fraction, default=DEFAULT_MFU, help="utilisation of peak while computing"
    )
    out = parser.add_argument_group("output")
    form = out.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="the ranked rows as a JSON list")
    form.add_argument("--md", action="store_true", help="a Markdown table")
    out.add_argument("--plot", type=Path, metavar="PNG", help="memory per GPU vs GPUs, step time by strategy")
    out.add_argument(
        "--simulate",
        nargs="?",
        const=1,
        type=positive_int,
        metavar="N",
        help="run row N's sharding (default: the first) on the fake process group",
    )
    parser.add_argument(
        "--validate", nargs="+", type=Path, metavar="RUN_DIR", help="runs' records against the plan"
    )
    args = parser.parse_args(argv)
    if args.validate is not None:  # (it plans each run's own model, layout and batch)
        given = [
            f"--{dest.replace('_', '-')}"
            for dest, value in vars(args).items()
            if dest not in ("validate", "json") and value != parser.get_default(dest)
        ]
        if given:
            parser.error(f"--validate RUN_DIR… plans each run as it ran: it takes no {', '.join(given)}")
    elif (args.model is None) == (args.params is None):
        parser.error("give --model NAME or --params N (not both), or --validate RUN_DIR…")
    if args.micro_batch is not None and args.grad_accum is not None:
        parser.error(
            "give --micro-batch or --grad-accum, not both: the other follows from the global batch and the mesh"
        )
    return args


def shape_of(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: sizes separated by commas, e.g. 3,224,224") from None
    if not dims or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: sizes must be positive")
    return dims


def parameter_count(text: str) -> int:
    """A whole number of parameters, written out or as 7.5e9."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of parameters") from None
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {text}")
    return int(value)


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def figure(unit: float) -> Callable[[str], float]:
    """An argparse type: a positive number of `unit`s (GB: 1e9 bytes) that stays finite in the unit."""

    def parse(text: str) -> float:
        value = positive_float(text)
        if not math.isfinite(value * unit):
            raise argparse.ArgumentTypeError(f"{text} is too large")
        return value

    return parse


def fraction(text: str) -> float:
    """An argparse type: a fraction of the peak, in (0, 1]."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"a fraction of the peak in (0, 1], got {text}")
    return value


def resolve_cluster(args: argparse.Namespace) -> Cluster:
    """The GPU preset with the figures overridden, and how many: --gpus, or --nodes of it."""
    if args.gpu not in GPUS:
        raise PlanError(f"unknown GPU {args.gpu!r}: one of {', '.join(GPUS)} (and override its figures)")
    gpu = GPUS[args.gpu]
    overrides = {
        "gpus_per_node": args.gpus_per_node,
        "memory_bytes": args.memory_gb and int(args.memory_gb * 1e9),
        "intra_node_bytes_per_s": args.intra_node_gbps and args.intra_node_gbps * 1e9,
        "inter_node_bytes_per_s": args.inter_node_gbps and args.inter_node_gbps * 1e9,
    }
    gpu = dataclasses.replace(gpu, **{k: v for k, v in overrides.items() if v})
    if args.peak_tflops:
        peak = args.peak_tflops * 1e12
        gpu = dataclasses.replace(gpu, peak_flops={"mixed": peak, "fp32": peak})
    if args.memory_gb and gpu.memory_bytes <= RESERVED_BYTES:
        raise PlanError(
            f"--memory-gb {args.memory_gb}: not above the {RESERVED_BYTES / 1e9:.1f} GB each GPU keeps"
        )
    if args.nodes and args.gpus and args.gpus != args.nodes * gpu.gpus_per_node:
        raise PlanError(f"--gpus {args.gpus} is not --nodes {args.nodes} × {gpu.gpus_per_node} GPUs per node")
    gpus = args.gpus or (args.nodes or 1) * gpu.gpus_per_node
    if gpus > gpu.gpus_per_node and gpus % gpu.gpus_per_node:
        raise PlanError(f"{gpus} GPUs do not fill nodes of {gpu.gpus_per_node}: give whole nodes")
    return Cluster(gpu, gpus)


# (what each splits the model by)
MESH_OPTIONS = {"--tp": "tensor", "--pp": "pipeline", "--cp": "context", "--ep": "expert"}


def check_mesh(
    tp: int | None, pp: int | None, cluster: Cluster, cp: int | None = None, ep: int | None = None
) -> None:
    """A mesh asked for must divide the GPUs, and be one this project implements (2-D at most: one of
    tensor, pipeline and context parallelism beside data parallelism; expert parallelism over its groups'
    copies). --ep's degree 1 is a mesh of its own (every GPU holds every expert): with another, refused."""
    asked = {name: degree for name, degree in zip(MESH_OPTIONS, (tp, pp, cp, ep), strict=True) if degree}
    split = [name for name, degree in asked.items() if degree > 1 or name == "--ep"]
    if len(split) > 1:
        given = " with ".join(f"{name} {asked[name]}" for name in split)
        kinds = " and ".join(MESH_OPTIONS[name] for name in split)
        raise PlanError(f"{given}: no impl here combines {kinds} parallelism")
    for name, degree in asked.items():
        if cluster.gpus % degree:
            raise PlanError(f"{name} {degree} does not divide the {cluster.gpus} GPUs")


def check_plot_path(path: Path) -> None:
    """--plot's file must be one matplotlib can write, in a folder that exists: said before planning."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    formats = Figure().canvas.get_supported_filetypes()
    if path.suffix.lower().lstrip(".") not in formats:
        raise PlanError(f"--plot {path}: name a file ending in one of .{', .'.join(sorted(formats))}")
    if not path.parent.is_dir():
        raise PlanError(f"--plot {path}: no folder {path.parent}")


def one_line(message: str) -> str:
    """An error's message on one line (what user code raised may span several)."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


PLANNER_TORCH = "2.11"  # the oldest torch the planner runs on (ci/torch_floor.toml)


def torch_too_old() -> str | None:
    """Why this torch cannot plan, or None. The planner builds each impl's pipeline schedules and reads
    their actions as letters ("F", "B", "W": torch 2.11's pipelining), and clears DTensor's sharding
    caches between simulated layouts (2.11's debug function); the impls' training needs less (their
    pyproject.toml). torch itself is asked, not its version number."""
    try:
        from torch.distributed.pipelining.schedules import _ComputationType
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache  # noqa: F401

        _ComputationType("F")
    except (ImportError, ValueError):
        import torch

        return (
            f"the planner needs torch {PLANNER_TORCH} or later (its pipeline schedules and DTensor); "
            f"this is {torch.__version__}"
        )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """python -m distref.plan: the plan (or --validate's comparison) on stdout; 2 and one line on bad input,
    1 and one line on a torch too old to plan with."""
    args = parse_args(argv)
    if (problem := torch_too_old()) is not None:
        print(f"python -m distref.plan: error: {problem}", file=sys.stderr)
        return 1
    try:
        return planned(args)
    except PlanError as e:
        print(f"python -m distref.plan: error: {one_line(str(e))}", file=sys.stderr)
        return 2


def planned(args: argparse.Namespace) -> int:
    """The plan, --validate's comparison or --simulate's run, on stdout; PlanError on bad input."""
    if args.validate:
        results = validate(args.validate)
        print(json.dumps(results, indent=1) if args.json else render_validation(results))
        return 0
    if args.plot:
        check_plot_path(args.plot)
    model, cluster = resolve_model(args), resolve_cluster(args)
    training = Training(
        global_batch=args.global_batch,
        micro_batch=args.micro_batch or 1,
        precision=args.precision,
        optimizer=args.optimizer,
        checkpointing=args.activation_checkpointing,
        mfu=args.mfu,
        grad_accum=args.grad_accum,
        device="cpu" if args.gpu == "cpu" else "cuda",  # (whose kernels save the activations)
    )
    check_mesh(args.tp, args.pp, cluster, args.cp, args.ep)
    plan = make_plan(model, cluster, training, args.tp, args.pp, args.cp, args.ep)
    if not plan.rows:
        raise PlanError(f"no layout can run: {'; '.join(dict.fromkeys(w for _, w in plan.skipped))}")
    if args.json:
        print(json.dumps([row.as_dict() | {"rank": i} for i, row in enumerate(plan.rows, 1)], indent=1))
    elif args.md:
        print(render_markdown(plan))
    else:
        print(render_text(plan))
    if args.plot:
        try:
            plot(plan, args.plot)
        except OSError as e:  # (the folder checked, the file not writable)
            raise PlanError(f"--plot {args.plot}: {e.strerror or e}") from None
        print(f"plot: {args.plot}", file=sys.stderr)
    if args.simulate:
        if args.simulate > len(plan.rows):
            raise PlanError(f"--simulate {args.simulate}: the plan has {len(plan.rows)} rows")
        print(simulate_row(plan, plan.rows[args.simulate - 1]), file=sys.stderr if args.json else sys.stdout)
    return 0
