"""Model parallelism: consecutive blocks of one model on different processes, or on different devices.

The model's block list is cut into consecutive parts (`--partition 2`: blocks [0, 2) and [2, n); without
it, the cut that balances parameter counts). Forward runs part 0 on the micro-batch and hands its output
activation to part 1, and so on; the loss is computed after the last part. Backward runs the other way:
each part receives the gradient of its output, back-propagates through its own blocks and hands the
gradient of its input upstream. Each part's optimizer steps its own parameters. One micro-batch is in
flight at a time, so one part works while the others wait (the naive schedule, which impls/pipeline
fills with micro-batches).

Two forms, one loop:
- one process per part (rank r holds only part r): activations and their gradients travel with
  torch.distributed point-to-point send/recv, gloo on CPU, NCCL on GPU;
- one process, one part per device (`--devices cuda:0,cuda:1`): activations move with `.to()`, and
  autograd carries their gradients back across devices by itself.

    python impls/model_parallel/train.py --nproc-per-node 2 --epochs 2 --out runs/mp   # 2 ranks (CPU: gloo)
    python impls/model_parallel/train.py --devices cuda:0,cuda:1 --epochs 2            # 1 process, 2 GPUs
    torchrun --standalone --nproc-per-node 4 impls/model_parallel/train.py --model gpt --dataset synthetic

Changes against impls/single/train.py are marked `# --- MODEL PARALLEL: ... ---`.
"""

import dataclasses
from collections import OrderedDict

import torch
import torch.distributed as dist  # --- MODEL PARALLEL ---

from distref import impl_version
from distref.cli import add_options_for, exit_on_bad_input, option, parse_config
from distref.config import RunConfig, under_torchrun
from distref.cost.activations import no_formula, part_bytes
from distref.cost.pipeline import boundary_bytes, model_parallel_rank_cost
from distref.cost.usage import model_usage, parameters_of
from distref.data import (
    eval_batches,
    load_dataset,
    scored_targets,
    steps_per_epoch,
    train_loader,
)
from distref.distributed import (
    check_ranks_agree,
    destroy_process_group_on_exit,
    exit_without_interpreter_teardown,
    finish_record,
    gather_to_rank0,
    launch_ranks,
    recv_tensor,
    save_whole_state,
    send_tensor,
    start_process_group,
)
from distref.distributed.handoffs import HandoffMeter
from distref.distributed.partition import block_sizes, choose_cut_points, part_bounds
from distref.models import BlockModel, build_model
from distref.record import RunRecord, print_summary
from distref.training.bookkeeping import Cadence, StepLog
from distref.training.checkpoint import (
    CheckpointError,
    load_checkpoint,
    resume_path,
    resume_step,
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
    synchronize,
)
from distref.training.measure import model_state_bytes
from distref.training.monitor import profiler
from distref.training.optim import make_grad_scaler, make_lr_schedule, make_optimizer, total_steps
from distref.training.steps import loss_sum, score
from distref.your_model import cut_problem

IMPL = "model_parallel"
VERSION = impl_version(__file__)


# --- MODEL PARALLEL: the strategy ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelParallelOptions:
    """Model parallelism's own options (cfg.strategy), each declared with its command-line option."""

    partition: str | None = option(
        "block indices where the model is cut, e.g. 2 (two parts) or 1,2,3 (four); "
        "default: the cut balancing parameter counts",
        metavar="CUTS",
    )
    devices: str | None = option(
        "one process, one part per device: cuda:0,cuda:1 (cpu,cpu shows the mechanism on CPU); "
        "default: one process per part",
        metavar="LIST",
    )


def device_list(text: str) -> tuple[list[torch.device] | None, str | None]:
    """--devices parsed and checked: (devices, None) or (None, a one-line reason)."""
    try:
        devices = [torch.device(name) for name in text.split(",")]
    except RuntimeError:
        return None, f"--devices {text}: unknown device (use e.g. cuda:0,cuda:1 or cpu,cpu)"
    if len(devices) < 2:
        return None, f"--devices {text}: give 2 or more devices, one per part"
    if any(d.type not in ("cpu", "cuda") for d in devices):
        return None, f"--devices {text}: only cpu and cuda devices are supported"
    if any(d.type == "cpu" and d.index not in (None, 0) for d in devices):
        # torch.device("cpu:1") is accepted, and is the same CPU as "cpu": parts would not be apart.
        return None, f"--devices {text}: there is one CPU device in torch; use cpu,cpu to try the form on CPU"
    needed = max([(d.index or 0) + 1 for d in devices if d.type == "cuda"], default=0)
    if needed > torch.cuda.device_count():
        return None, f"--devices {text}: needs {needed} CUDA devices, {torch.cuda.device_count()} visible"
    return [torch.device("cuda", d.index or 0) if d.type == "cuda" else d for d in devices], None


