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

Changes against impls/single/train.py are marked `# --- TP: ... ---`.
"""

import argparse
import contextlib
import dataclasses

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import Replicate, Shard
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
from distref.cli import add_options_for, exit_on_bad_input, option, parse_config
from distref.config import RunConfig, exit_after_rank_0_spoke, fail, is_factory, positive_int, under_torchrun
from distref.cost.tensor_parallel import tensor_parallel_run_cost
from distref.data import load_dataset, scored_targets, sequence_length, steps_per_epoch, train_loader
from distref.distributed import (
    all_reduce_sum,
    check_ranks_agree,
    destroy_process_group_on_exit,
    evaluate_gathered,
    exit_without_interpreter_teardown,
    finish_record,
    launch_ranks,
    start_process_group,
)
from distref.models import build_model, plain_copy
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
from distref.training.compile import compile_blocks
from distref.training.device import (
    autocast,
    configure_cpu_threads,
    param_dtype,
    seed_everything,
    seed_step,
)
from distref.training.measure import local_part, model_state_bytes, record_held_shapes
from distref.training.monitor import profiler
from distref.training.optim import make_grad_scaler, make_lr_schedule, make_optimizer, total_steps
from distref.training.random_streams import RandomStreams
from distref.training.steps import loss_sum
from distref.your_model import tp_model_problem, tp_split_problem

IMPL = "tensor_parallel"
VERSION = impl_version(__file__)


# --- TP: the strategy ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TPOptions:
    """Tensor parallelism's own options (cfg.strategy), each declared with its command-line option."""

    tp: int | None = option(
        "tensor-parallel degree: ranks that split every layer and see the same batch; must divide gpt's "
        "attention heads (default: world / --dp-shard, i.e. every rank)",
        metavar="T",
        type=positive_int,
    )
    dp_shard: int | None = option(
        "data-parallel groups of --tp ranks, each on its slice of the global batch, the parameters sharded "
        "over the groups with FSDP2: a 2-D mesh of D × T ranks (default: world / --tp)",
        metavar="D",
        type=positive_int,
    )
    # Sequence and loss parallelism not given (None): on for gpt, off for a model of yours (`resolved`)
    sequence_parallel: bool | None = option(
        "split layer norms and the residual stream along the sequence (all-gather + reduce-scatter per "
        "layer instead of an all-reduce; activations 1/T per rank); --no-sequence-parallel repeats them on "
        "every rank (default: on for gpt, off for a model of yours)",
        action=argparse.BooleanOptionalAction,
    )
    loss_parallel: bool | None = option(
        "cross-entropy on the logits as split over the vocabulary (never gathered whole); "
        "--no-loss-parallel all-gathers them first (default: on for gpt, off for a model of yours)",
        action=argparse.BooleanOptionalAction,
    )


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
    (distref.your_model)."""
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


def apply_tp(
    model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool
) -> nn.Module:
    """Megatron's split of every gpt block, as a plan of parallel styles (torchtitan's `apply_tp`):
    q/k/v and the MLP's first linear by output rows (ColwiseParallel), the attention's output projection
    and the MLP's second linear by input columns (RowwiseParallel, whose partial products are summed).
    Embeddings are split over their rows (vocabulary, positions), the output layer over the vocabulary.
    Every parameter becomes a DTensor on `tp_mesh`; DTensor's autograd makes the backward's collectives."""
    # Between blocks, activations are split along the sequence (dim 1) or whole on every rank.
    between = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "embed.tok": RowwiseParallel(input_layouts=Replicate()),  # token ids whole on every rank
        "embed.pos": RowwiseParallel(input_layouts=Replicate()),
        "head.out": ColwiseParallel(
            input_layouts=between,
            # loss parallel: each rank keeps its slice of the vocabulary's logits (a DTensor) for the loss
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
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
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
    streams: RandomStreams | None = None,
    compile: bool = False,
) -> nn.Module:
    """Split every layer over the tensor-parallel group, then, on a 2-D mesh, shard the slices over the
    data-parallel groups (torchtitan's `parallelize_*`: apply_tp, then apply_fsdp). A model of yours
    draws its split regions' random numbers from `streams` (this project's models draw none). `compile`:
    each block compiled between the two (torchtitan's order): graphs of the split layers' DTensors, with
    FSDP's hooks outside them."""
    if hasattr(model, "tp_plan"):
        if streams is not None:
            streams.attach(model, model.tp_plan)
        model = apply_own_plan(model, mesh["tp"])
    else:
        model = apply_tp(model, mesh["tp"], sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    if compile:
        compile_blocks(model)
    if mesh["dp_shard"].size() > 1:
        model = apply_fsdp(model, mesh["dp_shard"])
    return model


# --- end TP strategy ---


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_options(argv)
    # --- TP: one process per device, started here from plain python (as ddp does) once the arguments
    # are checked; under torchrun each rank arrives here directly
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
    model = build_model(cfg.model, info, cfg.gpt_layers, param_dtype(cfg), cfg.moe)
    # --- TP: a plain copy of the model, on the CPU, scores the gathered parameters (evaluation; copied
    # before the model moves to the device: one build per process, and no second model on the GPU)
    eval_model = plain_copy(
        model, lambda: build_model(cfg.model, info, cfg.gpt_layers, param_dtype(cfg), cfg.moe)
    )
    model = model.to(device)
    # --- TP: every rank read the data and built the model itself: they must agree (one all-gather)
    with exit_on_bad_input(IMPL, say=is_main):
        check_ranks_agree(cfg, train_set, test_set, model)
    model.activation_checkpointing = cfg.activation_checkpointing
    # --- TP: split every layer over the tensor-parallel group, then shard over the data-parallel groups
    # (every rank built the same parameters, same seed: each keeps its slice). The evaluation's copy stays
    # on the CPU between evaluations (evaluate_gathered).
    sp, lp = cfg.strategy.sequence_parallel, cfg.strategy.loss_parallel
    # dropout's streams: one per data-parallel group outside the split layers (per rank under sequence
    # parallelism, where each rank holds other tokens), one per rank inside them (RandomStreams)
    tp_rank = mesh["tp"].get_local_rank()
    streams = RandomStreams(dp_rank * tp + tp_rank if sp else dp_rank, tp_rank, device)
    model = parallelize(
        model, mesh, sequence_parallel=sp, loss_parallel=lp, streams=streams, compile=cfg.compile
    )
    # A plan of yours, checked once: does the split model compute what the whole one does?
    if problem := tp_split_problem(model, eval_model, train_set.x[:4], device, cfg.model):
        fail(problem, f"{IMPL}/train.py") if is_main else exit_after_rank_0_spoke(2)
    optimizer = make_optimizer(cfg, model.parameters())  # over the slices: each rank steps its own
    scaler = make_grad_scaler(cfg, device)
    n_steps = total_steps(cfg, len(train_set))
    cadence = Cadence(cfg, n_steps, steps_per_epoch(len(train_set), cfg.global_batch_size))
    record = RunRecord(
        IMPL, VERSION, cfg, world_size=world_size, device=device, backend=backend, write_files=is_main
    )  # --- TP: every rank keeps the numbers, rank 0 writes them
    record.add_strategy_facts(  # --- TP: the mesh, the options, and what each rank holds (first forward)
        mesh={"dp_shard": dp, "tp": tp},
        sequence_parallel=sp,
        loss_parallel=lp,
        held_shapes=record_held_shapes(model),
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
    micro_batches = train_loader(train_set, cfg, start_step, n_steps, dp_rank, dp, device=device)
    log = StepLog(
        record, cfg, IMPL, cadence, start_step, show=is_main, desc=f"{IMPL} {dp}×{tp}", device=device
    )
    state_bytes = None  # model-state bytes, measured once gradients and optimizer state both exist
    # --- TP: the cross-entropy on vocabulary-split logits, and its backward, run inside this context
    parallel_loss = loss_parallel if lp else contextlib.nullcontext

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
            step_loss = None
            for micro_step in range(cfg.grad_accum):
                x, y = next(micro_batches)  # on the device already, the next one on its way
                if dp > 1:  # --- TP: reduce-scatter over the groups at the last micro-step only
                    model.set_requires_gradient_sync(micro_step == cfg.grad_accum - 1)
                with parallel_loss():  # --- TP: (the sum over vocabulary-split logits)
                    with autocast(cfg, device):
                        loss = loss_sum(model(x), y) / scored
                    # The micro-batches' gradients add up to the global batch's, as one big batch gives.
                    # --- TP: and so do the groups': FSDP's reduce-scatter over them sums (apply_fsdp sets
                    # its divide factor to 1), where by default it would average, ÷ the groups.
                    scaler.scale(loss).backward()
                loss = local_part(loss).detach()  # --- TP: (a replicated DTensor under loss parallelism)
                step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()  # (K=1: no add)
            scale = scaler.get_scale()  # fp16: a host sync, as scaler.step() makes anyway; else 1.0
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() < scale:  # inf/nan gradients: the update was skipped, the scale lowered
                record.add_skipped_step(step)
            scheduler.step()
            if state_bytes is None:  # --- TP: this rank's slices (DTensors' local parts)
                state_bytes = model_state_bytes(model.parameters(), optimizer)
            optimizer.zero_grad(set_to_none=True)
            log.step_done(step_loss, started)  # (no wait for the GPU: the step is timed by events)
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

    # --- TP: the core model's full state_dict, gathered from the slices by every rank; rank 0 writes it
    if cfg.save_final:
        final = full_state_dict(model)
        if is_main:
            save_checkpoint(cfg.save_final, final)
    # --- TP: every rank's memory, model states (its slices) and activations, and what its counted step
    # communicated, beside the formulas' (distref.cost.tensor_parallel)
    predicted = tensor_parallel_run_cost(  # (a model of yours: the slices its plan holds, no other formula)
        cfg,
        info,
        tp=tp,
        tp_rank=tp_rank,
        dp_shard=dp,
        dp_rank=dp_rank,
        sequence_parallel=sp,
        loss_parallel=lp,
        device=device.type,
    )
    finish_record(record, cfg.global_batch_size, state_bytes, world_size, predicted)  # --- TP: to rank 0
    if is_main:
        print_summary(record.data)
    return record.data


# ---- The command line: the core options (distref.cli) and tensor parallelism's own ---------------
# --- TP: its options (TPOptions, declared with the strategy), parsed once into cfg.strategy ---
add_options = add_options_for(TPOptions)  # TPOptions' fields, each its --option


def check_options(cfg: RunConfig, world_size: int) -> str | None:
    options = cfg.strategy
    dp, tp = mesh_shape(options, world_size)
    if dp * tp != world_size:
        if options.tp is None or options.dp_shard is None:
            given = f"--tp {tp}" if options.tp else f"--dp-shard {dp}"
            return f"{given} must divide the {world_size} ranks"
        return f"--dp-shard {dp} × --tp {tp} = {dp * tp} ranks, but the job has {world_size}"
    # gpt's heads and units, or a model of yours by its plan (the your-model contract: distref.your_model)
    sp, lp = options.sequence_parallel, options.loss_parallel
    if problem := tp_model_problem(cfg.model, tp, sequence_parallel=sp, loss_parallel=lp):
        return problem
    # sequence parallelism (on for gpt unless turned off) splits every sequence evenly over the group
    tokens = sequence_length(cfg)
    if sp is not False and not is_factory(cfg.model) and tokens is not None and tokens % tp:
        return (
            f"--sequence-parallel splits each sequence's {tokens} tokens over the --tp {tp} ranks: they must "
            "divide (--sequence-length), or give --no-sequence-parallel"
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
