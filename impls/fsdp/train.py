"""Fully Sharded Data Parallel (FSDP2, `torch.distributed.fsdp.fully_shard`): data parallel, each rank
holding only its shard of every parameter, gradient and optimizer state.

Every rank runs this file, started by torchrun or by `python train.py`, which checks the arguments and
then starts the ranks through torch's own launcher (torch.distributed.run). As in DDP, each rank takes its
own slice of the global batch. Unlike DDP, a parameter lives on each rank as a 1/world shard (a DTensor
on a DeviceMesh): before a block's forward (and again before its backward) its shards are all-gathered
into the whole parameters, which are freed again afterwards (`--reshard-after-forward`); after its
backward, gradients are reduce-scattered, so each rank receives the average of its own shard; the
optimizer then steps on shards only. That is ZeRO-3 (impls/deepspeed_zero --zero-stage 3) in PyTorch
itself, and equal to `impls/single` trained on the whole global batch.

    python impls/fsdp/train.py --nproc-per-node 2 --epochs 2 --out runs/fsdp   # starts 2 ranks (CPU: gloo)
    torchrun --standalone --nproc-per-node 4 impls/fsdp/train.py --hsdp 2        # replicate 2 × shard 2
    python impls/fsdp/train.py --device cuda --precision bf16                    # bf16 params, fp32 reduce
    nox -s fsdp-cpu / nox -s fsdp-gpu

Changes against impls/single/train.py are marked `# --- FSDP: ... ---`.
"""

import argparse
import datetime
import sys
import time

import torch
import torch.distributed as dist  # --- FSDP ---
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from distref import impl_version
from distref.cli import parse_config
from distref.config import RunConfig, fail, under_torchrun
from distref.data import DataError, eval_batches, load_dataset, steps_per_epoch, train_loader
from distref.distributed import (
    all_reduce_mean,
    destroy_process_group_on_exit,
    exit_without_interpreter_teardown,
    gather_to_rank0,
    launch_ranks,
    restart_safe_store,
    torchrun_env,
)
from distref.models import build_model
from distref.record import RunRecord, print_summary
from distref.training import (
    CheckpointError,
    autocast,
    checkpoint_path,
    configure_cpu_threads,
    describe_resume,
    evaluate,
    full_state_dict,
    load_checkpoint,
    load_sharded_checkpoint,
    loss_fn,
    make_grad_scaler,
    make_lr_schedule,
    make_optimizer,
    model_state_bytes,
    param_dtype,
    pick_device,
    profiler,
    progress_bar,
    resume_path,
    save_checkpoint,
    save_sharded_checkpoint,
    seed_everything,
    stop_if_diverged,
    synchronize,
    tensorboard_writer,
    total_steps,
)

IMPL = "fsdp"
VERSION = impl_version(__file__)
EVAL_BATCH_SIZE = 1000


# --- FSDP: strategy options, on top of the core run contract ---
def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--reshard-after-forward",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="free each block's gathered parameters after its forward and gather them again for its "
        "backward (ZeRO-3: least memory); --no-reshard-after-forward keeps them until backward (one "
        "all-gather less per block and step, the whole parameters held between forward and backward)",
    )
    parser.add_argument(
        "--cpu-offload",
        action="store_true",
        help="keep parameter shards, gradients and the optimizer step on the CPU (CPUOffloadPolicy); "
        "with CUDA, each block's shards are copied to the GPU for its forward and backward",
    )
    parser.add_argument(
        "--hsdp",
        metavar="R",
        type=int,
        default=1,
        help="hybrid sharding: a 2-D mesh of R replicas × (world / R) shards; gradients are "
        "reduce-scattered within a replica, then all-reduced across replicas (the multi-node layout: "
        "shard within a node, replicate across nodes). 1: shard over every rank",
    )


