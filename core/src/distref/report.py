"""The comparison report: tables and plots from run records, any impls, any machines.

    python -m distref.report runs/compare/single runs/compare/ddp gpu-box/ddp --out report/

Each RUN_DIR holds a `record.json` (and, for the parity table, the `final.pt` that `--save-final` wrote);
a folder of such folders (what `nox -s compare` writes) stands for all of them, and files that are not a
record (the plots and report of an earlier comparison, as `runs/compare/<time>/*` gives) are skipped.
Writes `report.md`, `report.html` and PNG plots into --out and prints the path of report.md.

Records of different workloads (model, dataset, global batch, ...) are refused: their numbers cannot be
compared side by side. `--allow-mixed` builds the report anyway, with the differences stated at the top.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distref.config import RUN_DEFINING_OPTIONS, defining_value
from distref.parity_metric import max_relative_difference
from distref.record import load_record, not_counted

# Options that define the workload: two runs are compared only if these are equal. What defines a run
# (as for resuming it: the model, the data, the optimizer's trajectory), and its length and target.
WORKLOAD_KEYS = (*RUN_DEFINING_OPTIONS, "epochs", "steps", "target_accuracy")

# compare's target accuracy by (model, dataset; synthetic data is images for lenet, digit reversal for
# gpt), from single's test accuracy under compare's default workload (1 epoch, evaluated every 100
# steps; docs/report.md gives the curves). A target belongs to its data: a workload not listed gets none, not
# another's. Each value is distinct, so that a report can tell whose target a run had.
TARGETS: dict[tuple[str, str], float] = {
    ("lenet", "mnist"): 0.955,  # 0.933 at step 100, 0.960 at 200: on the steep part
    ("lenet", "synthetic"): 0.96,  # 0.946, 0.959, 0.966, 0.974 at steps 70-100: reached at the first eval
    ("gpt", "synthetic"): 0.95,  # 0.993 from step 30: reached at the first eval
    ("gpt", "masked"): 0.75,  # 0.647, 0.682, 0.773 at steps 100, 200, 300: on the steep part
}


TARGET_NOTE = (
    "Time to target is counted as MLPerf counts it: from the end of initialisation (the first step) to "
    "the end of the first evaluation reaching the target, evaluation included; 'of which training' is "
    "the optimizer steps alone. Start-up (process start to the first step: imports, data, model, process "
    "group, engine) is left out of it and shown beside it; wall time counts everything from process start. "
    "Time to target moves in whole evaluation intervals: compare the step at which each run got there too. "
    "A target belongs to its data: compare's are "
    + ", ".join(f"{t} for {m} on {d}" for (m, d), t in TARGETS.items())
    + ", none for other workloads. A run without a target shows *none*; one whose target is compare's "
    "for another dataset says whose, not *not reached*."
)

PARITY_NOTE = (
    "How to read this: *exact parity* is the correctness check. Each impl's run options, shortened to a "
    "few steps, against the single run that makes the same sums: plain single for SGD, single "
    "`--grad-accum S` for AdamW where the impl sums S micro-batches per step and S is a power of two, "
    "and both in fp64 where fp32 cannot be exact (`nox -s parity` runs the whole matrix). *End-of-run "
    "drift* compares the full runs' final parameters with single's and is not a correctness check: "
    "rounding differences of ~1e-7 per step (gradients summed in another order: several ranks, or "
    "threads) grow chaotically over a long run, AdamW amplifying them, so two correct runs can end 1e-2 "
    "to 1e-1 apart at the same accuracy (compare the accuracy columns). A strategy that sums in the same "
    "order as single is exact at any length: DDP with 2 ranks equals single with --grad-accum 2 bit for "
    "bit."
)

EFFICIENCY_NOTE = (
    "Hardware is what a run keeps busy: on CPU its processes × threads each (cores), on CUDA its GPUs. "
    "Speed-up = samples/s ÷ single's; scaling efficiency = speed-up ÷ (hardware ÷ single's hardware), "
    "on the same workload (same global batch: strong scaling), 1.00 being perfect use of the extra "
    "hardware. `nox -s compare` runs every process with one thread, so single uses one core. Throughput "
    "excludes the first (warm-up) step, the step whose communication was counted, and evaluation."
)


ROUTING_NOTE = (
    "A mixture of experts' router decides how many tokens each expert takes (each token counts once for "
    "each of its top k experts, over the whole global batch: every rank's, summed), recorded every step. "
    "Load imbalance is the busiest expert's tokens ÷ the mean: 1.00 is even, E/k every token sending one "
    "of its k choices to the same expert. Dropless: no token is dropped whatever the imbalance, so parity holds at any routing, but under "
    "expert parallelism the rank holding the busiest expert receives and computes the most (the all-to-all "
    "bytes in the cost table are that step's). The load-balancing loss (--balance-loss) pulls towards 1.00."
)

COST_NOTE = (
    "Where these numbers come from: *measured* communication is what each rank issued in one "
    "steady-state optimizer step (the record's counted step), counted at torch.distributed's dispatcher "
    "(distref.training.traffic): every collective and point-to-point call, the bytes of the tensors "
    "passed to it (all_gather and reduce_scatter: the unsharded side) and nccl-tests' bus bytes. Set-up, "
    "logging, evaluation and checkpoints are counted apart and left out. *Predicted* is the strategy's "
    "formula (distref.cost, derived in docs/cost-model.md). Communication is shown for the rank that "
    'moves the most bytes (the step waits for it; "ranks differ" where another rank\'s calls or bytes '
    "are not the same: a pipeline's or model_parallel's first and last stage); *exact* means the same "
    "calls and bytes of every kind on every rank as the formula's, else the differences are listed, "
    "measured − formula. Model states are measured once they all exist (parameters + gradients + "
    "optimizer state a rank holds), activations are the most bytes autograd saved for backward in one "
    "step (saved-tensor hooks), both beside distref.cost's formulas and, like peak memory, the most of any "
    "rank; peak is max RSS on CPU (set-up and evaluation included), max allocated on GPU. *no formula*: "
    "the impl predicts none; — : the record has no such number (an older record, or not measured by "
    "this impl). *Counting's cost*: the counted step's time beyond a median step's, as a share of "
    "the run's training time: counting is on in every run because one step is counted per session."
)

PIPELINE_NOTE = (
    "Formula bubble: the idle share of each rank's step with p stage ranks and m micro-batches, "
    "(p-1)/(m+p-1) for GPipe and 1F1B (GPipe, Huang et al. 2019, §2.2), (p-1)/(v·m+p-1) for interleaved "
    "1F1B with v stages per rank and m ≥ p (Megatron-LM, Narayanan et al. 2021, §2.2); the zero-bubble and "
    "V-shaped schedules get no formula here. Measured bubble: 1 − each rank's busy share (time in its "
    "stages' forward and backward ÷ time in the schedule, from the second step on), averaged over ranks; "
    "the sends, receives, the loss and the schedule's own work count as idle, so on small models it is "
    "well above the formula. The timeline is one step of it (the last one not slowed by counting its "
    "communication), one row per rank: each forward (F), backward (B; with zero-bubble schedules I, the "
    "input gradients, and W, the weight gradients, later) by micro-batch (with several stages on a rank, "
    "torch's notation: 2F0 is stage 2's forward of micro-batch 0), on the grey of the rank's time in the "
    "schedule, so that grey is idle; rows are placed by each rank's wall clock (one host: exact). Its "
    "step's bubble is in the table's last column. Times are the host's clock on CPU, CUDA events on GPU."
)


def on_cpu(record: dict[str, Any]) -> bool:
    """Whether the run computed on CPU (its record's device is not CUDA)."""
    return not str(record["environment"]["device"]).startswith("cuda")


def hardware(record: dict[str, Any]) -> tuple[int, str]:
    """(units, description) of what a run kept busy: GPUs on CUDA, processes × threads on CPU."""
    env = record["environment"]
    if not on_cpu(record):
        gpus = record.get("devices") or record["world_size"]
        return gpus, f"{gpus} GPU{'s' if gpus > 1 else ''}"
    processes, threads = record["world_size"], env.get("threads_per_rank") or 1
    return processes * threads, (
        f"{processes} process{'es' if processes > 1 else ''} × {threads} thread{'s' if threads > 1 else ''}"
    )


def scaling_efficiency(record: dict[str, Any], single: dict[str, Any]) -> float | None:
    """The one definition used here (report and benchmarks): (samples/s ÷ single's) ÷ (hardware units ÷
    single's), both runs on the same workload."""
    if not record.get("samples_per_s") or not single.get("samples_per_s"):
        return None
    speed_up = record["samples_per_s"] / single["samples_per_s"]
    return speed_up / (hardware(record)[0] / hardware(single)[0])


class Run:
    """One run directory: its record, its label and (if saved) its final parameters."""

    def __init__(self, path: Path, record: dict[str, Any]):
        self.path, self.record = path, record
        self.impl = record["impl"]["name"]
        self.ok = record["status"] == "completed"

    @property
    def devices(self) -> int:
        return self.record.get("devices") or self.record["world_size"]

    @property
    def label(self) -> str:
        if self.devices == 1 and self.impl != "single":  # e.g. DataParallel on CPU
            return f"{self.impl} ×1 (no parallelism)"
        return f"{self.impl} ×{self.devices}"

    def final_state(self):
        import torch

        path = self.path / "final.pt"
        return torch.load(path, map_location="cpu", weights_only=True) if path.exists() else None


def run_dirs_in(paths: Sequence[str | Path]) -> list[Path]:
    """The run folders that `paths` name: a folder with a record.json, a record.json itself, or a folder
    of run folders; other files (plots, report.md of an earlier comparison) are skipped."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            if p.name == "record.json":
                found.append(p.parent)
        elif (p / "record.json").exists():
            found.append(p)
        elif p.is_dir() and (children := sorted(c.parent for c in p.glob("*/record.json"))):
            found.extend(children)
        else:
            raise SystemExit(f"distref.report: error: {p} holds no record.json (nor folders that do)")
    return found


def load_runs(paths: Sequence[str | Path]) -> list[Run]:
    runs = []
    for path in run_dirs_in(paths):
        try:
            runs.append(Run(path, load_record(path)))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"distref.report: error: cannot read a record in {path}: {exc}") from exc
    return runs


def describe_workload(cfg: dict[str, Any]) -> str:
    length = f"{cfg['steps']} steps" if cfg.get("steps") else f"{cfg.get('epochs')} epoch(s)"
    model = f"gpt ({defining_value(cfg, 'gpt_layers')} layers)" if cfg["model"] == "gpt" else cfg["model"]
    return (
        f"{model} on {cfg['dataset']}, {length}, global batch {cfg['global_batch_size']}, "
        f"{cfg['optimizer']} lr {cfg['lr']} {defining_value(cfg, 'lr_schedule')}, {cfg['precision']}, "
        f"seed {cfg['seed']}"
    )


def training_time_to(record: dict[str, Any], eval_step: int) -> float:
    """Seconds spent in optimizer steps before the eval after step `eval_step` (evaluation excluded)."""
    return sum(s["step_time_s"] for s in record["steps"] if s["step"] < eval_step)


def workload_differences(runs: list[Run]) -> list[str]:
    """One line per workload option on which the runs disagree (empty when comparable). Threads per rank
    count too, on CPU: one run with 2 threads beside another with 1 compares the thread pools, not the
    strategies. On CUDA the GPUs do the work (threads only feed them: hardware counts GPUs), and a run that
    did not complete measured nothing to compare (one that died before its record has compare's own
    process's threads in the record compare wrote for it): neither counts there."""
    lines = []
    # Two runs may share a label (two runs of single): each run is one entry, named by its label.
    for key in WORKLOAD_KEYS:
        values = [(run.label, defining_value(run.record["config"], key)) for run in runs]
        if len({repr(v) for _, v in values}) > 1:
            lines.append(f"--{key.replace('_', '-')}: " + ", ".join(f"{k}={v}" for k, v in values))
    threads = [
        (run.label, run.record["environment"].get("threads_per_rank"))
        for run in runs
        if run.ok and on_cpu(run.record)
    ]
    if len({t for _, t in threads}) > 1:
        lines.append("threads per rank: " + ", ".join(f"{k}={v}" for k, v in threads))
    return lines


# ---- plots ------------------------------------------------------------------------------------------


def _figure(title: str, runs: list[Run], size: tuple[float, float] = (8, 4.5)):
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    ax.set_title(title)
    shas = sorted({(r.record["environment"]["git_sha"] or "no-git")[:10] for r in runs})
    source = "; ".join(f"{r.label}: {r.path.name}" for r in runs)
    fig.text(0.01, 0.005, f"runs: {source} | git {', '.join(shas)}", fontsize=6, color="gray")
    return fig, ax


def _save(fig, path: Path) -> str:
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name


def plot_loss(runs: list[Run], out: Path, by: str) -> str:
    fig, ax = _figure(f"training loss vs {'step' if by == 'step' else 'wall time'}", runs)
    for run in runs:
        steps = run.record["steps"]
        if not steps:
            continue
        if by == "step":
            xs = [s["step"] for s in steps]
        else:
            elapsed, xs = 0.0, []
            for s in steps:
                elapsed += s["step_time_s"]
                xs.append(elapsed)
        ax.plot(xs, [s["loss"] for s in steps], label=run.label, linewidth=1)
    ax.set_xlabel("optimizer step" if by == "step" else "training time (s, sum of step times)")
    ax.set_ylabel("loss (mean over ranks)")
    ax.set_yscale("log")
    ax.legend()
    return _save(fig, out / f"loss_vs_{by}.png")


def plot_accuracy(runs: list[Run], out: Path) -> str:
    fig, ax = _figure("test accuracy vs elapsed time", runs)
    for run in runs:
        evals = run.record["evals"]
        ax.plot([e["elapsed_s"] for e in evals], [e["accuracy"] for e in evals], marker="o", label=run.label)
    targets = {r.record["target_accuracy"] for r in runs} - {None}
    for target in targets:
        ax.axhline(target, color="red", linestyle="--", linewidth=1, label=f"target {target}")
    ax.set_xlabel("elapsed time (s)")
    ax.set_ylabel("test accuracy")
    ax.legend()
    return _save(fig, out / "accuracy_vs_time.png")


def plot_bars(runs: list[Run], out: Path, what: str) -> str:
    import numpy as np

    if what == "throughput":
        fig, ax = _figure("training throughput", runs)
        values = [r.record["samples_per_s"] or 0 for r in runs]
        ax.bar([r.label for r in runs], values, color="tab:blue")
        ax.set_ylabel("samples/s (all ranks)")
        name = "throughput.png"
    elif what == "memory":
        fig, ax = _figure("peak memory per rank (CPU: max RSS; GPU: max allocated)", runs)
        per_run = [r.record["peak_memory_bytes"] for r in runs]
        x = np.arange(len(runs))
        labelled = set()
        for i, peaks in enumerate(per_run):  # each run's ranks side by side, centred on its tick
            width = 0.8 / max(len(peaks), 1)
            for rank, peak in enumerate(peaks):
                label = f"rank {rank}" if rank not in labelled else None
                labelled.add(rank)
                ax.bar(
                    x[i] + (rank - (len(peaks) - 1) / 2) * width,
                    peak / 2**20,
                    width,
                    color=f"C{rank}",
                    label=label,
                )
        ax.set_xticks(x, [r.label for r in runs])
        ax.set_ylabel("MiB")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))  # outside: bars reach the top
        name = "peak_memory.png"
    else:  # pipeline bubble: measured, and the formula's beside it where the schedule has one
        shown = [r for r in runs if r.record.get("bubble_fraction") is not None]
        fig, ax = _figure("pipeline bubble (idle share of each rank's time in the schedule)", shown)
        x = np.arange(len(shown))
        measured = [r.record["bubble_fraction"] for r in shown]
        formula = [formula_bubble(r.record) for r in shown]
        ax.bar(x - 0.2, measured, 0.4, color="tab:orange", label="measured (mean over ranks)")
        ax.bar(x + 0.2, [f or 0 for f in formula], 0.4, color="tab:gray", label="formula")
        for i, f in enumerate(formula):
            if f is None:
                ax.text(x[i] + 0.2, 0.01, "no formula", ha="center", va="bottom", rotation=90, fontsize=8)
        ax.set_xticks(
            x,
            [f"{r.label}\n{(r.record.get('strategy') or {}).get('schedule', '')}" for r in shown],
            fontsize=8,
        )
        ax.set_xlim(-0.8, len(shown) - 0.2)
        ax.set_ylim(0, 1.2)  # (room for the legend above 1)
        ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
        ax.set_ylabel("fraction of time in the schedule idle")
        ax.legend(loc="upper left", ncol=2)
        name = "pipeline_bubble.png"
    return _save(fig, out / name)


