"""Activation bytes a rank holds for backward, by formula: what autograd saves, op by op, block by block,
counting the same elements once (a ReLU's output that is also the next Linear's input is one tensor).

Element size `e` (4 for fp32, 8 for fp64; indices and targets are int64, 8 bytes), per sample:

lenet (1×28×28 → conv 10k5 → maxpool 2 → ReLU → conv 20k5 → maxpool 2 → ReLU → fc 320→50 → ReLU → fc 50→10)
    conv1   e·784 (its input) + e·10·24·24 (conv output, kept by max-pool) + 8·10·12·12 (the pool's indices)
            + e·10·12·12 (ReLU's output, which conv2 saves as its input: counted here)
    conv2   e·20·8·8 + 8·20·4·4 + e·20·4·4 (likewise; fc1 saves the flattened ReLU output)
    fc1     e·50 (ReLU's output, fc2's input)          fc2   nothing of its own
gpt (L blocks of hidden h, heads a, sequence s, vocabulary V; pre-LN, GELU MLP, SDPA attention)
    embed   8·s (token ids), and 8·s per forward (positions)
    block   e·(16·s·h + 4·s + a·s): LayerNorm inputs (2 s·h) with mean and rstd (4 s), their outputs (2 s·h),
            q, k, v (3 s·h), attention's output and log-sum-exp (s·h + a·s), the MLP's hidden before and
            after GELU (8 s·h). Unlike Megatron's 34·s·b·h + 5·a·s²·b (arXiv 2205.05198, §4.1 and Table 2:
            `megatron_layer_activation_bytes`): no dropout masks, no s² score matrix (SDPA recomputes it).
    head    e·(2·s·h + 2·s): its LayerNorm's input with mean and rstd, and the Linear's input
resnet18 (C×H×W images; a 3×3 stem of 64 channels, four layers of two BasicBlocks, 64-512 channels; each
          BatchNorm saves its input, each in-place ReLU its output, which the next convolution saves too)
    stem    e·C·H·W (the image) + e·2·64·H·W (BatchNorm's input, ReLU's output)
    block   e·4·C'·H'·W' (two BatchNorm inputs, two ReLU outputs; C'×H'×W' its output), + e·C'·H'·W'
            for a downsampling block's BatchNorm; per forward e·2·C' per BatchNorm (batch mean and
            inverse std), and once e·2·C' (its running mean and variance: buffers, the same tensors in
            every micro-batch)
    head    e·512 (the average pool's output, the Linear's input; the pool, a mean, saves nothing)
the loss  e·(classes per sample, or s·V) for log-softmax's output, 8 (or 8·s) for the target, and e per
          forward (nll_loss's total weight)
With activation checkpointing a block keeps only its input (the rest is recomputed in backward).

A pipeline stage holds its blocks' bytes per micro-batch (its first block's input is the activation it
received), the loss on the last stage, times the micro-batches in flight: M for GPipe (every forward
before any backward), min(M, p − s) on stage s for 1F1B (GPipe arXiv 1811.06965; PipeDream-Flush /
Megatron-LM arXiv 2104.04473 §2.2); the multi-stage schedules by their own order of work (`held_in_order`),
those that split the backward (zero-bubble, ZBV, DualPipeV) freeing part at each pass (`stage_holdings`).

In 16 bits (`Saving`, `saving_for`) each kind of tensor has its own element size: under autocast over fp32
parameters the weighted ops' outputs (and what follows them) are 16-bit, gpt's residual stream, the layer
norms' inputs and statistics stay fp32, each weighted op saves its own 16-bit cast of an fp32 input (q, k
and v three of ln1's output), and its weight's cast once per autocast region (`Block.weights`: a
pipeline's schedule shares one region among its micro-batches); with 16-bit parameters (FSDP2's policy,
DeepSpeed) everything is 16-bit but the log-sum-exp and the loss. SDPA's kernel (the CPU's, CUDA's flash,
memory-efficient, cuDNN or math) decides what attention saves: distref.cost.attention. The table above
is fp32's (e = 4) and fp64's (e = 8) on the CPU's kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from fractions import Fraction

from distref.config import GPT_MODELS, MoEConfig, RunConfig
from distref.cost.attention import attention_saves, sdpa_kernel
from distref.models import gpt_config

INDEX_BYTES = 8  # int64 indices, token ids and targets
LOW_BYTES = {"bf16": 2, "fp16": 2}  # autocast's 16-bit dtypes
FULL_BYTES = {"fp32": 4, "fp64": 8}
# How the parameters compute: "full" (fp32 under autocast: single, DDP, the pipeline, ...), "16-bit" (cast
# and computing without autocast: DeepSpeed), "16-bit under autocast" (FSDP2's bf16 policy, the loop's
# autocast on as in single)
PARAMETERS = ("full", "16-bit", "16-bit under autocast")


def parameters_in(dtype, autocast: bool = True) -> str:
    """`saving_for`'s `parameters` for parameters that compute in `dtype` (a torch.dtype; None: as they
    are held), the forward under autocast or not: "full" unless bf16/fp16 (FSDP2's policy gathers them so,
    DeepSpeed casts the module)."""
    if dtype is None or dtype.itemsize != 2:
        return "full"
    return "16-bit under autocast" if autocast else "16-bit"


@dataclasses.dataclass(frozen=True)
class Saving:
    """The bytes per element of each kind of tensor autograd saves in a run, and the copies autocast adds.

    `stream`: the model's float tensors where no op changes their dtype — the image, gpt's residual stream
    (the parameters' dtype: fp32 under autocast); `compute`: what the weighted ops (Linear, convolution,
    SDPA) compute in, and the ops after them (ReLU, max-pool, GELU, BatchNorm); `layer_norm`: LayerNorm's
    mean and rstd; `batch_norm`: BatchNorm's batch mean and inverse std; `buffers`: BatchNorm's running
    mean and variance; `accumulate`: SDPA's log-sum-exp, log-softmax's output and nll_loss's total weight
    (at least fp32). `norm_input`: what LayerNorm saves of its input (CUDA's autocast runs it in fp32: an
    fp32 copy of a 16-bit stream; else the stream). `input_casts`: each weighted op saves its own cast of
    a wider input (autocast caches the casts of parameters only: q, k and v three copies of ln1's fp32
    output); `weight_casts`: each weighted op saves its weight's 16-bit cast, one per autocast region
    (autocast over fp32 parameters); `norm_weights`: bytes per element of LayerNorm's weight and bias as
    it saves them where autocast casts them (16-bit parameters in fp32 on CUDA; 0: the parameters
    themselves, not counted). `attention`: SDPA's kernel (`distref.cost.attention`)."""

    stream: int
    compute: int
    layer_norm: int
    batch_norm: int
    buffers: int
    accumulate: int
    input_casts: bool = False
    weight_casts: bool = False
    norm_input: int | None = None  # (None: `stream`)
    norm_weights: int = 0
    attention: str = "cpu"

    @property
    def norm_input_bytes(self) -> int:
        return self.stream if self.norm_input is None else self.norm_input


