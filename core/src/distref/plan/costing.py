"""One layout costed per GPU from distref.cost: memory, communication by link, time."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
from collections.abc import Iterator
from typing import Any

import torch

from distref.cost import activations as act
from distref.cost.context_parallel import context_parallel_cost
from distref.cost.counts import Counts, merge
from distref.cost.data_parallel import ddp as ddp_communication
from distref.cost.expert_parallel import expert_parallel_cost, is_expert_parameter, uniform_routing
from distref.cost.memory import ZERO_PARTITIONS, mixed_precision, replicated
from distref.cost.pipeline import model_parallel as model_parallel_communication
from distref.cost.pipeline import pipeline as pipeline_communication
from distref.cost.sharded import fsdp as fsdp_communication
from distref.cost.sharded import fsdp_model_states
from distref.cost.tensor_parallel import (
    fsdp_units,
    parameters_held,
    tensor_parallel,
    tensor_parallel_model_states,
)
from distref.cost.tp_activations import tensor_parallel_activation_bytes
from distref.cost.zero import zero_bf16_communication, zero_communication, zero_model_states
from distref.distributed.partition import choose_cut_points, part_bounds
from distref.distributed.stages import default_stages_per_rank, schedule_problem, work_order
from distref.impl_folders import load_train_api
from distref.plan.cluster import GPU, RESERVED_BYTES, Cluster, Training
from distref.plan.layouts import CONTEXT_PARALLEL, Layout
from distref.plan.model import Model, PlanError
from distref.simulate import IMPLS_DIR

DDP_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's bucket_cap_mb default
ZERO_REDUCE_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size default (elements)
ZERO_PREFETCH_BUCKET = 50_000_000  # stage3_prefetch_bucket_size default (elements)
# When each data-parallel collective runs, as the impls run it: "steps" in any micro-step's forward or
# backward (FSDP's and ZeRO-3's gathers, ZeRO-2's reductions), "last" in the last micro-step's backward
# (DDP's all-reduce, FSDP's reduce-scatter: gradient sync only then), "after" once the backward is done
# (ZeRO-1's reduction at the step boundary, ZeRO's all-gather of the updated parameters): never hidden.
# (Ring attention's hops run in "attention": each block travels while the one before it is computed.)
PHASES = {
    "ddp": {"all_reduce": "last"},
    "zero0": {},  # (DeepSpeed's stage 0 all-reduces the gradients once the backward is done)
    "zero1": {},
    "zero2": {"all_reduce": "steps"},
    "zero3": {"all_gather": "steps", "reduce_scatter": "steps"},
    "fsdp": {"all_gather": "steps", "reduce_scatter": "last", "all_reduce": "last"},
}
PHASES["hsdp"] = PHASES["fsdp"]
K_OPTIMIZER = {"adamw": 12, "sgd": 8}  # mixed precision: fp32 master copy and the optimizer's fp32 states
MEASURED_WORLD, SIMULATED_WORLD = 4, 512  # the largest worlds the tests run for real, and simulate
ATTENTION_KINDS = ("send", "recv", "all_to_all")  # context parallelism's attention; FSDP2's are collectives


@dataclasses.dataclass
class Row:
    """One layout costed: per GPU (a pipeline's fullest rank), one optimizer step of `micro_batch` samples
    × `grad_accum` micro-steps. `extrapolated`: what its numbers rest on that no test measured."""

    strategy: str
    mesh: str
    memory_per_gpu_bytes: dict[str, float | None]
    fits: bool
    communication_bytes: dict[str, float]  # per step per GPU: bus bytes by link
    communication_s: float  # those bytes over their links' bandwidths
    compute_s: float | None
    step_s: dict[str, float | None]  # no_overlap, overlap
    tokens_per_s_per_gpu: float | None
    extrapolated: list[str]
    why: str = ""
    cpu_bytes: float = 0.0  # offloaded optimizer states, per GPU
    pipeline_rank: int | None = None  # the pipeline rank whose memory is given: the fullest
    exposed: dict[str, Any] | None = None  # the communication adding most to the step: phase, link, bytes, s
    micro_batch: int = 0
    grad_accum: int = 0
    layout: Layout | None = None

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("layout")
        return out


def micro_steps(training: Training, replicas: int) -> tuple[int, int]:
    """(micro-batch, micro-steps K) with `replicas` data-parallel copies; PlanError where they do not
    divide the global batch."""
    if training.grad_accum:
        k = training.grad_accum
        if training.global_batch % (replicas * k):
            raise PlanError(
                f"global batch {training.global_batch} is not {replicas} replicas × {k} micro-steps × b"
            )
        return training.global_batch // (replicas * k), k
    b = training.micro_batch
    if training.global_batch % (replicas * b):
        raise PlanError(
            f"global batch {training.global_batch} is not a multiple of {replicas} replicas × micro-batch {b}"
        )
    return b, training.global_batch // (replicas * b)


def data_parallel_states(
    layout: Layout, model: Model, training: Training, k: int
) -> tuple[dict[str, float], float]:
    """(model states on the GPU at their most, bytes offloaded to the CPU) for the data-parallel family,
    `k` micro-steps per step."""
    n, strategy, e = layout.dp, layout.strategy.removesuffix("-offload"), training.element_bytes
    # over how many ranks each of (parameters, gradients, optimizer states) is partitioned
    over = {f"zero{stage}": tuple(n if cut else 1 for cut in cuts) for stage, cuts in ZERO_PARTITIONS.items()}
    over |= {"ddp": over["zero0"], "fsdp": (n, n, n), "hsdp": (layout.shard,) * 3}
    numels = [math.prod(s) for s in model.shapes]
    if training.precision == "mixed":
        p, g, o = over[strategy]
        states = mixed_precision(
            model.parameters,
            parameters_over=p,
            gradients_over=g,
            optimizer_over=o,
            k=K_OPTIMIZER[training.optimizer],
        )
    elif strategy in ("ddp", "zero0"):  # (ZeRO stage 0 partitions nothing: DDP's states)
        states = replicated([numel * e for numel in numels], training.optimizer)
    elif strategy in ("fsdp", "hsdp"):
        shard = n if strategy == "fsdp" else layout.shard
        states = fsdp_model_states(model.shapes, shard, 0, e, training.optimizer)
    else:
        states = zero_model_states(numels, n, 0, int(strategy[-1]), training.optimizer, element_bytes=e)
    if strategy in ("fsdp", "hsdp") and k > 1:
        # impls/fsdp syncs gradients only in the last micro-step: until then each rank accumulates them
        # whole (FSDP2's set_requires_gradient_sync(False), as DDP's no_sync)
        states["gradients"] = model.parameters * e
    offloaded = 0.0
    if layout.strategy.endswith("-offload"):  # ZeRO-Offload: the optimizer's states and step on the CPU
        offloaded = states["optimizer"]
        states = {**states, "optimizer": 0}
    return states, offloaded


def data_parallel_communication(
    layout: Layout, model: Model, training: Training, k: int
) -> tuple[Counts, list[str]]:
    """One step's collectives of the data-parallel family, `k` micro-steps, by the impl's own formula
    (distref.cost), and what they extrapolate."""
    n, strategy = layout.dp, layout.strategy.removesuffix("-offload")
    e = training.element_bytes
    numels = [math.prod(s) for s in model.shapes]
    notes = []
    if strategy == "ddp":  # (the gradients' all-reduce, and the buffers' broadcast before each step)
        return (
            ddp_communication(
                [m * e for m in numels], n, bucket_cap_bytes=DDP_BUCKET_BYTES, buffers=model.buffer_bytes(e)
            ),
            notes,
        )
    if strategy == "zero0":
        notes.append(
            "ZeRO stage 0's all-reduce: DDP's bytes in DeepSpeed's buckets (no formula in distref.cost)"
        )
        return ddp_communication([m * e for m in numels], n, bucket_cap_bytes=ZERO_REDUCE_BUCKET * e), notes
    if strategy in ("fsdp", "hsdp"):
        shard = n if strategy == "fsdp" else layout.shard
        units = unit_shapes(model)
        # impls/fsdp's default: each unit but the last resharded after forward, none with one shard
        resharded = [shard > 1 and i < len(units) - 1 for i in range(len(units))]
        return (
            fsdp_communication(
                units,
                resharded,
                shard,
                replicas=n // shard,
                # (under autocast impls/fsdp gathers 16-bit parameters and reduces fp32 gradients)
                gather_element_bytes=training.compute_element_bytes,
                reduce_element_bytes=e,
                grad_accum=k,
            ),
            notes,
        )
    stage = int(strategy[-1])
    if n == 1:
        return {}, notes
    buckets = dict(bucket_elements=ZERO_REDUCE_BUCKET, prefetch_elements=ZERO_PREFETCH_BUCKET, grad_accum=k)
    if training.precision == "mixed" and stage > 0:  # DeepSpeed's bf16 (16-bit buckets and gathers)
        counts = zero_bf16_communication(numels, n, stage, **buckets)
    else:
        counts = zero_communication(numels, n, stage, **buckets, element_bytes=e)
    if counts is None:  # ZeRO-3 beyond one prefetch bucket: FSDP's pattern (two gathers, one reduce-scatter)
        notes.append("ZeRO-3's communication beyond one prefetch bucket: FSDP's formula (not measured)")
        units = unit_shapes(model)
        counts = fsdp_communication(
            units, [True] * len(units), n, gather_element_bytes=e, reduce_element_bytes=e, grad_accum=k
        )
    return counts, notes


def unit_shapes(model: Model) -> list[list[tuple[int, ...]]]:
    """The parameters' shapes grouped by block (FSDP's units in the impls: one per block)."""
    units, shapes = [], iter(model.shapes)
    for count in model.block_parameters:
        unit, held = [], 0
        while held < count:
            shape = next(shapes)
            unit.append(shape)
            held += math.prod(shape)
        units.append(unit)
    return units


def cost(layout: Layout, model: Model, cluster: Cluster, training: Training) -> Row:
    """One layout's memory, communication and time per GPU (the worst GPU where they differ); PlanError for
    a layout whose impl refuses the model in this precision."""
    notes: list[str] = []
    family = layout.strategy.removesuffix("-offload")
    sixteen_bit_parameters = family.startswith(("fsdp", "hsdp", "zero")) and training.precision != "fp32"
    if sixteen_bit_parameters and any(dtype.is_floating_point for _, dtype, _ in model.buffers):
        raise PlanError(  # (distref.your_model.batch_norm_in_16_bits_problem, which the impls ask)
            "impls/fsdp and impls/deepspeed_zero refuse a BatchNorm in 16 bits: its weights would be 16-bit, "
            "its running statistics fp32"
        )
    if training.precision == "mixed" and layout.strategy != "ep":
        notes.append(
            "mixed precision: the ZeRO paper's bytes per parameter (DeepSpeed's own partition of the "
            "gradients and padding left out: distref.cost.zero.zero_bf16_model_states has them); activations "
            "as 16-bit parameters save them (impls but fsdp and deepspeed_zero train fp32 parameters under "
            "autocast: --precision autocast)"
        )
    if training.precision == "autocast" and family.startswith("zero"):
        notes.append(
            "autocast: DeepSpeed casts the module to bf16 (no autocast over fp32 parameters): activations as "
            "its 16-bit parameters save them, states as fp32's"
        )
    if layout.strategy == "ep":
        notes += expert_parallel_notes(layout, model, training)
    elif model.gpt is not None and training.device == "cuda" and layout.strategy == "cp":
        notes.append(
            "activations: ring attention saves its own q, k, v, output and log-sum-exp (no SDPA kernel); "
            "the formulas are measured exact on the CPU, not yet on a GPU"
        )
    elif model.gpt is not None and training.device == "cuda":
        # (Ulysses attends over the whole sequence with 1/C of the heads: SDPA's kernel for those)
        saving = training.saving(layout.strategy, model.gpt, layout.tp * layout.cp)
        notes.append(
            f"activations: SDPA's {saving.attention} kernel on CUDA saves "
            "what torch's source says (distref.cost.attention); the formulas are measured exact on the CPU's "
            "kernels, not yet on a GPU"
        )
    world = layout.dp * layout.tp * layout.pp * layout.cp
    if world > SIMULATED_WORLD:
        notes.append(
            f"world {world}: formulas simulated up to {SIMULATED_WORLD} ranks, measured up to {MEASURED_WORLD}"
        )
    cpu_bytes = 0.0
    # Each collective's bus bytes by (when it runs: PHASES, the link its group spans)
    timed: dict[tuple[str, str], Counts] = {}
    slowdown, worst_rank = 0.0, None  # a pipeline's time over the ideal: its bubble, its slowest rank
    b, k = micro_steps(training, layout.dp)
    # (by strategy, not by mesh: tensor parallelism of degree 1 and a one-part model_parallel are theirs)
    if layout.strategy == "ep":
        states, all_to_all, ddp_counts, copies = expert_parallel_costs(layout, model, training, b, k)
        activations = None  # (not planned for a mixture of experts: expert_parallel_notes says so)
        # the all-to-alls wait for what they carry (every MoE layer, forward and backward) within the
        # expert-parallel group; DDP's all-reduce in the last backward and the experts' copies' after it,
        # over every rank
        merge_into(timed.setdefault(("after", cluster.link(layout.ep)), {}), all_to_all)
        merge_into(timed.setdefault(("last", cluster.link(world)), {}), ddp_counts)
        merge_into(timed.setdefault(("after", cluster.link(world)), {}), copies)
    elif layout.strategy in CONTEXT_PARALLEL:
        states, activations, cp_counts, dp_counts = context_parallel_costs(layout, model, training, b, k)
        # the ring's hops hide under attention's compute; Ulysses' all-to-alls wait for what they carry
        phase = "attention" if layout.strategy == "cp" else "after"
        merge_into(timed.setdefault((phase, cluster.link(layout.cp)), {}), cp_counts)
        for kind, entry in dp_counts.items():  # FSDP2 over every rank, the groups' and the slices' alike
            key = (PHASES["fsdp"].get(kind, "after"), cluster.link(layout.dp * layout.cp))
            merge_into(timed.setdefault(key, {}), {kind: entry})
    elif layout.strategy not in ("tp", "model_parallel") and not layout.strategy.startswith("pp-"):
        strategy = layout.strategy.removesuffix("-offload")
        states, cpu_bytes = data_parallel_states(layout, model, training, k)
        activations = whole_model_activations(model, b, training, layout.strategy)
        counts, more = data_parallel_communication(layout, model, training, k)
        notes += more
        if layout.strategy.endswith("-offload"):
            notes.append("offload: the CPU's optimizer step and PCIe copies not modelled (no formula)")
        for kind, entry in counts.items():
            # HSDP: the replicas' all-reduce spans the nodes, the shard group's collectives one node
            group = layout.shard if strategy == "hsdp" and kind != "all_reduce" else layout.dp
            merge_into(
                timed.setdefault((PHASES[strategy].get(kind, "after"), cluster.link(group)), {}),
                {kind: entry},
            )
    elif layout.strategy == "tp":
        states, activations, tp_counts, dp_counts = tensor_parallel_costs(layout, model, training, b, k)
        if layout.dp > 1:  # (impls/tensor_parallel has no activation formula on its 2-D mesh either)
            notes.append(
                "activations on the dp × tp mesh: the 1-D formula (FSDP2's gathered slices left out)"
            )
        merge_into(timed.setdefault(("after", "intra_node"), {}), tp_counts)  # on the critical path
        for kind, entry in dp_counts.items():  # FSDP over the dp groups
            key = (PHASES["fsdp"].get(kind, "after"), cluster.link(layout.dp * layout.tp))
            merge_into(timed.setdefault(key, {}), {kind: entry})
    else:
        states, activations, p2p, dp_counts, slowdown, more, worst_rank = pipeline_costs(
            layout, model, training, b, k
        )
        notes += more
        # (point-to-point on the critical path; the pipelines' all-reduce after the schedule)
        merge_into(timed.setdefault(("after", cluster.link(layout.pp)), {}), p2p)
        merge_into(timed.setdefault(("after", cluster.link(layout.pp * layout.dp)), {}), dp_counts)
    if activations is None and layout.strategy != "ep":
        notes.append("activations: no formula for this model (whether it fits is judged on its model states)")
    states_total = sum(states.values())
    total = states_total + (activations or 0)
    usable = cluster.gpu.memory_bytes - RESERVED_BYTES
    communication = {"intra_node": 0.0, "inter_node": 0.0}
    seconds = {"attention": 0.0, "steps": 0.0, "last": 0.0, "after": 0.0}
    for (phase, link), counts in timed.items():
        communication[link] += bus(counts)
        seconds[phase] += bus(counts) / cluster.bandwidth(link)
    comm_s = sum(seconds.values())
    compute_s = step_flops(model, training, world)
    step = {"no_overlap": None, "overlap": None}
    tokens, bound_by = None, None
    if compute_s is not None:
        compute_s = compute_s / (peak(cluster.gpu, training.precision) * training.mfu) * (1 + slowdown)
        # what hides under compute: causal attention's for the ring's hops, the last micro-step's backward
        # (2/3 of its FLOPs) for what runs there, the rest of the step for what may run in any micro-step;
        # nothing for what runs after
        hidden_attention = min(seconds["attention"], compute_s * attention_share(model))
        hidden_last = min(seconds["last"], compute_s * 2 / 3 / k)
        hidden_steps = min(seconds["steps"], compute_s - hidden_last - hidden_attention)
        overlap = compute_s + comm_s - hidden_last - hidden_steps - hidden_attention
        step = {"no_overlap": compute_s + comm_s, "overlap": overlap}
        tokens = training.global_batch * model.tokens_per_sample / step["overlap"] / world
        exposed = {
            "attention": seconds["attention"] - hidden_attention,
            "steps": seconds["steps"] - hidden_steps,
            "last": seconds["last"] - hidden_last,
            "after": seconds["after"],
        }
        phase = max(exposed, key=exposed.get)
        if exposed[phase] > 0:  # the phase adding the most to the step, and its busiest link
            link = max(
                ("intra_node", "inter_node"),
                key=lambda link: bus(timed.get((phase, link), {})) / cluster.bandwidth(link),
            )
            bound_by = {"phase": phase, "link": link, "bytes": bus(timed.get((phase, link), {}))}
            bound_by["exposed_s"] = exposed[phase]
    return Row(
        strategy=layout.strategy,
        mesh=layout.mesh,
        memory_per_gpu_bytes={
            "model_states": states_total,
            "activations": activations,
            "total": total,
            **states,
        },
        fits=total <= usable,
        communication_bytes=communication,
        communication_s=comm_s,
        compute_s=compute_s,
        step_s=step,
        tokens_per_s_per_gpu=tokens,
        extrapolated=notes,
        cpu_bytes=cpu_bytes,
        pipeline_rank=worst_rank,
        exposed=bound_by,
        micro_batch=b,
        grad_accum=k,
        layout=layout,
    )


def peak(gpu: GPU, precision: str) -> float:
    """Dense peak FLOP/s in the training's precision (autocast: 16-bit's; fp64, for --validate's fp64
    runs: half fp32's)."""
    if precision == "autocast":
        return gpu.peak_flops["mixed"]
    return gpu.peak_flops.get(precision) or gpu.peak_flops["fp32"] / 2


