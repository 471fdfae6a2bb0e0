"""One command that checks a GPU machine and writes one table: `python ci/gpu_check.py`.

GPU time is scarce and brief (a lent machine for minutes, a cluster node between jobs), so this runs, in
about 6 minutes on one GPU (then the benchmark, 4 more), what the project claims of a GPU and says what it
could not run:

1. the tests marked `gpu` (with 2+ GPUs these include the 2-GPU ones: NCCL, CUDA parity);
2. every `nox -s <impl>-gpu` session at the largest world the GPUs allow (those needing more GPUs than
   there are: "not run: needs 2 GPUs, 1 visible");
3. every impl that starts ranks at world 1 on CUDA, and single as their oracle, on gpt in fp32 (SGD) and
   bf16 (AdamW) (model_parallel as one process with its parts on cuda:0): a run whose costs differ from
   their formulas fails, and so does an fp32 run whose parameters are not single's within fp32's
   tolerance where single makes the same sums (distref.parity.oracle); then `distref.report` on them;
4. fp16 with the grad scaler, activation checkpointing and the profiler once (ddp ×1);
5. `python -m distref.plan --validate` on every record;
6. a speed table: the world-1 bf16 gpt runs, run one at a time (the others share the GPU, several at once);
7. the GPU benchmark (ci/gpu_bench.py): every impl on GPT-2 small in bf16, eager and compiled, against a
   bare loop, last and alone, within --bench-budget-s; its table goes into gpu-check.md.

Everything lands in one folder (default runs/gpu-check/<time>): gpu-check.md, each run's record and log.
It runs with the machine's own torch: no venv is built (a GPU node often reaches no package registry).
What it needs beyond torch (nox, pytest, deepspeed, the MNIST wheel) comes from the offline bundle
(ci/gpu_bundle.py; docs/gpu.md), installed into a folder of its own by `--bundle DIR`.

    python ci/gpu_check.py                          # the machine's python has what it needs
    python ci/gpu_check.py --bundle gpu-wheels   # install the offline bundle first
    python ci/gpu_check.py --device cpu --steps 3   # the same plan on CPU (gloo): a rehearsal (the tiny gpt
                                                    # in the benchmark)

A run passes when it exits 0, its record says completed, its costs equal their formulas and (fp32, world 1)
its parameters single's. Exit 0 when everything that ran passed, 1 otherwise (and when nothing could run),
each failure named with why.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "core" / "src"))  # distref from the source tree: nothing to install
sys.path.insert(0, str(ROOT / "ci"))
from gpu_bundle import write_wrappers  # noqa: E402

from distref import declared_torch, impl_dependencies  # noqa: E402
from distref.impl_folders import discover, gpu_test_files  # noqa: E402

IMPLS = discover(ROOT / "impls")  # name -> its [tool.distref] settings
GPT = ["--model", "gpt", "--dataset", "synthetic", "--global-batch-size", "64", "--lr", "3e-3"]
PRECISIONS = ("fp32", "bf16")
# The world-1 rows' optimizer by precision. fp32's parameters are checked against single's within fp32's
# tolerance (1e-5), and SGD does not amplify rounding: two correct 40-step gpt runs summing in another order
# came 3e-7 apart with SGD, 1e-5 with AdamW (the tolerance itself), and CUDA's kernels need not be
# deterministic. bf16's rows (the speed table, no exact oracle) train with AdamW.
OPTIMIZER = {"fp32": ["--optimizer", "sgd"], "bf16": ["--optimizer", "adamw"]}
# (name, options, the fewest steps it runs) run once on ddp ×1: the features the GPU issue saw work, kept
# working. The profiler traces steps 3-5 (distref.training.monitor.PROFILED_UNTIL: 6 steps at least).
FEATURES = (
    ("fp16", ["--precision", "fp16"], 1),
    ("activation-checkpointing", ["--activation-checkpointing"], 1),
    ("profiler", ["--profile"], 6),
)


@dataclass
class Job:
    """One command of the check: its name in the table, what it runs, where its run (if any) records."""

    name: str
    group: str  # "tests", "session", "world 1", "feature"
    argv: list[str]
    out: Path | None = None  # the run's --out: its record.json
    alone: bool = False  # run with nothing else on the GPU (tests take the GPUs; timings)
    env: dict[str, str] = field(default_factory=dict)
    needs: tuple[str, ...] = ()  # modules beyond torch and distref it imports (the bundle brings them)
    impl: str | None = None  # the impl it runs: its pyproject's torch>= must hold here
    limit_s: float | None = None  # seconds before it is stopped, where not its group's (JOB_LIMIT_S)
    # filled in by run_job
    status: str = "not run"
    why: str = ""
    seconds: float | None = None
    log: Path | None = None


def impl_needs(impl: str) -> tuple[str, ...]:
    """The modules an impl imports beyond torch and distref: its pyproject's other dependencies."""
    names = [re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0] for d in impl_dependencies(ROOT / "impls" / impl)]
    return tuple(n for n in names if n not in ("torch", "distref-core"))


