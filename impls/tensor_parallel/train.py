"""Tensor parallelism (Megatron-LM's layout, with torch.distributed.tensor.parallel): every layer of gpt
split across ranks, which all see the same batch; optionally 2-D with FSDP2 (`--dp-shard D --tp T`).

Every rank runs this file, started by torchrun or by `python train.py`, which checks the arguments and
then starts the ranks through torch's own launcher (torch.distributed.run). Within a tensor-parallel group
of T ranks, each attention layer's query/key/value projections are split by output rows (ColwiseParallel:
each rank computes n_head / T whole heads) and its output projection by input columns (RowwiseParallel:
each rank's partial product, summed across the group); the MLP likewise (first linear by rows, second by
columns): one all-reduce per layer in forward and one in backward. With sequence parallelism the layer
norms and residual stream are split along the sequence instead of repeated, the all-reduces becoming an
all-gather before and a reduce-scatter after each layer. With loss parallelism the logits stay split over
the vocabulary into the cross-entropy. `--dp-shard D` adds a data-parallel dimension: D groups, each on
its slice of the global batch, sharding the (already split) parameters over the groups with FSDP2.

    python impls/tensor_parallel/train.py --nproc-per-node 2 --model gpt --dataset synthetic --steps 600
    python impls/tensor_parallel/train.py --nproc-per-node 4 --dp-shard 2 --tp 2 --model gpt --dataset synthetic
    torchrun --standalone --nproc-per-node 2 impls/tensor_parallel/train.py --model gpt --dataset text --data-root input.txt
    nox -s tensor_parallel-cpu / nox -s tensor_parallel-gpu

Changes against impls/single/train.py are marked `# --- TP: ... ---`.
"""

import argparse
import contextlib
import dataclasses
import logging

import torch
import torch.distributed as dist  # --- TP ---
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from distref import impl_version
from distref.cli import exit_on_bad_input, parse_config
from distref.config import (
    RunConfig,
    exit_after_rank_0_spoke,
    fail,
    first_line,
    is_factory,
    positive_int,
    under_torchrun,
)
from distref.cost import Predicted
from distref.cost.activations import no_formula
from distref.cost.tensor_parallel import (
    planned_model_states,
    planned_split,
    tensor_parallel,
    tensor_parallel_model_states,
)
from distref.cost.tp_activations import tensor_parallel_activation_bytes
from distref.cost.usage import model_usage
from distref.data import (
    DatasetInfo,
    TensorData,
    eval_batches,
    load_dataset,
    scored_targets,
    steps_per_epoch,
    train_loader,
)
from distref.distributed import (
    all_reduce_sum,
    check_ranks_agree,
    destroy_process_group_on_exit,
    exit_without_interpreter_teardown,
    finish_record,
    launch_ranks,
    start_process_group,
)
from distref.models import GPTConfig, build_model, tied_across_blocks
from distref.record import RunRecord, print_summary
from distref.training.bookkeeping import Cadence, StepLog
from distref.training.checkpoint import (
    checkpoint_path,
    checkpoint_state,
    full_state_dict,
    load_checkpoint,
    load_sharded_checkpoint,
    resume_path,
    resume_step,
    save_checkpoint,
    save_sharded_checkpoint,
)
from distref.training.device import (
    autocast,
    configure_cpu_threads,
    param_dtype,
    seed_everything,
    seed_step,
    stream_seed,
    synchronize,
)
from distref.training.measure import model_state_bytes
from distref.training.monitor import profiler
from distref.training.optim import make_grad_scaler, make_lr_schedule, make_optimizer, total_steps
from distref.training.steps import evaluate, loss_sum

IMPL = "tensor_parallel"
VERSION = impl_version(__file__)


# --- TP: the strategy ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TPOptions:
    """Tensor parallelism's own options (`add_options`, at the end of this file, gives their help and
    defaults)."""

    tp: int | None
    dp_shard: int | None
    sequence_parallel: bool | None  # None (not given): on for gpt, off for a model of yours (`resolved`)
    loss_parallel: bool | None


