"""Single-process baseline: one process, one device, no parallelism.

Every other impl is this file plus its strategy. It is also the oracle they are checked against: with
the same data order, seed and global batch, each strategy must end with the same parameters (fp32).

    python impls/single/train.py --epochs 2 --out runs/single          # real MNIST, lenet
    python impls/single/train.py --model gpt --dataset synthetic --steps 300 --lr 3e-3
"""

import torch

from distref import impl_version
from distref.cli import exit_on_bad_input, parse_config
from distref.config import RunConfig
from distref.cost.activations import predicted_for_run
from distref.cost.memory import one_process_cost
from distref.cost.usage import model_usage, parameters_of
from distref.data import eval_batches, load_dataset, scored_targets, steps_per_epoch, train_loader
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
    pick_device,
    seed_everything,
    seed_step,
)
from distref.training.measure import model_state_bytes
from distref.training.monitor import profiler
from distref.training.optim import make_grad_scaler, make_lr_schedule, make_optimizer, total_steps
from distref.training.steps import evaluate, loss_sum

IMPL = "single"
VERSION = impl_version(__file__)


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_options(argv)
    configure_cpu_threads()
    device = pick_device(cfg.device)

    # ---- Data and model: the same in every impl -------------------------------------------------
    with exit_on_bad_input(IMPL):  # a dataset that fails its md5: one line, exit 2
        train_set, test_set, info = load_dataset(cfg)
    seed_everything(cfg.seed)  # before building: every impl starts from the same parameters
    model = build_model(cfg.model, info, cfg.gpt_layers, param_dtype(cfg), cfg.moe).to(device)
    model.activation_checkpointing = cfg.activation_checkpointing
    if cfg.compile:  # torch.compile, block by block, before any strategy wraps the model
        compile_blocks(model)
    optimizer = make_optimizer(cfg, model.parameters())
    scaler = make_grad_scaler(cfg, device)
    n_steps = total_steps(cfg, len(train_set))
    cadence = Cadence(cfg, n_steps, steps_per_epoch(len(train_set), cfg.global_batch_size))
    record = RunRecord(IMPL, VERSION, cfg, world_size=1, device=device, backend="none")

    # ---- Resume: model, optimizer, scaler, RNG, record; the data order and lr follow the step ---
    start_step = 0
    if (path := resume_path(cfg)) is not None:
        with exit_on_bad_input(IMPL):  # a checkpoint of another run: one line, exit 2
            state = load_checkpoint(path, cfg, n_steps, holds=("model", "optimizer", "scaler"))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        start_step = resume_step(state, path, record, IMPL)  # and the RNG, the record's history

    # The lr is a function of the step: built after a resume, it continues where the run left off.
    scheduler = make_lr_schedule(cfg, optimizer, n_steps, start_step)
    micro_batches = train_loader(train_set, cfg, start_step, n_steps, device=device)
    log = StepLog(record, cfg, IMPL, cadence, start_step, device=device)
    state_bytes = None  # model-state bytes, measured once gradients and optimizer state both exist

    record.start_training()  # start-up (imports, data, model, set-up) ends: the run's clock starts
    with log, profiler(cfg, rank=0) as prof:
        for step in range(start_step, n_steps):
            started = log.step_starts(step)
            # This step's random numbers (dropout): a function of (seed, step), so a resumed run draws
            # what an uninterrupted one does. (Each impl says which stream each of its ranks draws.)
            seed_step(cfg.seed, step, devices=[device])
            # The step's loss is the mean over every scored target of the whole global batch: each
            # micro-batch adds its loss *sum* over this count. (The mean of the micro-batches' own means
            # would weigh a micro-batch scoring 3 targets as much as one scoring 60: padding, prompts.)
            scored = scored_targets(train_set, cfg, step)
            step_loss = None
            for _ in range(cfg.grad_accum):
                x, y = next(micro_batches)  # on the device already, the next one on its way
                with autocast(cfg, device):
                    loss = loss_sum(model(x), y) / scored
                # The micro-batches' gradients add up to the global batch's, as one big batch gives.
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
                log.flush(due.done)
            if due.eval:
                started = log.eval_starts()
                totals = evaluate(model, eval_batches(test_set), device, cfg)
                log.evaluated(due.done, totals, started)
            if due.checkpoint:
                states = dict(model=model.state_dict(), optimizer=optimizer.state_dict())
                save_step_checkpoint(cfg, due.done, n_steps, record, **states, scaler=scaler.state_dict())

    if cfg.save_final:  # the core model's full state_dict (fp32; fp64 in fp64); keys the same in every impl
        save_checkpoint(cfg.save_final, unwrap_state_dict(model))
    # Model states (a full replica: gradients and optimizer state of the parameters that receive a
    # gradient) and activations by formula (distref.cost), beside the measured ones; one process
    # communicates nothing
    usage = model_usage(cfg.model, info, cfg.gpt_layers, cfg.moe)  # which parameters train: a forward on meta
    predicted = one_process_cost(
        parameters_of(model.named_parameters(), usage),
        optimizer=cfg.optimizer,
        step_bytes=torch.get_default_dtype().itemsize,
        unknown=usage.unknown,
        activations=predicted_for_run(cfg, info, device=device.type),
    )
    record.finish(cfg.global_batch_size, record.training_peak_memory(), [state_bytes], [predicted.as_dict()])
    print_summary(record.data)
    return record.data


# ---- The command line: the core options (distref.cli); single has none of its own ----------------
def parse_options(argv: list[str] | None, world_size: int = 1) -> RunConfig:
    return parse_config(argv, IMPL, world_size=world_size, description=__doc__, trains_experts=True)


if __name__ == "__main__":
    main()