def missing_modules(modules: set[str], env: dict[str, str]) -> set[str]:
    """Those of `modules` the commands' python cannot import (in their environment)."""
    code = "import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] if not importlib.util.find_spec(m)))"
    return set(ask([sys.executable, "-c", code, *sorted(modules)], env).stdout.split())


def version_tuple(version: str) -> tuple[int, ...]:
    """(2, 11) of "2.11.0+cu130": the release, as packaging compares it (local and pre-release parts off)."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:2])


def runnable(
    jobs: list[Job], missing: set[str], torch_version: tuple[int, ...] | None = None
) -> tuple[list[Job], list[tuple[str, str]]]:
    """The jobs whose modules import and whose impl declares this torch, and for each other, why not."""
    kept, not_run = [], []
    for job in jobs:
        lacking = sorted(set(job.needs) & missing)
        floor = (
            version_tuple(declared_torch(ROOT / "impls" / job.impl)) if job.impl and torch_version else None
        )
        if lacking:
            not_run.append(
                (job.name, f"{', '.join(lacking)} not importable here: give --bundle (docs/gpu.md)")
            )
        elif floor and torch_version < floor:
            shown = ".".join(map(str, torch_version))
            not_run.append(
                (job.name, f"{job.impl} needs torch {'.'.join(map(str, floor))} or later, this is {shown}")
            )
        else:
            kept.append(job)
    return kept, not_run


EXPERTS = "4"  # a mixture of experts' experts per block (--experts), for the impls made for one


def workload_options(impl: str) -> list[str]:
    """What an impl's workload needs beyond the dense gpt's options: a mixture of experts (--experts) for
    one made for it (its [tool.distref] experts = "required": it refuses a dense model)."""
    return ["--experts", EXPERTS] if IMPLS[impl].get("experts") == "required" else []


def world_one_impls() -> list[str]:
    """The impls that start ranks (torchrun) and train the dense gpt at world 1: a pipeline needs 2 stages,
    and expert_parallel trains the mixture of experts only (its session and its gpu tests run it)."""
    return [
        i
        for i, settings in IMPLS.items()
        if settings["launcher"] == "torchrun" and i != "pipeline" and settings.get("experts") != "required"
    ]


def plan_jobs(
    gpus: int, device: str, out: Path, steps: int, bench_budget_s: float | None = None
) -> tuple[list[Job], list[tuple[str, str]]]:
    """The check's jobs for `gpus` visible GPUs (on `device`: "cuda", or "cpu" to rehearse), in the order
    they run, and what will not run with why. Pure: the tests call it with a faked GPU count."""
    python = sys.executable
    jobs: list[Job] = []
    not_run: list[tuple[str, str]] = []
    if device == "cuda":
        junit = out / "gpu-tests.xml"
        jobs.append(
            Job(
                "gpu tests",
                "tests",
                [
                    python,
                    "-m",
                    "pytest",
                    "-m",
                    "gpu",
                    "-p",
                    "no:cacheprovider",
                    "-rs",
                    f"--junitxml={junit}",
                    *(str(f.relative_to(ROOT)) for f in gpu_test_files(ROOT)),
                ],
                alone=True,
                env={"DISTREF_GPU_TESTS": "1"},
                needs=("pytest",),
            )
        )
    else:
        not_run.append(("gpu tests", "they need CUDA (--device cpu rehearses the rest)"))
    for impl in IMPLS:
        needed = IMPLS[impl]["min_gpus"] if device == "cuda" else 1
        name = f"{impl}-{'gpu' if device == 'cuda' else 'cpu'}"
        if gpus < needed:
            not_run.append((name, f"needs {needed} GPUs, {gpus} visible"))
            continue
        run_out = out / "sessions" / impl
        # the session's own workload (lenet on MNIST to its target; tensor_parallel's gpt), its world
        options = ["--out", str(run_out), "--save-final", str(run_out / "final.pt")]
        if device != "cuda":
            options += ["--steps", str(steps)]  # the rehearsal only shows the commands work
        jobs.append(
            Job(
                name,
                "session",
                [python, "-m", "nox", "--no-venv", "--no-install", "-s", name, "--", *options],
                run_out,
                needs=("nox", *impl_needs(impl)),
                impl=impl,
            )
        )
    cuda_devices = "cuda:0,cuda:0" if device == "cuda" else "cpu,cpu"
    for precision in PRECISIONS:
        for impl in ["single", *world_one_impls()]:
            run_out = out / "world1" / precision / impl
            options = [*GPT, *OPTIMIZER[precision], "--steps", str(steps), "--precision", precision]
            options += ["--device", device]
            options += ["--out", str(run_out), "--save-final", str(run_out / "final.pt")]
            train = str(ROOT / "impls" / impl / "train.py")
            if impl == "model_parallel":  # one process, both parts on the one GPU
                argv = [python, train, "--devices", cuda_devices, *options]
            elif impl == "single":
                argv = [python, train, *options]
            else:
                argv = [python, train, "--nproc-per-node", "1", *options]
            # bf16's runs give the speed table: each alone on the GPU
            jobs.append(
                Job(
                    f"{impl} ×1 gpt {precision}",
                    "world 1",
                    argv,
                    run_out,
                    alone=precision == "bf16",
                    needs=impl_needs(impl),
                    impl=impl,
                )
            )
    for feature, extra, fewest_steps in FEATURES:
        if feature == "fp16" and device != "cuda":
            not_run.append(("ddp ×1 fp16", "fp16 trains with the grad scaler on CUDA only"))
            continue
        run_out = out / "features" / feature
        options = [*GPT, "--steps", str(max(steps, fewest_steps)), "--device", device, "--out", str(run_out)]
        options += extra
        train = str(ROOT / "impls" / "ddp" / "train.py")
        argv = [python, train, "--nproc-per-node", "1", *options]
        jobs.append(Job(f"ddp ×1 {feature}", "feature", argv, run_out, impl="ddp"))
    # The impls made for gpt's mixture of experts, at world 1 on the one GPU too (the world-1 rows train the
    # dense gpt): on CUDA its optimizer takes a mix of DTensors and plain tensors, which CPU runs never meet
    for impl in (i for i, settings in IMPLS.items() if settings.get("experts") == "required"):
        run_out = out / "features" / f"{impl}-experts"
        options = [*GPT, *workload_options(impl), "--steps", str(steps), "--device", device]
        options += ["--out", str(run_out)]
        argv = [python, str(ROOT / "impls" / impl / "train.py"), "--nproc-per-node", "1", *options]
        jobs.append(
            Job(f"{impl} ×1 gpt experts", "feature", argv, run_out, needs=impl_needs(impl), impl=impl)
        )
    # The benchmark (ci/gpu_bench.py), last and alone (run_all): its own budget, its table in gpu-check.md
    budget = BENCH_BUDGET_S if bench_budget_s is None else bench_budget_s
    bench = [python, str(ROOT / "ci" / "gpu_bench.py"), "--device", device, "--out", str(out / "bench")]
    bench += ["--budget-s", str(budget)]
    if device != "cuda":  # the rehearsal: the tiny gpt, eager, a few steps
        bench += ["--model", "gpt", "--quick", "--modes", "eager", "--steps", str(steps + 3), "--warmup", "1"]
    jobs.append(Job("gpu benchmark", "bench", bench, limit_s=budget + 60))
    return jobs, not_run


# Seconds a job may run before it is stopped (with every process it started): a hung NCCL collective,
# the usual GPU failure, must not take the check's whole budget. The tests get more: several runs each.
JOB_LIMIT_S = {"tests": 240.0}
DEFAULT_JOB_LIMIT_S = 150.0
TIMED_RUN_S = 25.0  # kept back, per timed run, from the jobs before them (start-up ~15 s, 40 steps)
BENCH_BUDGET_S = 240.0  # the benchmark's --budget-s: its eager rows and the first compiled ones on 1 GPU


def run_job(job: Job, env: dict[str, str], logs: Path, deadline: float) -> Job:
    """Run `job` (its log in `logs`), unless the check's time is up; stopped, with every process it
    started (torchrun's agent, the ranks), after its limit. Passed: exit 0 and, for a run, a record that
    says completed (a session that skipped exits 0 too)."""
    if time.monotonic() >= deadline:
        job.status, job.why = "not run", "the check's time budget (--budget-s) was spent"
        return job
    job.log = logs / (job.name.replace(" ", "_").replace("×", "x") + ".log")
    limit = job.limit_s or JOB_LIMIT_S.get(job.group, DEFAULT_JOB_LIMIT_S)
    started = time.monotonic()
    with open(job.log, "w") as log:
        log.write("$ " + shlex.join(job.argv) + "\n")
        log.flush()
        # a session of its own: the whole tree is stopped at once (killing the child alone would leave
        # torchrun's ranks holding the GPU for the jobs after)
        process = subprocess.Popen(
            job.argv,
            cwd=ROOT,
            env={**env, **job.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            stop_tree(process)
            code = None
    job.seconds = time.monotonic() - started
    record = record_of(job)
    if code is None:
        job.status, job.why = "failed", f"stopped after {limit:.0f} s (a hang?): {last_line(job.log)}"
    elif code != 0:
        job.status, job.why = "failed", f"exit code {code}: {last_line(job.log)}"
    elif job.out is not None and record is None:
        job.status, job.why = "failed", f"exit code 0 but no record in {job.out}: {last_line(job.log)}"
    elif record is not None and record.get("status") != "completed":
        job.status, job.why = "failed", f"record says {record.get('status')}: {record.get('error')}"
    else:
        job.status, job.why = "passed", ""
    return job


def stop_tree(process: subprocess.Popen) -> None:
    """SIGTERM to the job's whole process group, SIGKILL to what is left 10 s later."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def run_all(jobs: list[Job], env: dict[str, str], logs: Path, budget_s: float, parallel: int) -> None:
    """Jobs marked alone one by one with nothing else running; the others `parallel` at a time, in
    order: the tests first, then the sessions and runs, the timed runs last, with time kept back for
    them (a third of the budget at most); the benchmark after everything (its own budget), if the check's
    is not spent."""
    deadline = time.monotonic() + budget_s
    bench = [j for j in jobs if j.group == "bench"]
    shared = [j for j in jobs if not j.alone and j not in bench]
    first = [j for j in jobs if j.alone and j.group == "tests"]
    timed = [j for j in jobs if j.alone and j.group != "tests"]
    before_timed = deadline - min(TIMED_RUN_S * len(timed), budget_s / 3)
    for job in first:
        run_job(job, env, logs, before_timed)
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        list(pool.map(lambda j: run_job(j, env, logs, before_timed), shared))
    for job in timed:
        run_job(job, env, logs, deadline)
    for job in bench:
        run_job(job, env, logs, deadline)


# ---- reading what ran --------------------------------------------------------------------------------


def record_of(job: Job) -> dict | None:
    """The record this job's run wrote (None for a job that did not run: not an older one left there)."""
    path = job.out / "record.json" if job.out else None
    if path is None or not path.exists() or job.log is None:
        return None
    return json.loads(path.read_text())


def judge_costs(jobs: list[Job]) -> None:
    """A run that passed but whose communication, model states or activations differ from their formulas
    (the report's "**differs**" cells, distref.report.formula_differences) failed, saying which."""
    from distref.report import formula_differences

    for job in jobs:
        record = record_of(job)
        if job.status == "passed" and record is not None and (differing := formula_differences(record)):
            job.status = "failed"
            job.why = "; ".join(f"{cost} {cell}" for cost, cell in differing.items())


def parity_check(record: dict, final: Path, reference: Path | None) -> dict:
    """A world-1 run's final parameters against single's of the same workload (`reference`), as
    `distref.compare`'s exact check judges them (its parity.json, which the report's parity column reads):
    where the project's oracle rule (distref.parity.oracle) says plain single makes the same sums, within
    its tolerance; else {"not_checked": why}."""
    from distref.parity import oracle, parity_settings
    from distref.parity_metric import max_relative_difference

    impl, config = record["impl"]["name"], record["config"]
    precision = config["precision"]
    result = {"steps": config["steps"], "precision": precision, "oracle": "single"}
    if precision not in ("fp32", "fp64"):
        why = f"no exact oracle in {precision}: the tolerances are fp32's and fp64's"
        return {**result, "not_checked": why}
    settings = parity_settings(ROOT / "impls" / impl)
    option = settings["accumulation"].lstrip("-").replace("-", "_")
    accum = config.get(option) or (config.get("extra") or {}).get(option) or 1
    sums, tolerance = oracle(impl, settings, record["world_size"], accum, precision, config["optimizer"])
    if sums is None:
        return {**result, "not_checked": tolerance}
    if sums != 1:
        return {**result, "not_checked": f"its oracle is single --grad-accum {sums}, not run here"}
    if reference is None or not reference.exists() or not final.exists():
        return {**result, "tolerance": tolerance, "error": "no final.pt from this run or from single"}
    import torch

    a, b = (torch.load(path, map_location="cpu", weights_only=True) for path in (final, reference))
    try:
        difference = max_relative_difference(a, b)
    except ValueError as exc:  # (another model's parameters)
        return {**result, "tolerance": tolerance, "error": str(exc)}
    return {**result, "tolerance": tolerance, "difference": difference, "passed": difference <= tolerance}


def judge_parity(jobs: list[Job]) -> None:
    """Each world-1 run that passed, against single's of its precision (parity_check): its parity.json
    written beside its record, and failed where the difference exceeds the tolerance or cannot be taken."""
    for precision in PRECISIONS:
        runs = [j for j in jobs if j.group == "world 1" and j.name.endswith(f" {precision}")]
        single = next((j for j in runs if j.name.startswith("single ")), None)
        reference = single.out / "final.pt" if single and single.status == "passed" else None
        for job in runs:
            record = record_of(job)
            if job is single or job.status != "passed" or record is None:
                continue
            check = parity_check(record, job.out / "final.pt", reference)
            (job.out / "parity.json").write_text(json.dumps(check, indent=1) + "\n")
            if "error" in check:
                job.status, job.why = "failed", f"parity with single: {check['error']}"
            elif "passed" in check and not check["passed"]:
                job.status = "failed"
                job.why = (
                    f"parity with single {check['difference']:.1e} > {check['tolerance']:g} "
                    f"({precision}, {check['steps']} steps: it makes single's sums)"
                )


def median_step_ms(record: dict, skip: int = 3) -> float | None:
    """The median step time after the first `skip` steps (start-up, allocator warm-up, autotuning)."""
    times = [s["step_time_s"] for s in record.get("steps", [])[skip:] if s.get("step_time_s")]
    return 1000 * statistics.median(times) if times else None


def cost_cells(record: dict) -> list[str]:
    """[communication vs formula, model states vs formula, activations vs formula] as the report says."""
    from distref.report import communication_cells, memory_cells

    memory = memory_cells(record)
    return [communication_cells(record)[2], memory[1], memory[3]]


def result_rows(jobs: list[Job]) -> list[list[str]]:
    rows = []
    for job in jobs:
        record = record_of(job)
        status = job.status if not job.why else f"{job.status}: {job.why}"
        if record is None:
            rows.append([job.name, status, seconds(job.seconds), "—", "—", "—", "—", "—", "—"])
            continue
        accuracy = record.get("final_accuracy")
        target = record.get("target_accuracy")
        reached = (
            ""
            if target is None
            else (" (target reached)" if record.get("time_to_target_s") else " (target not reached)")
        )
        step = median_step_ms(record)
        rows.append(
            [
                job.name,
                status,
                seconds(job.seconds),
                f"{record['world_size']}",
                "—" if accuracy is None else f"{accuracy:.4f}{reached}",
                "—" if step is None else f"{step:.1f}",
                *cost_cells(record),
            ]
        )
    return rows


def seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def speed_rows(jobs: list[Job]) -> list[list[str]]:
    """The bf16 world-1 runs, each alone on the GPU: median step and its ratio to single's."""
    timed = [(j, record_of(j)) for j in jobs if j.group == "world 1" and j.alone]
    steps = {j.name.split(" ")[0]: median_step_ms(r) for j, r in timed if r}
    base = steps.get("single")
    rows = []
    for impl, step in steps.items():
        ratio = "—" if step is None or not base else f"{step / base:.2f}"
        rows.append([impl, "—" if step is None else f"{step:.1f}", ratio])
    return rows


def gpu_test_summary(out: Path) -> str:
    """passed/failed/skipped of the gpu tests, and why each skipped (from pytest's junit XML)."""
    import xml.etree.ElementTree as ET

    junit = out / "gpu-tests.xml"
    if not junit.exists():
        return "no results (the tests did not run)"
    cases = ET.parse(junit).getroot().iter("testcase")
    passed, failed, skipped = [], [], []
    for case in cases:
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        if case.find("skipped") is not None:
            skipped.append(f"{name}: {case.find('skipped').get('message', '')}")
        elif case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
        else:
            passed.append(name)
    lines = [f"{len(passed)} passed, {len(failed)} failed, {len(skipped)} skipped"]
    lines += [f"- failed: {n}" for n in failed] + [f"- skipped: {n}" for n in skipped]
    return "\n".join(lines)


def table_under(markdown: Path, heading: str) -> str | None:
    """The first table under `heading` in a report.md, or None."""
    if not markdown.exists():
        return None
    lines = markdown.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(heading)), None)
    if start is None:
        return None
    rows = [line for line in lines[start + 1 :] if not line.startswith("## ")]
    table = []
    for line in rows:
        if line.startswith("|"):
            table.append(line)
        elif table:
            break
    return "\n".join(table) or None


