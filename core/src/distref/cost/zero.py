"""Communication and model states of ZeRO stages 0-3 as DeepSpeed 0.19 does them (impls/deepspeed_zero).

ZeRO (Rajbhandari et al., arXiv 1910.02054, §5 and §7) partitions over the N data-parallel ranks the
optimizer states (stage 1, P_os), also the gradients (stage 2, P_os+g), also the parameters (stage 3,
P_os+g+p). The paper's communication per step: stages 1 and 2 move 2Ψ per rank, a reduce-scatter of the
gradients and an all-gather of the updated parameters (§7.2.1); stage 3 3Ψ, the parameters all-gathered
in forward and again in backward (§7.2.2). DeepSpeed 0.19, with this project's config (fp32, no
offload; reduce_bucket_size = allgather_bucket_size = stage3_prefetch_bucket_size = B elements,
contiguous_gradients, overlap_comm from stage 2 on several ranks, compute_grad_norm false at stages 1/2,
stage3_param_persistence_threshold 0, gradient_clipping 0, bf16's check_grad_overflow false),
differs from that in ways counted here, per rank and optimizer step, for Ψ parameters n_1 … n_k of b bytes:

Stage 0 (runtime/engine.py, buffered_allreduce_fallback) is DDP: a replica on every rank, the gradients
all-reduced once per step in parameter order, in all-reduces of just over 5e8 elements (a fixed size):

    all_reduce: calls = ⌈Ψ / 5e8⌉ (about),   bytes = Ψ·b

Stages 1 and 2 (runtime/zero/stage_1_and_2.py). The parameters are one flat buffer padded to a multiple
of 2N elements (nccl_start_alignment_factor = 2): Ψ' = ⌈Ψ / 2N⌉·2N, partition P = Ψ'/N. Gradients go
into reduce buckets, a bucket closed when the next gradient would pass B (stage 1 fills them in
parameter order at the step's end, reduce_gradients; stage 2 in backward as they become ready, the
parameters' reverse order). Each bucket is reduced by ONE all-reduce of the whole bucket, not a
reduce-scatter (average_tensor with use_multi_rank_bucket_allreduce, on by default in 0.19): every
rank receives every gradient and keeps its partition's — in pieces where a gradient larger than B
straddles partitions: each gradient is cut where a partition starts, and an all-reduce is issued as soon
as the pieces it gathers exceed B (allreduce_and_scatter), so such a gradient costs one call per partition
it touches (`bucket_all_reduces`; the bytes are the same). step() all-gathers the updated flat parameters,
one call for the whole buffer (all_gather_into_tensor; allgather_bucket_size then plays no part,
runtime/utils.py all_gather_dp_groups). It all-reduces no gradient norm: the config's compute_grad_norm
false (clipping is off, nothing reads it) skips scaled_global_norm's fp32 all-reduce and the kept norm
(zero/stage_1_and_2.py:3022-3039; DeepSpeed allows it at stages 1/2 only, zero/config.py:390-393, without
optimizer offload, :216-218, and not in BF16_Optimizer, engine.py:2305-2309):

    all_reduce: calls = K'·pieces(n, B),  bytes = K'·Ψ·b     (K' = 1 at stage 1, K at stage 2)
    all_gather: calls = 1,                bytes = Ψ'·b          (none on one rank)

Stage 3 (runtime/zero/stage3.py, partition_parameters.py). Each parameter is padded on its own to a
multiple of N: n'_i = ⌈n_i / N⌉·N, Ψ' = Σ n'_i. While Ψ ≤ B the first forward fetch prefetches every
parameter in one coalesced all-gather, and they stay gathered through backward (stage3_max_reuse_distance
1e9 exceeds the model): no second gather, unlike the paper's 3Ψ. Gradients are reduce-scattered per bucket
(closed as above, in backward's order; reduce_scatter_coalesced pads each tensor to n'_i), and step()
all-reduces the gradient norm as one fp64 scalar. With K micro-steps of gradient accumulation (K the
engine's gradient_accumulation_steps) stage 1 still reduces once, at the boundary, while stages 2 and 3
reduce in every backward, and stage 3 gathers in every forward:

    all_gather:     calls = K,               bytes = K·Ψ'·b      (Ψ ≤ B; beyond, None: not modelled)
    reduce_scatter: calls = K·buckets(n', B), bytes = K·Ψ'·b
    all_reduce:     calls = 1,               bytes = 8

Model states of rank r (what distref.training.measure.zero_model_state_bytes counts), for torch's AdamW
(exp_avg, exp_avg_sq and a step scalar of s bytes) or SGD with momentum, on the fp32 master partition of
P (stages 1, 2) or Ψ'/N (stage 3) elements that DeepSpeed keeps even in fp32:

    stage 1, 2  parameters = Ψ'·b (the whole flat buffer)
                gradients  = b·Σ{n_i : parameter i overlaps [rP, (r+1)P)} + b·(padding in that range)
                optimizer  = P·b (master) + 2P·b + s (AdamW) or P·b (SGD)
    stage 3     parameters = Ψ'/N·b,  gradients = Ψ'/N·b + 8,  optimizer as above with P = Ψ'/N
    stage 0     parameters = gradients = Ψ·b, optimizer as torch's (memory.replicated)

The stage 1/2 gradients are not the paper's Ψ/N: the contiguous partition buffer (copy_grads_in_partition)
holds the WHOLE gradient of every parameter that overlaps the partition, so ranks differ; stage 3's +8 is
the kept global gradient norm (fp64; stages 1/2 compute none). overlap_comm's second reduce bucket buffer
(stage_1_and_2.py:3272-3277, from stage 2 on several ranks) is released after backward
(_release_ipg_buffers, :1061): no state between steps, not counted.

Frozen and unused parameters (`uses`: distref.cost.usage). Stages 1/2 flatten and partition only the
trainable (requires_grad) parameters — Ψ above counts those; a frozen one stays whole on every rank
(parameters + its bytes) — and reduce only gradients that exist; a trainable parameter the forward never
reads is nonetheless in the flat buffer, and a rank whose partition it overlaps holds, besides, a whole
tensor of zeros for its gradient. Stage 3 partitions every parameter, gathers those of the modules whose
forward runs (frozen ones too), reduce-scatters the gradients that exist, and keeps gradient and optimizer
partitions for the trainable ones. Stage 0 all-reduces every trainable gradient, an unused one's as zeros
(so it has optimizer state too), and none of a frozen one.

bf16 (stages 1-3; the impl refuses stage 0, which DeepSpeed runs without fp32 masters): the same optimizers
(DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3, not BF16_Optimizer), the same buckets and padding,
with b = 2 for everything kept and sent in the model's dtype — the flat buffer or stage-3 partitions, the
gradients, the reduced and gathered tensors — while the master partition and the optimizer's states stay
fp32 (m = 4). No overflow check: the config's bf16.check_grad_overflow false leaves out the 1-byte flag's
all-reduce stages 1/2 would add (`zero_bf16_model_states`, `zero_bf16_communication`: their docstrings
give the formulas and DeepSpeed's lines).

One rank (N = 1): nothing is gathered, at any stage and whatever the prefetch bucket (stage 3 then
reduce-scatters per bucket and all-reduces the norm only), so stage 3 beyond one prefetch bucket, not
modelled on several ranks, has its formula there.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from distref.cost import Predicted
from distref.cost.counts import Counts, add
from distref.cost.memory import replicated
from distref.cost.usage import ModelParameters, ParameterUse

NCCL_START_ALIGNMENT_FACTOR = 2  # stage_1_and_2.py: partitions start at multiples of 2·N elements
STAGE0_ALLREDUCE_ELEMENTS = 500_000_000  # engine.py MEMORY_OPT_ALLREDUCE_SIZE: stage 0's all-reduce bucket
BF16_ELEMENT_BYTES = 2  # bf16: the model's dtype, its gradients' and what is reduced and gathered
MASTER_ELEMENT_BYTES = 4  # the fp32 master partition and the optimizer's states on it, in any precision
STAGE3_NORM_BYTES = 8  # stage 3's global gradient norm, fp64: all-reduced and kept (stages 1/2: none)


def reduce_buckets(numels: Sequence[int], bucket_elements: int) -> list[list[int]]:
    """DeepSpeed's reduce buckets (reduce_independent_p_g_buckets_and_remove_grads, stages 1-3): gradients in
    order join the bucket; before one would take it past `bucket_elements` the bucket is reduced (an
    empty one reduces nothing: a gradient larger than a bucket is one of its own). Returns each bucket's
    gradients' elements, in order."""
    result, current = [], []
    for n in numels:
        if sum(current) + n > bucket_elements and current:
            result.append(current)
            current = []
        current.append(n)
    if current:
        result.append(current)
    return result


