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
Mixed precision (autocast keeps some inputs in bf16, some in fp32) has no formula yet: the functions
return None.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from fractions import Fraction

from distref.config import RunConfig
from distref.models import GPTConfig

INDEX_BYTES = 8  # int64 indices, token ids and targets


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


def lenet_blocks(e: int, checkpointed: bool) -> list[Block]:
    inputs = [e * 784, e * 10 * 12 * 12, e * 20 * 4 * 4, e * 50]  # the image; each ReLU's output
    if checkpointed:  # each block keeps its input alone: its own, the previous block keeps nothing
        return [Block(0, inputs[i]) for i in range(4)]
    conv1 = e * 10 * 24 * 24 + INDEX_BYTES * 10 * 12 * 12 + inputs[1]  # max-pool's and ReLU's: after the conv
    conv2 = e * 20 * 8 * 8 + INDEX_BYTES * 20 * 4 * 4 + inputs[2]
    return [
        Block(inputs[0], conv1, after_weights=conv1),
        Block(inputs[1], conv2, after_weights=conv2),
        Block(inputs[2], inputs[3], after_weights=inputs[3]),  # ReLU's output
        Block(inputs[3], 0),
    ]


def _halved(size: int) -> int:
    """A 3×3 convolution of stride 2 and padding 1 (or a 1×1 of stride 2): ⌈size/2⌉."""
    return (size + 1) // 2


def resnet18_blocks(input_shape: tuple[int, int, int], e: int, checkpointed: bool) -> list[Block]:
    """distref.models.resnet18 (torchvision's BasicBlocks, a 3×3 stem, no max-pool): stem, layer1-4,
    head. Per sample, each BatchNorm saves its input (the convolution's output), each in-place ReLU its
    output (the next convolution's input: the same elements); a downsampling block's 1×1 convolution saves
    the block's input (already counted) and its BatchNorm that convolution's output. Per forward each
    BatchNorm saves its batch mean and inverse std (2C), and once its running mean and variance (2C)."""
    channels, height, width = input_shape
    inputs, blocks = [e * channels * height * width], []
    stem_out = 64 * height * width
    statistics = e * 2 * 64  # its BatchNorm's: batch mean and inverse std; running mean and variance
    # (after_weights: the in-place ReLU after the last BatchNorm, of the stem and of each layer)
    blocks.append(Block(inputs[0], e * 2 * stem_out, statistics, statistics, after_weights=e * stem_out))
    inputs.append(e * stem_out)
    in_channels = 64
    for out_channels, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        own = per_forward = 0
        for first in (True, False):  # two BasicBlocks per layer
            if first and stride == 2:
                height, width = _halved(height), _halved(width)
            pixels = out_channels * height * width
            downsample = first and (stride != 1 or in_channels != out_channels)
            batch_norms = 3 if downsample else 2
            # bn1's input, relu's output (conv2's input), bn2's input, the final relu's output; the
            # downsample's BatchNorm input
            own += e * pixels * (4 + (1 if downsample else 0))
            per_forward += e * 2 * out_channels * batch_norms
            in_channels = out_channels
        inputs.append(e * out_channels * height * width)
        blocks.append(
            Block(inputs[-2], own, per_forward=per_forward, once=per_forward, after_weights=inputs[-1])
        )
    # The average pool (a mean over H×W: MeanBackward) saves nothing of its input; the Linear saves its input
    blocks.append(Block(0, e * 512))
    if checkpointed:  # each block keeps its input alone
        return [Block(0, size) for size in inputs]
    return blocks


def gpt_blocks(seq: int, hidden: int, heads: int, layers: int, e: int, checkpointed: bool) -> list[Block]:
    s, h = seq, hidden
    if checkpointed:  # each block keeps its input alone
        return [Block(0, INDEX_BYTES * s)] + [Block(0, e * s * h)] * (layers + 1)
    embed = Block(INDEX_BYTES * s, 0, per_forward=INDEX_BYTES * s)
    block = Block(0, e * (16 * s * h + 4 * s + heads * s))  # (its input: LayerNorm's, in `own`)
    return [embed, *[block] * layers, Block(0, e * (2 * s * h + 2 * s))]


@dataclasses.dataclass(frozen=True)
class Loss:
    per_sample: int  # log-softmax's output and the target
    per_forward: int  # nll_loss's total weight


def stage_bytes(blocks: list[Block], loss: Loss | None, micro_batch: int, in_flight: int = 1) -> int:
    """The activations a stage of `blocks` (the whole model: every block) holds with `in_flight`
    micro-batches of `micro_batch` samples, `loss` on the stage that computes it: per micro-batch the
    first block's input, every block's own bytes and the loss; once, the buffers saved."""
    per_sample = blocks[0].input + sum(block.own for block in blocks)
    per_forward = sum(block.per_forward for block in blocks)
    if loss is not None:
        per_sample, per_forward = per_sample + loss.per_sample, per_forward + loss.per_forward
    return in_flight * (micro_batch * per_sample + per_forward) + sum(block.once for block in blocks)