def saving_for(
    precision: str, device: str = "cpu", parameters: str = "full", attention: str | None = None
) -> Saving:
    """How a run saves (`Saving`): `precision` (fp32, fp64, or bf16/fp16), on `device` ("cpu" or "cuda"),
    its `parameters` as they compute (`PARAMETERS`). `attention`: SDPA's kernel where not the one torch
    picks for these inputs (`distref.cost.attention.sdpa_kernel`).

    CPU and CUDA differ in autocast's op lists (torch 2.13's autocast_mode.h): CUDA runs layer_norm in
    fp32 (a 16-bit input is copied to fp32, its 16-bit weight and bias cast), the CPU in its input's dtype;
    and CUDA's layer norm keeps fp32 statistics for 16-bit input, the CPU's 16-bit ones."""
    if parameters not in PARAMETERS:
        raise ValueError(f"parameters is one of {', '.join(PARAMETERS)}, not {parameters!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device is cpu or cuda, not {device!r}")
    kernel = attention or sdpa_kernel(device, precision)
    if precision in FULL_BYTES:
        e = FULL_BYTES[precision]
        return Saving(e, e, e, e, e, e, attention=kernel)
    if precision not in LOW_BYTES:
        raise ValueError(f"no precision {precision!r}: fp32, fp64, bf16 or fp16")
    low = LOW_BYTES[precision]
    if parameters == "full":  # fp32 parameters under autocast: the stream stays fp32
        return Saving(4, low, 4, 4, 4, 4, input_casts=True, weight_casts=True, attention=kernel)
    # 16-bit parameters: everything in 16 bits but what is accumulated; CUDA's layer norm keeps its
    # statistics in fp32 (its accumulation type), the CPU's in the input's dtype
    if device == "cuda" and parameters == "16-bit under autocast":  # (the CPU's autocast leaves it be)
        # layer_norm on CUDA's fp32 list: its input and weights cast to fp32, its fp32 output cast again
        # by each Linear after it
        return Saving(
            low, low, 4, low, low, 4, input_casts=True, norm_input=4, norm_weights=4, attention=kernel
        )
    return Saving(low, low, 4 if device == "cuda" else low, low, low, 4, attention=kernel)