def bucket_all_reduces(bucket: Sequence[tuple[int, int]], partition: int, bucket_elements: int) -> list[int]:
    """Stages 1/2: the all-reduces of one reduce bucket, each one's elements (average_tensor, then
    allreduce_and_scatter). `bucket`: each gradient's (offset in the flat buffer, elements). Each gradient
    is cut where a partition starts, and consecutive pieces of one partition merged; the pieces in turn
    fill an all-reduce that is issued as soon as it holds MORE than `bucket_elements` — so a gradient
    larger than a bucket that straddles partitions is all-reduced piece by piece, one call per partition."""
    pieces: list[list[int]] = []  # [partition, elements], merged
    for offset, elements in bucket:
        end = offset + elements
        while offset < end:
            owner = offset // partition
            piece = min(end, (owner + 1) * partition) - offset
            if pieces and pieces[-1][0] == owner:
                pieces[-1][1] += piece
            else:
                pieces.append([owner, piece])
            offset += piece
    return filled_all_reduces([elements for _, elements in pieces], bucket_elements)


def flat_partition(numels: Sequence[int], world_size: int) -> tuple[int, int]:
    """Stages 1/2: (Ψ', P): the flat buffer's elements, padded to a multiple of 2N, and a partition's."""
    alignment = NCCL_START_ALIGNMENT_FACTOR * world_size
    padded = math.ceil(sum(numels) / alignment) * alignment
    return padded, padded // world_size