def reports_and_validation(
    jobs: list[Job], env: dict[str, str], out: Path, plan: bool = True
) -> tuple[str, list[str]]:
    """distref.report on each precision's world-1 runs (parity against single, costs), plan --validate on
    every record: their output, as they print it."""
    sections, failures = [], []
    for precision in PRECISIONS:
        dirs = [
            str(j.out) for j in jobs if j.group == "world 1" and j.name.endswith(precision) and record_of(j)
        ]
        if len(dirs) < 2:
            continue
        report = out / f"report-{precision}"
        said = ask([sys.executable, "-m", "distref.report", *dirs, "--out", str(report)], env, timeout=300)
        if said.returncode != 0:
            failures.append(f"distref.report on the gpt {precision} runs: exit code {said.returncode}")
        parity = table_under(report / "report.md", "## Parity with single")
        said_text = (said.stdout + said.stderr).strip()
        sections.append(
            f"### World 1, gpt {precision}: parity with single (`{report / 'report.md'}`)\n\n"
            + (parity or f"no report (exit code {said.returncode}):\n\n```\n{said_text[-1500:]}\n```")
        )
    records = [str(j.out) for j in jobs if record_of(j)]
    if records and plan:
        said = ask([sys.executable, "-m", "distref.plan", "--validate", *records], env, timeout=300)
        if said.returncode != 0:
            failures.append(f"plan --validate: exit code {said.returncode}")
        sections.append(
            f"### `plan --validate` on every record (exit code {said.returncode})\n\n{(said.stdout + said.stderr).strip()}"
        )
    return "\n\n".join(sections), failures


