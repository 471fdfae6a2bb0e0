"""Pipeline parallelism: the model's blocks cut into stages on different ranks, and each batch cut into
micro-batches that flow through the stages at the same time (torch.distributed.pipelining).

impls/model_parallel runs one micro-batch through its parts at a time: while one part works, the others
wait. Here a schedule from torch.distributed.pipelining keeps every stage busy with a different
micro-batch. With p stages and M micro-batches the idle share of each step (the bubble) is (p-1)/(M+p-1)
for GPipe and 1F1B, smaller again with several stages per rank. 2 ranks, M = 4, 1F1B (F3 = forward of
micro-batch 3, B3 its backward; time runs left to right):

    rank 0 (stage 0)   F0 F1 .. B0 F2 B1 F3 B2 .. B3      idle: 2 of 10 slots each, (p-1)/(M+p-1) = 1/5
    rank 1 (stage 1)   .. F0 B0 F1 B1 F2 B2 F3 B3 ..      (GPipe: all forwards, then all backwards)

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
import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterable
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
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from distref import impl_version
from distref.cli import exit_on_bad_input, parse_config
from distref.config import RunConfig, fail, positive_int, under_torchrun
from distref.cost import Predicted
from distref.cost.activations import Action, no_formula, one_stage_order, pipeline_rank
from distref.cost.memory import replicated
from distref.cost.pipeline import pipeline as pipeline_communication
from distref.cost.usage import model_usage
from distref.data import (
    DatasetInfo,
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
    gather_to_rank0,
    launch_ranks,
    recv_tensor,
    send_tensor,
    start_process_group,
)
from distref.distributed.partition import block_sizes, choose_cut_points, cut_problem, part_bounds
from distref.distributed.stages import ScheduleTimeline, TimedStage
from distref.models import BlockModel, build_model
from distref.record import RunRecord, print_summary
from distref.training.bookkeeping import Cadence, StepLog
from distref.training.checkpoint import (
    CheckpointError,
    check_listed_files,
    checkpoint_path,
    checkpoint_state,
    file_sha256,
    load_checkpoint,
    resume_path,
    resume_step,
    save_checkpoint,
    unwrap_state_dict,
)
from distref.training.device import (
    autocast,
    configure_cpu_threads,
    param_dtype,
    seed_everything,
    seed_step,
    synchronize,
)
from distref.training.measure import IntervalTimer, SavedActivations, model_state_bytes
from distref.training.monitor import profiler
from distref.training.optim import make_grad_scaler, make_lr_schedule, make_optimizer, total_steps
from distref.training.steps import loss_sum, score

IMPL = "pipeline"
VERSION = impl_version(__file__)


# --- PIPELINE: the strategy ----------------------------------------------------------------------
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


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """The pipeline's own options (`add_options`, at the end of this file, gives their help and defaults)."""

    schedule: str
    microbatches: int
    stages_per_rank: int | None  # None: the schedule's default (`stages_per_rank`)
    dp: int
    partition: str | None


def stages_per_rank(options: PipelineOptions) -> int:
    if options.stages_per_rank is not None:
        return options.stages_per_rank
    return 1 if options.schedule in ONE_STAGE_PER_RANK else 2