def stage3_padded(numels: Sequence[int], world_size: int) -> list[int]:
    """Stage 3: each parameter padded to a multiple of N (partition_parameters.py _padding_size)."""
    return [math.ceil(n / world_size) * world_size for n in numels]


def stage0_all_reduces(numels: Sequence[int]) -> list[int]:
    """Stage 0 (the engine's buffered_allreduce_fallback, allreduce_no_retain): the gradients in
    parameter order fill an all-reduce, issued once it holds MORE than MEMORY_OPT_ALLREDUCE_SIZE
    elements (a fixed size: the config's bucket sizes play no part at stage 0)."""
    return filled_all_reduces(numels, STAGE0_ALLREDUCE_ELEMENTS)


def filled_all_reduces(sizes: Sequence[int], limit: int) -> list[int]:
    """The all-reduces (their elements) of gradients of `sizes` poured in order into a buffer that is
    sent once it holds MORE than `limit` elements, and once more at the end for what is left."""
    calls, filling = [], 0
    for size in sizes:
        filling += size
        if filling > limit:
            calls.append(filling)
            filling = 0
    if filling:
        calls.append(filling)
    return calls


def zero_communication(
    numels: Sequence[int],
    world_size: int,
    stage: int,
    *,
    bucket_elements: int,
    prefetch_elements: int,
    grad_accum: int = 1,
    element_bytes: int = 4,
    uses: Sequence[ParameterUse] | None = None,
    gradient_order: Sequence[int] | None = None,
) -> Counts | None:
    """One optimizer step of ZeRO `stage` (0-3) on one rank, without offload, gradients reduced and
    parameters gathered in `element_bytes` (fp32's 4; bf16: `zero_bf16_communication`). `numels`: each
    parameter's elements in model.parameters() order; `bucket_elements`: reduce_bucket_size;
    `prefetch_elements`: stage3_prefetch_bucket_size; `grad_accum`: micro-steps K per step (stages 0 and 1
    reduce once at the boundary, stages 2 and 3 in every backward, stage 3 gathers in every forward);
    `uses`: what the step does with each parameter (default: trains every one); `gradient_order`: the
    indices of those with a gradient in the order backward produces them (distref.cost.usage; default:
    the reverse of the parameters'). None where the formula does not hold exactly
    (`communication_unavailable` says why)."""
    if communication_unavailable(numels, world_size, stage, prefetch_elements):
        return None
    uses = uses or [ParameterUse()] * len(numels)
    if gradient_order is None:
        gradient_order = [i for i in reversed(range(len(numels))) if uses[i].trained]
    trainable = [n for n, use in zip(numels, uses, strict=True) if use.requires_grad]
    counts: Counts = {}
    if stage == 0:  # DDP-like: every trainable gradient (an unused one's as zeros), all-reduced once
        for elements in stage0_all_reduces(trainable):
            add(counts, "all_reduce", elements * element_bytes, world_size)
        return counts
    if stage in (1, 2):
        # The flat buffer holds the trainable parameters (frozen ones stay whole, outside it); only those
        # with a gradient are reduced, at stage 1 in parameter order, at stage 2 in backward's.
        padded, partition = flat_partition(trainable, world_size)
        trainable_indices = [i for i, use in enumerate(uses) if use.requires_grad]
        starts = dict(zip(trainable_indices, itertools.accumulate(trainable, initial=0), strict=False))
        if stage == 1:  # at the step's end, in parameter order
            reduced, reductions = sorted(gradient_order), 1
        else:  # in backward, as each gradient is produced
            reduced, reductions = list(gradient_order), grad_accum
        placed = [(starts[i], numels[i]) for i in reduced]  # each one's place in the flat buffer, its size
        first = 0
        for bucket in reduce_buckets([n for _, n in placed], bucket_elements):
            in_bucket, first = placed[first : first + len(bucket)], first + len(bucket)
            for elements in bucket_all_reduces(in_bucket, partition, bucket_elements) * reductions:
                add(counts, "all_reduce", elements * element_bytes, world_size)
        # (no gradient norm: compute_grad_norm false; no bf16 overflow flag: check_grad_overflow false)
        if world_size > 1:  # (one rank: nothing to gather)
            add(counts, "all_gather", padded * element_bytes, world_size)
        return counts
    # Stage 3: the parameters of every module that runs are gathered, frozen ones too; the gradients
    # that exist are reduce-scattered
    sizes = stage3_padded(numels, world_size)
    padded = [n for n, use in zip(sizes, uses, strict=True) if use.runs]  # gathered: its module runs
    if world_size > 1:
        add(counts, "all_gather", grad_accum * sum(padded) * element_bytes, world_size, calls=grad_accum)
    for bucket in reduce_buckets([sizes[i] for i in gradient_order], bucket_elements) * grad_accum:
        add(counts, "reduce_scatter", sum(bucket) * element_bytes, world_size)
    add(counts, "all_reduce", STAGE3_NORM_BYTES, world_size)  # the gradient norm (DeepSpeed computes it)
    return counts