@dataclasses.dataclass
class Links:
    """The ranks holding the parts before and after this process's (None: it holds the first / last
    part; both None in the one-process form); `meter` measures the hand-offs (bytes sent, time waiting)."""

    before: int | None = None
    after: int | None = None
    meter: HandoffMeter = dataclasses.field(default_factory=HandoffMeter)


def start_parts(cfg: RunConfig) -> tuple[int, int, list[torch.device], str, Links]:
    """(rank, world_size, this process's devices, backend, links): one process per part in a process group,
    `links` naming its neighbours; or, with --devices, this one process holding every part, one per device."""
    if cfg.strategy.devices is not None:
        devices = device_list(cfg.strategy.devices)[0]
        if all(d.type == "cpu" for d in devices):
            print(
                f"{IMPL}: --devices {cfg.strategy.devices}: every part on the one CPU shows the mechanism, gains nothing"
            )
        return 0, 1, devices, "none", Links()
    rank, world_size, device, backend = start_process_group(cfg)  # a send/recv waits at most --timeout
    before, after = rank - 1 if rank > 0 else None, rank + 1 if rank < world_size - 1 else None
    return rank, world_size, [device], backend, Links(before, after, HandoffMeter(device))


def apply_model_parallel(
    model: BlockModel,
    cuts: list[int],
    devices: list[torch.device],
    *,
    parts_held: list[int],
    activation_checkpointing: bool = False,
    say: str | None = None,
) -> tuple[BlockModel, list[tuple[BlockModel, torch.device]], list[list[str]]]:
    """The model cut at `cuts` into parts [first, end) of its blocks: this process's (`parts_held`), each on
    its device (the blocks themselves: parameter names stay the core model's); all its blocks as one model
    (optimizer, state_dict, model-state bytes); every part's block names (the record). `say`: how the cut
    was made, printed."""
    bounds = part_bounds(cuts, len(list(model.children())))
    blocks = list(model.named_children())
    names = [[name for name, _ in blocks[a:b]] for a, b in bounds]
    if say:
        shown = " | ".join(",".join(part) for part in names)
        print(f"{IMPL}: {len(bounds)} parts, cut at {cuts} ({say}): {shown}")
    mine = [bounds[i] for i in parts_held]
    parts = [(BlockModel(OrderedDict(blocks[a:b])).to(d), d) for (a, b), d in zip(mine, devices, strict=True)]
    for part, _ in parts:
        part.activation_checkpointing = activation_checkpointing
    held = BlockModel(OrderedDict((n, b) for part, _ in parts for n, b in part.named_children()))
    return held, parts, names


def send_activation(tensor: torch.Tensor, links: Links) -> None:
    """To the next part, its shape and dtype first (batches differ in size; autocast changes the dtype)."""
    links.meter.sent(send_tensor(tensor, links.after))


def run_parts(parts: list[tuple[BlockModel, torch.device]], x: torch.Tensor) -> torch.Tensor:
    """Forward through this process's parts, moving the activation to each part's device."""
    for part, device in parts:
        x = part(x.to(device))
    return x


def train_micro_batch(parts, x, y, links: Links, cfg: RunConfig, scaler, scored: int) -> torch.Tensor:
    """Forward and backward of one micro-batch through this process's parts; returns its part of the
    step's loss (its loss sum / `scored`, the global batch's scored targets; 0 on ranks without the last
    part). The hand-offs below are what impls/pipeline's schedules automate."""
    device = parts[-1][1]
    if links.before is None:
        inputs = x
    else:  # the previous part's output, as this part's input: backward needs its gradient
        with links.meter.waiting():
            inputs = recv_tensor(links.before, parts[0][1]).requires_grad_()
    with autocast(cfg, device):
        outputs = run_parts(parts, inputs)
    if links.after is None:  # the last part: the loss, and backward from it
        with autocast(cfg, device):
            loss = loss_sum(outputs, y.to(device)) / scored
        # As in single: the micro-batches' gradients add up to the global batch's (every part's, as
        # the last part's backward carries the loss's scale back through the others).
        scaler.scale(loss).backward()
    else:
        send_activation(outputs.detach(), links)
        with links.meter.waiting():
            output_grad = torch.empty_like(outputs)  # the same shape and dtype as what was sent
            dist.recv(output_grad, links.after)
        if outputs.requires_grad:  # (a part whose parameters are all frozen, before any trained one: none)
            torch.autograd.backward(outputs, output_grad)  # backward through this part from its output
        loss = torch.zeros((), device=device)
    if links.before is not None:  # hand the input's gradient to the previous part
        dist.send(inputs.grad, links.before)
        links.meter.sent(inputs.grad.numel() * inputs.grad.element_size())
    return loss.detach()


