"""Communication and model states of ZeRO stages 1-3 as DeepSpeed 0.19 does them (impls/deepspeed_zero).

ZeRO (Rajbhandari et al., arXiv 1910.02054, §5 and §7) partitions over the N data-parallel ranks the
optimizer states (stage 1, P_os), also the gradients (stage 2, P_os+g), also the parameters (stage 3,
P_os+g+p). The paper's communication per step: stages 1 and 2 move 2Ψ per rank, a reduce-scatter of the
gradients and an all-gather of the updated parameters (§7.2.1); stage 3 3Ψ, the parameters all-gathered
in forward and again in backward (§7.2.2). DeepSpeed 0.19, with this project's config (fp32, no
offload; reduce_bucket_size = allgather_bucket_size = stage3_prefetch_bucket_size = B elements,
contiguous_gradients, overlap_comm from stage 2, stage3_param_persistence_threshold 0, gradient_clipping 0),
differs from that in ways counted here, per rank and optimizer step, for Ψ parameters n_1 … n_k of b bytes:

Stages 1 and 2 (runtime/zero/stage_1_and_2.py). The parameters are one flat buffer padded to a multiple
of 2N elements (nccl_start_alignment_factor = 2): Ψ' = ⌈Ψ / 2N⌉·2N, partition P = Ψ'/N. Gradients go
into reduce buckets, a bucket closed when the next gradient would pass B (stage 1 fills them in
parameter order at the step's end, reduce_gradients; stage 2 in backward as they become ready, the
parameters' reverse order). Each bucket is reduced by ONE all-reduce of the whole bucket, not a
reduce-scatter (average_tensor with use_multi_rank_bucket_allreduce, on by default in 0.19): every
rank receives every gradient and keeps its partition's. step() all-reduces the partition's gradient norm
(one fp32 scalar, computed although clipping is off: scaled_global_norm) and all-gathers the updated
flat parameters, one call for the whole buffer (all_gather_into_tensor; allgather_bucket_size then plays
no part, runtime/utils.py all_gather_dp_groups):

    all_reduce: calls = K'·buckets(n, B) + 1,  bytes = K'·Ψ·b + 4     (K' = 1 at stage 1, K at stage 2)
    all_gather: calls = 1,                     bytes = Ψ'·b

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
                gradients  = b·Σ{n_i : parameter i overlaps [rP, (r+1)P)} + b·(padding in that range) + 4
                optimizer  = P·b (master) + 2P·b + s (AdamW) or P·b (SGD)
    stage 3     parameters = Ψ'/N·b,  gradients = Ψ'/N·b + 8,  optimizer as above with P = Ψ'/N

The stage 1/2 gradients are not the paper's Ψ/N: the contiguous partition buffer (copy_grads_in_partition)
holds the WHOLE gradient of every parameter that overlaps the partition, so ranks differ; the +4 and +8 are
the kept global gradient norm (fp32 at stages 1/2, fp64 at stage 3).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from distref.cost.counts import Counts, add

NCCL_START_ALIGNMENT_FACTOR = 2  # stage_1_and_2.py: partitions start at multiples of 2·N elements


def reduce_buckets(numels: Sequence[int], bucket_elements: int) -> list[int]:
    """DeepSpeed's reduce buckets (reduce_independent_p_g_buckets_and_remove_grads, stages 1-3): gradients in
    order join the bucket; before one would take it past `bucket_elements` the bucket is reduced (an
    empty one reduces nothing). Returns each bucket's elements."""
    result, current = [], 0
    for n in numels:
        if current + n > bucket_elements and current > 0:
            result.append(current)
            current = 0
        current += n
    if current:
        result.append(current)
    return result


def flat_partition(numels: Sequence[int], world_size: int) -> tuple[int, int]:
    """Stages 1/2: (Ψ', P): the flat buffer's elements, padded to a multiple of 2N, and a partition's."""
    alignment = NCCL_START_ALIGNMENT_FACTOR * world_size
    padded = math.ceil(sum(numels) / alignment) * alignment
    return padded, padded // world_size


def stage3_padded(numels: Sequence[int], world_size: int) -> list[int]:
    """Stage 3: each parameter padded to a multiple of N (partition_parameters.py _padding_size)."""
    return [math.ceil(n / world_size) * world_size for n in numels]


def zero_communication(
    numels: Sequence[int],
    world_size: int,
    stage: int,
    *,
    bucket_elements: int,
    prefetch_elements: int,
    grad_accum: int = 1,
    element_bytes: int = 4,
) -> Counts | None:
    """One optimizer step of ZeRO `stage` (1-3) on one rank, fp32 without offload. `numels`: each
    parameter's elements in model.parameters() order; `bucket_elements`: reduce_bucket_size;
    `prefetch_elements`: stage3_prefetch_bucket_size; `grad_accum`: micro-steps K per step (stage 1 reduces
    once at the boundary, stages 2 and 3 in every backward, stage 3 gathers in every forward). None where
    the formula does not hold exactly."""
    if stage not in (1, 2, 3) or world_size < 2:
        return None
    counts: Counts = {}
    if stage in (1, 2):
        order, reductions = (list(numels), 1) if stage == 1 else (list(reversed(numels)), grad_accum)
        for elements in reduce_buckets(order, bucket_elements) * reductions:
            add(counts, "all_reduce", elements * element_bytes, world_size)
        add(counts, "all_reduce", 4, world_size)  # the gradient norm, fp32
        add(counts, "all_gather", flat_partition(numels, world_size)[0] * element_bytes, world_size)
        return counts
    if sum(numels) > prefetch_elements:
        return (
            None  # several prefetch buckets, re-gathers in backward: the trace-driven fetch is not modelled
        )
    padded = stage3_padded(numels, world_size)
    add(counts, "all_gather", grad_accum * sum(padded) * element_bytes, world_size, calls=grad_accum)
    for elements in reduce_buckets(list(reversed(padded)), bucket_elements) * grad_accum:
        add(counts, "reduce_scatter", elements * element_bytes, world_size)
    add(counts, "all_reduce", 8, world_size)  # the gradient norm, fp64
    return counts


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
) -> dict[str, int] | None:
    """Model-state bytes rank `rank` holds under ZeRO `stage` (1-3), fp32 without offload, one param group."""
    if stage in (1, 2):
        padded, partition = flat_partition(numels, world_size)
        start, end = rank * partition, (rank + 1) * partition
        overlapping, offset = 0, 0
        for n in numels:
            if n and offset < end and offset + n > start:
                overlapping += n
            offset += n
        padding = max(0, end - max(sum(numels), start))
        return {
            "parameters": padded * element_bytes,
            "gradients": (overlapping + padding) * element_bytes + 4,
            "optimizer": optimizer_partition_bytes(partition, optimizer, element_bytes, step_bytes),
        }
    if stage == 3:
        partition = sum(stage3_padded(numels, world_size)) // world_size
        return {
            "parameters": partition * element_bytes,
            "gradients": partition * element_bytes + 8,
            "optimizer": optimizer_partition_bytes(partition, optimizer, element_bytes, step_bytes),
        }
    return None