def communication_unavailable(
    numels: Sequence[int], world_size: int, stage: int, prefetch_elements: int
) -> str | None:
    """Why zero_communication has no formula for this run (without offload), or None. Stage 3 beyond one
    prefetch bucket is not modelled on several ranks (its gathers); one rank gathers nothing, whatever the
    buckets, and reduce-scatters per bucket as anywhere."""
    if stage not in (0, 1, 2, 3):
        return f"ZeRO has no stage {stage}"
    if stage == 3 and world_size > 1 and sum(numels) > prefetch_elements:
        return (
            f"ZeRO-3 over more than one prefetch bucket ({sum(numels):,} elements > {prefetch_elements:,}): "
            "DeepSpeed's trace-driven fetch and re-gathers in backward are not modelled"
        )
    return None


def optimizer_partition_bytes(partition: int, optimizer: str, element_bytes: int, step_bytes: int) -> int:
    """The fp32 master partition and torch's state for it (one flat tensor per param group)."""
    master = partition * element_bytes
    if optimizer == "adamw":
        return master + 2 * master + step_bytes
    if optimizer == "sgd":
        return master + master
    raise ValueError(f"no formula for optimizer {optimizer!r}")


def zero_model_states(
    numels: Sequence[int],
    world_size: int,
    rank: int,
    stage: int,
    optimizer: str,
    *,
    element_bytes: int = 4,
    step_bytes: int = 4,
    uses: Sequence[ParameterUse] | None = None,
    master_bytes: int | None = None,
) -> dict[str, int] | None:
    """Model-state bytes rank `rank` holds under ZeRO `stage` (0-3), without offload, one param group:
    parameters and gradients of `element_bytes` (the model's dtype), the master partition and optimizer
    states of `master_bytes` (default: `element_bytes`, as in fp32; bf16: `zero_bf16_model_states`);
    `uses`: what the step does with each parameter (default: trains every one)."""
    master_bytes = element_bytes if master_bytes is None else master_bytes
    uses = uses or [ParameterUse()] * len(numels)
    trainable = [n for n, use in zip(numels, uses, strict=True) if use.requires_grad]
    frozen = sum(numels) - sum(trainable)
    if stage == 0:  # a replica; an unused trainable parameter's gradient is all-reduced zeros, then stepped
        return replicated(
            [n * element_bytes for n in numels],
            optimizer,
            step_bytes,
            trained=[use.requires_grad for use in uses],
        )
    if stage in (1, 2):
        padded, partition = flat_partition(trainable, world_size)
        start, end = rank * partition, (rank + 1) * partition
        # The partition's gradient buffer holds every parameter overlapping it, whole — allocated once a
        # gradient of one is copied in: not where only unused ones overlap. An unused one's gradient is,
        # besides, a whole tensor of zeros (get_all_grad_tensors), as the padding is.
        overlapping = unused = offset = 0
        trained_here = False
        for n, use in zip(trainable, [use for use in uses if use.requires_grad], strict=True):
            if n and offset < end and offset + n > start:
                overlapping += n
                unused += 0 if use.trained else n
                trained_here = trained_here or use.trained
            offset += n
        padding = max(0, end - max(sum(trainable), start))
        held = (overlapping if trained_here else 0) + unused + padding
        return {
            "parameters": (padded + frozen) * element_bytes,  # the flat buffer, and frozen ones whole
            "gradients": held * element_bytes,  # (no kept norm: compute_grad_norm false)
            "optimizer": optimizer_partition_bytes(partition, optimizer, master_bytes, step_bytes),
        }
    if stage == 3:
        partition = sum(stage3_padded(numels, world_size)) // world_size
        trainable_partition = sum(stage3_padded(trainable, world_size)) // world_size
        return {
            "parameters": partition * element_bytes,
            "gradients": trainable_partition * element_bytes + STAGE3_NORM_BYTES,
            "optimizer": optimizer_partition_bytes(trainable_partition, optimizer, master_bytes, step_bytes),
        }
    return None


