"""The GPU benchmark: every impl on GPT-2 small in bf16, eager and compiled, against a bare loop.

Each impl trains at the largest world the visible GPUs allow (its own checks decide, as `nox -s
<impl>-gpu` does; with 1 GPU world 1, model_parallel as one process with both parts on cuda:0; pipeline
needs 2 ranks), on `--model gpt2 --dataset synthetic --precision bf16 --global-batch-size 12`, once
eager and once with `--compile`; fsdp with `--reshard-after-forward` and `--no-reshard-after-forward`;
expert_parallel, made for a mixture of experts, with each block's MLP a mixture of 4 experts (`--experts 4`).
Beside them a bare loop of this project's own, run the same way: the same model, one random batch
already on the GPU, fused AdamW, bf16 autocast and distref's loss, nothing else (as nanoGPT's bench.py),
so that what the harness costs is a number in the table ("vs bare").

Per row, from its record.json (each step's time from CUDA events): step time median, mean and p90 after
the warm-up, tokens/s, MFU (PaLM's FLOPs per token over the card's dense bf16 peak), training peak
memory, start-up, and the step time against the bare loop's and single's. Eager rows run first; a row
that would not fit in what is left of --budget-s is not run, and the table says so. Under the table the
issue's goals, each pass or **fail** (a goal whose run failed fails), or — where its run did not run.

    python ci/gpu_bench.py                                # the GPUs here; about 9 minutes at most
    python ci/gpu_bench.py --impls single,ddp --steps 60  # fewer rows, more steps
    python ci/gpu_bench.py --device cpu --quick           # a rehearsal: the tiny gpt on the CPU (gloo)

Writes gpu-bench.md (the table) and gpu-bench.json (its numbers) into --out, each run's record and log
beside them. Exit 0 when every run started completed, 1 otherwise (and when none could start).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "core" / "src"))  # distref from the source tree: nothing to install
sys.path.insert(0, str(ROOT / "ci"))
import gpu_check  # noqa: E402  (its launching, environment and module checks, reused)

from distref import declared_torch  # noqa: E402
from distref.impl_folders import discover  # noqa: E402

IMPLS = discover(ROOT / "impls")
GLOBAL_BATCH = 12
MIN_MEASURED = 30  # steps measured after the warm-up, unless --quick
# The cards' dense (not 2:4 sparse) bf16 tensor-core peaks, from NVIDIA's datasheets, by a part of the
# name torch.cuda.get_device_name() gives ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB").
PEAKS = (("h200", 989e12), ("h100", 989e12), ("a100", 312e12))
# Seconds a run is expected to take before its first measured row of that mode tells (start-up, GPT-2
# small's compile: about a minute a process, then the steps); later rows use the last one's.
ESTIMATE_S = {False: 30.0, True: 90.0}
GOAL_BARE, GOAL_COMPILE, GOAL_WORLD_ONE = 1.02, 1.3, 1.05
WORLD_ONE_GOAL_ROWS = ("ddp", "fsdp reshard", "fsdp no-reshard", "deepspeed_zero")
FORMULA = "6·N + 12·L·H·Q·T"


# ---- the numbers -------------------------------------------------------------------------------------


class TooFewSteps(ValueError):
    pass


def measured_step_times(record: dict, warmup: int) -> list[float]:
    """Seconds of each step after the first `warmup` (allocations, autotuning, compiling), in step order,
    less the step whose communication was counted (every operation through Python: slower)."""
    counted = (record.get("communication") or {}).get("step")
    steps = sorted(record.get("steps", []), key=lambda s: s["step"])[warmup:]
    return [s["step_time_s"] for s in steps if s["step"] != counted and s.get("step_time_s") is not None]


def step_stats(times_s: list[float], minimum: int = MIN_MEASURED) -> dict[str, float]:
    """Median, mean and p90 (nearest rank: the smallest time at least 90% of the steps take no longer
    than) in milliseconds, and how many steps; TooFewSteps under `minimum` steps."""
    if len(times_s) < max(minimum, 1):
        raise TooFewSteps(f"{len(times_s)} steps measured, {minimum} needed")
    ordered = sorted(times_s)
    p90 = ordered[math.ceil(0.9 * len(ordered)) - 1]
    return {
        "median_ms": 1000 * statistics.median(ordered),
        "mean_ms": 1000 * statistics.fmean(ordered),
        "p90_ms": 1000 * p90,
        "steps": len(ordered),
    }


def tokens_per_s(global_batch: int, seq_len: int, step_ms: float) -> float:
    return global_batch * seq_len / (step_ms / 1000)


def flops_per_token(n_params: int, n_layer: int, n_head: int, head_dim: int, seq_len: int) -> int:
    """PaLM's estimate (appendix B), as nanoGPT's estimate_mfu: 6N for the matmuls with the weights,
    forward and backward, 12·L·H·Q·T for attention's scores and weighted sum; N without the position
    embeddings (a lookup, no matmul)."""
    return 6 * n_params + 12 * n_layer * n_head * head_dim * seq_len


def mfu(flops_token: float, tokens_s: float, gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: the FLOPs the model needs per second over what the GPUs could do."""
    return flops_token * tokens_s / (gpus * peak_flops)