# The kinds of communication, in the order tables and plots list them (distref.training.traffic's).
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "send", "recv", "all_to_all")
HATCHES = (None, "//", "..", "xx")  # a pipeline timeline's bars, by the stage's place on its rank
# A pipeline timeline's work, by torch's letters (pipelining.schedules._ComputationType): name, colour.
ACTIONS = {
    "F": ("forward", "tab:blue"),
    "B": ("backward (input and weight gradients)", "tab:orange"),
    "I": ("backward, input gradients", "tab:red"),
    "W": ("backward, weight gradients", "tab:green"),
}


def _kinds(per_rank: list[dict]) -> list[str]:
    """The kinds any rank communicated: KINDS' order, then any other alphabetically."""
    seen = {kind for counts in per_rank for kind in counts}
    return [k for k in KINDS if k in seen] + sorted(seen - set(KINDS))


def measured_communication(record: dict[str, Any]) -> list[dict] | None:
    """Per rank, {kind: {"calls", "bytes", "bus_bytes"}} of the counted step; None where the record has
    none (older records, or a step no rank counted)."""
    measured = (record.get("communication") or {}).get("measured")
    if not measured or all(m is None for m in measured):
        return None
    return [m or {} for m in measured]


def predicted_communication(record: dict[str, Any]) -> list[dict] | None:
    predicted = (record.get("communication") or {}).get("predicted")
    return [p or {} for p in predicted] if predicted else None


