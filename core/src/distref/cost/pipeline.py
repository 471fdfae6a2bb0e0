"""Communication of the strategies that cut the model's blocks into consecutive stages: pipeline
parallelism (impls/pipeline, torch.distributed.pipelining's schedules) and naive model parallelism
(impls/model_parallel, one micro-batch through the parts at a time).

Stage s's output for one micro-batch holds A_s bytes (its shape: the micro-batch size b times the
boundary block's output shape, in the dtype autocast gives it). Each micro-batch crosses every boundary
twice (GPipe, Huang et al. 2019, arXiv 1811.06965, §2.2; Megatron-LM, Narayanan et al. 2021, arXiv
2104.04473, §2.2): its activation forward, from stage s to s+1, and that activation's gradient backward,
from s+1 to s, the same A_s bytes. The schedule (GPipe; 1F1B, and interleaved 1F1B whose rank r holds
stages r, r+p, ...; the zero-bubble and V-shaped schedules, whose rank r holds stages r and 2p-1-r)
decides when, not how much: per step with M micro-batches, a rank holding stage s sends and receives,
for every boundary of s whose other side lives on another rank (a V's turn, stages p-1 and p on one rank,
is handed over in memory),

    send: M·A_s (s < S-1, forward)  + M·A_{s-1} (s > 0, backward)     calls: one per micro-batch each
    recv: M·A_s (s < S-1, backward) + M·A_{s-1} (s > 0, forward)

With D pipelines side by side (--dp) each rank then averages its stages' gradients over the D ranks
holding the same stages, one all-reduce per parameter tensor (Ψ_r·b bytes: its own stages' parameters,
bus bytes 2(D-1)/D of that), and takes the first pipeline's buffers (BatchNorm's statistics), one
broadcast per buffer tensor. Nothing else in the step: the losses are gathered when they are logged.

impls/model_parallel hands over with distref.distributed.send_tensor: a 64-byte header (8 int64: dtype,
dims, sizes) before the tensor, since the receiver cannot know its shape; the gradient goes back with a
plain send of the received shape. With --grad-accum M micro-batches per step and parts 0..P-1, rank r:

    send: 2M calls, M·(64 + A_r) bytes (r < P-1)   +  M calls, M·A_{r-1} bytes (r > 0)
    recv: M calls, M·A_r bytes (r < P-1)           +  2M calls, M·(64 + A_{r-1}) bytes (r > 0)

The A_s come from the model (`boundary_bytes`: one forward of the blocks on fake tensors under the run's
autocast, or impls/pipeline's stage examples, one real forward of one micro-batch). Model states per rank
are those of its own stages' parameters: distref.cost.memory.replicated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distref.cost import Predicted
from distref.cost.counts import Counts, add
from distref.cost.memory import replicated
from distref.cost.usage import ModelParameters

HEADER_BYTES = 8 * 8  # distref.distributed.send_tensor's header: 8 int64


def pipeline(
    activation_bytes: Sequence[int],
    my_stages: Sequence[int],
    stage_rank: Sequence[int],
    microbatches: int,
    *,
    parameter_bytes: Sequence[int] = (),
    buffer_bytes: Sequence[int] = (),
    dp: int = 1,
) -> Counts:
    """One step of a torch.distributed.pipelining schedule on one rank. `activation_bytes[s]`: stage s's
    output for one micro-batch (s < S-1); `my_stages`: the stages this rank holds; `stage_rank[s]`: the
    rank holding stage s in this pipeline; with `dp` > 1 pipelines, this rank's parameter and buffer
    tensors' bytes are all-reduced, resp. broadcast, over the dp group."""
    counts: Counts = {}
    n_stages, m = len(stage_rank), microbatches
    for s in my_stages:
        if s < n_stages - 1 and stage_rank[s + 1] != stage_rank[s]:  # the output forward, its grad back
            add(counts, "send", m * activation_bytes[s], 2, calls=m)
            add(counts, "recv", m * activation_bytes[s], 2, calls=m)
        if s > 0 and stage_rank[s - 1] != stage_rank[s]:  # the input from before, its grad back to it
            add(counts, "recv", m * activation_bytes[s - 1], 2, calls=m)
            add(counts, "send", m * activation_bytes[s - 1], 2, calls=m)
    if dp > 1:
        add(counts, "all_reduce", sum(parameter_bytes), dp, calls=len(parameter_bytes))
        add(counts, "broadcast", sum(buffer_bytes), dp, calls=len(buffer_bytes))
    return counts