@torch.no_grad()
def evaluate_parts(parts, batches, links: Links, cfg: RunConfig) -> torch.Tensor:
    """[loss_sum, correct, count] over `batches`, every batch through the same chain of parts; the
    totals are correct on the rank with the last part."""
    device = parts[-1][1]
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for part, _ in parts:
        part.eval()
    for x, y in batches:
        inputs = x if links.before is None else recv_tensor(links.before, parts[0][1])
        with autocast(cfg, device):
            outputs = run_parts(parts, inputs)
        if links.after is None:
            totals += score(outputs, y.to(device))
        else:
            send_activation(outputs, links)
    for part, _ in parts:
        part.train()
    return totals


def from_last_rank(tensor: torch.Tensor, last_rank: int) -> torch.Tensor:
    """`tensor` (step losses, test scores) as the rank with the last part computed it (the others: zeros)."""
    if last_rank > 0:  # several ranks
        dist.broadcast(tensor, src=last_rank)
    return tensor


def gather_parts(model: BlockModel, optimizer: torch.optim.Optimizer, world_size: int) -> dict | None:
    """On rank 0 (None elsewhere): every part's blocks in one state_dict, and the parts' optimizer states."""
    held = {"model": unwrap_state_dict(model), "optimizer": optimizer.state_dict()}
    gathered = gather_to_rank0(held, world_size)  # [] but on rank 0
    model_state = {k: v for part in gathered for k, v in part["model"].items()}
    return {"model": model_state, "optimizer": [part["optimizer"] for part in gathered]} if gathered else None


