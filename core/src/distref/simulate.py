"""One rank of a large job, run in this process: what it holds and what it communicates, beside the cost
model's formulas — the cost model checked at the world sizes users run (64, 512 ranks), not only at 2-4.

torch's fake process group (backend "fake", torch.testing._internal.distributed.fake_pg) plays one rank of
a world of any size: every collective and send/recv returns at once and moves nothing, so the impl's own
parallelization code (its `apply_*`, mesh and stage functions, those its pyproject.toml declares for the
tools: distref.impl_folders.TrainAPI) runs unchanged for that rank, patched nowhere, and one step's collectives are counted at the dispatcher as in a real run
(distref.training.traffic). The model is gpt (distref.models) of any shape (`GPTShape`, `PRESETS`: up to a
7B-like decoder). Its tensors hold no data where the impl's code allows it (`TENSORS`), which decides what
runs at real sizes:

- "fake" (FSDP2 / HSDP; tensor parallelism, 1-D and 2-D with FSDP2; context parallelism, ring or
  Ulysses, over FSDP2): the model is built and parallelized
  on the meta device, then materialized as fake tensors (FakeTensorMode: shapes, dtypes and a device, no
  storage, no arithmetic) with Module.to_empty, FSDP2's own path from meta; the steps run on fake tensors.
  A 7B-like model's step at 512 ranks takes seconds. Meta tensors alone would not do: FSDP2 refuses to
  run forward on meta parameters (FSDPParamGroup._validate_no_meta_params), and FSDP2 and DTensor on a
  "meta" device mesh find no device handle ("'NoneType' object has no attribute 'current_device'").
- "meta" (the pipeline): fake parameters cannot be moved by Module.to (torch.utils.swap_tensors: "Cannot
  swap t1 because it has weakref associated with it"), which the impl's apply_pipeline calls for each
  block of its example forward (to the device and back where it was: for meta tensors, nowhere). The fake
  backend is registered for "meta" too, for the schedule's batched send/recv.
- "real", so small shapes only (DDP, DeepSpeed ZeRO, expert parallelism's DDP of the rest): DDP's
  constructor reads the parameters' data (_verify_params_across_processes: "The tensor has a non-zero
  number of elements, but its data is not allocated yet"); DeepSpeed flattens their storage and reads the
  gradient norm with .item(); a mixture of experts' router counts its tokens per expert (torch.bincount,
  whose output's size is data: fake tensors refuse it) and reads them with .tolist(), as does the
  all-to-all dispatch its exchanged counts.

What the fake backend cannot play, and what is done instead (same calls, same bytes):
- its operations' futures hold nothing: DDP's reducer takes each bucket's all-reduce result from one
  ("expected the hook result is either a Tensor or a TensorList found None"): impls/ddp's and
  impls/expert_parallel's own comm hooks (`summing_hook`, the all-reduce as a sum) return the bucket they
  reduced in place instead; DDP's compression hooks (--comm-hook) are refused.
- its all-to-all cannot tell one rank what the others route: expert parallelism's exchange of routing
  counts (how many tokens each rank sends each expert) comes back as the input's first slot from every
  rank, and a rank whose experts are then sent nothing while it sends refuses the outputs' return.
  `SymmetricRouting` delivers it as if each rank of the group sent this one what this one sends it: every
  rank receives the rows it sends, uniform routing's expectation (distref.cost.expert_parallel's
  `uniform_routing`, the planner's); the tokens' all-to-alls, sized by those counts, then run as they are.
- its recv and all-to-all deliver nothing: context parallelism's ring attention computes on the key/value
  blocks it receives, and Ulysses on what its all-to-all returns, whatever they hold (their shapes are
  known before they arrive): both run as they are, counted as sent.
- its recv delivers nothing: torch 2.13's pipeline schedules start with a vote among the stages
  (_warmup_p2p: each says whether its shapes are static, the product travels to the last stage and back),
  which then comes out "dynamic", and the shape exchange that follows unpickles nothing (nor has a meta
  tensor an .item() to read the vote with). Every stage has its shapes given (the impl's stage examples),
  as in a real run, where the vote comes out "static": each stage answers it so (`with_static_vote`, given
  to apply_pipeline as its declared `wrap_stage` hook; the vote's 2·(p−1) one-integer messages are in
  the first step only). impls/model_parallel sends each tensor's shape before it: not simulated.
- its broadcast delivers nothing: DeepSpeed ZeRO-3 checks that every rank traced the same modules by
  broadcasting rank 0's list (assert_ints_same_as_other_ranks), which fails on any other rank. ZeRO-3 runs
  here as rank 0 only (its partitions are the same size on every rank).
- device meshes compare equal whichever rank holds them, and DTensor caches its sharding decisions by
  mesh: they are forgotten between simulations (`forget_sharding_decisions`).

Limits of the impls' own checks at these sizes: impls/pipeline balances its cut by trying every one of
C(blocks − 1, stages − 1) cuts (beyond `MAX_CUTS_TRIED`, give --partition: 32 blocks into 16 stages would
take hours); impls/tensor_parallel checks --tp against the default gpt's 4 heads, and
impls/context_parallel --cp against its heads and its data's sequence (here the simulated shape's heads
and sequence are checked instead, by the same rules).

`simulate` runs `steps` optimizer steps (forward, backward and optimizer step, --grad-accum micro-steps)
and counts the last: distref.training.traffic counts a run's third, as DDP rebuilds its buckets after the
first and ZeRO-3 records its trace in the first; FSDP2, DTensor and the pipeline schedules communicate the
same from the first step on here. It measures the rank's model states (distref.training.measure: DTensors'
local parts) and returns both beside what distref.cost predicts for the same shape and options, by the
function each impl's train.py calls (distref.cost's `*_cost`: one copy). The planner (`python -m distref.plan --simulate`)
runs a preset through the chosen impl's sharding the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._python_dispatch import TorchDispatchMode

from distref.config import MoEConfig, RunConfig
from distref.cost.context_parallel import context_parallel_cost
from distref.cost.counts import Counts, same
from distref.cost.data_parallel import ddp_rank_cost
from distref.cost.expert_parallel import expert_parallel_cost, uniform_routing
from distref.cost.pipeline import pipeline_rank_cost
from distref.cost.sharded import fsdp_rank_cost
from distref.cost.tensor_parallel import tensor_parallel_cost
from distref.cost.usage import Usage, model_usage, parameters_by_block, parameters_of
from distref.cost.zero import zero_rank_cost
from distref.data import DatasetInfo
from distref.distributed.partition import choose_cut_points, named_block_sizes
from distref.impl_folders import load_train_api
from distref.models import ROUTING, BlockModel, GPTConfig, gpt
from distref.training.device import autocast, param_dtype
from distref.training.measure import model_state_bytes, zero_model_state_bytes
from distref.training.optim import make_optimizer
from distref.training.steps import loss_fn
from distref.training.traffic import CountCommunication, add, describe

IMPLS_DIR = Path(__file__).resolve().parents[3] / "impls"  # core/src/distref/ → the repository's impls/

# What each impl's code runs on with the fake backend (the module docstring says why).
TENSORS = {
    "ddp": "real",
    "fsdp": "fake",
    "tensor_parallel": "fake",
    "context_parallel": "fake",
    "pipeline": "meta",
    "deepspeed_zero": "real",
    "expert_parallel": "real",
}
# Impls that run no collectives of their own in a step, or none on the fake backend: single and
# dataparallel (one process), model_parallel (its point-to-point handover sends each tensor's shape first,
# distref.distributed.send_tensor: a fake recv delivers none, so the receiver cannot build its buffer).
NOT_SIMULATED = ("single", "dataparallel", "model_parallel")
OPTIONS_CLASS = {
    "ddp": "DDPOptions",
    "fsdp": "FSDPOptions",
    "tensor_parallel": "TPOptions",
    "context_parallel": "CPOptions",
    "pipeline": "PipelineOptions",
    "deepspeed_zero": "ZeroOptions",
    "expert_parallel": "EPOptions",
}
MAX_CUTS_TRIED = 200_000  # impls/pipeline's balanced cut tries every cut: C(31, 15) ≈ 3·10⁸ never ends


@dataclasses.dataclass(frozen=True)
class GPTShape:
    """The shape of a gpt (distref.models): blocks, hidden width, heads, vocabulary, sequence length; with
    `experts`, each block's MLP a mixture of that many experts (distref.models.MoE), each token routed to
    `top_k` of them, each expert `expert_hidden` wide (None: 4 × hidden, as distref.models builds them)."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    experts: int = 0  # 0: dense MLPs
    top_k: int = 2
    expert_hidden: int | None = None

    @property
    def expert_width(self) -> int:
        """Each expert's hidden width (its MLP: hidden → width → hidden)."""
        return self.expert_hidden or 4 * self.hidden

    def config(self) -> GPTConfig:
        """distref.models' configuration of this shape; ValueError for experts of another width than the
        4 × hidden distref.models builds."""
        if self.experts and self.expert_width != 4 * self.hidden:
            raise ValueError(
                f"distref.models builds experts 4 × {self.hidden} wide, not {self.expert_width}: a shape "
                "to build has expert_hidden None"
            )
        moe = MoEConfig(self.experts, self.top_k) if self.experts else None
        return GPTConfig(
            self.vocab, self.seq, n_layer=self.layers, n_head=self.heads, n_embd=self.hidden, moe=moe
        )

    def parameters(self) -> int:
        """Parameter count: the embeddings, 12h² + 12h per block (q, k, v, proj, a 4h MLP, two layer
        norms; k has no bias), the head's layer norm and output layer. A mixture of experts' block has,
        instead of the MLP's 8h² + 5h, a router (E × h) and E experts of width f (2hf + f + h each)."""
        h, e, f = self.hidden, self.experts, self.expert_width
        mlp = e * h + e * (2 * h * f + f + h) if e else 8 * h * h + 5 * h
        block = 4 * h * h + 7 * h + mlp
        return (self.vocab + self.seq) * h + self.layers * block + 2 * h + self.vocab * h


