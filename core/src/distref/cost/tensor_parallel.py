"""Communication and model states of tensor parallelism (impls/tensor_parallel: gpt split by
torch.distributed.tensor.parallel, optionally 2-D with FSDP2 over `dp_shard` groups).

Megatron-LM (Shoeybi et al., arXiv 1909.08053, §3 and Figure 4) splits each transformer layer over the T ranks
of a tensor-parallel group: q/k/v and the MLP's first linear by output rows (ColwiseParallel), the attention's
output projection and the MLP's second linear by input columns (RowwiseParallel). The partial products are
summed by one all-reduce after each RowwiseParallel layer in forward (the paper's g: two per layer) and the
input gradient of each column-split pair by one in backward (its f: two per layer), each of b·s·h elements
(micro-batch b, sequence s, hidden h). With sequence parallelism (Korthikanti et al., arXiv 2205.05198, §4.2.2
and Figure 5) the residual stream and the layer norms are split along the sequence: each all-reduce becomes
an all-gather before the column-split layer and a reduce-scatter after the row-split one, of the same b·s·h
elements unsharded (the record's bytes are the unsharded side), forward and backward alike.

What this impl adds around the layers (torch 2.13's DTensor does the communicating, so these are what it
issues, counted at the dispatcher):
  - the embeddings are split over their rows (RowwiseParallel on nn.Embedding): each rank looks up the ids
    it holds, zeros elsewhere, and an all-reduce sums the lookups in forward: b·s·h for the tokens, s·h for
    the positions (their output has no batch dimension). Nothing in backward: the output gradient is whole on
    every rank, each computing the whole table's gradient (so an embedding's gradient is the whole table).
  - with sequence parallelism the embedding's output is split along the sequence (no communication) and its
    gradient all-gathered in backward; the head's input, split along the sequence after its layer norm, is
    all-gathered in forward and its gradient reduce-scattered in backward. Without it the head's input
    gradient is all-reduced in backward (the output layer is split by rows, its input whole).
  - loss parallelism keeps the logits split over the vocabulary into the cross-entropy: three all-reduces of
    b·s elements (the max, the sum of exponentials, the target's logit; torch.distributed.tensor.parallel
    .loss's _log_softmax and nll_loss), none in backward — two on a rank that holds no column of the
    vocabulary (V ≤ ⌈V/T⌉·(T − 1): V = 1000, T = 512, ranks 500-511), where _log_softmax skips the max's
    (`if x.numel() == 0`; in a real run the other ranks would wait on it). Without it the logits are
    all-gathered: DTensor pads a rank's ⌈V/T⌉ columns (V = 11, T = 2: 12 columns), so b·s·⌈V/T⌉·T elements.
  - with sequence parallelism the layer norms' parameters are replicated but see 1/T of the tokens: their
    gradients are partial sums (DTensor's Partial). On a 1-D mesh the optimizer's arithmetic reduces them
    each time it reads one: AdamW three times per parameter on the CPU (foreach's exp_avg.lerp_(grad),
    exp_avg_sq.addcmul_(grad, grad)), once on CUDA (the fused kernel: distref.training.optim), SGD once
    (the momentum buffer is itself a partial sum, reduced when added to the parameter; with weight decay
    grad.add(param) reduces it instead). On the 2-D mesh FSDP2 reduces
    each once before its reduce-scatter. 2·(2L + 1) such parameters of h elements (ln1, ln2 per block,
    the head's ln).
  - FSDP2 over the D data-parallel groups (`--dp-shard D`) communicates as distref.cost.sharded.fsdp says,
    each rank's units being its tensor-parallel slices (embed, each block, head; every one resharded after
    forward), padded to a multiple of D on dim 0.
  - with activation checkpointing, backward recomputes each checkpointed block's forward, but only up to the
    last activation it saved for backward (torch.utils.checkpoint's non-reentrant early stop): the token
    embedding's all-reduce again (not the positions'), and per block the collectives before the MLP's
    output: with sequence parallelism both gathers and the attention's reduce-scatter, and the head's
    gather; without it the attention's all-reduce. FSDP2 gathers nothing more (its units are gathered for
    backward anyway).
  - on a mesh of T = 1, DTensor skips every redistribution; loss parallelism's three all-reduces, explicit
    calls, still run.

Per rank and optimizer step, for A micro-batches of b sequences, L blocks, E = b·s·h, w the bytes of a
parameter's element (the residual stream, layer norms and embeddings), c of a linear layer's output (2
under bf16 autocast, else w), and T > 1:

    without sequence parallelism
        all_reduce:     A·(2 + 4L + 1) calls: A·(E·w + s·h·w + 2L·E·c + (2L + 1)·E·w)
    with sequence parallelism
        all_reduce:     2A calls, A·(E + s·h)·w, and the layer norms' 2(2L + 1) gradients of h·w,
                        3 times each (AdamW) or once (SGD; FSDP2 on a 2-D mesh)
        all_gather:     A·(4L + 2) calls: A·((2L + 2)·E·w + 2L·E·c)
        reduce_scatter: A·(4L + 1) calls: A·((2L + 1)·E·w + 2L·E·c)
    loss parallelism:   all_reduce, 3A calls, 3A·b·s·w (2A, 2A·b·s·w on a rank holding no vocabulary column);
                        without it: all_gather, A calls, A·b·s·⌈V/T⌉·T·c
    checkpointed:       all_reduce, A more, A·E·w; and with sequence parallelism all_gather A(2L + 1) more,
                        A(2L + 1)·E·w, reduce_scatter AL more, AL·E·c; without it all_reduce AL more, AL·E·c

Model states: each parameter's slice (the tensor-parallel split, then FSDP2's over D, both torch.chunk's:
the last ranks may hold fewer rows), as `parameters_held` lists them. On a 1-D mesh the embeddings' gradients
are whole tables, and SGD's momentum buffer is a clone of the first gradient (whole tables too), except with
weight decay (grad + λ·param: the parameter's slice). On the 2-D mesh FSDP2 holds gradients as its shards.

What a rank predicts, all three formulas at once: `tensor_parallel_cost` (gpt, or a model of yours split by
its plan: `planned_cost`), called by impls/tensor_parallel/train.py and distref.simulate alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from distref.config import FUSED_ADAMW_DEVICES, GPT_MODELS, RunConfig, is_factory
from distref.cost import Predicted
from distref.cost.activations import no_formula, saving_for
from distref.cost.attention import sdpa_kernel
from distref.cost.counts import Counts, add, merge
from distref.cost.memory import optimizer_state_bytes, replicated
from distref.cost.sharded import fsdp, fsdp_model_states, rows_held
from distref.cost.tp_activations import tensor_parallel_activation_bytes
from distref.cost.usage import model_usage
from distref.data.tensors import DatasetInfo
from distref.models import GPTConfig, build_model, gpt_config, on_meta, parameter_dtype

Shape = tuple[int, ...]

# How apply_tp's plan splits each of gpt's parameters over the tensor-parallel group: "rows" (Shard(0):
# ColwiseParallel's weight and bias, an embedding's table, the output layer), "columns" (Shard(1):
# RowwiseParallel's weight), "whole" (replicated: layer norms, a RowwiseParallel layer's bias).
BLOCK_PARAMETERS = (
    ("ln1.weight", "whole"),
    ("ln1.bias", "whole"),
    ("attn.q.weight", "rows"),
    ("attn.q.bias", "rows"),
    ("attn.k.weight", "rows"),
    ("attn.v.weight", "rows"),
    ("attn.v.bias", "rows"),
    ("attn.proj.weight", "columns"),
    ("attn.proj.bias", "whole"),
    ("ln2.weight", "whole"),
    ("ln2.bias", "whole"),
    ("mlp.0.weight", "rows"),
    ("mlp.0.bias", "rows"),
    ("mlp.2.weight", "columns"),
    ("mlp.2.bias", "whole"),
)


def gpt_parameters(layers: int, hidden: int, vocabulary: int, sequence: int) -> list[tuple[str, Shape, str]]:
    """gpt's parameters (distref.models.gpt) in model.parameters() order: (name, shape, how TP splits it)."""
    h = hidden
    shapes = {
        "ln1.weight": (h,),
        "ln1.bias": (h,),
        "attn.q.weight": (h, h),
        "attn.q.bias": (h,),
        "attn.k.weight": (h, h),
        "attn.v.weight": (h, h),
        "attn.v.bias": (h,),
        "attn.proj.weight": (h, h),
        "attn.proj.bias": (h,),
        "ln2.weight": (h,),
        "ln2.bias": (h,),
        "mlp.0.weight": (4 * h, h),
        "mlp.0.bias": (4 * h,),
        "mlp.2.weight": (h, 4 * h),
        "mlp.2.bias": (h,),
    }
    params = [("embed.tok.weight", (vocabulary, h), "rows"), ("embed.pos.weight", (sequence, h), "rows")]
    for i in range(layers):
        params += [(f"block{i}.{name}", shapes[name], split) for name, split in BLOCK_PARAMETERS]
    params += [("head.ln.weight", (h,), "whole"), ("head.ln.bias", (h,), "whole")]
    return [*params, ("head.out.weight", (vocabulary, h), "rows")]