def write_markdown(
    out: Path, machine: str, jobs: list[Job], not_run: list[tuple[str, str]], extra: str
) -> Path:
    header = [
        "job",
        "status",
        "s",
        "world",
        "final accuracy",
        "median step ms",
        "communication vs formula",
        "model states vs formula",
        "activations vs formula",
    ]
    skipped = [*not_run, *[(j.name, j.why) for j in jobs if j.status == "not run"]]
    text = [
        "# GPU check",
        "",
        machine,
        "",
        md_table(header, result_rows(jobs)),
        "",
        "## Not run",
        "",
        *([f"- {name}: {why}" for name, why in skipped] or ["- nothing: everything ran"]),
        "",
        "## The gpu tests",
        "",
        gpu_test_summary(out),
        "",
        "## Speed: world 1, gpt bf16, each run alone on the GPU",
        "",
        md_table(["impl", "median step ms (steps 4+)", "vs single"], speed_rows(jobs)),
        "",
        "## Reports and plan --validate",
        "",
        extra or "nothing to report: no records",
        "",
        "## The GPU benchmark (ci/gpu_bench.py)",
        "",
        bench_section(out, jobs),
        "",
    ]
    path = out / "gpu-check.md"
    path.write_text("\n".join(text))
    return path


def bench_section(out: Path, jobs: list[Job]) -> str:
    """The benchmark's gpu-bench.md, its headings one level down, or why there is none."""
    table = out / "bench" / "gpu-bench.md"
    if table.exists():
        return "\n".join(
            "##" + line if line.startswith("#") else line for line in table.read_text().splitlines()
        )
    job = next((j for j in jobs if j.group == "bench"), None)
    if job is None:
        return "not run (left out by --only)"
    return (
        f"no table: {job.status}"
        + (f": {job.why}" if job.why else "")
        + (f" (log: {job.log})" if job.log else "")
    )