def mesh_shape(options: TPOptions, world_size: int) -> tuple[int, int]:
    """(data-parallel groups, tensor-parallel degree): as given, the one not given filling the world;
    neither given: every rank in one tensor-parallel group."""
    dp, tp = options.dp_shard, options.tp
    if tp is None:
        dp = dp or 1
        return dp, max(1, world_size // dp)
    return dp or max(1, world_size // tp), tp


def make_mesh(dp: int, tp: int, device: torch.device) -> DeviceMesh:
    """2-D mesh (dp_shard, tp): ranks 0..T-1 form the first tensor-parallel group, T..2T-1 the second, and
    so on. Tensor parallelism communicates in every layer, forward and backward: its group gets the
    neighbouring ranks (on a cluster, one node's fast links); data parallelism (FSDP: a gather per block
    in forward and backward, a reduce-scatter per block per step, each on 1/T of the bytes) spans them."""
    return init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp_shard", "tp"))


STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}  # a model of yours names them in its plan


def apply_own_plan(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """A model of yours (--model MODULE:FUNCTION) split by the plan it carries, `model.tp_plan`:
    {submodule name: "colwise" | "rowwise"}, as Hugging Face models carry theirs. Colwise splits a
    linear layer by output rows (each rank computes a slice of the features), rowwise by input columns
    (each rank's partial product, summed: an all-reduce): a colwise layer, then element-wise operations,
    then a rowwise one (Megatron's MLP). Checked against the model itself before training
    (`own_plan_problem`)."""
    plan = {name: STYLES[style]() for name, style in model.tp_plan.items()}
    return parallelize_keeping_frozen(model, tp_mesh, plan)


def parallelize_keeping_frozen(model: nn.Module, tp_mesh: DeviceMesh, plan: dict) -> nn.Module:
    """parallelize_module, with what was frozen (`requires_grad=False`) still frozen: torch before 2.11
    makes each split weight a new Parameter that trains (a frozen colwise weight trained there)."""
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    model = parallelize_module(model, tp_mesh, plan)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    return model


class RandomStreams:
    """The random streams tensor parallelism needs for dropout (Megatron's RNG tracker, here driven by the
    plan). Outside the split layers, activations are whole on every rank of a tensor-parallel group: their
    masks must be equal there, or the replicas part; `shared` is one stream per data-parallel group (per
    rank under sequence parallelism, where each rank holds other tokens). Inside a split region, from a
    colwise layer's output to the next rowwise layer's input, each rank holds other hidden units: their
    masks must be independent. On entering one, the generators are seeded from a number drawn from the
    shared CPU stream and the rank's index in its group, and put back on leaving: activation
    checkpointing, which restores the shared stream to recompute, then recomputes the same masks."""

    def __init__(self, mesh: DeviceMesh, sequence_parallel: bool, device: torch.device):
        self.tp_rank, self.device = mesh["tp"].get_local_rank(), device
        dp_rank, tp = mesh["dp_shard"].get_local_rank(), mesh["tp"].size()
        self.shared = dp_rank * tp + self.tp_rank if sequence_parallel else dp_rank
        self.outside: tuple[torch.Tensor, torch.Tensor | None] | None = None  # the shared states, inside

    def attach(self, model: nn.Module, plan: dict[str, str]) -> None:
        """Enter a split region after each colwise layer of `plan`, leave it before each rowwise one."""
        for name, style in plan.items():
            if style == "colwise":
                model.get_submodule(name).register_forward_hook(self.enter)
            else:
                model.get_submodule(name).register_forward_pre_hook(self.leave)

    def enter(self, *_) -> None:
        if self.outside is not None or in_backward():  # (q, k, v: three colwise layers open one region)
            return
        drawn = int(torch.randint(2**62, (1,)))  # from the shared CPU stream: the same on the whole group
        cuda = self.device.type == "cuda"
        self.outside = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if cuda else None)
        torch.random.default_generator.manual_seed(stream_seed(drawn, 0, self.tp_rank, "cpu"))
        if cuda:
            torch.cuda.default_generators[self.device.index or 0].manual_seed(
                stream_seed(drawn, 0, self.tp_rank, str(self.device))
            )

    def leave(self, *_) -> None:
        if self.outside is None or in_backward():
            return
        cpu_state, cuda_state = self.outside
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, self.device)
        self.outside = None