# --- end MODEL PARALLEL strategy ---


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_options(argv)
    # --- MODEL PARALLEL: a process per part (launched here, as ddp does), or one driving a part per --devices
    one_process = cfg.strategy.devices is not None
    if not one_process and not under_torchrun():
        launch_ranks(__file__, argv, cfg, IMPL)  # starts the ranks and exits
    configure_cpu_threads()
    rank, world_size, devices, backend, links = start_parts(cfg)
    device = devices[-1]  # --- MODEL PARALLEL: the last part's, where the loss is computed
    is_main = rank == 0  # rank 0 writes the record, checkpoints and the final state_dict
    n_parts = len(devices) if one_process else world_size
    # --- end MODEL PARALLEL ---

    # ---- Data and model: the same in every impl -------------------------------------------------
    with exit_on_bad_input(IMPL):  # a dataset that fails its md5: one line, exit 2
        train_set, test_set, info = load_dataset(cfg)
    seed_everything(cfg.seed)  # before building: every impl starts from the same parameters
    model = build_model(cfg.model, info, cfg.gpt_layers, param_dtype(cfg), cfg.moe)
    if not one_process:  # --- MODEL PARALLEL: every rank read the data and built the model: they must agree
        with exit_on_bad_input(IMPL, say=is_main):
            check_ranks_agree(cfg, train_set, test_set, model)
    # --- MODEL PARALLEL: every rank builds the whole model as single does (same seed, same initial
    # parameters), cuts it between its blocks (--partition, else balancing their parameters), keeps its own
    # part(s) on its device(s), lets the rest go; first each cut's activation bytes (a fake-tensor forward).
    cuts = choose_cut_points(block_sizes(model), cfg.strategy.partition, n_parts)[0]
    micro_batch, n_blocks = cfg.global_batch_size // cfg.grad_accum, len(list(model.children()))
    bounds, example = part_bounds(cuts, n_blocks), train_set.x[:micro_batch]
    activation_bytes = boundary_bytes(list(model.children()), bounds, example, device, autocast(cfg, device))
    mine = list(range(n_parts)) if one_process else [rank]  # --devices: one process holds every part
    say = ("as given" if cfg.strategy.partition else "balancing parameter counts") if is_main else None
    model, parts, part_names = apply_model_parallel(
        model, cuts, devices, parts_held=mine, activation_checkpointing=cfg.activation_checkpointing, say=say
    )
    if cfg.compile:  # --- MODEL PARALLEL: this rank's blocks, each compiled on its part's device
        compile_blocks(model)
    optimizer = make_optimizer(cfg, model.parameters())  # --- MODEL PARALLEL: this rank's parameters
    scaler = make_grad_scaler(cfg, device)
    n_steps = total_steps(cfg, len(train_set))
    cadence = Cadence(cfg, n_steps, steps_per_epoch(len(train_set), cfg.global_batch_size))
    record = RunRecord(
        IMPL,
        VERSION,
        cfg,
        world_size=world_size,
        device=device,
        backend=backend,
        write_files=is_main,
        devices=n_parts,
        memory_devices=devices,  # --- MODEL PARALLEL: --devices: the peak of each part's device
    )  # --- MODEL PARALLEL: every rank keeps the numbers, rank 0 writes them
    record.add_strategy_facts(cut_points=cuts, parts=part_names)

    # ---- Resume: model, optimizer, scaler, RNG, record; the data order and lr follow the step ---
    start_step = 0
    if (path := resume_path(cfg)) is not None:
        with exit_on_bad_input(IMPL, say=is_main):  # another run's checkpoint: rank 0 says it, once
            state = load_checkpoint(path, cfg, n_steps, holds=("model", "optimizer", "scaler", "cut_points"))
            if state["cut_points"] != cuts:  # --- MODEL PARALLEL: parts and optimizer states must match
                raise CheckpointError(
                    f"checkpoint {path} was cut at {state['cut_points']}, this run at {cuts}"
                )
        # --- MODEL PARALLEL: one checkpoint for all ranks; each takes its blocks and its optimizer state
        model.load_state_dict(
            {k: v for k, v in state["model"].items() if k.split(".")[0] in dict(model.named_children())}
        )
        optimizer.load_state_dict(state["optimizer"][rank])
        scaler.load_state_dict(state["scaler"])
        start_step = resume_step(state, path, record, IMPL, say=is_main)  # --- MODEL PARALLEL: said once

    # The lr is a function of the step: built after a resume, it continues where the run left off.
    scheduler = make_lr_schedule(cfg, optimizer, n_steps, start_step)
    # --- MODEL PARALLEL: every rank reads the same micro-batches (the first part uses x, the last y)
    micro_batches = train_loader(
        train_set, cfg, start_step, n_steps, device=devices[0], targets_device=device
    )
    log = StepLog(record, cfg, IMPL, cadence, start_step, show=is_main, desc=f"{IMPL} ×{n_parts}")
    state_bytes = None  # model-state bytes, measured once gradients and optimizer state both exist
    last_rank = world_size - 1  # --- MODEL PARALLEL: the rank with the last part has the loss

    record.start_training()  # start-up (imports, data, model, set-up) ends: the run's clock starts
    with log, profiler(cfg, rank=rank) as prof:  # --- MODEL PARALLEL: one trace per rank
        for step in range(start_step, n_steps):
            started = log.step_starts(step)
            # This step's random numbers (dropout): a function of (seed, step), so a resumed run draws
            # what an uninterrupted one does. (Each impl says which stream each of its ranks draws.)
            seed_step(cfg.seed, step, stream=rank, devices=devices)  # --- MODEL PARALLEL: a stream per part
            # The step's loss is the mean over every scored target of the whole global batch: each
            # micro-batch adds its loss *sum* over this count. (The mean of the micro-batches' own means
            # would weigh a micro-batch scoring 3 targets as much as one scoring 60: padding, prompts.)
            scored = scored_targets(train_set, cfg, step)
            # --- MODEL PARALLEL: fp32 on every rank (0 on those without the last part), as the losses' broadcast
            step_loss = torch.zeros((), device=device)  # from the last rank needs one dtype everywhere
            for _ in range(cfg.grad_accum):
                x, y = next(micro_batches)
                # --- MODEL PARALLEL: this micro-batch through every part and back, one part
                # working at a time; micro-batches one after another (no overlap: that is pipelining).
                loss = train_micro_batch(parts, x, y, links, cfg, scaler, scored)
                step_loss += loss
            scale = scaler.get_scale()  # fp16: a host sync, as scaler.step() makes anyway; else 1.0
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() < scale:  # inf/nan gradients: the update was skipped, the scale lowered
                record.add_skipped_step(step)
            scheduler.step()
            if state_bytes is None:
                state_bytes = model_state_bytes(model.parameters(), optimizer)
            optimizer.zero_grad(set_to_none=True)
            # --- MODEL PARALLEL: every part's queue waited for, each step: its hand-off meter needs the
            # step's time now (the host's clock), and the parts take turns anyway
            for part_device in devices:
                synchronize(part_device)
            links.meter.step_done(step, log.step_done(step_loss, started))  # --- MODEL PARALLEL: its time
            prof.step()

            due = cadence.after(step)
            if due.log:  # --- MODEL PARALLEL: the losses are the last rank's
                log.flush(due.done, reduce=lambda losses: from_last_rank(losses, last_rank))
            if due.eval:
                started = log.eval_starts()
                # --- MODEL PARALLEL: every test batch through the chain; the last rank scores it
                totals = from_last_rank(evaluate_parts(parts, eval_batches(test_set), links, cfg), last_rank)
                log.evaluated(due.done, totals, started)
            if due.checkpoint:
                # --- MODEL PARALLEL: rank 0 gathers every part (core keys) and optimizer state
                states = gather_parts(model, optimizer, world_size)
                if is_main:
                    states.update(cut_points=cuts, scaler=scaler.state_dict())
                    save_step_checkpoint(cfg, due.done, n_steps, record, **states)

    if cfg.save_final:  # --- MODEL PARALLEL: rank 0 gathers every part into the full state_dict
        save_whole_state(cfg.save_final, unwrap_state_dict(model), world_size)
    # --- MODEL PARALLEL: every rank's hand-offs, memory and model states, beside the formulas', to rank 0
    record.add_strategy_facts(**links.meter.gathered(world_size))
    usage = model_usage(cfg.model, info, cfg.gpt_layers, cfg.moe)  # which parameters train: a forward on meta
    mine, checkpointed = bounds if world_size > 1 else [(0, n_blocks)], cfg.activation_checkpointing
    held = part_bytes(
        cfg.model, info, cfg.gpt_layers, mine, rank, micro_batch, 1, cfg.precision, checkpointed, device.type
    )
    predicted = model_parallel_rank_cost(
        activation_bytes,
        rank,
        world_size,
        cfg.grad_accum,
        parameters=parameters_of(model.named_parameters(), usage),
        optimizer=cfg.optimizer,
        step_bytes=torch.get_default_dtype().itemsize,
        unknown=usage.unknown,
        activations=(held, no_formula(cfg.model, cfg.precision, device.type)),
    )
    finish_record(record, cfg.global_batch_size, state_bytes, world_size, predicted)  # --- MODEL PARALLEL
    if is_main:
        print_summary(record.data)
    return record.data


