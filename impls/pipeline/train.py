"""Pipeline parallelism: the model's blocks cut into stages on different ranks, and each batch cut into
micro-batches that flow through the stages at the same time (torch.distributed.pipelining).

impls/model_parallel runs one micro-batch through its parts at a time: while one part works, the others
wait. Here a schedule from torch.distributed.pipelining keeps every stage busy with a different
micro-batch. With p stages and M micro-batches the idle share of each step (the bubble) is (p-1)/(M+p-1)
for GPipe and 1F1B, smaller again with several stages per rank. 2 ranks, M = 4, 1F1B (F3 = forward of
micro-batch 3, B3 its backward; time runs left to right):

    rank 0 (stage 0)   F0 F1 .. .. B0 F2 B1 F3 B2 .. B3      idle: the two gaps at the start, one at the end
    rank 1 (stage 1)   .. F0 B0 F1 B1 F2 B2 F3 B3 .. ..      (GPipe: all forwards, then all backwards)

--schedule                 stages per rank   what it changes
gpipe                      1                 all forwards, then all backwards: M micro-batches' activations held
1f1b                       1                 one forward, one backward: at most p micro-batches in flight
interleaved-1f1b           V (--stages-per-rank, round-robin: rank r holds stages r, r+p, ...): bubble / V
interleaved-zero-bubble    V                 backward split into input- and weight-gradient work that fills gaps
zbv, dualpipev             2, V-shaped       rank r holds stages r and 2p-1-r (the first and the last on rank 0)

Every rank builds the whole model from the seed (as single does), keeps the blocks of its stages and
lets the rest go. `--dp N` runs N pipelines side by side on a 2-D device mesh (world = N × p), each on
its own share of the batch, and averages each stage's gradients across them.

    python impls/pipeline/train.py --nproc-per-node 2 --epochs 2 --out runs/pp       # 2 stages, 1F1B, M=4
    python impls/pipeline/train.py --nproc-per-node 4 --dp 2 --schedule gpipe        # 2 pipelines × 2 stages
    torchrun --standalone --nproc-per-node 2 impls/pipeline/train.py --model gpt --dataset synthetic \\
        --gpt-layers 4 --schedule interleaved-1f1b --microbatches 8

Changes against impls/single/train.py are marked `# --- PIPELINE: ... ---`.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist  # --- PIPELINE ---
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from distref import impl_version
from distref.cli import parse_config
from distref.config import RunConfig, fail, positive_int, under_torchrun
from distref.data import DataError, eval_batches, load_dataset, steps_per_epoch, train_loader
from distref.distributed import (
    destroy_process_group_on_exit,
    exit_without_interpreter_teardown,
    gather_to_rank0,
    launch_ranks,
    recv_tensor,
    restart_safe_store,
    send_tensor,
    torchrun_env,
)
from distref.distributed.partition import choose_cut_points, part_bounds
from distref.distributed.stages import TimedStage
from distref.models import BlockModel, build_model
from distref.record import RunRecord, print_summary
from distref.training import (
    CheckpointError,
    IntervalTimer,
    autocast,
    check_listed_files,
    checkpoint_path,
    configure_cpu_threads,
    describe_resume,
    file_sha256,
    load_checkpoint,
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
    score,
    seed_everything,
    stop_if_diverged,
    synchronize,
    tensorboard_writer,
    total_steps,
    unwrap_state_dict,
)
from distref.training.measure import SavedActivations

IMPL = "pipeline"
VERSION = impl_version(__file__)
EVAL_BATCH_SIZE = 1000
SPLITS_BATCH = False  # --- PIPELINE: check_options splits it over --dp and micro-batches


# --- PIPELINE: strategy options, on top of the core run contract ---
SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "interleaved-zero-bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
ONE_STAGE_PER_RANK = ("gpipe", "1f1b")
V_SHAPED = ("zbv", "dualpipev")  # rank r holds stages r and 2p-1-r


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b", help="the pipeline schedule")
    parser.add_argument(
        "--microbatches",
        metavar="M",
        type=positive_int,
        default=4,
        help="micro-batches per step and pipeline; must divide the pipeline's batch",
    )
    parser.add_argument(
        "--stages-per-rank",
        metavar="V",
        type=positive_int,
        help="stages each rank holds (default: 1 for gpipe/1f1b, 2 for the others)",
    )
    parser.add_argument(
        "--dp",
        metavar="N",
        type=positive_int,
        default=1,
        help="pipelines side by side (data parallel): ranks = N × ranks per pipeline",
    )
    parser.add_argument(
        "--partition",
        metavar="CUTS",
        help="block indices where the model is cut into its p×V stages, e.g. 2 or 1,2,3; "
        "default: the cut balancing parameter counts",
    )


def stages_per_rank(cfg: RunConfig) -> int:
    if cfg.extra["stages_per_rank"] is not None:
        return cfg.extra["stages_per_rank"]
    return 1 if cfg.extra["schedule"] in ONE_STAGE_PER_RANK else 2


def microbatch_problem(schedule: str, m: int, p: int, n_stages: int) -> str | None:
    """What torch 2.13's schedule constructors would raise for M micro-batches and p ranks, said before
    any process starts (a test checks these against the constructors themselves)."""
    if schedule == "1f1b" and m < p:
        return (
            f"--schedule 1f1b needs --microbatches >= the {p} stages (each starts backward after p forwards)"
        )
    if schedule.startswith("interleaved") and m % (rounds := max(1, m // p)):
        return (
            f"--schedule {schedule} needs --microbatches {m} to be a multiple of its {rounds} rounds (M // p)"
        )
    if schedule == "dualpipev" and m < n_stages:
        return f"--schedule dualpipev needs --microbatches >= its {n_stages} stages"
    return None


def check_options(cfg: RunConfig, world_size: int) -> str | None:
    schedule, m, dp, v = (
        cfg.extra["schedule"],
        cfg.extra["microbatches"],
        cfg.extra["dp"],
        stages_per_rank(cfg),
    )
    if world_size % dp:
        return f"--dp {dp} must divide the {world_size} ranks (ranks = pipelines × stage ranks)"
    p = world_size // dp
    if p < 2:
        return f"{world_size} ranks with --dp {dp} leave {p} rank per pipeline: a pipeline needs 2 or more"
    if schedule in ONE_STAGE_PER_RANK and v != 1:
        return f"--schedule {schedule} runs one stage per rank: for {v} use interleaved-1f1b or interleaved-zero-bubble"
    if schedule not in ONE_STAGE_PER_RANK and v == 1:
        return f"--schedule {schedule} needs 2 or more stages per rank (--stages-per-rank 2)"
    if schedule in V_SHAPED and v != 2:
        return f"--schedule {schedule} places exactly 2 stages per rank (a V), not {v}"
    if cfg.global_batch_size % (dp * m):
        return (
            f"--microbatches {m} must divide each pipeline's batch: --global-batch-size "
            f"{cfg.global_batch_size} / --dp {dp} is not a multiple of {m}"
        )
    if cfg.grad_accum != 1:
        return (
            "--grad-accum: the schedule already accumulates over --microbatches; ask for more micro-batches"
        )
    if cfg.precision == "fp16":
        # GradScaler decides per process whether a step had inf/nan gradients; the stages would disagree.
        return "--precision fp16 with one process per stage would need a shared inf check: use bf16"
    cut_problem = choose_cut_points(cfg.model, cfg.extra["partition"], p * v, cfg.gpt_layers)[1]
    return cut_problem or microbatch_problem(schedule, m, p, p * v)


def stage_indices(schedule: str, pp_rank: int, p: int, v: int) -> list[int]:
    """The stages rank `pp_rank` of a pipeline holds: round-robin (r, r+p, ...) or V-shaped."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * p - 1 - pp_rank]
    return [pp_rank + k * p for k in range(v)]