def in_backward() -> bool:
    """Whether autograd is running a backward here: activation checkpointing recomputing a block, whose
    random state the checkpoint has restored itself (a colwise layer recomputed without its rowwise
    partner must not open a region that nothing closes)."""
    return torch._C._current_graph_task_id() != -1


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, options: TPOptions) -> nn.Module:
    """Megatron's split of every gpt block, as a plan of parallel styles (torchtitan's `apply_tp`):
    q/k/v and the MLP's first linear by output rows (ColwiseParallel), the attention's output projection
    and the MLP's second linear by input columns (RowwiseParallel, whose partial products are summed).
    Embeddings are split over their rows (vocabulary, positions), the output layer over the vocabulary.
    Every parameter becomes a DTensor on `tp_mesh`; DTensor's autograd makes the backward's collectives."""
    sequence_parallel, loss_parallel_ = options.sequence_parallel, options.loss_parallel
    # Between blocks, activations are split along the sequence (dim 1) or whole on every rank.
    between = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "embed.tok": RowwiseParallel(input_layouts=Replicate()),  # token ids whole on every rank
        "embed.pos": RowwiseParallel(input_layouts=Replicate()),
        "head.out": ColwiseParallel(
            input_layouts=between,
            # loss parallel: each rank keeps its slice of the vocabulary's logits (a DTensor) for the loss
            output_layouts=Shard(-1) if loss_parallel_ else Replicate(),
            use_local_output=not loss_parallel_,
        ),
    }
    if sequence_parallel:
        plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
        plan["head.ln"] = SequenceParallel()
    for name in (n for n, _ in model.named_children() if n.startswith("block")):  # block0, block1, ...
        plan.update(
            {
                # gather the sequence-split input before the layer; each rank then has whole tokens
                f"{name}.attn": PrepareModuleInput(input_layouts=between, desired_input_layouts=Replicate()),
                f"{name}.attn.q": ColwiseParallel(),
                f"{name}.attn.k": ColwiseParallel(),
                f"{name}.attn.v": ColwiseParallel(),
                f"{name}.attn.proj": RowwiseParallel(output_layouts=between),  # sum (and split) partials
                f"{name}.mlp": PrepareModuleInput(input_layouts=between, desired_input_layouts=Replicate()),
                f"{name}.mlp.0": ColwiseParallel(),
                f"{name}.mlp.2": RowwiseParallel(output_layouts=between),
            }
        )
        if sequence_parallel:
            plan[f"{name}.ln1"] = SequenceParallel()
            plan[f"{name}.ln2"] = SequenceParallel()
    return parallelize_keeping_frozen(model, tp_mesh, plan)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """2-D: fully_shard each block, then the root, over the data-parallel groups (as impls/fsdp): each
    tensor-parallel slice is sharded again across the groups, gathered for its block's forward and
    backward, its gradient reduce-scattered over the groups."""
    for block in model.children():
        fully_shard(block, mesh=dp_mesh)
    model = fully_shard(model, mesh=dp_mesh)
    # Sum the gradients over the groups, not average them: each group's loss is already its part of the
    # global batch's mean (its loss sum ÷ the global batch's scored targets). Plain SUM on the wire.
    for module in model.modules():
        if isinstance(module, FSDPModule):  # each fully_shard call: its own unit, its own setting
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def parallelize(
    model: nn.Module, mesh: DeviceMesh, options: TPOptions, streams: RandomStreams | None = None
) -> nn.Module:
    """Split every layer over the tensor-parallel group, then, on a 2-D mesh, shard the slices over the
    data-parallel groups (torchtitan's `parallelize_*`: apply_tp, then apply_fsdp). A model of yours
    draws its split regions' random numbers from `streams` (this project's models draw none)."""
    if hasattr(model, "tp_plan"):
        if streams is not None:
            streams.attach(model, model.tp_plan)
        model = apply_own_plan(model, mesh["tp"])
    else:
        model = apply_tp(model, mesh["tp"], options)
    if mesh["dp_shard"].size() > 1:
        model = apply_fsdp(model, mesh["dp_shard"])
    return model


@torch.no_grad()
def own_plan_problem(
    model: nn.Module, whole: nn.Module, train_set: TensorData, cfg: RunConfig, device: torch.device
) -> str | None:
    """Why the split `model` (a model of yours, split by its tp_plan) does not compute what `whole`, the
    same parameters unsplit, does on the first training samples (eval mode), or None. Every rank gets
    the same answer (the split model's output is whole on every rank). A collective: every rank calls it."""
    x = train_set.x[:4].to(device)
    whole.to(device).eval()
    model.eval()
    # (DTensor's sharding propagation logs a failed shape check as a traceback of its own: said here)
    propagation_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = propagation_log.level
    propagation_log.setLevel(logging.CRITICAL)
    try:
        split = local_part(model(x))
    except Exception as exc:
        return f"--model {cfg.model}: its tp_plan fails in forward ({type(exc).__name__}: {first_line(exc)})"
    finally:
        model.train()
        propagation_log.setLevel(level)
    expected = whole(x)
    whole.to("cpu").train()
    if split.shape != expected.shape or not torch.allclose(split, expected, rtol=1e-4, atol=1e-5):
        return (
            f"--model {cfg.model}: split by its tp_plan {dict(model.tp_plan)} it does not compute its "
            "forward (a colwise layer's sliced output must reach a rowwise layer through element-wise "
            "operations only)"
        )
    return None


