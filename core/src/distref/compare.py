"""Run every impl on the same workload, then build the comparison report.

    python -m distref.compare                                   # lenet, real MNIST, 1 epoch, world 2
    python -m distref.compare --impls ddp --model gpt --dataset synthetic --steps 300 --world-size 4
    nox -s compare -- --impls ddp,dataparallel

Options other than --impls, --world-size, --out and --impls-dir are run options (see README), given to
every impl's train.py and replacing DEFAULT_WORKLOAD's. `single` always runs: it is the reference of the
parity and scaling columns. Every impl's arguments are validated before anything is started; each
run gets --out <dir>/<impl> and --save-final <dir>/<impl>/final.pt. Every process uses one thread, so
that each run's hardware is its number of processes (scaling efficiency: distref.report). After the
runs, each impl's run is checked against its exact oracle (distref.parity.exact_parity: the same
options, 20 steps, against the single run that makes the same sums), written as <dir>/<impl>/parity.json
for the report's parity column. A run that fails appears at the top of the report with its error, is
listed in one line on stderr, and the command exits 1.

The world size of the multi-process impls is --world-size, else 2 on CPU (which every impl must take: an
impl refusing it refuses the options, and compare stops before running anything), else on CUDA one rank
per GPU: the count, up to the GPUs visible, that the most impls fit (default_world). An impl that cannot
take it (on one GPU: pipeline, which needs 2 stages) is not run, and is listed with why, on stdout and in
the report, as an impl made for another model is; the others run. Exit 0 when every run that ran
completed; 1 when one failed, or when none of the impls asked for can run here (single alone compares
nothing).
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from distref import impl_version
from distref.cli import RANKS_NEED_A_GPU_EACH
from distref.config import OneLineErrorParser, uses_cuda, with_defaults
from distref.impl_folders import discover, validate
from distref.parity import SHORT_STEPS, exact_parity
from distref.ranks import cuda_gpus, workload_problem
from distref.record import RunRecord, load_record
from distref.report import TARGETS, build_report

DEFAULT_WORKLOAD = {
    "--model": "lenet",
    "--dataset": "mnist",
    "--epochs": "1",
    "--global-batch-size": "64",
    "--optimizer": "adamw",
    "--lr": "2e-3",
    # --target-accuracy: the workload's own (TARGETS, by model and dataset; with_target), or none
    "--eval-every": "100",
    "--log-every": "50",
}


def made_for_the_model(
    available: dict[str, dict], chosen: list[str], run_args: list[str]
) -> tuple[list[str], list[tuple[str, str]]]:
    """(the chosen impls that train the workload's model, [(impl, why not) for the others]): an impl made
    for some models only (tensor_parallel: gpt) is left out of another model's comparison, and the report
    says so, rather than failing the whole comparison."""
    model_option = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    model_option.add_argument("--model", default="lenet")
    model_option.add_argument("--experts", type=int, default=0)
    given = model_option.parse_known_args(run_args)[0]
    model, experts = given.model, given.experts
    left_out = {
        impl: f"trains --model {' / '.join(available[impl]['models'])} only; this workload is --model {model}"
        for impl in chosen
        if available[impl]["models"] and model not in available[impl]["models"]
    }
    for impl in chosen:  # gpt's mixture of experts: the impls that train it, and those made for it only
        takes = available[impl].get("experts", "never")
        if experts and takes == "never":
            left_out.setdefault(
                impl, f"does not train gpt's mixture of experts; this workload has --experts {experts}"
            )
        if not experts and takes == "required":
            left_out.setdefault(
                impl, "trains gpt's mixture of experts only: give --experts E (and --model gpt)"
            )
    return [impl for impl in chosen if impl not in left_out], list(left_out.items())


def with_target(run_args: list[str]) -> tuple[list[str], str]:
    """`run_args` with the target accuracy of their model and dataset (distref.report.TARGETS) unless
    they give one, and a line saying which target applies: a target belongs to its data (MNIST's 0.955
    says nothing of another dataset's curve), so a workload without its own runs without one, said so."""
    options = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    options.add_argument("--model", default="lenet")
    options.add_argument("--dataset", default="mnist")
    options.add_argument("--target-accuracy")
    given, _ = options.parse_known_args(run_args)
    if given.target_accuracy is not None:
        return run_args, f"target accuracy {given.target_accuracy} (given)"
    target = TARGETS.get((given.model, given.dataset))
    if target is None:
        known = ", ".join(f"{m} on {d} {t}" for (m, d), t in TARGETS.items())
        return run_args, (
            f"no target accuracy: none is known for --model {given.model} --dataset {given.dataset} "
            f"(compare's: {known}); give --target-accuracy to measure a time to target"
        )
    return [*run_args, "--target-accuracy", str(target)], (
        f"target accuracy {target} ({given.model} on {given.dataset}'s)"
    )


# Counts of ranks above the GPUs tried, to say how many GPUs an impl that fits none of them needs.
MORE_GPUS_TRIED = 8


def choose_world(
    impls: Sequence[str], counts: Sequence[int], problem_at: Callable[[str, int], str | None]
) -> tuple[int, dict[str, str]]:
    """(the world size of `counts` that the most of `impls` fit, {impl: its problem there} for those that do
    not fit it). Of counts that tie, the largest (more ranks show more of each strategy): where one count
    fits every impl, that is the largest count that fits them all, as before; where none does, the impls
    that fit no count (or fewer than the others) are left out rather than the whole comparison."""
    problems = {n: {i: p for i in impls if (p := problem_at(i, n)) is not None} for n in counts}
    world = max(counts, key=lambda n: (len(impls) - len(problems[n]), n))
    return world, problems[world]


def short_of_gpus(problem: str | None) -> bool:
    """Whether `problem` (an impl's refusal of a count of ranks above the GPUs) is only the GPUs: None (no
    CUDA in the check, as in a test) or distref.cli.gpus_problem's "N ranks on this machine need a CUDA
    device each", which parse_config says once the workload itself fits."""
    return problem is None or RANKS_NEED_A_GPU_EACH in problem


def why_not_run(impl: str, world: int, gpus: int, problem_at: Callable[[str, int], str | None]) -> str:
    """Why `impl` is not run at `world` ranks on `gpus` GPUs, in one line: the counts it fits here, or the
    GPUs it needs (pipeline on one GPU: 2 stages), or that it fits none; with its own refusal of `world`."""
    refusal = f"{world} rank{'s' if world > 1 else ''}: {problem_at(impl, world)}"
    fits = [n for n in range(1, gpus + 1) if problem_at(impl, n) is None]
    if fits:
        return (
            f"world size {world} does not fit it ({refusal}); it fits {', '.join(map(str, fits))}: "
            f"--impls {impl} --world-size {fits[-1]} runs it"
        )
    most = max(MORE_GPUS_TRIED, 2 * gpus)
    needs = next((n for n in range(gpus + 1, most + 1) if short_of_gpus(problem_at(impl, n))), None)
    if needs is not None:
        return f"needs {needs} GPUs, {gpus} visible ({refusal})"
    return f"fits no world size up to {most} ({refusal})"


def default_world(
    available: dict[str, dict], chosen: list[str], run_args: list[str]
) -> tuple[int, list[tuple[str, str]]]:
    """(the world size of the multi-process impls, [(impl, why not run)] for those that cannot take it).

    On CPU 2, which every impl must take: there the world is not the machine's limit, so an impl that
    refuses it refuses the options, and the validation before any run says so. On CUDA one rank per GPU,
    at most the GPUs visible: the count that the most chosen multi-process impls fit, the largest of those
    that tie (choose_world), said in one line; each impl that does not fit it is not run, listed with why
    (on one GPU, pipeline: it needs 2 stages), the others all run at that one world size. With no usable
    GPU, 2: each impl's own check then says what is wrong."""
    device_option = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    device_option.add_argument("--device", default="auto")
    device = device_option.parse_known_args(run_args)[0].device
    if device == "cpu":
        return 2, []
    gpus, said = cuda_gpus()
    if gpus == 0:
        if device == "cuda":
            print(f"compare: {said}", flush=True)
        return 2, []
    trains = {i: available[i]["train"] for i in chosen if available[i]["launcher"] == "torchrun"}
    asked: dict[tuple[str, int], str | None] = {}

    def problem_at(impl: str, ranks: int) -> str | None:
        if (impl, ranks) not in asked:
            asked[impl, ranks] = workload_problem(trains[impl], run_args, ranks)
        return asked[impl, ranks]

    counts = range(1, gpus + 1)
    world, refused = choose_world(list(trains), counts, problem_at)
    larger = [
        f"{n} ranks: " + "; ".join(f"{i}: {p}" for i in trains if (p := problem_at(i, n)))
        for n in reversed(counts)
        if n > world
    ]
    why = f"; not more: {'; '.join(larger)}" if larger else ""
    print(f"compare: world size {world}, one rank per GPU of {said}{why}", flush=True)
    return world, [(impl, why_not_run(impl, world, gpus, problem_at)) for impl in refused]


def _tee(stream, *sinks) -> None:
    """Copy a child's output to the console and its log, bytes as they come (progress bars included)."""
    for chunk in iter(lambda: stream.read1(4096), b""):
        for sink in sinks:
            sink.write(chunk)
            sink.flush()


THREADS_PER_RANK = 1  # every process compare starts (run_one): its hardware is its processes


def run_one(command: list[str], log_path: Path) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS_PER_RANK)}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        copier = threading.Thread(target=_tee, args=(proc.stdout, sys.stdout.buffer, log))
        copier.start()
        code = proc.wait()
        copier.join()
    return code


