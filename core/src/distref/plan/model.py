"""The model a plan is for: decoder presets (in distref's gpt layout), this project's models, any nn.Module
given as module:function (built on the meta device), or a bare parameter count."""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Sequence

import torch

from distref.cli import torchvision_problem
from distref.config import GPT_MODELS, MoEConfig, is_factory
from distref.cost import activations as act
from distref.cost.expert_parallel import is_expert_parameter
from distref.cost.tensor_parallel import gpt_parameters
from distref.data import DatasetInfo
from distref.distributed.partition import MODEL_DATASETS as PROJECT_DATASETS
from distref.models import build_model
from distref.simulate import PRESETS, GPTShape


class PlanError(ValueError):
    """Bad input: said in one line, exit 2."""


# Decoder presets in distref's gpt layout (pre-LN, GELU MLP of 4h, biases, learned positions, an untied
# output layer): GPT-3's 125M and 1.3B shapes (arXiv 2005.14165, Table 2.1), Llama's 7B, 13B and 70B widths
# and depths (arXiv 2302.13971 Table 2; 2307.09288) and Llama 3's 8B with its vocabulary and 8,192 tokens
# (arXiv 2407.21783) — in this layout 7B is 6.7B parameters, 8B 7.5B, 13B 12.9B and 70B 65.0B (Llama's
# SwiGLU and grouped-query attention are not modelled).
MODELS = {
    "125m": GPTShape(layers=12, hidden=768, heads=12, vocab=50257, seq=2048),
    "1.3b": PRESETS["gpt-1.3b"],
    "7b": PRESETS["gpt-7b"],
    "8b": GPTShape(layers=32, hidden=4096, heads=32, vocab=128256, seq=8192),  # Llama 3's sizes: 7.5B here
    "13b": GPTShape(layers=40, hidden=5120, heads=40, vocab=32000, seq=4096),
    "70b": GPTShape(layers=80, hidden=8192, heads=64, vocab=32000, seq=4096),
    # Mixtures of experts (impls/expert_parallel alone trains them: only its rows are planned), each block's
    # MLP E experts of their published width, GELU MLPs in this layout (SwiGLU's third matrix and grouped-
    # query attention not modelled), at 4,096 positions. Mixtral 8x7B: 32 × 4096, 32 heads, 8 experts
    # 14,336 wide, top-2, 32,000 tokens (arXiv 2401.04088, Table 1; its 32K context: --seq 32768): 32.5B
    # parameters here, Mixtral's 46.7B. OLMoE-1B-7B: 16 × 2048, 16 heads, 64 experts 1,024 wide, top-8,
    # 50,304 tokens, 4,096 positions (arXiv 2409.02060; allenai/OLMoE-1B-7B-0924's config.json): 4.8B here,
    # OLMoE's 6.9B.
    "mixtral-8x7b": GPTShape(
        layers=32, hidden=4096, heads=32, vocab=32000, seq=4096, experts=8, top_k=2, expert_hidden=14336
    ),
    "olmoe-1b-7b": GPTShape(
        layers=16, hidden=2048, heads=16, vocab=50304, seq=4096, experts=64, top_k=8, expert_hidden=1024
    ),
}


@dataclasses.dataclass(frozen=True)
class Model:
    """What the planner knows of a model: its parameter shapes (model.parameters() order), its blocks (a
    pipeline cuts between them: each block's parameter count), the gpt shape where it is a decoder (tensor
    parallelism and the decoder formulas need it), FLOPs of one sample's forward and backward, what one
    sample is in tokens, the activation formula `formula(saving, checkpointed)` → (blocks, loss)
    of distref.cost.activations (None where there is none), each block's output per sample (what a
    pipeline sends between stages: elements, and bytes under bf16 autocast, which leaves some outputs in
    fp32), and its buffers (BatchNorm's statistics: what DDP broadcasts)."""

    name: str
    shapes: list[tuple[int, ...]]
    block_parameters: list[int]
    gpt: GPTShape | None = None
    flops_per_sample: float | None = None
    tokens_per_sample: int = 1
    formula: Callable[[act.Saving, bool], tuple[list[act.Block], act.Loss]] | None = None
    block_outputs: list[int] | None = None  # elements of each block's output, per sample
    block_flops: list[float] | None = None  # each block's forward and backward FLOPs, per sample
    autocast_output_bytes: list[int] | None = None  # each block's output per sample under bf16 autocast
    buffers: tuple[tuple[int, torch.dtype, int], ...] = ()  # (block, dtype, elements), module.buffers() order
    # each parameter's name (model.named_parameters()) where the plan costs by name: a mixture of experts'
    parameter_names: tuple[str, ...] | None = None

    @property
    def parameters(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)

    def buffer_bytes(self, element_bytes: int, blocks: Sequence[int] | None = None) -> list[tuple[str, int]]:
        """(dtype, bytes) of each buffer (of `blocks` only, where given): floating ones in the training's
        element size, as the impls convert them with the parameters; integer counters as they are."""
        return [
            (str(dtype), numel * (element_bytes if dtype.is_floating_point else dtype.itemsize))
            for block, dtype, numel in self.buffers
            if blocks is None or block in blocks
        ]