def bus(counts: Counts) -> float:
    """Bus bytes of all the collectives in `counts`."""
    return sum(entry["bus_bytes"] for entry in counts.values())


def merge_into(into: Counts, part: Counts) -> None:
    """Add `part`'s calls and bytes to `into`."""
    into.update(merge(into, part))


def whole_model_activations(
    model: Model, micro_batch: int, training: Training, strategy: str
) -> float | None:
    """A rank of `strategy` running the whole model on `micro_batch` samples (distref.cost.activations), if
    a formula."""
    if model.formula is None:
        return None
    saving = training.saving(strategy, model.gpt)
    return act.stage_bytes(*model.formula(saving, training.checkpointing), micro_batch)


def step_flops(model: Model, training: Training, world: int) -> float | None:
    """One GPU's share of a step's FLOPs (recomputation included with activation checkpointing)."""
    if model.flops_per_sample is None:
        return None
    recompute = 4 / 3 if training.checkpointing else 1
    return model.flops_per_sample * training.global_batch * recompute / world


def attention_share(model: Model) -> float:
    """The share of a step's compute that is causal attention's (0 for a model without one): half of
    PaLM's 12·L·h·s FLOPs per token, which count every key for every query; a causal query meets the keys
    before it, and the ring's load-balanced hops compute half a block each."""
    if model.gpt is None or not model.flops_per_sample:
        return 0.0
    shape = model.gpt
    return 6 * shape.layers * shape.hidden * shape.seq * model.tokens_per_sample / model.flops_per_sample


