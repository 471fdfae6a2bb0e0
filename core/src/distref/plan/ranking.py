"""The plan: every layout costed, ranked, each with one line of why."""

from __future__ import annotations

import dataclasses

from distref.plan.cluster import RESERVED_BYTES, Cluster, Training
from distref.plan.costing import Row, cost
from distref.plan.layouts import CONTEXT_PARALLEL, layouts
from distref.plan.model import Model, PlanError


@dataclasses.dataclass
class Plan:
    """Every layout of `model` on `cluster` costed and ranked (`rows`), and the layouts skipped, with why."""

    model: Model
    cluster: Cluster
    training: Training
    rows: list[Row]  # ranked: fitting rows by tokens/s per GPU, then the rest by memory
    skipped: list[tuple[str, str]]
    tp: int | None = None  # the degrees asked for (--tp, --pp, --cp, --ep), if any
    pp: int | None = None
    cp: int | None = None
    ep: int | None = None

    def smallest_cluster(self, limit: int = 2**16) -> tuple[int, Row] | None:
        """Where nothing fits: the fewest GPUs (doubling) on which something would, and its best row."""
        gpus = self.cluster.gpus * 2
        while gpus <= limit:
            bigger = make_plan(
                self.model,
                dataclasses.replace(self.cluster, gpus=gpus),
                self.training,
                self.tp,
                self.pp,
                self.cp,
                self.ep,
            )
            if bigger.rows and bigger.rows[0].fits:
                return gpus, bigger.rows[0]
            gpus *= 2
        return None


def make_plan(
    model: Model,
    cluster: Cluster,
    training: Training,
    tp: int | None = None,
    pp: int | None = None,
    cp: int | None = None,
    ep: int | None = None,
) -> Plan:
    """Every layout (only those of tensor-, pipeline-, context- or expert-parallel degree `tp` / `pp` /
    `cp` / `ep` where given) costed and ranked."""
    found, skipped = layouts(model, cluster, tp, pp, cp, ep)
    rows = []
    for layout in found:
        try:
            rows.append(cost(layout, model, cluster, training))
        except PlanError as e:
            skipped.append((f"{layout.strategy} {layout.mesh}", str(e)))
    rows.sort(key=rank_key)
    usable = cluster.gpu.memory_bytes - RESERVED_BYTES
    for row in rows:
        row.why = explain(row, usable, cluster)
        if row.strategy in CONTEXT_PARALLEL and row.fits:
            row.why = context_parallel_why(row, rows, model.gpt.seq)
        if row.strategy == "ep":
            row.why = expert_parallel_why(row, model.gpt.experts)
    return Plan(model, cluster, training, rows, skipped, tp, pp, cp, ep)


def rank_key(row: Row) -> tuple:
    """Fitting rows first, the most tokens per second per GPU first (to 3 significant digits: closer than
    that the model cannot tell them apart), then the fewest extrapolations, the least time communicating
    (the least exposed to the bandwidths assumed) and the least memory; rows without a time by memory;
    rows that do not fit last."""
    total = row.memory_per_gpu_bytes["total"]
    if not row.fits:
        return (2, total)
    if row.tokens_per_s_per_gpu is None:
        return (1, total)
    speed = -float(f"{row.tokens_per_s_per_gpu:.3g}")
    return (0, speed, len(row.extrapolated), row.communication_s, total)


def explain(row: Row, usable: float, cluster: Cluster) -> str:
    """One line of why: what bounds the row's step (compute, communication, memory)."""
    memory = row.memory_per_gpu_bytes
    states, activations, total = memory["model_states"], memory["activations"], memory["total"]
    held = f"{gb(states)} states" + (f" + {gb(activations)} activations" if activations is not None else "")
    if not row.fits:
        return f"does not fit: {gb(total)} of {gb(usable)} usable ({held})"
    room = f"{gb(total)} of {gb(usable)}"
    if row.compute_s is None:
        return f"fits, {room} ({held}); no FLOPs known: time not estimated"
    moved = sum(row.communication_bytes.values())
    if not moved:
        return f"compute-bound: {row.compute_s:.2f} s per step, nothing to communicate; {room}"
    exposed = row.exposed
    if exposed and exposed["exposed_s"] > 0.01 * row.compute_s:
        where = "across nodes" if exposed["link"] == "inter_node" else "within the node"
        when = {
            "after": "not overlapped",
            "last": "in the last backward",
            "steps": "beyond the compute",
            "attention": "beyond attention's compute",
        }
        return (
            f"communication-bound: {gb(exposed['bytes'])} {where} {when[exposed['phase']]} adds "
            f"{exposed['exposed_s']:.2f} s to {row.compute_s:.2f} s of compute; {room}"
        )
    return f"compute-bound: {gb(moved)} of communication hides under {row.compute_s:.2f} s of compute; {room}"


def context_parallel_why(row: Row, rows: list[Row], seq: int) -> str:
    """A fitting context-parallel row's why, and what it holds against the others: the only kind that fits
    (each GPU keeps 1/C of every sequence's activations), or faster than the best tensor-parallel row
    (whose collectives in every layer are exposed; the ring's hops hide under attention)."""
    cp = row.layout.cp
    held = f"1/{cp} of each {seq:,}-token sequence per GPU"
    if not any(other.fits and other.strategy not in CONTEXT_PARALLEL for other in rows):
        return f"only context parallelism fits ({held}): {row.why}"
    tp = next((other for other in rows if other.fits and other.strategy == "tp"), None)
    faster = tp is not None and row.tokens_per_s_per_gpu and tp.tokens_per_s_per_gpu
    if faster and row.tokens_per_s_per_gpu > tp.tokens_per_s_per_gpu:
        gain = row.tokens_per_s_per_gpu / tp.tokens_per_s_per_gpu - 1
        return (
            f"{row.why}; {held}; {gain:.0%} faster than tp {tp.mesh} (communication exposed: "
            f"{exposed_s(row):.2f} s, tp's {exposed_s(tp):.2f} s)"
        )
    return f"{row.why}; {held}"


def expert_parallel_why(row: Row, experts: int) -> str:
    """An expert-parallel row's why, with what each GPU holds of the experts and that its activations are
    not planned (not for a mixture of experts yet: its model states alone decide whether it fits)."""
    ep = row.layout.ep
    held = f"{experts // ep} of each layer's {experts} experts per GPU"
    return f"{row.why}; {held}; activations not planned (not for a mixture of experts yet)"


def exposed_s(row: Row) -> float:
    """Seconds a row's communication adds to its step (beyond what hides under compute)."""
    return max(0.0, row.step_s["overlap"] - row.compute_s)  # (0, not a rounding error's -0.00)


def gb(n: float | None) -> str:
    """Bytes in GB (10⁹ bytes), one decimal; — for none."""
    return "—" if n is None else f"{n / 1e9:.1f} GB"
