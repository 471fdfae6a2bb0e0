"""What F.scaled_dot_product_attention saves for backward, by kernel, and which kernel torch picks.

Per sample (sequence s, hidden h = a heads × head size d) and per forward (once per call, whatever the
batch), in bytes; `compute` the inputs' element size (bf16/fp16 under autocast: 2), `accumulate` fp32's 4
(fp64's 8). derivatives.yaml (torch 2.11–2.13) names what each kernel's backward reads:

    cpu        q, k, v, output: compute·4·s·h       log-sum-exp (B, a, s): accumulate·a·s
               (`_scaled_dot_product_flash_attention_for_cpu`; measured here, fp32, fp64 and bf16)
    flash      q, k, v, output: compute·4·s·h       log-sum-exp (B, a, s) fp32: 4·a·s
               its random-number state, (2,) and () uint64: 24 per forward (`_flash_attention_forward`)
    efficient  q, k, v, output: compute·4·s·h       log-sum-exp (B, a, ⌈s/32⌉·32) fp32: 4·a·⌈s/32⌉·32
               (the memory-efficient kernel pads its rows to 32), seed and offset: 16 per forward
    cudnn      q, k, v, output: compute·4·s·h       log-sum-exp (B, a, s, 1) fp32: 4·a·s
               seed and offset: 16 per forward
    math       the composite `_scaled_dot_product_attention_math`: 16-bit inputs upcast to fp32; q and
               kᵀ scaled by √scale and reshaped for bmm (copies: 2·s·h), the softmax's output (a·s²), v
               reshaped for bmm (a copy: s·h), all accumulate-sized; the output cast back and made
               contiguous for the output projection: compute·s·h (the other kernels' output is a view)
               (measured here, fp32, fp64 and bf16)

Every kernel's output is laid out (B, s, a, d), so the output projection's input is a view of it (counted
once). The shapes and dtypes are those of torch's own meta kernels (torch/_meta_registrations.py), which
core/tests/test_attention_saves.py runs on meta tensors, kernel by kernel.

The q, k, v saved are the projections' outputs (views of them: the kernels take (B, a, s, d) views of
(B, s, a, d) memory, as distref's gpt makes them, without copies) and count here, not in the projections.
With the math kernel the projections' outputs themselves are not saved.
"""

from __future__ import annotations

KERNELS = ("cpu", "flash", "efficient", "cudnn", "math")
RANDOM_STATE = 16  # philox seed and offset: two int64 scalars, saved even without dropout
FLASH_RANDOM_STATE = 24  # flash's: a (2,) uint64 seed and offset, and a () uint64


def _padded(s: int, multiple: int = 32) -> int:
    return -(-s // multiple) * multiple


def attention_saves(kernel: str, s: int, h: int, a: int, compute: int, accumulate: int) -> tuple[int, int]:
    """(per sample, per forward) bytes SDPA's `kernel` saves for one causal self-attention of a heads
    over s tokens of width h (the module docstring's table)."""
    if kernel == "cpu":
        return compute * 4 * s * h + accumulate * a * s, 0
    if kernel == "flash":
        return compute * 4 * s * h + 4 * a * s, FLASH_RANDOM_STATE
    if kernel == "cudnn":
        return compute * 4 * s * h + 4 * a * s, RANDOM_STATE
    if kernel == "efficient":
        return compute * 4 * s * h + 4 * a * _padded(s), RANDOM_STATE
    if kernel == "math":
        return accumulate * (3 * s * h + a * s * s) + compute * s * h, 0
    raise ValueError(f"no SDPA kernel {kernel!r}: one of {', '.join(KERNELS)}")


# torch's SDPBackend values, as torch._fused_sdp_choice returns them
BACKENDS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}


def sdpa_kernel(
    device: str,
    precision: str,
    head_size: int = 16,
    heads: int = 4,
    seq: int = 16,
    ask_the_gpu: bool = True,
) -> str:
    """The kernel torch picks for a causal self-attention without mask or dropout, of `heads` heads of
    `head_size` over `seq` tokens (distref's gpt: 4 × 16), on `device` under `precision`. On the CPU its
    flash kernel ("cpu"; fp64 too). On CUDA, where a GPU is here (and `ask_the_gpu`), torch's own choice
    for such q, k, v requiring grad (`torch._fused_sdp_choice`); else torch 2.11–2.13's rule for sm90
    (H100, H200) with the CUDA 13 wheels, whose cuDNN (> 9.15) torch puts first: 16-bit inputs with a
    head size a multiple of 8 up to 128 go to cuDNN, up to 256 to flash (which pads another head size:
    copies not modelled here); fp32 to the memory-efficient kernel (head size a multiple of 4; cuDNN and
    flash take 16 bits only); fp64, and what no fused kernel takes, to math."""
    if device == "cpu":
        return "cpu"
    chosen = _chosen_on_this_gpu(precision, head_size, heads, seq) if ask_the_gpu else None
    if chosen is not None:
        return chosen
    if precision in ("bf16", "fp16"):
        if head_size % 8 == 0 and head_size <= 128:
            return "cudnn"
        return "flash" if head_size <= 256 else "efficient" if head_size % 8 == 0 else "math"
    if precision == "fp32" and head_size % 4 == 0:
        return "efficient"
    return "math"


def _chosen_on_this_gpu(precision: str, head_size: int, heads: int, seq: int) -> str | None:
    """What torch's dispatcher picks on this machine's GPU for such q, k, v (None without a GPU)."""
    import torch

    if not torch.cuda.is_available():
        return None
    dtype = {"fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}.get(
        precision, torch.float32
    )
    q, k, v = (
        torch.empty(1, seq, heads, head_size, device="cuda", dtype=dtype, requires_grad=True).transpose(1, 2)
        for _ in range(3)
    )
    return BACKENDS.get(torch._fused_sdp_choice(q, k, v, is_causal=True))
