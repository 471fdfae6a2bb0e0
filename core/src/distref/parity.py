"""The parity matrix: every impl, at every world size and accumulation it supports, with SGD and AdamW, in
fp32 and fp64, against impls/single.

    python -m distref.parity                        # every impl; lenet, synthetic data, 10 steps
    python -m distref.parity --impls ddp,pipeline --model gpt --steps 20
    python -m distref.parity --jobs 1                # one case at a time (default 2)
    nox -s parity

Which single run is the oracle, and how close it must be (the README's "Parity: what we know"):
- fp64, any optimizer: plain single in fp64, within FP64_TOLERANCE. fp64 rounding (~1e-16) stays
  negligible even where AdamW normalises tiny gradients, so the other summation order of ranks,
  all-reduces and micro-batches does not matter.
- fp32 SGD: plain single, within FP32_TOLERANCE (SGD does not amplify rounding).
- fp32 AdamW: single `--grad-accum S`, S = the micro-batch sums the impl makes per step, within
  FP32_TOLERANCE; only where S is a power of two (dividing by S is then exact). Elsewhere AdamW turns 1e-7
  rounding into differences of up to 1e-2 between two correct runs: the fp64 column is the proof.

What each impl runs comes from its pyproject.toml, [tool.distref.parity]: `world_sizes`, `accumulation`
(the option that splits a step: --grad-accum, pipeline's --microbatches) with its `values`, `variants`
(strategy options, one row each) and `sums` ("world": each rank sums its own slice, S = world × K; "one":
every rank sees the whole batch, S = K), `model` (an impl that trains one model only: its rows, and their
single references, train that model instead of the workload's), `model_options` (options shaping the model,
given to single's references too: --experts; a variant giving one is refused) and `inexact_fp32` (why fp32 AdamW is not
exact whatever S, e.g. tensor parallelism splitting each matmul's sum). A new impl joins by adding that
table. Cases an impl refuses (DeepSpeed in fp64) show its one-line reason. Writes parity.md (a report section) and parity.json.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import io
import itertools
import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from distref.config import OneLineErrorParser, with_defaults
from distref.impl_folders import discover, validate
from distref.parity_metric import FP32_TOLERANCE, FP64_TOLERANCE, max_relative_difference

WORKLOAD = {
    "--model": "lenet",
    "--dataset": "synthetic",
    "--steps": "10",
    # Divisible by every world size × accumulation in the matrix (2, 3, 4 × 1, 2; 2, 4 micro-batches).
    "--global-batch-size": "48",
    "--lr": "0.01",
    "--log-every": "10",
}
COLUMNS = [("fp32", "sgd"), ("fp32", "adamw"), ("fp64", "sgd"), ("fp64", "adamw")]
# Every impl's rows again on masked targets: gpt on `--dataset masked`, whose samples score 1 to 8 of their
# 16 targets. There a split step equals single only if its loss is the mean over the global batch's scored
# targets (docs/parity.md, "One global batch, one loss"); on lenet's class labels any split weighs alike.
MASKED_WORKLOAD = ("--model", "gpt", "--dataset", "masked")
# gpt with AdamW turns fp32 rounding (the ranks' sums in another order) into lr-sized differences between two
# correct runs (distref.testing.workloads): ddp ×4 --grad-accum 2 came within 8.2e-6 of single --grad-accum
# 8 after 4 steps, and 1e-5 is no margin. Its fp64 column is the proof.
MASKED_FP32_ADAMW = "gpt AdamW amplifies fp32 rounding: not exact in fp32 (fp64 column)"


def parity_settings(impl_dir: Path) -> dict:
    """The impl's [tool.distref.parity] table, with defaults for a one-process impl."""
    with open(impl_dir / "pyproject.toml", "rb") as f:
        table = tomllib.load(f).get("tool", {}).get("distref", {}).get("parity", {})
    return {
        "world_sizes": table.get("world_sizes", [1]),
        "accumulation": table.get("accumulation", "--grad-accum"),
        "values": table.get("values", [1, 2]),
        "variants": table.get("variants", [[]]),
        "sums": table.get("sums", "one"),
        "model": table.get("model"),
        "model_options": table.get("model_options", []),
        "inexact_fp32": table.get("inexact_fp32"),
    }


def options_single_takes(variants: list[list[str]]) -> list[str]:
    """The options in an impl's parity `variants` that are the run contract's (single's too): a variant
    is the strategy's own options, and single's reference runs without it (expert_parallel's --top-k 1 as
    a variant once compared top-1 runs with top-2 references: 0.73 apart)."""
    from distref.cli import build_parser

    core = build_parser("single")._option_string_actions
    return sorted({option for variant in variants for option in variant if option in core})


