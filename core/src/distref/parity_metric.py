"""The parity metric (how far an impl's final parameters are from single's) and its tolerances: used by
`distref.parity`, the report and the tests alike."""

from __future__ import annotations

import math

FP32_TOLERANCE = 1e-5

# Measured (README): lenet rows at most 6.8e-16. gpt with AdamW amplifies fp64 rounding far more (attention
# sharpening, Adam's normalisation): two correct single runs, --grad-accum 4 vs 1, differ by 4.4e-13 after
# 10 steps, and tensor_parallel's gpt rows reach 7.2e-13. Within this, but not by much: a gpt AdamW fp64
# case that fails it by a little is that amplification until shown otherwise (compare two single runs).
FP64_TOLERANCE = 1e-12


def max_relative_difference(a: dict, b: dict) -> float:
    """max over tensors of ||a - b|| / ||b|| (in float64): the parity metric, here and in the tests. Same
    keys required; buffers count too, and integer ones (BatchNorm's num_batches_tracked) must be equal
    (else the result is inf)."""
    import torch

    if a.keys() != b.keys():
        raise ValueError(  # two different models: a test of this project's models run on another?
            f"different state_dict keys (not the same model): {sorted(set(a) ^ set(b))}"
        )
    worst = 0.0
    for key in b:
        if not b[key].is_floating_point():
            if not torch.equal(a[key], b[key]):
                return math.inf
            continue
        denom = b[key].double().norm().item() or 1.0
        worst = max(worst, (a[key].double() - b[key].double()).norm().item() / denom)
    return worst
