"""distref.cost.attention against torch: what each SDPA kernel saves for backward, by the shapes and dtypes
torch's own meta kernels document (CUDA's flash, memory-efficient and cuDNN kernels run on meta tensors
here, no GPU needed), and the math kernel measured on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.nn.attention import sdpa_kernel as only_kernel

from distref.cost.activations import model_blocks, saving_for, stage_bytes
from distref.cost.attention import attention_saves, sdpa_kernel
from distref.data import DatasetInfo
from distref.models import build_model
from distref.training.measure import SavedActivations
from distref.training.steps import loss_sum

ATEN = torch.ops.aten
KERNEL_OPS = {  # (q, k, v) → the kernel's outputs, causal, no mask, no dropout, log-sum-exp for backward
    "efficient": lambda q, k, v: ATEN._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True),
    "flash": lambda q, k, v: ATEN._scaled_dot_product_flash_attention(q, k, v, 0.0, True),
    "cudnn": lambda q, k, v: ATEN._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True),
    "cpu": lambda q, k, v: ATEN._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True),
}


def saved_by(kernel: str, batch: int, seq: int, heads: int, head_size: int, dtype: torch.dtype) -> int:
    """Bytes `kernel` saves for backward on meta tensors shaped as distref's gpt makes q, k and v: (B, a,
    s, d) views of (B, s, a, d) projections' outputs. Each saved tensor counts once (meta tensors have no
    storage to tell views apart: the kernels save q, k, v, the output and their own tensors, no view
    twice)."""
    projections = [
        torch.empty(batch, seq, heads, head_size, device="meta", dtype=dtype, requires_grad=True)
        for _ in range(3)
    ]
    q, k, v = (t.transpose(1, 2) for t in projections)
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = KERNEL_OPS[kernel](q, k, v)[0]
    # the output is laid out (B, s, a, d): the output projection's input is a view of it, not a copy
    assert output.transpose(1, 2).is_contiguous()
    return sum(saved)


@pytest.mark.parametrize(
    "kernel, dtype",
    [
        ("efficient", torch.float32),
        ("efficient", torch.bfloat16),
        ("flash", torch.bfloat16),
        ("flash", torch.float16),
        ("cudnn", torch.bfloat16),
        ("cpu", torch.float32),
        ("cpu", torch.bfloat16),
        ("cpu", torch.float64),
    ],
)
@pytest.mark.parametrize("seq", [16, 33, 100])  # the memory-efficient kernel pads its rows to 32
def test_each_kernel_saves_what_torch_documents(kernel, dtype, seq):
    batch, heads, head_size = 3, 4, 16
    compute = dtype.itemsize
    accumulate = max(4, compute)
    per_sample, per_forward = attention_saves(kernel, seq, heads * head_size, heads, compute, accumulate)
    assert saved_by(kernel, batch, seq, heads, head_size, dtype) == batch * per_sample + per_forward


@pytest.mark.parametrize("precision", ["fp32", "fp64", "bf16"])
def test_the_math_kernel_as_measured(precision):
    """The math kernel (the composite one every device has): 16-bit inputs upcast to fp32, q and kᵀ
    scaled and copied for bmm, the softmax's output, v copied, the output cast back and copied; measured
    on the CPU as the impls measure (storages counted once), one attention of distref's gpt layout."""
    batch, seq, heads, head_size = 2, 24, 4, 16
    hidden = heads * head_size
    dtype = torch.float64 if precision == "fp64" else torch.float32
    projection = torch.nn.Linear(hidden, 3 * hidden, dtype=dtype)
    x = torch.randn(batch, seq, hidden, dtype=dtype)
    meter = SavedActivations(projection.parameters())
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    with (
        only_kernel(SDPBackend.MATH),
        autocast,
        torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack),
    ):
        projected = projection(x)  # (what the Linear saves: its input x, and under autocast its casts)
        before = meter.live
        q, k, v = (p.view(batch, seq, heads, head_size).transpose(1, 2) for p in projected.split(hidden, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        attention = meter.live - before
        # the output projection's input: a contiguous copy of the output (math's output is (B, a, s, d))
        flat = y.transpose(1, 2).reshape(batch, seq, hidden)
        assert not y.transpose(1, 2).is_contiguous() and flat.data_ptr() != y.data_ptr()
    sv = saving_for(precision, "cpu", attention="math")
    per_sample, per_forward = attention_saves("math", seq, hidden, heads, sv.compute, sv.accumulate)
    # (the formula counts the output projection's input, `flat`, here: the copy it saves)
    assert attention + batch * sv.compute * seq * hidden == batch * per_sample + per_forward


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_gpt_on_the_math_kernel_saves_what_its_formula_says(precision):
    """The whole gpt (its layer norms, MLP, loss, autocast's copies) with SDPA on the math kernel, as CUDA
    runs it for fp64 or where no other kernel takes the inputs: measured equal to the formula."""
    info = DatasetInfo("synthetic", num_classes=11, input_shape=(16,), kind="sequence")
    model = build_model("gpt", info, 2, torch.float32)
    batch = 3
    x, y = torch.randint(0, 11, (2, batch, 16))
    meter = SavedActivations(model.parameters())
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    with only_kernel(SDPBackend.MATH), torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        with autocast:
            loss = loss_sum(model(x), y)
        measured = meter.peak
    del loss
    sv = saving_for(precision, "cpu", attention="math")
    assert measured == stage_bytes(*model_blocks("gpt", info, 2, sv, checkpointed=False), batch)


def test_the_kernel_is_torch_s_choice_on_a_gpu_and_its_rule_without(monkeypatch):
    """On the CPU, the CPU's flash kernel. On CUDA, torch's own choice for such q, k, v where a GPU is
    here (`torch._fused_sdp_choice`, faked here: this machine has none); without one, torch 2.11–2.13's
    order on sm90 with the CUDA 13 wheels' cuDNN: cuDNN for 16 bits (head size a multiple of 8, ≤ 128),
    flash beyond 128, memory-efficient for fp32, math for fp64."""
    assert {sdpa_kernel("cpu", p) for p in ("fp32", "fp64", "bf16")} == {"cpu"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sdpa_kernel("cuda", "fp32") == "efficient"
    assert sdpa_kernel("cuda", "fp64") == "math"
    assert sdpa_kernel("cuda", "bf16") == sdpa_kernel("cuda", "fp16", head_size=128) == "cudnn"
    assert sdpa_kernel("cuda", "bf16", head_size=256) == sdpa_kernel("cuda", "bf16", head_size=12) == "flash"
    assert sdpa_kernel("cuda", "bf16", head_size=512) == "efficient"
    assert sdpa_kernel("cuda", "fp32", head_size=6) == "math"
    asked = []

    def fused_sdp_choice(q, k, v, is_causal):  # torch's SDPBackend: 0 math, 1 flash, 2 efficient, 3 cuDNN
        asked.append((q.shape, q.dtype, q.requires_grad, is_causal))
        return 1

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "_fused_sdp_choice", fused_sdp_choice)
    monkeypatch.setattr(
        torch,
        "empty",
        lambda *shape, device, dtype, requires_grad: torch.zeros(
            *shape, dtype=dtype, requires_grad=requires_grad
        ),
    )
    assert sdpa_kernel("cuda", "bf16", head_size=64, heads=12, seq=1024) == "flash"
    assert asked == [(torch.Size([1, 12, 1024, 64]), torch.bfloat16, True, True)]  # (as training asks)
    assert sdpa_kernel("cuda", "bf16", ask_the_gpu=False) == "cudnn"  # (the planner: not this GPU's)
    assert saving_for("bf16", "cuda").attention == "flash"