def context_parallel_costs(layout: Layout, model: Model, training: Training, b: int, k: int):
    """impls/context_parallel (gpt's sequences split over cp ranks, ring or Ulysses; FSDP2 over all dp × cp
    ranks), by distref.cost.context_parallel: rank 0's model states (the fullest shard, with gradients
    whole while micro-steps accumulate), activations (s/C tokens), and the attention's and FSDP2's traffic
    apart."""
    shape, e, world = model.gpt, training.element_bytes, layout.dp * layout.cp
    predicted = context_parallel_cost(
        mode="ulysses" if layout.strategy == "cp-ulysses" else "ring",
        cp=layout.cp,
        dp_shard=layout.dp,
        shard_rank=0,
        layers=shape.layers,
        hidden=shape.hidden,
        heads=shape.heads,
        vocabulary=shape.vocab,
        sequence=shape.seq,
        micro_batch=b,
        grad_accum=k,
        optimizer=training.optimizer,
        # 16 bits as the impl computes under --precision bf16: FSDP2 gathers 16-bit parameters and
        # reduce-scatters fp32 gradients; the ring's key/value gradients travel in fp32
        precision="bf16" if training.precision in ("mixed", "autocast") else training.precision,
        element_bytes=e,
        step_bytes=4,
        activation_checkpointing=training.checkpointing,
        device=training.device,
    )
    states: dict[str, float] = dict(predicted.model_states)
    if training.precision == "mixed":
        states = mixed_precision(
            model.parameters,
            parameters_over=world,
            gradients_over=world,
            optimizer_over=world,
            k=K_OPTIMIZER[training.optimizer],
        )
    if k > 1:  # (as impls/fsdp: gradient sync in the last micro-step only, whole gradients until then)
        states["gradients"] = model.parameters * e
    communication = predicted.communication
    attention = {kind: entry for kind, entry in communication.items() if kind in ATTENTION_KINDS}
    sharded = {kind: entry for kind, entry in communication.items() if kind not in ATTENTION_KINDS}
    return states, predicted.activations, attention, sharded