# Samples in the forwards that count FLOPs and outputs (their counts are then per sample): BatchNorm in
# training mode refuses a batch of one
SAMPLES = 2


def sample_input(sample_shape: Sequence[int], tokens: bool) -> torch.Tensor:
    """SAMPLES zero inputs (token ids, or floats) on the current device."""
    return torch.zeros(SAMPLES, *sample_shape, dtype=torch.long if tokens else torch.float32)


def decoder(name: str, shape: GPTShape) -> Model:
    """A gpt of `shape`: its parameters, blocks, FLOPs (PaLM's formula) and activation formula."""
    if shape.experts:
        return mixture_of_experts(name, shape)
    params = gpt_parameters(shape.layers, shape.hidden, shape.vocab, shape.seq)
    shapes = [s for _, s, _ in params]
    per_block = [sum(math.prod(s) for n, s, _ in params if n.startswith(p)) for p in block_prefixes(shape)]
    # PaLM's model FLOPs per token (arXiv 2204.02311, App. B): 6 per matmul weight (forward 2, backward 4)
    # plus attention's 12·L·h·s; the embeddings' lookups are no matmuls.
    matmul_weights = shape.parameters() - (shape.vocab + shape.seq) * shape.hidden
    per_token = 6 * matmul_weights + 12 * shape.layers * shape.hidden * shape.seq

    def formula(saving: act.Saving, checkpointed: bool):
        blocks = act.gpt_blocks(
            shape.seq, shape.hidden, shape.heads, shape.layers, shape.vocab, saving, checkpointed
        )
        s, acc = shape.seq, saving.accumulate
        return blocks, act.Loss(acc * s * shape.vocab + act.INDEX_BYTES * s, acc)

    outputs = [shape.seq * shape.hidden] * (shape.layers + 1) + [shape.seq * shape.vocab]
    # per block: 6 per matmul weight and token, and each transformer block's attention, 12·h·s per token
    attention = 12 * shape.hidden * shape.seq
    flops = (
        [0.0] + [(6 * n + attention) * shape.seq for n in per_block[1:-1]] + [6.0 * per_block[-1] * shape.seq]
    )
    return Model(name, shapes, per_block, shape, per_token * shape.seq, shape.seq, formula, outputs, flops)


def decoder_parameters(shape: GPTShape) -> list[tuple[str, tuple[int, ...]]]:
    """gpt's (name, shape) of each parameter in model.named_parameters() order; with experts, each block's
    MLP a router and E stacked experts (distref.models.MoE: router, w1, b1, w2, b2)."""
    dense = [(name, s) for name, s, _ in gpt_parameters(shape.layers, shape.hidden, shape.vocab, shape.seq)]
    if not shape.experts:
        return dense
    h, e, f = shape.hidden, shape.experts, shape.expert_width
    moe = [("router.weight", (e, h)), ("experts.w1", (e, h, f)), ("experts.b1", (e, f))]
    moe += [("experts.w2", (e, f, h)), ("experts.b2", (e, h))]
    named = []
    for name, s in dense:
        block, _, rest = name.partition(".")
        if rest == "mlp.0.weight":  # (the MLP's first tensor: the router and experts in the MLP's place)
            named += [(f"{block}.mlp.{part}", part_shape) for part, part_shape in moe]
        elif not rest.startswith("mlp."):
            named.append((name, s))
    return named


def mixture_of_experts(name: str, shape: GPTShape) -> Model:
    """A gpt of `shape` whose blocks' MLPs are mixtures of experts: its parameters by name, its blocks, and
    PaLM's FLOPs over the weights each token meets (the router, k of the E experts, the rest: 6 per weight
    and token, and attention's 12·L·h·s). No activation formula (distref.cost.activations has none for a
    mixture of experts yet)."""
    named = decoder_parameters(shape)
    shapes = [s for _, s in named]
    per_block = [sum(math.prod(s) for n, s in named if n.startswith(p)) for p in block_prefixes(shape)]
    experts = sum(math.prod(s) for n, s in named if is_expert_parameter(n))
    active = sum(map(math.prod, shapes)) - experts + experts // shape.experts * shape.top_k
    per_token = (
        6 * (active - (shape.vocab + shape.seq) * shape.hidden) + 12 * shape.layers * shape.hidden * shape.seq
    )
    outputs = [shape.seq * shape.hidden] * (shape.layers + 1) + [shape.seq * shape.vocab]
    return Model(
        name,
        shapes,
        per_block,
        shape,
        per_token * shape.seq,
        shape.seq,
        block_outputs=outputs,
        parameter_names=tuple(n for n, _ in named),
    )