def tp_slice(shape: Shape, split: str, tp: int, tp_rank: int) -> Shape:
    """The shape of what tensor-parallel rank `tp_rank` of `tp` holds (DTensor's Shard: torch.chunk's
    split, ⌈n/T⌉ each, the last ranks fewer or none)."""
    if split == "whole":
        return shape
    dim = 0 if split == "rows" else 1
    return (*shape[:dim], rows_held(shape[dim], tp, tp_rank), *shape[dim + 1 :])


def parameters_held(
    layers: int, hidden: int, vocabulary: int, sequence: int, tp: int, tp_rank: int
) -> list[tuple[str, Shape]]:
    """Each parameter's tensor-parallel slice on rank `tp_rank`, in model.parameters() order."""
    return [
        (name, tp_slice(shape, split, tp, tp_rank))
        for name, shape, split in gpt_parameters(layers, hidden, vocabulary, sequence)
    ]


def fsdp_units(held: Sequence[tuple[str, Shape]], layers: int) -> list[list[Shape]]:
    """The fully_shard units of apply_fsdp (embed, block0..., head), each its parameters' slices."""
    units: dict[str, list[Shape]] = {
        unit: [] for unit in ("embed", *(f"block{i}" for i in range(layers)), "head")
    }
    for name, shape in held:  # (by the name's first part: one pass, not one per unit)
        if (unit := name.split(".", 1)[0]) in units:
            units[unit].append(shape)
    return list(units.values())


