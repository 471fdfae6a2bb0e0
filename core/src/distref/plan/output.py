"""The plan as a terminal table, Markdown, JSON rows, and a plot."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from distref.plan.cluster import RESERVED_BYTES
from distref.plan.layouts import powers_of_two
from distref.plan.ranking import Plan, gb, make_plan


def table_rows(plan: Plan) -> tuple[list[str], list[list[str]], list[str]]:
    """Header, cells and footnotes (what each row extrapolates)."""
    header = ["#", "strategy", "mesh", "b×K", "states", "activations", "total", "fits", "intra-node"]
    header += ["inter-node", "step s (overlap / none)", "tokens/s/GPU", "why"]
    notes: list[str] = []
    cells = []
    for i, row in enumerate(plan.rows, 1):
        marks = []
        for note in row.extrapolated:
            if note not in notes:
                notes.append(note)
            marks.append(str(notes.index(note) + 1))
        memory = row.memory_per_gpu_bytes
        step, serial = row.step_s["overlap"], row.step_s["no_overlap"]
        cells.append(
            [
                str(i) + (f" [{','.join(marks)}]" if marks else ""),
                row.strategy,
                row.mesh,
                f"{row.micro_batch}×{row.grad_accum}",
                gb(memory["model_states"]),
                gb(memory["activations"]),
                gb(memory["total"]),
                "yes" if row.fits else "no",
                gb(row.communication_bytes["intra_node"]),
                gb(row.communication_bytes["inter_node"]),
                "—" if step is None else f"{step:.3f} / {serial:.3f}",
                "—" if row.tokens_per_s_per_gpu is None else f"{row.tokens_per_s_per_gpu:,.0f}",
                row.why,
            ]
        )
    return header, cells, notes


def heading(plan: Plan) -> str:
    """One line: the model, the cluster, the training set-up."""
    c, t, m = plan.cluster, plan.training, plan.model
    return (
        f"{m.name} ({m.parameters / 1e9:.2f}B parameters) on {c.gpus} × {c.gpu.name} ({c.nodes} node(s) of "
        f"{c.gpu.gpus_per_node}); global batch {t.global_batch}, {t.precision} precision, {t.optimizer}"
        f"{', activation checkpointing' if t.checkpointing else ''}, MFU {t.mfu:.0%}"
    )


def render_text(plan: Plan) -> str:
    """The plan as a terminal table (the why column last, unpadded), then its footer."""
    header, cells, notes = table_rows(plan)
    widths = [max(len(r[i]) for r in [header, *cells]) for i in range(len(header) - 1)]
    lines = [heading(plan), ""]
    for r in [header, *cells]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1])
    lines += ["", *footer(plan, notes)]
    return "\n".join(lines)


def render_markdown(plan: Plan) -> str:
    """The plan as a Markdown table, then its footer as a list."""
    header, cells, notes = table_rows(plan)
    lines = [f"**{heading(plan)}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in cells]
    return "\n".join([*lines, "", *(f"- {line}" for line in footer(plan, notes))])


def footer(plan: Plan, notes: list[str]) -> list[str]:
    """The footnotes, what the numbers are, what was skipped, and, where nothing fits, what would."""
    lines = [f"[{i}] extrapolated: {note}" for i, note in enumerate(notes, 1)]
    lines.append(
        "Memory per GPU; communication in bus bytes per step and GPU; times from FLOPs at the MFU and bytes at "
        "the links' bandwidths (a model: `--validate RUN_DIR` sets it against runs). docs/plan.md says where "
        "each number comes from."
    )
    if plan.skipped:
        by_reason: dict[str, list[str]] = {}
        for what, why in plan.skipped:
            by_reason.setdefault(why, []).append(what)
        lines.append(
            "Skipped: " + "; ".join(f"{', '.join(whats)}: {why}" for why, whats in by_reason.items())
        )
    if plan.rows and not plan.rows[0].fits:
        bigger = plan.smallest_cluster()
        if bigger is None and plan.model.gpt is not None and plan.model.gpt.experts:
            least = min(row.memory_per_gpu_bytes["model_states"] for row in plan.rows)
            lines.append(
                "Nothing fits, on any cluster of these GPUs: impls/expert_parallel spreads each layer's "
                f"{plan.model.gpt.experts} experts over at most {plan.model.gpt.experts} GPUs and keeps every "
                f"other parameter whole on each (DDP): at least {gb(least)} of model states per GPU here."
            )
        elif bigger is None:
            lines.append(
                f"Nothing fits, on any cluster of these GPUs: beyond {plan.training.global_batch} GPUs the global "
                "batch leaves a GPU no sample. Activations are the most of it: --activation-checkpointing keeps "
                "only each block's input."
                if not plan.training.checkpointing
                else f"Nothing fits, on any cluster of these GPUs (beyond {plan.training.global_batch} GPUs the "
                "global batch leaves a GPU no sample)."
            )
        else:
            gpus, row = bigger
            lines.append(
                f"Nothing fits on {plan.cluster.gpus} GPUs. The smallest cluster that would: {gpus} GPUs, "
                f"with {row.strategy} {row.mesh} ({gb(row.memory_per_gpu_bytes['total'])} per GPU)."
            )
    return lines


def plot(plan: Plan, path: Path) -> None:
    """Memory per GPU against the number of GPUs (each strategy's smallest mesh option), and step time by
    strategy on the plan's cluster."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    counts = powers_of_two(plan.cluster.gpus)
    least: dict[str, dict[int, float]] = {}  # strategy (pipelines as one) → GPUs → least memory per GPU
    for gpus in counts:
        smaller = make_plan(plan.model, dataclasses.replace(plan.cluster, gpus=gpus), plan.training)
        for row in smaller.rows:
            family = least.setdefault("pp" if row.strategy.startswith("pp-") else row.strategy, {})
            family[gpus] = min(family.get(gpus, math.inf), row.memory_per_gpu_bytes["total"])
    for family, points in sorted(least.items()):
        left.plot(list(points), [m / 1e9 for m in points.values()], marker="o", label=family)
    left.axhline(
        (plan.cluster.gpu.memory_bytes - RESERVED_BYTES) / 1e9, color="k", linestyle="--", label="usable"
    )
    left.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="GB per GPU", title="memory per GPU")
    left.legend(fontsize=7)
    timed = [row for row in plan.rows if row.step_s["overlap"] is not None][:20]
    right.barh(
        [f"{r.strategy} {r.mesh}" for r in timed],
        [r.step_s["overlap"] for r in timed],
        color=["tab:green" if r.fits else "tab:gray" for r in timed],
    )
    right.invert_yaxis()
    right.set(
        xlabel="step time, s (overlap; grey: does not fit)", title=f"step time on {plan.cluster.gpus} GPUs"
    )
    right.tick_params(axis="y", labelsize=7)
    fig.suptitle(heading(plan), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