# gpt-1.3b: GPT-3 XL's sizes (24 × 2048, GPT-2's vocabulary), 1.42B parameters; gpt-7b: Llama-7B's sizes
# (32 × 4096, 32000 tokens, 4096 positions), 6.72B parameters in gpt's layout (GELU MLP of 4h, biases).
PRESETS = {
    "gpt-tiny": GPTShape(layers=2, hidden=64, heads=4, vocab=11, seq=16),  # what --model gpt trains
    "gpt-1.3b": GPTShape(layers=24, hidden=2048, heads=16, vocab=50257, seq=2048),
    "gpt-7b": GPTShape(layers=32, hidden=4096, heads=32, vocab=32000, seq=4096),
}


@dataclasses.dataclass
class Simulation:
    """One rank's step, measured and predicted: communication ({kind: {"calls", "bytes", "bus_bytes"}})
    and model-state bytes ({"parameters", "gradients", "optimizer"}); `facts`: the mesh, the stages, the
    parameters in all."""

    impl: str
    world_size: int
    rank: int
    shape: GPTShape
    tensors: str
    communication: Counts
    communication_predicted: Counts | None
    model_state_bytes: dict[str, int]
    model_state_bytes_predicted: dict[str, int] | None
    facts: dict[str, Any]
    seconds: float = 0.0

    def differences(self) -> list[str]:
        """What differs between measurement and formula (calls and bytes exactly, bus bytes to rounding)."""
        found = []
        if not same(self.communication, self.communication_predicted):
            found.append(
                f"communication: measured {self.communication}, predicted {self.communication_predicted}"
            )
        if self.model_state_bytes != self.model_state_bytes_predicted:
            found.append(
                f"model states: measured {self.model_state_bytes}, "
                f"predicted {self.model_state_bytes_predicted}"
            )
        return found

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Outcome(NamedTuple):
    """What a runner returns: the counted step's communication and the model states after it, measured,
    and the formulas' for the same; `facts` about the layout (mesh, stages)."""

    communication: Counts
    model_state_bytes: dict[str, int]
    communication_predicted: Counts | None
    model_state_bytes_predicted: dict[str, int] | None
    facts: dict[str, Any]


