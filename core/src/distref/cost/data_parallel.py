"""Communication of data parallelism with replicated model states: DDP.

Each rank holds every parameter; after backward the gradients are averaged over the ranks by all-reduce.
DDP packs gradients into buckets of --bucket-cap-mb (filled in the order gradients became ready in the
first step: the parameters' reverse order; torch 2.13 makes the first bucket 1 MiB only when
bucket_cap_mb is left unset, and the impl always sets it) and all-reduces each bucket once per optimizer
step: Ψ gradient values in all, whatever --grad-accum (no_sync() skips the micro-steps before the last).
A compression hook (fp16/bf16) halves the bytes. Buffers (BatchNorm statistics) are broadcast from rank 0
before the step's first forward (a forward under no_sync() turns the next one's broadcast off), one
broadcast per dtype (float statistics, int64 counters). Per rank and step, for Ψ parameters of b bytes each (PyTorch Distributed, Li et
al. 2020, arXiv 2006.15704, §3.2):

    all_reduce: calls = buckets, bytes = Ψ·b (Ψ·2 compressed); bus bytes 2(N-1)/N of that
    broadcast:  calls = buffer dtypes, bytes = buffer bytes, when the model has buffers
"""

from __future__ import annotations

from collections.abc import Sequence

from distref.cost.counts import Counts, add, buckets

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DDP's broadcast_bucket_size for buffers


def ddp(
    parameter_bytes: Sequence[int],
    world_size: int,
    *,
    bucket_cap_bytes: int,
    compressed_element_ratio: float = 1.0,
    buffers: Sequence[tuple[str, int]] = (),
) -> Counts:
    """One optimizer step of DDP on one rank. `parameter_bytes`: each parameter's gradient bytes, in
    model.parameters() order; `compressed_element_ratio`: 0.5 with an fp16/bf16 comm hook on fp32
    gradients; `buffers`: each buffer's (dtype, bytes)."""
    counts: Counts = {}
    bucket_sizes = buckets(reversed(parameter_bytes), [bucket_cap_bytes])
    for size in bucket_sizes:
        add(counts, "all_reduce", int(size * compressed_element_ratio), world_size)
    if buffers and world_size > 1:
        for dtype in dict.fromkeys(dtype for dtype, _ in buffers):  # each dtype's buffers flattened together
            sizes = [size for of_dtype, size in buffers if of_dtype == dtype]
            for size in buckets(sizes, [BROADCAST_BUCKET_BYTES]):
                add(counts, "broadcast", size, world_size)
    return counts
