"""nn.DataParallel: one process drives every visible GPU.

Each step, DataParallel (1) copies the model from GPU 0 to every other GPU, (2) splits the batch along
dim 0 across them, (3) runs the replicas in threads of this one process, (4) gathers the outputs on
GPU 0, where the loss is computed; backward sums every replica's gradients back into GPU 0's parameters.

Why DDP is usually preferred (see README for what was measured): the replication in (1) happens every
step; one Python process runs all replicas, so they contend for the GIL; and GPU 0 holds the gathered
outputs, the loss and the optimizer, so it needs more memory and does more work than the others. DDP
keeps one replica per process and moves only gradients.

Without a GPU, or with only one, DataParallel has nothing to split across and runs the module as is: the
impl says so at start-up and trains the same code path.

    python impls/dataparallel/train.py --epochs 2 --out runs/dataparallel
    nox -s dataparallel-gpu

Changes against impls/single/train.py are marked `# --- DataParallel: ... ---`.
"""

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from distref import impl_version
from distref.cli import exit_on_bad_input, parse_config
from distref.config import RunConfig
from distref.cost.activations import no_formula, predicted_for_run
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

IMPL = "dataparallel"
VERSION = impl_version(__file__)


# --- DataParallel: the strategy ------------------------------------------------------------------
def apply_dataparallel(
    model: nn.Module, gpu_ids: list[int], make_autocast: Callable[[], contextlib.AbstractContextManager]
) -> nn.DataParallel:
    """Wrap the model (on its device, before the optimizer is built): every step DataParallel replicates
    it across `gpu_ids` and splits the batch; GPU 0 gathers the outputs and holds the optimizer."""
    if len(gpu_ids) < 2:
        print(
            f"{IMPL}: {len(gpu_ids)} GPU(s) visible: DataParallel runs the module as is, without parallelism"
        )
    return DataParallelWithAutocast(model, gpu_ids or None, make_autocast)


class InAutocast(nn.Module):
    """A replica whose forward runs under `make_autocast()`, entered in the thread that calls it."""

    def __init__(self, replica: nn.Module, make_autocast: Callable[[], contextlib.AbstractContextManager]):
        super().__init__()
        self.replica, self.make_autocast = replica, make_autocast

    def forward(self, *args, **kwargs):
        with self.make_autocast():
            return self.replica(*args, **kwargs)


class DataParallelWithAutocast(nn.DataParallel):
    """nn.DataParallel whose replicas compute in the run's precision. It runs each replica in a thread of
    its own, and autocast is per thread: torch 2.13's parallel_apply re-enters it there with its on/off
    flag but no dtype, and CUDA's default is fp16, so a bf16 run would compute in fp16 (without the loss
    scaler fp16 needs). Each replica enters the run's autocast itself."""

    def __init__(
        self, module: nn.Module, device_ids, make_autocast: Callable[[], contextlib.AbstractContextManager]
    ):
        super().__init__(module, device_ids=device_ids)
        self.make_autocast = make_autocast

    def parallel_apply(self, replicas, inputs, kwargs):
        wrapped = [InAutocast(replica, self.make_autocast) for replica in replicas]
        return super().parallel_apply(wrapped, inputs, kwargs)


