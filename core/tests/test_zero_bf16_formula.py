"""DeepSpeed ZeRO's formulas in bf16 (distref.cost.zero: zero_bf16_model_states, zero_bf16_communication),
pinned term by term on a tiny model worked out by hand: four parameters of 10, 20, 30 and 3 elements
(Ψ = 63), AdamW with a 4-byte step or SGD with momentum. bf16 keeps and sends the model's dtype (b = 2)
and keeps fp32 masters and optimizer states (m = 4); stages 1/2 neither check for overflow nor compute
the gradient norm (the impl's config turns both off), so they all-reduce neither a flag nor a norm. Real
runs check the same formulas against DeepSpeed (impls/deepspeed_zero, test_cost_equals_the_formulas)."""

from __future__ import annotations

import pytest

from distref.cost.usage import ModelParameters, ParameterUse
from distref.cost.zero import (
    zero_bf16_communication,
    zero_bf16_model_states,
    zero_communication,
    zero_model_states,
    zero_rank_cost,
)

NUMELS = [10, 20, 30, 3]  # backward's order (the default): 3, 30, 20, 10
BIG = 1000  # a reduce (and prefetch) bucket larger than the model


def counts(**kinds: tuple[int, int, float]) -> dict:
    return {kind: {"calls": c, "bytes": b, "bus_bytes": bus} for kind, (c, b, bus) in kinds.items()}


# Stages 1/2, 2 ranks: the flat buffer padded to a multiple of 2N = 4, Ψ' = 64, P = 32. Rank 0's partition
# [0, 32) overlaps the first three parameters (the third, [30, 60), whole): 60 elements; rank 1's [32, 64)
# the last two, 33, and the padding, 1. 3 ranks: Ψ' = 66, P = 22: rank 0 holds 10 + 20, rank 1 20 + 30,
# rank 2 30 + 3 and 3 of padding. Stage 3 pads each parameter to a multiple of N: 2 ranks 10, 20, 30, 4
# (64: 32 each), 3 ranks 12, 21, 30, 3 (66: 22 each). One rank: Ψ' = 64 at stages 1/2, 63 at stage 3.
MODEL_STATES = {
    # (stage, world, rank, optimizer): parameters Ψ'·2 (stage 3: Ψ'/N·2), gradients b·held (no kept norm;
    # stage 3: Ψ'/N·2 + 8, its fp64 norm), optimizer P·4 master + 2P·4 + 4 (AdamW) or + P·4 (SGD)
    (1, 2, 0, "adamw"): {"parameters": 128, "gradients": 60 * 2, "optimizer": 32 * 4 * 3 + 4},
    (2, 2, 1, "adamw"): {"parameters": 128, "gradients": 34 * 2, "optimizer": 32 * 4 * 3 + 4},
    (2, 2, 0, "sgd"): {"parameters": 128, "gradients": 60 * 2, "optimizer": 32 * 4 * 2},
    (1, 3, 0, "adamw"): {"parameters": 132, "gradients": 30 * 2, "optimizer": 22 * 4 * 3 + 4},
    (2, 3, 1, "adamw"): {"parameters": 132, "gradients": 50 * 2, "optimizer": 22 * 4 * 3 + 4},
    (2, 3, 2, "sgd"): {"parameters": 132, "gradients": 36 * 2, "optimizer": 22 * 4 * 2},
    (1, 1, 0, "adamw"): {"parameters": 128, "gradients": 64 * 2, "optimizer": 64 * 4 * 3 + 4},
    (3, 2, 1, "adamw"): {"parameters": 32 * 2, "gradients": 32 * 2 + 8, "optimizer": 32 * 4 * 3 + 4},
    (3, 3, 2, "sgd"): {"parameters": 22 * 2, "gradients": 22 * 2 + 8, "optimizer": 22 * 4 * 2},
    (3, 1, 0, "adamw"): {"parameters": 63 * 2, "gradients": 63 * 2 + 8, "optimizer": 63 * 4 * 3 + 4},
}


@pytest.mark.parametrize("case", MODEL_STATES, ids=lambda case: "stage{}-w{}-rank{}-{}".format(*case))
def test_bf16_model_states_are_16_bit_copies_and_fp32_masters(case):
    stage, world, rank, optimizer = case
    assert zero_bf16_model_states(NUMELS, world, rank, stage, optimizer, step_bytes=4) == MODEL_STATES[case]


def test_bf16_model_states_differ_from_fp32_s_in_the_16_bit_terms_only():
    """Against fp32 on the same partitions: parameters and gradients halve (stage 3's kept norm, 8 bytes,
    does not; stages 1/2 keep none), the master partition and the optimizer's states do not."""
    for stage in (1, 2, 3):
        fp32 = zero_model_states(NUMELS, 2, 0, stage, "adamw")
        bf16 = zero_bf16_model_states(NUMELS, 2, 0, stage, "adamw")
        norm = 8 if stage == 3 else 0
        assert bf16["parameters"] * 2 == fp32["parameters"]
        assert (bf16["gradients"] - norm) * 2 == fp32["gradients"] - norm
        assert bf16["optimizer"] == fp32["optimizer"]


