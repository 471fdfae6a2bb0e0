"""Communication of data parallelism with replicated model states: DDP.

Each rank holds every parameter; after backward the gradients are averaged over the ranks by all-reduce.
DDP packs gradients into buckets of --bucket-cap-mb (filled in the order gradients became ready in the
first step: about the parameters' reverse order, exactly backward's, `ddp_bucket_order`; torch 2.13
makes the first bucket 1 MiB only when bucket_cap_mb is left unset, and the impl always sets it) and
all-reduces each bucket once per optimizer step: Ψ gradient values in all, whatever --grad-accum
(no_sync() skips the micro-steps before the last). A compression hook (fp16/bf16) halves the bytes. Only
parameters that require grad are in the buckets (DDP leaves frozen ones out); with find_unused_parameters
(a model whose loss leaves some unread) an unused one's zero gradient is all-reduced with its bucket, and
each synchronised backward also all-reduces DDP's map of the parameters used, one int32 per parameter.
Buffers (BatchNorm statistics) are broadcast from rank 0 before the step's first forward (a forward under
no_sync() turns the next one's broadcast off), one broadcast per dtype (float statistics, int64
counters). Per rank and step, for Ψ parameters of b bytes each (PyTorch Distributed, Li et al. 2020,
arXiv 2006.15704, §3.2):

    all_reduce: calls = buckets, bytes = Ψ·b (Ψ·2 compressed); bus bytes 2(N-1)/N of that
                (find_unused_parameters: + 1 call of 4 bytes per parameter tensor)
    broadcast:  calls = buffer dtypes, bytes = buffer bytes, when the model has buffers
"""

from __future__ import annotations

from collections.abc import Sequence

from distref.cost.counts import Counts, add, buckets

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DDP's broadcast_bucket_size for buffers
USED_MAP_ENTRY_BYTES = 4  # find_unused_parameters: one int32 per parameter, whether this rank used it


def ddp(
    parameter_bytes: Sequence[int],
    world_size: int,
    *,
    bucket_cap_bytes: int,
    compressed_element_ratio: float = 1.0,
    buffers: Sequence[tuple[str, int]] = (),
    find_unused_parameters: bool = False,
    bucket_order: Sequence[int] | None = None,
) -> Counts:
    """One optimizer step of DDP on one rank. `parameter_bytes`: the gradient bytes of each parameter
    that requires grad (DDP's), in model.parameters() order; `compressed_element_ratio`: 0.5 with an
    fp16/bf16 comm hook on fp32 gradients; `buffers`: each buffer's (dtype, bytes);
    `find_unused_parameters`: DDP's option of that name; `bucket_order`: the indices of
    `parameter_bytes` in the order DDP's rebuilt buckets take them (`ddp_bucket_order`; default: reversed)."""
    counts: Counts = {}
    if bucket_order is None:
        bucket_order = range(len(parameter_bytes) - 1, -1, -1)
    bucket_sizes = buckets([parameter_bytes[i] for i in bucket_order], [bucket_cap_bytes])
    for size in bucket_sizes:
        add(counts, "all_reduce", int(size * compressed_element_ratio), world_size)
    if find_unused_parameters:  # the used-parameter map (reducer.cpp's local_used_map_, at::kInt)
        add(counts, "all_reduce", USED_MAP_ENTRY_BYTES * len(parameter_bytes), world_size)
    if buffers and world_size > 1:
        for dtype in dict.fromkeys(dtype for dtype, _ in buffers):  # each dtype's buffers flattened together
            sizes = [size for of_dtype, size in buffers if of_dtype == dtype]
            for size in buckets(sizes, [BROADCAST_BUCKET_BYTES]):
                add(counts, "broadcast", size, world_size)
    return counts


def ddp_bucket_order(gradient_order: Sequence[int], parameters: int) -> list[int]:
    """The order DDP's reducer rebuilds its buckets in after the first step (reducer.cpp: each parameter as
    its gradient becomes ready, rebuilt_params_): `gradient_order`, the indices of the `parameters` (those
    that require grad) in the order backward produces their gradients — after those it never receives one
    for, which find_unused_parameters marks ready, in index order, at the backward's first gradient."""
    produced = set(gradient_order)
    return [i for i in range(parameters) if i not in produced] + list(gradient_order)
