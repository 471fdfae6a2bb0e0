"""python -m distref.plan: which strategy for my model on my GPUs, from the formulas this project proves.

For a model (a decoder preset, one of this project's models, any nn.Module as module:function, or a bare
parameter count), a cluster (a GPU preset, its count and nodes) and a training set-up (global batch,
micro-batch, precision, optimizer, activation checkpointing), every strategy and mesh the project
implements is costed per GPU and ranked:

- **memory**: model states by `distref.cost` — in fp32 the impls' own exact formulas (`replicated`,
  `fsdp_model_states`, `zero_model_states`, `tensor_parallel_model_states`: measured equal in every impl's
  tests, simulated equal up to 512 ranks); in mixed precision the ZeRO paper's bytes per parameter
  (`memory.mixed_precision`, checked against the paper's table). Activations by `cost.activations` and
  `cost.tp_activations` (exact in fp32 for gpt, lenet and resnet18, every pipeline schedule's order
  replayed); at 2 bytes per element in mixed precision (extrapolated: autocast has no formula yet).
- **communication** per step by `distref.cost`'s per-strategy functions, split by link: intra-node
  (NVLink/PCIe) when the group's ranks share a node, inter-node otherwise (tensor parallelism innermost,
  then the pipeline, data parallelism outermost).
- **time**: compute from FLOPs (PaLM's 6N + 12·L·h·s per token, arXiv 2204.02311 App. B; ×4/3 with
  activation checkpointing) at the stated utilisation of the GPU's peak (`--mfu`); communication as bus
  bytes over the link's bandwidth (nccl-tests' convention); a pipeline's bubble by its schedule's formula.
  Step time without overlap adds them; with overlap the data-parallel collectives hide under compute and
  the tensor- and pipeline-parallel ones do not. Times are a model, not a measurement: `--validate` sets
  them against runs.

Rows are extrapolated where a number rests on something the tests did not measure; each says which.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import itertools
import json
import math
import sys
import unittest.mock
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from distref.config import OneLineErrorParser, positive_int
from distref.cost import activations as act
from distref.cost.counts import Counts, add, merge
from distref.cost.data_parallel import ddp as ddp_communication
from distref.cost.memory import mixed_precision, replicated
from distref.cost.pipeline import model_parallel as model_parallel_communication
from distref.cost.pipeline import pipeline as pipeline_communication
from distref.cost.sharded import fsdp as fsdp_communication
from distref.cost.sharded import fsdp_model_states
from distref.cost.tensor_parallel import (
    _units,
    gpt_parameters,
    parameters_held,
    tensor_parallel,
    tensor_parallel_model_states,
)
from distref.cost.tp_activations import tensor_parallel_activation_bytes
from distref.cost.zero import zero_communication, zero_model_states
from distref.distributed.partition import _SHAPES as PROJECT_DATASETS
from distref.impl_folders import load_train_module
from distref.models import build_model
from distref.simulate import IMPLS_DIR, PRESETS, GPTShape

GiB = 2**30

# ---- What a user names: models, GPUs ------------------------------------------------------------------

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
}


@dataclasses.dataclass(frozen=True)
class GPU:
    """One accelerator and its node: memory, dense peak FLOP/s by precision, and per-GPU bandwidth one
    way, within a node and out of it."""

    name: str
    memory_bytes: int
    peak_flops: dict[str, float]  # {"mixed": bf16 tensor cores, "fp32": fp32}
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    gpus_per_node: int


# Datasheet figures (dense, no sparsity). NVLink's bidirectional totals halved; the inter-node link is the
# node's NICs shared by its GPUs: DGX H100 8×400 Gb/s, DGX A100 8×200 Gb/s, an L4 node 100 Gb/s Ethernet.
GPUS = {
    "h100-80gb": GPU("H100 80GB SXM", 80 * GiB, {"mixed": 989.4e12, "fp32": 66.9e12}, 450e9, 50e9, 8),
    "a100-80gb": GPU("A100 80GB SXM", 80 * GiB, {"mixed": 312e12, "fp32": 19.5e12}, 300e9, 25e9, 8),
    "a100-40gb": GPU("A100 40GB SXM", 40 * GiB, {"mixed": 312e12, "fp32": 19.5e12}, 300e9, 25e9, 8),
    "l4": GPU("L4 24GB (PCIe)", 24 * GiB, {"mixed": 121e12, "fp32": 30.3e12}, 32e9, 12.5e9 / 8, 8),
    # This project's CI box: 2 cores as 2 ranks, 24 GiB; 2 × 2.5 GHz × 32 fp32 FLOP per cycle (AVX2 FMA),
    # no bf16 units; gloo's copies through shared memory assumed 5 GB/s.
    "cpu": GPU("CPU (2 cores)", 24 * GiB, {"mixed": 160e9, "fp32": 160e9}, 5e9, 1.25e9, 2),
}

RESERVED_BYTES = 2 * GiB  # per GPU, not for training: CUDA context, NCCL buffers, allocator fragmentation
DEFAULT_MFU = 0.4
DDP_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's bucket_cap_mb default
ZERO_REDUCE_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size default (elements)
ZERO_PREFETCH_BUCKET = 50_000_000  # stage3_prefetch_bucket_size default (elements)
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zero-bubble", "zbv", "dualpipev")
MEASURED_WORLD, SIMULATED_WORLD = 4, 512  # the largest worlds the tests run for real, and simulate


class PlanError(ValueError):
    """Bad input: said in one line, exit 2."""


# ---- The model ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Model:
    """What the planner knows of a model: its parameter shapes (model.parameters() order), its blocks (a
    pipeline cuts between them: each block's parameter count), the gpt shape where it is a decoder (tensor
    parallelism and the decoder formulas need it), FLOPs of one sample's forward and backward, what one
    sample is in tokens, and the activation formula `activations(micro_batch, element_bytes,
    checkpointed)` → (blocks, loss) of distref.cost.activations, or None where there is none."""

    name: str
    shapes: list[tuple[int, ...]]
    block_parameters: list[int]
    gpt: GPTShape | None = None
    flops_per_sample: float | None = None
    tokens_per_sample: int = 1
    formula: Callable[[int, bool], tuple[list[act.Block], act.Loss]] | None = None
    block_outputs: list[int] | None = None  # elements of each block's output, per sample

    @property
    def parameters(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)


def decoder(name: str, shape: GPTShape) -> Model:
    params = gpt_parameters(shape.layers, shape.hidden, shape.vocab, shape.seq)
    shapes = [s for _, s, _ in params]
    per_block = [sum(math.prod(s) for n, s, _ in params if n.startswith(p)) for p in block_prefixes(shape)]
    # PaLM's model FLOPs per token (arXiv 2204.02311, App. B): 6 per matmul weight (forward 2, backward 4)
    # plus attention's 12·L·h·s; the embeddings' lookups are no matmuls.
    matmul_weights = shape.parameters() - (shape.vocab + shape.seq) * shape.hidden
    per_token = 6 * matmul_weights + 12 * shape.layers * shape.hidden * shape.seq

    def formula(element_bytes: int, checkpointed: bool):
        blocks = act.gpt_blocks(
            shape.seq, shape.hidden, shape.heads, shape.layers, element_bytes, checkpointed
        )
        s = shape.seq
        return blocks, act.Loss(element_bytes * s * shape.vocab + act.INDEX_BYTES * s, element_bytes)

    outputs = [shape.seq * shape.hidden] * (shape.layers + 1) + [shape.seq * shape.vocab]
    return Model(name, shapes, per_block, shape, per_token * shape.seq, shape.seq, formula, outputs)


def block_prefixes(shape: GPTShape) -> list[str]:
    return ["embed.", *(f"block{i}." for i in range(shape.layers)), "head."]


def flops_measured(module: torch.nn.Module, sample_shape: Sequence[int], tokens: bool) -> float:
    """One sample's forward and backward FLOPs, counted by torch's FlopCounterMode on the meta device."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        x = torch.zeros(1, *sample_shape, dtype=torch.long) if tokens else torch.zeros(1, *sample_shape)
    with FlopCounterMode(display=False) as counter:
        out = module(x)
        out.float().sum().backward()
    return float(counter.get_total_flops())


