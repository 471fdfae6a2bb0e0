"""distref.cost.activations' rules for what a run saves, by precision, device and how its parameters
compute (`saving_for`), pinned by hand where no impl test can measure them here: CUDA's autocast lists
(torch 2.13's autocast_mode.h: layer_norm runs in fp32 on CUDA, in its input's dtype on the CPU) and
CUDA's layer norm and batch norm. What the CPU runs, the impls' tests measure."""

from __future__ import annotations

import pytest

from distref.cost.activations import gpt_blocks, no_formula, saving_for
from distref.cost.attention import attention_saves

S, H, A, V = 16, 64, 4, 11


def test_fsdp_s_16_bit_parameters_under_autocast_on_cuda_copy_around_the_layer_norms():
    """FSDP2's bf16 policy with the loop's autocast on CUDA: each layer norm saves an fp32 copy of its bf16
    input and fp32 statistics; its fp32 output is cast again by each Linear after it (q, k, v: three
    copies); its bf16 weight and bias are cast to fp32, once per forward. The Linear weights are 16-bit
    parameters already: no casts of them."""
    sv = saving_for("bf16", "cuda", "16-bit under autocast")
    blocks = gpt_blocks(S, H, A, 2, V, sv, checkpointed=False)
    attention, per_forward = attention_saves(sv.attention, S, H, A, 2, 4)
    assert blocks[1].own == 4 * 2 * S * H + 4 * 4 * S + 2 * (3 + 1) * S * H + attention + 2 * 8 * S * H
    assert (blocks[1].weights, blocks[1].per_forward) == (4 * 2 * 2 * H, per_forward)
    assert (blocks[-1].own, blocks[-1].weights) == (4 * S * H + 4 * 2 * S + 2 * S * H, 4 * 2 * H)
    # DeepSpeed (no autocast): the layer norms take the bf16 stream as it is, statistics fp32 on CUDA
    deepspeed = gpt_blocks(S, H, A, 2, V, saving_for("bf16", "cuda", "16-bit"), checkpointed=False)
    assert deepspeed[1].own == 2 * 2 * S * H + 4 * 4 * S + 2 * 2 * S * H + attention + 2 * 8 * S * H
    assert deepspeed[1].weights == 0


def test_on_the_cpu_autocast_leaves_16_bit_layer_norms_alone():
    """The CPU's autocast has no layer_norm in its lists: FSDP's and DeepSpeed's 16-bit parameters save
    alike there (measured: fsdp and deepspeed_zero, gpt bf16, 857,220 bytes each), statistics in bf16."""
    fsdp, deepspeed = saving_for("bf16", "cpu", "16-bit under autocast"), saving_for("bf16", "cpu", "16-bit")
    assert fsdp == deepspeed and fsdp.layer_norm == 2 and not fsdp.input_casts


def test_autocast_over_fp32_parameters_is_the_same_on_both_devices_but_for_attention():
    """layer_norm on an fp32 input runs in fp32 either way (CUDA's fp32 list changes nothing), GELU in the
    Linear's bf16 on both: only SDPA's kernel differs."""
    cpu, cuda = saving_for("bf16", "cpu"), saving_for("bf16", "cuda", attention="cpu")
    assert cpu == cuda


@pytest.mark.parametrize(
    "precision, reason", [("fp32", True), ("fp64", True), ("fp16", True), ("bf16", False)]
)
def test_resnet18_on_cuda_has_no_formula_where_cudnn_s_batch_norm_keeps_a_reserve(precision, reason):
    said = no_formula("resnet18", precision, "cuda")
    assert (said is not None) == reason
    if reason:
        assert "cuDNN's batch norm saves a reserve buffer" in said
    assert no_formula("resnet18", precision, "cpu") is None


def test_an_unknown_device_or_parameters_is_refused():
    with pytest.raises(ValueError, match="device is cpu or cuda"):
        saving_for("bf16", "mps")
    with pytest.raises(ValueError, match="parameters is one of"):
        saving_for("bf16", "cpu", "8-bit")