@dataclasses.dataclass(frozen=True)
class Block:
    """What one block saves for backward, in bytes: `input` (per sample: its saved input, which the
    previous block already counts as its own output — except on the first block of a model or a stage),
    `own` (per sample: everything else it saves), `per_forward` (once per forward, whatever the batch)."""

    input: int
    own: int
    per_forward: int = 0
    once: int = 0  # buffers saved for backward (BatchNorm's running statistics): the same tensors however
    # many micro-batches are in flight
    after_weights: int = 0  # per sample, of `own`: what the ops after the block's last weighted op save
    # (a split backward's input-gradient pass lets it go: `stage_holdings`)
    weights: int = 0  # autocast's casts of its weights: one per autocast region (a forward; a pipeline's
    # whole step, whose micro-batches share them)


def lenet_blocks(sv: Saving, checkpointed: bool) -> list[Block]:
    c = sv.compute
    if checkpointed:  # each block keeps its input alone (the image as given); the rest is recomputed
        return [Block(0, size) for size in (sv.stream * 784, c * 10 * 12 * 12, c * 20 * 4 * 4, c * 50)]
    image = (c if sv.input_casts else sv.stream) * 784  # under autocast conv1 saves its 16-bit copy
    inputs = [image, c * 10 * 12 * 12, c * 20 * 4 * 4, c * 50]  # the image; each ReLU's output
    conv1 = c * 10 * 24 * 24 + INDEX_BYTES * 10 * 12 * 12 + inputs[1]  # max-pool's and ReLU's: after the conv
    conv2 = c * 20 * 8 * 8 + INDEX_BYTES * 20 * 4 * 4 + inputs[2]
    weights = [w * c if sv.weight_casts else 0 for w in (10 * 25, 20 * 10 * 25, 50 * 320, 10 * 50)]
    return [
        Block(inputs[0], conv1, after_weights=conv1, weights=weights[0]),
        Block(inputs[1], conv2, after_weights=conv2, weights=weights[1]),
        Block(inputs[2], inputs[3], after_weights=inputs[3], weights=weights[2]),  # ReLU's output
        Block(inputs[3], 0, weights=weights[3]),
    ]


def _halved(size: int) -> int:
    """A 3×3 convolution of stride 2 and padding 1 (or a 1×1 of stride 2): ⌈size/2⌉."""
    return (size + 1) // 2


