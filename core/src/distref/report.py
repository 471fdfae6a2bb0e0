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
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distref.config import RUN_DEFINING_OPTIONS, defining_value
from distref.parity_metric import max_relative_difference
from distref.record import load_record

# Options that define the workload: two runs are compared only if these are equal. What defines a run
# (as for resuming it: the model, the data, the optimizer's trajectory), and its length and target.
WORKLOAD_KEYS = (*RUN_DEFINING_OPTIONS, "epochs", "steps", "target_accuracy")


TARGET_NOTE = (
    "Time to target is counted as MLPerf counts it: from the end of initialisation (the first step) to "
    "the end of the first evaluation reaching the target, evaluation included; 'of which training' is "
    "the optimizer steps alone. Start-up (process start to the first step: imports, data, model, process "
    "group, engine) is left out of it and shown beside it; wall time counts everything from process start. "
    "Evaluation is part of the strategy's cost: ddp scores its test-set shard on every rank, so it "
    "evaluates about world-size times faster than single. Time to target moves in whole evaluation "
    "intervals: compare the step at which each run got there too."
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
    "excludes the first (warm-up) step and evaluation."
)


def hardware(record: dict[str, Any]) -> tuple[int, str]:
    """(units, description) of what a run kept busy: GPUs on CUDA, processes × threads on CPU."""
    env = record["environment"]
    if str(env["device"]).startswith("cuda"):
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
    count too: one run with 2 threads beside another with 1 compares the thread pools, not the strategies."""
    lines = []
    # Two runs may share a label (two runs of single): each run is one entry, named by its label.
    for key in WORKLOAD_KEYS:
        values = [(run.label, defining_value(run.record["config"], key)) for run in runs]
        if len({repr(v) for _, v in values}) > 1:
            lines.append(f"--{key.replace('_', '-')}: " + ", ".join(f"{k}={v}" for k, v in values))
    threads = [(run.label, run.record["environment"].get("threads_per_rank")) for run in runs]
    if len({t for _, t in threads}) > 1:
        lines.append("threads per rank: " + ", ".join(f"{k}={v}" for k, v in threads))
    return lines


# ---- plots ------------------------------------------------------------------------------------------


def _figure(title: str, runs: list[Run]):
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
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
    else:  # pipeline bubble
        fig, ax = _figure("pipeline bubble (idle fraction of each stage)", runs)
        shown = [r for r in runs if r.record.get("bubble_fraction") is not None]
        ax.bar([r.label for r in shown], [r.record["bubble_fraction"] for r in shown], color="tab:orange")
        ax.set_ylabel("fraction of step time idle")
        name = "pipeline_bubble.png"
    return _save(fig, out / name)


# ---- tables -----------------------------------------------------------------------------------------


def _fmt(value: Any, spec: str = "", none: str = "—") -> str:
    return none if value is None else format(value, spec)


def tables(runs: list[Run]) -> dict[str, tuple[list[str], list[list[str]]]]:
    baseline = next((r for r in runs if r.impl == "single" and r.ok), None)
    base_state = baseline.final_state() if baseline else None
    parity, speed, target, memory, held, versions = [], [], [], [], [], []
    for run in runs:
        rec = run.record
        parity.append([run.label, *parity_cells(run, baseline, base_state)])
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
                _fmt(rec.get("eval_time_s"), ".1f"),
                _fmt(rec["wall_time_s"], ".1f"),
            ]
        )
        reached = rec["time_to_target_s"]
        first = next((e for e in rec["evals"] if e["elapsed_s"] == reached), None) if reached else None
        target.append(
            [
                run.label,
                _fmt(rec["target_accuracy"]),
                _fmt(rec["final_accuracy"], ".4f"),
                _fmt(reached, ".1f", none="not reached" if rec["target_accuracy"] else "—"),
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
    `not_run`: (impl, why) of impls the comparison left out of this workload."""
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
    plots = {}
    if completed:
        plots = {
            "Loss vs step": plot_loss(completed, out, "step"),
            "Loss vs wall time": plot_loss(completed, out, "time"),
            "Test accuracy vs time": plot_accuracy(completed, out),
            "Throughput": plot_bars(completed, out, "throughput"),
            "Peak memory per rank": plot_bars(completed, out, "memory"),
        }
        if any(r.record.get("bubble_fraction") is not None for r in completed):
            plots["Pipeline bubble"] = plot_bars(completed, out, "bubble")

    # Mixed workloads have no one title: each run's workload is listed under the warning instead.
    workload = "mixed workloads" if differences else describe_workload(runs[0].record["config"])
    failures = [[r.label, as_text(r.record.get("error") or "failed"), str(r.path)] for r in runs if not r.ok]
    table_data = tables(runs)

    md = [f"# distref comparison: {workload}", ""]
    if differences:
        md += ["> **These runs are different workloads; compare with care:**", ""]
        md += [f"> - {d}" for d in differences] + [""]
        md += [f"> - {r.label}: {describe_workload(r.record['config'])}" for r in runs] + [""]
    if failures:
        md += ["## Failed runs", "", _md_table(["run", "error", "run dir"], failures), ""]
    if not_run:
        md += ["## Not run on this workload", "", _md_table(["impl", "why"], [list(n) for n in not_run]), ""]
    for title, (header, rows) in table_data.items():
        md += [f"## {title}", "", _md_table(header, rows), ""]
        if title.startswith("Parity"):
            md += [PARITY_NOTE, ""]
        if title.startswith("Time to target"):
            md += [TARGET_NOTE, ""]
        if title.startswith("Throughput"):
            md += [EFFICIENCY_NOTE, ""]
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