def oracle(impl: str, settings: dict, world: int, accum: int, precision: str, optimizer: str) -> tuple:
    """(single --grad-accum S to compare with, tolerance), or (None, why the cell does not apply)."""
    if precision == "fp64":
        return 1, FP64_TOLERANCE
    if optimizer == "sgd":
        return 1, FP32_TOLERANCE
    if impl == "single":
        return None, "the oracle itself"
    if settings["inexact_fp32"]:
        return None, settings["inexact_fp32"]
    sums = accum * (world if settings["sums"] == "world" else 1)
    if sums & (sums - 1):
        return None, f"{sums} micro-batch sums: not exact in fp32 (fp64 column)"
    return sums, FP32_TOLERANCE


def accumulation_of(cfg, settings: dict) -> int:
    """The run's value of the impl's accumulation option (--grad-accum, or pipeline's --microbatches)."""
    name = settings["accumulation"].lstrip("-").replace("-", "_")
    value = getattr(cfg, name, None)
    return value if value is not None else getattr(cfg.strategy, name)


def exact_oracle(impl: str, settings: dict, cfg, world: int) -> tuple[str, int, float]:
    """(precision, single's --grad-accum, tolerance) of the exact check of a run of `cfg` at `world` ranks:
    fp32 where the oracle is exact in fp32 (SGD; AdamW with a power-of-two split), else fp64."""
    accum = accumulation_of(cfg, settings)
    reference, tolerance = oracle(impl, settings, world, accum, "fp32", cfg.optimizer)
    if reference is not None:
        return "fp32", reference, tolerance
    reference, tolerance = oracle(impl, settings, world, accum, "fp64", cfg.optimizer)
    return "fp64", reference, tolerance


# Options of a longer run that its parity check replaces or drops: it runs SHORT_STEPS steps, evaluates
# once, measures nothing and writes nothing but its final parameters.
SHORT_STEPS = 20
_DROPPED = {
    "--epochs",
    "--steps",
    "--target-accuracy",
    "--eval-every",
    "--log-every",
    "--checkpoint-every",
    "--checkpoint-dir",
    "--resume",
    "--out",
    "--save-final",
    "--precision",
    "--tensorboard",
    "--profile",
}
_FLAGS = {"--tensorboard", "--profile"}  # dropped options that take no value


def shortened(args: list[str], precision: str, drop: set[str] = frozenset()) -> list[str]:
    """`args` as a parity case: SHORT_STEPS steps in `precision`, without the options in _DROPPED | drop."""
    kept, skip_value = [], False
    for arg in args:
        if skip_value:
            skip_value = False
            continue
        name = arg.split("=")[0]
        if name in _DROPPED | drop:
            skip_value = "=" not in arg and name not in _FLAGS
            continue
        kept.append(arg)
    steps = str(SHORT_STEPS)
    return [*kept, "--steps", steps, "--log-every", steps, "--eval-every", steps, "--precision", precision]


def launcher(info: dict, world: int) -> list[str]:
    if info["launcher"] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    return [sys.executable]