# ---- The command line: the core options (distref.cli) and model parallelism's own ---------------
# --- MODEL PARALLEL: its options, parsed once into ModelParallelOptions (cfg.strategy) ---
add_options = add_options_for(ModelParallelOptions)  # ModelParallelOptions' fields, each its --option


def check_options(cfg: RunConfig, world_size: int) -> str | None:
    if cfg.strategy.devices is not None:
        if under_torchrun() and world_size > 1:
            return "--devices is the one-process form: start it with python, not with several torchrun ranks"
        devices, problem = device_list(cfg.strategy.devices)
        if problem:
            return problem
        parts = len(devices)
    else:
        parts = world_size
        if cfg.precision == "fp16":
            # GradScaler decides per process whether a step had inf/nan gradients; the ranks would
            # disagree (one skips, one steps). bf16 needs no loss scaling.
            return "--precision fp16 with one process per part would need a shared inf check: use bf16"
    return cut_problem(cfg, cfg.strategy.partition, parts)  # (a model of yours: a sequence of blocks?)


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
        splits_batch=False,
        one_process=lambda cfg: cfg.strategy.devices and f"--devices {cfg.strategy.devices} is one process",
        strategy_options=ModelParallelOptions,
        cuts_model=True,  # (a model of yours must be a sequence of blocks: check_options)
    )


# --- end MODEL PARALLEL options ---


if __name__ == "__main__":
    with destroy_process_group_on_exit(IMPL):  # --- MODEL PARALLEL: clean teardown on every exit path
        main()
    exit_without_interpreter_teardown()  # --- MODEL PARALLEL: gloo threads vs Python's shutdown