def zero_bf16_model_states(
    numels: Sequence[int],
    world_size: int,
    rank: int,
    stage: int,
    optimizer: str,
    *,
    step_bytes: int = 4,
    uses: Sequence[ParameterUse] | None = None,
) -> dict[str, int] | None:
    """Model-state bytes rank `rank` holds under ZeRO `stage` 1-3 in bf16 without offload (None at stage 0,
    which DeepSpeed runs through its fp16-style optimizer, without fp32 masters: the impl refuses it). With
    Ψ' and P as in fp32 (`flat_partition`, `stage3_padded`: the padding does not depend on the dtype),
    b = 2 (BF16_ELEMENT_BYTES) and m = 4 (MASTER_ELEMENT_BYTES):

        stage 1, 2  parameters = Ψ'·b (frozen ones whole besides)
                    gradients  = b·(every parameter overlapping [rP, (r+1)P), whole, + padding there)
        stage 3     parameters = Ψ'/N·b,  gradients = Ψ'/N·b + 8
        optimizer   = P·m (master) + 2P·m + s (AdamW) or + P·m (SGD)

    DeepSpeed 0.19.8 (deepspeed/runtime/), as this impl's config selects it: engine.py:1806-1807 leaves
    grad_accum_dtype the model's, bf16, so _do_optimizer_sanity_check (engine.py:2305-2311) picks ZeRO's
    own optimizers, not BF16_Optimizer (bf16_optimizer.py: only for stage 1 with fp32 accumulation).
    Stages 1/2 (zero/stage_1_and_2.py): the flat buffer is the bf16 parameters flattened (:505-514, views
    of it the module's parameters, :534); the master partition is cast to master_weights_and_grads_dtype
    (:560-561), fp32 unless bf16_master_weights_and_grads is set (base_optimizer.py:523-528), and the
    torch optimizer's states follow it; the partition's gradients are bf16 (copy_grads_in_partition's
    buffer in self.dtype, :2192-2194; get_flat_partition's padding in gradient_accumulation_dtype,
    :1046-1052); no norm is kept (compute_grad_norm false: _global_grad_norm None, :3022-3023). Stage 3
    (zero/stage3.py): the parameters' partitions are one bf16 buffer (lp_param_buffer, :972), the gradient
    partitions another (gradient_accumulation_dtype, :791-793), the master partition fp32 (:1170-1171), the
    kept norm fp64 (get_norm_dtype, zero/utils.py:59-63). step()'s fp32 copy of the gradient partition
    (stage_1_and_2.py:3118) lives only inside step(): not held between steps, not counted."""
    if stage not in (1, 2, 3):
        return None
    return zero_model_states(
        numels,
        world_size,
        rank,
        stage,
        optimizer,
        element_bytes=BF16_ELEMENT_BYTES,
        master_bytes=MASTER_ELEMENT_BYTES,
        step_bytes=step_bytes,
        uses=uses,
    )