def exact_parity(
    impl: str, available: dict, args: list[str], world: int, out: Path, references: dict, reference_dir: Path
) -> dict:
    """The exact-oracle check of a longer run (what `nox -s compare` shows as parity): the run's options
    (`args`) shortened to SHORT_STEPS steps, run by the impl at `world` ranks (files in `out`) and by the
    single run that is its oracle (in `reference_dir`; `references` caches those across impls)."""
    info = available[impl]
    settings = parity_settings(info["train"].parent)
    distributed = info["launcher"] == "torchrun"
    cfg = validate(info["train"], args, world, distributed)
    precision, accum, tolerance = exact_oracle(impl, settings, cfg, world)
    result = {
        "steps": SHORT_STEPS,
        "precision": precision,
        "oracle": f"single --grad-accum {accum}" if accum > 1 else "single",
        "tolerance": tolerance,
    }
    case = shortened(args, precision)
    if problem := refusal(info["train"], case, world, distributed):
        return {**result, "refused": problem}
    out.mkdir(parents=True, exist_ok=True)
    if (precision, accum) not in references:
        reference_dir.mkdir(parents=True, exist_ok=True)
        path = reference_dir / f"single-{precision}-accum{accum}.pt"
        single_case = [*shortened(args, precision, drop={"--grad-accum"}), "--grad-accum", str(accum)]
        command = [sys.executable, str(available["single"]["train"]), *single_case, "--save-final", str(path)]
        references[precision, accum] = path if run(command, path.with_suffix(".log")) == 0 else None
    final = out / f"{impl}-{precision}.pt"
    code = run(
        [*launcher(info, world), str(info["train"]), *case, "--save-final", str(final)],
        final.with_suffix(".log"),
    )
    reference = references[precision, accum]
    if code != 0 or reference is None:
        return {**result, "error": f"exit code {code}: see {final.with_suffix('.log')}"}
    import torch

    a, b = (torch.load(p, weights_only=True) for p in (final, reference))
    difference = max_relative_difference(a, b)
    return {**result, "difference": difference, "passed": difference <= tolerance}


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="python -m distref.parity", description=__doc__.splitlines()[0])
    parser.add_argument("--impls", help="comma-separated impls (default: every impls/*/train.py)")
    parser.add_argument(
        "--out", help="folder for parity.md, parity.json and the runs (default runs/parity/<time>)"
    )
    parser.add_argument("--impls-dir", default="impls")
    parser.add_argument(
        "--no-masked",
        dest="masked",
        action="store_false",
        help="leave out the rows on masked targets (gpt, --dataset masked; they double the matrix's time)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=2,
        help="cases run at once (default 2: a 10-step case is mostly process start-up, which two cases "
        "overlap on 2 cores; results do not depend on it)",
    )
    args, run_args = parser.parse_known_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    available = discover(Path(args.impls_dir))
    chosen = args.impls.split(",") if args.impls else list(available)
    if unknown := [name for name in chosen if name not in available]:
        parser.error(f"unknown impl(s) {', '.join(unknown)}; available: {', '.join(available)}")
    run_args = with_defaults(WORKLOAD, run_args)
    out = Path(args.out or Path("runs") / "parity" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    single = available["single"]["train"]

    # Plan every cell first (validating each run as its train.py would): a bad option fails in a second.
    cells, references = [], set()
    for impl in chosen:
        info, settings = available[impl], parity_settings(available[impl]["train"].parent)
        if shared := options_single_takes(settings["variants"]):
            parser.error(
                f"{impl}'s parity variants give {', '.join(shared)}, a run-contract option that single's "
                "reference would not get: list it in [tool.distref.parity] model_options instead"
            )
        distributed = info["launcher"] == "torchrun"
        own_model = ("--model", settings["model"]) if settings["model"] else ()  # replaces the workload's
        for model, variant in itertools.product((own_model, MASKED_WORKLOAD), settings["variants"]):
            if model == MASKED_WORKLOAD and not args.masked:
                continue
            # (options that shape the model, single's reference given them too: expert_parallel's --experts)
            shaped = (*model, *settings["model_options"])
            for world in settings["world_sizes"]:
                for accum in settings["values"]:
                    row = (impl, " ".join([*shaped, *variant]), world, accum)
                    for precision, optimizer in COLUMNS:
                        case = [
                            *run_args,
                            *shaped,
                            "--precision",
                            precision,
                            "--optimizer",
                            optimizer,
                            *variant,
                        ]
                        case += [settings["accumulation"], str(accum)]
                        reference, tolerance = oracle(impl, settings, world, accum, precision, optimizer)
                        if model == MASKED_WORKLOAD and (precision, optimizer) == ("fp32", "adamw"):
                            reference, tolerance = None, MASKED_FP32_ADAMW
                        cell = {"row": row, "column": (precision, optimizer), "args": case}
                        if reference is None:
                            cells.append({**cell, "skip": tolerance})
                            continue
                        problem = refusal(info["train"], case, world, distributed)
                        if problem:
                            cells.append({**cell, "refused": problem})
                            continue
                        ref_key = (precision, optimizer, reference, shaped)
                        references.add(ref_key)
                        cells.append({**cell, "reference": ref_key, "tolerance": tolerance})

    started = time.perf_counter()

    def run_reference(key: tuple) -> None:
        precision, optimizer, accum, model = key
        name = f"{precision}-{optimizer}-accum{accum}{''.join('-' + value for value in model[1::2])}"
        path = out / "single" / f"{name}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        args_ = [*run_args, *model, "--precision", precision, "--optimizer", optimizer]
        args_ += ["--grad-accum", str(accum)]
        code = run([sys.executable, str(single), *args_, "--save-final", str(path)], path.with_suffix(".log"))
        ref_files[key] = path if code == 0 else None

    ref_files: dict = {}
    # Each job only waits on its subprocess: threads suffice. References first (every cell needs one).
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as jobs:
        list(jobs.map(run_reference, sorted(references)))

    import torch

    to_run = [c for c in cells if "reference" in c]
    done = []

    def run_cell(cell: dict) -> None:
        impl, variant, world, accum = cell["row"]
        variant_name = "-" + variant.replace("--", "").replace(" ", "") if variant else ""
        name = f"{impl}{variant_name}-w{world}-a{accum}-{'-'.join(cell['column'])}"
        final = out / impl / f"{name}.pt"
        final.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        command = [*launcher(available[impl], world), str(available[impl]["train"]), *cell["args"]]
        code = run([*command, "--save-final", str(final)], final.with_suffix(".log"))
        reference = ref_files[cell["reference"]]
        if code != 0 or reference is None:
            cell["error"] = f"exit code {code}: see {final.with_suffix('.log')}"
        else:
            a, b = (torch.load(p, weights_only=True) for p in (final, reference))
            cell["difference"] = max_relative_difference(a, b)
            cell["passed"] = cell["difference"] <= cell["tolerance"]
        done.append(name)
        verdict = cell.get("error") or f"{cell['difference']:.1e} {'ok' if cell['passed'] else 'FAIL'}"
        print(
            f"[{len(done)}/{len(to_run)}] {name}: {verdict} ({time.perf_counter() - t0:.0f}s, "
            f"{time.perf_counter() - started:.0f}s elapsed)",
            flush=True,
        )

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as jobs:
        list(jobs.map(run_cell, to_run))

    section = render(cells, run_args, time.perf_counter() - started)
    (out / "parity.md").write_text(section)
    (out / "parity.json").write_text(json.dumps(cells, indent=1, default=str) + "\n")
    print("\n" + section + f"\nwritten: {out / 'parity.md'}")
    return 0 if all(c.get("passed", True) and "error" not in c for c in cells) else 1


def refusal(train: Path, args: list[str], world: int, distributed: bool) -> str | None:
    """The impl's one-line refusal of `args` at `world` ranks, or None if it accepts them."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            validate(train, args, world, distributed)
    except SystemExit:
        return err.getvalue().strip().split("error: ", 1)[-1]
    return None


def run(command: list[str], log: Path) -> int:
    """One run, one thread per process (like every measurement here), its output kept in `log`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        return subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=600).returncode


