"""--simulate: a plan's row run through the impl's own sharding on torch's fake process group."""

from __future__ import annotations

import dataclasses
import sys

from distref.plan.cluster import GiB
from distref.plan.costing import Row, cost
from distref.plan.layouts import CONTEXT_PARALLEL, Layout
from distref.plan.ranking import Plan, gb

REAL_TENSORS_LIMIT = 2 * GiB  # model states a simulation on real tensors (DDP, DeepSpeed) may build here


def simulation_of(layout: Layout, row: Row) -> tuple[str, list[str]] | str:
    """(impl, its options) that run `layout` in distref.simulate, or why there is none."""
    if layout.strategy in ("ddp", "fsdp"):
        return layout.strategy, []
    if layout.strategy == "hsdp":
        return "fsdp", ["--hsdp", str(layout.dp // layout.shard)]  # (--hsdp R: the replicas)
    if layout.strategy == "tp":
        return "tensor_parallel", ["--tp", str(layout.tp), "--dp-shard", str(layout.dp)]
    if layout.strategy in CONTEXT_PARALLEL:
        mode = "ulysses" if layout.strategy == "cp-ulysses" else "ring"
        return "context_parallel", ["--cp", str(layout.cp), "--dp-shard", str(layout.dp), "--cp-mode", mode]
    if layout.strategy == "ep":
        return "expert_parallel", ["--ep", str(layout.ep)]
    if layout.strategy in ("zero1", "zero2", "zero3"):
        return "deepspeed_zero", ["--zero-stage", layout.strategy[-1]]
    if layout.strategy.startswith("pp-"):
        schedule = layout.strategy.removeprefix("pp-")
        return "pipeline", [
            "--schedule",
            schedule,
            "--dp",
            str(layout.dp),
            "--microbatches",
            str(row.grad_accum),
        ]
    return f"{layout.strategy}: no simulation (distref.simulate's docstring says which impls run on it)"


def simulate_row(plan: Plan, row: Row) -> str:
    """Rank 0 of `row`'s layout at the plan's world size, on torch's fake process group (distref.simulate):
    its model states and one step's communication measured, beside the plan's in fp32 (the impls'
    precision; the plan's mixed-precision figures are the paper's)."""
    from distref.simulate import TENSORS, simulate

    layout = row.layout
    if plan.model.gpt is None:
        return "--simulate builds a decoder of the plan's shape: give --model 125m … 70b"
    found = simulation_of(layout, row)
    if isinstance(found, str):
        return found
    impl, options = found
    fp32 = dataclasses.replace(plan.training, precision="fp32")
    planned = cost(layout, plan.model, plan.cluster, fp32)
    if TENSORS[impl] == "real" and 16 * plan.model.parameters > REAL_TENSORS_LIMIT:
        return (
            f"{impl} runs on real tensors in a simulation (distref.simulate says why): "
            f"{gb(16 * plan.model.parameters)} of them is too much to build here; --simulate N picks another row"
        )
    world = layout.dp * layout.tp * layout.pp * layout.cp
    excepthook = sys.excepthook  # (its process group wraps it, to prefix "[rank0]:" to every line)
    try:
        run = simulate(
            impl,
            world,
            plan.model.gpt,
            options=options,
            micro_batch=row.micro_batch,
            grad_accum=1 if impl == "pipeline" else row.grad_accum,
            optimizer=plan.training.optimizer,
            activation_checkpointing=plan.training.checkpointing,
        )
    except ValueError as e:
        return f"{impl} at {world} ranks: not simulated: {e}"
    finally:
        sys.excepthook = excepthook
    states = sum(run.model_state_bytes.values())
    comm = sum(e["bus_bytes"] for e in run.communication.values())
    return (
        f"simulated {' '.join([impl, *options])} at {world} ranks (rank 0, fake process group, {run.seconds:.1f} s): "
        f"model states {states:,} B, plan (fp32) {planned.memory_per_gpu_bytes['model_states']:,.0f} B; "
        f"communication {comm:,.0f} bus bytes per step, plan {sum(planned.communication_bytes.values()):,.0f}"
    )