def resnet18_blocks(
    input_shape: tuple[int, int, int], sv: Saving, checkpointed: bool, classes: int = 10
) -> list[Block]:
    """distref.models.resnet18 (torchvision's BasicBlocks, a 3×3 stem, no max-pool): stem, layer1-4,
    head. Per sample, each BatchNorm saves its input (the convolution's output), each in-place ReLU its
    output (the next convolution's input: the same elements); a downsampling block's 1×1 convolution saves
    the block's input (already counted) and its BatchNorm that convolution's output. Per forward each
    BatchNorm saves its batch mean and inverse std (2C), and once its running mean and variance (2C).
    Under autocast the convolutions' outputs, and so all that follows them, are 16-bit, the statistics
    fp32 (BatchNorm's weights' dtype); the stem saves its 16-bit copy of the image and each convolution
    (and the head's Linear) its weight's."""
    channels, height, width = input_shape
    c = sv.compute
    image_as_given = sv.stream * channels * height * width  # what a checkpointed stem keeps
    image = c * channels * height * width if sv.input_casts else image_as_given
    inputs, blocks = [image], []
    stem_out = 64 * height * width
    per_forward, once = sv.batch_norm * 2 * 64, sv.buffers * 2 * 64  # the stem's BatchNorm's statistics
    # (after_weights: the in-place ReLU after the last BatchNorm, of the stem and of each layer)
    weight_copies = (lambda elements: elements * c) if sv.weight_casts else (lambda elements: 0)
    stem_weights = weight_copies(64 * channels * 9)
    blocks.append(Block(image, c * 2 * stem_out, per_forward, once, c * stem_out, stem_weights))
    inputs.append(c * stem_out)
    in_channels = 64
    for out_channels, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        own = batch_norms = weights = 0
        for first in (True, False):  # two BasicBlocks per layer
            if first and stride == 2:
                height, width = _halved(height), _halved(width)
            pixels = out_channels * height * width
            downsample = first and (stride != 1 or in_channels != out_channels)
            batch_norms += 3 if downsample else 2
            # bn1's input, relu's output (conv2's input), bn2's input, the final relu's output; the
            # downsample's BatchNorm input
            own += c * pixels * (4 + (1 if downsample else 0))
            weights += out_channels * (in_channels + out_channels) * 9
            weights += out_channels * in_channels if downsample else 0
            in_channels = out_channels
        inputs.append(c * out_channels * height * width)
        blocks.append(
            Block(
                inputs[-2],
                own,
                per_forward=sv.batch_norm * 2 * out_channels * batch_norms,
                once=sv.buffers * 2 * out_channels * batch_norms,
                after_weights=inputs[-1],
                weights=weight_copies(weights),
            )
        )
    # The average pool (a mean over H×W: MeanBackward) saves nothing of its input; the Linear saves its input
    blocks.append(Block(0, c * 512, weights=weight_copies(512 * classes)))
    if checkpointed:  # each block keeps its input alone (the image as given)
        return [Block(0, size) for size in (image_as_given, *inputs[1:])]
    return blocks


def moe_layer_bytes(
    *, tokens: int, sequences: int, hidden: int, top_k: int, experts: int, rows_in: int, sv: Saving
) -> int:
    """What one MoE layer (distref.models.MoE) saves for backward, on `tokens` tokens of `sequences`
    sequences, its experts computing `rows_in` routed rows (all n·k where every expert is local; a rank's
    share under expert parallelism). Counted op by op, r the router's bytes (the parameters': the stream's)
    and c the experts' (`compute`):
      the router: its input, the ln's output (r·n·h), the softmax's output (r·n·E), the top k's indices
        gathered (8·n·k), with k > 1 the renormalisation's input and sum (r·n·k + r·n), each sequence's
        f (r·E), the balance loss (r, once a forward);
      the dispatch: the tokens' gather index (8·n·k); each expert's rows (c·R·h), its hidden before and
        after GELU (2·c·R·4h); the outputs' placing index and source (8·n·k + c·n·k·h);
      the combine: the outputs (c·n·k·h) and their weights (c·n·k) the product saves.
    Under autocast each expert's weights are cast anew for each call (a view of the stacked parameter is no
    parameter: autocast caches none), and saved: `per_forward_bytes`."""
    n, k, h, c, r, rows = tokens, top_k, hidden, sv.compute, sv.stream, tokens * top_k
    router = r * n * h + r * n * experts + INDEX_BYTES * rows + (r * n * k + r * n if k > 1 else 0)
    router += r * sequences * experts
    dispatch = INDEX_BYTES * rows + expert_rows_bytes(rows_in, h, sv) + INDEX_BYTES * rows + c * rows * h
    combine = c * rows * h + c * rows
    return router + dispatch + combine


def expert_rows_bytes(rows: int, hidden: int, sv: Saving) -> int:
    """What the experts save of `rows` routed rows: the rows, and their hidden before and after GELU."""
    return sv.compute * rows * hidden + 2 * sv.compute * rows * 4 * hidden


def moe_per_forward_bytes(experts_held: int, hidden: int, sv: Saving) -> int:
    """Once a forward, per MoE layer: the balance loss (a scalar), and under autocast each held expert's
    two weight casts (h × 4h each)."""
    return sv.stream + (experts_held * 2 * 4 * hidden * hidden * sv.compute if sv.weight_casts else 0)