def failure_reason(log_path: Path, code: int) -> str:
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return f"exit code {code}: " + (errors[-1] if errors else (lines[-1] if lines else "no output"))[:300]


def main(argv: list[str] | None = None) -> None:
    defaults = " ".join(f"{option} {value}" for option, value in DEFAULT_WORKLOAD.items())
    targets = ", ".join(f"{m} on {d}: {t}" for (m, d), t in TARGETS.items())
    parser = OneLineErrorParser(
        prog="python -m distref.compare",
        description=__doc__.splitlines()[0],
        epilog=f"Any other option is a run option passed to every impl's train.py (see its --help). Unless "
        f"given, the workload is: {defaults}; --target-accuracy is the model and dataset's own ({targets}), "
        "none for the others.",
    )
    parser.add_argument(
        "--impls", help="comma-separated impls; single is always added (default: every impls/*/train.py)"
    )
    parser.add_argument(
        "--world-size",
        type=int,
        help="ranks of the multi-process impls, which each must take (default: 2 on CPU; on CUDA one per "
        "GPU, as many as the most impls' workloads allow: the others are not run, and listed with why)",
    )
    parser.add_argument("--out", help="directory for the runs and the report (default runs/compare/<time>)")
    parser.add_argument("--impls-dir", default="impls")
    args, run_args = parser.parse_known_args(argv)

    available = discover(Path(args.impls_dir))
    chosen = args.impls.split(",") if args.impls else list(available)
    unknown = [name for name in chosen if name not in available]
    if unknown:
        parser.error(f"unknown impl(s) {', '.join(unknown)}; available: {', '.join(available)}")
    if "single" in available and "single" not in chosen:  # the reference for parity and scaling
        chosen.insert(0, "single")
    if args.world_size is not None and args.world_size < 1:
        parser.error("--world-size must be >= 1")
    run_args, target_said = with_target(with_defaults(DEFAULT_WORKLOAD, run_args))
    print(f"compare: {target_said}", flush=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or Path("runs") / "compare" / stamp)

    asked = [impl for impl in chosen if impl != "single"]
    chosen, not_run = made_for_the_model(available, chosen, run_args)
    if args.world_size is None:
        args.world_size, unfit = default_world(available, chosen, run_args)
        chosen = [impl for impl in chosen if impl not in dict(unfit)]
        not_run += unfit
    for impl, reason in not_run:
        print(f"{impl}: not run ({reason})", flush=True)
    if asked and not [impl for impl in chosen if impl != "single"]:  # single alone compares nothing
        sys.exit(
            "distref.compare: error: none of the impls asked for can run here: "
            + "; ".join(f"{impl}: {reason}" for impl, reason in not_run)
        )

    # Validate everything before starting anything: a typo fails in a second, not after the first impl.
    plans = []
    for impl in chosen:
        info = available[impl]
        world = args.world_size if info["launcher"] == "torchrun" else 1
        run_dir = out / impl
        full_args = [*run_args, "--out", str(run_dir), "--save-final", str(run_dir / "final.pt")]
        cfg = validate(info["train"], full_args, world, info["launcher"] == "torchrun")
        # Each train.py starts its own ranks (`python train.py --nproc-per-node N`, torchrun underneath):
        # a rank's failure then ends in one line naming it, not torchrun's traceback.
        ranks = ["--nproc-per-node", str(world)] if info["launcher"] == "torchrun" else []
        plans.append((impl, world, cfg, run_dir, [sys.executable, str(info["train"]), *full_args, *ranks]))

    started = time.perf_counter()
    for i, (impl, world, cfg, run_dir, command) in enumerate(plans, 1):
        print(
            f"\n[{i}/{len(plans)}] {impl} (world {world}) — {time.perf_counter() - started:.0f}s elapsed",
            flush=True,
        )
        run_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        code = run_one(command, run_dir / "log.txt")
        status = "completed" if code == 0 else "FAILED"
        print(f"[{i}/{len(plans)}] {impl}: {status} in {time.perf_counter() - t0:.0f}s", flush=True)
        if code != 0 and not (run_dir / "record.json").exists():
            # The run died before writing its record (torchrun failure, crash at start-up): say so, in a
            # record of compare's: the run's device, as its options ask, the threads compare gave it, and
            # nothing it did not measure.
            import torch

            record = RunRecord(
                impl, impl_version(available[impl]["train"]), cfg, world, torch.device("cpu"), "n/a"
            )
            record.data["environment"].update(
                device="cuda" if uses_cuda(cfg) else "cpu",
                device_name="not recorded",
                threads_per_rank=THREADS_PER_RANK,
            )
            record.fail(f"ended before writing its record: {failure_reason(run_dir / 'log.txt', code)}")

    # Parity from the exact oracle: each impl's run, shortened to a few steps, against the single run that
    # makes the same sums (over a whole run, rounding drifts apart; the report shows that drift apart).
    import json

    print(f"\nparity: each impl against its exact oracle ({SHORT_STEPS} steps)", flush=True)
    references: dict = {}
    for impl, world, _, run_dir, _ in plans:
        if impl == "single" or not (run_dir / "final.pt").exists():
            continue
        # Its files go inside the run folders, so that `distref.report <dir>/*` still means the runs.
        check = exact_parity(
            impl, available, run_args, world, run_dir / "parity", references, out / "single" / "parity"
        )
        (run_dir / "parity.json").write_text(json.dumps(check, indent=1) + "\n")
        verdict = check.get("refused") or check.get("error") or f"{check['difference']:.1e}"
        print(f"  {impl} ×{world} vs {check['oracle']} ({check['precision']}): {verdict}", flush=True)

    # The planner beside each run (python -m distref.plan --validate): its formulas checked on every
    # machine compare runs on
    from distref.plan import PlanError, render_validation
    from distref.plan import validate as validate_plan

    recorded = [run_dir for _, _, _, run_dir, _ in plans if (run_dir / "record.json").exists()]
    try:
        validation = validate_plan(recorded)
        (out / "plan_validation.json").write_text(json.dumps(validation, indent=1) + "\n")
        print(f"\nplan: {render_validation(validation)}", flush=True)
    except PlanError as e:
        print(f"\nplan: not validated: {e}", flush=True)
    except Exception as e:  # (a diagnostic after the runs: it must not lose the report)
        print(f"\nplan: not validated: {type(e).__name__}: {e}", flush=True)

    report = build_report([run_dir for _, _, _, run_dir, _ in plans], out, not_run=not_run)
    print(f"\nall {len(plans)} runs done in {time.perf_counter() - started:.0f}s; report: {report.resolve()}")
    failed = failed_runs([(impl, run_dir) for impl, _, _, run_dir, _ in plans])
    if failed:  # a comparison with a failed run is not a result: CI and scripts must see it
        sys.stderr.write(
            f"distref.compare: error: {len(failed)} of {len(plans)} runs failed (report lists them):\n"
        )
        sys.stderr.writelines(f"  {impl}: {error}\n" for impl, error in failed)
        sys.exit(1)


def failed_runs(runs: list[tuple[str, Path]]) -> list[tuple[str, str]]:
    """(impl, its error in one line) for each run whose record says it did not complete."""

    failed = []
    for impl, run_dir in runs:
        record = load_record(run_dir)
        if record["status"] != "completed":
            failed.append((impl, (record.get("error") or "failed").strip().splitlines()[0][:300]))
    return failed


if __name__ == "__main__":
    main()