def block_prefixes(shape: GPTShape) -> list[str]:
    """The parameter-name prefix of each block: embed, block0…, head."""
    return ["embed.", *(f"block{i}." for i in range(shape.layers)), "head."]


def flops_measured(module: torch.nn.Module, sample_shape: Sequence[int], tokens: bool) -> float:
    """One sample's forward and backward FLOPs, counted by torch's FlopCounterMode on the meta device."""
    return sum(flops_by_block(module, sample_shape, tokens))


def flops_by_block(module: torch.nn.Module, sample_shape: Sequence[int], tokens: bool) -> list[float]:
    """One sample's forward and backward FLOPs of each of an nn.Sequential's blocks (of anything else: one
    figure), counted by torch's FlopCounterMode on the meta device."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        x = sample_input(sample_shape, tokens)
    with FlopCounterMode(display=False) as counter:
        out = module(x)
        out.float().sum().backward()
    if not isinstance(module, torch.nn.Sequential):
        return [counter.get_total_flops() / SAMPLES]
    counts, root = counter.get_flop_counts(), type(module).__name__
    return [sum(counts.get(f"{root}.{name}", {}).values()) / SAMPLES for name, _ in module.named_children()]


def autocast_output_bytes(
    module: torch.nn.Module, sample_shape: Sequence[int], tokens: bool
) -> list[int] | None:
    """Bytes of each block's output for one sample under bf16 autocast (the dtype autocast leaves each
    output in: a linear layer's bf16, an embedding's or a residual sum's fp32), from a forward on fake
    tensors, as impls/pipeline measures what its stages send; None where the model is no sequence of
    blocks."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    if not isinstance(module, torch.nn.Sequential):
        return None
    sizes = []
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True) as fake, torch.no_grad(), autocast:
        x = sample_input(sample_shape, tokens)
        for block in module:
            held = [*block.named_parameters(), *block.named_buffers()]
            x = functional_call(block, {name: fake.from_tensor(t).to("cpu") for name, t in held}, (x,))
            sizes.append(x.numel() * x.element_size() // SAMPLES)
    return sizes


def module_buffers(module: torch.nn.Module) -> tuple[tuple[int, torch.dtype, int], ...]:
    """(block, dtype, elements) of each buffer in module.buffers() order; the block is the index of the
    child holding it (a sequence of blocks), 0 for a model of one block."""
    block_of = {
        id(buffer): index
        for index, child in enumerate(module.children() if isinstance(module, torch.nn.Sequential) else ())
        for buffer in child.buffers()
    }
    return tuple((block_of.get(id(b), 0), b.dtype, b.numel()) for b in module.buffers())


def block_outputs(module: torch.nn.Module, sample_shape: Sequence[int], tokens: bool) -> list[int] | None:
    """Elements of each block's output for one sample (a forward on the meta device), where the model is
    a sequence of blocks (nn.Sequential: what a pipeline cuts); None otherwise."""
    if not isinstance(module, torch.nn.Sequential):
        return None
    with torch.device("meta"), torch.no_grad():
        x = sample_input(sample_shape, tokens)
        sizes = []
        for block in module:
            x = block(x)
            sizes.append(x.numel() // SAMPLES)
    return sizes


def project_model(
    name: str, info: DatasetInfo | None = None, gpt_layers: int = 2, moe: MoEConfig | None = None
) -> Model:
    """lenet, resnet18 or gpt (`gpt_layers` transformer blocks; `moe`: its MLPs mixtures of experts) as
    distref.models builds it for a dataset (`info`; by default the model's usual one): its classes, input
    shape and vocabulary are the model's."""
    info = info or PROJECT_DATASETS[name]
    if name == "resnet18" and (why := torchvision_problem()):  # (it was an import's traceback)
        raise PlanError(
            f"--model resnet18 needs torchvision, and {why}: pip install torchvision (the build made for your torch)"
        )
    try:
        with torch.device("meta"):
            module = build_model(name, info, gpt_layers, moe=moe)
    except ValueError as e:  # (lenet on images of another size, gpt on images)
        raise PlanError(str(e)) from None
    shapes = [tuple(p.shape) for p in module.parameters()]
    blocks = [sum(p.numel() for p in block.parameters()) for block in module.children()]
    tokens = info.kind == "sequence"
    built = dict(
        shapes=shapes,
        block_parameters=blocks,
        # (a mixture of experts' router counts tokens: no forward on fake tensors; no pipeline plans it)
        autocast_output_bytes=None if moe else autocast_output_bytes(module, info.input_shape, tokens),
        buffers=module_buffers(module),
    )
    if name in GPT_MODELS:
        shape = act.gpt_shape(info, gpt_layers, name)
        shape = GPTShape(shape["layers"], shape["hidden"], shape["heads"], shape["vocab"], shape["seq"])
        if moe is not None:  # (its experts 4 × hidden wide, as distref.models builds them)
            shape = dataclasses.replace(shape, experts=moe.experts, top_k=moe.top_k)
            built["parameter_names"] = tuple(name for name, _ in module.named_parameters())
        return dataclasses.replace(decoder(name, shape), **built)

    def formula(saving: act.Saving, checkpointed: bool):
        return act.model_blocks(name, info, gpt_layers, saving, checkpointed)

    flops = flops_by_block(module, info.input_shape, tokens)
    outputs = block_outputs(module, info.input_shape, tokens)
    return Model(
        name, flops_per_sample=sum(flops), formula=formula, block_outputs=outputs, block_flops=flops, **built
    )


def custom_model(spec: str, sample_shape: Sequence[int] | None, tokens: bool) -> Model:
    """`module:function`, built on the meta device (no memory used): its parameters and buffers; with a
    sample shape, its FLOPs counted by FlopCounterMode. No activation formula (activations: not
    estimated)."""
    if not is_factory(spec):
        raise PlanError(f"--model {spec}: give MODULE:FUNCTION, e.g. mypkg.models:build")
    module_name, _, function = spec.partition(":")
    try:
        built = getattr(importlib.import_module(module_name), function)
    except (Exception, SystemExit) as e:  # (a missing module or function, or the module failing as imported)
        raise PlanError(
            f"--model {spec}: cannot import {function!r} from {module_name!r} ({type(e).__name__}: {e})"
        ) from None
    try:
        with torch.device("meta"):
            module = built()
    except (Exception, SystemExit) as e:  # (the user's code: whatever it raises is said in one line)
        raise PlanError(
            f"--model {spec}: {function}() failed on the meta device: {type(e).__name__}: {e}"
        ) from None
    if not isinstance(module, torch.nn.Module):
        raise PlanError(f"--model {spec}: {function}() returned a {type(module).__name__}, not an nn.Module")
    shapes = [tuple(p.shape) for p in module.parameters()]  # (a parameter shared by blocks: once)
    # A pipeline cuts an nn.Sequential between its blocks; anything else is one block
    blocks = [sum(map(math.prod, shapes))]
    if isinstance(module, torch.nn.Sequential) and not list(module.parameters(recurse=False)):
        seen: set[int] = set()
        blocks = []
        for child in module:
            mine = [p for p in child.parameters() if id(p) not in seen]
            seen.update(id(p) for p in mine)
            blocks.append(sum(p.numel() for p in mine))
    flops = outputs = per_block = autocast_bytes = None
    if sample_shape:
        try:
            per_block = flops_by_block(module, sample_shape, tokens)
            flops = sum(per_block) or None  # (no FLOPs counted: no time)
            outputs = block_outputs(module, sample_shape, tokens)
            autocast_bytes = autocast_output_bytes(module, sample_shape, tokens)
        except Exception as e:
            raise PlanError(
                f"--model {spec} on --sample-shape {','.join(map(str, sample_shape))}: its forward failed "
                f"on the meta device: {type(e).__name__}: {e}"
            ) from None
    tokens_per_sample = sample_shape[0] if tokens and sample_shape else 1
    if per_block is not None and len(per_block) != len(blocks):
        per_block = None  # (parameters on the Sequential itself: not cut into stages)
    return Model(
        spec,
        shapes,
        blocks,
        None,
        flops,
        tokens_per_sample,
        block_outputs=outputs,
        block_flops=per_block,
        autocast_output_bytes=autocast_bytes,
        buffers=module_buffers(module),
    )


def parameters_only(count: int) -> Model:
    """--params N: model states only (one flat tensor; no blocks, FLOPs or activations)."""
    return Model(f"{count:,} parameters", [(count,)], [count])