def evaluate_gathered(
    model: nn.Module, eval_model: nn.Module, test_set: TensorData, device: torch.device, cfg: RunConfig
) -> torch.Tensor:
    """The test set's [loss sum, correct, count], each rank scoring its shard of it with `eval_model`, a
    plain copy of the model loaded with the gathered parameters: shards may differ in batch count, and
    forwards through the split model are collectives, so they would not pair up across ranks. A collective."""
    eval_model.load_state_dict(full_state_dict(model))
    eval_model.to(device)  # for the evaluation only: a whole model on every GPU would undo the split
    batches = eval_batches(test_set, rank=dist.get_rank(), world_size=dist.get_world_size())
    totals = evaluate(eval_model, batches, device, cfg)
    eval_model.to("cpu")
    dist.all_reduce(totals)  # the ranks' sums: the whole test set's
    return totals


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `tensor`: a DTensor's local part (the loss under loss parallelism is a
    replicated DTensor: every rank holds the whole loss), a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def record_held_shapes(model: nn.Module) -> dict[str, list[int]]:
    """Filled by the first forward: the shape of what this rank holds of the activations between blocks
    (sequence parallel: 1/T of the sequence) and of the logits (loss parallel: 1/T of the vocabulary).
    Each hook removes itself once it has looked: nothing runs in later steps."""
    shapes: dict[str, list[int]] = {}
    handles: dict[str, torch.utils.hooks.RemovableHandle] = {}
    if hasattr(model, "tp_plan"):  # a model of yours: no gpt blocks to look at
        return shapes
    for name, module in (("between_blocks", model.block0), ("logits", model.head)):

        def note(_module, _args, output, name=name) -> None:  # (returning None keeps the output)
            shapes[name] = list(local_part(output).shape)
            handles.pop(name).remove()

        handles[name] = module.register_forward_hook(note)
    return shapes


def tp_cost(mesh: DeviceMesh, cfg: RunConfig, info: DatasetInfo) -> Predicted:
    """What a rank of the (dp_shard, tp) mesh costs by formula (distref.cost.tensor_parallel): per block
    two all-reduces forward and two backward of b·s·h (sequence parallel: all-gathers and reduce-scatters
    instead), the embeddings' and the loss's, FSDP2's over the dp_shard groups; this rank's slices of
    every parameter, gradient and optimizer state; the activations it holds (its heads, its MLP units).
    A model of yours: `own_model_tp_cost`."""
    if is_factory(cfg.model):
        return own_model_tp_cost(mesh, cfg, info)
    gpt = GPTConfig(vocab_size=info.num_classes, block_size=info.input_shape[0], n_layer=cfg.gpt_layers)
    dp, tp = mesh["dp_shard"].size(), mesh["tp"].size()
    shape = dict(layers=gpt.n_layer, hidden=gpt.n_embd, vocabulary=gpt.vocab_size, sequence=gpt.block_size)
    shape.update(tp=tp, dp_shard=dp, tp_rank=mesh["tp"].get_local_rank())
    element = param_dtype(cfg).itemsize
    communication = tensor_parallel(
        **shape,
        micro_batch=cfg.global_batch_size // (dp * cfg.grad_accum),  # each data-parallel group's share
        sequence_parallel=cfg.strategy.sequence_parallel,
        loss_parallel=cfg.strategy.loss_parallel,
        optimizer=cfg.optimizer,
        grad_accum=cfg.grad_accum,
        element_bytes=element,
        compute_element_bytes=2 if cfg.precision == "bf16" else element,  # the linear layers' outputs
        activation_checkpointing=cfg.activation_checkpointing,
    )
    model_states = tensor_parallel_model_states(
        **shape,
        dp_rank=mesh["dp_shard"].get_local_rank(),
        optimizer=cfg.optimizer,
        weight_decay=cfg.weight_decay,
        element_bytes=element,
        step_bytes=torch.get_default_dtype().itemsize,
    )
    activations = None  # (bf16 autocast and FSDP2's gathered slices on the 2-D mesh: no formula yet)
    no_activation_formula = no_formula(cfg.model, cfg.precision) or (
        f"no activation formula on the 2-D mesh (--dp-shard {dp}: FSDP2's gathered slices)"
    )
    if cfg.precision in ("fp32", "fp64") and dp == 1:
        activations = tensor_parallel_activation_bytes(
            micro_batch=cfg.global_batch_size // cfg.grad_accum,
            seq=gpt.block_size,
            hidden=gpt.n_embd,
            heads=gpt.n_head,
            layers=gpt.n_layer,
            vocab=gpt.vocab_size,
            tp=tp,
            tp_rank=mesh["tp"].get_local_rank(),
            sequence_parallel=cfg.strategy.sequence_parallel,
            loss_parallel=cfg.strategy.loss_parallel,
            element_bytes=element,
            checkpointed=cfg.activation_checkpointing,
        )
    return Predicted(
        communication=communication,
        model_states=model_states,
        activations=activations,
        unavailable={"activations": no_activation_formula},
    )