def communication_bars(runs: list[Run]) -> list[tuple[Run, int, dict[str, float], float | None]]:
    """Per run that recorded its communication: (the run, its busiest rank (the table's), that rank's
    bus bytes by kind, its formula's total bus bytes or None). Bus bytes, as the cost table's column and
    docs/cost-model.md compare strategies: the raw bytes count an all-gather's whole output, of which a
    rank of n moves (n-1)/n, and an all-reduce's message once, which a ring moves 2(n-1)/n times."""
    bars = []
    for run in runs:
        if (measured := measured_communication(run.record)) is None:
            continue
        rank = busiest_rank(measured)
        predicted = predicted_communication(run.record)
        formula = sum(c.get("bus_bytes", 0.0) for c in predicted[rank].values()) if predicted else None
        bars.append((run, rank, {k: c.get("bus_bytes", 0.0) for k, c in measured[rank].items()}, formula))
    return bars


def plot_communication(runs: list[Run], out: Path) -> str | None:
    """Bus bytes per step by strategy: the rank that moves the most bytes, stacked by kind, its
    formula's total beside it; None when no run recorded its communication."""
    bars = communication_bars(runs)
    if not bars:
        return None
    shown = [run for run, _, _, _ in bars]
    busiest = [(rank, by_kind, formula) for _, rank, by_kind, formula in bars]
    most = max([sum(m.values()) for _, m, _ in busiest] + [1])
    unit, scale = next((u, 2.0**e) for u, e in (("MiB", 20), ("KiB", 10), ("B", 0)) if most >= 2**e)
    title = "bus bytes per step (the rank moving the most bytes), by kind"
    fig, ax = _figure(title, shown, size=(max(8.0, 3 + 1.3 * len(shown)), 4.5))
    kinds = _kinds([m for _, m, _ in busiest])
    x = list(range(len(shown)))
    bottom = [0.0] * len(shown)
    for kind in kinds:
        heights = [m.get(kind, 0.0) / scale for _, m, _ in busiest]
        colour = f"C{KINDS.index(kind)}" if kind in KINDS else None
        ax.bar(x, heights, 0.6, bottom=bottom, label=kind, color=colour)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    formula = [(i, f / scale) for i, (_, _, f) in enumerate(busiest) if f is not None]
    if formula:
        ax.scatter(
            [i for i, _ in formula],
            [f for _, f in formula],
            marker="_",
            s=900,
            color="black",
            zorder=3,
            label="formula (total)",
        )
    for i, (_, m, _) in enumerate(busiest):
        if not m:
            ax.text(i, 0, "none", ha="center", va="bottom", fontsize=8)
    names = [r.label.replace(" ", "\n", 1) for r in shown]  # "ddp\n×2": narrow enough side by side
    ax.set_xticks(
        x, [f"{n}\n(rank {rank})" for n, (rank, _, _) in zip(names, busiest, strict=True)], fontsize=8
    )
    ax.set_ylim(0, 1.1 * max([*bottom, *(f for _, f in formula), 1 / scale]))  # the formula's marks show
    ax.set_ylabel(f"bus bytes ({unit}) per optimizer step")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, out / "communication_per_step.png")


