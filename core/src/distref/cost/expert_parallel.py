"""Communication and model states of expert parallelism (impls/expert_parallel: gpt's mixture of experts,
the E experts of each MoE layer spread over the ep ranks of an expert-parallel group, world/ep groups
each holding every expert, every other parameter replicated over all W ranks by DDP).

Per rank and optimizer step, for each MoE layer and micro-batch, h the hidden size, c the bytes of an
element the experts compute in (2 under bf16: the tokens are cast before they are sent, and the experts'
outputs are bf16; else 4, or 8 in fp64), the rank sending S = n·k rows (its n tokens, each to k
experts: whatever the routing, dropless) and receiving R (the rows every rank of its group sent to its
experts: the routing decides):

    all_to_all  the counts: E int64 (8E bytes), group ep
                dispatch: S·h·c; the outputs back: R·h·c                          (forward)
                the outputs' gradients to the experts: S·h·c; the tokens' back: R·h·c  (backward)
                checkpointed: the recomputed forward's three again
    all_reduce  DDP's buckets of the non-expert gradients, summed over all W ranks (distref.cost.data_parallel),
                once per step
                with world/ep > 1 copies of the experts: each expert tensor's local shard (its E/ep rows),
                over the world/ep copies, once per step

The record's all-to-all bytes are what the rank passes (its input): S·h·c sent, R·h·c returned. Under
uniform routing R = S on average (`uniform_routing`: the planner's expectation); measured, R is the step's
own (`expert_parallel_run_cost` takes the counted step's sizes, as the impl saw them).

Model states: the non-expert parameters whole, each expert tensor's E/ep rows (memory.replicated over those
sizes: gradients alike, the optimizer's state beside each). Activations: single's formula on the rank's
micro-batch (distref.cost.activations.moe_layer_bytes), its experts' rows, hidden and GELU output on the
R rows they received instead of n·k, and under autocast the weight casts of its E/ep experts only
(`expert_parallel_activation_bytes`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from distref.config import RunConfig
from distref.cost import Predicted
from distref.cost.activations import (
    expert_rows_bytes,
    formula_for,
    moe_per_forward_bytes,
    no_formula,
    saving_for,
    stage_bytes,
)
from distref.cost.counts import Counts, add, merge
from distref.cost.data_parallel import ddp, ddp_bucket_order
from distref.cost.memory import replicated
from distref.cost.usage import Usage
from distref.data.tensors import DatasetInfo
from distref.models import build_model, gpt_config, on_meta, parameter_dtype

COUNT_BYTES = 8  # each expert's token count, int64


def is_expert_parameter(name: str) -> bool:
    """Whether a gpt parameter is an expert's (its rows are spread over the expert-parallel ranks)."""
    return ".experts." in name


def uniform_routing(tokens: int, top_k: int, layers: int, micro_batches: int) -> list[tuple[int, int]]:
    """The (rows sent, rows received) of each MoE layer's forward on a rank of `tokens` tokens per
    micro-batch, routing even: every rank receives what it sends."""
    rows = tokens * top_k
    return [(rows, rows)] * (layers * micro_batches)


def all_to_all_counts(
    routed: Sequence[tuple[int, int]],
    *,
    experts: int,
    hidden: int,
    element_bytes: int,
    ep: int,
    checkpointed: bool,
) -> Counts:
    """A rank's all-to-alls for the MoE layers' forwards `routed` (rows sent, rows received each)."""
    counts: Counts = {}
    forwards = 2 if checkpointed else 1  # (backward recomputes a checkpointed block's forward)
    for sent, received in routed:
        for _ in range(forwards):
            add(counts, "all_to_all", COUNT_BYTES * experts, ep)
            add(counts, "all_to_all", sent * hidden * element_bytes, ep)
            add(counts, "all_to_all", received * hidden * element_bytes, ep)
        add(counts, "all_to_all", sent * hidden * element_bytes, ep)  # the outputs' gradients
        add(counts, "all_to_all", received * hidden * element_bytes, ep)  # the tokens' gradients
    return counts