def own_model_tp_cost(mesh: DeviceMesh, cfg: RunConfig, info: DatasetInfo) -> Predicted:
    """A model of yours split by its tp_plan, on a 1-D mesh: this rank's slice of each parameter (its
    plan's: colwise by rows, rowwise by columns, the rest whole) and, for those that receive a gradient,
    of the gradient and optimizer state. Its communication and activations have no formula: what its
    plan's layers gather and reduce depends on what surrounds them."""
    usage = model_usage(cfg.model, info, cfg.gpt_layers)  # which parameters train: a forward on meta
    dp, tp = mesh["dp_shard"].size(), mesh["tp"].size()
    model_states = None
    if not usage.unknown and dp == 1:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            whole = build_model(cfg.model, info, cfg.gpt_layers)  # (its names and shapes)
        named = list(whole.named_parameters())
        model_states = planned_model_states(
            [(p.shape, planned_split(whole.tp_plan, name)) for name, p in named],
            tp,
            mesh["tp"].get_local_rank(),
            cfg.optimizer,
            element_bytes=param_dtype(cfg).itemsize,
            step_bytes=torch.get_default_dtype().itemsize,
            trained=usage.trained_flags(named),
        )
    return Predicted(
        model_states=model_states,
        unavailable={
            "communication": f"no communication formula for --model {cfg.model}: what its tp_plan's layers "
            "gather and reduce depends on the layers around them",
            "model_states": usage.unknown or f"no model-state formula for {cfg.model} on the 2-D mesh",
            "activations": no_formula(cfg.model, cfg.precision),
        },
    )


