"""Fully Sharded Data Parallel (FSDP2, `torch.distributed.fsdp.fully_shard`): data parallel, each rank
holding only its shard of every parameter, gradient and optimizer state.

Every rank runs this file, started by torchrun or by `python train.py`, which checks the arguments and
then starts the ranks through torch's own launcher (torch.distributed.run). As in DDP, each rank takes its
own slice of the global batch. Unlike DDP, a parameter lives on each rank as a 1/world shard (a DTensor
on a DeviceMesh): before a block's forward (and again before its backward) its shards are all-gathered
into the whole parameters, which are freed again afterwards (`--reshard-after-forward`); after its
backward, gradients are reduce-scattered, so each rank receives the sum of its own shard; the
optimizer then steps on shards only. That is ZeRO-3 (impls/deepspeed_zero --zero-stage 3) in PyTorch
itself, and equal to `impls/single` trained on the whole global batch.

    python impls/fsdp/train.py --nproc-per-node 2 --epochs 2 --out runs/fsdp   # starts 2 ranks (CPU: gloo)
    torchrun --standalone --nproc-per-node 4 impls/fsdp/train.py --hsdp 2        # replicate 2 × shard 2
    python impls/fsdp/train.py --device cuda --precision bf16                    # bf16 params, fp32 reduce
    nox -s fsdp-cpu / nox -s fsdp-gpu

Changes against impls/single/train.py are marked `# --- FSDP: ... ---`.
"""

import argparse
import dataclasses

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from distref import impl_version
from distref.cli import add_options_for, exit_on_bad_input, option, parse_config
from distref.config import RunConfig, under_torchrun
from distref.cost.activations import parameters_in, predicted_for_run
from distref.cost.sharded import fsdp_rank_cost
from distref.cost.usage import model_usage, parameters_by_block
from distref.data import (
    load_dataset,
    scored_targets,
    steps_per_epoch,
    train_loader,
)
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
from distref.training.measure import model_state_bytes
from distref.training.monitor import profiler
from distref.training.optim import make_grad_scaler, make_lr_schedule, make_optimizer, total_steps
from distref.training.steps import loss_sum
from distref.your_model import batch_norm_in_16_bits_problem, own_model_tied_across_blocks

IMPL = "fsdp"
VERSION = impl_version(__file__)


# --- FSDP: the strategy --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FSDPOptions:
    """FSDP's own options (cfg.strategy), each declared with its command-line option."""

    reshard_after_forward: bool | None = option(
        "free each block's gathered parameters after its forward and gather them again for its "
        "backward (ZeRO-3: least memory); --no-reshard-after-forward keeps them until backward (one "
        "all-gather less per block and step, the whole parameters held between forward and backward). "
        "Default: on with 2+ shards, off with one (one rank holds every shard: nothing to free)",
        action=argparse.BooleanOptionalAction,
        default=None,
    )
    cpu_offload: bool = option(
        "keep parameter shards, gradients and the optimizer step on the CPU (CPUOffloadPolicy); "
        "with CUDA, each block's shards are copied to the GPU for its forward and backward",
        action="store_true",
        default=False,
    )
    hsdp: int = option(
        "hybrid sharding: a 2-D mesh of R replicas × (world / R) shards; gradients are "
        "reduce-scattered within a replica, then all-reduced across replicas (the multi-node layout: "
        "shard within a node, replicate across nodes). 1: shard over every rank",
        metavar="R",
        type=int,
        default=1,
    )