COMMUNICATION = {
    # (stage, world, grad_accum): stages 1/2 all-reduce K'·Ψ·2 in one bucket (K' = 1 at stage 1, K at 2)
    # and nothing else (no overflow flag, no norm), and all-gather Ψ'·2; stage 3 gathers Ψ'·2 and
    # reduce-scatters Ψ'·2 per micro-step, and all-reduces the 8-byte norm (no overflow flag). Bus bytes:
    # 2(N-1)/N of an all-reduce, (N-1)/N of the others.
    (1, 2, 1): counts(all_reduce=(1, 63 * 2, 126.0), all_gather=(1, 64 * 2, 64.0)),
    (1, 2, 2): counts(all_reduce=(1, 63 * 2, 126.0), all_gather=(1, 64 * 2, 64.0)),
    (2, 2, 2): counts(all_reduce=(2, 2 * 63 * 2, 252.0), all_gather=(1, 64 * 2, 64.0)),
    (2, 3, 1): counts(all_reduce=(1, 63 * 2, 126 * 4 / 3), all_gather=(1, 66 * 2, 66 * 2 * 2 / 3)),
    (1, 1, 1): counts(all_reduce=(1, 63 * 2, 0.0)),  # the gradients only, on one rank too
    (3, 2, 1): counts(all_gather=(1, 64 * 2, 64.0), reduce_scatter=(1, 64 * 2, 64.0), all_reduce=(1, 8, 8.0)),
    (3, 2, 2): counts(
        all_gather=(2, 2 * 64 * 2, 128.0), reduce_scatter=(2, 2 * 64 * 2, 128.0), all_reduce=(1, 8, 8.0)
    ),
    (3, 1, 1): counts(reduce_scatter=(1, 63 * 2, 0.0), all_reduce=(1, 8, 0.0)),
}


@pytest.mark.parametrize("case", COMMUNICATION, ids=lambda case: "stage{}-w{}-accum{}".format(*case))
def test_bf16_communication_is_in_2_bytes_without_an_overflow_flag_or_a_norm_at_stages_1_and_2(case):
    stage, world, accum = case
    got = zero_bf16_communication(
        NUMELS, world, stage, bucket_elements=BIG, prefetch_elements=BIG, grad_accum=accum
    )
    assert got.keys() == COMMUNICATION[case].keys()
    for kind, expected in COMMUNICATION[case].items():
        assert got[kind]["calls"] == expected["calls"], kind
        assert got[kind]["bytes"] == expected["bytes"], kind
        assert got[kind]["bus_bytes"] == pytest.approx(expected["bus_bytes"]), kind


def test_bf16_buckets_count_elements_not_bytes():
    """B = 25 elements: backward's order 3 | 30 | 20 | 10 fills 4 buckets, in bf16 as in fp32 (the 30-element
    gradient cut at rank 1's partition, 2 + 28, is one all-reduce: its pieces pass B together)."""
    bf16 = zero_bf16_communication(NUMELS, 2, 2, bucket_elements=25, prefetch_elements=BIG)
    fp32 = zero_communication(NUMELS, 2, 2, bucket_elements=25, prefetch_elements=BIG)
    assert bf16["all_reduce"]["calls"] == fp32["all_reduce"]["calls"] == 4
    assert bf16["all_reduce"]["bytes"] == 63 * 2


def test_one_rank_at_stage_3_has_a_formula_beyond_one_prefetch_bucket():
    """Nothing is gathered on one rank, whatever the prefetch bucket: the reduce-scatters per bucket (B = 25:
    4 buckets) and the norm. On two ranks DeepSpeed's trace-driven fetch is not modelled: None."""
    for element_bytes, formula in ((4, zero_communication), (2, zero_bf16_communication)):
        one = formula(NUMELS, 1, 3, bucket_elements=25, prefetch_elements=10)
        assert one == counts(reduce_scatter=(4, 63 * element_bytes, 0.0), all_reduce=(1, 8, 0.0))
        assert formula(NUMELS, 2, 3, bucket_elements=25, prefetch_elements=10) is None


def test_the_rank_cost_uses_the_bf16_formulas_and_says_why_where_there_is_none():
    parameters = ModelParameters(
        shapes=tuple((n,) for n in NUMELS),
        element_bytes=(2,) * len(NUMELS),
        uses=(ParameterUse(),) * len(NUMELS),
        gradient_order=(3, 2, 1, 0),
    )

    def cost(stage: int, precision: str, world: int = 2):
        return zero_rank_cost(
            parameters,
            world,
            0,
            stage,
            bucket_elements=BIG,
            prefetch_elements=BIG,
            grad_accum=1,
            precision=precision,
            offload=False,
            optimizer="adamw",
            step_bytes=4,
        )

    bf16 = cost(2, "bf16")
    assert bf16.model_states == MODEL_STATES[(1, 2, 0, "adamw")]  # (stages 1 and 2 hold the same)
    assert bf16.communication == zero_bf16_communication(
        NUMELS, 2, 2, bucket_elements=BIG, prefetch_elements=BIG
    )
    assert (
        cost(0, "bf16").unavailable["model_states"].startswith("no formula for DeepSpeed's stage 0 in bf16")
    )
    assert cost(2, "fp16").communication is None
    assert cost(3, "fp32", world=1).communication == counts(
        reduce_scatter=(1, 63 * 4, 0.0), all_reduce=(1, 8, 0.0)
    )
