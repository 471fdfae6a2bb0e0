"""Communication, model states and activations of context parallelism (impls/context_parallel: gpt's
sequences split over the C ranks of a context-parallel group, D such groups each on its share of the
batch, FSDP2 sharding the parameters over all W = D·C ranks).

Per rank and optimizer step, for A micro-batches of b sequences of s tokens (each rank holding n = s/C of
them), L blocks of hidden h, c the bytes of an element of q, k and v (the parameters' compute dtype: 2
under bf16, whose FSDP2 policy computes in bf16; else 4, or 8 in fp64), x the bytes the ring's gradients
are summed in (at least fp32's 4), E = b·n·h the elements of one of q, k, v on a rank:

  ring attention (Liu et al., arXiv 2310.01889), per block and micro-batch, C > 1:
      forward   C − 1 hops, each sending its key/value block on and receiving the previous rank's:
                send and recv, C − 1 calls each of 2E·c
      backward  the blocks around again (C − 1 hops of 2E·c), and each block's key/value gradients
                with it, home after C hops: C calls each way of 2E·x
      checkpointed: backward recomputes the forward first, C − 1 more hops of 2E·c each way
  Ulysses (Jacobs et al., arXiv 2309.14509), per block and micro-batch, C > 1:
      all_to_all: 4 forward (q, k, v to heads; the output back to tokens) and 4 backward, each of E·c
      (the record's bytes: what the rank passes), group C; checkpointed: 4 more (the recomputed forward)
  FSDP2 over all W ranks (distref.cost.sharded.fsdp): embed, each block and the head its units, every
      one but the last resharded after forward (W > 1); gathered in c, reduced in fp32 under bf16.

A rank's activations are a whole model's (distref.cost.activations.gpt_blocks) on n tokens: every layer
but attention works on a token alone, and the ring's attention saves what the CPU's SDPA kernel does at
n tokens (q, k, v, the output, a log-sum-exp per query and head, in at least fp32), on any device; with
C = 1 attention is SDPA itself, as in single. Ulysses' attention is SDPA over all s tokens of a/C heads
(the same bytes with the CPU's kernel; on CUDA the kernel torch picks for a/C heads of s tokens), and
its output comes back through the all-to-all as a new tensor, which the output projection saves: E·c
more per block — except after the math kernel, whose own contiguous copy of its output (counted in
its saves) is what the all-to-all sends instead. The position embedding's indices are the rank's n
positions.

Model states: FSDP2's shards over the W ranks (rank r holds shard r: distref.cost.sharded.fsdp_model_states).

What a rank predicts, all three formulas at once: `context_parallel_cost`, called by
impls/context_parallel/train.py (`context_parallel_run_cost`), distref.simulate and the planner alike.
"""

from __future__ import annotations

import dataclasses

import torch

from distref.config import GPT_MODELS, RunConfig
from distref.cost import Predicted
from distref.cost.activations import Loss, gpt_blocks, no_formula, parameters_in, saving_for, stage_bytes
from distref.cost.attention import attention_saves, sdpa_kernel
from distref.cost.counts import Counts, add, merge
from distref.cost.sharded import fsdp, fsdp_model_states
from distref.cost.tensor_parallel import fsdp_units, gpt_parameters
from distref.data.tensors import DatasetInfo
from distref.models import gpt_config, parameter_dtype

MODES = ("ring", "ulysses")


def attention_communication(
    *,
    mode: str,
    cp: int,
    layers: int,
    hidden: int,
    tokens: int,
    micro_batch: int,
    grad_accum: int = 1,
    compute_bytes: int = 4,
    sum_bytes: int = 4,
    activation_checkpointing: bool = False,
) -> Counts:
    """What one rank's attention sends in one optimizer step (the module docstring's formulas): `tokens`
    the rank's n = s/C, `micro_batch` b, `compute_bytes` c, `sum_bytes` x."""
    if mode not in MODES:
        raise ValueError(f"mode is ring or ulysses, not {mode!r}")
    counts: Counts = {}
    if cp == 1:
        return counts
    E = micro_batch * tokens * hidden
    passes = grad_accum * layers  # forward-and-backward passes through an attention
    if mode == "ring":
        block_hops = (cp - 1) * (3 if activation_checkpointing else 2)  # forward, backward (, recomputed)
        for kind in ("send", "recv"):
            add(counts, kind, passes * block_hops * 2 * E * compute_bytes, cp, calls=passes * block_hops)
            add(counts, kind, passes * cp * 2 * E * sum_bytes, cp, calls=passes * cp)
    else:
        exchanges = 12 if activation_checkpointing else 8
        add(counts, "all_to_all", passes * exchanges * E * compute_bytes, cp, calls=passes * exchanges)
    return counts


