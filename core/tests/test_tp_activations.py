"""distref.cost.tp_activations by hand, against single's formula (distref.cost.activations) and Megatron's
Table 2. Against what every rank measures: impls/tensor_parallel's test_cost_equals_the_formulas."""

from __future__ import annotations

import pytest

from distref.cost.activations import (
    INDEX_BYTES,
    Loss,
    gpt_blocks,
    megatron_layer_activation_bytes,
    saving_for,
    stage_bytes,
)
from distref.cost.tp_activations import chunk, tensor_parallel_activation_bytes

SINGLE_B24 = 3393156  # impls/single, the same gpt, whole model, micro-batch 24 (its record.json)


def shape_of(tp: int) -> dict:
    """The formula's arguments for impls/tensor_parallel's default gpt on synthetic data (s = 16, h = 64,
    a = 4 heads, L = 2, V = 11), a micro-batch of 24, fp32, sequence and loss parallel."""
    shape = dict(micro_batch=24, seq=16, hidden=64, heads=4, layers=2, vocab=11, tp=tp)
    return shape | dict(sequence_parallel=True, loss_parallel=True, element_bytes=4, checkpointed=False)


def test_the_default_two_rank_run_by_hand():
    """b = 24, s = 16, h = 64, a = 4, L = 2, V = 11, fp32, T = 2, sequence and loss parallel, rank 0."""
    bsh = 24 * 16 * 64
    block = (
        4 * (2 * bsh // 2 + 4 * 24 * 8)  # ln inputs, mean, rstd: half the sequence
        + 4 * 2 * bsh  # ln outputs, all-gathered
        + 4 * (4 * bsh + 24 * 4 * 16) // 2  # q, k, v, output; log-sum-exp of 2 heads
        + 4 * 8 * bsh // 2  # GELU's input and output: 128 of 256 units
    )
    head = 4 * (bsh // 2 + 2 * 24 * 8) + 4 * bsh
    loss = 4 * 24 * 16 * 6 + 8 * 24 * 16 + 4
    embed = 8 * 24 * 16 + 8 * 16
    assert tensor_parallel_activation_bytes(**shape_of(2), tp_rank=0) == embed + 2 * block + head + loss


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize(
    "precision, device",
    [("fp32", "cpu"), ("fp64", "cpu"), ("bf16", "cpu"), ("bf16", "cuda"), ("fp32", "cuda")],
)
def test_one_rank_is_single(checkpointed, precision, device):
    """On a group of one the formula is single's (distref.cost.activations), in fp32, fp64 and under
    autocast, with the CPU's SDPA kernel and CUDA's."""
    sv = saving_for(precision, device)
    s, h, a, L, V, b = 16, 64, 4, 2, 11, 24
    single = stage_bytes(
        gpt_blocks(seq=s, hidden=h, heads=a, layers=L, vocab=V, sv=sv, checkpointed=checkpointed),
        Loss(sv.accumulate * s * V + INDEX_BYTES * s, sv.accumulate),
        b,
    )
    shape = dict(micro_batch=b, seq=s, hidden=h, heads=a, layers=L, vocab=V, tp=1, tp_rank=0)
    shape.update(sequence_parallel=True, loss_parallel=True, checkpointed=checkpointed, saving=sv)
    assert tensor_parallel_activation_bytes(**shape) == single
    if (precision, device, checkpointed) == ("fp32", "cpu", False):
        assert single == SINGLE_B24


def test_megatron_s_per_layer_terms_are_the_same_split():
    """Per layer, in b·s·h elements: Megatron's 16-bit bytes sbh·(10 + 24/T) are 5 + 12/T elements, of
    which one (the dropout masks) distref's gpt has not: 4 + 12/T, what the formula's block holds without
    sequence parallelism once its b·s statistics and weight slices are dropped."""
    s, b, h, a = 16, 24, 64, 4
    for t in (1, 2, 4):
        shape = dict(micro_batch=b, seq=s, hidden=h, heads=a, vocab=11, tp=t, tp_rank=0)
        # 16-bit parameters on CUDA: 16-bit activations, fp32 statistics and log-sum-exp (flash)
        shape.update(sequence_parallel=False, loss_parallel=True, saving=saving_for("bf16", "cuda", "16-bit"))
        one_layer = tensor_parallel_activation_bytes(**shape, layers=2) - tensor_parallel_activation_bytes(
            **shape, layers=1
        )
        statistics = 4 * (4 * b * s + b * a * s // t) + 16  # (flash's random-number state: 16 per forward)
        megatron = megatron_layer_activation_bytes(s, b, h, a, t=t, recompute="selective")
        assert one_layer - statistics == megatron - 2 * s * b * h  # less the masks, 1 byte × 2 per sbh


def test_chunk_is_torch_chunk():
    torch = pytest.importorskip("torch")
    for n in range(0, 20):
        for parts in range(1, 6):
            sizes = [len(c) for c in torch.arange(n).chunk(parts)]
            sizes += [0] * (parts - len(sizes))
            assert [chunk(n, parts, i) for i in range(parts)] == sizes


def test_a_split_that_does_not_divide_the_heads_is_refused():
    with pytest.raises(ValueError):
        tensor_parallel_activation_bytes(**shape_of(2), tp_rank=2)
    shape = shape_of(2) | {"tp": 3}
    with pytest.raises(ValueError):
        tensor_parallel_activation_bytes(**shape, tp_rank=0)
