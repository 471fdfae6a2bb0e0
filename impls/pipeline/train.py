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
its own share of the batch, and sums each stage's gradients across them.

    python impls/pipeline/train.py --nproc-per-node 2 --epochs 2 --out runs/pp       # 2 stages, 1F1B, M=4
    python impls/pipeline/train.py --nproc-per-node 4 --dp 2 --schedule gpipe        # 2 pipelines × 2 stages
    torchrun --standalone --nproc-per-node 2 impls/pipeline/train.py --model gpt --dataset synthetic \\
        --gpt-layers 4 --schedule interleaved-1f1b --microbatches 8

Changes against impls/single/train.py are marked `# --- PIPELINE: ... ---`.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.distributed as dist  # --- PIPELINE ---
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from distref import impl_version
from distref.cli import add_options_for, exit_on_bad_input, option, parse_config
from distref.config import RunConfig, positive_int, under_torchrun
from distref.cost.activations import pipeline_rank_activations
from distref.cost.pipeline import pipeline_rank_cost
from distref.cost.usage import model_usage, parameters_of
from distref.data import eval_batches, load_dataset, scored_targets, steps_per_epoch, train_loader
from distref.distributed import (
    all_reduce_sum,
    check_ranks_agree,
    destroy_process_group_on_exit,
    exit_without_interpreter_teardown,
    finish_record,
    launch_ranks,
    save_whole_state,
    start_process_group,
)
from distref.distributed.partition import block_sizes, choose_cut_points, part_bounds
from distref.distributed.stages import (
    ONE_STAGE_PER_RANK,
    V_SHAPED,
    StageMeter,
    default_stages_per_rank,
    evaluate_stages,
    microbatch_problem,
    stage_examples,
    stages_per_rank_problem,
    work_order,
)
from distref.models import BlockModel, build_model
from distref.record import RunRecord, print_summary
from distref.training.bookkeeping import Cadence, StepLog
from distref.training.checkpoint import (
    checkpoint_path,
    checkpoint_state,
    load_checkpoint,
    load_sharded_checkpoint,
    resume_path,
    resume_step,
    save_sharded_checkpoint,
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
from distref.training.steps import loss_sum
from distref.your_model import cut_problem

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
SPLIT_BACKWARD = ("interleaved-zero-bubble", "zbv", "dualpipev")  # input- and weight-gradient passes apart


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """The pipeline's own options (cfg.strategy), each declared with its command-line option."""

    schedule: str = option("the pipeline schedule", choices=list(SCHEDULES), default="1f1b")
    microbatches: int = option(
        "micro-batches per step and pipeline; must divide the pipeline's batch",
        metavar="M",
        type=positive_int,
        default=4,
    )
    stages_per_rank: int | None = option(
        "stages each rank holds (default: 1 for gpipe/1f1b, 2 for the others)", metavar="V", type=positive_int
    )
    dp: int = option(
        "pipelines side by side (data parallel): ranks = N × ranks per pipeline",
        metavar="N",
        type=positive_int,
        default=1,
    )
    partition: str | None = option(
        "block indices where the model is cut into its p×V stages, e.g. 2 or 1,2,3; default: the cut "
        "balancing parameter counts",
        metavar="CUTS",
    )


def stage_indices(schedule: str, pp_rank: int, p: int, v: int) -> list[int]:
    """The stages rank `pp_rank` of a pipeline holds: round-robin (r, r+p, ...) or V-shaped."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * p - 1 - pp_rank]
    return [pp_rank + k * p for k in range(v)]


@dataclasses.dataclass(frozen=True)
class PipelineMesh:
    """Where this rank sits in the 2-D mesh of (pipelines, stage ranks)."""

    dp: int  # pipelines side by side
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


def pipeline_mesh(device: torch.device, world_size: int, *, dp: int, schedule: str, v: int) -> PipelineMesh:
    """A 2-D mesh of (`dp` pipelines, stage ranks), `v` stages per rank placed as `schedule` places them:
    rank r's pipeline rank is r % p, its replica index r // p."""
    p = world_size // dp
    mesh = init_device_mesh(device.type, (dp, p), mesh_dim_names=("dp", "pp"))
    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    owner = [0] * (p * v)
    for r in range(p):
        for s in stage_indices(schedule, r, p, v):
            owner[s] = dist.get_global_rank(pp_group, r)
    my_stages = stage_indices(schedule, pp_rank, p, v)
    return PipelineMesh(dp, p, v, pp_group, dp_group, pp_rank, dp_rank, owner, my_stages)


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """This rank's share of the pipeline (`apply_pipeline`): its blocks as one `model` (parameter names
    the whole model's: optimizer, state_dict) and as stages by stage index, the schedule that runs them
    with its loss, each stage's example input and output (the shapes and dtypes a micro-batch sends
    between stages) and the layout (the blocks each pipeline rank holds)."""

    model: BlockModel
    stage_modules: dict[int, BlockModel]
    schedule: PipelineScheduleSingle | PipelineScheduleMulti
    loss: GlobalBatchMean
    examples: list[tuple[torch.Tensor, torch.Tensor]]
    layout: list[list[str]]
    n_stages: int
    device: torch.device

    def step(self, x: torch.Tensor, y: torch.Tensor, scored: int) -> list[torch.Tensor]:
        """One step of the schedule: every micro-batch's forward and backward on this rank's stages, the
        activations and their gradients sent to the neighbouring stages, each micro-batch's loss sum
        divided by the global batch's `scored` targets. The first stage takes the batch's inputs `x`, the
        last its targets `y` and returns each micro-batch's loss (none elsewhere)."""
        self.loss.scored = scored
        losses: list[torch.Tensor] = []
        first, last = 0 in self.stage_modules, self.n_stages - 1 in self.stage_modules
        inputs = (x.to(self.device),) if first else ()
        self.schedule.step(*inputs, **({"target": y.to(self.device), "losses": losses} if last else {}))
        return losses


def apply_pipeline(
    model: BlockModel,
    mesh: PipelineMesh,
    *,
    cuts: list[int],
    schedule: str,
    microbatches: int,
    example: torch.Tensor,
    device: torch.device,
    precision: str = "fp32",
    activation_checkpointing: bool = False,
    wrap_stage: Callable[[PipelineStage], PipelineStage] = lambda stage: stage,
    say: bool = False,
    cuts_given: bool = False,
) -> Pipeline:
    """Cut the whole `model` at `cuts` into p×V stages and keep this rank's, on `device`, each a
    BlockModel of whole blocks (parameter names stay the model's); wrap each in a PipelineStage
    (`wrap_stage`: a measurement's) and build `schedule` over `microbatches` micro-batches of the size of
    `example` (one micro-batch: it gives every stage its shapes), its loss GlobalBatchMean. `say`:
    print the layout (`cuts_given`: by --partition)."""
    blocks = list(model.named_children())
    bounds = part_bounds(cuts, len(blocks))
    if say:
        shown = " | ".join(",".join(name for name, _ in blocks[a:b]) for a, b in bounds)
        how = "as given" if cuts_given else "balancing parameter counts"
        print(
            f"{IMPL}: {schedule}, {microbatches} micro-batches, {mesh.dp} pipeline(s) × {mesh.p} ranks × "
            f"{mesh.v} stage(s); cut at {cuts} ({how}): {shown}"
        )
    examples = stage_examples(model, bounds, example, device, precision)
    stage_modules = {
        s: BlockModel(OrderedDict(blocks[slice(*bounds[s])])).to(device) for s in sorted(mesh.my_stages)
    }
    for module in stage_modules.values():
        module.activation_checkpointing = activation_checkpointing
    stages = [  # in the schedule's order for this rank
        wrap_stage(
            PipelineStage(stage_modules[s], s, mesh.n_stages, device, *examples[s], group=mesh.pp_group)
        )
        for s in mesh.my_stages
    ]
    # The schedule sums the micro-batches' gradients. scale_grads=False: it would then divide them by M,
    # which the loss's divisor (the global batch's scored targets, GlobalBatchMean) has already done.
    loss = GlobalBatchMean()
    built = SCHEDULES[schedule](
        stages[0] if schedule in ONE_STAGE_PER_RANK else stages,
        n_microbatches=microbatches,
        loss_fn=loss,
        scale_grads=False,
    )
    # What each pipeline rank holds (the record's layout)
    by_rank = [sorted(stage_indices(schedule, r, mesh.p, mesh.v)) for r in range(mesh.p)]
    layout = [[name for s in held for name, _ in blocks[slice(*bounds[s])]] for held in by_rank]
    held = BlockModel(OrderedDict((n, b) for m in stage_modules.values() for n, b in m.named_children()))
    return Pipeline(held, stage_modules, built, loss, examples, layout, mesh.n_stages, device)


class GlobalBatchMean:
    """The schedule's loss_fn: a micro-batch's loss *sum* over the scored targets of the whole global batch
    (`scored`, set before each step), so that the micro-batches' and the pipelines' gradients add up to the
    global batch's mean, as single's step computes it (not the mean of the micro-batches' means)."""

    def __init__(self) -> None:
        self.scored = 1

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_sum(logits, targets) / self.scored


def sync_pipelines(model: torch.nn.Module, dp_group: dist.ProcessGroup) -> None:
    """After the schedule, the `dp_group` pipelines (same stages, other data) made one: each gradient
    summed over them (each pipeline's loss is its part of the global batch's mean), BatchNorm's statistics
    the first pipeline's (as DDP takes rank 0's). (DDP-wrapped stages would sum overlapped, but in torch
    2.13 they fail with every schedule but 1F1B: "rebuilt parameter indices size is not same as original
    model parameters size", DDP's reducer seeing a stage's backward run once per micro-batch.)"""
    for parameter in model.parameters():
        if parameter.grad is not None:  # (frozen, or not reached by the loss: no gradient on any pipeline)
            dist.all_reduce(parameter.grad, group=dp_group)
    source = dist.get_global_rank(dp_group, 0)
    for buffer in model.buffers():
        dist.broadcast(buffer, src=source, group=dp_group)


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
    mesh = pipeline_mesh(device, world_size, dp=dp, schedule=options.schedule, v=options.stages_per_rank)
    is_main = rank == 0  # rank 0 writes the record, the checkpoint index and the final state_dict
    # --- end PIPELINE ---

    # ---- Data and model: the same in every impl -------------------------------------------------
    with exit_on_bad_input(IMPL):  # a dataset that fails its md5: one line, exit 2
        train_set, test_set, info = load_dataset(cfg)
    seed_everything(cfg.seed)  # before building: every impl starts from the same parameters
    model = build_model(cfg.model, info, cfg.gpt_layers, param_dtype(cfg), cfg.moe)
    # --- PIPELINE: every rank read the data and built the model itself: they must agree (one all-gather)
    with exit_on_bad_input(IMPL, say=is_main):
        check_ranks_agree(cfg, train_set, test_set, model)
    # --- PIPELINE: every rank builds the whole model (same seed, same parameters as single), then keeps
    # only its stages' blocks as `model` (optimizer, state_dict; the schedule runs the stages, not `model`).
    # The cuts: --partition, else those balancing the parameters of the blocks of the model built.
    cuts = choose_cut_points(block_sizes(model), options.partition, mesh.n_stages)[0]
    core_keys = list(model.state_dict())  # the final state_dict keeps the core model's keys, in order
    bounds = part_bounds(cuts, len(list(model.children())))  # each stage's blocks (the cost's formulas)
    micro_batch = train_set.x[: cfg.global_batch_size // (dp * n_micro)]
    meter = StageMeter(device, activations=not cfg.compile)  # busy time (the bubble), activations, timeline
    pipeline = apply_pipeline(
        model,
        mesh,
        cuts=cuts,
        schedule=options.schedule,
        microbatches=n_micro,
        example=micro_batch,
        device=device,
        precision=cfg.precision,
        activation_checkpointing=cfg.activation_checkpointing,
        wrap_stage=meter.wrap,
        say=is_main,
        cuts_given=options.partition is not None,
    )
    model = pipeline.model  # this rank's blocks
    if cfg.compile:  # --- PIPELINE: the blocks of this rank's stages, each compiled
        if options.schedule in SPLIT_BACKWARD:  # backward twice over each graph (input, then weight
            # gradients: retain_graph), where inductor's backward frees its saved buffers after one run
            torch._functorch.config.donated_buffer = False
        compile_blocks(model)
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
        stages_by_rank=pipeline.layout,
    )

    # ---- Resume: model, optimizer, scaler, RNG, record; the data order and lr follow the step ---
    start_step = 0
    if (path := resume_path(cfg)) is not None:
        # --- PIPELINE: the index (step-N.pt) names a complete checkpoint, the folder step-N/ beside it
        # (torch.distributed.checkpoint), keyed by parameter name: each rank reads its stages' parameters
        # and optimizer state, whichever rank held them before (a changed cut or --dp loads too).
        with exit_on_bad_input(IMPL, say=is_main):  # every rank finds it; rank 0 says it, once
            state = load_checkpoint(
                path, cfg, n_steps, holds=("folder", "sha256", "scaler", "stages_by_rank")
            )
            load_sharded_checkpoint(model, optimizer, path, state, by_parameter_name=True)
        # --- end PIPELINE ---
        scaler.load_state_dict(state["scaler"])
        start_step = resume_step(state, path, record, IMPL, say=is_main)  # --- PIPELINE: said once

    # The lr is a function of the step: built after a resume, it continues where the run left off.
    scheduler = make_lr_schedule(cfg, optimizer, n_steps, start_step)
    # --- PIPELINE: each pipeline reads its 1/dp share of every global batch, whole (the schedule cuts
    # it into micro-batches); all stages of a pipeline read the same (the first uses x, the last y).
    batches = train_loader(train_set, cfg, start_step, n_steps, mesh.dp_rank, dp, device=device)
    log = StepLog(
        record, cfg, IMPL, cadence, start_step, show=is_main, desc=f"{IMPL} {options.schedule}", device=device
    )
    state_bytes = None  # model-state bytes, measured once gradients and optimizer state both exist

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
            scored = scored_targets(train_set, cfg, step)  # --- PIPELINE: of every pipeline's batch
            # --- PIPELINE: the schedule runs every micro-batch's forward and backward on this rank's
            # stages, sending activations and their gradients to the neighbouring stages.
            x, y = next(batches)
            with meter.step(step), autocast(cfg, device):
                micro_losses = pipeline.step(x, y, scored)  # (on the last stage's rank; none elsewhere)
            if dp > 1:  # the pipelines' gradients summed, the first one's BatchNorm statistics
                sync_pipelines(model, mesh.dp_group)
            step_loss = torch.zeros((), device=device)  # --- PIPELINE: zero on ranks without the last stage
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
            log.step_done(step_loss, started)  # (no wait for the GPU: the step is timed by events)
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
                totals = evaluate_stages(
                    pipeline.stage_modules, mesh.owner, shard, device, cfg.precision, mesh.pp_group
                )
                dist.all_reduce(totals)
                log.evaluated(due.done, totals, started)
            if due.checkpoint:  # --- PIPELINE: each rank its stages' part (DCP), rank 0 the index
                index = checkpoint_path(cfg.checkpoint_dir, due.done)
                state = checkpoint_state(
                    cfg, due.done, n_steps, record, stages_by_rank=pipeline.layout, scaler=scaler.state_dict()
                )
                save_sharded_checkpoint(model, optimizer, index, state, is_main, by_parameter_name=True)

    if cfg.save_final:  # --- PIPELINE: every rank's stages into the core model's full state_dict
        save_whole_state(cfg.save_final, unwrap_state_dict(model), world_size, core_keys)
    # --- PIPELINE: each rank's busy share of its time in the schedule (the bubble is the idle share),
    # activations held for backward and timeline of one step, to rank 0's record
    record.add_schedule_measurements(meter.gathered(world_size))
    # --- PIPELINE: what this rank's counted step communicated, its model states (its stages') and the
    # activations it held, beside the formulas' (distref.cost), to rank 0
    usage = model_usage(cfg.model, info, cfg.gpt_layers, cfg.moe)  # which parameters train: a forward on meta
    order = work_order(
        pipeline.schedule, mesh.pp_rank, options.schedule, n_micro, mesh.n_stages, mesh.my_stages[0]
    )
    predicted = pipeline_rank_cost(  # --- PIPELINE: each boundary's bytes (the stage examples' outputs)
        [output.numel() * output.element_size() for _, output in pipeline.examples[:-1]],
        mesh.my_stages,
        mesh.owner,
        n_micro,
        parameters=parameters_of(model.named_parameters(), usage),
        buffer_bytes=[b.numel() * b.element_size() for b in model.buffers()],
        dp=dp,
        optimizer=cfg.optimizer,
        step_bytes=torch.get_default_dtype().itemsize,
        unknown=usage.unknown,
        # --- PIPELINE: the activations its stages hold at once in the schedule's order of work
        activations=pipeline_rank_activations(
            cfg, info, bounds, order, len(micro_batch), options.schedule, device.type
        ),
    )
    # --- PIPELINE: the stages' own saved-tensor hooks hide the step's activations from traffic's meter
    finish_record(
        record, cfg.global_batch_size, state_bytes, world_size, predicted, meter.peak_activation_bytes
    )
    if is_main:
        print_summary(record.data)
    return record.data


# ---- The command line: the core options (distref.cli) and the pipeline's own ----------------------
# --- PIPELINE: its options, parsed once into PipelineOptions (cfg.strategy) ---
add_options = add_options_for(PipelineOptions)  # PipelineOptions' fields, each its --option


def check_options(cfg: RunConfig, world_size: int) -> str | None:
    options = cfg.strategy
    schedule, m, dp = options.schedule, options.microbatches, options.dp
    v = options.stages_per_rank or default_stages_per_rank(schedule)
    if world_size % dp:
        return f"--dp {dp} must divide the {world_size} ranks (ranks = pipelines × stage ranks)"
    p = world_size // dp
    if p < 2:
        return f"{world_size} ranks with --dp {dp} leave {p} rank per pipeline: a pipeline needs 2 or more"
    if problem := stages_per_rank_problem(schedule, v):
        return problem
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


def resolved(cfg: RunConfig) -> RunConfig:
    """--stages-per-rank not given: the schedule's default (1 for gpipe and 1f1b, 2 for the others)."""
    v = cfg.strategy.stages_per_rank or default_stages_per_rank(cfg.strategy.schedule)
    return dataclasses.replace(cfg, strategy=dataclasses.replace(cfg.strategy, stages_per_rank=v))


def parse_options(argv: list[str] | None, world_size: int | None = None) -> RunConfig:
    """The command line, checked (one line and exit 2 on bad input, before any rank exists). Every stage
    rank sees its pipeline's whole batch: check_options splits it over --dp and micro-batches."""
    return resolved(
        parse_config(
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
    )


# --- end PIPELINE options ---


if __name__ == "__main__":
    with destroy_process_group_on_exit(IMPL):  # --- PIPELINE: clean teardown on every exit path
        main()
    exit_without_interpreter_teardown()  # --- PIPELINE: gloo threads vs Python's shutdown