def make_mesh(world_size: int, replicas: int, device: torch.device) -> DeviceMesh:
    """1-D mesh of every rank (FSDP), or 2-D (replicate, shard) for --hsdp R: ranks 0..S-1 form the first
    replica's shard group, S..2S-1 the second's, and so on (neighbours shard: on a cluster, one node)."""
    if replicas == 1:
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(
        device.type, (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard")
    )


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """bf16: parameters all-gathered and computed in bf16, gradients reduced in fp32, the sharded fp32
    parameters stepped by the optimizer (the master weights). Otherwise all in the parameters' dtype.
    The loop's autocast stays on too (as in single): the policy sets what FSDP gathers and reduces, autocast
    what each op computes in (the loss in fp32)."""
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def reshards_after_forward(option: bool | None, mesh: DeviceMesh) -> bool:
    """--[no-]reshard-after-forward, or by default: whether the shard group has 2+ ranks. With one, the
    gathered parameters are a copy of the rank's shard, and freeing them after forward only makes
    backward copy them again (both measured by `nox -s gpu-bench`)."""
    return mesh["shard"].size() > 1 if option is None else option


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    precision: str = "fp32",
    device: torch.device,
) -> nn.Module:
    """fully_shard each block, then the root (torchtitan's order): each block's parameters are one
    all-gather / reduce-scatter group, unsharded only while that block runs; the root takes what the
    blocks leave (none here: every parameter belongs to a block). Replaces the parameters by DTensor
    shards in place: build the optimizer after this."""
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    settings = {"mesh": mesh, "mp_policy": mixed_precision(precision), "offload_policy": offload}
    blocks = list(model.children())
    for i, block in enumerate(blocks):
        # The last block's parameters would be gathered again right away for backward: keep them.
        reshard = reshard_after_forward and i < len(blocks) - 1
        fully_shard(block, reshard_after_forward=reshard, **settings)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **settings)
    sum_gradients_over_ranks(model)
    return model