def model_blocks(
    model: str, info, gpt_layers: int, e: int, checkpointed: bool
) -> tuple[list[Block], Loss] | None:
    """(blocks, loss) of one of this project's models on a dataset (`info`: distref.data.DatasetInfo)."""
    classes = info.num_classes
    if model == "lenet":
        return lenet_blocks(e, checkpointed), Loss(e * classes + INDEX_BYTES, e)
    if model == "resnet18":
        return resnet18_blocks(info.input_shape, e, checkpointed), Loss(e * classes + INDEX_BYTES, e)
    if model == "gpt":
        shape = gpt_shape(info, gpt_layers)
        s = shape.pop("seq")
        shape.pop("vocab")
        loss = Loss(e * s * classes + INDEX_BYTES * s, e)
        return gpt_blocks(seq=s, **shape, e=e, checkpointed=checkpointed), loss
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


def gpt_shape(info, gpt_layers: int) -> dict:
    """seq, hidden, heads, layers, vocab of the gpt distref.models builds for a dataset."""
    config = GPTConfig(vocab_size=info.num_classes, block_size=info.input_shape[0], n_layer=gpt_layers)
    return {
        "seq": config.block_size,
        "hidden": config.n_embd,
        "heads": config.n_head,
        "layers": config.n_layer,
        "vocab": config.vocab_size,
    }


ELEMENT_BYTES = {"fp32": 4, "fp64": 8}  # precisions with a formula (autocast: none yet)
MODELS_WITH_FORMULA = ("lenet", "resnet18", "gpt")


def no_formula(model: str, precision: str) -> str | None:
    """Why `formula_for` has no formula for this model in this precision (a line), or None."""
    if model not in MODELS_WITH_FORMULA:
        return (
            f"no activation formula for --model {model}: what autograd saves is counted op by op for "
            f"{', '.join(MODELS_WITH_FORMULA)} only"
        )
    if precision not in ELEMENT_BYTES:
        return (
            f"no activation formula under --precision {precision}: autocast saves some tensors in 16 bits, "
            "some in fp32"
        )
    return None


def formula_for(model: str, info, gpt_layers: int, precision: str, checkpointed: bool):
    """(blocks, loss) of one of this project's models on a dataset (`info`: distref.data.DatasetInfo), or
    None where there is no formula (`no_formula` says why)."""
    if no_formula(model, precision) is not None:
        return None
    return model_blocks(model, info, gpt_layers, ELEMENT_BYTES[precision], checkpointed)


def predicted_for_run(cfg: RunConfig, info, replicas: int = 1) -> int | None:
    """A rank running the whole model (single, DDP, FSDP, ZeRO) on its share of each micro-batch: the
    global batch split over `replicas` ranks and `--grad-accum` micro-steps."""
    found = formula_for(cfg.model, info, cfg.gpt_layers, cfg.precision, cfg.activation_checkpointing)
    micro_batch = cfg.global_batch_size // (replicas * cfg.grad_accum)
    return stage_bytes(*found, micro_batch) if found else None


@dataclasses.dataclass(frozen=True)
class Held:
    """A stage's bytes saved for backward, per micro-batch: `tensor` names them (two stages on one rank
    that both save the same tensor name it alike: it counts once, until both let go), `until` is the
    backward pass that lets them go: "I" (the input gradient) or "W" (the weight gradient), both at a
    full backward "B"."""

    tensor: str
    bytes: int
    until: str


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
            key = (item.tensor, micro_batch)
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
    rest = stage_bytes(blocks, loss, micro_batch) - sum(b.once for b in blocks) - received - after_weights
    holdings = [
        Held(f"{stage - 1}->{stage}" if previous_here else f"input of {stage}", received, "W"),
        Held(f"kept by {stage}", rest, "W"),
        Held(f"after the weights of {stage}", after_weights, let_go),
    ]
    if next_saves:  # the next stage's input, as saved here (a part of `after_weights`)
        sent = micro_batch * next_saves
        holdings[-1] = dataclasses.replace(holdings[-1], bytes=after_weights - sent)
        holdings.append(Held(f"{stage}->{stage + 1}", sent, let_go))
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
) -> int | None:
    """A rank holding the blocks bounds[part] of the model's (a pipeline stage, a model-parallel part)
    with `in_flight` micro-batches of `micro_batch` samples held at once; the loss if it holds the last."""
    found = formula_for(model, info, gpt_layers, precision, checkpointed)
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
) -> int | None:
    """A pipeline rank of one of this project's models (`held_in_rank`), or None where there is no formula
    or the schedule's order is not known."""
    found = formula_for(model, info, gpt_layers, precision, checkpointed)
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
    )
    why = no_formula(cfg.model, cfg.precision)
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
    once (`held_in_order`), and once each stage's saved buffers."""
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