def block_outputs(module: torch.nn.Module, sample_shape: Sequence[int], tokens: bool) -> list[int] | None:
    """Elements of each block's output for one sample (a forward on the meta device), where the model is
    a sequence of blocks (nn.Sequential: what a pipeline cuts); None otherwise."""
    if not isinstance(module, torch.nn.Sequential):
        return None
    with torch.device("meta"), torch.no_grad():
        x = torch.zeros(1, *sample_shape, dtype=torch.long) if tokens else torch.zeros(1, *sample_shape)
        sizes = []
        for block in module:
            x = block(x)
            sizes.append(x.numel())
    return sizes


def project_model(name: str) -> Model:
    """lenet, resnet18 or gpt (the tiny one --model gpt trains), on their usual datasets."""
    info = PROJECT_DATASETS[name]
    with torch.device("meta"):
        module = build_model(name, info)
    shapes = [tuple(p.shape) for p in module.parameters()]
    blocks = [sum(p.numel() for p in block.parameters()) for block in module.children()]
    if name == "gpt":
        shape = PRESETS["gpt-tiny"]
        return dataclasses.replace(decoder("gpt", shape), shapes=shapes, block_parameters=blocks)

    def formula(element_bytes: int, checkpointed: bool):
        e = element_bytes
        if name == "lenet":
            return act.lenet_blocks(e, checkpointed), act.Loss(e * info.num_classes + act.INDEX_BYTES, e)
        blocks = act.resnet18_blocks(info.input_shape, e, checkpointed)
        return blocks, act.Loss(e * info.num_classes + act.INDEX_BYTES, e)

    flops = flops_measured(module, info.input_shape, False)
    return Model(
        name, shapes, blocks, None, flops, 1, formula, block_outputs(module, info.input_shape, False)
    )


def custom_model(spec: str, sample_shape: Sequence[int] | None, tokens: bool) -> Model:
    """`module:function`, built on the meta device (no memory used): its parameters; with a sample shape,
    its FLOPs counted by FlopCounterMode. No activation formula (activations: not estimated)."""
    module_name, _, function = spec.partition(":")
    try:
        built = getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError) as e:
        raise PlanError(f"--model {spec}: cannot import {function!r} from {module_name!r} ({e})") from None
    with torch.device("meta"):
        module = built()
    if not isinstance(module, torch.nn.Module):
        raise PlanError(f"--model {spec}: {function}() returned a {type(module).__name__}, not an nn.Module")
    shapes = [tuple(p.shape) for p in module.parameters()]
    blocks = [sum(p.numel() for p in child.parameters()) for child in module.children()] or [
        sum(map(math.prod, shapes))
    ]
    flops = flops_measured(module, sample_shape, tokens) if sample_shape else None
    tokens_per_sample = sample_shape[0] if tokens and sample_shape else 1
    outputs = block_outputs(module, sample_shape, tokens) if sample_shape else None
    return Model(spec, shapes, blocks, None, flops, tokens_per_sample, block_outputs=outputs)


def parameters_only(count: int) -> Model:
    """--params N: model states only (one flat tensor; no blocks, FLOPs or activations)."""
    return Model(f"{count:,} parameters", [(count,)], [count])


def resolve_model(args: argparse.Namespace) -> Model:
    if args.params is not None:
        return parameters_only(args.params)
    name = args.model
    if name in MODELS:
        shape = MODELS[name]
        if args.seq:
            shape = dataclasses.replace(shape, seq=args.seq)
        return decoder(name, shape)
    if name in PROJECT_DATASETS:
        return project_model(name)
    if ":" in name:
        return custom_model(name, args.sample_shape, args.tokens)
    known = ", ".join([*MODELS, *PROJECT_DATASETS])
    raise PlanError(f"unknown model {name!r}: one of {known}, module:function, or --params N")


# ---- The cluster and the training set-up ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus: int

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpu.gpus_per_node)

    def link(self, group_span: int) -> str:
        """The link a group of consecutive ranks spanning `group_span` ranks runs over."""
        return "intra_node" if group_span <= self.gpu.gpus_per_node else "inter_node"

    def bandwidth(self, link: str) -> float:
        return self.gpu.intra_node_bytes_per_s if link == "intra_node" else self.gpu.inter_node_bytes_per_s


@dataclasses.dataclass(frozen=True)
class Training:
    global_batch: int  # samples (sequences) per optimizer step
    micro_batch: int  # samples per GPU per micro-step (a pipeline's micro-batch)
    precision: str  # "mixed" (16-bit parameters and gradients, fp32 master and optimizer) or "fp32"
    optimizer: str  # "adamw" or "sgd"
    checkpointing: bool
    mfu: float
    grad_accum: int | None = None  # fixes K, and so the micro-batch, where given

    @property
    def element_bytes(self) -> int:  # a parameter's, a gradient's, an activation's
        return {"mixed": 2, "fp32": 4, "fp64": 8}[self.precision]  # (fp64: --validate's fp64 runs)


# ---- Layouts: a strategy on a mesh ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    strategy: str  # ddp, zero1-3, zero*-offload, fsdp, hsdp, tp, pp-<schedule>, model_parallel
    dp: int = 1  # data-parallel ranks (for hsdp: shard × replicas)
    tp: int = 1
    pp: int = 1
    shard: int = 1  # hsdp's shard group

    @property
    def mesh(self) -> str:
        parts = [f"dp{self.dp}"] if self.dp > 1 or (self.tp == 1 and self.pp == 1) else []
        parts += [f"tp{self.tp}"] if self.tp > 1 else []
        parts += [f"pp{self.pp}"] if self.pp > 1 else []
        text = "×".join(parts)
        return (
            f"{text} (shard {self.shard} × replicate {self.dp // self.shard})"
            if self.strategy == "hsdp"
            else text
        )


def powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(limit)) + 1)] if limit >= 1 else []