def gpt_blocks(
    seq: int,
    hidden: int,
    heads: int,
    layers: int,
    vocab: int,
    sv: Saving,
    checkpointed: bool,
    moe: MoEConfig | None = None,
) -> list[Block]:
    """distref's gpt (module docstring). Under autocast the residual stream stays in the parameters'
    fp32 (the embeddings are no autocast op, and fp32 + 16-bit adds in fp32): the layer norms' inputs and
    statistics are fp32, and each Linear saves its own 16-bit cast of the layer norm's output (q, k and v
    three copies of ln1's), and its weight's cast (one per autocast region). `moe`: its MLPs a mixture of
    experts (`moe_layer_bytes`, every expert on this rank)."""
    s, h, c = seq, hidden, sv.compute
    if checkpointed:  # each block keeps its input alone
        return [Block(0, INDEX_BYTES * s)] + [Block(0, sv.stream * s * h)] * (layers + 1)
    embed = Block(INDEX_BYTES * s, 0, per_forward=INDEX_BYTES * s)
    attention, attention_once = attention_saves(sv.attention, s, h, heads, c, sv.accumulate)
    q_k_v_inputs = 3 if sv.input_casts else 1  # autocast casts ln1's output once for each of them
    own = (
        sv.norm_input_bytes * 2 * s * h  # ln1's and ln2's inputs
        + sv.layer_norm * 4 * s  # their means and rstds
        + c * q_k_v_inputs * s * h  # ln1's output, as q, k, v save it
        + attention
    )
    per_forward = attention_once
    weights = c * 4 * h * h if sv.weight_casts else 0  # q, k, v, proj (h×h)
    weights += sv.norm_weights * 4 * h  # (the layer norms' weights and biases, where autocast casts them)
    if moe is None:
        own += c * s * h + c * 8 * s * h  # ln2's output, as the MLP's first Linear saves it; its hidden
        weights += c * 8 * h * h if sv.weight_casts else 0  # the MLP's (4h×h, h×4h)
    else:  # (per sequence: every term is linear in the tokens but the balance loss and the casts)
        own += moe_layer_bytes(
            tokens=s,
            sequences=1,
            hidden=h,
            top_k=moe.top_k,
            experts=moe.experts,
            rows_in=s * moe.top_k,
            sv=sv,
        )
        per_forward += moe_per_forward_bytes(moe.experts, h, sv)
    block = Block(0, own, per_forward=per_forward, weights=weights)
    head_weights = (c * h * vocab if sv.weight_casts else 0) + sv.norm_weights * 2 * h
    head = Block(0, sv.norm_input_bytes * s * h + sv.layer_norm * 2 * s + c * s * h, weights=head_weights)
    return [embed, *[block] * layers, head]


@dataclasses.dataclass(frozen=True)
class Loss:
    per_sample: int  # log-softmax's output and the target
    per_forward: int  # nll_loss's total weight


def stage_bytes(
    blocks: list[Block], loss: Loss | None, micro_batch: int, in_flight: int = 1, shared_weights: bool = False
) -> int:
    """The activations a stage of `blocks` (the whole model: every block) holds with `in_flight`
    micro-batches of `micro_batch` samples, `loss` on the stage that computes it: per micro-batch the
    first block's input, every block's own bytes and the loss, and autocast's weight casts (once where
    the micro-batches share an autocast region: `shared_weights`); once, the buffers saved."""
    per_sample = blocks[0].input + sum(block.own for block in blocks)
    per_forward = sum(block.per_forward for block in blocks)
    if loss is not None:
        per_sample, per_forward = per_sample + loss.per_sample, per_forward + loss.per_forward
    weights = sum(block.weights for block in blocks)
    once = sum(block.once for block in blocks) + (weights if shared_weights else 0)
    per_forward += 0 if shared_weights else weights
    return in_flight * (micro_batch * per_sample + per_forward) + once


def model_blocks(
    model: str, info, gpt_layers: int, sv: Saving, checkpointed: bool, moe: MoEConfig | None = None
) -> tuple[list[Block], Loss] | None:
    """(blocks, loss) of one of this project's models on a dataset (`info`: distref.data.DatasetInfo),
    saving as `sv` says. The loss: log-softmax's output on logits widened to at least fp32 (the loss
    takes them so), the targets, nll_loss's total weight."""
    classes, acc = info.num_classes, sv.accumulate
    if model == "lenet":
        return lenet_blocks(sv, checkpointed), Loss(acc * classes + INDEX_BYTES, acc)
    if model == "resnet18":
        blocks = resnet18_blocks(info.input_shape, sv, checkpointed, classes)
        return blocks, Loss(acc * classes + INDEX_BYTES, acc)
    if model in GPT_MODELS:
        shape = gpt_shape(info, gpt_layers, model)
        s = shape.pop("seq")
        loss = Loss(acc * s * classes + INDEX_BYTES * s, acc)
        return gpt_blocks(seq=s, **shape, sv=sv, checkpointed=checkpointed, moe=moe), loss
    return None