def context_parallel_activation_bytes(
    *,
    mode: str,
    cp: int,
    micro_batch: int,
    seq: int,
    hidden: int,
    heads: int,
    layers: int,
    vocab: int,
    precision: str,
    device: str = "cpu",
    checkpointed: bool = False,
) -> int:
    """The activations one rank holds for backward: gpt on its seq/C tokens (module docstring)."""
    n = seq // cp
    parameters = parameters_in(torch.bfloat16 if precision == "bf16" else None)
    # the ring's saves are the CPU kernel's; one rank keeps SDPA, whichever kernel it picks
    kernel = sdpa_kernel(device, precision, hidden // heads, heads, seq) if cp == 1 else "cpu"
    sv = saving_for(precision, device, parameters, attention=kernel)
    blocks = gpt_blocks(n, hidden, heads, layers, vocab, sv, checkpointed)
    if mode == "ulysses" and cp > 1 and not checkpointed:
        kernel = sdpa_kernel(device, precision, hidden // heads, heads // cp, seq)
        ring_own, _ = attention_saves("cpu", n, hidden, heads, sv.compute, sv.accumulate)
        own, once = attention_saves(kernel, seq, hidden // cp, heads // cp, sv.compute, sv.accumulate)
        # the output as the all-to-all returns it, the projection's input (the math kernel's own copy of its
        # output, which attention_saves counts, is not made: the all-to-all's send buffer is instead)
        copy_back = 0 if kernel == "math" else sv.compute * n * hidden
        blocks = (
            [blocks[0]]
            + [
                dataclasses.replace(block, own=block.own - ring_own + own + copy_back, per_forward=once)
                for block in blocks[1:-1]
            ]
            + [blocks[-1]]
        )
    loss = Loss(sv.accumulate * n * vocab + 8 * n, sv.accumulate)
    return stage_bytes(blocks, loss, micro_batch)


def context_parallel_cost(
    *,
    mode: str,
    cp: int,
    dp_shard: int,
    shard_rank: int,
    layers: int,
    hidden: int,
    heads: int,
    vocabulary: int,
    sequence: int,
    micro_batch: int,
    grad_accum: int,
    optimizer: str,
    precision: str,
    element_bytes: int,
    step_bytes: int,
    activation_checkpointing: bool,
    device: str = "cpu",
) -> Predicted:
    """What rank `shard_rank` (of the W = dp_shard × cp ranks FSDP2 shards over) of impls/context_parallel
    costs by formula, `micro_batch` sequences per micro-step on each data-parallel group."""
    world = dp_shard * cp
    compute = 2 if precision == "bf16" else element_bytes
    attention = attention_communication(
        mode=mode,
        cp=cp,
        layers=layers,
        hidden=hidden,
        tokens=sequence // cp,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        compute_bytes=compute,
        sum_bytes=max(compute, 4) if precision != "fp64" else 8,
        activation_checkpointing=activation_checkpointing,
    )
    parameters = [(name, shape) for name, shape, _ in gpt_parameters(layers, hidden, vocabulary, sequence)]
    units = fsdp_units(parameters, layers)
    sharded = fsdp(
        units,
        [world > 1 and i < len(units) - 1 for i in range(len(units))],
        world,
        gather_element_bytes=compute,
        reduce_element_bytes=4 if precision == "bf16" else element_bytes,
        grad_accum=grad_accum,
    )
    model_states = fsdp_model_states(
        [shape for _, shape in parameters], world, shard_rank, element_bytes, optimizer, step_bytes
    )
    activations = context_parallel_activation_bytes(
        mode=mode,
        cp=cp,
        micro_batch=micro_batch,
        seq=sequence,
        hidden=hidden,
        heads=heads,
        layers=layers,
        vocab=vocabulary,
        precision=precision,
        device=device,
        checkpointed=activation_checkpointing,
    )
    return Predicted(
        communication=merge(attention, sharded), model_states=model_states, activations=activations
    )


def context_parallel_run_cost(
    cfg: RunConfig,
    info: DatasetInfo,
    *,
    cp: int,
    dp_shard: int,
    shard_rank: int,
    mode: str,
    device: str = "cpu",
) -> Predicted:
    """`context_parallel_cost` of rank `shard_rank` in the run `cfg` (gpt or gpt2 on `info`'s data), each
    data-parallel group on its share of the global batch, on `device` ("cpu" or "cuda")."""
    if cfg.model not in GPT_MODELS:
        why = f"context parallelism splits gpt's sequences; no formula for --model {cfg.model}"
        return Predicted(unavailable={"communication": why, "model_states": why, "activations": why})
    if why := no_formula(cfg.model, cfg.precision, device):
        return Predicted(unavailable={"communication": why, "model_states": why, "activations": why})
    shape = gpt_config(cfg.model, info, cfg.gpt_layers)
    return context_parallel_cost(
        mode=mode,
        cp=cp,
        dp_shard=dp_shard,
        shard_rank=shard_rank,
        layers=shape.n_layer,
        hidden=shape.n_embd,
        heads=shape.n_head,
        vocabulary=shape.vocab_size,
        sequence=shape.block_size,
        micro_batch=cfg.global_batch_size // (dp_shard * cfg.grad_accum),
        grad_accum=cfg.grad_accum,
        optimizer=cfg.optimizer,
        precision=cfg.precision,
        element_bytes=parameter_dtype(cfg.precision).itemsize,
        step_bytes=torch.get_default_dtype().itemsize,
        activation_checkpointing=cfg.activation_checkpointing,
        device=device,
    )
