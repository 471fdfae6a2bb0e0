"""DistributedDataParallel (DDP): one process per device, each holding a full replica of the model.

Every rank runs this file, started by torchrun or by `python train.py`, which checks the arguments and
then starts the ranks through torch's own launcher (torch.distributed.run). Each rank takes its own slice
of the global batch and runs forward and backward on it; during backward DDP all-reduces (sums: each rank's
loss is its part of the global batch's mean) the gradients bucket by bucket, overlapping communication
with the rest of backward. All replicas then take
the same optimizer step, so they stay identical — and identical to `impls/single` trained on the whole
global batch.

    python impls/ddp/train.py --nproc-per-node 2 --epochs 2 --out runs/ddp   # starts 2 ranks (CPU: gloo)
    torchrun --standalone --nproc-per-node 2 impls/ddp/train.py --epochs 2     # the same, with torchrun
    python impls/ddp/train.py --device cuda                                     # one rank per visible GPU
    nox -s ddp-cpu / nox -s ddp-gpu

Changes against impls/single/train.py are marked `# --- DDP: ... ---`.
"""

import contextlib
import dataclasses

import torch
import torch.distributed as dist  # --- DDP ---
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from distref import impl_version
from distref.cli import add_options_for, exit_on_bad_input, option, parse_config
from distref.config import RunConfig, positive_float, under_torchrun, uses_cuda
from distref.cost.activations import predicted_for_run
from distref.cost.data_parallel import ddp_rank_cost
from distref.cost.usage import Usage, model_usage, parameters_of
from distref.data import (
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
from distref.models import build_model
from distref.record import RunRecord, print_summary
from distref.training.bookkeeping import Cadence, StepLog
from distref.training.checkpoint import (
    load_checkpoint,
    resume_path,
    resume_step,
    save_checkpoint,
    save_step_checkpoint,
    unwrap_state_dict,
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
from distref.training.steps import evaluate, loss_sum

IMPL = "ddp"
VERSION = impl_version(__file__)


# --- DDP: the strategy ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DDPOptions:
    """DDP's own options (cfg.strategy), each declared with its command-line option."""

    bucket_cap_mb: float = option(
        "gradient bucket size: bigger = fewer all-reduces, later overlap",
        metavar="MB",
        type=positive_float,
        default=25.0,
    )
    static_graph: bool = option(
        "promise the same used parameters every step (lets DDP skip per-step checks)",
        action="store_true",
        default=False,
    )
    find_unused_parameters: bool = option(
        "look for parameters the loss does not reach in every backward: for a model whose graph "
        "changes from step to step (stochastic depth, LayerDrop); one traced forward finds the others",
        action="store_true",
        default=False,
    )
    grad_as_bucket_view: bool = option(
        "gradients are views into the all-reduce buckets (saves one gradient copy)",
        action="store_true",
        default=False,
    )
    comm_hook: str = option(
        "compress gradients before the all-reduce",
        choices=("none", "fp16", "bf16", "powersgd"),
        default="none",
    )


def apply_ddp(
    model: nn.Module, options: DDPOptions, device: torch.device, rank: int, usage: Usage | None = None
) -> DDP:
    """Wrap the model in DDP (after it is on its device, before the optimizer is built). `usage`: which
    parameters the loss reaches (distref.cost.usage: a forward and backward on the meta device)."""
    has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if has_batchnorm and device.type == "cuda":
        # Per-rank BatchNorm would normalise with each rank's micro-batch statistics only; SyncBatchNorm
        # computes them over the whole global batch (one extra all-reduce per BN layer).
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    elif has_batchnorm and rank == 0:
        print(
            f"{IMPL}: SyncBatchNorm needs CUDA in torch {torch.__version__}; on CPU each rank keeps "
            "its own BatchNorm statistics (parity with single holds only for models without BatchNorm)"
        )
    # DDP's reducer waits for the gradient of every parameter that requires one: a parameter the loss
    # never reaches (a layer of yours built and not used) ends the second step in `Expected to have
    # finished reduction`. Told which, DDP looks for them in each backward; where the meta forward
    # cannot tell (usage.unknown), it looks too.
    known = usage is not None and usage.unknown is None
    unused = [n for n, p in model.named_parameters() if known and p.requires_grad and not usage.is_trained(n)]
    find_unused = options.find_unused_parameters or bool(unused or (usage is not None and usage.unknown))
    find_unused = find_unused and not options.static_graph
    if find_unused and rank == 0:
        said = (
            f"{', '.join(unused)} not used by the loss"
            if unused
            else f"unknown which parameters the loss uses ({usage.unknown})"
        )
        print(
            f"{IMPL}: {said}: DDP looks for unused parameters in every backward (find_unused_parameters: "
            "one more walk of the graph per step; their gradients stay None, as in single)"
        )
    ddp_model = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=options.bucket_cap_mb,
        static_graph=options.static_graph,  # (a static graph knows its unused parameters after step 1)
        find_unused_parameters=find_unused,
        gradient_as_bucket_view=options.grad_as_bucket_view,
    )
    # DDP's own all-reduce averages the gradients (÷ world size). Each rank's loss is already its part of
    # the global batch's mean (its loss sum ÷ the global batch's scored targets), so the gradients must be
    # summed: a communication hook replaces the reduction, optionally sending bf16/fp16 (half the bytes).
    hook = options.comm_hook
    if hook == "powersgd":  # PowerSGD averages inside its hook, with no option to sum: undo the ÷ N after it
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=10
        )
        ddp_model.register_comm_hook(state, times_world_size(powerSGD_hook.powerSGD_hook))
    else:
        ddp_model.register_comm_hook(WIRE_DTYPES[hook], summing_hook)
    return ddp_model