class CountSimulated(CountCommunication):
    """CountCommunication that also counts collectives on fake tensors: here the whole step runs on them
    (the real runs' counter leaves them out: there they are only DTensor's shape propagation)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # A tensor subclass (DTensor, FSDP2's parameters) first turns its operation into plain ones: those
        # come back here and are counted.
        if any(t not in (torch.Tensor, torch.nn.Parameter) and not issubclass(t, FakeTensor) for t in types):
            return NotImplemented
        if isinstance(func, torch._ops.OpOverload) and (seen := describe(func, args)) is not None:
            add(self.counts, *seen)
        return func(*args, **(kwargs or {}))


class SymmetricRouting(TorchDispatchMode):
    """Expert parallelism's exchange of routing counts (an all-to-all of integers: how many tokens each
    rank sends each expert) delivered as if every rank of the group sent this rank what this rank sends
    it: a symmetric routing, in which each rank receives as many rows as it sends (uniform routing's
    expectation, distref.cost.expert_parallel.uniform_routing). One process cannot know how the other
    ranks route, and the fake backend fills an all-to-all's output with the input's first slot from every
    rank: the sizes that follow would be another rank's, and where a rank's experts are sent nothing while
    it sends tokens, the backend refuses the outputs' return ("inputBuffer is empty"). The tokens'
    all-to-alls, sized by these counts, run as they are."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # (a tensor subclass's operation: its plain ones come back here; DTensor's shape propagation on
        # fake tensors runs as it is)
        if any(t not in (torch.Tensor, torch.nn.Parameter) and not issubclass(t, FakeTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if func is torch.ops._c10d_functional.all_to_all_single.default and not args[0].is_floating_point():
            out.copy_(args[0])  # (from rank r of the group: what this rank sends rank r)
        return out


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """This process as rank `rank` of `world_size`, on torch's fake backend (for CPU and meta tensors)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # (registers the "fake" backend)

    forget_sharding_decisions()
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        if dist.is_initialized():  # (DeepSpeed's runner destroys it itself)
            dist.destroy_process_group()
        forget_sharding_decisions()


def forget_sharding_decisions() -> None:
    """Empty DTensor's caches of sharding decisions. They are keyed by device meshes, which compare equal
    whichever rank holds them (one process is one rank in a real job): a simulation as rank 0 after one as
    rank 511 of the same mesh would reuse rank 511's local shapes ("shape '[1, 512, 0]' is invalid for
    input of size 1024")."""
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _gen_transform_infos.cache_clear()


def build(shape: GPTShape, tensors: str, cfg: RunConfig) -> BlockModel:
    """gpt of `shape`: on the meta device, to be parallelized there ("fake", "meta"), or real on the CPU."""
    with torch.device("meta") if tensors in ("fake", "meta") else contextlib.nullcontext():
        model = gpt(shape.config())
    model.activation_checkpointing = cfg.activation_checkpointing  # (as every impl sets it)
    return model


@contextlib.contextmanager
def step_tensors(tensors: str, model: torch.nn.Module) -> Iterator[None]:
    """Where the steps run. "fake": the model, parallelized on the meta device (FSDP2 chunks each parameter
    into a shard per rank: cheap on meta, slow for fake tensors at 512 ranks), is materialized as fake
    tensors (Module.to_empty, FSDP2's own path from meta) in a FakeTensorMode, and everything inside is
    fake. "meta": tensors created inside are on the meta device. "real": as they are."""
    if tensors == "fake":
        with FakeTensorMode(allow_non_fake_inputs=True):  # (to_empty reads the meta parameters)
            model.to_empty(device="cpu")
            yield
    elif tensors == "meta":
        with torch.device("meta"):
            yield
    else:
        yield


def device_of(tensors: str) -> torch.device:
    """The device the impl's functions are given (fake tensors pass for CPU ones)."""
    return torch.device("meta" if tensors == "meta" else "cpu")


def strategy_options(module, impl: str, argv: Sequence[str]):
    """The impl's own options (its `add_options`, its defaults) from `argv`, as its options dataclass."""
    parser = argparse.ArgumentParser(prog=f"{impl} (simulated)")
    module.add_options(parser)
    known, unknown = parser.parse_known_args(list(argv))
    if unknown:
        raise ValueError(
            f"{impl} has no option {' '.join(unknown)} (its own options only: {parser.format_usage()})"
        )
    return getattr(module, OPTIONS_CLASS[impl])(**vars(known))


def data_parallel_degree(impl: str, module, options, world_size: int) -> int:
    """How many ranks (or groups of ranks) each take their own slice of the global batch."""
    if impl in ("tensor_parallel", "context_parallel"):  # (the data-parallel groups of its 2-D mesh)
        return module.mesh_shape(options, world_size)[0]
    if impl == "pipeline":
        return options.dp * options.microbatches  # each pipeline's batch is cut into micro-batches
    return world_size


def check(impl: str, module, cfg: RunConfig, shape: GPTShape, world_size: int, rank: int) -> str | None:
    """What the impl's own check_options says (tensor_parallel, context_parallel: the simulated shape's heads
    and sequence instead of the default gpt's), and what the fake backend cannot run; None if the
    simulation can run."""
    if not 0 <= rank < world_size:
        return f"rank {rank} is not one of the {world_size} ranks"
    options = cfg.strategy
    if shape.experts and impl != "expert_parallel":
        return f"gpt's mixture of {shape.experts} experts is trained by impls/expert_parallel alone here"
    if impl == "expert_parallel" and shape.experts:
        if shape.expert_width != 4 * shape.hidden:
            return f"distref.models builds experts 4 × {shape.hidden} wide, not {shape.expert_width}"
        if shape.top_k > shape.experts:
            return f"top-{shape.top_k} routing sends each token to more experts than the {shape.experts}"
    if impl == "tensor_parallel":
        dp, tp = module.mesh_shape(options, world_size)
        if dp * tp != world_size:
            return f"--dp-shard {dp} × --tp {tp} = {dp * tp} ranks, but the world has {world_size}"
        if shape.heads % tp:
            return f"--tp {tp} must divide the {shape.heads} attention heads"
        if options.sequence_parallel and shape.seq % tp:  # (a rank without a position fails to reshape)
            return (
                f"--sequence-parallel splits the {shape.seq} positions over the --tp {tp} ranks: not evenly"
            )
        return None
    if impl == "context_parallel":  # (impls/context_parallel's check_options, on the simulated shape)
        dp, cp = module.mesh_shape(options, world_size)
        if dp * cp != world_size:
            return f"--dp-shard {dp} × --cp {cp} = {dp * cp} ranks, but the world has {world_size}"
        if options.cp_mode == "ring" and shape.seq % (2 * cp):
            return f"ring attention cuts the {shape.seq} positions into 2 × --cp {cp} chunks: not evenly"
        if options.cp_mode == "ulysses" and (shape.heads % cp or shape.seq % cp):
            return (
                f"Ulysses: --cp {cp} must divide the {shape.heads} attention heads and {shape.seq} positions"
            )
        if cfg.precision == "fp16":
            return "--precision fp16 is not supported with context parallelism (no sharded loss scaler)"
        return None
    if impl == "pipeline":
        stages = world_size // options.dp * options.stages_per_rank
        cuts = math.comb(shape.layers + 1, stages - 1) if stages <= shape.layers + 2 else 0
        if options.partition is None and cuts > MAX_CUTS_TRIED:
            return (
                f"impls/pipeline would try all {cuts:,} cuts of {shape.layers + 2} blocks into {stages} "
                "stages to balance them: give --partition"
            )
        if cfg.precision != "fp32":
            return "the pipeline runs on meta tensors here, which have no autocast: fp32 only"
    if impl == "ddp" and options.comm_hook != "none":
        return (
            f"--comm-hook {options.comm_hook} reads the all-reduce's result: the fake backend leaves it empty"
        )
    if impl == "deepspeed_zero" and options.zero_stage == 3 and rank != 0:
        return (
            "DeepSpeed ZeRO-3 runs on the fake backend as rank 0 only (its trace check broadcasts rank 0's)"
        )
    return module.check_options(cfg, world_size)


def simulate(
    impl: str,
    world_size: int,
    shape: GPTShape,
    *,
    rank: int = 0,
    options: Sequence[str] = (),
    micro_batch: int = 1,
    grad_accum: int = 1,
    optimizer: str = "adamw",
    precision: str = "fp32",
    weight_decay: float = 0.0,
    activation_checkpointing: bool = False,
    steps: int | None = None,
    tensors: str | None = None,
    impls_dir: Path = IMPLS_DIR,
) -> Simulation:
    """Rank `rank` of `world_size` running `impl` (its own command-line `options`, e.g. ["--hsdp", "8"]) on
    gpt of `shape` (a mixture of experts where `shape.experts`: expert_parallel's): `micro_batch` sequences
    per rank (tensor_parallel, context_parallel: per data-parallel group; pipeline: per micro-batch) and
    micro-step, `steps` optimizer steps (default: 3 where DDP runs and for DeepSpeed, 2 for the others),
    the last counted. `tensors` ("fake", "meta", "real"; default TENSORS[impl]) chooses what the
    model is built of. Raises ValueError where the impl or the fake backend cannot run it."""
    if impl not in TENSORS:
        why = " (distref.simulate's docstring says why)" if impl in NOT_SIMULATED else ""
        raise ValueError(f"no simulation for impl {impl!r}{why}; one of: {', '.join(TENSORS)}")
    module = load_train_api(Path(impls_dir) / impl / "train.py")  # what the impl declares for the tools
    own = strategy_options(module, impl, options)
    degree = data_parallel_degree(impl, module, own, world_size)
    settles_after_one_step = ("ddp", "deepspeed_zero", "expert_parallel")  # (DDP's buckets, ZeRO-3's trace)
    steps = steps or (3 if impl in settles_after_one_step else 2)
    cfg = RunConfig(
        model="gpt",
        gpt_layers=shape.layers,
        dataset="synthetic",
        experts=shape.experts,
        top_k=shape.top_k,
        steps=steps,
        global_batch_size=micro_batch * degree * (1 if impl == "pipeline" else grad_accum),
        optimizer=optimizer,
        weight_decay=weight_decay,
        precision=precision,
        grad_accum=grad_accum,
        activation_checkpointing=activation_checkpointing,
        device="cpu",
        strategy=own,
    )
    if module.declares(
        "resolved"
    ):  # defaults that depend on the model or schedule (tensor_parallel, pipeline)
        cfg = module.resolved(cfg)
    if problem := check(impl, module, cfg, shape, world_size, rank):
        raise ValueError(f"{impl} at {world_size} ranks: {problem}")
    tensors = tensors or TENSORS[impl]
    started = time.perf_counter()
    with fake_world(world_size, rank):
        outcome = RUNNERS[impl](module, cfg, shape, world_size, rank, tensors, steps)
    return Simulation(
        impl=impl,
        world_size=world_size,
        rank=rank,
        shape=shape,
        tensors=tensors,
        communication=outcome.communication,
        communication_predicted=outcome.communication_predicted,
        model_state_bytes=outcome.model_state_bytes,
        model_state_bytes_predicted=outcome.model_state_bytes_predicted,
        facts={"parameters": shape.parameters(), **outcome.facts},
        seconds=time.perf_counter() - started,
    )


# ---- Each impl's step, run with its own functions, and the cost function its train.py calls


def gpt_usage(shape: GPTShape) -> Usage:
    """Which parameters of gpt of `shape` a step trains (distref.cost.usage, as each train.py finds it for
    its model: one forward and backward on the meta device): all of them."""
    info = DatasetInfo("synthetic", shape.vocab, (shape.seq,), "sequence")
    return model_usage("gpt", info, shape.layers, shape.config().moe)


def batch(shape: GPTShape, sequences: int) -> torch.Tensor:
    """Token ids (zeros) for `sequences` sequences, on the current tensor context's device: input and
    target alike (their values do not change what is communicated)."""
    return torch.zeros(sequences, shape.seq, dtype=torch.long)


def run_steps(
    steps: int, step: Callable[[], None], optimizer: torch.optim.Optimizer, params: Callable
) -> tuple[Counts, dict[str, int]]:
    """`steps` optimizer steps of `step` (forward and backward of every micro-step), the last counted
    (optimizer step included); the model states measured after it, before zero_grad."""
    counts: Counts = {}
    for index in range(steps):
        counting = index == steps - 1
        with CountSimulated(counts) if counting else contextlib.nullcontext():
            step()
            optimizer.step()
        if counting:
            states = model_state_bytes(params(), optimizer)
        optimizer.zero_grad(set_to_none=True)
    return counts, states


def run_ddp(module, cfg, shape, world_size, rank, tensors, steps) -> Outcome:
    device = device_of(tensors)
    options = cfg.strategy
    usage = gpt_usage(shape)
    model = module.apply_ddp(build(shape, tensors, cfg), options, device, rank, usage)  # (its hook: the sum)
    with step_tensors(tensors, model):
        optimizer = make_optimizer(cfg, model.parameters())
        x = batch(shape, cfg.global_batch_size // (world_size * cfg.grad_accum))

        def step() -> None:
            for micro_step in range(cfg.grad_accum):
                last = micro_step == cfg.grad_accum - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    with autocast(cfg, device):
                        loss = loss_fn(model(x), x)
                    (loss / cfg.grad_accum).backward()

        counts, states = run_steps(steps, step, optimizer, model.parameters)
    predicted = ddp_rank_cost(  # as impls/ddp/train.py calls it
        parameters_of(model.module.named_parameters(), usage),
        [(str(b.dtype), b.numel() * b.element_size()) for b in model.module.buffers()],
        world_size,
        bucket_cap_mb=options.bucket_cap_mb,
        comm_hook=options.comm_hook,
        find_unused_parameters=options.find_unused_parameters,
        static_graph=options.static_graph,
        optimizer=cfg.optimizer,
        step_bytes=torch.get_default_dtype().itemsize,
        unknown=usage.unknown,
    )
    return Outcome(counts, states, predicted.communication, predicted.model_states, {})


def sharded_step(model, cfg: RunConfig, x: torch.Tensor, device, loss_context=contextlib.nullcontext):
    """One optimizer step's micro-steps on an FSDP2-sharded model: gradients reduced at the last only."""

    def step() -> None:
        for micro_step in range(cfg.grad_accum):
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(micro_step == cfg.grad_accum - 1)
            with loss_context():
                with autocast(cfg, device):
                    loss = loss_fn(model(x), x)
                (loss / cfg.grad_accum).backward()

    return step


def run_fsdp(module, cfg, shape, world_size, rank, tensors, steps) -> Outcome:
    device = device_of(tensors)
    options = cfg.strategy
    mesh = module.make_mesh(world_size, options.hsdp, device)
    reshard = module.reshards_after_forward(options.reshard_after_forward, mesh)
    model = module.apply_fsdp(
        build(shape, tensors, cfg),
        mesh,
        reshard_after_forward=reshard,
        cpu_offload=options.cpu_offload,
        precision=cfg.precision,
        device=device,
    )
    with step_tensors(tensors, model):
        optimizer = make_optimizer(cfg, model.parameters())
        x = batch(shape, cfg.global_batch_size // (world_size * cfg.grad_accum))
        counts, states = run_steps(steps, sharded_step(model, cfg, x, device), optimizer, model.parameters)
    usage = gpt_usage(shape)
    policy, shards = module.mixed_precision(cfg.precision), mesh["shard"]
    predicted = fsdp_rank_cost(  # as impls/fsdp/train.py calls it
        parameters_by_block(model, usage),
        shards.size(),
        shards.get_local_rank(),
        replicas=options.hsdp,
        reshard_after_forward=reshard,
        dtype=param_dtype(cfg),
        gather_dtype=policy.param_dtype,
        reduce_dtype=policy.reduce_dtype,
        grad_accum=cfg.grad_accum,
        optimizer=cfg.optimizer,
        step_bytes=torch.get_default_dtype().itemsize,
        unknown=usage.unknown,
    )
    facts = {"mesh": dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True))}
    return Outcome(counts, states, predicted.communication, predicted.model_states, facts)


def run_tensor_parallel(module, cfg, shape, world_size, rank, tensors, steps) -> Outcome:
    device = device_of(tensors)
    options = cfg.strategy
    dp, tp = module.mesh_shape(options, world_size)
    mesh = module.make_mesh(dp, tp, device)
    loss_context = loss_parallel if options.loss_parallel else contextlib.nullcontext
    model = module.parallelize(
        build(shape, tensors, cfg),
        mesh,
        sequence_parallel=options.sequence_parallel,
        loss_parallel=options.loss_parallel,
    )
    with step_tensors(tensors, model):
        optimizer = make_optimizer(cfg, model.parameters())
        x = batch(shape, cfg.global_batch_size // (dp * cfg.grad_accum))
        step = sharded_step(model, cfg, x, device, loss_context)
        counts, states = run_steps(steps, step, optimizer, model.parameters)
    predicted = tensor_parallel_cost(  # as impls/tensor_parallel/train.py calls it, for this shape
        "gpt",
        DatasetInfo("synthetic", shape.vocab, (shape.seq,), "sequence"),
        layers=shape.layers,
        hidden=shape.hidden,
        heads=shape.heads,
        tp=tp,
        tp_rank=mesh["tp"].get_local_rank(),
        dp_shard=dp,
        dp_rank=mesh["dp_shard"].get_local_rank(),
        micro_batch=cfg.global_batch_size // (dp * cfg.grad_accum),
        grad_accum=cfg.grad_accum,
        sequence_parallel=options.sequence_parallel,
        loss_parallel=options.loss_parallel,
        optimizer=cfg.optimizer,
        weight_decay=cfg.weight_decay,
        precision=cfg.precision,
        element_bytes=param_dtype(cfg).itemsize,
        step_bytes=torch.get_default_dtype().itemsize,
        activation_checkpointing=cfg.activation_checkpointing,
    )
    facts = {"mesh": {"dp_shard": dp, "tp": tp}}
    return Outcome(counts, states, predicted.communication, predicted.model_states, facts)


def run_context_parallel(module, cfg, shape, world_size, rank, tensors, steps) -> Outcome:
    device = device_of(tensors)
    options = cfg.strategy
    dp, cp = module.mesh_shape(options, world_size)
    mesh = module.make_mesh(dp, cp, device)
    # as impls/context_parallel/train.py finds it: the mesh's cp dimension is the innermost, so rank r
    # holds slice r % C of its group's sequences (test_context_parallel checks it)
    cp_rank = mesh["cp"].get_local_rank()
    positions = module.slice_positions(shape.seq, cp, cp_rank, load_balanced=options.cp_mode == "ring")
    model = module.parallelize(
        build(shape, tensors, cfg), mesh, mode=options.cp_mode, positions=positions, precision=cfg.precision
    )
    micro_batch = cfg.global_batch_size // (dp * cfg.grad_accum)
    with step_tensors(tensors, model):
        optimizer = make_optimizer(cfg, model.parameters())
        x = batch(shape, micro_batch)[:, positions]  # this rank's tokens of its group's sequences
        counts, states = run_steps(steps, sharded_step(model, cfg, x, device), optimizer, model.parameters)
    predicted = context_parallel_cost(  # as impls/context_parallel/train.py calls it, for this shape
        mode=options.cp_mode,
        cp=cp,
        dp_shard=dp,
        shard_rank=rank,  # (FSDP2 shards over every rank, in rank order)
        layers=shape.layers,
        hidden=shape.hidden,
        heads=shape.heads,
        vocabulary=shape.vocab,
        sequence=shape.seq,
        micro_batch=micro_batch,
        grad_accum=cfg.grad_accum,
        optimizer=cfg.optimizer,
        precision=cfg.precision,
        element_bytes=param_dtype(cfg).itemsize,
        step_bytes=torch.get_default_dtype().itemsize,
        activation_checkpointing=cfg.activation_checkpointing,
    )
    facts = {"mesh": {"dp_shard": dp, "cp": cp}, "cp_rank": cp_rank}
    return Outcome(counts, states, predicted.communication, predicted.model_states, facts)


def with_static_vote(stage):
    """`stage` as the fake backend can run it: its part in the schedule's warm-up vote (each stage says
    whether its shapes are static; the product travels to the last stage and back, where torch 2.13 reads
    it with .item()) answered as a real run's is when every stage's shapes are given, as the impl gives
    them: static. The fake backend's recv delivers nothing (the vote would come out "dynamic", and the
    shape exchange that follows unpickles nothing), and meta tensors have no .item(). Given to the impl's
    apply_pipeline as its `wrap_stage`; the vote's 2·(p−1) one-integer messages are in the first step
    only, which is not counted."""
    static = torch.ones(1, dtype=torch.int32, device="cpu")  # (not the meta default of the steps)
    stage._warmup_forward_vote = lambda has_backward, received_acc=None: static
    stage._warmup_backward_result = lambda received_result=None: static
    return stage


def run_pipeline(module, cfg, shape, world_size, rank, tensors, steps) -> Outcome:
    device = device_of(tensors)
    options = cfg.strategy
    v = options.stages_per_rank  # (resolved: the schedule's where not given)
    mesh = module.pipeline_mesh(device, world_size, dp=options.dp, schedule=options.schedule, v=v)
    blocks = named_block_sizes("gpt", shape.layers)
    cuts = choose_cut_points(blocks, options.partition, mesh.n_stages, "gpt")[0]
    micro_batch = cfg.global_batch_size // (options.dp * options.microbatches)
    model = build(shape, tensors, cfg)
    with step_tensors(tensors, model):
        x = batch(shape, micro_batch * options.microbatches)  # the pipeline's batch
        pipeline = module.apply_pipeline(
            model,
            mesh,
            cuts=cuts,
            schedule=options.schedule,
            microbatches=options.microbatches,
            example=x[:micro_batch],
            device=device,
            precision=cfg.precision,
            activation_checkpointing=cfg.activation_checkpointing,
            wrap_stage=with_static_vote,
        )
        held = pipeline.model
        optimizer = make_optimizer(cfg, held.parameters())

        def step() -> None:  # as impls/pipeline/train.py's step, then the --dp sum
            pipeline.step(x, x, scored=x.numel())
            if options.dp > 1:
                module.sync_pipelines(held, mesh.dp_group)

        counts, states = run_steps(steps, step, optimizer, held.parameters)
    usage = gpt_usage(shape)
    predicted = pipeline_rank_cost(  # as impls/pipeline/train.py calls it
        [out.numel() * out.element_size() for _, out in pipeline.examples[:-1]],
        mesh.my_stages,
        mesh.owner,
        options.microbatches,
        parameters=parameters_of(held.named_parameters(), usage),
        buffer_bytes=[b.numel() * b.element_size() for b in held.buffers()],
        dp=options.dp,
        optimizer=cfg.optimizer,
        step_bytes=torch.get_default_dtype().itemsize,
        unknown=usage.unknown,
    )
    facts = {"mesh": {"dp": options.dp, "pp": mesh.p}, "cuts": cuts, "stages": sorted(mesh.my_stages)}
    return Outcome(counts, states, predicted.communication, predicted.model_states, facts)


def run_deepspeed_zero(module, cfg, shape, world_size, rank, tensors, steps) -> Outcome:
    if tensors != "real":
        raise ValueError("DeepSpeed runs on real tensors only (it flattens their storage)")
    device = device_of(tensors)
    stage = cfg.strategy.zero_stage
    local_rank = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"  # read by DeepSpeed's checks (one device per process)
    # DeepSpeed's ZeRO-3 replaces F.linear for the whole process (by its zero3_linear_wrap, whose backward
    # readies a Linear's gradients in another order: a later DDP in this process then builds other
    # buckets). A run's own process may keep it; one simulation among others must not.
    linear = torch.nn.functional.linear
    deepspeed = module.init_deepspeed(cfg, device, "fake")
    try:
        model = gpt(shape.config())
        optimizer = make_optimizer(cfg, model.parameters())
        config = module.deepspeed_config(cfg, world_size)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        x = batch(shape, cfg.global_batch_size // (world_size * cfg.grad_accum))
        counts: Counts = {}
        for index in range(steps):
            counting = index == steps - 1
            with CountSimulated(counts) if counting else contextlib.nullcontext():
                for micro_step in range(cfg.grad_accum):
                    engine.backward(loss_fn(engine(x), x))
                    if counting and micro_step == cfg.grad_accum - 1:  # before step() frees the gradients
                        states = zero_model_state_bytes(engine, optimizer)
                    engine.step()
        # which parameters train, traced as the impl's train.py traces it: under DeepSpeed's F.linear
        usage = gpt_usage(shape)
    finally:
        deepspeed.comm.destroy_process_group()  # and DeepSpeed's own references to its groups
        torch.nn.functional.linear = linear
        if local_rank is None:
            os.environ.pop("LOCAL_RANK")
        else:
            os.environ["LOCAL_RANK"] = local_rank
    zero = config["zero_optimization"]
    predicted = zero_rank_cost(  # as impls/deepspeed_zero/train.py calls it
        parameters_of(model.named_parameters(), usage),
        world_size,
        rank,
        stage,
        bucket_elements=zero["reduce_bucket_size"],
        prefetch_elements=zero.get("stage3_prefetch_bucket_size", 0),
        grad_accum=cfg.grad_accum,
        precision=cfg.precision,
        offload=cfg.strategy.offload_optimizer or cfg.strategy.offload_params,
        optimizer=cfg.optimizer,
        step_bytes=torch.get_default_dtype().itemsize,
        unknown=usage.unknown,
    )
    return Outcome(counts, states, predicted.communication, predicted.model_states, {"zero_stage": stage})


def run_expert_parallel(module, cfg, shape, world_size, rank, tensors, steps) -> Outcome:
    device = device_of(tensors)
    ep = cfg.strategy.ep or world_size
    mesh = module.make_mesh(world_size, ep, device)
    model = module.parallelize(build(shape, tensors, cfg), mesh, device)  # (its experts, then DDP)
    micro_batch = cfg.global_batch_size // (world_size * cfg.grad_accum)
    try:
        with SymmetricRouting(), step_tensors(tensors, model):
            optimizer = make_optimizer(cfg, model.parameters())
            x = batch(shape, micro_batch)

            def step() -> None:  # as impls/expert_parallel/train.py's step
                for micro_step in range(cfg.grad_accum):
                    last = micro_step == cfg.grad_accum - 1
                    with contextlib.nullcontext() if last else model.no_sync():
                        with autocast(cfg, device):
                            loss = loss_fn(model(x), x)
                        (loss / cfg.grad_accum).backward()
                module.all_reduce_expert_gradients(model.module, mesh)

            counts, states = run_steps(steps, step, optimizer, model.parameters)
    finally:
        ROUTING.take()  # (what the routers logged: no run's steps)
    usage = gpt_usage(shape)
    # Symmetric routing (SymmetricRouting): each rank receives the rows it sends, uniform routing's
    # expectation; one rank holding every expert (--ep 1) sends none (no all-to-all)
    tokens = micro_batch * shape.seq
    routed = uniform_routing(tokens, shape.top_k, shape.layers, cfg.grad_accum) if ep > 1 else []
    communication, model_states = expert_parallel_cost(  # as impls/expert_parallel/train.py costs it
        [(name, tuple(p.shape)) for name, p in model.module.named_parameters()],  # (DTensors: whole shapes)
        world_size=world_size,
        ep=ep,
        experts=shape.experts,
        hidden=shape.hidden,
        routed=routed,
        precision=cfg.precision,
        checkpointed=cfg.activation_checkpointing,
        optimizer=cfg.optimizer,
        gradient_order=None if usage.unknown else usage.gradient_order,
        step_bytes=torch.get_default_dtype().itemsize,
    )
    facts = {"mesh": {"ep_replicate": world_size // ep, "ep": ep}, "ep_rank": mesh["ep"].get_local_rank()}
    return Outcome(counts, states, communication, model_states, facts)


RUNNERS = {
    "ddp": run_ddp,
    "fsdp": run_fsdp,
    "tensor_parallel": run_tensor_parallel,
    "context_parallel": run_context_parallel,
    "pipeline": run_pipeline,
    "deepspeed_zero": run_deepspeed_zero,
    "expert_parallel": run_expert_parallel,
}