def all_reduce_gradients(
    parameters: Iterable[torch.nn.Parameter], dp_group: dist.ProcessGroup, dp: int
) -> None:
    """Average each gradient over the pipelines (the same stages, other data), once per step after the
    schedule's last backward. (DDP-wrapped stages would do this overlapped, but in torch 2.13 they fail
    with every schedule but 1F1B: `rebuilt parameter indices size is not same as original model
    parameters size`, DDP's reducer seeing a stage's backward run once per micro-batch.)"""
    for parameter in parameters:
        dist.all_reduce(parameter.grad, group=dp_group)  # gloo has no AVG: sum, then divide
        parameter.grad /= dp


def broadcast_buffers(model: torch.nn.Module, dp_group: dist.ProcessGroup) -> None:
    """BatchNorm's running statistics: the first pipeline's, on every pipeline (each updated its own on
    its own data). DDP does the same with rank 0's at every forward; evaluation, checkpoints and the
    final state_dict then agree whichever pipeline they come from."""
    source = dist.get_global_rank(dp_group, 0)
    for buffer in model.buffers():
        dist.broadcast(buffer, src=source, group=dp_group)


@torch.no_grad()
def evaluate_stages(
    stage_modules: dict[int, BlockModel],
    owner: list[int],
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    cfg: RunConfig,
    device: torch.device,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """[loss_sum, correct, count] over `batches`, each batch forward through every stage in order (no
    schedule: nothing to overlap without backward). Activations go to the next stage's rank by point-to-
    point send/recv, or stay here when this rank holds that stage too; the last stage's rank scores."""
    me, last = dist.get_rank(), len(owner) - 1
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for module in stage_modules.values():
        module.eval()
    for x, y in batches:
        kept = None  # an activation for a stage this rank also holds
        for s, module in stage_modules.items():  # in stage order
            if s == 0:
                inputs = x.to(device)
            elif owner[s - 1] == me:
                inputs = kept
            else:
                inputs = recv_tensor(owner[s - 1], device, group)
            with autocast(cfg, device):
                outputs = module(inputs)
            if s == last:
                totals += score(outputs, y.to(device))
            elif owner[s + 1] == me:
                kept = outputs
            else:
                send_tensor(outputs, owner[s + 1], group)
    for module in stage_modules.values():
        module.train()
    return totals


@torch.no_grad()
def stage_examples(
    model: BlockModel,
    bounds: list[tuple[int, int]],
    example: torch.Tensor,
    cfg: RunConfig,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each stage's input and output for one micro-batch `example` (their shapes and dtypes are what
    count), from one forward of the whole model on this rank. Given to PipelineStage, they spare it its
    own shape inference at the first step: a train-mode forward of a real micro-batch on stage 0 and of
    uninitialised tensors on the others, which updates BatchNorm's running statistics once more than
    single does. Here in eval mode: BatchNorm reads its statistics and writes none. On the run's device
    and under its autocast, so that dtypes are those the stages will send; marked as requiring gradients
    where training's would (every activation but the data), so that each stage expects its gradient."""

    def as_in_training(tensor: torch.Tensor, is_activation: bool) -> torch.Tensor:
        return tensor.detach().requires_grad_(is_activation and tensor.is_floating_point())

    blocks = list(model.children())
    model.eval()
    examples, x = [], example.to(device)
    with autocast(cfg, device):
        for first, end in bounds:
            stage_input = x
            for block in blocks[first:end]:
                x = block(x)
            examples.append((as_in_training(stage_input, first > 0), as_in_training(x, True)))
    model.train()
    return examples


def stage_file(index_path: Path, pp_rank: int) -> Path:
    """Where pipeline rank `pp_rank` writes its stages' part of checkpoint `index_path` (step-N.pt)."""
    return index_path.with_name(f"{index_path.stem}.pipeline-rank{pp_rank}.pt")


# --- end PIPELINE options ---


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(
        argv,
        IMPL,
        add_options,
        check=check_options,
        description=__doc__,
        distributed=True,
        splits_batch=SPLITS_BATCH,
    )
    # --- PIPELINE: one process per stage rank, launched here from plain python (as ddp does); a 2-D
    # mesh of (pipelines, stage ranks): rank r's pipeline rank is r % p, its replica index r // p.
    if not under_torchrun():
        launch_ranks(__file__, argv, cfg, IMPL)  # starts the ranks and exits
    configure_cpu_threads()
    # --- PIPELINE: the process group, then the mesh of pipelines × stage ranks
    rank, world_size, local_rank = torchrun_env()
    device = pick_device(cfg.device, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=cfg.timeout)  # a send/recv waiting longer than this fails
    dist.init_process_group(
        backend,
        store=restart_safe_store(timeout),  # keyed by restart count: see distref/dist.py for why
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    schedule_name, n_micro, dp = cfg.extra["schedule"], cfg.extra["microbatches"], cfg.extra["dp"]
    p, v = world_size // dp, stages_per_rank(cfg)
    n_stages = p * v
    mesh = init_device_mesh(device.type, (dp, p), mesh_dim_names=("dp", "pp"))
    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    # The global rank holding each stage in this pipeline (for evaluation's sends).
    owner = [0] * n_stages
    for r in range(p):
        for s in stage_indices(schedule_name, r, p, v):
            owner[s] = dist.get_global_rank(pp_group, r)
    my_stages = stage_indices(schedule_name, pp_rank, p, v)
    is_main = rank == 0  # rank 0 writes the record, the checkpoint index and the final state_dict
    cuts = choose_cut_points(cfg.model, cfg.extra["partition"], n_stages, cfg.gpt_layers)[0]
    # --- end PIPELINE ---

    # ---- Data and model: the same in every impl -------------------------------------------------
    try:
        train_set, test_set, info = load_dataset(cfg)
    except DataError as exc:
        fail(str(exc), IMPL)
    seed_everything(cfg.seed)  # before building: every impl starts from the same parameters
    model = build_model(cfg.model, info, cfg.gpt_layers, param_dtype(cfg))
    # --- PIPELINE: every rank builds the whole model (same seed, same parameters as single), keeps the
    # blocks of its stages and lets the rest go. Each stage is a BlockModel of whole blocks, so
    # parameter names stay the core model's.
    core_keys = list(model.state_dict())
    blocks = list(model.named_children())
    bounds = part_bounds(cuts, len(blocks))
    if is_main:
        how = "as given" if cfg.extra["partition"] else "balancing parameter counts"
        shown = " | ".join(",".join(name for name, _ in blocks[a:b]) for a, b in bounds)
        print(
            f"{IMPL}: {schedule_name}, {n_micro} micro-batches, {dp} pipeline(s) × {p} ranks × {v} "
            f"stage(s); cut at {cuts} ({how}): {shown}"
        )
    # One example forward of the whole model on the device gives every stage its shapes; then only this
    # rank's stages stay there.
    micro_batch = train_set.x[: cfg.global_batch_size // (dp * n_micro)]
    examples = stage_examples(model.to(device), bounds, micro_batch, cfg, device)
    model.to("cpu")
    stage_modules = {
        s: BlockModel(OrderedDict(blocks[slice(*bounds[s])])).to(device) for s in sorted(my_stages)
    }
    for module in stage_modules.values():
        module.activation_checkpointing = cfg.activation_checkpointing
    model = BlockModel(OrderedDict((n, b) for m in stage_modules.values() for n, b in m.named_children()))
    # What each pipeline rank holds: a checkpoint's stage files fit only the same layout.
    layout = [
        [name for s in sorted(stage_indices(schedule_name, r, p, v)) for name, _ in blocks[slice(*bounds[s])]]
        for r in range(p)
    ]
    stages = [  # in the schedule's order for this rank
        TimedStage(stage_modules[s], s, n_stages, device, *examples[s], group=pp_group) for s in my_stages
    ]
    # Each micro-batch's loss is its own mean; the schedule sums the micro-batch gradients and, with
    # scale_grads=True, divides them by M once at the end: the mean over the pipeline's batch, as
    # single --grad-accum M gets by dividing each loss by M. Dividing the loss here as well would
    # shrink every gradient M-fold.
    schedule = SCHEDULES[schedule_name](
        stages[0] if schedule_name in ONE_STAGE_PER_RANK else stages,
        n_microbatches=n_micro,
        loss_fn=loss_fn,
        scale_grads=True,
    )
    has_first, has_last = 0 in my_stages, n_stages - 1 in my_stages
    saved_activations = SavedActivations(model.parameters())
    optimizer = make_optimizer(cfg, model.parameters())  # --- PIPELINE: this rank's parameters
    # --- end PIPELINE ---
    scaler = make_grad_scaler(cfg, device)
    n_steps = total_steps(cfg, len(train_set))
    epoch_steps = steps_per_epoch(len(train_set), cfg.global_batch_size)
    record = RunRecord(
        IMPL,
        VERSION,
        cfg,
        world_size=world_size,
        device=device,
        backend=backend,
        write_files=is_main,
        devices=world_size,
    )  # --- PIPELINE: every rank keeps the numbers, rank 0 writes them
    record.data["strategy"].update(
        schedule=schedule_name,
        microbatches=n_micro,
        dp=dp,
        stages=n_stages,
        cut_points=cuts,
        stages_by_rank=layout,
    )

    # ---- Resume: model, optimizer, scaler, RNG, record; the data order and lr follow the step ---
    start_step = 0
    if (path := resume_path(cfg)) is not None:
        # --- PIPELINE: the index (step-N.pt: step, record, options, layout, the stage files' hashes)
        # names a complete checkpoint; each rank then reads its own stages' file, written beside it.
        try:
            state = load_checkpoint(path, cfg, n_steps)
            if state["stages_by_rank"] != layout:  # --- PIPELINE: the same stages on each rank
                raise CheckpointError(
                    f"checkpoint {path} holds stages {state['stages_by_rank']}, this run {layout}"
                )
            # Every stage file as written for this index (not one left by a crash or copied from
            # another run), checked by every rank before any loads.
            check_listed_files(path, path.parent, state.get("stage_sha256", {}), whole_folder=False)
        except CheckpointError as exc:  # every rank finds it; rank 0 says it, once
            fail(str(exc), IMPL) if is_main else sys.exit(2)
        try:
            mine = torch.load(stage_file(path, pp_rank), map_location="cpu", weights_only=True)
        except (OSError, RuntimeError) as exc:
            fail(str(exc), IMPL)
        model.load_state_dict(mine["model"])  # --- PIPELINE: this rank's stages
        optimizer.load_state_dict(mine["optimizer"])
        # --- end PIPELINE ---
        scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"])
        record.load_state(state, path)  # the history so far, and what this session changes
        start_step = state["step"]
        if is_main:  # --- PIPELINE: one line, not one per rank
            print(f"{IMPL}: {describe_resume(path, state)}")

    # The lr is a function of the step: built after a resume, it continues where the run left off.
    scheduler = make_lr_schedule(cfg, optimizer, n_steps, start_step)

    # --- PIPELINE: each pipeline reads its 1/dp share of every global batch, whole (the schedule cuts
    # it into micro-batches); all stages of a pipeline read the same (the first uses x, the last y).
    batches = iter(train_loader(train_set, cfg, start_step, n_steps, rank=dp_rank, world_size=dp))
    bar = progress_bar(n_steps, start_step, enabled=is_main, desc=f"{IMPL} {schedule_name}")
    tb = tensorboard_writer(cfg, enabled=is_main)
    pending_losses: list[torch.Tensor] = []  # per-step losses not yet in the record (no sync per step)
    pending_times: list[float] = []
    state_bytes = None  # model-state bytes, measured once gradients and optimizer state both exist
    in_schedule = IntervalTimer(device)  # --- PIPELINE: time in the schedule, from the second step on

    record.start_training()  # start-up (imports, data, model, set-up) ends: the run's clock starts
    try:
        with profiler(cfg, rank=rank) as prof:  # --- PIPELINE: one trace per rank
            for step in range(start_step, n_steps):
                t0 = time.perf_counter()
                # --- PIPELINE: the schedule runs every micro-batch's forward and backward on this rank's
                # stages, sending activations and their gradients to the neighbouring stages.
                x, y = next(batches)
                if step == start_step + 1:  # the bubble and activations: measured from the second step
                    for timer in (in_schedule, *(stage.busy for stage in stages)):
                        timer.reset()
                    saved_activations.peak = 0
                saved_activations.at_step_start = saved_activations.live
                micro_losses: list[torch.Tensor] = []  # filled on the rank with the last stage
                inputs = (x.to(device),) if has_first else ()
                targets = {"target": y.to(device), "losses": micro_losses} if has_last else {}
                held = torch.autograd.graph.saved_tensors_hooks(
                    saved_activations.pack, saved_activations.unpack
                )
                with in_schedule.measure(), held, autocast(cfg, device):
                    schedule.step(*inputs, **targets)
                if dp > 1:
                    all_reduce_gradients(model.parameters(), dp_group, dp)
                    broadcast_buffers(model, dp_group)
                step_loss = torch.zeros((), device=device)
                for loss in micro_losses:  # --- PIPELINE: summed as single --grad-accum M sums
                    step_loss += loss.detach() / n_micro
                # --- end PIPELINE ---
                scale = scaler.get_scale()  # fp16: a host sync, as scaler.step() makes anyway; else 1.0
                scaler.step(optimizer)
                scaler.update()
                if scaler.get_scale() < scale:  # inf/nan gradients: the update was skipped, the scale lowered
                    record.add_skipped_step(step)
                scheduler.step()
                if state_bytes is None:
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
                    losses = torch.stack(pending_losses)
                    # --- PIPELINE: the last stage's ranks hold the losses (zeros elsewhere): their
                    # sum over every rank, / dp, is the mean over the pipelines
                    dist.all_reduce(losses)
                    losses = (losses / dp).tolist()
                    record.add_steps(done - len(losses), losses, pending_times)
                    stop_if_diverged(losses, done - len(losses), cfg, IMPL)  # nan/inf: exit 1
                    bar.set_postfix(loss=f"{losses[-1]:.4f}")
                    tb.add_scalar("train/loss", losses[-1], done)
                    pending_losses, pending_times = [], []

                if eval_now:
                    eval_started = time.perf_counter()
                    # --- PIPELINE: each pipeline scores its share of the test set through its stages;
                    # the totals are summed over every rank (only the last stages' are non-zero)
                    shard = eval_batches(test_set, EVAL_BATCH_SIZE, dp_rank, dp)
                    totals = evaluate_stages(stage_modules, owner, shard, cfg, device, pp_group)
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

                if checkpoint_now:
                    # --- PIPELINE: each pipeline rank of the first pipeline writes its stages (replicas
                    # hold the same); after a barrier, rank 0 writes the index that makes the set
                    # complete: a crash before it leaves the previous checkpoint the newest one.
                    index = checkpoint_path(cfg.checkpoint_dir, done)
                    if dp_rank == 0:
                        held = {"model": unwrap_state_dict(model), "optimizer": optimizer.state_dict()}
                        save_checkpoint(stage_file(index, pp_rank), held)
                    dist.barrier()
                    if is_main:
                        stage_files = [stage_file(index, r) for r in range(p)]
                        state = {
                            "stages_by_rank": layout,
                            # ties each stage file to this index: a resume checks them before loading
                            "stage_sha256": {f.name: file_sha256(f) for f in stage_files},
                            "scaler": scaler.state_dict(),
                            "step": done,
                            "total_steps": n_steps,
                            "rng": torch.get_rng_state(),
                            "record": record.state(),
                            "config": cfg.to_dict(),
                        }
                        save_checkpoint(index, state)
                    # --- end PIPELINE ---
    except BaseException as exc:  # the record says the run failed, and why; nothing written is lost
        record.fail(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        bar.close()
        tb.close()

    # --- PIPELINE: rank 0 gathers every stage into the full fp32 state_dict (core keys, core order)
    if cfg.save_final:
        gathered = gather_to_rank0(unwrap_state_dict(model), world_size)
        if is_main:
            merged = {k: v for held in gathered for k, v in held.items()}  # replicas hold equal copies
            save_checkpoint(cfg.save_final, {k: merged[k] for k in core_keys})
    # --- PIPELINE: each rank's memory, model state (its stages only), activations held for backward,
    # and busy share of its time in the schedule, gathered to rank 0; the bubble is the idle share
    busy_s, schedule_s = sum(stage.busy.seconds() for stage in stages), in_schedule.seconds()
    measured = gather_to_rank0(
        {
            "peak": record.training_peak_memory()[0],
            "state": state_bytes,
            "activations": saved_activations.peak,
            "busy_fraction": busy_s / schedule_s if schedule_s else None,
        },
        world_size,
    )
    if is_main:
        busy = [m["busy_fraction"] for m in measured]
        record.data["strategy"]["busy_fraction"] = busy
        record.data["strategy"]["peak_activation_bytes"] = [m["activations"] for m in measured]
        if all(b is not None for b in busy):
            record.data["bubble_fraction"] = 1 - sum(busy) / len(busy)
    record.finish(cfg.global_batch_size, [m["peak"] for m in measured], [m["state"] for m in measured])
    if is_main:
        print_summary(record.data)
    return record.data


if __name__ == "__main__":
    with destroy_process_group_on_exit(IMPL):  # --- PIPELINE: clean teardown on every exit path
        main()
    exit_without_interpreter_teardown()  # --- PIPELINE: gloo threads vs Python's shutdown