def plot_timeline(run: Run, out: Path, name: str) -> str:
    """One row per rank: the work its stages did in the timeline's step (coloured by action, labelled
    with the micro-batch, torch's "stage action micro-batch" where a rank holds several stages) on the
    grey of its time in the schedule, so that grey is idle. Rows start when that rank's schedule started:
    placed against each other by the wall clock."""
    import matplotlib.patches as mpatches

    strategy = run.record["strategy"]
    rows = [(rank, t) for rank, t in enumerate(strategy["timeline"]) if t]
    origin = min(t["started_at"] for _, t in rows)
    ms = [(1000 * (t["started_at"] - origin), t) for _, t in rows]  # each row's start, in ms
    end = max(start + 1000 * t["schedule_s"] for start, t in ms)
    steps = sorted({t["step"] for _, t in rows})
    title = (
        f"{run.label} {strategy.get('schedule', '')}, {strategy.get('microbatches', '?')} micro-batches: "
        f"step {', '.join(map(str, steps))}, each rank's work"
    )
    fig, ax = _figure(title, [run], size=(10, 1.6 + 0.7 * len(rows)))
    several = any(len({w[1] for w in t["work"]}) > 1 for _, t in rows)
    labels, used = [], set()
    for row, ((rank, t), (start, _)) in enumerate(zip(rows, ms, strict=True)):
        ax.broken_barh([(start, 1000 * t["schedule_s"])], (row - 0.4, 0.8), facecolor="0.88")
        stages = sorted({w[1] for w in t["work"]})
        for action, stage, micro, t0, t1 in t["work"]:
            used.add(action)
            left, width = start + 1000 * t0, 1000 * (t1 - t0)
            hatch = HATCHES[stages.index(stage) % len(HATCHES)]  # a rank's 1st stage plain, then these
            colour = ACTIONS.get(action, (action, "tab:purple"))[1]
            ax.broken_barh(
                [(left, width)], (row - 0.4, 0.8), facecolor=colour, edgecolor="white", hatch=hatch
            )
            text = f"{stage}{action}{micro}" if several else f"{action}{micro}"
            if width > (5 * len(text) + 2) * end / 850:  # room for the label (~5 px a character)
                ax.text(left + width / 2, row, text, ha="center", va="center", fontsize=7, color="white")
        busy = sum(w[4] - w[3] for w in t["work"]) / t["schedule_s"] if t["schedule_s"] else 0
        held = ", ".join(map(str, stages))
        labels.append(f"rank {rank}: stage{'s' if len(stages) > 1 else ''} {held}\nidle {1 - busy:.0%}")
    ax.set_yticks(range(len(rows)), labels)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, end * 1.01)
    clock = "CUDA events" if str(run.record["environment"]["device"]).startswith("cuda") else "host clock"
    ax.set_xlabel(f"ms from the first rank's start of the step's schedule ({clock})")
    handles = [mpatches.Patch(color=ACTIONS[a][1], label=ACTIONS[a][0]) for a in ACTIONS if a in used]
    handles.append(mpatches.Patch(color="0.88", label="idle (waiting, sends, receives, the schedule)"))
    most = max(len({w[1] for w in t["work"]}) for _, t in rows)
    for i, (hatch, nth) in enumerate(zip(HATCHES[1:], ("2nd", "3rd", "4th"), strict=True), start=2):
        if i <= most:
            handles.append(
                mpatches.Patch(
                    facecolor="white", edgecolor="gray", hatch=hatch, label=f"a rank's {nth} stage"
                )
            )
    # Between the title and the rows: the rows fill the plot.
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=3, fontsize=8, frameon=False)
    ax.set_title(title, pad=12 + 14 * ((len(handles) + 2) // 3))
    return _save(fig, out / name)


# ---- tables -----------------------------------------------------------------------------------------


def _fmt(value: Any, spec: str = "", none: str = "—") -> str:
    return none if value is None else format(value, spec)


def _seconds(value: float | None) -> str:
    """Seconds to two significant figures at least (0.052, 0.12, 3.4, 61.2): times the report compares
    (evaluation's) must not show as one figure (0.1) where they differ, nor as 0.0."""
    if value is None:
        return "—"
    return f"{value:.1f}" if value >= 1 else f"{value:#.2g}"


def evaluated(record: dict[str, Any]) -> bool:
    """Whether the run evaluated, and its record says how long that took."""
    return bool(record.get("evals")) and record.get("eval_time_s") is not None


def evaluation_comparison(runs: list[Run], baseline: Run | None) -> str:
    """A sentence setting each run's evaluation time beside single's, from the figures the throughput
    table shows (so that its words follow from them); empty without a baseline that evaluated."""
    if baseline is None or not evaluated(baseline.record):
        return ""
    base = _seconds(baseline.record.get("eval_time_s"))
    said = []
    for run in runs:
        if run is baseline or not run.ok or not evaluated(run.record):
            continue
        shown = _seconds(run.record.get("eval_time_s"))
        ratio = float(base) / float(shown) if float(shown) and float(base) else None
        if ratio is None:
            how = "beside single"
        elif round(ratio, 1) == 1.0:
            how = "about as fast as single"
        elif ratio > 1:
            how = f"{ratio:.1f}× faster than single"
        else:
            how = f"{1 / ratio:.1f}× slower than single"
        said.append(f"{run.label} {how} ({shown} s against {base} s)")
    if not said:
        return ""
    return (
        "Evaluation is part of the strategy's cost (a strategy that scores a shard of the test set on each "
        "rank, as ddp does, can evaluate faster than single; one that gathers the model first, slower). "
        "Here, from the evaluation column above: " + "; ".join(said) + "."
    )


def whose_target(record: dict[str, Any]) -> str | None:
    """The workload ("lenet on mnist") whose target (TARGETS) the run's target is, where that is
    another dataset's and not the run's own: then it says nothing about this run's learning curve."""
    cfg, target = record["config"], record["target_accuracy"]
    if target is None or TARGETS.get((cfg["model"], cfg["dataset"])) == target:
        return None
    return next((f"{m} on {d}" for (m, d), t in TARGETS.items() if t == target and d != cfg["dataset"]), None)


def target_cells(record: dict[str, Any]) -> list[str]:
    """[target, time to target (s)]: *none* for a run without a target, and where the run's target is
    another dataset's (compare's before targets were per dataset), whose it is rather than *not
    reached*."""
    target, reached = record["target_accuracy"], record["time_to_target_s"]
    if target is None:
        return ["none", "— (no target)"]
    if (owner := whose_target(record)) is not None:
        ours = f"{record['config']['model']} on {record['config']['dataset']}"
        return [f"{target} ({owner}'s)", _fmt(reached, ".1f", none=f"n/a: {owner}'s target, not {ours}'s")]
    return [_fmt(target), _fmt(reached, ".1f", none="not reached")]


def formula_bubble(record: dict[str, Any]) -> float | None:
    """The idle share a pipeline's schedule has by formula, with p stage ranks, v stages per rank and m
    micro-batches (PIPELINE_NOTE); None for schedules without one (zero-bubble, V-shaped) and records
    that do not say their schedule."""
    strategy = record.get("strategy") or {}
    schedule, m = strategy.get("schedule"), strategy.get("microbatches")
    if not schedule or not m or not strategy.get("stages"):
        return None
    p = record["world_size"] // (strategy.get("dp") or 1)
    v = strategy["stages"] // p
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved-1f1b" and m >= p:  # (Megatron's derivation: m a multiple of p)
        return (p - 1) / (v * m + p - 1)
    return None


def timeline_bubble(timeline: list[dict | None]) -> float | None:
    """The idle share of the timeline's step, averaged over ranks (as bubble_fraction averages)."""
    shares = [
        1 - sum(w[4] - w[3] for w in t["work"]) / t["schedule_s"] for t in timeline if t and t["schedule_s"]
    ]
    return sum(shares) / len(shares) if shares else None


def _bytes(n: float | None, signed: bool = False) -> str:
    """Bytes as people read them: B, KiB, MiB, GiB (1024s), one decimal; '+' for a positive difference."""
    if n is None:
        return "—"
    sign = "+" if signed and n > 0 else "-" if n < 0 else ""
    n = abs(n)
    for unit, exponent in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 2**exponent:
            return f"{sign}{n / 2**exponent:,.1f} {unit}"
    return f"{sign}{n:,.0f} B"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def busiest_rank(measured: list[dict]) -> int:
    """The rank that moves the most bytes in the counted step (the lowest of equals)."""
    totals = [sum(c["bytes"] for c in counts.values()) for counts in measured]
    return max(range(len(totals)), key=totals.__getitem__)


def communication_cells(record: dict[str, Any]) -> list[str]:
    """[per step (the busiest rank's calls and bytes per kind), its bus bytes, vs formula ("exact", or
    each rank and kind that differs: measured − formula)]; "not counted" where no steady step was."""
    if (why := not_counted(record)) is not None:
        return ["not counted", "—", f"not counted ({why})"]
    measured = measured_communication(record)
    if measured is None:
        return ["—", "—", "—"]
    rank = busiest_rank(measured)
    counts = measured[rank]
    per_step = "; ".join(
        f"{kind}: {_plural(counts[kind]['calls'], 'call')}, {_bytes(counts[kind]['bytes'])}"
        for kind in _kinds([counts])
    )
    if len(measured) > 1:
        same = all(_calls_and_bytes(m) == _calls_and_bytes(counts) for m in measured)
        per_step = f"{per_step or 'none'} ({'every rank' if same else f'rank {rank}; ranks differ'})"
    bus = _bytes(sum(c.get("bus_bytes", 0) for c in counts.values()))
    predicted = predicted_communication(record)
    if predicted is None:
        return [per_step or "none", bus, "no formula"]
    differences = []
    for r, (m, p) in enumerate(zip(measured, predicted, strict=False)):
        for kind in _kinds([m, p]):
            calls = m.get(kind, {}).get("calls", 0) - p.get(kind, {}).get("calls", 0)
            size = m.get(kind, {}).get("bytes", 0) - p.get(kind, {}).get("bytes", 0)
            if calls or size:
                differences.append(f"rank {r} {kind} {calls:+d} calls, {_bytes(size, signed=True)}")
    if len(measured) != len(predicted):
        differences.append(f"{len(measured)} ranks measured, {len(predicted)} predicted")
    return [per_step or "none", bus, _differences(differences)]


def _calls_and_bytes(counts: dict) -> dict:
    return {kind: (c["calls"], c["bytes"]) for kind, c in counts.items()}


DIFFERS = "**differs**"  # how a "vs formula" cell that differs begins


def _differences(differences: list[str]) -> str:
    if not differences:
        return "exact"
    more = f" (and {len(differences) - 2} more)" if len(differences) > 2 else ""
    return f"{DIFFERS} (measured − formula): " + "; ".join(differences[:2]) + more


def formula_differences(record: dict[str, Any]) -> dict[str, str]:
    """The record's costs that differ from their formulas, each as its "vs formula" cell says it
    ({"communication": "**differs** (measured − formula): rank 0 …"}); {} where every one is exact, has no
    formula or was not counted. What a check fails on (ci/gpu_check.py)."""
    communication, memory = communication_cells(record), memory_cells(record)
    cells = {"communication": communication[2], "model states": memory[1], "activations": memory[3]}
    return {name: cell for name, cell in cells.items() if cell.startswith(DIFFERS)}


STATE_KINDS = ("parameters", "gradients", "optimizer")


def memory_cells(record: dict[str, Any]) -> list[str]:
    """[model states, vs formula, activations, vs formula]: per rank, the most of any rank; vs formula
    "exact" (every rank, every kind), the differences (measured − formula), "no formula" (the record has
    a place for one but the impl gave none), "not counted" (activations: no step counted) or — (an older
    record: no place for one; or nothing measured: a resumed session with no steps left)."""
    states = [s for s in record.get("model_state_bytes") or [] if s]
    predicted = record.get("model_state_bytes_predicted")
    if "model_state_bytes_predicted" not in record or not states:  # (no place for one, or not measured)
        states_vs = "—"
    elif not predicted or all(p is None for p in predicted):
        states_vs = "no formula"
    else:
        states_vs = _differences(
            [
                f"rank {rank} {kind} {_bytes(s.get(kind, 0) - p.get(kind, 0), signed=True)}"
                for rank, (s, p) in enumerate(zip(states, predicted, strict=False))
                if p is not None
                for kind in STATE_KINDS
                if s.get(kind, 0) != p.get(kind, 0)
            ]
        )
    activations = record.get("activation_bytes") or {}
    measured_held = activations.get("measured") or []
    predicted_held = activations.get("predicted")
    if not activations:
        held_vs = "—"
    elif all(m is None for m in measured_held):  # (held in the counted step: none was counted)
        held_vs = f"not counted ({why})" if (why := not_counted(record)) else "—"
    elif not predicted_held or all(p is None for p in predicted_held):
        held_vs = "no formula"
    else:
        held_vs = _differences(
            [
                f"rank {rank} {_bytes(m - p, signed=True)}"
                for rank, (m, p) in enumerate(zip(measured_held, predicted_held, strict=False))
                if m is not None and p is not None and m != p
            ]
        )
    return [
        _bytes(max((sum(s.get(k, 0) for k in STATE_KINDS) for s in states), default=None)),
        states_vs,
        _bytes(max((a for a in measured_held if a is not None), default=None)),
        held_vs,
    ]


def cost_row(run: Run) -> list[str]:
    rec = run.record
    peaks = rec.get("peak_memory_bytes") or []
    return [
        run.label,
        str(rec["world_size"]),
        *communication_cells(rec),
        *memory_cells(rec),
        _bytes(max(peaks, default=None)),
        counting_cost(rec),
    ]


def counting_cost(record: dict[str, Any]) -> str:
    """What counting the step's communication added to the run: the counted step's time beyond a
    median step's, as a share of the training time (one step counted per session, so it shrinks as
    runs grow)."""
    overhead = (record.get("communication") or {}).get("counting_overhead_s")
    train = record.get("train_time_s")
    if overhead is None or not train:
        return "—"
    return f"{max(overhead, 0.0) / train:.1%} of training ({overhead:+.3f} s)"


def pipeline_row(run: Run) -> list[str]:
    rec = run.record
    strategy = rec.get("strategy") or {}
    p = rec["world_size"] // (strategy.get("dp") or 1)
    v = strategy["stages"] // p if strategy.get("stages") else None
    busy = strategy.get("busy_fraction") or []
    timeline = strategy.get("timeline") or []
    steps = sorted({t["step"] for t in timeline if t})
    shown = f"step {', '.join(map(str, steps))}: {timeline_bubble(timeline):.2f}" if steps else "—"
    formula = formula_bubble(rec)
    return [
        run.label,
        strategy.get("schedule", "—"),
        f"{p} × {v}" if v else "—",
        str(strategy.get("microbatches", "—")),
        _fmt(formula, ".2f", none="no formula" if strategy.get("schedule") else "—"),
        _fmt(rec.get("bubble_fraction"), ".2f"),
        ", ".join(f"{b:.2f}" if b is not None else "—" for b in busy) or "—",
        shown,
    ]


COST_TITLE = "Cost: communication per step and memory per rank, measured and by formula"
PIPELINE_TITLE = "Pipeline: the bubble by formula and measured, and the schedule's timeline"
ROUTING_TITLE = "Routing balance (mixture of experts): tokens per expert, beside speed and parity"


def load_imbalance(tokens_per_expert: list[int]) -> float | None:
    """A layer's routing in a step: its busiest expert's tokens ÷ the mean (1: even; E: all to one)."""
    total = sum(tokens_per_expert)
    return max(tokens_per_expert) * len(tokens_per_expert) / total if total else None


def routed_steps(record: dict[str, Any]) -> list[dict[str, Any]]:
    return [row for row in record["steps"] if row.get("tokens_per_expert")]


def routing_row(run: Run, parity: list[str]) -> list[str]:
    """[run, experts, the last step's tokens per expert (its most uneven layer), the worst layer's load
    imbalance at the first and last step and on average, the last balance loss, samples/s, exact parity]."""
    rec, cfg = run.record, run.record["config"]
    steps = routed_steps(rec)
    worst = [max(load_imbalance(layer) or 0.0 for layer in row["tokens_per_expert"]) for row in steps]
    last = steps[-1]["tokens_per_expert"] if steps else None
    uneven = max(last, key=lambda layer: load_imbalance(layer) or 0.0) if last else None
    return [
        run.label,
        f"{cfg.get('experts')} × top-{cfg.get('top_k')}",
        " / ".join(str(n) for n in uneven) if uneven else "—",
        _fmt(worst[0] if worst else None, ".2f"),
        _fmt(worst[-1] if worst else None, ".2f"),
        _fmt(sum(worst) / len(worst) if worst else None, ".2f"),
        _fmt(steps[-1].get("balance_loss") if steps else None, ".4f"),
        _fmt(rec["samples_per_s"], ",.0f"),
        parity[0],
    ]


def is_pipeline(run: Run) -> bool:
    strategy = run.record.get("strategy") or {}
    return run.record.get("bubble_fraction") is not None or bool(strategy.get("timeline"))


def reference_run(runs: list[Run]) -> Run | None:
    """The run the others are measured against: the first completed run of single."""
    return next((r for r in runs if r.impl == "single" and r.ok), None)


def tables(runs: list[Run]) -> dict[str, tuple[list[str], list[list[str]]]]:
    baseline = reference_run(runs)
    base_state = baseline.final_state() if baseline else None
    parity, speed, target, memory, held, versions = [], [], [], [], [], []
    cost = [cost_row(run) for run in runs]
    pipelines = [pipeline_row(run) for run in runs if is_pipeline(run)]
    routing = []
    for run in runs:
        rec = run.record
        parity.append([run.label, *parity_cells(run, baseline, base_state)])
        if run.ok and routed_steps(rec):
            routing.append(routing_row(run, parity[-1][1:]))
        sps = rec["samples_per_s"]
        efficiency = scaling_efficiency(rec, baseline.record) if baseline and run is not baseline else None
        speed_up = sps / baseline.record["samples_per_s"] if efficiency is not None else None
        speed.append(
            [
                run.label,
                hardware(rec)[1],
                _fmt(sps, ",.0f"),
                _fmt(speed_up, ".2f", none="reference" if run is baseline else "—"),
                _fmt(efficiency, ".2f", none="reference" if run is baseline else "—"),
                _fmt(rec.get("startup_time_s"), ".1f"),
                _fmt(rec.get("train_time_s"), ".1f"),
                _seconds(rec.get("eval_time_s")),
                _fmt(rec["wall_time_s"], ".1f"),
            ]
        )
        reached = rec["time_to_target_s"]
        first = next((e for e in rec["evals"] if e["elapsed_s"] == reached), None) if reached else None
        target_shown, reached_shown = target_cells(rec)
        target.append(
            [
                run.label,
                target_shown,
                _fmt(rec["final_accuracy"], ".4f"),
                reached_shown,
                _fmt(first and first["step"]),
                _fmt(first and training_time_to(rec, first["step"]), ".1f"),
                _fmt(rec.get("startup_time_s"), ".1f"),
            ]
        )
        peaks = rec["peak_memory_bytes"]
        memory.append(
            [
                run.label,
                ", ".join(f"{m / 2**20:,.0f}" for m in peaks) or "—",
                _fmt(max(peaks) / 2**20 if peaks else None, ",.0f"),
            ]
        )
        # ZeRO-3's formula: single's whole model state (parameters, gradients, optimizer) ÷ the ranks.
        whole = sum((baseline.record.get("model_state_bytes") or [{}])[0].values()) if baseline else 0
        for rank, rank_state in enumerate(rec.get("model_state_bytes") or []):
            kib = [rank_state[k] / 1024 for k in ("parameters", "gradients", "optimizer")]
            sharded = f"{whole / rec['world_size'] / 1024:,.1f}" if whole else "—"
            held.append([run.label, str(rank), *(f"{k:,.1f}" for k in kib), f"{sum(kib):,.1f}", sharded])
        env = rec["environment"]
        versions.append(
            [
                run.label,
                rec["impl"]["version"],
                env["torch"],
                f"{env['device']} ({env['device_name']})",
                env["backend"],
                f"{env['cpu_count']} / {env['gpu_count']}",
                str(env.get("threads_per_rank", "—")),
                (env["git_sha"] or "—")[:10],
                env["hostname"],
                run.path.name,
            ]
        )
    return {
        "Parity with single (max relative parameter difference)": (
            ["run", "exact parity", "oracle", "tolerance", "end-of-run drift vs single"],
            parity,
        ),
        "Throughput and scaling": (
            [
                "run",
                "hardware",
                "samples/s",
                "speed-up vs single",
                "scaling efficiency",
                "start-up (s)",
                "training (s)",
                "evaluation (s)",
                "wall time (s)",
            ],
            speed,
        ),
        "Time to target accuracy": (
            [
                "run",
                "target",
                "final accuracy",
                "time to target (s)",
                "at step",
                "of which training (s)",
                "start-up (s)",
            ],
            target,
        ),
        "Peak memory (MiB)": (["run", "per rank", "max"], memory),
        "Model state per rank (KiB, measured after the first step)": (
            [
                "run",
                "rank",
                "parameters",
                "gradients",
                "optimizer",
                "total",
                "ZeRO-3 formula (single's ÷ ranks)",
            ],
            held,
        ),
        COST_TITLE: (
            [
                "run",
                "ranks",
                "communication per step (the busiest rank)",
                "bus bytes",
                "communication vs formula",
                "model states",
                "model states vs formula",
                "activations",
                "activations vs formula",
                "peak memory",
                "counting's cost",
            ],
            cost,
        ),
        **(
            {
                PIPELINE_TITLE: (
                    [
                        "run",
                        "schedule",
                        "stage ranks × stages per rank",
                        "micro-batches",
                        "bubble by formula",
                        "bubble measured (mean over ranks)",
                        "busy share per rank",
                        "the timeline's step: its bubble",
                    ],
                    pipelines,
                )
            }
            if pipelines
            else {}
        ),
        **(
            {
                ROUTING_TITLE: (
                    [
                        "run",
                        "experts",
                        "tokens per expert, last step (its most uneven layer)",
                        "load imbalance, first step (max ÷ mean, worst layer)",
                        "last step",
                        "mean over steps",
                        "balance loss, last step",
                        "samples/s",
                        "exact parity",
                    ],
                    routing,
                )
            }
            if routing
            else {}
        ),
        "Versions and environment": (
            [
                "run",
                "impl version",
                "torch",
                "device",
                "backend",
                "CPUs / GPUs",
                "threads/rank",
                "git sha",
                "host",
                "run dir",
            ],
            versions,
        ),
    }


def parity_cells(run: Run, baseline: Run | None, base_state: dict | None) -> list[str]:
    """[exact parity, oracle, tolerance, end-of-run drift] of a run: the first three from the parity.json
    that distref.compare wrote beside its record, the drift from the final.pt files."""
    if not run.ok:
        return ["failed", "", "", ""]
    if run is baseline:
        return ["reference", "", "", "reference"]
    state = run.final_state()
    if state is None or base_state is None:
        drift = "n/a (no final.pt from this run or from single)"
    elif state.keys() != base_state.keys():
        drift = "n/a (other parameter names than single's)"
    else:
        drift = f"{max_relative_difference(state, base_state):.1e}"
    path = run.path / "parity.json"
    if not path.exists():
        return ["not checked (`python -m distref.compare` checks it)", "", "", drift]
    check = json.loads(path.read_text())
    oracle = f"{check['oracle']}, {check['precision']}, {check['steps']} steps"
    if "not_checked" in check:  # (ci/gpu_check.py's: no exact oracle among the runs it has)
        return [f"not checked: {check['not_checked']}", "", "", drift]
    if "refused" in check:
        exact = f"n/a: the impl refuses it ({check['refused']})"
    elif "error" in check:
        exact = f"**error**: {check['error']}"
    else:
        exact = f"{check['difference']:.1e} " + ("✓" if check["passed"] else "**FAIL**")
    return [exact, oracle, f"{check['tolerance']:g}", drift]


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table; a cell is one line (a newline would end the row) and its `|` is escaped."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += [
        "| " + " | ".join(" ".join(cell.split("\n")).replace("|", "\\|") for cell in row) + " |"
        for row in rows
    ]
    return "\n".join(lines)


def as_text(text: str) -> str:
    """Text from outside (an error message) as Markdown shows it: its `*`, `_`, backticks, brackets and
    backslashes escaped, so that they stay characters."""
    return re.sub(r"([\\`*_\[\]])", r"\\\1", text)


def build_report(
    run_dirs: Sequence[str | Path],
    out: str | Path,
    allow_mixed: bool = False,
    not_run: Sequence[tuple[str, str]] = (),
) -> Path:
    """The comparison report (report.md and its plots) of the runs in `run_dirs`, written under `out`;
    `not_run`: (impl, why) of impls the comparison left out (made for another model, or unable to take
    the world size on these GPUs), listed under "Not run"."""
    runs = load_runs(run_dirs)
    if not runs:
        raise SystemExit("distref.report: error: no runs given")
    differences = workload_differences(runs)
    if differences and not allow_mixed:
        raise SystemExit(
            "distref.report: error: these runs are different workloads and cannot be compared "
            "side by side (--allow-mixed to report them anyway): " + "; ".join(differences)
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    completed = [r for r in runs if r.ok]
    # The tables are the report; the plots need matplotlib (a dependency of the tests and the nox
    # sessions, not of distref-core: a GPU machine without a registry may lack it).
    plotted = completed if importlib.util.find_spec("matplotlib") is not None else []
    if completed and not plotted:
        print("distref.report: no plots: matplotlib is not installed (the tables are all there)")
    plots = {}
    if plotted:
        plots = {
            "Loss vs step": plot_loss(completed, out, "step"),
            "Loss vs wall time": plot_loss(completed, out, "time"),
            "Test accuracy vs time": plot_accuracy(completed, out),
            "Throughput": plot_bars(completed, out, "throughput"),
            "Peak memory per rank": plot_bars(completed, out, "memory"),
        }
    # Plots of a section, shown under its table and note.
    section_plots: dict[str, list[tuple[str, str]]] = {COST_TITLE: [], PIPELINE_TITLE: []}
    if plotted and (name := plot_communication(plotted, out)):
        section_plots[COST_TITLE].append(("Communication per step by strategy", name))
    if any(r.record.get("bubble_fraction") is not None for r in plotted):
        section_plots[PIPELINE_TITLE].append(("Pipeline bubble", plot_bars(plotted, out, "bubble")))
    timelines = [r for r in plotted if any((r.record.get("strategy") or {}).get("timeline") or [])]
    for n, run in enumerate(timelines, start=1):
        name = plot_timeline(run, out, f"pipeline_timeline_{n}.png")
        section_plots[PIPELINE_TITLE].append((f"Pipeline timeline: {run.label} ({run.path.name})", name))

    # Mixed workloads have no one title: each run's workload is listed under the warning instead.
    workload = "mixed workloads" if differences else describe_workload(runs[0].record["config"])
    failures = [[r.label, as_text(r.record.get("error") or "failed"), str(r.path)] for r in runs if not r.ok]
    table_data = tables(runs)
    baseline = reference_run(runs)

    md = [f"# distref comparison: {workload}", ""]
    if differences:
        md += ["> **These runs are different workloads; compare with care:**", ""]
        md += [f"> - {d}" for d in differences] + [""]
        md += [f"> - {r.label}: {describe_workload(r.record['config'])}" for r in runs] + [""]
    if failures:
        md += ["## Failed runs", "", _md_table(["run", "error", "run dir"], failures), ""]
    if not_run:
        md += ["## Not run", "", _md_table(["impl", "why"], [[i, as_text(why)] for i, why in not_run]), ""]
    for title, (header, rows) in table_data.items():
        md += [f"## {title}", "", _md_table(header, rows), ""]
        if title.startswith("Parity"):
            md += [PARITY_NOTE, ""]
        if title.startswith("Time to target"):
            md += [" ".join(filter(None, [TARGET_NOTE, evaluation_comparison(runs, baseline)])), ""]
        if title.startswith("Throughput"):
            md += [EFFICIENCY_NOTE, ""]
        if title == COST_TITLE:
            md += [COST_NOTE, ""]
        if title == PIPELINE_TITLE:
            md += [PIPELINE_NOTE, ""]
        if title == ROUTING_TITLE:
            md += [ROUTING_NOTE, ""]
        for caption, name in section_plots.get(title, []):
            md += [f"### {caption}", "", f"![{caption}]({name})", ""]
    for title, name in plots.items():
        md += [f"## {title}", "", f"![{title}]({name})", ""]
    report = out / "report.md"
    report.write_text("\n".join(md))

    # The page is the same Markdown, rendered (tables on; raw HTML off: an error message's "<" is text).
    try:
        from markdown_it import MarkdownIt
    except ImportError:  # a dependency of distref-core; report.md is the report either way
        print("distref.report: report.html not written: it needs markdown-it-py (pip install markdown-it-py)")
        return report
    body = MarkdownIt("commonmark", {"html": False}).enable("table").render("\n".join(md))
    style = (
        "body{font-family:sans-serif;max-width:60em;margin:auto}td,th{border:1px solid #ccc;padding:2px 6px}"
    )
    (out / "report.html").write_text(f"<!doctype html><meta charset=utf-8><style>{style}</style>{body}")
    return report


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m distref.report", description=__doc__.splitlines()[0])
    parser.add_argument(
        "run_dirs", nargs="+", help="folders holding record.json (and final.pt), or a folder of them"
    )
    parser.add_argument("--out", required=True, help="where report.md, report.html and the plots go")
    parser.add_argument("--allow-mixed", action="store_true", help="report runs of different workloads")
    args = parser.parse_args(argv)
    report = build_report(args.run_dirs, args.out, args.allow_mixed)
    print(f"report: {report}")


if __name__ == "__main__":
    sys.exit(main())