# --- end DataParallel strategy ---


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
    # --- DataParallel: replicate across every visible GPU each step; GPU 0 gathers and steps ---
    gpu_ids = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
    model = apply_dataparallel(model, gpu_ids, lambda: autocast(cfg, device))
    optimizer = make_optimizer(cfg, model.parameters())
    scaler = make_grad_scaler(cfg, device)
    n_steps = total_steps(cfg, len(train_set))
    cadence = Cadence(cfg, n_steps, steps_per_epoch(len(train_set), cfg.global_batch_size))
    # --- DataParallel: one process computing on every GPU it was given (1 on CPU: no parallelism)
    gpus = [torch.device("cuda", i) for i in gpu_ids]
    record = RunRecord(
        IMPL,
        VERSION,
        cfg,
        world_size=1,
        device=device,
        backend="none",
        devices=max(1, len(gpu_ids)),
        memory_devices=gpus or None,
    )

    # ---- Resume: model, optimizer, scaler, RNG, record; the data order and lr follow the step ---
    start_step = 0
    if (path := resume_path(cfg)) is not None:
        with exit_on_bad_input(IMPL):  # a checkpoint of another run: one line, exit 2
            state = load_checkpoint(path, cfg, n_steps, holds=("model", "optimizer", "scaler"))
        model.module.load_state_dict(state["model"])  # --- DataParallel: the core model is .module
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        start_step = resume_step(state, path, record, IMPL)

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
            seed_step(cfg.seed, step, devices=gpus or [device])  # --- DataParallel: each GPU its own stream
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
                # --- DataParallel: nothing to undo: the loss is over the outputs gathered on GPU 0 (the
                # whole micro-batch), and backward *sums* the replicas' gradients into the module's.
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
                # --- DataParallel: the core model's state_dict (no "module." prefix)
                states = dict(model=model.module.state_dict(), optimizer=optimizer.state_dict())
                save_step_checkpoint(cfg, due.done, n_steps, record, **states, scaler=scaler.state_dict())

    if cfg.save_final:  # the core model's full state_dict (fp32; fp64 in fp64); keys the same in every impl
        save_checkpoint(cfg.save_final, unwrap_state_dict(model))
    # --- DataParallel: peak memory of every GPU it used (GPU 0 carries the gathers, loss and optimizer)
    # Model states (a full replica: gradients and optimizer state of the parameters that receive a
    # gradient) and activations by formula (distref.cost), beside the measured ones.
    # --- DataParallel: on several GPUs its copies between them are no process-group collectives (the
    # counter sees none) and the replicas run in threads of their own (saved-tensor hooks are per
    # thread): no formula then; on one device it is single.
    usage = model_usage(cfg.model, info, cfg.gpt_layers, cfg.moe)  # which parameters train: a forward on meta
    one_device = len(gpu_ids) < 2  # --- DataParallel
    threads = (
        None
        if one_device
        else "nn.DataParallel on several GPUs: its replicas' threads and copies are not counted"
    )
    predicted = one_process_cost(
        parameters_of(model.module.named_parameters(), usage),  # --- DataParallel: the core model's
        optimizer=cfg.optimizer,
        step_bytes=torch.get_default_dtype().itemsize,
        unknown=usage.unknown,
        # --- DataParallel: with several GPUs neither communication nor activations have a formula
        activations=(
            predicted_for_run(cfg, info, device=device.type)[0] if one_device else None,
            no_formula(cfg.model, cfg.precision, device.type) or threads,
        ),
        communication_unavailable=threads,
    )
    record.finish(cfg.global_batch_size, record.training_peak_memory(), [state_bytes], [predicted.as_dict()])
    print_summary(record.data)
    return record.data


# ---- The command line: the core options (distref.cli); DataParallel has none of its own ----------
# --- DataParallel: only a check of its own (one line and exit 2 on bad input) ---
def check_options(cfg: RunConfig, world_size: int) -> str | None:
    """nn.DataParallel takes every visible GPU whatever the run's device: on the CPU, hide them."""
    if cfg.device == "cpu" and torch.cuda.is_available():
        return "--device cpu: nn.DataParallel would take the visible GPUs anyway; hide them (CUDA_VISIBLE_DEVICES=)"
    if (
        cfg.compile
    ):  # (its replicas are copies made at every forward, which share the original's compiled call)
        return "--compile: nn.DataParallel copies the model onto each GPU at every forward; compile with ddp instead"
    return None


def parse_options(argv: list[str] | None, world_size: int = 1) -> RunConfig:
    # --- DataParallel: the core options, then its check
    return parse_config(argv, IMPL, world_size=world_size, check=check_options, description=__doc__)


# --- end DataParallel options ---


if __name__ == "__main__":
    main()