def dense_bf16_peak(card: str) -> tuple[float | None, str]:
    """(FLOP/s, a line saying it) for a card named as torch names it; None and why for one not known."""
    low = card.lower()
    if "h100" in low and ("pcie" in low or "nvl" in low):
        return None, f"{card}: no peak here for the H100 PCIe/NVL (lower clocks than the SXM's 989 TFLOP/s)"
    for part, peak in PEAKS:
        if part in low:
            return peak, f"{card}: {peak / 1e12:.0f} TFLOP/s dense bf16 ({part.upper()} datasheet)"
    known = "H100 SXM, H200: 989 TFLOP/s; A100: 312"
    return None, f"{card}: no dense bf16 peak known for this card ({known}): MFU not given"


@dataclass
class Shape:
    """What MFU needs of the model: N (parameters less the position embeddings), L, H, Q, T."""

    n_params: int
    n_layer: int
    n_head: int
    head_dim: int
    seq_len: int
    vocab: int

    @property
    def flops_per_token(self) -> int:
        return flops_per_token(self.n_params, self.n_layer, self.n_head, self.head_dim, self.seq_len)


def data_info(model: str):
    """--dataset synthetic's DatasetInfo for `model`, without making the data."""
    from distref.data.tensors import DatasetInfo

    if model == "gpt2":
        from distref.config import GPT2_CONTEXT, GPT2_VOCABULARY

        return DatasetInfo("synthetic", GPT2_VOCABULARY, (GPT2_CONTEXT,), "sequence")
    from distref.data import synthetic_reverse

    return synthetic_reverse(n_train=1, n_test=1)[2]


def model_shape(model: str, experts: int = 0) -> Shape:
    """The model's shape, its parameters counted on the meta device (nothing allocated). With `experts`
    (a mixture of experts a block, top-2: expert_parallel's workload) N counts the parameters a token
    meets: of each block's experts the top k's share, k ÷ E of them (the router and the rest whole)."""
    import torch

    from distref.config import MoEConfig
    from distref.models import build_model, gpt_config

    info = data_info(model)
    moe = MoEConfig(experts) if experts else None
    cfg = gpt_config(model, info, moe=moe)
    with torch.device("meta"):
        built = build_model(model, info, moe=moe)
    met = moe.top_k / moe.experts if moe else 1.0  # (the share of its experts a token meets)
    n = sum(
        p.numel() * (met if ".experts." in name else 1)
        for name, p in built.named_parameters()
        if not name.endswith("pos.weight")
    )
    head_dim = cfg.n_embd // cfg.n_head
    return Shape(round(n), cfg.n_layer, cfg.n_head, head_dim, info.input_shape[0], cfg.vocab_size)


