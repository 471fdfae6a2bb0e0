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

from __future__ import annotations

import argparse
import dataclasses
import datetime
import time
from collections import OrderedDict

import torch
import torch.distributed as dist  # --- MODEL PARALLEL ---

from distref import impl_version
from distref.cli import parse_config
from distref.config import RunConfig, fail, under_torchrun
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
from distref.models import BlockModel, build_model
from distref.record import RunRecord, print_summary
from distref.training import (
    CheckpointError,
    IntervalTimer,
    autocast,
    checkpoint_path,
    configure_cpu_threads,
    describe_resume,
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

IMPL = "model_parallel"
VERSION = impl_version(__file__)
EVAL_BATCH_SIZE = 1000
SPLITS_BATCH = False  # --- MODEL PARALLEL: every part sees the whole batch


# --- MODEL PARALLEL: strategy options, on top of the core run contract ---
def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--partition",
        metavar="CUTS",
        help="block indices where the model is cut, e.g. 2 (two parts) or 1,2,3 (four); "
        "default: the cut balancing parameter counts",
    )
    parser.add_argument(
        "--devices",
        metavar="LIST",
        help="one process, one part per device: cuda:0,cuda:1 (cpu,cpu shows the mechanism on CPU); "
        "default: one process per part",
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


def check_options(cfg: RunConfig, world_size: int) -> str | None:
    if cfg.extra["devices"] is not None:
        if under_torchrun() and world_size > 1:
            return "--devices is the one-process form: start it with python, not with several torchrun ranks"
        devices, problem = device_list(cfg.extra["devices"])
        if problem:
            return problem
        parts = len(devices)
    else:
        parts = world_size
        if cfg.precision == "fp16":
            # GradScaler decides per process whether a step had inf/nan gradients; the ranks would
            # disagree (one skips, one steps). bf16 needs no loss scaling.
            return "--precision fp16 with one process per part would need a shared inf check: use bf16"
    return choose_cut_points(cfg.model, cfg.extra["partition"], parts, cfg.gpt_layers)[1]


@dataclasses.dataclass
class Links:
    """The ranks holding the parts before and after this process's (None: it holds the first / last
    part; both None in the one-process form), and what it measured on the way."""

    before: int | None = None
    after: int | None = None
    bytes_sent: int = 0  # activations forward, their gradients backward
    # training time blocked receiving: idle, waiting for a neighbour (CUDA events on a GPU)
    waiting: IntervalTimer = dataclasses.field(default_factory=lambda: IntervalTimer(torch.device("cpu")))


def send_activation(tensor: torch.Tensor, links: Links) -> None:
    """To the next part: shape and dtype first (micro-batches and eval batches differ in size; autocast
    changes the dtype), then the data (distref.distributed.send_tensor)."""
    links.bytes_sent += send_tensor(tensor, links.after)


def receive_activation(links: Links, device: torch.device) -> torch.Tensor:
    return recv_tensor(links.before, device)


def split_model(
    model: BlockModel, bounds: list[tuple[int, int]], devices
) -> list[tuple[BlockModel, torch.device]]:
    """The parts [first, end) of the model's blocks, each moved to its device (the blocks themselves:
    their parameter names stay the core model's)."""
    blocks = list(model.named_children())
    return [
        (BlockModel(OrderedDict(blocks[a:b])).to(d), d) for (a, b), d in zip(bounds, devices, strict=True)
    ]


def run_parts(parts: list[tuple[BlockModel, torch.device]], x: torch.Tensor) -> torch.Tensor:
    """Forward through this process's parts, moving the activation to each part's device."""
    for part, device in parts:
        x = part(x.to(device))
    return x


def train_micro_batch(parts, x, y, links: Links, cfg: RunConfig, scaler) -> torch.Tensor:
    """Forward and backward of one micro-batch through this process's parts; returns its loss (0 on
    ranks without the last part). The hand-offs below are what impls/pipeline's schedules automate."""
    device = parts[-1][1]
    if links.before is None:
        inputs = x
    else:  # the previous part's output, as this part's input: backward needs its gradient
        with links.waiting.measure():
            inputs = receive_activation(links, parts[0][1]).requires_grad_()
    with autocast(cfg, device):
        outputs = run_parts(parts, inputs)
    if links.after is None:  # the last part: the loss, and backward from it
        with autocast(cfg, device):
            loss = loss_fn(outputs, y.to(device))
        # 1/grad_accum as in single: the last part's backward scales every part's gradients.
        scaler.scale(loss / cfg.grad_accum).backward()
    else:
        send_activation(outputs.detach(), links)
        with links.waiting.measure():
            output_grad = torch.empty_like(outputs)  # the same shape and dtype as what was sent
            dist.recv(output_grad, links.after)
        torch.autograd.backward(outputs, output_grad)  # backward through this part from its output
        loss = torch.zeros((), device=device)
    if links.before is not None:  # hand the input's gradient to the previous part
        dist.send(inputs.grad, links.before)
        links.bytes_sent += inputs.grad.numel() * inputs.grad.element_size()
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
        inputs = x if links.before is None else receive_activation(links, parts[0][1])
        with autocast(cfg, device):
            outputs = run_parts(parts, inputs)
        if links.after is None:
            totals += score(outputs, y.to(device))
        else:
            send_activation(outputs, links)
    for part, _ in parts:
        part.train()
    return totals


# --- end MODEL PARALLEL options ---


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(
        argv,
        IMPL,
        add_options,
        check=check_options,
        description=__doc__,
        distributed=True,
        splits_batch=SPLITS_BATCH,
        one_process=lambda cfg: cfg.extra["devices"] and f"--devices {cfg.extra['devices']} is one process",
    )
    # --- MODEL PARALLEL: one process per part (launched here from plain python, as ddp does), or with
    # --devices one process driving a part per device. `links` names the neighbouring ranks.
    one_process = cfg.extra["devices"] is not None
    if not one_process and not under_torchrun():
        launch_ranks(__file__, argv, cfg, IMPL)  # starts the ranks and exits
    configure_cpu_threads()
    if one_process:  # --- MODEL PARALLEL: this process holds every part, one per device
        rank, world_size = 0, 1
        devices = device_list(cfg.extra["devices"])[0]
        if all(d.type == "cpu" for d in devices):
            print(
                f"{IMPL}: --devices {cfg.extra['devices']}: every part on the one CPU shows the mechanism, gains nothing"
            )
        device, backend, links = devices[-1], "none", Links()
    else:
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
        devices = [device]
        links = Links(rank - 1 if rank > 0 else None, rank + 1 if rank < world_size - 1 else None)
        links.waiting = IntervalTimer(device)
    is_main = rank == 0  # rank 0 writes the record, checkpoints and the final state_dict
    n_parts = len(devices) if one_process else world_size
    cuts = choose_cut_points(cfg.model, cfg.extra["partition"], n_parts, cfg.gpt_layers)[0]
    # --- end MODEL PARALLEL ---

    # ---- Data and model: the same in every impl -------------------------------------------------
    try:
        train_set, test_set, info = load_dataset(cfg)
    except DataError as exc:
        fail(str(exc), IMPL)
    seed_everything(cfg.seed)  # before building: every impl starts from the same parameters
    model = build_model(cfg.model, info, cfg.gpt_layers, param_dtype(cfg))
    # --- MODEL PARALLEL: every rank builds the whole model as single does (same seed, same initial
    # parameters), keeps its own part(s) on its device(s) and lets the rest go.
    bounds = part_bounds(cuts, len(model))
    block_names = [name for name, _ in model.named_children()]
    if is_main:
        how = "as given" if cfg.extra["partition"] else "balancing parameter counts"
        shown = " | ".join(",".join(block_names[a:b]) for a, b in bounds)
        print(f"{IMPL}: {n_parts} parts, cut at {cuts} ({how}): {shown}")
    parts = split_model(model, bounds if one_process else [bounds[rank]], devices)
    model = BlockModel(OrderedDict((n, b) for part, _ in parts for n, b in part.named_children()))
    for part, _ in parts:
        part.activation_checkpointing = cfg.activation_checkpointing
    optimizer = make_optimizer(cfg, model.parameters())  # --- MODEL PARALLEL: this rank's parameters
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
        devices=n_parts,
        memory_devices=devices,  # --- MODEL PARALLEL: --devices: the peak of each part's device
    )  # --- MODEL PARALLEL: every rank keeps the numbers, rank 0 writes them
    record.data["strategy"].update(cut_points=cuts, parts=[block_names[a:b] for a, b in bounds])

    # ---- Resume: model, optimizer, scaler, RNG, record; the data order and lr follow the step ---
    start_step = 0
    if (path := resume_path(cfg)) is not None:
        try:
            state = load_checkpoint(path, cfg, n_steps)
            if state["cut_points"] != cuts:  # --- MODEL PARALLEL: parts and optimizer states must match
                raise CheckpointError(
                    f"checkpoint {path} was cut at {state['cut_points']}, this run at {cuts}"
                )
        except CheckpointError as exc:
            fail(str(exc), IMPL)
        # --- MODEL PARALLEL: one checkpoint for all ranks; each takes its blocks and its optimizer state
        model.load_state_dict(
            {k: v for k, v in state["model"].items() if k.split(".")[0] in dict(model.named_children())}
        )
        optimizer.load_state_dict(state["optimizer"][rank])
        scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"])
        record.load_state(state, path)  # the history so far, and what this session changes
        start_step = state["step"]
        if is_main:  # --- MODEL PARALLEL: one line, not one per rank
            print(f"{IMPL}: {describe_resume(path, state)}")

    # The lr is a function of the step: built after a resume, it continues where the run left off.
    scheduler = make_lr_schedule(cfg, optimizer, n_steps, start_step)

    # --- MODEL PARALLEL: every rank reads the same micro-batches (the first part uses x, the last y)
    micro_batches = iter(train_loader(train_set, cfg, start_step, n_steps))
    bar = progress_bar(n_steps, start_step, enabled=is_main, desc=f"{IMPL} ×{n_parts}")
    tb = tensorboard_writer(cfg, enabled=is_main)
    pending_losses: list[torch.Tensor] = []  # per-step losses not yet in the record (no sync per step)
    pending_times: list[float] = []
    state_bytes = None  # model-state bytes, measured once gradients and optimizer state both exist
    last_rank = world_size - 1  # --- MODEL PARALLEL: the rank with the last part has the loss
    session_train_s = 0.0  # and the time this session trained, for each rank's busy fraction

    record.start_training()  # start-up (imports, data, model, set-up) ends: the run's clock starts
    try:
        with profiler(cfg, rank=rank) as prof:  # --- MODEL PARALLEL: one trace per rank
            for step in range(start_step, n_steps):
                t0 = time.perf_counter()
                step_loss = torch.zeros((), device=device)
                for _ in range(cfg.grad_accum):
                    x, y = next(micro_batches)
                    # --- MODEL PARALLEL: this micro-batch through every part and back, one part
                    # working at a time; micro-batches one after another (no overlap: that is pipelining).
                    loss = train_micro_batch(parts, x, y, links, cfg, scaler)
                    step_loss += loss / cfg.grad_accum
                scale = scaler.get_scale()  # fp16: a host sync, as scaler.step() makes anyway; else 1.0
                scaler.step(optimizer)
                scaler.update()
                if scaler.get_scale() < scale:  # inf/nan gradients: the update was skipped, the scale lowered
                    record.add_skipped_step(step)
                scheduler.step()
                if state_bytes is None:
                    state_bytes = model_state_bytes(model.parameters(), optimizer)
                    bytes_per_step = links.bytes_sent  # --- MODEL PARALLEL: measured on the first step
                optimizer.zero_grad(set_to_none=True)
                for part_device in devices:  # --- MODEL PARALLEL: --devices: every part's queue
                    synchronize(part_device)
                pending_times.append(time.perf_counter() - t0)
                session_train_s += pending_times[-1]  # --- MODEL PARALLEL
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
                    if world_size > 1:  # --- MODEL PARALLEL: the losses are the last rank's
                        dist.broadcast(losses, src=last_rank)
                    losses = losses.tolist()
                    record.add_steps(done - len(losses), losses, pending_times)
                    stop_if_diverged(losses, done - len(losses), cfg, IMPL)  # nan/inf: exit 1
                    bar.set_postfix(loss=f"{losses[-1]:.4f}")
                    tb.add_scalar("train/loss", losses[-1], done)
                    pending_losses, pending_times = [], []

                if eval_now:
                    eval_started = time.perf_counter()
                    # --- MODEL PARALLEL: every test batch through the chain; the last rank scores it
                    totals = evaluate_parts(parts, eval_batches(test_set, EVAL_BATCH_SIZE), links, cfg)
                    if world_size > 1:
                        dist.broadcast(totals, src=last_rank)
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
                    # --- MODEL PARALLEL: rank 0 gathers every part (core keys) and optimizer state
                    held = {"model": unwrap_state_dict(model), "optimizer": optimizer.state_dict()}
                    gathered = gather_to_rank0(held, world_size)
                    if is_main:
                        state = {
                            "model": {k: v for part in gathered for k, v in part["model"].items()},
                            "optimizer": [part["optimizer"] for part in gathered],
                            "cut_points": cuts,
                            "scaler": scaler.state_dict(),
                            "step": done,
                            "total_steps": n_steps,
                            "rng": torch.get_rng_state(),
                            "record": record.state(),
                            "config": cfg.to_dict(),
                        }
                        save_checkpoint(checkpoint_path(cfg.checkpoint_dir, done), state)
    except BaseException as exc:  # the record says the run failed, and why; nothing written is lost
        record.fail(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        bar.close()
        tb.close()

    # --- MODEL PARALLEL: rank 0 gathers every part into the full fp32 state_dict (core keys)
    if cfg.save_final:
        parts_state = gather_to_rank0(unwrap_state_dict(model), world_size)
        if is_main:
            save_checkpoint(cfg.save_final, {k: v for part in parts_state for k, v in part.items()})
    # --- MODEL PARALLEL: each rank's memory and model state (about 1/parts each), its idle time and
    # the bytes it sent per step, gathered to rank 0
    measured = gather_to_rank0(
        {
            "peak": record.training_peak_memory(),  # one per device it computes on
            "state": state_bytes,
            "bytes_per_step": bytes_per_step if state_bytes else None,
            "busy_fraction": 1 - links.waiting.seconds() / session_train_s if session_train_s else None,
        },
        world_size,
    )
    if is_main:
        record.data["strategy"]["bytes_sent_per_step"] = [m["bytes_per_step"] for m in measured]
        record.data["strategy"]["busy_fraction"] = [m["busy_fraction"] for m in measured]
    record.finish(
        cfg.global_batch_size, [p for m in measured for p in m["peak"]], [m["state"] for m in measured]
    )
    if is_main:
        print_summary(record.data)
    return record.data


if __name__ == "__main__":
    with destroy_process_group_on_exit(IMPL):  # --- MODEL PARALLEL: clean teardown on every exit path
        main()
    exit_without_interpreter_teardown()  # --- MODEL PARALLEL: gloo threads vs Python's shutdown
