"""Communication and model states of fully sharded data parallelism: FSDP2 (`fully_shard`), ZeRO stage 3.

Each rank holds a shard of every parameter, gradient and optimizer state (ZeRO, Rajbhandari et al., arXiv
1910.02054, §5.3: P_os+g+p); a unit (a module given to fully_shard) all-gathers its parameters before its
forward, and again before its backward if it freed them after forward (reshard_after_forward), and
reduce-scatters its gradients after its backward (FSDP, Zhao et al., arXiv 2304.11277, §3.2 and §4). FSDP2
shards each parameter on dim 0 over the S ranks of a shard group, padding dim 0 to a multiple of S: rank s
holds rows [s·c, (s+1)·c) of d₀, c = ⌈d₀/S⌉ (torch.chunk: the last ranks may hold fewer, or none), and
every collective moves the padded size p = c·S·(numel/d₀) of each parameter. With HSDP (a mesh of R
replicas × S shards), the reduce-scattered shard is then all-reduced over the R replicas. Under
--grad-accum A, gradient sync is off for the first A-1 micro-steps (set_requires_gradient_sync): they
gather as every micro-step does but accumulate unsharded gradients, and only the last reduces. Per rank and
optimizer step, over units u with padded size P_u = Σ p, r_u = 1 if u reshards after forward, b the
bytes of an element as gathered (the mixed-precision param_dtype) or reduced (its reduce_dtype):

    all_gather:     calls = A·Σ_u (1 + r_u),  bytes = A·Σ_u (1 + r_u)·P_u·b_gather   (group S)
    reduce_scatter: calls = U,                bytes = Σ_u P_u·b_reduce               (group S)
    all_reduce:     calls = U,                bytes = Σ_u P_u/S·b_reduce             (group R; HSDP only)

With S = 1 nothing is gathered or scattered (FSDP2 skips both). A unit gathers every parameter it holds,
frozen or unread (a frozen unit whose backward never runs is still gathered again: the next unit's
backward prefetches it), but reduce-scatters only those with a gradient: P_u then sums those, and a unit
without any reduces nothing; a unit whose forward never runs gathers nothing. Model states on a rank of shard index s,
for a parameter of d₀ rows: n_s = max(0, min(c, d₀ − s·c))·numel/d₀ elements of parameter, gradient and
each optimizer moment (AdamW: 2, plus its step count per tensor; SGD: 1) — about (2 + 2 + K)Ψ/S
(memory.zero_paper stage 3), exactly this sum; gradient and moments only for parameters with a gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from distref.cost import Predicted
from distref.cost.counts import Counts, add
from distref.cost.memory import replicated
from distref.cost.usage import ModelParameters

Shape = Sequence[int]


def rows_held(rows: int, shard_size: int, shard_rank: int) -> int:
    """Rows of a dim 0 of `rows` that shard `shard_rank` of `shard_size` holds (torch.chunk's split)."""
    per_rank = -(-rows // shard_size)
    return max(0, min(per_rank, rows - shard_rank * per_rank))


def padded_numel(shape: Shape, shard_size: int) -> int:
    """Elements of a parameter with dim 0 padded to a multiple of the shard group: what collectives move."""
    rows = shape[0] if shape else 1
    return -(-rows // shard_size) * shard_size * math.prod(shape[1:])


def fsdp(
    units: Sequence[Sequence[Shape]],
    resharded: Sequence[bool],
    shard_size: int,
    *,
    replicas: int = 1,
    gather_element_bytes: int = 4,
    reduce_element_bytes: int = 4,
    grad_accum: int = 1,
    reduced_units: Sequence[Sequence[Shape]] | None = None,
) -> Counts:
    """One optimizer step of FSDP2 on one rank. `units`: each fully_shard unit's parameter shapes (units
    without parameters, or whose forward never runs, communicate nothing); `resharded`: whether each frees
    its parameters after forward; `shard_size` S and `replicas` R: the mesh (R·S ranks);
    `reduced_units`: each unit's shapes of the parameters that receive a gradient (default: all)."""
    counts: Counts = {}
    for shapes, reduced, reshard in zip(units, reduced_units or units, resharded, strict=True):
        if not shapes:
            continue
        padded = sum(padded_numel(shape, shard_size) for shape in shapes)
        padded_reduced = sum(padded_numel(shape, shard_size) for shape in reduced)
        if shard_size > 1:
            gathers = grad_accum * (2 if reshard else 1)
            add(counts, "all_gather", gathers * padded * gather_element_bytes, shard_size, calls=gathers)
            if reduced:
                add(counts, "reduce_scatter", padded_reduced * reduce_element_bytes, shard_size)
        if replicas > 1 and reduced:
            add(counts, "all_reduce", padded_reduced // shard_size * reduce_element_bytes, replicas)
    return counts


def fsdp_model_states(
    shapes: Sequence[Shape],
    shard_size: int,
    shard_rank: int,
    element_bytes: int,
    optimizer: str,
    step_bytes: int = 4,
    trained: Sequence[bool] | None = None,
) -> dict[str, int]:
    """Model-state bytes on the rank of shard index `shard_rank` (its rank modulo S): its rows of each
    parameter (`shapes`, every unit's), and for those that receive a gradient (`trained`, default all) a
    gradient of the same size and the optimizer's state."""
    held = [
        rows_held(shape[0] if shape else 1, shard_size, shard_rank) * math.prod(shape[1:]) * element_bytes
        for shape in shapes
    ]
    return replicated(held, optimizer, step_bytes, trained)  # (the same sums, over what this rank holds)


def fsdp_rank_cost(
    units: Sequence[ModelParameters],
    shard_size: int,
    shard_rank: int,
    *,
    replicas: int,
    reshard_after_forward: bool,
    dtype: torch.dtype,
    gather_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    grad_accum: int,
    optimizer: str,
    step_bytes: int,
    unknown: str | None = None,
    activations: tuple[int | None, str | None] = (None, "not predicted here"),
) -> Predicted:
    """What a rank of impls/fsdp costs by formula: each of its `units` (a block given to fully_shard, its
    parameters described with `runs` by the block: the root holds none) all-gathered before its forward
    and, resharded after it (`reshard_after_forward`, but the last), again before its backward, its
    gradients reduce-scattered over the `shard_size` ranks of its shard group and, with `replicas` > 1
    (HSDP), all-reduced over the replicas (`fsdp`); this rank's rows (`shard_rank`: its place in its
    shard group) of every parameter, gradient and optimizer state (`fsdp_model_states`); `activations` as
    (bytes, or None and why). A unit gathers its every parameter, frozen or unread, and reduces those with
    a gradient; a unit never called, nothing. Parameters of `dtype`, gathered and reduced in the mixed
    precision policy's `gather_dtype` and `reduce_dtype` (None: `dtype`). `unknown`: why it is not known
    which parameters train (no communication or model-state formula then)."""
    communication = model_states = None
    if not unknown:
        communication = fsdp(
            [list(unit.shapes) if all(use.runs for use in unit.uses) else [] for unit in units],
            [reshard_after_forward and i < len(units) - 1 for i in range(len(units))],
            shard_size,
            replicas=replicas,
            gather_element_bytes=(gather_dtype or dtype).itemsize,
            reduce_element_bytes=(reduce_dtype or dtype).itemsize,
            grad_accum=grad_accum,
            reduced_units=[[s for s, t in zip(u.shapes, u.trained, strict=True) if t] for u in units],
        )
        model_states = fsdp_model_states(
            [shape for unit in units for shape in unit.shapes],
            shard_size,
            shard_rank,
            dtype.itemsize,
            optimizer,
            step_bytes,
            trained=[t for unit in units for t in unit.trained],
        )
    held, why_not = activations
    return Predicted(
        communication=communication,
        model_states=model_states,
        activations=held,
        unavailable={"communication": unknown, "model_states": unknown, "activations": why_not},
    )