def zero_bf16_communication(
    numels: Sequence[int],
    world_size: int,
    stage: int,
    *,
    bucket_elements: int,
    prefetch_elements: int,
    grad_accum: int = 1,
    uses: Sequence[ParameterUse] | None = None,
    gradient_order: Sequence[int] | None = None,
) -> Counts | None:
    """One optimizer step of ZeRO `stage` 1-3 on one rank in bf16 without offload (None at stage 0, and
    where `communication_unavailable` says): `zero_communication`'s buckets, pieces and padding (buckets
    count elements, whatever the dtype), in b = 2 bytes, with no norm at stages 1/2 (as in fp32) and no
    overflow flag:

        stages 1, 2  all_reduce: calls = K'·pieces(n, B),  bytes = K'·Ψ·b
                     all_gather: calls = 1,                bytes = Ψ'·b            (none on one rank)
        stage 3      all_gather: calls = K, bytes = K·Ψ'·b (none on one rank);  reduce_scatter: calls =
                     K·buckets(n', B), bytes = K·Ψ'·b;  all_reduce: calls = 1, bytes = 8

    DeepSpeed 0.19.8 (deepspeed/runtime/): communication_data_type is bf16 (engine.py:1719-1728), so the
    gradient buckets are bf16 (stage_1_and_2.py:1253-1254, bucket buffers of the parameters' dtype;
    :1493-1497 all-reduces them uncast; stage3.py:780-784) and the gathered buffers the bf16 parameters
    (stage_1_and_2.py:3155, all_gather_dp_groups of bit16_groups_flat). The norm as in fp32: none at
    stages 1/2 (compute_grad_norm false skips scaled_global_norm's all-reduce, stage_1_and_2.py:3033-3039,
    :2693), fp64 at stage 3 (stage3.py:2469). The overflow check: bf16's check_grad_overflow (default True,
    precision_config.py:56) reaches stages 1/2 (engine.py:2638-2639, :2706), whose step() would check
    (stage_1_and_2.py:3029), all-reducing a uint8 flag (has_overflow, :3237-3248, an .item() too) — on one
    rank too; the config sets it false (single's bf16 step is never skipped, nor is this one); stage 3
    checks in fp16 only (stage3.py:2815)."""
    if stage not in (1, 2, 3):
        return None
    return zero_communication(
        numels,
        world_size,
        stage,
        bucket_elements=bucket_elements,
        prefetch_elements=prefetch_elements,
        grad_accum=grad_accum,
        element_bytes=BF16_ELEMENT_BYTES,
        uses=uses,
        gradient_order=gradient_order,
    )