def expert_parallel_cost(
    named_shapes: Sequence[tuple[str, tuple[int, ...]]],
    *,
    world_size: int,
    ep: int,
    experts: int,
    hidden: int,
    routed: Sequence[tuple[int, int]],
    precision: str,
    checkpointed: bool,
    optimizer: str,
    gradient_order: Sequence[str] | None = None,
    bucket_cap_mb: float = 25.0,
    step_bytes: int = 4,
) -> tuple[Counts, dict[str, int]]:
    """(communication, model states) of one rank for a model of these (name, shape) parameters, in
    model.named_parameters() order. `gradient_order`: the parameter names in the order backward gives
    their gradients (distref.cost.usage; DDP's buckets fill in it; None: reversed)."""
    element = 8 if precision == "fp64" else 4  # the parameters' (bf16 autocasts fp32 ones)
    dense = [(name, shape) for name, shape in named_shapes if not is_expert_parameter(name)]
    dense_bytes = [element * math.prod(shape) for _, shape in dense]
    position = {name: i for i, (name, _) in enumerate(dense)}
    order = None
    if gradient_order is not None:
        order = ddp_bucket_order([position[n] for n in gradient_order if n in position], len(dense))
    communication = ddp(
        dense_bytes, world_size, bucket_cap_bytes=int(bucket_cap_mb * 2**20), bucket_order=order
    )
    expert_bytes = [
        element * math.prod(shape) // ep for name, shape in named_shapes if is_expert_parameter(name)
    ]
    replicas = world_size // ep
    if replicas > 1:
        for size in expert_bytes:
            add(communication, "all_reduce", size, replicas)
    moved = all_to_all_counts(
        routed,
        experts=experts,
        hidden=hidden,
        element_bytes=saving_for(precision).compute,  # (bf16: the tokens are cast before they are sent)
        ep=ep,
        checkpointed=checkpointed,
    )
    return merge(communication, moved), replicated(dense_bytes + expert_bytes, optimizer, step_bytes)


def expert_parallel_activation_bytes(
    cfg: RunConfig,
    info: DatasetInfo,
    *,
    world_size: int,
    ep: int,
    routed: Sequence[tuple[int, int]],
    device: str = "cpu",
) -> tuple[int | None, str | None]:
    """The most activations a rank holds for backward (bytes, or None and why): single's formula on the
    rank's micro-batch (distref.cost.activations: every MoE layer's router, dispatch and combine on its
    tokens), its experts computing the rows they received (`routed`: the counted step's (sent, received)
    per MoE layer forward, micro-batch by micro-batch; none: every expert here, R = S) instead of its
    own n·k, and under autocast only its E/ep experts' weight casts. The peak: the micro-batch holding most
    (each lets go with its backward before the next)."""
    if why := no_formula(cfg.model, cfg.precision, device):
        return None, why
    found = formula_for(
        cfg.model, info, cfg.gpt_layers, cfg.precision, cfg.activation_checkpointing, device, moe=cfg.moe
    )
    micro_batch = cfg.global_batch_size // (world_size * cfg.grad_accum)
    whole = stage_bytes(*found, micro_batch)  # (every expert here, each computing its n·k rows)
    if cfg.activation_checkpointing:  # each block keeps its input alone: nothing routed is held
        return whole, None
    sv = saving_for(cfg.precision, device)
    shape = gpt_config(cfg.model, info, cfg.gpt_layers)
    hidden, layers = shape.n_embd, shape.n_layer
    held_casts = moe_per_forward_bytes(cfg.experts // ep, hidden, sv)
    casts_not_held = layers * (moe_per_forward_bytes(cfg.experts, hidden, sv) - held_casts)
    # per micro-batch: what its experts' received rows hold beyond the n·k rows single's formula counts
    beyond = [
        sum(
            expert_rows_bytes(got, hidden, sv) - expert_rows_bytes(sent, hidden, sv)
            for sent, got in routed[m : m + layers]
        )
        for m in range(0, len(routed), layers)
    ]
    return whole - casts_not_held + max(beyond, default=0), None


def expert_parallel_run_cost(
    cfg: RunConfig,
    info: DatasetInfo,
    usage: Usage,
    *,
    world_size: int,
    ep: int,
    routed: Sequence[tuple[int, int]],
    bucket_cap_mb: float,
    device: str = "cpu",
) -> Predicted:
    """What a rank of impls/expert_parallel costs by formula, its all-to-alls sized by `routed` (the counted
    step's (rows sent, rows received) per MoE layer forward, as the rank saw them)."""
    model = on_meta(
        lambda: build_model(cfg.model, info, cfg.gpt_layers, parameter_dtype(cfg.precision), cfg.moe)
    )
    named_shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    hidden = model.embed.tok.embedding_dim
    communication, model_states = expert_parallel_cost(
        named_shapes,
        world_size=world_size,
        ep=ep,
        experts=cfg.experts,
        hidden=hidden,
        routed=routed,
        precision=cfg.precision,
        checkpointed=cfg.activation_checkpointing,
        optimizer=cfg.optimizer,
        gradient_order=None if usage.unknown else usage.gradient_order,
        bucket_cap_mb=bucket_cap_mb,
        step_bytes=torch.get_default_dtype().itemsize,
    )
    held, why_not = expert_parallel_activation_bytes(
        cfg, info, world_size=world_size, ep=ep, routed=routed, device=device
    )
    return Predicted(
        communication=communication,
        model_states=model_states,
        activations=held,
        unavailable={"activations": why_not},
    )