def tensor_parallel(
    *,
    layers: int,
    hidden: int,
    vocabulary: int,
    sequence: int,
    micro_batch: int,
    tp: int,
    sequence_parallel: bool,
    loss_parallel: bool,
    optimizer: str,
    grad_accum: int = 1,
    dp_shard: int = 1,
    tp_rank: int = 0,
    element_bytes: int = 4,
    compute_element_bytes: int | None = None,
    activation_checkpointing: bool = False,
    device: str = "cpu",
) -> Counts:
    """One optimizer step of impls/tensor_parallel on one rank (the module docstring's formula):
    `micro_batch` sequences per micro-step on each data-parallel group, `element_bytes` a parameter's,
    `compute_element_bytes` a linear layer's output's (2 under bf16 autocast; default: element_bytes),
    on `device` (AdamW is fused on FUSED_ADAMW_DEVICES, foreach elsewhere)."""
    b, s, h, L, A = micro_batch, sequence, hidden, layers, grad_accum
    w = element_bytes
    c = w if compute_element_bytes is None else compute_element_bytes
    E = b * s * h
    tp_part: Counts = {}
    if tp > 1:
        # the embeddings' sums of lookups (forward)
        add(tp_part, "all_reduce", A * (E + s * h) * w, tp, calls=2 * A)
        if sequence_parallel:
            # per block, forward: gather before attention and MLP (layer-norm outputs, w), scatter after
            # their row-split layers (c); backward the reverse; the head's input and the embedding's output
            add(tp_part, "all_gather", A * ((2 * L + 2) * E * w + 2 * L * E * c), tp, calls=A * (4 * L + 2))
            add(
                tp_part,
                "reduce_scatter",
                A * ((2 * L + 1) * E * w + 2 * L * E * c),
                tp,
                calls=A * (4 * L + 1),
            )
            # the layer norms' partial gradients, reduced by the optimizer's reads or by FSDP2, once
            partials = 2 * (2 * L + 1)
            fused = optimizer == "adamw" and device in FUSED_ADAMW_DEVICES
            reads = 1 if dp_shard > 1 or optimizer == "sgd" or fused else 3
            add(tp_part, "all_reduce", reads * partials * h * w, tp, calls=reads * partials)
        else:
            # per block two sums of partial products (forward, c) and two of input gradients (backward, w),
            # and the head's input gradient
            add(tp_part, "all_reduce", A * (2 * L * E * c + (2 * L + 1) * E * w), tp, calls=A * (4 * L + 1))
        if not loss_parallel:
            add(tp_part, "all_gather", A * b * s * -(-vocabulary // tp) * tp * c, tp, calls=A)
        if activation_checkpointing:
            # backward recomputes each block's forward only up to its last activation saved for backward
            # (non-reentrant checkpoint's early stop): the token embedding's sum, and in each block what
            # comes before the MLP's output (sequence parallel: both gathers and the attention's scatter,
            # and the head's gather; else the attention's all-reduce)
            add(tp_part, "all_reduce", A * E * w, tp, calls=A)
            if sequence_parallel:
                add(tp_part, "all_gather", A * (2 * L + 1) * E * w, tp, calls=A * (2 * L + 1))
                add(tp_part, "reduce_scatter", A * L * E * c, tp, calls=A * L)
            else:
                add(tp_part, "all_reduce", A * L * E * c, tp, calls=A * L)
    if loss_parallel:
        reductions = 3 if rows_held(vocabulary, tp, tp_rank) else 2  # (no column: no max to reduce)
        add(tp_part, "all_reduce", reductions * A * b * s * w, tp, calls=reductions * A)
    if dp_shard == 1:
        return tp_part
    held = parameters_held(L, h, vocabulary, s, tp, tp_rank)
    units = fsdp_units(held, L)
    sharded = fsdp(
        units,
        [True] * len(units),
        dp_shard,
        gather_element_bytes=w,
        reduce_element_bytes=w,
        grad_accum=A,
    )
    return merge(tp_part, sharded)


def tensor_parallel_model_states(
    *,
    layers: int,
    hidden: int,
    vocabulary: int,
    sequence: int,
    tp: int,
    tp_rank: int,
    optimizer: str,
    weight_decay: float = 0.0,
    dp_shard: int = 1,
    dp_rank: int = 0,
    element_bytes: int = 4,
    step_bytes: int = 4,
) -> dict[str, int]:
    """Model-state bytes on the rank (`dp_rank`, `tp_rank`) of the (dp_shard, tp) mesh."""
    held = parameters_held(layers, hidden, vocabulary, sequence, tp, tp_rank)
    shapes = [shape for _, shape in held]
    if dp_shard > 1:
        return fsdp_model_states(shapes, dp_shard, dp_rank, element_bytes, optimizer, step_bytes)
    whole = dict((name, shape) for name, shape, _ in gpt_parameters(layers, hidden, vocabulary, sequence))
    parameter_bytes = [math.prod(shape) * element_bytes for shape in shapes]
    # an embedding's gradient: the whole table on every rank (its output gradient is whole)
    gradient_bytes = [
        math.prod(whole[name] if name.startswith("embed.") and tp > 1 else shape) * element_bytes
        for name, shape in held
    ]
    if optimizer == "sgd":  # the momentum buffer: the first step's gradient (+ λ·param: the slice's shape)
        state = sum(parameter_bytes if weight_decay else gradient_bytes)
    else:
        state = optimizer_state_bytes(parameter_bytes, optimizer, step_bytes)
    return {"parameters": sum(parameter_bytes), "gradients": sum(gradient_bytes), "optimizer": state}


# How a plan's style splits a linear layer's parameters (torch's ColwiseParallel: weight and bias by
# output rows; RowwiseParallel: weight by input columns, bias whole)
PLAN_SPLITS = {("colwise", "weight"): "rows", ("colwise", "bias"): "rows", ("rowwise", "weight"): "columns"}


def planned_split(plan: dict[str, str], parameter_name: str) -> str:
    """How a model of yours split by `plan` ({linear layer's name: "colwise" | "rowwise"}) splits one
    parameter: "rows", "columns" or "whole" (a parameter outside the plan's layers)."""
    module, _, kind = parameter_name.rpartition(".")
    return PLAN_SPLITS.get((plan.get(module, ""), kind), "whole")


def planned_model_states(
    parameters: Sequence[tuple[Shape, str]],
    tp: int,
    tp_rank: int,
    optimizer: str,
    *,
    element_bytes: int = 4,
    step_bytes: int = 4,
    trained: Sequence[bool] | None = None,
) -> dict[str, int]:
    """Model-state bytes on tensor-parallel rank `tp_rank` of a model of yours split by its plan, on a 1-D
    mesh: each parameter's (shape, `planned_split`) slice, and for those that receive a gradient
    (`trained`, default all) a gradient of the slice's size and the optimizer's state for it."""
    held = [math.prod(tp_slice(shape, split, tp, tp_rank)) * element_bytes for shape, split in parameters]
    return replicated(held, optimizer, step_bytes, trained)  # (the same sums, over what this rank holds)


def tensor_parallel_cost(
    model: str,
    info: DatasetInfo,
    *,
    layers: int,
    tp: int,
    tp_rank: int,
    dp_shard: int,
    dp_rank: int,
    micro_batch: int,
    grad_accum: int,
    sequence_parallel: bool,
    loss_parallel: bool,
    optimizer: str,
    weight_decay: float,
    precision: str,
    element_bytes: int,
    step_bytes: int,
    activation_checkpointing: bool,
    hidden: int = GPTConfig.n_embd,
    heads: int = GPTConfig.n_head,
    device: str = "cpu",
) -> Predicted:
    """What rank (`dp_rank`, `tp_rank`) of impls/tensor_parallel's (dp_shard, tp) mesh costs by formula,
    on `micro_batch` sequences per micro-step on each data-parallel group. `model` "gpt": `layers` blocks
    of `hidden` units and `heads` heads, its vocabulary and sequence the data's (`info`); per block two
    all-reduces forward and two backward of b·s·h (sequence parallel: all-gathers and reduce-scatters
    instead), the embeddings' and the loss's, FSDP2's over the dp_shard groups (`tensor_parallel`); this
    rank's slices of every parameter, gradient and optimizer state (`tensor_parallel_model_states`); the
    activations it holds, its heads and MLP units, on `device` (distref.cost.tp_activations; on a 1-D
    mesh only). A model of yours (MODULE:FUNCTION): `planned_cost`. `element_bytes`: a parameter's
    (--precision fp64: 8, else 4); `step_bytes`: AdamW's step count's (torch's default dtype)."""
    if is_factory(model):
        return planned_cost(
            model,
            info,
            tp=tp,
            tp_rank=tp_rank,
            dp_shard=dp_shard,
            optimizer=optimizer,
            precision=precision,
            element_bytes=element_bytes,
            step_bytes=step_bytes,
        )
    vocabulary, sequence = info.num_classes, info.input_shape[0]
    shape = dict(layers=layers, hidden=hidden, vocabulary=vocabulary, sequence=sequence)
    shape.update(tp=tp, dp_shard=dp_shard, tp_rank=tp_rank)
    communication = tensor_parallel(
        **shape,
        micro_batch=micro_batch,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        optimizer=optimizer,
        grad_accum=grad_accum,
        element_bytes=element_bytes,
        compute_element_bytes=2 if precision == "bf16" else element_bytes,  # the linear layers' outputs
        activation_checkpointing=activation_checkpointing,
        device=device,
    )
    model_states = tensor_parallel_model_states(
        **shape,
        dp_rank=dp_rank,
        optimizer=optimizer,
        weight_decay=weight_decay,
        element_bytes=element_bytes,
        step_bytes=step_bytes,
    )
    activations = None  # (FSDP2's gathered slices on the 2-D mesh: no formula yet)
    no_activation_formula = no_formula(model, precision, device) or (
        f"no activation formula on the 2-D mesh (--dp-shard {dp_shard}: FSDP2's gathered slices)"
    )
    if dp_shard == 1:
        activations = tensor_parallel_activation_bytes(
            micro_batch=micro_batch,
            seq=sequence,
            hidden=hidden,
            heads=heads,
            layers=layers,
            vocab=vocabulary,
            tp=tp,
            tp_rank=tp_rank,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            checkpointed=activation_checkpointing,
            saving=saving_for(
                precision,
                device,
                attention=sdpa_kernel(device, precision, hidden // heads, heads // tp, sequence),
            ),
        )
    return Predicted(
        communication=communication,
        model_states=model_states,
        activations=activations,
        unavailable={"activations": no_activation_formula},
    )


def planned_cost(
    model: str,
    info: DatasetInfo,
    *,
    tp: int,
    tp_rank: int,
    dp_shard: int,
    optimizer: str,
    precision: str,
    element_bytes: int,
    step_bytes: int,
) -> Predicted:
    """What tensor-parallel rank `tp_rank` costs by formula training a model of yours (`model`:
    MODULE:FUNCTION, on data of `info`) split by its tp_plan, on a 1-D mesh: this rank's slice of each
    parameter (its plan's: colwise by rows, rowwise by columns, the rest whole) and, for those that
    receive a gradient, of the gradient and optimizer state (`planned_model_states`). Its communication
    and activations have no formula: what its plan's layers gather and reduce depends on what surrounds
    them."""
    usage = model_usage(model, info, gpt_layers=2)  # which parameters train: a forward on meta
    model_states = None
    if not usage.unknown and dp_shard == 1:
        whole = on_meta(lambda: build_model(model, info))  # (its names and shapes)
        named = list(whole.named_parameters())
        model_states = planned_model_states(
            [(p.shape, planned_split(whole.tp_plan, name)) for name, p in named],
            tp,
            tp_rank,
            optimizer,
            element_bytes=element_bytes,
            step_bytes=step_bytes,
            trained=usage.trained_flags(named),
        )
    return Predicted(
        model_states=model_states,
        unavailable={
            "communication": f"no communication formula for --model {model}: what its tp_plan's layers "
            "gather and reduce depends on the layers around them",
            "model_states": usage.unknown or f"no model-state formula for {model} on the 2-D mesh",
            "activations": no_formula(model, precision),
        },
    )


def tensor_parallel_run_cost(
    cfg: RunConfig,
    info: DatasetInfo,
    *,
    tp: int,
    tp_rank: int,
    dp_shard: int,
    dp_rank: int,
    sequence_parallel: bool,
    loss_parallel: bool,
    device: str = "cpu",
) -> Predicted:
    """`tensor_parallel_cost` of rank (`dp_rank`, `tp_rank`) in the run `cfg` (its core options: the model,
    batch, micro-steps, optimizer, precision), each data-parallel group on its share of the global batch,
    on `device` ("cpu" or "cuda")."""
    shape = gpt_config(cfg.model, info, cfg.gpt_layers) if cfg.model in GPT_MODELS else None
    return tensor_parallel_cost(
        cfg.model,
        info,
        layers=shape.n_layer if shape else cfg.gpt_layers,
        tp=tp,
        tp_rank=tp_rank,
        dp_shard=dp_shard,
        dp_rank=dp_rank,
        micro_batch=cfg.global_batch_size // (dp_shard * cfg.grad_accum),
        grad_accum=cfg.grad_accum,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        optimizer=cfg.optimizer,
        weight_decay=cfg.weight_decay,
        precision=cfg.precision,
        element_bytes=parameter_dtype(cfg.precision).itemsize,
        step_bytes=torch.get_default_dtype().itemsize,
        activation_checkpointing=cfg.activation_checkpointing,
        device=device,
        **({"hidden": shape.n_embd, "heads": shape.n_head} if shape else {}),
    )