# --- end TP strategy ---


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_options(argv)
    # --- TP: one process per device. Started as `python train.py [--nproc-per-node N]`, this process has
    # only checked the arguments (bad input stops above, before any rank exists); it now starts the ranks
    # through torch's own launcher, as torchrun would, and waits. Each rank arrives here under torchrun.
    if not under_torchrun():
        launch_ranks(__file__, argv, cfg, IMPL)
    configure_cpu_threads()
    rank, world_size, device, backend = start_process_group(cfg)  # --- TP: one device per rank, a group
    dp, tp = mesh_shape(cfg.strategy, world_size)
    mesh = make_mesh(dp, tp, device)
    dp_rank = mesh["dp_shard"].get_local_rank()  # which slice of the global batch this rank trains on
    is_main = rank == 0  # rank 0 alone writes the record, the checkpoint index and the final state_dict
    # --- end TP ---

    # ---- Data and model: the same in every impl -------------------------------------------------
    with exit_on_bad_input(IMPL):  # a dataset that fails its md5: one line, exit 2
        train_set, test_set, info = load_dataset(cfg)
    seed_everything(cfg.seed)  # before building: every impl starts from the same parameters
    model = build_model(cfg.model, info, cfg.gpt_layers, param_dtype(cfg)).to(device)
    # --- TP: every rank read the data and built the model itself: they must agree (one all-gather)
    with exit_on_bad_input(IMPL, say=is_main):
        check_ranks_agree(cfg, train_set, test_set, model)
    model.activation_checkpointing = cfg.activation_checkpointing
    # --- TP: split every layer over the tensor-parallel group, then shard over the data-parallel groups
    # (every rank built the same parameters, same seed: each keeps its slice). A plain copy of the model
    # scores the gathered parameters (evaluation), kept on the CPU between evaluations (evaluate_gathered).
    eval_model = build_model(cfg.model, info, cfg.gpt_layers, param_dtype(cfg))
    eval_model.load_state_dict(model.state_dict())  # (the same parameters, for own_plan_problem)
    streams = RandomStreams(mesh, cfg.strategy.sequence_parallel, device)  # dropout's (RandomStreams)
    model = parallelize(model, mesh, cfg.strategy, streams)
    # A plan of yours, checked once: does the split model compute what the whole one does?
    if is_factory(cfg.model) and (problem := own_plan_problem(model, eval_model, train_set, cfg, device)):
        fail(problem, f"{IMPL}/train.py") if is_main else exit_after_rank_0_spoke(2)
    optimizer = make_optimizer(cfg, model.parameters())  # over the slices: each rank steps its own
    scaler = make_grad_scaler(cfg, device)
    n_steps = total_steps(cfg, len(train_set))
    cadence = Cadence(cfg, n_steps, steps_per_epoch(len(train_set), cfg.global_batch_size))
    record = RunRecord(
        IMPL, VERSION, cfg, world_size=world_size, device=device, backend=backend, write_files=is_main
    )  # --- TP: every rank keeps the numbers, rank 0 writes them
    record.add_strategy_facts(  # --- TP: the mesh, the options, and what each rank holds
        mesh={"dp_shard": dp, "tp": tp},
        sequence_parallel=cfg.strategy.sequence_parallel,
        loss_parallel=cfg.strategy.loss_parallel,
        held_shapes=record_held_shapes(model),  # filled in by the first forward
    )

    # ---- Resume: model, optimizer, scaler, RNG, record; the data order and lr follow the step ---
    start_step = 0
    if (path := resume_path(cfg)) is not None:
        # --- TP: the index (step-N.pt: step, record, options, RNG, file hashes) names a complete sharded
        # checkpoint, the folder step-N/ beside it (torch.distributed.checkpoint), whose hashes are checked
        # before DCP reads it. DCP reshards on load: any --tp / --dp-shard loads any other.
        with exit_on_bad_input(IMPL, say=is_main):  # --- TP: every rank finds it; rank 0 says it, once
            state = load_checkpoint(path, cfg, n_steps, holds=("folder", "sha256", "scaler"))
            load_sharded_checkpoint(model, optimizer, path, state)  # this rank's slices, in place
        scaler.load_state_dict(state["scaler"])
        start_step = resume_step(state, path, record, IMPL, say=is_main)  # --- TP: said once

    # The lr is a function of the step: built after a resume, it continues where the run left off.
    scheduler = make_lr_schedule(cfg, optimizer, n_steps, start_step)
    # --- TP: the data-parallel group's slice of every global batch; the T ranks of a tensor-parallel
    # group read the same one (same order as single, any mesh).
    micro_batches = iter(train_loader(train_set, cfg, start_step, n_steps, dp_rank, dp))
    log = StepLog(record, cfg, IMPL, cadence, start_step, show=is_main, desc=f"{IMPL} {dp}×{tp}")
    state_bytes = None  # model-state bytes, measured once gradients and optimizer state both exist
    # --- TP: the cross-entropy on vocabulary-split logits, and its backward, run inside this context
    parallel_loss = loss_parallel if cfg.strategy.loss_parallel else contextlib.nullcontext

    record.start_training()  # start-up (imports, data, model, set-up) ends: the run's clock starts
    with log, profiler(cfg, rank=rank) as prof:  # --- TP: one trace per rank
        for step in range(start_step, n_steps):
            started = log.step_starts(step)
            # This step's random numbers (dropout): a function of (seed, step), so a resumed run draws
            # what an uninterrupted one does. (Each impl says which stream each of its ranks draws.)
            seed_step(cfg.seed, step, stream=streams.shared, devices=[device])  # --- TP: RandomStreams
            # The step's loss is the mean over every scored target of the whole global batch: each
            # micro-batch adds its loss *sum* over this count. (The mean of the micro-batches' own means
            # would weigh a micro-batch scoring 3 targets as much as one scoring 60: padding, prompts.)
            scored = scored_targets(train_set, cfg, step)  # --- TP: of the whole batch, not the group's
            step_loss = torch.zeros((), device=device)
            for micro_step in range(cfg.grad_accum):
                x, y = next(micro_batches)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                if dp > 1:  # --- TP: reduce-scatter over the groups at the last micro-step only
                    model.set_requires_gradient_sync(micro_step == cfg.grad_accum - 1)
                with parallel_loss():  # --- TP: (the sum over vocabulary-split logits)
                    with autocast(cfg, device):
                        loss = loss_sum(model(x), y) / scored
                    # The micro-batches' gradients add up to the global batch's, as one big batch gives.
                    # --- TP: and so do the groups': FSDP's reduce-scatter over them sums (apply_fsdp sets
                    # its divide factor to 1), where by default it would average, ÷ the groups.
                    scaler.scale(loss).backward()
                step_loss += local_part(loss).detach()
            scale = scaler.get_scale()  # fp16: a host sync, as scaler.step() makes anyway; else 1.0
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() < scale:  # inf/nan gradients: the update was skipped, the scale lowered
                record.add_skipped_step(step)
            scheduler.step()
            if state_bytes is None:  # --- TP: this rank's slices (DTensors' local parts)
                state_bytes = model_state_bytes(model.parameters(), optimizer)
            optimizer.zero_grad(set_to_none=True)
            synchronize(device)
            log.step_done(step_loss, started)
            prof.step()

            due = cadence.after(step)
            if due.log:
                # --- TP: sum the groups' parts of the loss over the data-parallel dimension (one
                # all-reduce for all pending steps; a group's T ranks hold the same value): the global mean.
                log.flush(
                    due.done, reduce=lambda losses: all_reduce_sum(losses, mesh["dp_shard"].get_group())
                )
            if due.eval:
                started = log.eval_starts()
                # --- TP: each rank scores its shard of the test set with a plain copy of the gathered
                # model (evaluate_gathered says why); the sums are all-reduced into global numbers.
                totals = evaluate_gathered(model, eval_model, test_set, device, cfg)
                log.evaluated(due.done, totals, started)
            if due.checkpoint:  # --- TP: every rank writes its slices in step-N/ (DCP), rank 0 the index
                index = checkpoint_path(cfg.checkpoint_dir, due.done)  # step-N.pt, written by rank 0
                state = checkpoint_state(cfg, due.done, n_steps, record, scaler=scaler.state_dict())
                save_sharded_checkpoint(model, optimizer, index, state, is_main)

    # --- TP: the full state_dict of the core model, gathered from the slices (keys identical for every
    # impl); every rank takes part, rank 0 writes.
    if cfg.save_final:
        final = full_state_dict(model)
        if is_main:
            save_checkpoint(cfg.save_final, final)
    # --- TP: every rank's memory and model states (its slices), beside the formulas', and what its
    # counted step communicated beside the formula's (tp_cost), gathered to rank 0
    predicted = tp_cost(mesh, cfg, info)
    finish_record(record, cfg.global_batch_size, state_bytes, world_size, predicted)
    if is_main:
        print_summary(record.data)
    return record.data