def pipeline_rank_cost(
    boundary_bytes: Sequence[int],
    my_stages: Sequence[int],
    stage_rank: Sequence[int],
    microbatches: int,
    *,
    parameters: ModelParameters,
    buffer_bytes: Sequence[int],
    dp: int,
    optimizer: str,
    step_bytes: int,
    unknown: str | None = None,
    activations: tuple[int | None, str | None] = (None, "not predicted here"),
) -> Predicted:
    """What one rank of impls/pipeline costs by formula: each boundary of its stages with a stage on
    another rank crossed twice per micro-batch (`boundary_bytes[s]`: stage s's output for one micro-batch),
    with `dp` pipelines the gradients of its stages' `parameters` that train all-reduced and its buffers
    broadcast (`pipeline`); the model states of its stages (gradients and optimizer state of the
    parameters that train: distref.cost.memory.replicated); `activations` as (bytes, or None and why).
    `unknown`: why it is not known which parameters train (no communication or model-state formula then)."""
    communication = model_states = None
    if not unknown:
        trained = parameters.trained
        communication = pipeline(
            boundary_bytes,
            my_stages,
            stage_rank,
            microbatches,
            parameter_bytes=[size for size, t in zip(parameters.bytes, trained, strict=True) if t],
            buffer_bytes=buffer_bytes,
            dp=dp,
        )
        model_states = replicated(parameters.bytes, optimizer, step_bytes, trained)
    held, why_not = activations
    return Predicted(
        communication=communication,
        model_states=model_states,
        activations=held,
        unavailable={"communication": unknown, "model_states": unknown, "activations": why_not},
    )


def model_parallel(activation_bytes: Sequence[int], rank: int, parts: int, microbatches: int) -> Counts:
    """One step of impls/model_parallel on rank `rank` of `parts` (one process per part): M micro-batches
    one after another, each activation with send_tensor's header, each gradient without.
    `activation_bytes[r]`: part r's output for one micro-batch (r < parts-1)."""
    counts: Counts = {}
    m = microbatches
    if rank < parts - 1:  # header and activation to the next part; the activation's gradient back
        add(counts, "send", m * (HEADER_BYTES + activation_bytes[rank]), 2, calls=2 * m)
        add(counts, "recv", m * activation_bytes[rank], 2, calls=m)
    if rank > 0:  # header and activation from the part before; the input's gradient back to it
        add(counts, "recv", m * (HEADER_BYTES + activation_bytes[rank - 1]), 2, calls=2 * m)
        add(counts, "send", m * activation_bytes[rank - 1], 2, calls=m)
    return counts


def model_parallel_rank_cost(
    activation_bytes: Sequence[int],
    rank: int,
    parts: int,
    microbatches: int,
    *,
    parameters: ModelParameters,
    optimizer: str,
    step_bytes: int,
    unknown: str | None = None,
    activations: tuple[int | None, str | None] = (None, "not predicted here"),
) -> Predicted:
    """What rank `rank` of impls/model_parallel (`parts` processes, 1: one process holding every part)
    costs by formula: per micro-batch a header and the activation to the next part, the activation's
    gradient back (`model_parallel`; `activation_bytes`: each cut's, for one micro-batch); the model states
    of its part(s)' `parameters`, gradients and optimizer state of those that receive a gradient
    (memory.replicated); `activations` as (bytes, or None and why). `unknown`: why it is not known which
    parameters train (no model-state formula then)."""
    model_states = None
    if not unknown:
        model_states = replicated(parameters.bytes, optimizer, step_bytes, parameters.trained)
    held, why_not = activations
    return Predicted(
        communication=model_parallel(activation_bytes, rank, parts, microbatches),
        model_states=model_states,
        activations=held,
        unavailable={"model_states": unknown, "activations": why_not},
    )


def boundary_bytes(
    blocks: Sequence[torch.nn.Module],
    bounds: Sequence[tuple[int, int]],
    example: torch.Tensor,
    device: torch.device,
    autocast,
) -> list[int]:
    """Bytes of each part's output but the last's, for input `example` (one micro-batch), found by a
    forward of `blocks` on fake tensors (torch's FakeTensorMode: shapes and dtypes, no data, no compute,
    the real modules untouched) on `device` under `autocast` (a context manager: the run's)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    sizes = []
    with FakeTensorMode(allow_non_fake_inputs=True) as fake, torch.no_grad(), autocast:
        x = fake.from_tensor(example).to(device)
        for first, end in bounds[:-1]:
            for block in blocks[first:end]:
                state = {**dict(block.named_parameters()), **dict(block.named_buffers())}
                x = functional_call(
                    block, {k: fake.from_tensor(v).to(device) for k, v in state.items()}, (x,)
                )
            sizes.append(x.numel() * x.element_size())
    return sizes