WIRE_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}  # --comm-hook → what is sent


def summing_hook(
    wire_dtype: torch.dtype | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:  # DDP checks these annotations, so no `from __future__ import`
    """All-reduce one bucket of gradients as a sum over the ranks, sent in `wire_dtype` (bf16: half the
    bytes, fp32's exponent range; fp16: half the bytes, a smaller range; None: as they are). torch's
    fp16/bf16_compress_hook average instead, and its bf16 one refuses to run without CUDA (DDP checks the
    hook's *name*) although gloo all-reduces bf16 fine."""
    buffer = bucket.buffer()
    sent = buffer if wire_dtype is None else buffer.to(wire_dtype)
    work = dist.all_reduce(sent, async_op=True)

    def received(_: torch.futures.Future) -> torch.Tensor:
        if sent is not buffer:
            buffer.copy_(sent)  # (the all-reduce summed `sent` in place)
        return buffer

    return work.get_future().then(received)


def times_world_size(hook):
    """`hook`, its averaged result multiplied back by the world size: a sum."""

    def summed(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return hook(state, bucket).then(lambda fut: fut.value().mul_(dist.get_world_size()))

    return summed


# --- end DDP strategy ---


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_options(argv)
    # --- DDP: one process per device. Started as `python train.py [--nproc-per-node N]`, this process has
    # only checked the arguments (bad input stops above, before any rank exists); it now starts the ranks
    # through torch's own launcher, as torchrun would, and waits. Each rank arrives here under torchrun.
    if not under_torchrun():
        launch_ranks(__file__, argv, cfg, IMPL)
    configure_cpu_threads()
    # --- DDP: one device per rank, and the process group over every rank (NCCL on CUDA, gloo on the
    # CPU; --timeout; a store that survives restarts): distref.distributed.start_process_group.
    rank, world_size, device, backend = start_process_group(cfg)
    is_main = rank == 0  # rank 0 alone writes the record, checkpoints and the final state_dict
    # --- end DDP ---

    # ---- Data and model: the same in every impl -------------------------------------------------
    with exit_on_bad_input(IMPL):  # a dataset that fails its md5: one line, exit 2
        train_set, test_set, info = load_dataset(cfg)
    seed_everything(cfg.seed)  # before building: every impl starts from the same parameters
    model = build_model(cfg.model, info, cfg.gpt_layers, param_dtype(cfg), cfg.moe).to(device)
    model.activation_checkpointing = cfg.activation_checkpointing
    if cfg.compile:  # torch.compile, block by block, before any strategy wraps the model
        compile_blocks(model)
    # --- DDP: every rank read the data and built the model itself: they must agree (one all-gather)
    with exit_on_bad_input(IMPL, say=is_main):
        check_ranks_agree(cfg, train_set, test_set, model)
    # --- DDP: wrap; DDP also broadcasts rank 0's parameters so every replica starts identical ---
    usage = model_usage(cfg.model, info, cfg.gpt_layers, cfg.moe)  # which parameters train: a forward on meta
    model = apply_ddp(model, cfg.strategy, device, rank, usage)
    optimizer = make_optimizer(cfg, model.parameters())
    scaler = make_grad_scaler(cfg, device)
    n_steps = total_steps(cfg, len(train_set))
    cadence = Cadence(cfg, n_steps, steps_per_epoch(len(train_set), cfg.global_batch_size))
    record = RunRecord(
        IMPL, VERSION, cfg, world_size=world_size, device=device, backend=backend, write_files=is_main
    )  # --- DDP: every rank keeps the numbers, rank 0 writes them

    # ---- Resume: model, optimizer, scaler, RNG, record; the data order and lr follow the step ---
    start_step = 0
    if (path := resume_path(cfg)) is not None:
        with exit_on_bad_input(IMPL, say=is_main):  # another run's checkpoint: rank 0 says it, once
            state = load_checkpoint(path, cfg, n_steps, holds=("model", "optimizer", "scaler"))
        model.module.load_state_dict(state["model"])  # --- DDP: every rank loads rank 0's checkpoint
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        start_step = resume_step(state, path, record, IMPL, say=is_main)  # --- DDP: said once

    # The lr is a function of the step: built after a resume, it continues where the run left off.
    scheduler = make_lr_schedule(cfg, optimizer, n_steps, start_step)
    # --- DDP: this rank's slice of every global batch (same order as single, any world size) ---
    micro_batches = train_loader(train_set, cfg, start_step, n_steps, rank, world_size, device=device)
    log = StepLog(
        record, cfg, IMPL, cadence, start_step, show=is_main, desc=f"{IMPL} ×{world_size}", device=device
    )
    state_bytes = None  # model-state bytes, measured once gradients and optimizer state both exist

    record.start_training()  # start-up (imports, data, model, set-up) ends: the run's clock starts
    with log, profiler(cfg, rank=rank) as prof:  # --- DDP: one trace per rank
        for step in range(start_step, n_steps):
            started = log.step_starts(step)
            # This step's random numbers (dropout): a function of (seed, step), so a resumed run draws
            # what an uninterrupted one does. (Each impl says which stream each of its ranks draws.)
            seed_step(cfg.seed, step, stream=rank, devices=[device])  # --- DDP: each rank its own stream
            # The step's loss is the mean over every scored target of the whole global batch: each
            # micro-batch adds its loss *sum* over this count. (The mean of the micro-batches' own means
            # would weigh a micro-batch scoring 3 targets as much as one scoring 60: padding, prompts.)
            scored = scored_targets(train_set, cfg, step)  # --- DDP: of the whole batch, not this rank's
            step_loss = None
            for micro_step in range(cfg.grad_accum):
                x, y = next(micro_batches)  # on the device already, the next one on its way
                # --- DDP: all-reduce gradients only in the last micro-step's backward; before it,
                # no_sync() lets each rank accumulate locally (K-1 fewer all-reduces per step).
                # Counted per rank: every rank runs grad_accum micro-steps of B/(world·K) samples.
                last_micro_step = micro_step == cfg.grad_accum - 1
                with contextlib.nullcontext() if last_micro_step else model.no_sync():
                    with autocast(cfg, device):
                        loss = loss_sum(model(x), y) / scored
                    # The micro-batches' gradients add up to the global batch's, as one big batch gives.
                    # --- DDP: and so do the ranks': the all-reduce sums them (summing_hook), where DDP's
                    # own would average them, dividing the global batch's gradient by the world size.
                    scaler.scale(loss).backward()
                step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()  # (K=1: no add)
            scale = scaler.get_scale()  # fp16: a host sync, as scaler.step() makes anyway; else 1.0
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() < scale:  # inf/nan gradients: the update was skipped, the scale lowered
                record.add_skipped_step(step)
            scheduler.step()
            if state_bytes is None:
                state_bytes = model_state_bytes(model.parameters(), optimizer)
            optimizer.zero_grad(set_to_none=True)
            log.step_done(step_loss, started)  # (no wait for the GPU: the step is timed by events)
            prof.step()

            due = cadence.after(step)
            if due.log:
                # --- DDP: sum the ranks' parts of the loss (one all-reduce for all pending steps), so
                # rank 0 reports the global-batch loss, not its own slice's (pytorch/examples #905).
                log.flush(due.done, reduce=all_reduce_sum)
            if due.eval:
                started = log.eval_starts()
                # --- DDP: each rank scores its shard of the test set with the bare module (no DDP
                # forward: shards may differ in batch count); sums are all-reduced into global numbers.
                # Parameters are identical on every rank, but on CPU (no SyncBatchNorm) each rank's last
                # forward updated its own BatchNorm running statistics from its own slice: score the model
                # rank 0 saves, with rank 0's buffers everywhere (DDP broadcasts them at the next forward).
                for buffer in model.module.buffers():
                    dist.broadcast(buffer, src=0)
                totals = evaluate(
                    model.module, eval_batches(test_set, rank=rank, world_size=world_size), device, cfg
                )
                dist.all_reduce(totals)
                log.evaluated(due.done, totals, started)
            if due.checkpoint and is_main:  # --- DDP: replicas are identical; rank 0 saves for all
                states = dict(model=model.module.state_dict(), optimizer=optimizer.state_dict())
                save_step_checkpoint(cfg, due.done, n_steps, record, **states, scaler=scaler.state_dict())

    # --- DDP: rank 0 saves the full state_dict of the core model (fp32; fp64 under --precision fp64)
    if cfg.save_final and is_main:
        save_checkpoint(cfg.save_final, unwrap_state_dict(model))
    # --- DDP: every rank's memory and model states (a full replica each), beside the formulas', and what
    # its counted step communicated beside the formula's (distref.cost.data_parallel), gathered to rank 0
    predicted = ddp_rank_cost(
        parameters_of(model.module.named_parameters(), usage),
        [(str(b.dtype), b.numel() * b.element_size()) for b in model.module.buffers()],
        world_size,
        bucket_cap_mb=cfg.strategy.bucket_cap_mb,
        comm_hook=cfg.strategy.comm_hook,
        find_unused_parameters=cfg.strategy.find_unused_parameters,
        static_graph=cfg.strategy.static_graph,
        optimizer=cfg.optimizer,
        step_bytes=torch.get_default_dtype().itemsize,
        unknown=usage.unknown,
        activations=predicted_for_run(cfg, info, world_size, device.type),
    )
    finish_record(record, cfg.global_batch_size, state_bytes, world_size, predicted)  # --- DDP: to rank 0
    if is_main:
        print_summary(record.data)
    return record.data


# ---- The command line: the core options (distref.cli) and DDP's own ------------------------------
# --- DDP: its options, parsed once into DDPOptions (cfg.strategy) ---
add_options = add_options_for(DDPOptions)  # DDPOptions' fields, each its --option


def check_options(cfg: RunConfig, world_size: int) -> str | None:
    if cfg.strategy.static_graph and cfg.grad_accum > 1:
        # torch 2.13: the first no_sync() step trips `expect_autograd_hooks_` in reducer.cpp on every rank
        # (pytorch #143580); the workaround proposed there silently stops gradients being all-reduced.
        return "--static-graph cannot be combined with --grad-accum > 1 (no_sync) in torch 2.13; drop one"
    if cfg.strategy.static_graph and cfg.strategy.find_unused_parameters:
        return "--static-graph promises the same used parameters every step; --find-unused-parameters does not: drop one"
    if cfg.strategy.comm_hook == "powersgd" and not uses_cuda(cfg):
        # Measured on torch 2.13 + gloo: powerSGD_hook crashes or hangs intermittently once the
        # gradients span 2+ buckets, and batched_powerSGD_hook always fails. Refuse rather than hang.
        return "--comm-hook powersgd is not reliable on gloo (CPU); use it with NCCL, or fp16/bf16 on CPU"
    return None


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
        strategy_options=DDPOptions,
    )


# --- end DDP options ---


if __name__ == "__main__":
    with destroy_process_group_on_exit(IMPL):  # --- DDP: clean teardown on every exit path
        main()
    exit_without_interpreter_teardown()  # --- DDP: gloo threads vs Python's shutdown (distref/distributed)