def render(cells: list[dict], run_args: list[str], seconds: float) -> str:
    """The matrix as a markdown section: impl rows, (precision, optimizer) columns."""
    rows = list(dict.fromkeys(c["row"] for c in cells))
    by_key = {(c["row"], c["column"]): c for c in cells}
    header = "| impl | options | ranks | accum | " + " | ".join(f"{p} {o}" for p, o in COLUMNS) + " |"
    lines = [
        "## Parity with single",
        "",
        f"Max relative difference of every parameter after the run (`{' '.join(run_args)}`) against single: "
        f"plain single in fp64 (tolerance {FP64_TOLERANCE:g}) and for fp32 SGD ({FP32_TOLERANCE:g}); for "
        f"fp32 AdamW, single `--grad-accum S` with the impl's S micro-batch sums ({FP32_TOLERANCE:g}, "
        "where S is a power of two). accum: --grad-accum, or pipeline's --microbatches. The rows with "
        f"`{' '.join(MASKED_WORKLOAD)}` train on masked targets (a sample scores 1 to 8 of its 16): there a "
        "split equals single only if its loss is the mean over the global batch's scored targets.",
        "",
        header,
        "|" + "---|" * (4 + len(COLUMNS)),
    ]
    for row in rows:
        impl, variant, world, accum = row
        shown = []
        for column in COLUMNS:
            c = by_key.get((row, column), {})
            if "skip" in c:
                shown.append(f"n/a ({c['skip']})")
            elif "refused" in c:
                shown.append(f"refused: {c['refused']}")
            elif "error" in c:
                shown.append(f"**error**: {c['error']}")
            elif "difference" in c:
                shown.append(f"{c['difference']:.1e} {'✓' if c['passed'] else '**FAIL**'}")
            else:
                shown.append("")
        lines.append(f"| {impl} | {variant or '–'} | {world} | {accum} | " + " | ".join(shown) + " |")
    ran = [c for c in cells if "difference" in c]
    failed = [c for c in cells if "error" in c or not c.get("passed", True)]
    worst64 = max((c["difference"] for c in ran if c["column"][0] == "fp64"), default=float("nan"))
    lines += [
        "",
        f"{len(ran)} runs compared, {len(failed)} failed; largest fp64 difference {worst64:.1e}; "
        f"{seconds / 60:.1f} min.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