# ---- The command line: the core options (distref.cli) and tensor parallelism's own ---------------
# --- TP: its options, parsed once into TPOptions (cfg.strategy) ---
def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tp",
        metavar="T",
        type=positive_int,
        help="tensor-parallel degree: ranks that split every layer and see the same batch; must divide "
        "gpt's attention heads (default: world / --dp-shard, i.e. every rank)",
    )
    parser.add_argument(
        "--dp-shard",
        metavar="D",
        type=positive_int,
        help="data-parallel groups of --tp ranks, each on its slice of the global batch, the parameters "
        "sharded over the groups with FSDP2: a 2-D mesh of D × T ranks (default: world / --tp)",
    )
    parser.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        help="split layer norms and the residual stream along the sequence (all-gather + reduce-scatter "
        "per layer instead of an all-reduce; activations 1/T per rank); --no-sequence-parallel repeats "
        "them on every rank (default: on for gpt, off for a model of yours)",
    )
    parser.add_argument(
        "--loss-parallel",
        action=argparse.BooleanOptionalAction,
        help="cross-entropy on the logits as split over the vocabulary (never gathered whole); "
        "--no-loss-parallel all-gathers them first (default: on for gpt, off for a model of yours)",
    )


def check_options(cfg: RunConfig, world_size: int) -> str | None:
    dp, tp = mesh_shape(cfg.strategy, world_size)
    if is_factory(cfg.model):
        problem = own_model_problem(cfg, tp)
        if problem:
            return problem
    elif cfg.model != "gpt":
        return (
            f"--model {cfg.model}: tensor parallelism here splits gpt's attention heads and MLP, or a model "
            "of yours by its tp_plan; use --model gpt or MODULE:FUNCTION"
        )
    if dp * tp != world_size:
        if cfg.strategy.tp is None or cfg.strategy.dp_shard is None:
            given = f"--tp {tp}" if cfg.strategy.tp else f"--dp-shard {dp}"
            return f"{given} must divide the {world_size} ranks"
        return f"--dp-shard {dp} × --tp {tp} = {dp * tp} ranks, but the job has {world_size}"
    gpt = GPTConfig(vocab_size=1, block_size=1)  # the shape --model gpt has (distref.models)
    if cfg.model == "gpt" and (gpt.n_head % tp or (4 * gpt.n_embd) % tp):
        return (
            f"--tp {tp} must divide gpt's {gpt.n_head} attention heads and its MLP's {4 * gpt.n_embd} units"
        )
    if cfg.global_batch_size % (dp * cfg.grad_accum):
        return (
            f"--global-batch-size {cfg.global_batch_size} must be divisible by --dp-shard × --grad-accum "
            f"= {dp} × {cfg.grad_accum} = {dp * cfg.grad_accum}"
        )
    if cfg.precision == "fp16":
        # GradScaler's inf check would run on each rank's slice of the gradients: ranks could disagree
        # on skipping a step. bf16 has fp32's range and needs no scaler.
        return "--precision fp16 is not supported with tensor parallelism here (no sharded loss scaler): use bf16"
    return None