def check_options(cfg: RunConfig, world_size: int) -> str | None:
    replicas = cfg.extra["hsdp"]
    if replicas < 1 or world_size % replicas:
        return f"--hsdp {replicas} must divide the {world_size} ranks into replicas of equal size"
    if cfg.precision == "fp16":
        # fp16 needs a loss scaler whose inf check spans every rank's gradient shards (FSDP1 had
        # ShardedGradScaler); bf16 has fp32's range and needs none.
        return "--precision fp16 is not supported with FSDP2 here (no sharded loss scaler): use bf16"
    return None


def mixed_precision(cfg: RunConfig) -> MixedPrecisionPolicy:
    """bf16: parameters all-gathered and computed in bf16, gradients reduced in fp32, the sharded fp32
    parameters stepped by the optimizer (the master weights). Otherwise all in the parameters' dtype."""
    if cfg.precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def make_mesh(world_size: int, replicas: int, device: torch.device) -> DeviceMesh:
    """1-D mesh of every rank (FSDP), or 2-D (replicate, shard) for --hsdp R: ranks 0..S-1 form the first
    replica's shard group, S..2S-1 the second's, and so on (neighbours shard: on a cluster, one node)."""
    if replicas == 1:
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(
        device.type, (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard")
    )


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, cfg: RunConfig, device: torch.device) -> nn.Module:
    """fully_shard each block, then the root (torchtitan's order): each block's parameters are one
    all-gather / reduce-scatter group, unsharded only while that block runs; the root takes what the
    blocks leave (none here: every parameter belongs to a block). Replaces the parameters by DTensor
    shards in place: build the optimizer after this."""
    offload = (
        CPUOffloadPolicy(pin_memory=device.type == "cuda") if cfg.extra["cpu_offload"] else OffloadPolicy()
    )
    settings = {"mesh": mesh, "mp_policy": mixed_precision(cfg), "offload_policy": offload}
    blocks = list(model.children())
    for i, block in enumerate(blocks):
        # The last block's parameters would be gathered again right away for backward: keep them.
        reshard = cfg.extra["reshard_after_forward"] and i < len(blocks) - 1
        fully_shard(block, reshard_after_forward=reshard, **settings)
    fully_shard(model, reshard_after_forward=cfg.extra["reshard_after_forward"], **settings)
    return model