def stage_indices(schedule: str, pp_rank: int, p: int, v: int) -> list[int]:
    """The stages rank `pp_rank` of a pipeline holds: round-robin (r, r+p, ...) or V-shaped."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * p - 1 - pp_rank]
    return [pp_rank + k * p for k in range(v)]


@dataclasses.dataclass(frozen=True)
class PipelineMesh:
    """Where this rank sits in the 2-D mesh of (pipelines, stage ranks)."""

    p: int  # stage ranks per pipeline
    v: int  # stages per rank
    pp_group: dist.ProcessGroup  # this rank's pipeline: its stages' sends and receives
    dp_group: dist.ProcessGroup  # the ranks holding the same stages in the other pipelines
    pp_rank: int
    dp_rank: int
    owner: list[int]  # the global rank holding each stage in this pipeline (for evaluation's sends)
    my_stages: list[int]  # this rank's stages, in the schedule's order

    @property
    def n_stages(self) -> int:
        return self.p * self.v


def pipeline_mesh(device: torch.device, options: PipelineOptions, world_size: int) -> PipelineMesh:
    """A 2-D mesh of (pipelines, stage ranks): rank r's pipeline rank is r % p, its replica index r // p."""
    p, v = world_size // options.dp, stages_per_rank(options)
    mesh = init_device_mesh(device.type, (options.dp, p), mesh_dim_names=("dp", "pp"))
    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    owner = [0] * (p * v)
    for r in range(p):
        for s in stage_indices(options.schedule, r, p, v):
            owner[s] = dist.get_global_rank(pp_group, r)
    my_stages = stage_indices(options.schedule, pp_rank, p, v)
    return PipelineMesh(p, v, pp_group, dp_group, pp_rank, dp_rank, owner, my_stages)


def cut_into_stages(
    model: BlockModel,
    cuts: list[int],
    cfg: RunConfig,
    mesh: PipelineMesh,
    example: torch.Tensor,
    device: torch.device,
    say: bool,
) -> tuple[dict[int, BlockModel], list[tuple[torch.Tensor, torch.Tensor]], list[list[str]]]:
    """This rank's stages of the whole `model`, cut at `cuts`, on `device`, by stage index; each
    stage's example input and output (`stage_examples`, for micro-batch `example`); and the layout:
    the blocks each pipeline rank holds. Each stage is a BlockModel of whole blocks, so parameter
    names stay the core model's."""
    options, p, v = cfg.strategy, mesh.p, mesh.v
    blocks = list(model.named_children())
    bounds = part_bounds(cuts, len(blocks))
    if say:
        how = "as given" if options.partition else "balancing parameter counts"
        shown = " | ".join(",".join(name for name, _ in blocks[a:b]) for a, b in bounds)
        print(
            f"{IMPL}: {options.schedule}, {options.microbatches} micro-batches, {options.dp} pipeline(s) "
            f"× {p} ranks × {v} stage(s); cut at {cuts} ({how}): {shown}"
        )
    # One example forward of the whole model on the device gives every stage its shapes; then only this
    # rank's stages stay there.
    examples = stage_examples(model.to(device), bounds, example, cfg, device)
    model.to("cpu")
    stage_modules = {
        s: BlockModel(OrderedDict(blocks[slice(*bounds[s])])).to(device) for s in sorted(mesh.my_stages)
    }
    for module in stage_modules.values():
        module.activation_checkpointing = cfg.activation_checkpointing
    # What each pipeline rank holds: a checkpoint's stage files fit only the same layout.
    by_rank = [sorted(stage_indices(options.schedule, r, p, v)) for r in range(p)]
    layout = [[name for s in held for name, _ in blocks[slice(*bounds[s])]] for held in by_rank]
    return stage_modules, examples, layout


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