# ---- the machine -------------------------------------------------------------------------------------


def ask(argv: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    """A short command of the check's own (a question to torch, the report, plan --validate), its output
    captured."""
    return subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def child_environment(bundle_env: dict[str, str], bin_dir: Path) -> dict[str, str]:
    """What every command runs with: the bundle's environment if one was installed, else the same made for
    this interpreter and core alone: core on the path (nothing to install), and `python`, `torchrun`,
    `pytest`, `nox` as wrapper scripts that exec this interpreter (gpu_bundle.write_wrappers: a `python`
    symlinked to a venv's interpreter is not that venv)."""
    if not bundle_env:
        core = str(ROOT / "core" / "src")
        write_wrappers(bin_dir, sys.executable, core, f"{sys.version_info.major}.{sys.version_info.minor}")
        outer = os.environ.get("PYTHONPATH")
        bundle_env = {
            "PYTHONPATH": os.pathsep.join([core, outer]) if outer else core,
            "PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")]),
        }
    env = {**os.environ, **bundle_env}
    env.setdefault("DISTREF_DATA", str(ROOT / "data"))
    env["DISTREF_REQUIRE_GPU"] = "0"  # a session that cannot run says so here, in the table
    return env


def visible_gpus(env: dict[str, str]) -> tuple[int, str]:
    said = ask([sys.executable, "-m", "distref.ranks", "--cuda"], env)
    line = next((x for x in said.stdout.splitlines() if x.startswith("cuda_gpus=")), None)
    if line is None:
        return 0, f"distref.ranks --cuda failed: {(said.stderr.strip().splitlines() or [''])[-1]}"
    gpus, _, why = line[len("cuda_gpus=") :].partition(" ")
    return int(gpus), why