def sum_gradients_over_ranks(model: nn.Module) -> None:
    """Every FSDP unit's reduce-scatter (and HSDP's all-reduce over the replicas) sums the gradients
    instead of averaging them: each rank's loss is already its part of the global batch's mean (its loss
    sum ÷ the global batch's scored targets). Plain SUM on the wire (no pre/post-scaling)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):  # each fully_shard call: its own unit, its own setting
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


# --- end FSDP strategy ---


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_options(argv)
    # --- FSDP: one process per device. Started as `python train.py [--nproc-per-node N]`, this process has
    # only checked the arguments (bad input stops above, before any rank exists); it now starts the ranks
    # through torch's own launcher, as torchrun would, and waits. Each rank arrives here under torchrun.
    if not under_torchrun():
        launch_ranks(__file__, argv, cfg, IMPL)
    configure_cpu_threads()
    rank, world_size, device, backend = start_process_group(cfg)  # --- FSDP: one device per rank, a group
    mesh = make_mesh(world_size, cfg.strategy.hsdp, device)
    is_main = rank == 0  # rank 0 alone writes the record, the checkpoint index and the final state_dict
    # --- end FSDP ---

    # ---- Data and model: the same in every impl -------------------------------------------------
    with exit_on_bad_input(IMPL):  # a dataset that fails its md5: one line, exit 2
        train_set, test_set, info = load_dataset(cfg)
    seed_everything(cfg.seed)  # before building: every impl starts from the same parameters
    model = build_model(cfg.model, info, cfg.gpt_layers, param_dtype(cfg), cfg.moe)
    # --- FSDP: a plain copy of the model, on the CPU, scores the gathered parameters (evaluation; copied
    # before the model moves to the device: one build per process, and no second model on the GPU)
    eval_model = plain_copy(
        model, lambda: build_model(cfg.model, info, cfg.gpt_layers, param_dtype(cfg), cfg.moe)
    )
    model = model.to(device)
    # --- FSDP: every rank read the data and built the model itself: they must agree (one all-gather)
    with exit_on_bad_input(IMPL, say=is_main):
        check_ranks_agree(cfg, train_set, test_set, model)
    model.activation_checkpointing = cfg.activation_checkpointing
    if cfg.compile:  # torch.compile, block by block, before any strategy wraps the model
        compile_blocks(model)
    # --- FSDP: shard; every rank built the same parameters (same seed), so each keeps its own slice of
    # them (no broadcast needed). The evaluation's copy stays on the CPU between evaluations, where a
    # whole model on every GPU would undo the sharding.
    options = cfg.strategy
    reshard = reshards_after_forward(options.reshard_after_forward, mesh)
    model = apply_fsdp(
        model,
        mesh,
        reshard_after_forward=reshard,
        cpu_offload=options.cpu_offload,
        precision=cfg.precision,
        device=device,
    )
    optimizer = make_optimizer(cfg, model.parameters())  # over the shards: each rank steps its own
    scaler = make_grad_scaler(cfg, device)
    n_steps = total_steps(cfg, len(train_set))
    cadence = Cadence(cfg, n_steps, steps_per_epoch(len(train_set), cfg.global_batch_size))
    record = RunRecord(
        IMPL, VERSION, cfg, world_size=world_size, device=device, backend=backend, write_files=is_main
    )  # --- FSDP: every rank keeps the numbers, rank 0 writes them
    record.add_strategy_facts(  # --- FSDP: the mesh, and how the options shard
        mesh=dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True)),
        reshard_after_forward=reshard,
        cpu_offload=options.cpu_offload,
    )

    # ---- Resume: model, optimizer, scaler, RNG, record; the data order and lr follow the step ---
    start_step = 0
    if (path := resume_path(cfg)) is not None:
        # --- FSDP: the index (step-N.pt: step, record, options, RNG, file hashes) names a complete
        # sharded checkpoint, the folder step-N/ beside it (torch.distributed.checkpoint). DCP reshards
        # on load: a checkpoint written by any number of ranks loads at any other.
        # The files' hashes are checked before DCP reads them (it unpickles its .metadata).
        with exit_on_bad_input(IMPL, say=is_main):  # --- FSDP: every rank finds it; rank 0 says it, once
            state = load_checkpoint(path, cfg, n_steps, holds=("folder", "sha256", "scaler"))
            load_sharded_checkpoint(model, optimizer, path, state)  # this rank's shards, in place
        # --- end FSDP ---
        scaler.load_state_dict(state["scaler"])
        start_step = resume_step(state, path, record, IMPL, say=is_main)  # --- FSDP: said once

    # The lr is a function of the step: built after a resume, it continues where the run left off.
    scheduler = make_lr_schedule(cfg, optimizer, n_steps, start_step)
    # --- FSDP: this rank's slice of every global batch (same order as single, any world size) ---
    micro_batches = train_loader(train_set, cfg, start_step, n_steps, rank, world_size, device=device)
    log = StepLog(
        record, cfg, IMPL, cadence, start_step, show=is_main, desc=f"{IMPL} ×{world_size}", device=device
    )
    state_bytes = None  # model-state bytes, measured once gradients and optimizer state both exist

    record.start_training()  # start-up (imports, data, model, set-up) ends: the run's clock starts
    with log, profiler(cfg, rank=rank) as prof:  # --- FSDP: one trace per rank
        for step in range(start_step, n_steps):
            started = log.step_starts(step)
            # This step's random numbers (dropout): a function of (seed, step), so a resumed run draws
            # what an uninterrupted one does. (Each impl says which stream each of its ranks draws.)
            seed_step(cfg.seed, step, stream=rank, devices=[device])  # --- FSDP: each rank its own stream
            # The step's loss is the mean over every scored target of the whole global batch: each
            # micro-batch adds its loss *sum* over this count. (The mean of the micro-batches' own means
            # would weigh a micro-batch scoring 3 targets as much as one scoring 60: padding, prompts.)
            scored = scored_targets(train_set, cfg, step)  # --- FSDP: of the whole batch, not this rank's
            step_loss = None
            for micro_step in range(cfg.grad_accum):
                x, y = next(micro_batches)  # on the device already, the next one on its way
                # --- FSDP: reduce-scatter gradients only in the last micro-step's backward; before
                # it, each rank accumulates whole (unsharded) gradients locally, as DDP's no_sync(): fewer
                # reduce-scatters, at the memory of a full set of gradients per rank meanwhile.
                model.set_requires_gradient_sync(micro_step == cfg.grad_accum - 1)
                with autocast(cfg, device):
                    loss = loss_sum(model(x), y) / scored
                # The micro-batches' gradients add up to the global batch's, as one big batch gives.
                # --- FSDP: and so do the ranks': the reduce-scatter sums them (apply_fsdp sets its divide
                # factor to 1), where by default it would average them, dividing by the world size.
                scaler.scale(loss).backward()
                step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()  # (K=1: no add)
            scale = scaler.get_scale()  # fp16: a host sync, as scaler.step() makes anyway; else 1.0
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() < scale:  # inf/nan gradients: the update was skipped, the scale lowered
                record.add_skipped_step(step)
            scheduler.step()
            if state_bytes is None:  # --- FSDP: this rank's shards (DTensors' local parts)
                state_bytes = model_state_bytes(model.parameters(), optimizer)
            optimizer.zero_grad(set_to_none=True)
            log.step_done(step_loss, started)  # (no wait for the GPU: the step is timed by events)
            prof.step()

            due = cadence.after(step)
            if due.log:
                # --- FSDP: sum the ranks' parts of the loss (one all-reduce for all pending steps), so
                # rank 0 reports the global-batch loss, not its own slice's.
                log.flush(due.done, reduce=all_reduce_sum)
            if due.eval:
                started = log.eval_starts()
                # --- FSDP: each rank scores its shard of the test set with a plain copy of the gathered
                # model (evaluate_gathered says why); the sums are all-reduced into global numbers.
                totals = evaluate_gathered(model, eval_model, test_set, device, cfg)
                log.evaluated(due.done, totals, started)
            if due.checkpoint:  # --- FSDP: every rank writes its shards in step-N/ (DCP), rank 0 the index
                index = checkpoint_path(cfg.checkpoint_dir, due.done)  # step-N.pt, written by rank 0
                state = checkpoint_state(cfg, due.done, n_steps, record, scaler=scaler.state_dict())
                save_sharded_checkpoint(model, optimizer, index, state, is_main)

    # --- FSDP: the full state_dict of the core model, gathered from the shards (keys identical for every
    # impl); every rank takes part, rank 0 writes. Buffers (BatchNorm statistics) are rank 0's.
    if cfg.save_final:
        final = full_state_dict(model)
        if is_main:
            save_checkpoint(cfg.save_final, final)
    # --- FSDP: every rank's memory and model states (its shards), beside the formulas', and what its
    # counted step communicated beside the formula's (distref.cost.sharded), gathered to rank 0
    usage = model_usage(cfg.model, info, cfg.gpt_layers, cfg.moe)  # which parameters train: a forward on meta
    policy, shards = mixed_precision(cfg.precision), mesh["shard"]
    predicted = fsdp_rank_cost(
        parameters_by_block(model, usage),  # every block a unit (apply_fsdp; the root holds no parameter)
        shards.size(),
        shards.get_local_rank(),  # this rank's place in its shard group
        replicas=cfg.strategy.hsdp,
        reshard_after_forward=reshard,
        dtype=param_dtype(cfg),
        gather_dtype=policy.param_dtype,
        reduce_dtype=policy.reduce_dtype,
        grad_accum=cfg.grad_accum,
        optimizer=cfg.optimizer,
        step_bytes=torch.get_default_dtype().itemsize,
        unknown=usage.unknown,
        # --- FSDP: under --precision bf16 the policy's parameters compute in bf16, as gathered
        activations=predicted_for_run(
            cfg, info, world_size, device.type, parameters=parameters_in(policy.param_dtype)
        ),
    )
    finish_record(record, cfg.global_batch_size, state_bytes, world_size, predicted)  # --- FSDP: to rank 0
    if is_main:
        print_summary(record.data)
    return record.data


# ---- The command line: the core options (distref.cli) and FSDP's own -----------------------------
# --- FSDP: its options, parsed once into FSDPOptions (cfg.strategy) ---
add_options = add_options_for(FSDPOptions)  # FSDPOptions' fields, each its --option


def check_options(cfg: RunConfig, world_size: int) -> str | None:
    replicas = cfg.strategy.hsdp
    if replicas < 1 or world_size % replicas:
        return f"--hsdp {replicas} must divide the {world_size} ranks into replicas of equal size"
    if cfg.precision == "fp16":
        # fp16 needs a loss scaler whose inf check spans every rank's gradient shards (FSDP1 had
        # ShardedGradScaler); bf16 has fp32's range and needs none.
        return "--precision fp16 is not supported with FSDP2 here (no sharded loss scaler): use bf16"
    if tied := own_model_tied_across_blocks(cfg.model):  # --- FSDP: each block is sharded on its own
        return f"--model {cfg.model}: {tied}; fsdp shards each block on its own: keep them in one block"
    return batch_norm_in_16_bits_problem(cfg, "FSDP2's MixedPrecisionPolicy")


def parse_options(argv: list[str] | None, world_size: int | None = None) -> RunConfig:
    """The command line, checked (one line and exit 2 on bad input, before any rank exists)."""
    return parse_config(
        argv,
        IMPL,
        add_options,
        world_size,
        check_options,
        description=__doc__,
        distributed=True,
        strategy_options=FSDPOptions,
    )


# --- end FSDP options ---


if __name__ == "__main__":
    with destroy_process_group_on_exit(IMPL):  # --- FSDP: clean teardown on every exit path
        main()
    exit_without_interpreter_teardown()  # --- FSDP: gloo threads vs Python's shutdown (distref/distributed)