Action = tuple[str, int, int]  # a pipeline rank's unit of work: (kind, stage, micro-batch)


def one_stage_order(schedule: str, micro_batches: int, stages: int, stage: int) -> list[Action] | None:
    """The order of a one-stage-per-rank schedule's work on stage `stage` of `stages`, M micro-batches:
    GPipe every forward, then every backward (GPipe arXiv 1811.06965); 1F1B p − s forwards (at most M),
    then one backward and one forward in turn, then the last backwards (PipeDream-Flush, Megatron-LM
    arXiv 2104.04473 §2.2). The multi-stage schedules give their own order (`pipeline_order`)."""
    m = micro_batches
    if schedule == "gpipe":
        return [("F", stage, i) for i in range(m)] + [("B", stage, i) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(m, stages - stage)
        steady = [action for i in range(m - warmup) for action in (("B", stage, i), ("F", stage, warmup + i))]
        return (
            [("F", stage, i) for i in range(warmup)]
            + steady
            + [("B", stage, i) for i in range(m - warmup, m)]
        )
    return None


def megatron_layer_activation_bytes(
    s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False, recompute: str = "none"
) -> int | float:
    """Megatron-LM's activation memory of one transformer layer (Korthikanti et al., arXiv 2205.05198,
    §4 and Table 2): 16-bit activations and 1-byte dropout masks, sequence s, micro-batch b, hidden h, a
    heads, tensor-parallel size t. sbh·(10 + 24/t) (sequence parallel: 34/t: the layer norms' and
    dropouts' 10sbh split too) plus 5as²b/t for the attention scores, their softmax and dropout, which
    selective recomputation drops; full recomputation keeps the layer's input alone, 2sbh. With t = 1,
    no recomputation: 34sbh + 5as²b. Bytes, exact (a float only where t does not divide them).
    distref's gpt differs (no dropout, SDPA keeps no score matrix): `gpt_blocks`."""
    if recompute == "full":
        return 2 * s * b * h
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute is none, selective or full, not {recompute!r}")
    per_token = Fraction(34, t) if sequence_parallel else 10 + Fraction(24, t)
    total = s * b * h * per_token
    if recompute == "none":
        total += Fraction(5 * a * s * s * b, t)
    return int(total) if total.denominator == 1 else float(total)


def gpt_shape(info, gpt_layers: int, model: str = "gpt") -> dict:
    """seq, hidden, heads, layers, vocab of the gpt (or gpt2) distref.models builds for a dataset."""
    config = gpt_config(model, info, gpt_layers)
    return {
        "seq": config.block_size,
        "hidden": config.n_embd,
        "heads": config.n_head,
        "layers": config.n_layer,
        "vocab": config.vocab_size,
    }


MODELS_WITH_FORMULA = ("lenet", "resnet18", *GPT_MODELS)


def no_formula(model: str, precision: str = "fp32", device: str = "cpu") -> str | None:
    """Why `formula_for` has no formula for this model in this precision on this device (a line), or None."""
    if model not in MODELS_WITH_FORMULA:
        return (
            f"no activation formula for --model {model}: what autograd saves is counted op by op for "
            f"{', '.join(MODELS_WITH_FORMULA)} only"
        )
    if model == "resnet18" and device == "cuda" and precision != "bf16":
        # (torch's _select_batch_norm_backend sends a bf16 input to its native kernel, which keeps no such
        # buffer; fp32, fp64 and fp16 with fp32 weights go to cuDNN)
        return (
            f"no activation formula for resnet18 in {precision} on CUDA: cuDNN's batch norm saves a reserve "
            "buffer whose size cuDNN decides"
        )
    return None


def formula_for(
    model: str,
    info,
    gpt_layers: int,
    precision: str,
    checkpointed: bool,
    device: str = "cpu",
    parameters: str = "full",
    moe: MoEConfig | None = None,
) -> tuple[list[Block], Loss] | None:
    """(blocks, loss) of one of this project's models on a dataset (`info`: distref.data.DatasetInfo) in
    `precision` on `device` (`saving_for`), or None where there is no formula (`no_formula` says why).
    `moe`: gpt's mixture of experts (RunConfig.moe), every expert on this rank."""
    if no_formula(model, precision, device) is not None:
        return None
    attention = None
    if model in GPT_MODELS:  # (the kernel torch picks depends on the heads' size)
        shape = gpt_shape(info, gpt_layers, model)
        head_size, heads, seq = shape["hidden"] // shape["heads"], shape["heads"], shape["seq"]
        attention = sdpa_kernel(device, precision, head_size, heads, seq)
    return model_blocks(
        model, info, gpt_layers, saving_for(precision, device, parameters, attention), checkpointed, moe
    )


def predicted_for_run(
    cfg: RunConfig, info, replicas: int = 1, device: str = "cpu", parameters: str = "full"
) -> tuple[int | None, str | None]:
    """A rank running the whole model (single, DDP, FSDP, ZeRO) on its share of each micro-batch: the
    global batch split over `replicas` ranks and `--grad-accum` micro-steps, each forward in an autocast
    region of its own (its weights' casts let go with its backward), on `device` ("cpu" or "cuda") with
    its `parameters` (`saving_for`): (bytes, None), or (None, why there is no formula)."""
    why = no_formula(cfg.model, cfg.precision, device)
    found = formula_for(
        cfg.model,
        info,
        cfg.gpt_layers,
        cfg.precision,
        cfg.activation_checkpointing,
        device,
        parameters,
        cfg.moe,
    )
    micro_batch = cfg.global_batch_size // (replicas * cfg.grad_accum)
    return (stage_bytes(*found, micro_batch) if found else None), why


@dataclasses.dataclass(frozen=True)
class Held:
    """A stage's bytes saved for backward, per micro-batch: `tensor` names them (two stages on one rank
    that both save the same tensor name it alike: it counts once, until both let go), `until` is the
    backward pass that lets them go: "I" (the input gradient) or "W" (the weight gradient), both at a
    full backward "B". `shared`: the same tensor in every micro-batch (autocast's cast of a weight, cached
    for the step's autocast region): held while any micro-batch holds it."""

    tensor: str
    bytes: int
    until: str
    shared: bool = False


def held_in_order(actions: Sequence[Action], holdings: dict[int, list[Held]]) -> int:
    """The most activations a rank holds running its schedule's `actions` in order, each (kind, stage,
    micro-batch): a forward ("F") saves its stage's `holdings`, a full backward ("B") lets them go, a
    backward split in two (the zero-bubble schedules, arXiv 2401.10241: "I" the input gradient, later "W"
    the weight gradient) lets go at each of the holdings it frees. The peak comes at the end of a forward."""
    holders: dict[tuple[str, int], int] = {}  # (tensor, micro-batch) → how many stages hold it
    held = peak = 0
    for kind, stage, micro_batch in actions:
        if kind not in ("F", "B", "I", "W"):
            raise ValueError(f"unknown action {kind!r}: F, B, I or W")
        for item in holdings[stage]:
            key = (item.tensor, None if item.shared else micro_batch)
            if kind == "F":
                holders[key] = holders.get(key, 0) + 1
                held += item.bytes if holders[key] == 1 else 0
            elif kind == "B" or kind == item.until:
                holders[key] -= 1
                held -= item.bytes if holders[key] == 0 else 0
        peak = max(peak, held)
    return peak


def stage_holdings(
    blocks: list[Block],
    loss: Loss | None,
    micro_batch: int,
    stage: int,
    previous_here: bool,
    next_saves: int,
) -> list[Held]:
    """What pipeline stage `stage` (`blocks`, the `loss` if it is the last) saves per micro-batch, as
    torch.distributed.pipelining's split backward lets it go (`stage_backward_input`): the input-gradient
    pass keeps autograd's graph from each weighted op down, for the weight gradients, and lets go of what
    the ops after the stage's last weighted op saved (the last block's `after_weights`, and the loss). The
    first stage, whose input needs no gradient, does its whole backward in the weight-gradient pass.
    With the previous stage on this rank, the stage's input is the tensor that stage saved; with the next,
    `next_saves` (per sample) of what this one saved after its weights is that stage's input: torch passes
    it on without a copy."""
    let_go = "W" if stage == 0 else "I"
    received = micro_batch * blocks[0].input  # saved by the first block, kept for its weight gradient
    after_weights = micro_batch * blocks[-1].after_weights
    after_weights += micro_batch * loss.per_sample + loss.per_forward if loss is not None else 0
    weights = sum(b.weights for b in blocks)  # autocast's casts: one for the step's every micro-batch
    once = sum(b.once for b in blocks) + weights
    rest = stage_bytes(blocks, loss, micro_batch, shared_weights=True) - once - received - after_weights
    holdings = [
        Held(f"{stage - 1}->{stage}" if previous_here else f"input of {stage}", received, "W"),
        Held(f"kept by {stage}", rest, "W"),
        Held(f"after the weights of {stage}", after_weights, let_go),
    ]

    if next_saves:  # the next stage's input, as saved here (a part of `after_weights`)
        sent = micro_batch * next_saves
        holdings[-1] = dataclasses.replace(holdings[-1], bytes=after_weights - sent)
        holdings.append(Held(f"{stage}->{stage + 1}", sent, let_go))
    if weights:  # (saved by the weighted ops for the input gradient; their graph goes at "W")
        holdings.append(Held(f"weights of {stage}", weights, "W", shared=True))
    return holdings


def part_bytes(
    model: str,
    info,
    gpt_layers: int,
    bounds: list[tuple[int, int]],
    part: int,
    micro_batch: int,
    in_flight: int,
    precision: str,
    checkpointed: bool,
    device: str = "cpu",
) -> int | None:
    """A rank holding the blocks bounds[part] of the model's (a pipeline stage, a model-parallel part)
    with `in_flight` micro-batches of `micro_batch` samples held at once, each in an autocast region of
    its own; the loss if it holds the last."""
    found = formula_for(model, info, gpt_layers, precision, checkpointed, device)
    if found is None:
        return None
    blocks, loss = found
    first, last = bounds[part]
    return stage_bytes(blocks[first:last], loss if last == len(blocks) else None, micro_batch, in_flight)


def pipeline_rank(
    model: str,
    info,
    gpt_layers: int,
    bounds: list[tuple[int, int]],
    actions: Sequence[Action] | None,
    micro_batch: int,
    precision: str,
    checkpointed: bool,
    device: str = "cpu",
) -> int | None:
    """A pipeline rank of one of this project's models (`held_in_rank`), or None where there is no formula
    or the schedule's order is not known."""
    found = formula_for(model, info, gpt_layers, precision, checkpointed, device)
    if found is None or actions is None:
        return None
    return held_in_rank(*found, bounds, actions, micro_batch)


def pipeline_rank_activations(
    cfg: RunConfig,
    info,
    bounds: list[tuple[int, int]],
    actions: Sequence[Action] | None,
    micro_batch: int,
    schedule: str,
    device: str = "cpu",
) -> tuple[int | None, str | None]:
    """`pipeline_rank` for the run `cfg` (running `schedule`), and why there is no formula where it has
    none: (bytes, None) or (None, the reason)."""
    held = pipeline_rank(
        cfg.model,
        info,
        cfg.gpt_layers,
        bounds,
        actions,
        micro_batch,
        cfg.precision,
        cfg.activation_checkpointing,
        device,
    )
    why = no_formula(cfg.model, cfg.precision, device)
    if why is None and actions is None:
        why = f"no order of work known for --schedule {schedule}"
    return held, why


def held_in_rank(
    blocks: list[Block],
    loss: Loss,
    bounds: Sequence[tuple[int, int]],
    actions: Sequence[Action],
    micro_batch: int,
) -> int:
    """A pipeline rank running `actions` (its schedule's order: (kind, stage, micro-batch)) on its stages,
    the blocks bounds[stage] of the model's `blocks` each: the most micro-batches' activations it holds at
    once (`held_in_order`: autocast's weight casts, which the micro-batches share in the schedule's one
    autocast region, while any holds them), and once each stage's saved buffers."""
    mine = sorted({stage for _, stage, _ in actions})
    holdings, once = {}, 0
    for stage in mine:
        first, last = bounds[stage]
        next_saves = blocks[last].input if stage + 1 in mine else 0
        if next_saves > blocks[last - 1].after_weights:
            raise ValueError(f"block {last}'s input is not what block {last - 1}'s last ops saved")
        its_loss = loss if last == len(blocks) else None
        holdings[stage] = stage_holdings(
            blocks[first:last], its_loss, micro_batch, stage, stage - 1 in mine, next_saves
        )
        once += sum(block.once for block in blocks[first:last])
    return held_in_order(actions, holdings) + once