def build_schedule(
    stage_modules: dict[int, BlockModel],
    examples: list[tuple[torch.Tensor, torch.Tensor]],
    mesh: PipelineMesh,
    options: PipelineOptions,
    device: torch.device,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[list[TimedStage], PipelineScheduleSingle | PipelineScheduleMulti]:
    """This rank's PipelineStages (each timing its own work: the bubble) and the schedule that runs them,
    `loss` on the last stage's micro-batches."""
    n_stages, pp_group, my_stages = mesh.n_stages, mesh.pp_group, mesh.my_stages
    timeline = ScheduleTimeline(device)  # this rank's work in a step, each stage's put on it (report)
    stages = [  # in the schedule's order for this rank
        TimedStage(stage_modules[s], s, n_stages, device, *examples[s], group=pp_group, timeline=timeline)
        for s in my_stages
    ]
    # The schedule sums the micro-batches' gradients. scale_grads=False: it would then divide them by M,
    # which the loss's divisor (the global batch's scored targets, GlobalBatchMean) has already done.
    schedule = SCHEDULES[options.schedule](
        stages[0] if options.schedule in ONE_STAGE_PER_RANK else stages,
        n_microbatches=options.microbatches,
        loss_fn=loss,
        scale_grads=False,
    )
    return stages, schedule


class GlobalBatchMean:
    """The schedule's loss_fn: a micro-batch's loss *sum* over the scored targets of the whole global batch
    (`scored`, set before each step), so that the micro-batches' and the pipelines' gradients add up to the
    global batch's mean, as single's step computes it (not the mean of the micro-batches' means)."""

    def __init__(self) -> None:
        self.scored = 1

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_sum(logits, targets) / self.scored


def run_schedule(
    schedule: PipelineScheduleSingle | PipelineScheduleMulti,
    x: torch.Tensor,
    y: torch.Tensor,
    mesh: PipelineMesh,
    cfg: RunConfig,
    device: torch.device,
    in_schedule: IntervalTimer,
    saved_activations: SavedActivations,
    timeline: ScheduleTimeline,
    step: int,
) -> list[torch.Tensor]:
    """One step of the schedule on this rank's stages, batch (x, y) cut into micro-batches: the first
    stage takes x, the last y. Returns each micro-batch's loss on the rank with the last stage (none
    elsewhere). Timed (`in_schedule`, and each stage's work on the `timeline` of step `step`), and the
    activations autograd saves for backward counted."""
    saved_activations.at_step_start = saved_activations.live
    micro_losses: list[torch.Tensor] = []  # filled on the rank with the last stage
    has_first, has_last = 0 in mesh.my_stages, mesh.n_stages - 1 in mesh.my_stages
    inputs = (x.to(device),) if has_first else ()
    targets = {"target": y.to(device), "losses": micro_losses} if has_last else {}
    held = torch.autograd.graph.saved_tensors_hooks(saved_activations.pack, saved_activations.unpack)
    with timeline.step(step), in_schedule.measure(), held, autocast(cfg, device):
        schedule.step(*inputs, **targets)
    return micro_losses


def all_reduce_gradients(parameters: Iterable[torch.nn.Parameter], dp_group: dist.ProcessGroup) -> None:
    """Sum each gradient over the pipelines (the same stages, other data), once per step after the
    schedule's last backward: each pipeline's loss is its part of the global batch's mean, so the sum is
    the global batch's gradient. (DDP-wrapped stages would do this overlapped, but in torch 2.13 they fail
    with every schedule but 1F1B: `rebuilt parameter indices size is not same as original model
    parameters size`, DDP's reducer seeing a stage's backward run once per micro-batch.)"""
    for parameter in parameters:
        if parameter.grad is not None:  # (frozen, or not reached by the loss: no gradient on any pipeline)
            dist.all_reduce(parameter.grad, group=dp_group)


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


# The checkpoint: an index step-N.pt (step, record, options, layout, the stage files' hashes) that
# names a complete checkpoint, and beside it one file per pipeline rank with its stages.
def stage_file(index_path: Path, pp_rank: int) -> Path:
    """Where pipeline rank `pp_rank` writes its stages' part of checkpoint `index_path` (step-N.pt)."""
    return index_path.with_name(f"{index_path.stem}.pipeline-rank{pp_rank}.pt")


def save_stage_checkpoint(
    cfg: RunConfig,
    done: int,
    n_steps: int,
    record: RunRecord,
    mesh: PipelineMesh,
    layout: list[list[str]],
    model: BlockModel,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
) -> None:
    """Each pipeline rank of the first pipeline writes its stages (replicas hold the same); after a
    barrier, rank 0 writes the index that makes the set complete: a crash before it leaves the previous
    checkpoint the newest one."""
    index = checkpoint_path(cfg.checkpoint_dir, done)
    if mesh.dp_rank == 0:
        held = {"model": unwrap_state_dict(model), "optimizer": optimizer.state_dict()}
        save_checkpoint(stage_file(index, mesh.pp_rank), held)
    dist.barrier()
    if dist.get_rank() == 0:
        stage_files = [stage_file(index, r) for r in range(mesh.p)]
        state = checkpoint_state(
            cfg,
            done,
            n_steps,
            record,
            stages_by_rank=layout,
            # ties each stage file to this index: a resume checks them before loading
            stage_sha256={f.name: file_sha256(f) for f in stage_files},
            scaler=scaler.state_dict(),
        )
        save_checkpoint(index, state)


def load_stage_checkpoint(
    path: Path, cfg: RunConfig, n_steps: int, layout: list[list[str]], pp_rank: int, is_main: bool
) -> tuple[dict, dict]:
    """The index `path` (checked: this run's, the same stages on each rank, every stage file the one
    written for it) and this rank's stages' file beside it: (index, {"model", "optimizer"})."""
    with exit_on_bad_input(IMPL, say=is_main):  # every rank finds it; rank 0 says it, once
        state = load_checkpoint(path, cfg, n_steps, holds=("stages_by_rank", "scaler"))
        if state["stages_by_rank"] != layout:  # the same stages on each rank
            raise CheckpointError(
                f"checkpoint {path} holds stages {state['stages_by_rank']}, this run {layout}"
            )
        # Every stage file as written for this index (not one left by a crash or copied from
        # another run), checked by every rank before any loads.
        check_listed_files(path, path.parent, state.get("stage_sha256", {}), whole_folder=False)
    try:
        mine = torch.load(stage_file(path, pp_rank), map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as exc:
        fail(str(exc), IMPL)
    return state, mine


def save_final_state(
    path: str, model: BlockModel, core_keys: list[str], world_size: int, is_main: bool
) -> None:
    """Rank 0 gathers every stage into the full fp32 state_dict (core keys, core order) and writes it."""
    gathered = gather_to_rank0(unwrap_state_dict(model), world_size)
    if is_main:
        merged = {k: v for held in gathered for k, v in held.items()}  # replicas hold equal copies
        save_checkpoint(path, {k: merged[k] for k in core_keys})


def record_the_bubble(
    record: RunRecord,
    stages: list[TimedStage],
    in_schedule: IntervalTimer,
    saved_activations: SavedActivations,
    world_size: int,
    is_main: bool,
) -> None:
    """Each rank's activations held for backward, busy share of its time in the schedule and timeline
    of one step (its stages' work, ScheduleTimeline), gathered to rank 0 into the record; the bubble is
    the idle share."""
    busy_s, schedule_s = sum(stage.busy.seconds() for stage in stages), in_schedule.seconds()
    measured = gather_to_rank0(
        {
            "activations": saved_activations.peak,
            "busy_fraction": busy_s / schedule_s if schedule_s else None,
            "timeline": stages[0].timeline.result(),  # (one timeline per rank, shared by its stages)
        },
        world_size,
    )
    if is_main:
        busy = [m["busy_fraction"] for m in measured]
        record.add_strategy_facts(
            busy_fraction=busy,
            peak_activation_bytes=[m["activations"] for m in measured],
            timeline=[m["timeline"] for m in measured],
        )
        if all(b is not None for b in busy):
            record.set_bubble_fraction(1 - sum(busy) / len(busy))


def schedule_order(
    schedule: PipelineScheduleSingle | PipelineScheduleMulti, mesh: PipelineMesh, options: PipelineOptions
) -> list[Action]:
    """This rank's work in a step, in order, as (kind, stage, micro-batch): "F" forward, "B" full backward, "I" and
    "W" a backward split into its input- and weight-gradient passes. The multi-stage schedules hold it
    (`pipeline_order`; DualPipeV's overlapped forward-backward pairs as their parts); GPipe and 1F1B
    follow their rule (distref.cost.activations.one_stage_order)."""
    if isinstance(schedule, PipelineScheduleSingle):
        stage = mesh.my_stages[0]
        return one_stage_order(options.schedule, options.microbatches, mesh.n_stages, stage)
    order = []
    for action in schedule.pipeline_order[mesh.pp_rank]:
        for part in (action.sub_actions or (action,)) if action is not None else ():
            order.append((part.computation_type.value, part.stage_index, part.microbatch_index))
    return order


def pipeline_cost(
    model: BlockModel,
    cfg: RunConfig,
    info: DatasetInfo,
    mesh: PipelineMesh,
    schedule: PipelineScheduleSingle | PipelineScheduleMulti,
    examples: list,
    bounds: list[tuple[int, int]],
    micro_batch: int,
) -> Predicted:
    """What this rank costs by formula (distref.cost): each boundary of its stages with a stage on another
    rank crossed twice per micro-batch (the activation forward, its gradient back: `examples`' outputs'
    bytes), and with --dp its parameters' gradients all-reduced and buffers broadcast over the pipelines;
    the model states of its stages (gradients and optimizer state of the parameters that receive a
    gradient); the activations its stages hold at once in the schedule's order."""
    parameter_bytes = [p.numel() * p.element_size() for p in model.parameters()]
    usage = model_usage(cfg.model, info, cfg.gpt_layers)  # which parameters train: a forward on meta
    trained = usage.trained_flags(model.named_parameters())
    communication = model_states = None
    if not usage.unknown:
        communication = pipeline_communication(
            [out.numel() * out.element_size() for _, out in examples[:-1]],
            mesh.my_stages,
            mesh.owner,
            cfg.strategy.microbatches,
            parameter_bytes=[size for size, t in zip(parameter_bytes, trained, strict=True) if t],
            buffer_bytes=[b.numel() * b.element_size() for b in model.buffers()],
            dp=cfg.strategy.dp,
        )
        model_states = replicated(parameter_bytes, cfg.optimizer, torch.get_default_dtype().itemsize, trained)
    # The activations held at once: each stage's per micro-batch, forwards adding and backwards freeing
    # them in the schedule's order of work on this rank
    order = schedule_order(schedule, mesh, cfg.strategy)
    activations = pipeline_rank(
        cfg.model,
        info,
        cfg.gpt_layers,
        bounds,
        order,
        micro_batch,
        cfg.precision,
        cfg.activation_checkpointing,
    )
    return Predicted(
        communication=communication,
        model_states=model_states,
        activations=activations,
        unavailable={
            "communication": usage.unknown,
            "model_states": usage.unknown,
            "activations": no_formula(cfg.model, cfg.precision)
            or (f"no order of work known for --schedule {cfg.strategy.schedule}" if order is None else None),
        },
    )


# --- end PIPELINE strategy ---


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_options(argv)
    # --- PIPELINE: one process per stage rank, launched here from plain python (as ddp does)
    if not under_torchrun():
        launch_ranks(__file__, argv, cfg, IMPL)  # starts the ranks and exits
    configure_cpu_threads()
    # --- PIPELINE: the process group, then the mesh of pipelines × stage ranks
    rank, world_size, device, backend = start_process_group(cfg)
    options = cfg.strategy
    n_micro, dp = options.microbatches, options.dp
    mesh = pipeline_mesh(device, options, world_size)
    is_main = rank == 0  # rank 0 writes the record, the checkpoint index and the final state_dict
    # --- end PIPELINE ---

    # ---- Data and model: the same in every impl -------------------------------------------------
    with exit_on_bad_input(IMPL):  # a dataset that fails its md5: one line, exit 2
        train_set, test_set, info = load_dataset(cfg)
    seed_everything(cfg.seed)  # before building: every impl starts from the same parameters
    model = build_model(cfg.model, info, cfg.gpt_layers, param_dtype(cfg))
    # --- PIPELINE: every rank read the data and built the model itself: they must agree (one all-gather)
    with exit_on_bad_input(IMPL, say=is_main):
        check_ranks_agree(cfg, train_set, test_set, model)
    # --- PIPELINE: every rank builds the whole model (same seed, same parameters as single), then keeps
    # only its stages' blocks as `model` (optimizer, state_dict; the schedule runs the stages, not `model`).
    # The cuts: --partition, else those balancing the parameters of the blocks of the model built.
    cuts = choose_cut_points(block_sizes(model), options.partition, mesh.n_stages)[0]
    core_keys = list(model.state_dict())  # the final state_dict keeps the core model's keys, in order
    core_blocks = len(list(model.children()))  # (its blocks, for the activations' formula)
    micro_batch = train_set.x[: cfg.global_batch_size // (dp * n_micro)]
    stage_modules, examples, layout = cut_into_stages(model, cuts, cfg, mesh, micro_batch, device, is_main)
    model = BlockModel(OrderedDict((n, b) for m in stage_modules.values() for n, b in m.named_children()))
    loss = GlobalBatchMean()  # the schedule's loss_fn; its divisor set at each step
    stages, schedule = build_schedule(stage_modules, examples, mesh, options, device, loss)
    saved_activations = SavedActivations(model.parameters())
    optimizer = make_optimizer(cfg, model.parameters())  # --- PIPELINE: this rank's parameters
    # --- end PIPELINE ---
    scaler = make_grad_scaler(cfg, device)
    n_steps = total_steps(cfg, len(train_set))
    cadence = Cadence(cfg, n_steps, steps_per_epoch(len(train_set), cfg.global_batch_size))
    record = RunRecord(
        IMPL, VERSION, cfg, world_size=world_size, device=device, backend=backend, write_files=is_main
    )  # --- PIPELINE: every rank keeps the numbers, rank 0 writes them
    record.add_strategy_facts(
        schedule=options.schedule,
        microbatches=n_micro,
        dp=dp,
        stages=mesh.n_stages,
        cut_points=cuts,
        stages_by_rank=layout,
    )

    # ---- Resume: model, optimizer, scaler, RNG, record; the data order and lr follow the step ---
    start_step = 0
    if (path := resume_path(cfg)) is not None:
        # --- PIPELINE: the index names a complete checkpoint; each rank reads its own stages' file
        state, mine = load_stage_checkpoint(path, cfg, n_steps, layout, mesh.pp_rank, is_main)
        model.load_state_dict(mine["model"])  # --- PIPELINE: this rank's stages
        optimizer.load_state_dict(mine["optimizer"])
        scaler.load_state_dict(state["scaler"])
        start_step = resume_step(state, path, record, IMPL, say=is_main)  # --- PIPELINE: said once

    # The lr is a function of the step: built after a resume, it continues where the run left off.
    scheduler = make_lr_schedule(cfg, optimizer, n_steps, start_step)
    # --- PIPELINE: each pipeline reads its 1/dp share of every global batch, whole (the schedule cuts
    # it into micro-batches); all stages of a pipeline read the same (the first uses x, the last y).
    batches = iter(train_loader(train_set, cfg, start_step, n_steps, rank=mesh.dp_rank, world_size=dp))
    log = StepLog(record, cfg, IMPL, cadence, start_step, show=is_main, desc=f"{IMPL} {options.schedule}")
    state_bytes = None  # model-state bytes, measured once gradients and optimizer state both exist
    in_schedule = IntervalTimer(device)  # --- PIPELINE: time in the schedule, from the second step on

    record.start_training()  # start-up (imports, data, model, set-up) ends: the run's clock starts
    with log, profiler(cfg, rank=rank) as prof:  # --- PIPELINE: one trace per rank
        for step in range(start_step, n_steps):
            started = log.step_starts(step)
            # This step's random numbers (dropout): a function of (seed, step), so a resumed run draws
            # what an uninterrupted one does. (Each impl says which stream each of its ranks draws.)
            seed_step(cfg.seed, step, stream=rank, devices=[device])  # --- PIPELINE: each rank its own stream
            # The step's loss is the mean over every scored target of the whole global batch: each
            # micro-batch adds its loss *sum* over this count. (The mean of the micro-batches' own means
            # would weigh a micro-batch scoring 3 targets as much as one scoring 60: padding, prompts.)
            loss.scored = scored_targets(train_set, cfg, step)  # --- PIPELINE: of every pipeline's batch
            # --- PIPELINE: the schedule runs every micro-batch's forward and backward on this rank's
            # stages, sending activations and their gradients to the neighbouring stages.
            x, y = next(batches)
            if step == start_step + 1:  # the bubble and activations: measured from the second step
                # (the bubble's timers leave out the step distref.training.traffic counts: slower)
                for timer in (in_schedule, *(stage.busy for stage in stages)):
                    timer.reset()
                saved_activations.peak = 0
            micro_losses = run_schedule(
                schedule, x, y, mesh, cfg, device, in_schedule, saved_activations, stages[0].timeline, step
            )
            if dp > 1:
                all_reduce_gradients(model.parameters(), mesh.dp_group)
                broadcast_buffers(model, mesh.dp_group)
            step_loss = torch.zeros((), device=device)
            for micro_loss in micro_losses:  # --- PIPELINE: summed as single --grad-accum M sums
                step_loss += micro_loss.detach()
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
            log.step_done(step_loss, started)
            prof.step()

            due = cadence.after(step)
            if due.log:
                # --- PIPELINE: only the last stage's ranks hold losses (zeros elsewhere), each pipeline's
                # part of the global batch's mean: their sum over every rank is that mean
                log.flush(due.done, reduce=all_reduce_sum)
            if due.eval:
                started = log.eval_starts()
                # --- PIPELINE: each pipeline scores its share of the test set through its stages;
                # the totals are summed over every rank (only the last stages' are non-zero)
                shard = eval_batches(test_set, rank=mesh.dp_rank, world_size=dp)
                totals = evaluate_stages(stage_modules, mesh.owner, shard, cfg, device, mesh.pp_group)
                dist.all_reduce(totals)
                log.evaluated(due.done, totals, started)
            if due.checkpoint:  # --- PIPELINE: stage files, then the index that makes them a checkpoint
                save_stage_checkpoint(cfg, due.done, n_steps, record, mesh, layout, model, optimizer, scaler)

    if cfg.save_final:  # --- PIPELINE: every rank's stages into the core model's full state_dict
        save_final_state(cfg.save_final, model, core_keys, world_size, is_main)
    # --- PIPELINE: each rank's activations held for backward, busy share of its time in the schedule
    # (the bubble is the idle share) and timeline of one step, then its memory and model state
    record_the_bubble(record, stages, in_schedule, saved_activations, world_size, is_main)
    # --- PIPELINE: every rank's memory and model states (its stages'), beside the formulas', and what its
    # counted step communicated and held for backward beside the formulas' (pipeline_cost), to rank 0
    bounds = part_bounds(cuts, core_blocks)
    predicted = pipeline_cost(model, cfg, info, mesh, schedule, examples, bounds, len(micro_batch))
    held = saved_activations.peak  # (the stages' own saved-tensor hooks hide the step's from traffic's)
    finish_record(record, cfg.global_batch_size, state_bytes, world_size, predicted, held)
    if is_main:
        print_summary(record.data)
    return record.data


# ---- The command line: the core options (distref.cli) and the pipeline's own ----------------------
# --- PIPELINE: its options, parsed once into PipelineOptions (cfg.strategy) ---
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
    options = cfg.strategy
    schedule, m, dp, v = options.schedule, options.microbatches, options.dp, stages_per_rank(options)
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
    # (a model of yours: checked to be a sequence of blocks, and cut so that every stage has parameters)
    return cut_problem(cfg, options.partition, p * v) or microbatch_problem(schedule, m, p, p * v)


def parse_options(argv: list[str] | None, world_size: int | None = None) -> RunConfig:
    """The command line, checked (one line and exit 2 on bad input, before any rank exists). Every stage
    rank sees its pipeline's whole batch: check_options splits it over --dp and micro-batches."""
    return parse_config(
        argv,
        IMPL,
        add_options,
        world_size,
        check_options,
        description=__doc__,
        distributed=True,
        splits_batch=False,
        strategy_options=PipelineOptions,
        cuts_model=True,  # (a model of yours must be a sequence of blocks: check_options)
    )


# --- end PIPELINE options ---


if __name__ == "__main__":
    with destroy_process_group_on_exit(IMPL):  # --- PIPELINE: clean teardown on every exit path
        main()
    exit_without_interpreter_teardown()  # --- PIPELINE: gloo threads vs Python's shutdown