# --- end FSDP options ---


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(argv, IMPL, add_options, check=check_options, description=__doc__, distributed=True)
    # --- FSDP: one process per device. Started as `python train.py [--nproc-per-node N]`, this process has
    # only checked the arguments (bad input stops above, before any rank exists); it now starts the ranks
    # through torch's own launcher, as torchrun would, and waits. Each rank arrives here under torchrun.
    if not under_torchrun():
        launch_ranks(__file__, argv, cfg, IMPL)
    rank, world_size, local_rank = torchrun_env()
    configure_cpu_threads()
    device = pick_device(cfg.device, local_rank)  # --- FSDP: one device per rank, and a process group
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=cfg.timeout)  # a collective waiting longer than this fails
    dist.init_process_group(
        backend,
        store=restart_safe_store(timeout),  # keyed by restart count: see distref/dist.py for why
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    mesh = make_mesh(world_size, cfg.extra["hsdp"], device)
    is_main = rank == 0  # rank 0 alone writes the record, the checkpoint index and the final state_dict
    # --- end FSDP ---

    # ---- Data and model: the same in every impl -------------------------------------------------
    try:
        train_set, test_set, info = load_dataset(cfg)
    except DataError as exc:
        fail(str(exc), IMPL)
    seed_everything(cfg.seed)  # before building: every impl starts from the same parameters
    model = build_model(cfg.model, info, cfg.gpt_layers, param_dtype(cfg)).to(device)
    model.activation_checkpointing = cfg.activation_checkpointing
    # --- FSDP: shard; every rank built the same parameters (same seed), so each keeps its own slice of
    # them (no broadcast needed). A plain copy of the model scores the gathered parameters (evaluation):
    # kept on the CPU between evaluations, where a whole model on every GPU would undo the sharding.
    eval_model = build_model(cfg.model, info, cfg.gpt_layers, param_dtype(cfg))
    model = apply_fsdp(model, mesh, cfg, device)
    optimizer = make_optimizer(cfg, model.parameters())  # over the shards: each rank steps its own
    scaler = make_grad_scaler(cfg, device)
    n_steps = total_steps(cfg, len(train_set))
    epoch_steps = steps_per_epoch(len(train_set), cfg.global_batch_size)
    record = RunRecord(
        IMPL, VERSION, cfg, world_size=world_size, device=device, backend=backend, write_files=is_main
    )  # --- FSDP: every rank keeps the numbers, rank 0 writes them
    record.data["strategy"].update(
        mesh=dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True)),
        reshard_after_forward=cfg.extra["reshard_after_forward"],
        cpu_offload=cfg.extra["cpu_offload"],
    )

    # ---- Resume: model, optimizer, scaler, RNG, record; the data order and lr follow the step ---
    start_step = 0
    if (path := resume_path(cfg)) is not None:
        # --- FSDP: the index (step-N.pt: step, record, options, RNG, file hashes) names a complete
        # sharded checkpoint, the folder step-N/ beside it (torch.distributed.checkpoint). DCP reshards
        # on load: a checkpoint written by any number of ranks loads at any other.
        # The files' hashes are checked before DCP reads them (it unpickles its .metadata).
        try:
            state = load_checkpoint(path, cfg, n_steps)
            load_sharded_checkpoint(model, optimizer, path, state)  # this rank's shards, in place
        except CheckpointError as exc:  # --- FSDP: every rank finds it; rank 0 says it, once
            fail(str(exc), IMPL) if is_main else sys.exit(2)
        # --- end FSDP ---
        scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"])
        record.load_state(state, path)  # the history so far, and what this session changes
        start_step = state["step"]
        if is_main:  # --- FSDP: one line, not one per rank
            print(f"{IMPL}: {describe_resume(path, state)}")

    # The lr is a function of the step: built after a resume, it continues where the run left off.
    scheduler = make_lr_schedule(cfg, optimizer, n_steps, start_step)

    # --- FSDP: this rank's slice of every global batch (same order as single, any world size) ---
    micro_batches = iter(train_loader(train_set, cfg, start_step, n_steps, rank, world_size))
    bar = progress_bar(n_steps, start_step, enabled=is_main, desc=f"{IMPL} ×{world_size}")
    tb = tensorboard_writer(cfg, enabled=is_main)
    pending_losses: list[torch.Tensor] = []  # per-step losses not yet in the record (no sync per step)
    pending_times: list[float] = []
    state_bytes = None  # model-state bytes, measured once gradients and optimizer state both exist

    record.start_training()  # start-up (imports, data, model, set-up) ends: the run's clock starts
    try:
        with profiler(cfg, rank=rank) as prof:  # --- FSDP: one trace per rank
            for step in range(start_step, n_steps):
                t0 = time.perf_counter()
                step_loss = torch.zeros((), device=device)
                for micro_step in range(cfg.grad_accum):
                    x, y = next(micro_batches)
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    # --- FSDP: reduce-scatter gradients only in the last micro-step's backward; before
                    # it, each rank accumulates whole (unsharded) gradients locally, as DDP's no_sync().
                    model.set_requires_gradient_sync(micro_step == cfg.grad_accum - 1)
                    with autocast(cfg, device):
                        loss = loss_fn(model(x), y)
                    # --- FSDP: each micro-batch is 1/grad_accum of this rank's share; the reduce-scatter
                    # then averages over ranks: together, the mean over the whole global batch, as in single.
                    scaler.scale(loss / cfg.grad_accum).backward()
                    step_loss += loss.detach() / cfg.grad_accum
                scale = scaler.get_scale()  # fp16: a host sync, as scaler.step() makes anyway; else 1.0
                scaler.step(optimizer)
                scaler.update()
                if scaler.get_scale() < scale:  # inf/nan gradients: the update was skipped, the scale lowered
                    record.add_skipped_step(step)
                scheduler.step()
                if state_bytes is None:  # --- FSDP: this rank's shards (DTensors' local parts)
                    state_bytes = model_state_bytes(model.parameters(), optimizer)
                optimizer.zero_grad(set_to_none=True)
                synchronize(device)
                pending_times.append(time.perf_counter() - t0)
                pending_losses.append(step_loss)
                prof.step()
                bar.update(1)

                done = step + 1
                is_last = done == n_steps
                eval_now = is_last or (
                    done % cfg.eval_every == 0 if cfg.eval_every else done % epoch_steps == 0
                )
                checkpoint_now = cfg.checkpoint_every and done % cfg.checkpoint_every == 0
                if done % cfg.log_every == 0 or eval_now or checkpoint_now or is_last:
                    # --- FSDP: average the losses over ranks (one all-reduce for all pending steps), so
                    # rank 0 reports the global-batch loss, not its own slice's.
                    losses = all_reduce_mean(torch.stack(pending_losses), world_size).tolist()
                    record.add_steps(done - len(losses), losses, pending_times)
                    stop_if_diverged(losses, done - len(losses), cfg, IMPL)  # nan/inf: exit 1
                    bar.set_postfix(loss=f"{losses[-1]:.4f}")
                    tb.add_scalar("train/loss", losses[-1], done)
                    pending_losses, pending_times = [], []

                if eval_now:
                    eval_started = time.perf_counter()
                    # --- FSDP: each rank scores its shard of the test set with a plain copy of the
                    # gathered model: forwards through the sharded model all-gather collectively, and
                    # shards may differ in batch count, so they would not pair up across ranks. BatchNorm
                    # statistics (buffers, not sharded) are rank 0's everywhere: the saved model's.
                    eval_model.load_state_dict(full_state_dict(model))
                    eval_model.to(device)  # for the evaluation only (see above)
                    for buffer in eval_model.buffers():
                        dist.broadcast(buffer, src=0)
                    batches = eval_batches(test_set, EVAL_BATCH_SIZE, rank, world_size)
                    totals = evaluate(eval_model, batches, device, cfg)
                    eval_model.to("cpu")
                    dist.all_reduce(totals)
                    loss_sum, correct, count = totals
                    accuracy, eval_loss = (correct / count).item(), (loss_sum / count).item()
                    record.add_eval(
                        done, done / epoch_steps, accuracy, eval_loss, time.perf_counter() - eval_started
                    )
                    bar.write(
                        f"{IMPL}: step {done}/{n_steps} test accuracy {accuracy:.4f} loss {eval_loss:.4f}"
                    )
                    tb.add_scalar("test/accuracy", accuracy, done)

                if checkpoint_now:  # --- FSDP: every rank writes its shards (DCP), rank 0 the index
                    state = {
                        "scaler": scaler.state_dict(),
                        "step": done,
                        "total_steps": n_steps,
                        "rng": torch.get_rng_state(),
                        "record": record.state(),
                        "config": cfg.to_dict(),
                    }
                    # --- FSDP: the index step-N.pt, written by rank 0; each rank's shards in step-N/
                    index = checkpoint_path(cfg.checkpoint_dir, done)
                    save_sharded_checkpoint(model, optimizer, index, state, is_main)
    except BaseException as exc:  # the record says the run failed, and why; nothing written is lost
        record.fail(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        bar.close()
        tb.close()

    # --- FSDP: the full state_dict of the core model, gathered from the shards (keys identical for every
    # impl); every rank takes part, rank 0 writes. Buffers (BatchNorm statistics) are rank 0's.
    if cfg.save_final:
        final = full_state_dict(model)
        if is_main:
            save_checkpoint(cfg.save_final, final)
    # --- FSDP: peak memory and model-state bytes (its shards only) of every rank, gathered to rank 0
    peaks = gather_to_rank0(record.training_peak_memory()[0], world_size)
    states = gather_to_rank0(state_bytes, world_size)
    record.finish(cfg.global_batch_size, [int(p) for p in peaks], states)
    if is_main:
        print_summary(record.data)
    return record.data


if __name__ == "__main__":
    with destroy_process_group_on_exit(IMPL):  # --- FSDP: clean teardown on every exit path
        main()
    exit_without_interpreter_teardown()  # --- FSDP: gloo threads vs Python's shutdown (distref/dist.py)