def own_model_problem(cfg: RunConfig, tp: int) -> str | None:
    """A model of yours: it carries a plan (`apply_own_plan`) naming its linear layers, each splittable
    T ways; sequence and loss parallelism are gpt's."""
    options = cfg.strategy
    if options.sequence_parallel or options.loss_parallel:
        return (
            "--sequence-parallel and --loss-parallel split gpt's layer norms and vocabulary, not a model "
            "of yours"
        )
    model = build_model(cfg.model, None)  # (validate built it already: it builds)
    if tied := tied_across_blocks(model):  # a split parameter and its unsplit twin would drift apart
        return f"--model {cfg.model}: {tied}; tensor parallelism here splits layers of their own"
    plan = getattr(model, "tp_plan", None)
    if not isinstance(plan, dict) or not plan:
        return (
            f"--model {cfg.model}: tensor parallelism needs the model's plan, a `tp_plan` attribute "
            '{submodule name: "colwise" | "rowwise"}, e.g. {"fc1": "colwise", "fc2": "rowwise"}'
        )
    modules = dict(model.named_modules())
    for name, style in plan.items():
        if style not in STYLES:
            return f'--model {cfg.model}: tp_plan[{name!r}] is {style!r}, not "colwise" or "rowwise"'
        if not isinstance(modules.get(name), nn.Linear):
            return f"--model {cfg.model}: tp_plan names {name!r}, which is not a linear layer of the model"
        features = modules[name].out_features if style == "colwise" else modules[name].in_features
        if features % tp:
            which = "outputs" if style == "colwise" else "inputs"
            return f"--model {cfg.model}: {name}'s {features} {which} ({style}) do not split over --tp {tp}"
    if isinstance(model, nn.Sequential) and (problem := plan_order_problem(model, plan)):
        return f"--model {cfg.model}: {problem}"
    return None


def plan_order_problem(model: nn.Sequential, plan: dict[str, str]) -> str | None:
    """A plan's layers in the order a (nested) nn.Sequential applies them: each colwise layer's split
    output must reach a rowwise layer (which sums it whole again) before any other linear layer, and the
    model must end whole. (What lies between, the ranks check: `own_plan_problem`.)"""
    split_by = None  # the colwise layer whose split output flows now, if any
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        style = plan.get(name)
        if style == "colwise" and split_by:
            return f"{name} is colwise, but its input is {split_by}'s split output: make {name} rowwise"
        if style == "rowwise" and not split_by:
            return f"{name} is rowwise, but its input is whole: a colwise layer must come before it"
        if style is None and split_by:
            return f"{name} takes {split_by}'s split output: make {name} rowwise (or add it to the plan)"
        split_by = name if style == "colwise" else None
    return f"the model ends split ({split_by} is colwise): end with a rowwise layer" if split_by else None


def resolved(cfg: RunConfig) -> RunConfig:
    """Sequence and loss parallelism not given: on for gpt, off for a model of yours."""
    options, gpt = cfg.strategy, not is_factory(cfg.model)
    on = {
        k: gpt if getattr(options, k) is None else getattr(options, k)
        for k in ("sequence_parallel", "loss_parallel")
    }
    return dataclasses.replace(cfg, strategy=dataclasses.replace(options, **on))


def parse_options(argv: list[str] | None, world_size: int | None = None) -> RunConfig:
    """The command line, checked (one line and exit 2 on bad input, before any rank exists)."""
    return resolved(
        parse_config(
            argv,
            IMPL,
            add_options,
            world_size,
            check_options,
            description=__doc__,
            distributed=True,
            splits_batch=False,  # --- TP: check_options splits the batch over --dp-shard only
            strategy_options=TPOptions,
        )
    )


# --- end TP options ---


if __name__ == "__main__":
    with destroy_process_group_on_exit(IMPL):  # --- TP: clean teardown on every exit path
        main()
    exit_without_interpreter_teardown()  # --- TP: gloo threads vs Python's shutdown (distref/distributed)