def machine_torch(env: dict[str, str]) -> str:
    """The torch version the commands run with (in their environment)."""
    return ask([sys.executable, "-c", "import torch; print(torch.__version__)"], env).stdout.strip() or "0.0"


def machine_line(env: dict[str, str], gpus_said: str) -> str:
    code = (
        "import sys, torch; nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None; "
        "print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, Python {sys.version.split()[0]}')"
    )
    said = ask([sys.executable, "-c", code], env)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"{stamp}: {gpus_said}; {said.stdout.strip() or said.stderr.strip()[-200:]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python ci/gpu_check.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="the folder for gpu-check.md, records and logs")
    parser.add_argument(
        "--bundle", type=Path, help="the offline bundle's wheels (ci/gpu_bundle.py) to install first"
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: rehearse on gloo")
    parser.add_argument("--steps", type=int, default=40, help="steps of the world-1 and feature runs")
    parser.add_argument("--budget-s", type=float, default=330, help="start no job after this many seconds")
    parser.add_argument(
        "--parallel", type=int, default=3, help="runs sharing the GPU at once (not timed ones)"
    )
    parser.add_argument("--only", action="append", default=[], help="run only jobs whose name contains this")
    parser.add_argument(
        "--bench-budget-s",
        type=float,
        default=BENCH_BUDGET_S,
        help=f"the GPU benchmark's time, after the rest (default {BENCH_BUDGET_S:.0f})",
    )
    args = parser.parse_args(argv)
    if args.steps < 3:  # (a session of fewer steps counts no communication: nothing to check it with)
        parser.error(
            "--steps must be >= 3: a run's communication and activations are counted at its third step"
        )
    if args.parallel < 1 or not 0 < args.budget_s < float("inf"):
        parser.error("--parallel must be >= 1, --budget-s a number of seconds > 0")
    if not 0 < args.bench_budget_s < float("inf"):
        parser.error("--bench-budget-s must be a number of seconds > 0")
    names = [job.name for job in plan_jobs(8, args.device, ROOT / "runs", 1)[0]]  # (a plan: nothing runs)
    if unmatched := [o for o in args.only if not any(o in name for name in names)]:
        parser.error(f"--only {unmatched[0]!r} matches no job; the jobs: {', '.join(names)}")
    out = (
        args.out or ROOT / "runs" / "gpu-check" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    ).resolve()
    if out.exists() and any(out.iterdir()):  # (an older check's records would be read as this one's)
        parser.error(f"--out {out} is not empty: give a new folder")
    out.mkdir(parents=True, exist_ok=True)
    bundle_env: dict[str, str] = {}
    if args.bundle is not None:
        from gpu_bundle import BundleError, install_bundle

        try:  # (MNIST built from the bundle's wheel where the data folder lacks it)
            data = os.environ.get("DISTREF_DATA", str(ROOT / "data"))
            bundle_env = install_bundle(args.bundle, out / "site", data_root=data, check=False)
        except BundleError as exc:
            print(f"gpu_check: {exc}", file=sys.stderr)
            return 1
    env = child_environment(bundle_env, out / "bin")
    gpus, said = visible_gpus(env) if args.device == "cuda" else (1, "CPU rehearsal (gloo)")
    if gpus == 0:
        print(f"gpu_check: no GPU to check: {said}", file=sys.stderr)
        return 1
    jobs, not_run = plan_jobs(gpus, args.device, out, args.steps, args.bench_budget_s)
    torch_version = version_tuple(machine_torch(env))
    jobs, lacking = runnable(jobs, missing_modules({m for j in jobs for m in j.needs}, env), torch_version)
    not_run += lacking
    from distref.plan.cli import PLANNER_TORCH

    plan = torch_version >= version_tuple(PLANNER_TORCH)
    if not plan:
        not_run.append(("plan --validate", f"the planner needs torch {PLANNER_TORCH} or later"))
    if args.only:
        kept = [j for j in jobs if any(o in j.name for o in args.only)]
        not_run += [(j.name, "left out by --only") for j in jobs if j not in kept]
        jobs = kept
    print(f"gpu_check: {len(jobs)} jobs on {said}; logs and records in {out}", flush=True)
    (out / "logs").mkdir(exist_ok=True)
    run_all(jobs, env, out / "logs", args.budget_s, args.parallel)
    judge_costs(jobs)
    judge_parity(jobs)  # (before the reports: their parity column reads its parity.json files)
    extra, tool_failures = reports_and_validation(jobs, env, out, plan)
    report = write_markdown(out, machine_line(env, said), jobs, not_run, extra)
    for job in jobs:
        print(f"  {job.status:8} {job.name}" + (f": {job.why}" if job.why else ""))
    for name, why in not_run:
        print(f"  not run  {name}: {why}")
    for failure in tool_failures:
        print(f"  failed   {failure}")
    print(f"gpu_check: {report}")
    ran = [j for j in jobs if j.status != "not run"]
    return 0 if ran and all(j.status == "passed" for j in ran) and not tool_failures else 1


if __name__ == "__main__":
    sys.exit(main())
