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

from distref.cost import Predicted
from distref.cost.counts import Counts, add, buckets
from distref.cost.memory import replicated
from distref.cost.usage import ModelParameters

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


def ddp_rank_cost(
    parameters: ModelParameters,
    buffers: Sequence[tuple[str, int]],
    world_size: int,
    *,
    bucket_cap_mb: float,
    comm_hook: str,
    find_unused_parameters: bool,
    static_graph: bool,
    optimizer: str,
    step_bytes: int,
    unknown: str | None = None,
    activations: tuple[int | None, str | None] = (None, "not predicted here"),
) -> Predicted:
    """What a rank of impls/ddp costs by formula: every bucket of the gradients of the parameters that
    require grad all-reduced once per optimizer step (half the bytes with a bf16/fp16 `comm_hook`;
    PowerSGD: no formula), with unused parameters also DDP's map of them, the `buffers` ((dtype, bytes)
    each) broadcast before the step's first forward (`ddp`); a full replica of the model states, gradients
    and optimizer state of the parameters that receive a gradient (memory.replicated); `activations` as
    (bytes, or None and why). The options are DDP's of those names; `unknown`: why it is not known which
    parameters train (no communication or model-state formula then)."""
    # DDP leaves frozen parameters out of its buckets; an unused one's zero gradient is in them
    in_buckets = [i for i, use in enumerate(parameters.uses) if use.requires_grad]
    unused = any(use.requires_grad and not use.trained for use in parameters.uses)
    communication = model_states = None
    if comm_hook != "powersgd" and not unknown:
        position = {index: k for k, index in enumerate(in_buckets)}
        compressed, sizes = comm_hook in ("fp16", "bf16"), parameters.bytes
        communication = ddp(
            [sizes[i] for i in in_buckets],
            world_size,
            bucket_cap_bytes=int(bucket_cap_mb * 2**20),
            # a bf16/fp16 hook sends 2 bytes per gradient element (of 4 in fp32, of 8 in fp64)
            compressed_element_ratio=2 / parameters.element_bytes[0] if compressed else 1.0,
            buffers=buffers,
            # as impls/ddp's apply_ddp decides it: parameters the loss leaves unread, and no static graph
            find_unused_parameters=(find_unused_parameters or unused) and not static_graph,
            bucket_order=ddp_bucket_order([position[i] for i in parameters.gradient_order], len(in_buckets)),
        )
    if not unknown:
        model_states = replicated(parameters.bytes, optimizer, step_bytes, parameters.trained)
    held, why_not = activations
    powersgd = "--comm-hook powersgd: no formula (its low-rank factors; a plain all-reduce before step 10)"
    return Predicted(
        communication=communication,
        model_states=model_states,
        activations=held,
        unavailable={"communication": unknown or powersgd, "model_states": unknown, "activations": why_not},
    )