EXPERT_PARALLEL_ACTIVATIONS = (
    "activations: not planned for a mixture of experts yet (its router's, routed tokens' and experts' "
    "hidden: runs measure them); whether it fits is judged on its model states"
)


def expert_parallel_notes(layout: Layout, model: Model, training: Training) -> list[str]:
    """What an expert-parallel row rests on that no test measured."""
    shape = model.gpt
    notes = [EXPERT_PARALLEL_ACTIVATIONS]
    if layout.ep > 1 and layout.routed_rows is None:
        notes.append(
            "uniform routing: each rank's experts receive as many rows as it sends (all-to-all bytes) and "
            "compute an even share (time); a skewed router sends some ranks more"
        )
    if shape.expert_width != 4 * shape.hidden:
        notes.append(
            f"experts {shape.expert_width:,} wide, the preset's (distref.models builds 4 × hidden): planned by "
            "distref.cost.expert_parallel's formulas, which take any shapes"
        )
    if training.precision == "mixed":
        notes.append(
            "mixed precision: the ZeRO paper's bytes per parameter of what a rank holds (its E/ep experts, "
            "the rest whole); traffic as impls/expert_parallel's under --precision bf16 (bf16 tokens, fp32 "
            "gradients)"
        )
    return notes


def expert_parallel_costs(layout: Layout, model: Model, training: Training, b: int, k: int):
    """impls/expert_parallel (each MoE layer's E experts spread over ep ranks, dp / ep copies of them; the
    rest replicated by DDP over all dp ranks), by distref.cost.expert_parallel: rank 0's model states (its
    E/ep experts and the rest whole) and apart its all-to-alls (under uniform routing, `uniform_routing`,
    or a run's own: `routed_rows`), DDP's all-reduce of the rest's gradients, and the all-reduce of the
    experts' copies."""
    shape, world = model.gpt, layout.dp
    named = list(zip(model.parameter_names, model.shapes, strict=True))
    sent = b * shape.seq * shape.top_k  # rows a rank sends per MoE layer and micro-step: dropless
    if layout.routed_rows is not None:  # (the micro-steps' rows in all: the bytes add up alike)
        routed = [(sent, rows) for rows in layout.routed_rows]
        routed += [(sent, 0)] * (shape.layers * (k - 1))
    else:  # (--ep 1: a group of one moves nothing on the bus, as the impl, which sends nothing, does)
        routed = uniform_routing(b * shape.seq, shape.top_k, shape.layers, k)
    cost_of = functools.partial(
        expert_parallel_cost,
        world_size=world,
        ep=layout.ep,
        experts=shape.experts,
        hidden=shape.hidden,
        # bf16 as the impl computes under --precision bf16: bf16 tokens, fp32 parameters and gradients
        precision="bf16" if training.precision in ("mixed", "autocast") else training.precision,
        checkpointed=training.checkpointing,
        optimizer=training.optimizer,
        bucket_cap_mb=DDP_BUCKET_BYTES / 2**20,
        step_bytes=4,
    )
    communication, states = cost_of(named, routed=routed)
    # the experts' copies' all-reduce alone: the formula on the experts only, no tokens routed
    copies, _ = cost_of([(n, s) for n, s in named if is_expert_parameter(n)], routed=[])
    copied = copies.get("all_reduce", {})
    dense = {key: value - copied.get(key, 0) for key, value in communication.get("all_reduce", {}).items()}
    ddp_counts = {"all_reduce": dense} if dense.get("calls") else {}
    all_to_all = {kind: entry for kind, entry in communication.items() if kind == "all_to_all"}
    if training.precision == "mixed":
        held = sum(math.prod(s) // (layout.ep if is_expert_parameter(n) else 1) for n, s in named)
        states = mixed_precision(held, k=K_OPTIMIZER[training.optimizer])
    return dict(states), all_to_all, ddp_counts, copies


def tensor_parallel_costs(layout: Layout, model: Model, training: Training, b: int, k: int):
    """impls/tensor_parallel's 2-D mesh (FSDP over dp, Megatron TP with sequence and loss parallelism)."""
    shape, t, d, e = model.gpt, layout.tp, layout.dp, training.element_bytes
    dims = dict(layers=shape.layers, hidden=shape.hidden, vocabulary=shape.vocab, sequence=shape.seq)
    held = sum(
        math.prod(s) for _, s in parameters_held(shape.layers, shape.hidden, shape.vocab, shape.seq, t, 0)
    )
    if training.precision != "mixed":
        states = tensor_parallel_model_states(
            **dims, tp=t, tp_rank=0, optimizer=training.optimizer, dp_shard=d, element_bytes=e
        )
    else:
        states = mixed_precision(
            held, parameters_over=d, gradients_over=d, optimizer_over=d, k=K_OPTIMIZER[training.optimizer]
        )
    if d > 1 and k > 1:  # (impls/tensor_parallel, as impls/fsdp: gradients whole until the last micro-step)
        states["gradients"] = held * e
    activations = tensor_parallel_activation_bytes(
        micro_batch=b,
        seq=shape.seq,
        hidden=shape.hidden,
        heads=shape.heads,
        layers=shape.layers,
        vocab=shape.vocab,
        tp=t,
        tp_rank=0,
        sequence_parallel=True,
        loss_parallel=True,
        checkpointed=training.checkpointing,
        saving=training.saving("tp", model.gpt, t),
    )
    total = tensor_parallel(
        **dims,
        micro_batch=b,
        tp=t,
        sequence_parallel=True,
        loss_parallel=True,
        optimizer=training.optimizer,
        grad_accum=k,
        dp_shard=d,
        element_bytes=e,
        compute_element_bytes=training.compute_element_bytes,  # (what the linear layers' outputs are)
        activation_checkpointing=training.checkpointing,
        device=training.device,
    )
    dp_counts: Counts = {}
    if d > 1:  # what FSDP adds over the dp ranks (as tensor_parallel computes it)
        units = fsdp_units(
            parameters_held(shape.layers, shape.hidden, shape.vocab, shape.seq, t, 0), shape.layers
        )
        dp_counts = fsdp_communication(
            units, [True] * len(units), d, gather_element_bytes=e, reduce_element_bytes=e, grad_accum=k
        )
    tp_counts = {
        kind: {key: value - dp_counts.get(kind, {}).get(key, 0) for key, value in entry.items()}
        for kind, entry in total.items()
    }
    return states, activations, {k_: v for k_, v in tp_counts.items() if v["calls"]}, dp_counts


def cut_bounds(model: Model, parts: int, partition: str | None = None) -> list[tuple[int, int]]:
    """Each part's (first block, end block): the impls' own cut (`--partition`, else the balanced one that
    gives every part parameters, distref.distributed.partition), so that the plan holds what they hold;
    PlanError where the impls would refuse it."""
    sizes = {f"#{i}": count for i, count in enumerate(model.block_parameters)}  # (blocks by index)
    cuts, problem = choose_cut_points(sizes, partition, parts, model.name)
    if problem:
        raise PlanError(problem)
    return part_bounds(cuts, len(sizes))


@functools.lru_cache(maxsize=64)
def schedule_orders(schedule: str, p: int, m: int, v: int = 2) -> dict[int, list[act.Action]]:
    """Each rank's order of work (kind, stage, micro-batch) in one step: GPipe's and 1F1B's by their rule,
    the multi-stage schedules' (`v` stages per rank) from torch's own `pipeline_order` (built on the fake
    backend, as impls/pipeline builds it: rank r's stages round-robin or V-shaped)."""
    if schedule in ("gpipe", "1f1b"):
        return {r: act.one_stage_order(schedule, m, p, r) for r in range(p)}
    from torch.distributed.pipelining import PipelineStage

    module = pipeline_impl()
    with order_world(p), compute_order_only():
        stages = [
            PipelineStage(torch.nn.Linear(1, 1), index, v * p, torch.device("cpu"))
            for index in module.stage_indices(schedule, 0, p, v)
        ]
        built = module.SCHEDULES[schedule](stages, m, loss_fn=lambda out, target: out.sum())
        return {rank: work_order(built, rank, schedule, m, v * p, rank) for rank in range(p)}


@contextlib.contextmanager
def compute_order_only() -> Iterator[None]:
    """Inside, torch's multi-stage schedules are built without lowering their order to one with its sends
    and receives (`_prepare_schedule_with_comms`, kept apart as `pipeline_order_with_comms`), which the
    plan does not read: it reads `pipeline_order`. The lowering grows with the square of the micro-batches
    and was nine tenths of a plan's time (30 s for 70B where nothing fits and larger clusters are tried)."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    lowering = _PipelineScheduleRuntime.__dict__.get("_prepare_schedule_with_comms")
    if lowering is None:  # (another torch: built as it builds them)
        yield
        return
    _PipelineScheduleRuntime._prepare_schedule_with_comms = lambda self, actions, format="compute_only": None
    try:
        yield
    finally:
        _PipelineScheduleRuntime._prepare_schedule_with_comms = lowering


@contextlib.contextmanager
def order_world(world_size: int) -> Iterator[None]:
    """This process as rank 0 of `world_size` on torch's fake backend, for a schedule's constructor."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # (registers the "fake" backend)

    if dist.is_initialized():
        raise PlanError("the pipeline schedules' orders are built on a fake process group: not inside a job")
    excepthook = sys.excepthook  # (each process group wraps it again, to prefix "[rank0]:" to every line)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook


@functools.cache
def pipeline_impl():
    return load_train_api(IMPLS_DIR / "pipeline" / "train.py")  # (what it declares for the tools)


def pipeline_costs(layout: Layout, model: Model, training: Training, b: int, k: int):
    """impls/pipeline (p stage ranks, each of the dp pipelines all-reducing its parameters) or
    impls/model_parallel (one micro-batch after another): the worst rank's memory, its point-to-point
    traffic and the dp all-reduce, and how much longer than ideal it computes: the schedule's bubble, and
    the slowest rank's FLOPs over the mean rank's (the cut balances parameters, not FLOPs)."""
    p, e, notes = layout.pp, training.element_bytes, []
    m = k  # the pipeline runs the replica's micro-steps as its micro-batches
    if layout.strategy == "model_parallel":  # one micro-batch through every part before the next
        schedule, v, bubble = "gpipe", 1, p - 1.0
        orders = {r: act.one_stage_order("gpipe", 1, p, r) for r in range(p)}
    else:
        schedule = layout.strategy.removeprefix("pp-")
        v = layout.stages_per_rank or default_stages_per_rank(schedule)
        if problem := schedule_problem(schedule, m, p, v):
            raise PlanError(problem)
        orders = schedule_orders(schedule, p, m, v)
        bubble = pipeline_bubble(schedule, p, v, m)
    bounds = cut_bounds(model, p * v, layout.partition)
    stage_params = [sum(model.block_parameters[a:z]) for a, z in bounds]
    units = unit_shapes(model)
    stage_rank = {stage: rank for rank, order in orders.items() for _, stage, _ in order}
    saving = training.saving(layout.strategy, model.gpt)
    blocks_and_loss = model.formula(saving, training.checkpointing) if model.formula else None

    def rank_costs(rank: int) -> tuple[dict[str, float], float | None]:
        mine = sorted({stage for _, stage, _ in orders[rank]})
        held = sum(stage_params[s] for s in mine)
        if training.precision == "mixed":
            states = mixed_precision(held, k=K_OPTIMIZER[training.optimizer])
        else:
            tensors = [
                math.prod(shape) * e for s in mine for unit in units[slice(*bounds[s])] for shape in unit
            ]
            states = replicated(tensors, training.optimizer)
        held_activations = None
        if blocks_and_loss is not None:
            held_activations = act.held_in_rank(*blocks_and_loss, bounds, orders[rank], b)
        return states, held_activations

    each_rank = [rank_costs(rank) for rank in range(p)]
    worst_rank = max(range(p), key=lambda r: sum(each_rank[r][0].values()) + (each_rank[r][1] or 0))
    states, activations = each_rank[worst_rank]
    # Each boundary's activation forward and its gradient back, per micro-batch, in the dtype the
    # boundary block's output has (under autocast: bf16 after a linear layer, fp32 after a residual sum)
    if training.precision == "autocast":
        output_bytes = model.autocast_output_bytes
        if output_bytes is None and model.gpt is not None and model.block_outputs:
            # a decoder preset (not built): the embeddings' and blocks' outputs are the fp32 residual
            # stream, the head's the 16-bit logits
            output_bytes = [4 * elements for elements in model.block_outputs[:-1]] + [
                2 * model.block_outputs[-1]
            ]
    else:
        output_bytes = model.block_outputs and [elements * e for elements in model.block_outputs]
    if output_bytes is None:
        notes.append("activations sent between stages: not estimated (the model is no sequence of blocks)")
    output_bytes = output_bytes or [0] * len(model.block_parameters)
    boundary = [b * output_bytes[last - 1] for _, last in bounds[:-1]]
    mine = sorted({stage for _, stage, _ in orders[worst_rank]})
    if layout.strategy == "model_parallel":
        p2p = model_parallel_communication(boundary, worst_rank, p, k)
    else:
        p2p = pipeline_communication(boundary, mine, [stage_rank[s] for s in range(len(bounds))], m)
    # With dp pipelines, each rank's parameters all-reduced and buffers broadcast over the dp group
    my_blocks = [block for s in mine for block in range(*bounds[s])]
    dp_counts = pipeline_communication(
        [],
        [],
        [],
        m,
        parameter_bytes=[math.prod(shape) * e for block in my_blocks for shape in units[block]],
        buffer_bytes=[size for _, size in model.buffer_bytes(e, my_blocks)],
        dp=layout.dp,
    )
    # The slowest rank sets the pace: its stages' FLOPs over the mean rank's (the cut balances parameters)
    imbalance = 1.0
    if model.block_flops:
        work = [
            sum(sum(model.block_flops[slice(*bounds[s])]) for s in {st for _, st, _ in orders[r]})
            for r in range(p)
        ]
        imbalance = max(work) / (sum(work) / p) if sum(work) else 1.0
    if schedule not in ("gpipe", "1f1b", "interleaved-1f1b") and m >= p:
        notes.append(f"{schedule}'s bubble taken as none (its paper's claim; the report measures it)")
    return states, activations, p2p, dp_counts, (1 + bubble) * imbalance - 1, notes, worst_rank


def pipeline_bubble(schedule: str, p: int, v: int, m: int) -> float:
    """Idle time over busy time: (p − 1)/m for GPipe and 1F1B, (p − 1)/(v·m) interleaved (Megatron-LM,
    arXiv 2104.04473 §2.2). The zero-bubble schedules' taken as none once m ≥ p (what they are built for,
    arXiv 2401.10241); with fewer micro-batches than stage ranks, the interleaved schedule's."""
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if schedule == "interleaved-1f1b" or m < p:
        return (p - 1) / (v * m)
    return 0.0