def layouts(model: Model, cluster: Cluster) -> tuple[list[Layout], list[tuple[str, str]]]:
    """Every strategy and mesh a user would try on `cluster` (powers of two per dimension), and what was
    skipped, with why."""
    g, per_node = cluster.gpus, cluster.gpu.gpus_per_node
    found: list[Layout] = []
    skipped: list[tuple[str, str]] = []
    for strategy in (
        "ddp",
        "zero1",
        "zero2",
        "zero3",
        "zero1-offload",
        "zero2-offload",
        "zero3-offload",
        "fsdp",
    ):
        found.append(Layout(strategy, dp=g))
    if cluster.nodes > 1 and g % per_node == 0:
        found.append(Layout("hsdp", dp=g, shard=per_node))
    else:
        skipped.append(("hsdp", "one node: HSDP's replicas would be FSDP's shards"))
    if g & (g - 1):
        skipped.append(("tp, pp", f"{g} GPUs is not a power of two: meshes are searched in powers of two"))
        return found, skipped
    if model.gpt is None:
        skipped.append(("tp", "tensor parallelism needs a decoder's shape (--model 125m … 70b)"))
    for tp in powers_of_two(g)[1:]:
        if model.gpt is None:
            break
        heads = model.gpt.heads
        if tp > per_node:
            skipped.append(
                (f"tp{tp}", f"beyond a node's {per_node} GPUs: every layer's collectives would cross nodes")
            )
        elif heads % tp:
            skipped.append((f"tp{tp}", f"must divide the {heads} attention heads"))
        elif model.gpt.seq % tp:
            skipped.append(
                (f"tp{tp}", f"sequence parallelism splits the {model.gpt.seq} positions: not evenly")
            )
        else:
            found.append(Layout("tp", dp=g // tp, tp=tp))
    blocks = len(model.block_parameters)
    for pp in powers_of_two(g)[1:]:
        if blocks < 2:
            skipped.append(("pp, model_parallel", "the model has no blocks to cut between"))
            break
        for schedule in SCHEDULES:
            stages = pp * (1 if schedule in ("gpipe", "1f1b") else 2)
            if stages > blocks:
                skipped.append((f"pp{pp}-{schedule}", f"more stages than the model's {blocks} blocks"))
            else:
                found.append(Layout(f"pp-{schedule}", dp=g // pp, pp=pp))
        if pp == g and pp <= blocks:
            found.append(Layout("model_parallel", pp=pp))
    return found, skipped


# ---- Costing one layout ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    strategy: str
    mesh: str
    memory_per_gpu_bytes: dict[str, float | None]
    fits: bool
    communication_bytes: dict[str, float]  # per step per GPU: bus bytes by link
    compute_s: float | None
    step_s: dict[str, float | None]  # no_overlap, overlap
    tokens_per_s_per_gpu: float | None
    extrapolated: list[str]
    why: str = ""
    cpu_bytes: float = 0.0  # offloaded optimizer states, per GPU
    pipeline_rank: int | None = None  # the pipeline rank whose memory is given: the fullest
    micro_batch: int = 0
    grad_accum: int = 0
    layout: Layout | None = None

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("layout")
        return out


def micro_steps(training: Training, replicas: int) -> tuple[int, int]:
    """(micro-batch, micro-steps K) with `replicas` data-parallel copies; PlanError where they do not
    divide the global batch."""
    if training.grad_accum:
        k = training.grad_accum
        if training.global_batch % (replicas * k):
            raise PlanError(
                f"global batch {training.global_batch} is not {replicas} replicas × {k} micro-steps × b"
            )
        return training.global_batch // (replicas * k), k
    b = training.micro_batch
    if training.global_batch % (replicas * b):
        raise PlanError(
            f"global batch {training.global_batch} is not a multiple of {replicas} replicas × micro-batch {b}"
        )
    return b, training.global_batch // (replicas * b)


def data_parallel_states(layout: Layout, model: Model, training: Training) -> tuple[dict[str, float], float]:
    """(model states on the GPU, bytes offloaded to the CPU) for the data-parallel family."""
    n, strategy, e = layout.dp, layout.strategy.removesuffix("-offload"), training.element_bytes
    over = {"ddp": (1, 1, 1), "zero1": (1, 1, n), "zero2": (1, n, n), "zero3": (n, n, n), "fsdp": (n, n, n)}
    over["hsdp"] = (layout.shard,) * 3
    numels = [math.prod(s) for s in model.shapes]
    if training.precision == "mixed":
        p, g, o = over[strategy]
        states = mixed_precision(model.parameters, parameters_over=p, gradients_over=g, optimizer_over=o)
        if training.optimizer == "sgd":  # fp32 master and momentum: 8 bytes
            states["optimizer"] = 8 * model.parameters / o
    elif strategy == "ddp":
        states = replicated([n * e for n in numels], training.optimizer, step_bytes=e)
    elif strategy in ("fsdp", "hsdp"):
        shard = n if strategy == "fsdp" else layout.shard
        states = fsdp_model_states(model.shapes, shard, 0, e, training.optimizer, step_bytes=e)
    else:
        states = zero_model_states(
            numels, n, 0, int(strategy[-1]), training.optimizer, element_bytes=e, step_bytes=e
        )
    offloaded = 0.0
    if layout.strategy.endswith("-offload"):  # ZeRO-Offload: the optimizer's states and step on the CPU
        offloaded = states["optimizer"]
        states = {**states, "optimizer": 0}
    return states, offloaded


def data_parallel_communication(
    layout: Layout, model: Model, training: Training, k: int
) -> tuple[Counts, list[str]]:
    n, strategy = layout.dp, layout.strategy.removesuffix("-offload")
    e = training.element_bytes
    numels = [math.prod(s) for s in model.shapes]
    notes = []
    if strategy == "ddp":
        return ddp_communication([m * e for m in numels], n, bucket_cap_bytes=DDP_BUCKET_BYTES), notes
    if strategy in ("fsdp", "hsdp"):
        shard = n if strategy == "fsdp" else layout.shard
        units = unit_shapes(model)
        resharded = [i < len(units) - 1 for i in range(len(units))]
        return (
            fsdp_communication(
                units,
                resharded,
                shard,
                replicas=n // shard,
                gather_element_bytes=e,
                reduce_element_bytes=e,
                grad_accum=k,
            ),
            notes,
        )
    stage = int(strategy[-1])
    counts = zero_communication(
        numels,
        n,
        stage,
        bucket_elements=ZERO_REDUCE_BUCKET,
        prefetch_elements=ZERO_PREFETCH_BUCKET,
        grad_accum=k,
        element_bytes=e,
    )
    if counts is None:  # ZeRO-3 beyond one prefetch bucket: FSDP's pattern (two gathers, one reduce-scatter)
        notes.append("ZeRO-3's communication beyond one prefetch bucket: FSDP's formula (not measured)")
        units = unit_shapes(model)
        counts = fsdp_communication(
            units, [True] * len(units), n, gather_element_bytes=e, reduce_element_bytes=e, grad_accum=k
        )
    return counts, notes


def unit_shapes(model: Model) -> list[list[tuple[int, ...]]]:
    """The parameters' shapes grouped by block (FSDP's units in the impls: one per block)."""
    units, shapes = [], iter(model.shapes)
    for count in model.block_parameters:
        unit, held = [], 0
        while held < count:
            shape = next(shapes)
            unit.append(shape)
            held += math.prod(shape)
        units.append(unit)
    return units


def cost(layout: Layout, model: Model, cluster: Cluster, training: Training) -> Row:
    """One layout's memory, communication and time per GPU (the worst GPU where they differ)."""
    notes: list[str] = []
    if training.precision == "mixed":
        notes.append(
            "mixed precision: the ZeRO paper's bytes per parameter, activations at 2 bytes (not measured)"
        )
    world = layout.dp * layout.tp * layout.pp
    if world > SIMULATED_WORLD:
        notes.append(
            f"world {world}: formulas simulated up to {SIMULATED_WORLD} ranks, measured up to {MEASURED_WORLD}"
        )
    cpu_bytes = 0.0
    links: dict[str, Counts] = {"intra_node": {}, "inter_node": {}}
    overlapped = {"intra_node": 0.0, "inter_node": 0.0}  # bus bytes that hide under compute
    bubble, worst_rank = 0.0, None
    if layout.tp == 1 and layout.pp == 1:  # the data-parallel family
        b, k = micro_steps(training, layout.dp)
        states, cpu_bytes = data_parallel_states(layout, model, training)
        activations = whole_model_activations(model, b, training)
        counts, more = data_parallel_communication(layout, model, training, k)
        notes += more
        if layout.strategy.endswith("-offload"):
            notes.append("offload: the CPU's optimizer step and PCIe copies not modelled (no formula)")
        if layout.strategy == "hsdp":
            link_of = {"all_reduce": cluster.link(layout.dp)}
            shard_link = cluster.link(layout.shard)
            for kind, entry in counts.items():
                merge_into(links[link_of.get(kind, shard_link)], {kind: entry})
        else:
            merge_into(links[cluster.link(layout.dp)], counts)
        for link, part in links.items():
            overlapped[link] = bus(part)
    elif layout.tp > 1:
        b, k = micro_steps(training, layout.dp)
        states, activations, tp_counts, dp_counts = tensor_parallel_costs(layout, model, training, b, k)
        merge_into(links["intra_node"], tp_counts)
        merge_into(links[cluster.link(layout.dp * layout.tp)], dp_counts)
        overlapped[cluster.link(layout.dp * layout.tp)] += bus(dp_counts)
    else:
        b, k = micro_steps(training, layout.dp)
        states, activations, p2p, dp_counts, bubble, more, worst_rank = pipeline_costs(
            layout, model, training, b, k
        )
        notes += more
        merge_into(links[cluster.link(layout.pp)], p2p)
        merge_into(links[cluster.link(layout.pp * layout.dp)], dp_counts)
        overlapped[cluster.link(layout.pp * layout.dp)] += bus(dp_counts)
    states_total = sum(states.values())
    total = states_total + (activations or 0)
    usable = cluster.gpu.memory_bytes - RESERVED_BYTES
    communication = {link: bus(part) for link, part in links.items()}
    compute_s = step_flops(model, training, world)
    if compute_s is not None:
        compute_s = compute_s / (peak(cluster.gpu, training.precision) * training.mfu) * (1 + bubble)
    comm_s = sum(bytes_ / cluster.bandwidth(link) for link, bytes_ in communication.items())
    hidden_s = sum(bytes_ / cluster.bandwidth(link) for link, bytes_ in overlapped.items())
    step = {"no_overlap": None, "overlap": None}
    tokens = None
    if compute_s is not None:
        step = {"no_overlap": compute_s + comm_s, "overlap": max(compute_s, hidden_s) + (comm_s - hidden_s)}
        tokens = training.global_batch * model.tokens_per_sample / step["overlap"] / world
    return Row(
        strategy=layout.strategy,
        mesh=layout.mesh,
        memory_per_gpu_bytes={
            "model_states": states_total,
            "activations": activations,
            "total": total,
            **states,
        },
        fits=total <= usable,
        communication_bytes=communication,
        compute_s=compute_s,
        step_s=step,
        tokens_per_s_per_gpu=tokens,
        extrapolated=notes,
        cpu_bytes=cpu_bytes,
        pipeline_rank=worst_rank,
        micro_batch=b,
        grad_accum=k,
        layout=layout,
    )


def peak(gpu: GPU, precision: str) -> float:
    """Dense peak FLOP/s in the training's precision (fp64, for --validate's fp64 runs: half fp32's)."""
    return gpu.peak_flops.get(precision) or gpu.peak_flops["fp32"] / 2


def bus(counts: Counts) -> float:
    return sum(entry["bus_bytes"] for entry in counts.values())


def merge_into(into: Counts, part: Counts) -> None:
    into.update(merge(into, part))


def whole_model_activations(model: Model, micro_batch: int, training: Training) -> float | None:
    if model.formula is None:
        return None
    return act.stage_bytes(*model.formula(training.element_bytes, training.checkpointing), micro_batch)


def step_flops(model: Model, training: Training, world: int) -> float | None:
    """One GPU's share of a step's FLOPs (recomputation included with activation checkpointing)."""
    if model.flops_per_sample is None:
        return None
    recompute = 4 / 3 if training.checkpointing else 1
    return model.flops_per_sample * training.global_batch * recompute / world


def tensor_parallel_costs(layout: Layout, model: Model, training: Training, b: int, k: int):
    """impls/tensor_parallel's 2-D mesh (FSDP over dp, Megatron TP with sequence and loss parallelism)."""
    shape, t, d, e = model.gpt, layout.tp, layout.dp, training.element_bytes
    dims = dict(layers=shape.layers, hidden=shape.hidden, vocabulary=shape.vocab, sequence=shape.seq)
    if training.precision != "mixed":
        states = tensor_parallel_model_states(
            **dims, tp=t, tp_rank=0, optimizer=training.optimizer, dp_shard=d, element_bytes=e, step_bytes=e
        )
    else:
        held = sum(
            math.prod(s) for _, s in parameters_held(shape.layers, shape.hidden, shape.vocab, shape.seq, t, 0)
        )
        states = mixed_precision(held, parameters_over=d, gradients_over=d, optimizer_over=d)
    activations = tensor_parallel_activation_bytes(
        micro_batch=b,
        seq=shape.seq,
        hidden=shape.hidden,
        heads=shape.heads,
        layers=shape.layers,
        vocab=shape.vocab,
        tp=t,
        tp_rank=0,
        sequence_parallel=True,
        loss_parallel=True,
        element_bytes=e,
        checkpointed=training.checkpointing,
    )
    total = tensor_parallel(
        **dims,
        micro_batch=b,
        tp=t,
        sequence_parallel=True,
        loss_parallel=True,
        optimizer=training.optimizer,
        grad_accum=k,
        dp_shard=d,
        element_bytes=e,
        activation_checkpointing=training.checkpointing,
    )
    dp_counts: Counts = {}
    if d > 1:  # what FSDP adds over the dp ranks (as tensor_parallel computes it)
        units = _units(
            parameters_held(shape.layers, shape.hidden, shape.vocab, shape.seq, t, 0), shape.layers
        )
        dp_counts = fsdp_communication(
            units, [True] * len(units), d, gather_element_bytes=e, reduce_element_bytes=e, grad_accum=k
        )
    tp_counts = {
        kind: {key: value - dp_counts.get(kind, {}).get(key, 0) for key, value in entry.items()}
        for kind, entry in total.items()
    }
    return states, activations, {k_: v for k_, v in tp_counts.items() if v["calls"]}, dp_counts


def minimax_cut(sizes: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous parts of `sizes` with the largest part's sum as small as possible (the pipeline's
    balanced cut, distref.distributed.partition's objective, by dynamic programming instead of trying
    every cut)."""
    n = len(sizes)
    prefix = [0, *itertools.accumulate(sizes)]
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]  # best[p][end]: blocks [0, end) in p parts
    start_of = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for p in range(1, parts + 1):
        for end in range(p, n - (parts - p) + 1):
            for start in range(p - 1, end):
                largest = max(best[p - 1][start], prefix[end] - prefix[start])
                if largest < best[p][end]:
                    best[p][end], start_of[p][end] = largest, start
    bounds, end = [], n
    for p in range(parts, 0, -1):
        bounds.append((start_of[p][end], end))
        end = start_of[p][end]
    return bounds[::-1]


@functools.lru_cache(maxsize=64)
def schedule_orders(schedule: str, p: int, m: int) -> dict[int, list[act.Action]]:
    """Each rank's order of work (kind, stage, micro-batch) in one step: GPipe's and 1F1B's by their rule,
    the multi-stage schedules' from torch's own `pipeline_order` (built on the fake backend, as
    impls/pipeline builds it: rank r's stages round-robin or V-shaped)."""
    if schedule in ("gpipe", "1f1b"):
        return {r: act.one_stage_order(schedule, m, p, r) for r in range(p)}
    from torch.distributed.pipelining import PipelineStage

    module = pipeline_impl()
    with order_world(p):
        stages = [
            PipelineStage(torch.nn.Linear(1, 1), index, 2 * p, torch.device("cpu"))
            for index in module.stage_indices(schedule, 0, p, 2)
        ]
        cls = module.SCHEDULES[schedule]
        # (its constructor then adds the send/recv actions a real run needs, which costs seconds and
        # changes nothing in the order of compute: skipped here)
        with unittest.mock.patch.object(cls, "_prepare_schedule_with_comms", lambda *args, **kwargs: None):
            built = cls(stages, m, loss_fn=lambda out, target: out.sum())
        orders = {}
        for rank in range(p):
            orders[rank] = [
                (part.computation_type.value, part.stage_index, part.microbatch_index)
                for action in built.pipeline_order[rank]
                if action is not None
                for part in (action.sub_actions or (action,))
            ]
    return orders


@contextlib.contextmanager
def order_world(world_size: int) -> Iterator[None]:
    """This process as rank 0 of `world_size` on torch's fake backend, for a schedule's constructor."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # (registers the "fake" backend)

    if dist.is_initialized():
        raise PlanError("the pipeline schedules' orders are built on a fake process group: not inside a job")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@functools.cache
def pipeline_impl():
    return load_train_module(IMPLS_DIR / "pipeline" / "train.py")


def pipeline_costs(layout: Layout, model: Model, training: Training, b: int, k: int):
    """impls/pipeline (p stage ranks, each of the dp pipelines all-reducing its parameters) or
    impls/model_parallel (one micro-batch after another): the worst rank's memory, its point-to-point
    traffic and the dp all-reduce, the schedule's bubble."""
    p, e, notes = layout.pp, training.element_bytes, []
    m = k  # the pipeline runs the replica's micro-steps as its micro-batches
    if layout.strategy == "model_parallel":  # one micro-batch through every part before the next
        schedule, v, bubble = "gpipe", 1, p - 1.0
        orders = {r: act.one_stage_order("gpipe", 1, p, r) for r in range(p)}
    else:
        schedule = layout.strategy.removeprefix("pp-")
        v = 1 if schedule in ("gpipe", "1f1b") else 2
        if problem := pipeline_impl().microbatch_problem(schedule, m, p, p * v):
            raise PlanError(problem)
        orders = schedule_orders(schedule, p, m)
        bubble = pipeline_bubble(schedule, p, v, m)
    bounds = minimax_cut(model.block_parameters, p * v)
    stage_params = [sum(model.block_parameters[a:z]) for a, z in bounds]
    units = unit_shapes(model)
    stage_rank = {stage: rank for rank, order in orders.items() for _, stage, _ in order}
    blocks_and_loss = model.formula(e, training.checkpointing) if model.formula else None

    def rank_costs(rank: int) -> tuple[dict[str, float], float | None, int]:
        mine = sorted({stage for _, stage, _ in orders[rank]})
        held = sum(stage_params[s] for s in mine)
        if training.precision == "mixed":
            states = mixed_precision(held)
        else:
            tensors = [
                math.prod(shape) * e for s in mine for unit in units[slice(*bounds[s])] for shape in unit
            ]
            states = replicated(tensors, training.optimizer, step_bytes=e)
        held_activations = None
        if blocks_and_loss is not None:
            held_activations = act.held_in_rank(*blocks_and_loss, bounds, orders[rank], b)
        return states, held_activations, held

    each_rank = [rank_costs(rank) for rank in range(p)]
    worst_rank = max(range(p), key=lambda r: sum(each_rank[r][0].values()) + (each_rank[r][1] or 0))
    states, activations, held = each_rank[worst_rank]
    # Each boundary's activation forward and its gradient back, per micro-batch
    if model.block_outputs is None:
        notes.append("activations sent between stages: not estimated (the model is no sequence of blocks)")
    outputs = model.block_outputs or [0] * len(model.block_parameters)
    boundary = [b * outputs[last - 1] * e for _, last in bounds[:-1]]
    mine = sorted({stage for _, stage, _ in orders[worst_rank]})
    if layout.strategy == "model_parallel":
        p2p = model_parallel_communication(boundary, worst_rank, p, k)
    else:
        p2p = pipeline_communication(boundary, mine, [stage_rank[s] for s in range(len(bounds))], m)
    dp_counts: Counts = {}
    if layout.dp > 1:  # each pipeline rank's gradients summed over the dp pipelines
        add(dp_counts, "all_reduce", held * e, layout.dp)
    if schedule not in ("gpipe", "1f1b", "interleaved-1f1b"):
        notes.append(f"{schedule}'s bubble taken as none (its paper's claim; the report measures it)")
    return states, activations, p2p, dp_counts, bubble, notes, worst_rank


def pipeline_bubble(schedule: str, p: int, v: int, m: int) -> float:
    """Idle time over busy time: (p − 1)/m for GPipe and 1F1B, (p − 1)/(v·m) interleaved (Megatron-LM,
    arXiv 2104.04473 §2.2); the zero-bubble schedules' taken as none."""
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if schedule == "interleaved-1f1b":
        return (p - 1) / (v * m)
    return 0.0


# ---- The plan: every layout costed, ranked, each with one line of why ---------------------------------


@dataclasses.dataclass
class Plan:
    model: Model
    cluster: Cluster
    training: Training
    rows: list[Row]  # ranked: fitting rows by tokens/s per GPU, then the rest by memory
    skipped: list[tuple[str, str]]

    def smallest_cluster(self, limit: int = 2**16) -> tuple[int, Row] | None:
        """Where nothing fits: the fewest GPUs (doubling) on which something would, and its best row."""
        gpus = self.cluster.gpus * 2
        while gpus <= limit:
            bigger = make_plan(self.model, dataclasses.replace(self.cluster, gpus=gpus), self.training)
            if bigger.rows and bigger.rows[0].fits:
                return gpus, bigger.rows[0]
            gpus *= 2
        return None


def make_plan(model: Model, cluster: Cluster, training: Training) -> Plan:
    found, skipped = layouts(model, cluster)
    rows = []
    for layout in found:
        try:
            rows.append(cost(layout, model, cluster, training))
        except PlanError as e:
            skipped.append((f"{layout.strategy} {layout.mesh}", str(e)))
    rows.sort(key=rank_key)
    usable = cluster.gpu.memory_bytes - RESERVED_BYTES
    for row in rows:
        row.why = explain(row, usable, cluster)
    return Plan(model, cluster, training, rows, skipped)


def rank_key(row: Row) -> tuple:
    """Fitting rows first, the most tokens per second per GPU first (to 3 significant digits: closer than
    that the model cannot tell them apart), then the fewest extrapolations, the fewest bytes communicated
    (the least exposed to the bandwidths assumed) and the least memory; rows without a time by memory;
    rows that do not fit last."""
    total = row.memory_per_gpu_bytes["total"]
    if not row.fits:
        return (2, total)
    if row.tokens_per_s_per_gpu is None:
        return (1, len(row.extrapolated), total)
    speed = -float(f"{row.tokens_per_s_per_gpu:.3g}")
    return (0, speed, len(row.extrapolated), sum(row.communication_bytes.values()), total)


def explain(row: Row, usable: float, cluster: Cluster) -> str:
    """One line of why: what bounds the row's step (compute, communication, memory)."""
    memory = row.memory_per_gpu_bytes
    states, activations, total = memory["model_states"], memory["activations"], memory["total"]
    held = f"{gb(states)} states" + (f" + {gb(activations)} activations" if activations is not None else "")
    if not row.fits:
        return f"does not fit: {gb(total)} of {gb(usable)} usable ({held})"
    room = f"{gb(total)} of {gb(usable)}"
    if row.compute_s is None:
        return f"fits, {room} ({held}); no FLOPs known: time not estimated"
    link = max(row.communication_bytes, key=lambda k: row.communication_bytes[k] / cluster.bandwidth(k))
    moved = row.communication_bytes[link]
    seconds = moved / cluster.bandwidth(link)
    where = "across nodes" if link == "inter_node" else "within the node"
    exposed = row.step_s["overlap"] - row.compute_s
    if exposed > 0.01 * row.compute_s:
        return f"communication-bound: {gb(moved)} {where} adds {exposed:.2f} s to {row.compute_s:.2f} s of compute; {room}"
    if not moved:
        return f"compute-bound: {row.compute_s:.2f} s per step, nothing to communicate; {room}"
    return f"compute-bound: {gb(moved)} {where} ({seconds:.2f} s) hides under {row.compute_s:.2f} s of compute; {room}"


def gb(n: float | None) -> str:
    return "—" if n is None else f"{n / 1e9:.1f} GB"


# ---- Output -------------------------------------------------------------------------------------------


def table_rows(plan: Plan) -> tuple[list[str], list[list[str]], list[str]]:
    """Header, cells and footnotes (what each row extrapolates)."""
    header = [
        "#",
        "strategy",
        "mesh",
        "b×K",
        "states",
        "activations",
        "total",
        "fits",
        "intra-node",
        "inter-node",
    ]
    header += ["step s (overlap)", "tokens/s/GPU", "why"]
    notes: list[str] = []
    cells = []
    for i, row in enumerate(plan.rows, 1):
        marks = []
        for note in row.extrapolated:
            if note not in notes:
                notes.append(note)
            marks.append(str(notes.index(note) + 1))
        memory = row.memory_per_gpu_bytes
        step = row.step_s["overlap"]
        cells.append(
            [
                str(i) + (f" [{','.join(marks)}]" if marks else ""),
                row.strategy,
                row.mesh,
                f"{row.micro_batch}×{row.grad_accum}",
                gb(memory["model_states"]),
                gb(memory["activations"]),
                gb(memory["total"]),
                "yes" if row.fits else "no",
                gb(row.communication_bytes["intra_node"]),
                gb(row.communication_bytes["inter_node"]),
                "—" if step is None else f"{step:.3f}",
                "—" if row.tokens_per_s_per_gpu is None else f"{row.tokens_per_s_per_gpu:,.0f}",
                row.why,
            ]
        )
    return header, cells, notes


def heading(plan: Plan) -> str:
    c, t, m = plan.cluster, plan.training, plan.model
    return (
        f"{m.name} ({m.parameters / 1e9:.2f}B parameters) on {c.gpus} × {c.gpu.name} ({c.nodes} node(s) of "
        f"{c.gpu.gpus_per_node}); global batch {t.global_batch}, {t.precision} precision, {t.optimizer}"
        f"{', activation checkpointing' if t.checkpointing else ''}, MFU {t.mfu:.0%}"
    )


def render_text(plan: Plan) -> str:
    header, cells, notes = table_rows(plan)
    widths = [max(len(r[i]) for r in [header, *cells]) for i in range(len(header) - 1)]
    lines = [heading(plan), ""]
    for r in [header, *cells]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1])
    lines += ["", *footer(plan, notes)]
    return "\n".join(lines)


def render_markdown(plan: Plan) -> str:
    header, cells, notes = table_rows(plan)
    lines = [f"**{heading(plan)}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in cells]
    return "\n".join([*lines, "", *(f"- {line}" for line in footer(plan, notes))])


def footer(plan: Plan, notes: list[str]) -> list[str]:
    lines = [f"[{i}] extrapolated: {note}" for i, note in enumerate(notes, 1)]
    lines.append(
        "Memory per GPU; communication in bus bytes per step and GPU; times from FLOPs at the MFU and bytes at "
        "the links' bandwidths (a model: `--validate RUN_DIR` sets it against runs). docs/plan.md says where "
        "each number comes from."
    )
    if plan.skipped:
        by_reason: dict[str, list[str]] = {}
        for what, why in plan.skipped:
            by_reason.setdefault(why, []).append(what)
        lines.append(
            "Skipped: " + "; ".join(f"{', '.join(whats)}: {why}" for why, whats in by_reason.items())
        )
    if plan.rows and not plan.rows[0].fits:
        bigger = plan.smallest_cluster()
        if bigger is None:
            lines.append(
                f"Nothing fits, on any cluster of these GPUs: beyond {plan.training.global_batch} GPUs the global "
                "batch leaves a GPU no sample. Activations are the most of it: --activation-checkpointing keeps "
                "only each block's input."
                if not plan.training.checkpointing
                else f"Nothing fits, on any cluster of these GPUs (beyond {plan.training.global_batch} GPUs the "
                "global batch leaves a GPU no sample)."
            )
        else:
            gpus, row = bigger
            lines.append(
                f"Nothing fits on {plan.cluster.gpus} GPUs. The smallest cluster that would: {gpus} GPUs, "
                f"with {row.strategy} {row.mesh} ({gb(row.memory_per_gpu_bytes['total'])} per GPU)."
            )
    return lines


def plot(plan: Plan, path: Path) -> None:
    """Memory per GPU against the number of GPUs (each strategy's smallest mesh option), and step time by
    strategy on the plan's cluster."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    counts = powers_of_two(plan.cluster.gpus)
    least: dict[str, dict[int, float]] = {}  # strategy (pipelines as one) → GPUs → least memory per GPU
    for gpus in counts:
        smaller = make_plan(plan.model, dataclasses.replace(plan.cluster, gpus=gpus), plan.training)
        for row in smaller.rows:
            family = least.setdefault("pp" if row.strategy.startswith("pp-") else row.strategy, {})
            family[gpus] = min(family.get(gpus, math.inf), row.memory_per_gpu_bytes["total"])
    for family, points in sorted(least.items()):
        left.plot(list(points), [m / 1e9 for m in points.values()], marker="o", label=family)
    left.axhline(
        (plan.cluster.gpu.memory_bytes - RESERVED_BYTES) / 1e9, color="k", linestyle="--", label="usable"
    )
    left.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="GB per GPU", title="memory per GPU")
    left.legend(fontsize=7)
    timed = [row for row in plan.rows if row.step_s["overlap"] is not None][:20]
    right.barh(
        [f"{r.strategy} {r.mesh}" for r in timed],
        [r.step_s["overlap"] for r in timed],
        color=["tab:green" if r.fits else "tab:gray" for r in timed],
    )
    right.invert_yaxis()
    right.set(
        xlabel="step time, s (overlap; grey: does not fit)", title=f"step time on {plan.cluster.gpus} GPUs"
    )
    right.tick_params(axis="y", labelsize=7)
    fig.suptitle(heading(plan), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- The closed loop: the plan beside runs' records ------------------------------------------------------

IMPL_LAYOUT = {  # impl → the layout it runs, from its record (world size, its options)
    "single": lambda world, o: Layout("ddp", dp=1),
    "ddp": lambda world, o: Layout("ddp", dp=world),
    "fsdp": lambda world, o: (
        Layout("hsdp", dp=world, shard=world // o["hsdp"])
        if o.get("hsdp", 1) > 1
        else Layout("fsdp", dp=world)
    ),
    "deepspeed_zero": lambda world, o: Layout(f"zero{o['zero_stage']}", dp=world),
    "tensor_parallel": lambda world, o: tensor_parallel_layout(world, o.get("dp_shard"), o.get("tp")),
    "pipeline": lambda world, o: Layout(f"pp-{o['schedule']}", dp=o["dp"], pp=world // o["dp"]),
    "model_parallel": lambda world, o: Layout("model_parallel", pp=world),
}


def tensor_parallel_layout(world: int, dp: int | None, tp: int | None) -> Layout:
    """impls/tensor_parallel's mesh (its `mesh_shape`): the degree not given fills the world; neither
    given, one tensor-parallel group."""
    if tp is None:
        dp = dp or 1
        return Layout("tp", dp=dp, tp=max(1, world // dp))
    return Layout("tp", dp=dp or max(1, world // tp), tp=tp)


def dataset_info(config: dict[str, Any]):
    """The DatasetInfo a run's model was built for, from its record's config."""
    from distref.data.tensors import DatasetInfo

    model, dataset = config["model"], config["dataset"]
    if dataset == "synthetic" or dataset in ("mnist", "fashion-mnist", "digits", "cifar10"):
        if model == "gpt":
            return PROJECT_DATASETS["gpt"]
        shape = (3, 32, 32) if model == "resnet18" or dataset == "cifar10" else (1, 28, 28)
        return DatasetInfo(dataset, 10, shape, "image")
    from distref.config import RunConfig
    from distref.data.datasets import load_dataset

    fields = {f.name for f in dataclasses.fields(RunConfig)}
    return load_dataset(RunConfig(**{k: v for k, v in config.items() if k in fields and k != "strategy"}))[2]


def record_model(config: dict[str, Any]) -> Model:
    info = dataset_info(config)
    if config["model"] == "gpt":
        shape = act.gpt_shape(info, config["gpt_layers"])
        gpt_shape = GPTShape(shape["layers"], shape["hidden"], shape["heads"], shape["vocab"], shape["seq"])
        return dataclasses.replace(decoder("gpt", gpt_shape), name=f"gpt ({info.name})")
    model = project_model(config["model"])
    if info.input_shape != PROJECT_DATASETS[config["model"]].input_shape:
        raise PlanError(f"{config['model']} on {info.name}'s {info.input_shape} inputs: no preset shape")
    return model


def validate(run_dirs: Sequence[Path]) -> list[dict[str, Any]]:
    """Each run's record beside the plan for the same model, layout and batch (`validate_run`)."""
    results = []
    for run_dir in run_dirs:
        path = Path(run_dir) / "record.json"
        if not path.is_file():
            raise PlanError(f"{run_dir}: no record.json (give the --out folder of a run)")
        results.append({"run": str(run_dir), **validate_run(json.loads(path.read_text()))})
    return results


def validate_run(record: dict[str, Any]) -> dict[str, Any]:
    """[measured, planned] model states, activations and communication (bus bytes) of the run's rank 0 (a
    pipeline's: the plan's fullest rank), and its step time; on CPU, the plan's FLOPs over the measured
    time say what utilisation of the peak the run reached. {"skipped": why} where the plan has none."""
    impl, config, world = record["impl"]["name"], record["config"], record["world_size"]
    if impl not in IMPL_LAYOUT or record.get("status") != "completed":
        return {
            "impl": impl,
            "skipped": "not a completed run of an impl the plan lays out (nn.DataParallel: one process)",
        }
    precision = {"fp32": "fp32", "fp64": "fp64"}.get(config["precision"])
    if precision is None:
        return {
            "impl": impl,
            "skipped": f"--precision {config['precision']}: autocast has no activation formula",
        }
    options = config.get("extra") or {}
    training = Training(
        global_batch=config["global_batch_size"],
        micro_batch=1,
        precision=precision,
        optimizer=config["optimizer"],
        checkpointing=config["activation_checkpointing"],
        mfu=DEFAULT_MFU,
        grad_accum=options.get("microbatches") or config["grad_accum"],  # (a pipeline's: its micro-batches)
    )
    gpu = GPUS["cpu"] if record["environment"]["device"] == "cpu" else gpu_named(record["environment"])
    model = record_model(config)
    row = cost(IMPL_LAYOUT[impl](world, options), model, Cluster(gpu, world), training)
    rank = row.pipeline_rank or 0
    states = (record.get("model_state_bytes") or {rank: None})[rank]
    communication = ((record.get("communication") or {}).get("measured") or {rank: None})[rank]
    activations = ((record.get("activation_bytes") or {}).get("measured") or {rank: None})[rank]
    step_s = config["global_batch_size"] / record["samples_per_s"] if record.get("samples_per_s") else None
    flops = step_flops(model, training, world)
    return {
        "impl": impl,
        "layout": f"{row.strategy} {row.mesh}",
        "rank": rank,
        "model_states": [sum(states.values()) if states else None, row.memory_per_gpu_bytes["model_states"]],
        "activations": [activations, row.memory_per_gpu_bytes["activations"]],
        "communication_bus_bytes": [
            sum(entry.get("bus_bytes", 0) for entry in communication.values())
            if communication is not None
            else None,
            sum(row.communication_bytes.values()),
        ],
        "step_s": [step_s, row.step_s["overlap"]],
        "implied_mfu": flops / (peak(gpu, training.precision) * step_s) if flops and step_s else None,
    }


def gpu_named(environment: dict[str, Any]) -> GPU:
    name = (environment.get("device_name") or "").lower()
    for key, gpu in GPUS.items():
        if key != "cpu" and gpu.name.split()[0].lower() in name and gpu.name.split()[1][:2] in name:
            return gpu
    return dataclasses.replace(GPUS["h100-80gb"], name=environment.get("device_name") or "GPU")


def render_validation(results: list[dict[str, Any]]) -> str:
    def pair(values, fmt) -> str:
        measured, planned = values
        if measured is None or planned is None:
            return f"{fmt(measured)} vs {fmt(planned)}"
        ratio = planned / measured if measured else math.inf if planned else 1.0
        return f"{fmt(measured)} vs {fmt(planned)} ({ratio:.3f}×)"

    def size(n) -> str:
        return "—" if n is None else f"{n:,.0f} B"

    def secs(n) -> str:
        return "—" if n is None else f"{n:.3f} s"

    lines = ["measured vs planned (rank 0, a pipeline's fullest rank; planned ÷ measured in brackets)"]
    for r in results:
        if "skipped" in r:
            lines.append(f"{r['run']} ({r['impl']}): skipped: {r['skipped']}")
            continue
        mfu = "—" if r["implied_mfu"] is None else f"{r['implied_mfu']:.1%}"
        lines.append(
            f"{r['run']} ({r['impl']}, {r['layout']}, rank {r['rank']}): model states {pair(r['model_states'], size)}; "
            f"activations {pair(r['activations'], size)}; communication {pair(r['communication_bus_bytes'], size)} "
            f"bus bytes; step {pair(r['step_s'], secs)}, implied MFU {mfu}"
        )
    return "\n".join(lines)


# ---- --simulate: the plan's row run through the impl's own sharding on the fake process group -----------

SIMULATED_IMPL = {
    "ddp": "ddp",
    "fsdp": "fsdp",
    "hsdp": "fsdp",
    "tp": "tensor_parallel",
    "zero1": "deepspeed_zero",
}


REAL_TENSORS_LIMIT = 2 * GiB  # model states a simulation on real tensors (DDP, DeepSpeed) may build here


def simulation_of(layout: Layout, row: Row) -> tuple[str, list[str]] | str:
    """(impl, its options) that run `layout` in distref.simulate, or why there is none."""
    if layout.strategy in ("ddp", "fsdp"):
        return layout.strategy, []
    if layout.strategy == "hsdp":
        return "fsdp", ["--hsdp", str(layout.dp // layout.shard)]  # (--hsdp R: the replicas)
    if layout.strategy == "tp":
        return "tensor_parallel", ["--tp", str(layout.tp), "--dp-shard", str(layout.dp)]
    if layout.strategy in ("zero1", "zero2", "zero3"):
        return "deepspeed_zero", ["--zero-stage", layout.strategy[-1]]
    if layout.strategy.startswith("pp-"):
        schedule = layout.strategy.removeprefix("pp-")
        return "pipeline", [
            "--schedule",
            schedule,
            "--dp",
            str(layout.dp),
            "--microbatches",
            str(row.grad_accum),
        ]
    return f"{layout.strategy}: no simulation (distref.simulate's docstring says which impls run on it)"


def simulate_row(plan: Plan, row: Row) -> str:
    """Rank 0 of `row`'s layout at the plan's world size, on torch's fake process group (distref.simulate):
    its model states and one step's communication measured, beside the plan's in fp32 (the impls'
    precision; the plan's mixed-precision figures are the paper's)."""
    from distref.simulate import TENSORS, simulate

    layout = row.layout
    if plan.model.gpt is None:
        return "--simulate builds a decoder of the plan's shape: give --model 125m … 70b"
    found = simulation_of(layout, row)
    if isinstance(found, str):
        return found
    impl, options = found
    fp32 = dataclasses.replace(plan.training, precision="fp32")
    planned = cost(layout, plan.model, plan.cluster, fp32)
    if TENSORS[impl] == "real" and 16 * plan.model.parameters > REAL_TENSORS_LIMIT:
        return (
            f"{impl} runs on real tensors in a simulation (distref.simulate says why): "
            f"{gb(16 * plan.model.parameters)} of them is too much to build here; --simulate N picks another row"
        )
    world = layout.dp * layout.tp * layout.pp
    try:
        run = simulate(
            impl,
            world,
            plan.model.gpt,
            options=options,
            micro_batch=row.micro_batch,
            grad_accum=1 if impl == "pipeline" else row.grad_accum,
            optimizer=plan.training.optimizer,
            activation_checkpointing=plan.training.checkpointing,
        )
    except ValueError as e:
        return f"{impl} at {world} ranks: not simulated: {e}"
    states = sum(run.model_state_bytes.values())
    comm = sum(e["bus_bytes"] for e in run.communication.values())
    return (
        f"simulated {' '.join([impl, *options])} at {world} ranks (rank 0, fake process group, {run.seconds:.1f} s): "
        f"model states {states:,} B, plan (fp32) {planned.memory_per_gpu_bytes['model_states']:,.0f} B; "
        f"communication {comm:,.0f} bus bytes per step, plan {sum(planned.communication_bytes.values()):,.0f}"
    )


# ---- The command line -----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = OneLineErrorParser(prog="python -m distref.plan", description=__doc__.split("\n\n")[0])
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model", help=f"a preset ({', '.join(MODELS)}), lenet, resnet18, gpt, or module:function"
    )
    model.add_argument("--params", type=positive_int, help="a bare parameter count: model states only")
    model.add_argument("--seq", type=positive_int, help="sequence length (a preset's: 2048 or 4096)")
    model.add_argument(
        "--sample-shape", type=shape_of, help="module:function's input per sample, e.g. 3,224,224"
    )
    model.add_argument(
        "--tokens", action="store_true", help="module:function takes token ids (its sample: T)"
    )
    hw = parser.add_argument_group("hardware")
    hw.add_argument("--gpu", default="h100-80gb", help=f"one of {', '.join(GPUS)}")
    hw.add_argument("--gpus", type=positive_int, help="GPUs in all (default: one node's)")
    hw.add_argument("--nodes", type=positive_int, help="nodes (GPUs = nodes × GPUs per node)")
    hw.add_argument("--gpus-per-node", type=positive_int)
    hw.add_argument("--memory-gb", type=positive_float, help="memory per GPU, GB (10⁹ bytes)")
    hw.add_argument("--peak-tflops", type=positive_float, help="dense peak in the training's precision")
    hw.add_argument("--intra-node-gbps", type=positive_float, help="GB/s per GPU one way within a node")
    hw.add_argument("--inter-node-gbps", type=positive_float, help="GB/s per GPU one way between nodes")
    training = parser.add_argument_group("training")
    training.add_argument(
        "--global-batch", type=positive_int, default=256, help="samples (sequences) per step"
    )
    training.add_argument(
        "--micro-batch", type=positive_int, default=1, help="samples per GPU per micro-step"
    )
    training.add_argument(
        "--grad-accum", type=positive_int, help="micro-steps per step (sets the micro-batch)"
    )
    training.add_argument("--precision", choices=["mixed", "fp32"], default="mixed")
    training.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    training.add_argument("--activation-checkpointing", action="store_true")
    training.add_argument(
        "--mfu", type=fraction, default=DEFAULT_MFU, help="utilisation of peak while computing"
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="the ranked rows as a JSON list")
    out.add_argument("--md", action="store_true", help="a Markdown table")
    out.add_argument("--plot", type=Path, metavar="PNG", help="memory per GPU vs GPUs, step time by strategy")
    out.add_argument(
        "--simulate",
        nargs="?",
        const=1,
        type=positive_int,
        metavar="N",
        help="run row N's sharding (default: the first) on the fake process group",
    )
    parser.add_argument(
        "--validate", nargs="+", type=Path, metavar="RUN_DIR", help="runs' records against the plan"
    )
    args = parser.parse_args(argv)
    if args.validate is None and (args.model is None) == (args.params is None):
        parser.error("give --model NAME or --params N (not both), or --validate RUN_DIR…")
    return args


def shape_of(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: sizes separated by commas, e.g. 3,224,224") from None
    if not dims or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: sizes must be positive")
    return dims


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def fraction(text: str) -> float:
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"a fraction of the peak in (0, 1], got {text}")
    return value


def resolve_cluster(args: argparse.Namespace) -> Cluster:
    if args.gpu not in GPUS:
        raise PlanError(f"unknown GPU {args.gpu!r}: one of {', '.join(GPUS)} (and override its figures)")
    gpu = GPUS[args.gpu]
    overrides = {
        "gpus_per_node": args.gpus_per_node,
        "memory_bytes": args.memory_gb and int(args.memory_gb * 1e9),
        "intra_node_bytes_per_s": args.intra_node_gbps and args.intra_node_gbps * 1e9,
        "inter_node_bytes_per_s": args.inter_node_gbps and args.inter_node_gbps * 1e9,
    }
    gpu = dataclasses.replace(gpu, **{k: v for k, v in overrides.items() if v})
    if args.peak_tflops:
        peak = args.peak_tflops * 1e12
        gpu = dataclasses.replace(gpu, peak_flops={"mixed": peak, "fp32": peak})
    if args.memory_gb and gpu.memory_bytes <= RESERVED_BYTES:
        raise PlanError(
            f"--memory-gb {args.memory_gb}: not above the {RESERVED_BYTES / 1e9:.1f} GB each GPU keeps"
        )
    if args.nodes and args.gpus and args.gpus != args.nodes * gpu.gpus_per_node:
        raise PlanError(f"--gpus {args.gpus} is not --nodes {args.nodes} × {gpu.gpus_per_node} GPUs per node")
    gpus = args.gpus or (args.nodes or 1) * gpu.gpus_per_node
    if gpus > gpu.gpus_per_node and gpus % gpu.gpus_per_node:
        raise PlanError(f"{gpus} GPUs do not fill nodes of {gpu.gpus_per_node}: give whole nodes")
    return Cluster(gpu, gpus)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.validate:
            results = validate(args.validate)
            print(json.dumps(results, indent=1) if args.json else render_validation(results))
            return 0
        model, cluster = resolve_model(args), resolve_cluster(args)
        training = Training(
            global_batch=args.global_batch,
            micro_batch=args.micro_batch,
            precision=args.precision,
            optimizer=args.optimizer,
            checkpointing=args.activation_checkpointing,
            mfu=args.mfu,
            grad_accum=args.grad_accum,
        )
        plan = make_plan(model, cluster, training)
    except PlanError as e:
        print(f"python -m distref.plan: error: {e}", file=sys.stderr)
        return 2
    if not plan.rows:
        print(
            f"python -m distref.plan: error: no layout can run: {'; '.join(w for _, w in plan.skipped)}",
            file=sys.stderr,
        )
        return 2
    if args.json:
        print(json.dumps([row.as_dict() | {"rank": i} for i, row in enumerate(plan.rows, 1)], indent=1))
    elif args.md:
        print(render_markdown(plan))
    else:
        print(render_text(plan))
    if args.plot:
        plot(plan, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    if args.simulate:
        if args.simulate > len(plan.rows):
            print(
                f"python -m distref.plan: error: --simulate {args.simulate}: the plan has {len(plan.rows)} rows",
                file=sys.stderr,
            )
            return 2
        print(simulate_row(plan, plan.rows[args.simulate - 1]), file=sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