# ---- the bare loop (run as `gpu_bench.py --bare`, a process of its own like every row) ---------------


def bare_loop(model_name: str, device_name: str, steps: int, compiled: bool, out: Path) -> dict:
    """The same model, trained as plainly as it can be: one random batch on the device, fused AdamW, bf16
    autocast, distref's loss; each step timed with CUDA events (on the CPU, its clock). Writes a record
    with what the table reads of the impls' (steps, peak memory, start-up)."""
    import torch

    from distref.models import build_model
    from distref.record import peak_memory_bytes, seconds_since_process_start
    from distref.training.compile import compile_blocks  # (--compile's: each block, the same backend)
    from distref.training.device import configure_cpu_threads
    from distref.training.steps import loss_sum

    configure_cpu_threads()  # (one thread, as every rank: on the CPU two spinning threads ran 5-8x slower)
    device = torch.device(device_name)
    torch.manual_seed(0)
    info = data_info(model_name)
    model = build_model(model_name, info).to(device)
    if compiled:
        compile_blocks(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0, fused=True)
    tokens = torch.randint(0, info.num_classes, (GLOBAL_BATCH, info.input_shape[0] + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    startup = seconds_since_process_start()
    timings, losses = [], []
    for _ in range(steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_sum(model(x), y) / y.numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if cuda:
            end.record()
            timings.append((start, end))
        else:
            timings.append(time.perf_counter() - started)
    if cuda:
        torch.cuda.synchronize(device)
        timings = [start.elapsed_time(end) / 1000 for start, end in timings]
    record = {
        "status": "completed",
        "impl": {"name": "bare", "version": "-"},
        "world_size": 1,
        "environment": {
            "torch": torch.__version__,
            "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
            "threads_per_rank": torch.get_num_threads(),
        },
        "steps": [
            {"step": i, "loss": float(loss), "step_time_s": t}
            for i, (loss, t) in enumerate(zip(torch.stack(losses).tolist(), timings, strict=True))
        ],
        "peak_memory_bytes": [peak_memory_bytes(device)],
        "startup_time_s": startup,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "record.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


# ---- the rows ----------------------------------------------------------------------------------------


@dataclass
class Row:
    """One run of the table: its name ("bare", "single", "fsdp reshard"), mode, world and command."""

    name: str
    compiled: bool
    world: int = 1
    gpus: int = 1  # the GPUs it computes on (MFU's denominator)
    experts: int = 0  # its gpt's experts a block (a mixture of experts: another model than bare's, single's)
    argv: list[str] = field(default_factory=list)
    out: Path | None = None
    status: str = "planned"  # then "ran", "failed" or "not run"
    why: str = ""
    seconds: float | None = None
    numbers: dict = field(default_factory=dict)

    @property
    def mode(self) -> str:
        return "compiled" if self.compiled else "eager"


def variants(impl: str) -> list[tuple[str, list[str]]]:
    """(row name, extra options) of each row an impl gives: fsdp's resharding choice, stated and measured."""
    if impl == "fsdp":
        return [
            ("fsdp reshard", ["--reshard-after-forward"]),
            ("fsdp no-reshard", ["--no-reshard-after-forward"]),
        ]
    return [(impl, [])]


def train_options(model: str, device: str, steps: int, compiled: bool, out: Path) -> list[str]:
    options = ["--model", model, "--dataset", "synthetic", "--precision", "bf16", "--device", device]
    options += ["--steps", str(steps), "--global-batch-size", str(GLOBAL_BATCH), "--out", str(out)]
    return options + (["--compile"] if compiled else [])


def world_from_ranks(impl: str, options: list[str], gpus: int) -> tuple[int | None, str]:
    """The most ranks, one per GPU, the impl's own checks accept for the workload (distref.ranks)."""
    from distref.ranks import fitting_world_size

    try:
        return fitting_world_size(IMPLS[impl]["train"], options, gpus)
    except (Exception, SystemExit) as exc:  # (an impl that cannot be loaded here: said in its row)
        return None, f"its world size could not be asked: {type(exc).__name__}: {exc}"


def launch(impl: str, world: int, device: str, options: list[str], python: str) -> list[str]:
    """The command of an impl's run, as ci/gpu_check.py starts them: one process for single and
    dataparallel (and model_parallel at world 1, both parts on the one device), else ranks started by
    `train.py --nproc-per-node`."""
    train = str(IMPLS[impl]["train"])
    if IMPLS[impl]["launcher"] != "torchrun":
        return [python, train, *options]
    if impl == "model_parallel" and world == 1:
        return [python, train, "--devices", "cuda:0,cuda:0" if device == "cuda" else "cpu,cpu", *options]
    return [python, train, "--nproc-per-node", str(world), *options]


def plan_rows(
    gpus: int,
    device: str,
    model: str,
    impls: list[str],
    steps: int,
    out: Path,
    modes: tuple[bool, ...] = (False, True),
    unavailable: dict[str, str] | None = None,
    world_of=world_from_ranks,
    python: str = sys.executable,
) -> list[Row]:
    """The rows in the order they run: every eager row, then every compiled one; in each the bare loop
    and single first (the goals' rows); those of an impl in `unavailable` not run, saying its why. Pure
    but for `world_of` (the tests give their own)."""
    ordered = sorted(impls, key=lambda i: (i != "single", i))
    rows = []
    for compiled in modes:
        mode = "compiled" if compiled else "eager"
        bare_out = out / "runs" / mode / "bare"
        bare = [python, str(Path(__file__).resolve()), "--bare", "--model", model, "--device", device]
        bare += ["--steps", str(steps), "--out", str(bare_out), *(["--compile"] if compiled else [])]
        rows.append(Row("bare", compiled, argv=bare, out=bare_out))
        for impl in ordered:
            workload = gpu_check.workload_options(impl)  # (expert_parallel: gpt's mixture of experts)
            for name, extra in variants(impl):
                run_out = out / "runs" / mode / name.replace(" ", "-")
                options = [*train_options(model, device, steps, compiled, run_out), *workload, *extra]
                row = Row(name, compiled, out=run_out, experts=int(gpu_check.EXPERTS) if workload else 0)
                if impl in (unavailable or {}):
                    row.status, row.why = "not run", unavailable[impl]
                elif IMPLS[impl]["launcher"] != "torchrun":
                    row.world = gpus if impl == "dataparallel" and device == "cuda" else 1
                elif impl == "model_parallel" and gpus == 1:
                    row.world = 1  # one process, both parts on the one device
                else:
                    world, said = world_of(impl, options, gpus)
                    if world is None:
                        row.status, row.why = "not run", said
                    row.world = world or 0
                if row.status == "planned":
                    row.gpus = row.world if device == "cuda" else 1
                    row.argv = launch(impl, row.world, device, options, python)
                rows.append(row)
    return rows


def unavailable_impls(impls: list[str], missing: set[str], torch_version: tuple[int, ...]) -> dict[str, str]:
    """impl -> why it cannot run here: a module it imports is missing, or it declares a newer torch."""
    why = {}
    for impl in impls:
        lacking = sorted(set(gpu_check.impl_needs(impl)) & missing)
        floor = gpu_check.version_tuple(declared_torch(ROOT / "impls" / impl))
        if lacking:
            why[impl] = f"{', '.join(lacking)} not importable here (docs/gpu.md: the offline bundle)"
        elif torch_version < floor:
            why[impl] = f"{impl} needs torch {'.'.join(map(str, floor))} or later"
    return why


def run_rows(
    rows: list[Row], env: dict[str, str], logs: Path, budget_s: float, timeout_s: float, runner=None
) -> None:
    """Each planned row in order, one at a time (alone on the GPUs), unless what it is expected to take
    (its mode's last run's seconds, else ESTIMATE_S) exceeds what is left of `budget_s`: then not run,
    saying so. `runner(row, limit_s)` runs one (the tests give their own)."""
    runner = runner or (lambda row, limit: run_one(row, env, logs, limit))
    deadline = time.monotonic() + budget_s
    taken: dict[bool, float] = {}
    for row in rows:
        if row.status != "planned":
            continue
        expected = taken.get(row.compiled, ESTIMATE_S[row.compiled])
        left = deadline - time.monotonic()
        if expected > left:
            row.status = "not run"
            row.why = f"the budget: about {expected:.0f} s expected, {max(left, 0):.0f} s of --budget-s left"
            continue
        started = time.monotonic()
        runner(row, min(timeout_s, left))
        row.seconds = time.monotonic() - started
        taken[row.compiled] = row.seconds


def run_one(row: Row, env: dict[str, str], logs: Path, limit_s: float) -> None:
    """Runs `row` (its log in `logs`), stopped with every process it started after `limit_s`; ran when it
    exits 0 with a completed record."""
    log_path = logs / f"{row.mode}-{row.name.replace(' ', '-')}.log"
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(row.argv) + "\n")
        log.flush()
        process = subprocess.Popen(
            row.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            gpu_check.stop_tree(process)
            code = None
    record_path = row.out / "record.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else None
    if code is None:
        row.status, row.why = "failed", f"stopped after {limit_s:.0f} s (--timeout or the budget)"
    elif code != 0 or record is None or record.get("status") != "completed":
        said = record.get("error") if record else None
        row.status, row.why = "failed", f"exit code {code}: {said or gpu_check.last_line(log_path)}"
    else:
        row.status = "ran"


# ---- the table ---------------------------------------------------------------------------------------


def fill_numbers(
    rows: list[Row],
    shape: Shape,
    peak: float | None,
    warmup: int,
    minimum: int,
    expert_shape: Shape | None = None,
) -> None:
    """Each row that ran: its step statistics, tokens/s, MFU (a mixture of experts' by `expert_shape`),
    peak memory, start-up, and its step time against the bare loop's and single's of the same mode (not
    for a mixture of experts: another model), and (compiled) eager's over compiled's."""
    for row in rows:
        if row.status != "ran":
            continue
        record = json.loads((row.out / "record.json").read_text())
        try:
            stats = step_stats(measured_step_times(record, warmup), minimum)
        except TooFewSteps as exc:
            row.status, row.why = "failed", str(exc)
            continue
        trained = expert_shape if row.experts else shape
        tokens = tokens_per_s(GLOBAL_BATCH, shape.seq_len, stats["median_ms"])
        memory = record.get("peak_memory_bytes") or []
        row.numbers = {
            **stats,
            "tokens_per_s": tokens,
            "mfu": mfu(trained.flops_per_token, tokens, row.gpus, peak) if peak and trained else None,
            "peak_memory_gib": max(memory) / 2**30 if memory else None,
            "startup_s": record.get("startup_time_s"),
        }
    median = {(r.name, r.compiled): r.numbers["median_ms"] for r in rows if r.numbers}
    for row in rows:
        if not row.numbers:
            continue
        step = row.numbers["median_ms"]
        bare, single = median.get(("bare", row.compiled)), median.get(("single", row.compiled))
        eager = median.get((row.name, False)) if row.compiled else None
        row.numbers["vs_bare"] = step / bare if bare and not row.experts else None
        row.numbers["vs_single"] = step / single if single and not row.experts else None
        row.numbers["compile_speedup"] = eager / step if eager else None


def goals(rows: list[Row], device: str) -> list[tuple[str, str]]:
    """(goal, verdict) of the issue's goals: pass, **fail** (a run it needs failed: a fail too), or — with
    why (a run it needs did not run)."""
    if device != "cuda":
        return [("every goal", "— (a CPU rehearsal: the goals are judged on a GPU)")]
    by = {(r.name, r.compiled): r for r in rows}

    def number(name: str, compiled: bool, key: str) -> float | None:
        row = by.get((name, compiled))
        return row.numbers.get(key) if row and row.numbers else None

    def verdict(needs: list[tuple[str, bool]], value: float | None, ok: bool, shown: str) -> str:
        failed = [by[key] for key in needs if key in by and by[key].status == "failed"]
        if failed:
            return f"**fail**: {failed[0].name} {failed[0].mode} failed ({failed[0].why})"
        return "— (not measured)" if value is None else f"{'pass' if ok else '**fail**'}: {shown}"

    said = []
    ratio = number("single", False, "vs_bare")
    said.append(
        (
            f"single eager ≤ {GOAL_BARE}× the bare loop's step",
            verdict(
                [("bare", False), ("single", False)],
                ratio,
                ratio is not None and ratio <= GOAL_BARE,
                f"{ratio or 0:.3f}×",
            ),
        )
    )
    speedup = number("single", True, "compile_speedup")
    said.append(
        (
            f"single compiled ≥ {GOAL_COMPILE}× faster than eager",
            verdict(
                [("single", False), ("single", True)],
                speedup,
                speedup is not None and speedup >= GOAL_COMPILE,
                f"{speedup or 0:.2f}×",
            ),
        )
    )
    for name in WORLD_ONE_GOAL_ROWS:
        for compiled in (False, True):
            row = by.get((name, compiled))
            goal = (
                f"{name} {'compiled' if compiled else 'eager'} at world 1 ≤ {GOAL_WORLD_ONE}× single's step"
            )
            if row is None:
                continue
            if row.numbers and row.world != 1:
                said.append((goal, f"— (it ran at world {row.world}: the goal is for world 1)"))
                continue
            value = number(name, compiled, "vs_single")
            needs = [(name, compiled), ("single", compiled)]
            ok = value is not None and value <= GOAL_WORLD_ONE
            said.append((goal, verdict(needs, value, ok, f"{value or 0:.3f}×")))
    return said


def cell(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


HEADER = [
    "row",
    "mode",
    "world",
    "status",
    "steps measured",
    "median ms",
    "mean ms",
    "p90 ms",
    "tokens/s",
    "MFU",
    "peak GiB",
    "start-up s",
    "vs bare",
    "vs single",
    "compile speed-up",
]


def table_rows(rows: list[Row], mfu_why: str) -> list[list[str]]:
    out = []
    for row in rows:
        n = row.numbers
        status = row.status + (f": {row.why}" if row.why else "")
        if not n:
            world = str(row.world) if row.world else "—"
            out.append([row.name, row.mode, world, status, *["—"] * (len(HEADER) - 4)])
            continue
        out.append(
            [
                row.name,
                row.mode,
                str(row.world),
                status,
                str(n["steps"]),
                cell(n["median_ms"], ".1f"),
                cell(n["mean_ms"], ".1f"),
                cell(n["p90_ms"], ".1f"),
                cell(n["tokens_per_s"], ",.0f"),
                cell(100 * n["mfu"], ".1f") + "%" if n["mfu"] is not None else f"— ({mfu_why})",
                cell(n["peak_memory_gib"], ".2f"),
                cell(n["startup_s"], ".1f"),
                cell(n["vs_bare"], ".3f"),
                cell(n["vs_single"], ".3f"),
                cell(n["compile_speedup"], ".2f"),
            ]
        )
    return out


def markdown(
    rows: list[Row],
    context: dict,
    shape: Shape,
    peak_said: str,
    said_goals: list[tuple[str, str]],
    expert_shape: Shape | None = None,
) -> str:
    measured = context["steps"] - context["warmup"]
    experts = sorted({r.name for r in rows if r.experts})
    moe = (
        [
            f"- {', '.join(experts)}: the same model with each block's MLP a mixture of {gpu_check.EXPERTS} "
            f"experts, top-2 (`--experts {gpu_check.EXPERTS}`, the workload it is made for): N = the "
            f"parameters a token meets (2 of the {gpu_check.EXPERTS} experts' share) = {expert_shape.n_params:,}, "
            f"{expert_shape.flops_per_token:,} FLOPs per token; vs bare / vs single —: another model"
        ]
        if experts and expert_shape
        else []
    )
    mfu_why = "no peak for this card" if context["device"] == "cuda" else "CPU"
    lines = [
        f"# GPU benchmark: {context['model_said']}, bf16, {' and '.join(context['modes'])}",
        "",
        f"- machine: {context['card']}; torch {context['torch']}; {context['when']}",
        f"- each run: {context['steps']} steps, the first {context['warmup']} warm-up (not measured), so "
        f"{measured} measured (less a step whose communication was counted); global batch {GLOBAL_BATCH} × "
        f"{shape.seq_len} tokens; each step's time from CUDA events (record.json `steps[].step_time_s`; on the "
        "CPU the host's clock)",
        f"- MFU = FLOPs per token × tokens/s ÷ (GPUs × peak); FLOPs per token = {FORMULA} (PaLM, appendix B; "
        f"nanoGPT's estimate_mfu), N = parameters less the position embeddings = {shape.n_params:,}, L = "
        f"{shape.n_layer}, H = {shape.n_head}, Q = {shape.head_dim}, T = {shape.seq_len}: "
        f"{shape.flops_per_token:,} FLOPs per token",
        *moe,
        f"- peak: {peak_said}",
        "- tokens/s = global batch × T ÷ median step; peak GiB: training's peak allocation, the most of any "
        "rank; start-up: process start to first step; vs bare / vs single: median step ÷ that row's of the "
        "same mode; compile speed-up: eager median ÷ compiled median of the same row",
        "- bare: the same model, one random batch on the device, `torch.optim.AdamW(fused=True)`, bf16 "
        "autocast, distref's loss, nothing else; compiled: each block's forward, as `--compile` does (compile_blocks)",
        "",
        gpu_check.md_table(HEADER, table_rows(rows, mfu_why)),
        "",
        "## Goals",
        "",
        *[f"- {goal}: {verdict}" for goal, verdict in said_goals],
        "",
    ]
    return "\n".join(lines)


# ---- the command -------------------------------------------------------------------------------------


def environment() -> dict[str, str]:
    """What every run starts with: core's source on the path (nothing to install), the data folder."""
    core = str(ROOT / "core" / "src")
    outer = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([core, outer]) if outer else core}
    env.setdefault("DISTREF_DATA", str(ROOT / "data"))
    return env


def card_name(env: dict[str, str], device: str) -> str:
    if device != "cuda":
        from distref.record import cpu_name

        return cpu_name()
    code = "import torch; print(torch.cuda.get_device_name(0))"  # (in a child: no CUDA context held here)
    return gpu_check.ask([sys.executable, "-c", code], env).stdout.strip() or "unknown GPU"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python ci/gpu_bench.py", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps per run (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps not measured (default 5)")
    parser.add_argument(
        "--quick", action="store_true", help=f"allow fewer than {MIN_MEASURED} measured steps"
    )
    parser.add_argument("--impls", help="comma-separated impls (default: every one)")
    parser.add_argument("--modes", default="eager,compiled", help="eager, compiled or both (the default)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a rehearsal")
    parser.add_argument("--model", choices=("gpt2", "gpt"), help="default: gpt2 on cuda, gpt on cpu")
    parser.add_argument("--out", type=Path, help="default runs/gpu-bench/<time>")
    parser.add_argument("--timeout", type=float, default=180, help="seconds a run may take (default 180)")
    parser.add_argument("--budget-s", type=float, default=540, help="all runs within this (default 540)")
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)  # one bare loop's run
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    model = args.model or ("gpt2" if args.device == "cuda" else "gpt")
    if args.bare:
        bare_loop(model, args.device, args.steps, args.compile, args.out)
        return 0
    impls = args.impls.split(",") if args.impls else list(IMPLS)
    modes = args.modes.split(",")
    if unknown := [i for i in impls if i not in IMPLS]:
        parser.error(f"--impls: no impl {unknown[0]!r}; the impls: {', '.join(IMPLS)}")
    if not modes or any(m not in ("eager", "compiled") for m in modes):
        parser.error(f"--modes {args.modes}: give eager, compiled or eager,compiled")
    if args.warmup < 0 or args.steps <= args.warmup:
        parser.error("--steps must be more than --warmup, and --warmup >= 0")
    if args.steps - args.warmup < MIN_MEASURED and not args.quick:
        parser.error(
            f"--steps - --warmup is {args.steps - args.warmup}: {MIN_MEASURED} measured steps at least"
        )
    if not (0 < args.budget_s < math.inf and 0 < args.timeout < math.inf):
        parser.error("--budget-s and --timeout must be seconds > 0")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = (args.out or ROOT / "runs" / "gpu-bench" / stamp).resolve()
    if out.exists() and any(out.iterdir()):  # (an older run's records would be read as this one's)
        parser.error(f"--out {out} is not empty: give a new folder")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    env = environment()
    gpus, said = gpu_check.visible_gpus(env) if args.device == "cuda" else (1, "CPU rehearsal (gloo)")
    if gpus == 0:
        print(f"gpu_bench: no GPU: {said}", file=sys.stderr)
        return 1
    import torch

    compiled_modes = tuple(m == "compiled" for m in ("eager", "compiled") if m in modes)
    modules = {m for impl in impls for m in gpu_check.impl_needs(impl)}
    torch_version = gpu_check.version_tuple(torch.__version__)
    unavailable = unavailable_impls(impls, gpu_check.missing_modules(modules, env), torch_version)
    rows = plan_rows(gpus, args.device, model, impls, args.steps, out, compiled_modes, unavailable)
    print(f"gpu_bench: {sum(r.status == 'planned' for r in rows)} runs on {said}; in {out}", flush=True)
    run_rows(rows, env, out / "logs", args.budget_s, args.timeout)
    shape = model_shape(model)
    expert_shape = model_shape(model, int(gpu_check.EXPERTS)) if any(r.experts for r in rows) else None
    card = card_name(env, args.device)
    peak, peak_said = dense_bf16_peak(card) if args.device == "cuda" else (None, "— (CPU: no MFU)")
    minimum = 1 if args.quick else MIN_MEASURED
    fill_numbers(rows, shape, peak, args.warmup, minimum, expert_shape)
    said_goals = goals(rows, args.device)
    model_said = "GPT-2 small (12 × 768, 12 heads, 1024 tokens)" if model == "gpt2" else f"--model {model}"
    context = {
        "device": args.device,
        "card": f"{gpus} × {card}" if args.device == "cuda" else card,
        "torch": torch.__version__,
        "when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "steps": args.steps,
        "warmup": args.warmup,
        "model_said": model_said,
        "modes": [m for m in ("eager", "compiled") if m in modes],
    }
    text = markdown(rows, context, shape, peak_said, said_goals, expert_shape)
    (out / "gpu-bench.md").write_text(text)
    numbers = {
        **context,
        "formula": FORMULA,
        "shape": asdict(shape),
        "flops_per_token": shape.flops_per_token,
        "expert_shape": asdict(expert_shape) if expert_shape else None,
        "expert_flops_per_token": expert_shape.flops_per_token if expert_shape else None,
        "peak_flops": peak,
        "peak": peak_said,
        "global_batch": GLOBAL_BATCH,
        "rows": [{**asdict(r), "out": str(r.out) if r.out else None, "mode": r.mode} for r in rows],
        "goals": [{"goal": g, "verdict": v} for g, v in said_goals],
    }
    (out / "gpu-bench.json").write_text(json.dumps(numbers, indent=1) + "\n")
    print(text)
    print(f"gpu_bench: {out / 'gpu-bench.md'}")
    started = [r for r in rows if r.status in ("ran", "failed")]
    return 0 if started and all(r.status == "ran" for r in started) else 1


if __name__ == "__main__":
    sys.exit(main())