def zero_rank_cost(
    parameters: ModelParameters,
    world_size: int,
    rank: int,
    stage: int,
    *,
    bucket_elements: int,
    prefetch_elements: int,
    grad_accum: int,
    precision: str,
    offload: bool,
    optimizer: str,
    step_bytes: int,
    unknown: str | None = None,
    activations: tuple[int | None, str | None] = (None, "not predicted here"),
) -> Predicted:
    """What a rank of impls/deepspeed_zero costs by formula (DeepSpeed 0.19's buckets, padding and
    prefetch; fp32, or bf16 at stages 1-3 (`zero_bf16_communication`, `zero_bf16_model_states`), without
    `offload`): stage 0 all-reduces the gradients as DDP does, stages 1-2 an
    all-reduce per gradient bucket (per partition it spans, for a gradient larger than a bucket) and one
    all-gather of the updated flat parameters, stage 3 the parameters gathered once per forward and the
    gradients reduce-scattered per bucket (`zero_communication`: `bucket_elements` the config's
    reduce_bucket_size, `prefetch_elements` its stage3_prefetch_bucket_size); this rank's partitions, frozen
    parameters left out of them at stages 0-2 (`zero_model_states`); `activations` as (bytes, or None and
    why). `unknown`: why it is not known which parameters train (no communication or model-state formula
    then). The formula is a steady step's: a session's third, the one counted (distref.training.traffic;
    in its second ZeRO-3 checks the fetch trace it recorded against every rank's: 6 broadcasts)."""
    if precision not in ("fp32", "bf16"):
        no_formula_here = f"no formula for DeepSpeed in {precision} (not measured: its loss scaler)"
    elif precision == "bf16" and stage == 0:
        no_formula_here = (
            "no formula for DeepSpeed's stage 0 in bf16 (its fp16-style optimizer, no fp32 masters)"
        )
    elif offload:
        no_formula_here = "no formula with offload (DeepSpeed's CPU partitions and their copies)"
    else:
        no_formula_here = unknown
    numels, uses = parameters.numels, parameters.uses  # (stage 3 gathers one when its own module runs)
    communicated, held_states = (
        (zero_bf16_communication, zero_bf16_model_states)
        if precision == "bf16"
        else (zero_communication, zero_model_states)
    )
    communication = model_states = None
    if not no_formula_here:
        communication = communicated(
            numels,
            world_size,
            stage,
            bucket_elements=bucket_elements,
            prefetch_elements=prefetch_elements,
            grad_accum=grad_accum,
            uses=uses,
            gradient_order=parameters.gradient_order,  # what its reduce buckets fill in
        )
        model_states = held_states(
            numels, world_size, rank, stage, optimizer, step_bytes=step_bytes, uses=uses
        )
    held, why_not = activations
    return Predicted(
        communication=communication,
        model_states=model_states,
        activations=held,
        unavailable={
            "communication": no_formula_here
            or communication_unavailable(numels, world_size, stage, prefetch_elements),
            "model_states": no_formula_here,
            "activations": why_not,
        },
    )
