"""Model-state bytes per rank: parameters, gradients, optimizer states (and master copies), by formula.

ZeRO (Rajbhandari et al., arXiv 1910.02054, §3 and Figure 1) counts them for mixed-precision Adam as
2Ψ (fp16 parameters) + 2Ψ (fp16 gradients) + KΨ (fp32 master parameters, momentum and variance, K = 12),
and divides the terms ZeRO partitions by the data-parallel degree N_d:

    stage 0 (DDP)  (2 + 2 + K)Ψ          stage 2   2Ψ + (2 + K)Ψ/N_d
    stage 1        2Ψ + 2Ψ + KΨ/N_d       stage 3   (2 + 2 + K)Ψ/N_d

`zero_paper` is that formula (the paper's example: Ψ = 7.5B, N_d = 64 → 120, 31.4, 16.6, 1.9 GB).
`replicated` is what a rank of single, DDP or DataParallel holds in this project: fp32 (or fp64)
parameters and gradients, and torch's optimizer state measured the same way (distref.training.measure).
"""

from __future__ import annotations

from collections.abc import Sequence

from distref.cost import Predicted
from distref.cost.usage import ModelParameters

K_MIXED_PRECISION_ADAM = 12  # fp32 master parameters, momentum, variance: 4 + 4 + 4 bytes per parameter


def mixed_precision(
    parameters: float,
    *,
    parameters_over: int = 1,
    gradients_over: int = 1,
    optimizer_over: int = 1,
    k: int = K_MIXED_PRECISION_ADAM,
) -> dict[str, float]:
    """Bytes of model states per GPU in the paper's mixed precision, each term divided by the ranks that
    share it: 16-bit parameters (2Ψ), 16-bit gradients (2Ψ), the optimizer's fp32 states (KΨ)."""
    return {
        "parameters": 2 * parameters / parameters_over,
        "gradients": 2 * parameters / gradients_over,
        "optimizer": k * parameters / optimizer_over,
    }


ZERO_PARTITIONS = {  # what each ZeRO stage partitions: (parameters, gradients, optimizer states)
    0: (False, False, False),
    1: (False, False, True),
    2: (False, True, True),
    3: (True, True, True),
}


def zero_paper(parameters: float, data_parallel: int, stage: int, k: int = K_MIXED_PRECISION_ADAM) -> float:
    """Bytes of model states per GPU under ZeRO stage 0-3 with mixed-precision Adam (the paper's formula)."""
    over = [data_parallel if partitioned else 1 for partitioned in ZERO_PARTITIONS[stage]]
    states = mixed_precision(
        parameters, parameters_over=over[0], gradients_over=over[1], optimizer_over=over[2], k=k
    )
    return sum(states.values())


def optimizer_state_bytes(parameter_bytes: Sequence[int], optimizer: str, step_bytes: int = 4) -> int:
    """torch.optim's state for parameters of these sizes (torch 2.13): AdamW keeps exp_avg and exp_avg_sq,
    each the parameter's size, and a step count per parameter tensor (a scalar of the default float dtype:
    `step_bytes`); SGD with momentum (this project's, 0.9) one momentum buffer."""
    if optimizer == "adamw":
        return 2 * sum(parameter_bytes) + step_bytes * len(parameter_bytes)
    if optimizer == "sgd":
        return sum(parameter_bytes)
    raise ValueError(f"no formula for optimizer {optimizer!r}")


def replicated(
    parameter_bytes: Sequence[int],
    optimizer: str,
    step_bytes: int = 4,
    trained: Sequence[bool] | None = None,
) -> dict[str, int]:
    """Model states of a rank holding every parameter (single, DDP): parameters, gradients of the same
    size, and the optimizer's state — gradients and optimizer state only for the parameters that receive
    a gradient (`trained`, default all: torch's optimizers skip one whose .grad is None; a frozen or
    unused parameter has neither)."""
    trained = [True] * len(parameter_bytes) if trained is None else trained
    with_gradient = [size for size, t in zip(parameter_bytes, trained, strict=True) if t]
    return {
        "parameters": sum(parameter_bytes),
        "gradients": sum(with_gradient),
        "optimizer": optimizer_state_bytes(with_gradient, optimizer, step_bytes),
    }


def one_process_cost(
    parameters: ModelParameters,
    *,
    optimizer: str,
    step_bytes: int,
    unknown: str | None = None,
    activations: tuple[int | None, str | None] = (None, "not predicted here"),
    communication_unavailable: str | None = None,
) -> Predicted:
    """What one process holding the whole model costs by formula (impls/single, impls/dataparallel): no
    process-group communication (`communication_unavailable`: why none can be said instead, e.g.
    DataParallel's copies between GPUs), a full replica of the model states (gradients and optimizer
    state of the `parameters` that train: `replicated`), `activations` as (bytes, or None and why).
    `unknown`: why it is not known which parameters train (no model-state formula then)."""
    model_states = None
    if not unknown:
        model_states = replicated(parameters.bytes, optimizer, step_bytes, parameters.trained)
    held, why_not = activations
    return Predicted(
        communication=None if communication_unavailable else {},
        model_states=model_states,
        activations=held,
        unavailable={
            "communication": communication_unavailable,
            "model_states": unknown,
            "activations": why_not,
        },
    )
