"""DeepSpeed ZeRO: data parallel, with the model states partitioned over the ranks instead of replicated.

Every rank runs this file, started by torchrun (or `deepspeed --num_gpus N`), or by `python train.py`,
which checks the arguments and then starts the ranks itself. As in DDP each rank trains on its slice of
the global batch; what ZeRO changes is who holds what. Stage 0 keeps a full replica per rank (DDP);
stage 1 partitions the optimizer states, stage 2 also the gradients, stage 3 also the parameters —
each rank owns 1/N of them and the rest is gathered or reduced when needed. `--offload-optimizer` /
`--offload-params` keep those partitions in CPU memory. In fp32 and fp64 every stage gives the same
model as `impls/single` trained on the whole global batch (models without BatchNorm: each rank keeps
its own statistics; in bf16/fp16 DeepSpeed trains low-precision parameters with fp32 master copies,
where single keeps fp32 parameters under autocast).

    python impls/deepspeed_zero/train.py --nproc-per-node 2 --zero-stage 2 --epochs 2 --out runs/zero2
    torchrun --standalone --nproc-per-node 2 impls/deepspeed_zero/train.py --zero-stage 3
    deepspeed --num_gpus 2 impls/deepspeed_zero/train.py --zero-stage 3        # DeepSpeed's launcher
    nox -s deepspeed_zero-cpu / nox -s deepspeed_zero-gpu / nox -s deepspeed_zero-bench

Changes against impls/single/train.py are marked `# --- ZERO: ... ---`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import logging
import math
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist  # --- ZERO ---

from distref import impl_version
from distref.cli import add_options_for, exit_on_bad_input, option, parse_config
from distref.config import RunConfig, positive_float, under_torchrun, uses_cuda
from distref.cost.activations import parameters_in, predicted_for_run
from distref.cost.usage import model_usage, parameters_of
from distref.cost.zero import zero_rank_cost
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
    CheckpointError,
    check_listed_files,
    checkpoint_path,
    checkpoint_state,
    folder_hashes,
    load_checkpoint,
    resume_path,
    resume_step,
    save_checkpoint,
)
from distref.training.compile import compile_blocks
from distref.training.device import (
    configure_cpu_threads,
    param_dtype,
    seed_everything,
    seed_step,
)
from distref.training.measure import zero_model_state_bytes
from distref.training.monitor import profiler
from distref.training.optim import make_lr_schedule, make_optimizer, total_steps
from distref.training.steps import evaluate, loss_sum
from distref.your_model import batch_norm_in_16_bits_problem

IMPL = "deepspeed_zero"
VERSION = impl_version(__file__)


# --- ZERO: the strategy --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ZeroFlags:
    """ZeRO's own options, each declared with its command-line option (ZeroOptions adds --local_rank)."""

    zero_stage: int = option(
        "partition nothing (0, = DDP), optimizer states (1), + gradients (2), + parameters (3)",
        metavar="{0,1,2,3}",
        type=int,
        default=2,
    )
    offload_optimizer: bool = option(
        "keep the optimizer states (and fp32 master weights) in CPU memory and step there (stage ≥ 1)",
        action="store_true",
        default=False,
    )
    offload_params: bool = option(
        "keep the parameter partitions in CPU memory between uses (stage 3)",
        action="store_true",
        default=False,
    )
    bucket_mb: float = option(
        "gradient reduce / parameter all-gather bucket size (smaller = less memory, more calls)",
        metavar="MB",
        type=positive_float,
        default=50.0,
    )


@dataclasses.dataclass(frozen=True)
class ZeroOptions(ZeroFlags):
    """ZeRO's own options (cfg.strategy): ZeroFlags', then the hidden --local_rank (`add_options`)."""

    local_rank: int | None = None  # the `deepspeed` launcher passes it; torchrun's LOCAL_RANK is what is used


def quiet_deepspeed() -> None:
    """DeepSpeed logs INFO lines and FutureWarnings by the dozen per rank; keep its warnings and errors."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"deepspeed\.")
    # DeepSpeed calls collectives torch 2.13 deprecates (all_gather_into_tensor, reduce_scatter_tensor).
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def skip_shm_op_build() -> None:
    """On CPU, DeepSpeed's comm backend JIT-compiles a shared-memory all-reduce (`deepspeed_shm_comm`,
    ~84 s and 1.6 GB here) on every start; it serves inference only. Replace its builder with "not
    available". (The module is taken from sys.modules: `import deepspeed.comm.torch as m` would bind the
    name `torch` in `deepspeed.comm`, i.e. torch itself.)"""
    import deepspeed.comm.torch  # noqa: F401  (loads the module)

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def init_deepspeed(cfg: RunConfig, device: torch.device, backend: str):
    """DeepSpeed, imported for this rank's device, on the process group already started; returns it."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # else DeepSpeed guesses (and may pick CUDA)
    quiet_deepspeed()
    import deepspeed  # after DS_ACCELERATOR: DeepSpeed picks its accelerator at import

    skip_shm_op_build()
    timeout = datetime.timedelta(seconds=cfg.timeout)
    # The process group is torch's own, started as in ddp (restart-safe store, --timeout): deepspeed.comm
    # wraps it instead of creating another.
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout, verbose=False)
    # DeepSpeed makes process groups of its own (dist.new_group without a timeout), which take torch's
    # default for gloo, 30 minutes, not --timeout: a silent rank then hung the job that long.
    dist.distributed_c10d.default_pg_timeout = timeout
    return deepspeed


def deepspeed_config(cfg: RunConfig, world_size: int) -> dict:
    """The ZeRO configuration (what a ds_config.json would hold), from the run contract.

    DeepSpeed takes the batch as three numbers that must agree: the global batch (per optimizer step)
    = micro-batch per rank × gradient accumulation steps × world size."""
    stage = cfg.strategy.zero_stage
    bucket = bucket_elements(cfg.strategy.bucket_mb)  # DeepSpeed sizes buckets in elements
    zero: dict = {
        "stage": stage,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
        "contiguous_gradients": True,
        "overlap_comm": stage >= 2 and world_size > 1,  # reduce during backward; 1 rank: nothing to overlap
    }
    if stage in (1, 2) and not cfg.strategy.offload_optimizer:
        zero["compute_grad_norm"] = False  # only clipping (off) reads it: no norm all-reduce
    if stage == 3:
        # Below this many elements a parameter is kept whole on every rank (default 1e5): lenet's and gpt's
        # tensors all are, so nothing would be partitioned. 0 partitions every one, as a large model would be.
        zero["stage3_param_persistence_threshold"] = 0
        zero["stage3_prefetch_bucket_size"] = bucket
    if cfg.strategy.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": uses_cuda(cfg)}
    if cfg.strategy.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": uses_cuda(cfg)}
    return {
        "train_batch_size": cfg.global_batch_size,
        "train_micro_batch_size_per_gpu": cfg.global_batch_size // (world_size * cfg.grad_accum),
        "gradient_accumulation_steps": cfg.grad_accum,
        "zero_optimization": zero,
        # DeepSpeed 0.19 clips the global gradient norm at 1.0 unless told otherwise (its default changed
        # from 0.0): single does not clip, and clipping silently changed the result from step 10 on here.
        "gradient_clipping": 0.0,
        # single's bf16 skips no step: no overflow check (a flag all-reduce, .item()); nan: stop_if_diverged
        "bf16": {"enabled": cfg.precision == "bf16", "check_grad_overflow": False},
        "fp16": {"enabled": cfg.precision == "fp16", "loss_scale": 0},  # 0: dynamic loss scaling
        # The optimizer is single's own torch AdamW/SGD (make_optimizer), passed in: the same update as
        # every other impl, and nothing compiled. DeepSpeed's FusedAdam/CPUAdam JIT-compile C++ (~2 min)
        # and differ from torch's AdamW by up to 2e-2 after 50 steps; these two flags allow the client one.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # distref's progress bar and record do the logging
        "wall_clock_breakdown": False,
    }


def full_fp32_state_dict(engine, stage: int) -> dict[str, torch.Tensor]:
    """The core model's full fp32 state_dict (core keys), assembled from the partitions. A collective at
    stage 3 (every rank must call it). With bf16 the fp32 master weights are returned, not the bf16 copy
    the module computes with."""
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    params = dict(module.named_parameters())
    with deepspeed_gathered(params.values(), stage):
        state = {}
        for name, tensor in module.state_dict().items():
            param = params.get(name)
            master = safe_get_full_fp32_param(param) if param is not None else None
            value = master if master is not None else tensor
            state[name] = value.detach().float().cpu().clone() if value.is_floating_point() else value.cpu()
    return state


def deepspeed_gathered(params, stage: int):
    """Whole parameters for the duration of the block: at stage 3 each rank holds 1/N of every tensor."""
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(params)) if stage == 3 else contextlib.nullcontext()


# Checkpoints are DeepSpeed's own: each rank writes its partition of the optimizer states (and at stage 3
# of the parameters) into a folder step-N/ beside the index step-N.pt.
def save_zero_checkpoint(
    engine, cfg: RunConfig, done: int, n_steps: int, record: RunRecord, world_size: int, is_main: bool
) -> None:
    """DeepSpeed writes its files without a temporary name; the index, written atomically by rank 0 after
    every rank has finished (barrier), is what makes the set complete: a crash mid-save leaves the
    previous index the newest, and `--resume auto` never sees the half-written folder."""
    index = checkpoint_path(cfg.checkpoint_dir, done)
    tag = index.stem  # the folder DeepSpeed writes: <checkpoint-dir>/step-N/
    engine.save_checkpoint(cfg.checkpoint_dir, tag=tag, save_latest=False)
    dist.barrier()
    if is_main:
        files = {
            "deepspeed_tag": tag,
            "zero_stage": cfg.strategy.zero_stage,
            "world_size": world_size,
            # DeepSpeed loads its files with torch.load(weights_only=False), i.e. it unpickles them: their
            # hashes, taken when written, are checked before that happens on resume.
            "sha256": folder_hashes(index.parent / tag),
        }
        save_checkpoint(index, checkpoint_state(cfg, done, n_steps, record, **files))


def load_zero_checkpoint(
    engine, index: Path, cfg: RunConfig, n_steps: int, world_size: int, is_main: bool
) -> dict:
    """The index (step-N.pt: step, record, options, RNG, file hashes) names a complete checkpoint; DeepSpeed
    then loads its own sharded files from the folder beside it, once their hashes are checked. Returns the
    index's state."""
    with exit_on_bad_input(IMPL, say=is_main):  # every rank finds it; rank 0 says it, once
        state = load_checkpoint(index, cfg, n_steps, holds=("deepspeed_tag",))
        check_zero_checkpoint(index, state, cfg.strategy.zero_stage, world_size)
        check_listed_files(index, index.parent / state["deepspeed_tag"], state["sha256"])
    engine.load_checkpoint(
        str(index.parent), tag=state["deepspeed_tag"], load_module_strict=True, load_lr_scheduler_states=False
    )
    return state


def check_zero_checkpoint(index: Path, state: dict, stage: int, world_size: int) -> None:
    """A ZeRO checkpoint holds one partition per rank for one stage: it resumes only the same layout
    (convert it to a full state_dict for anything else; README). Its files: check_listed_files."""
    if (state.get("zero_stage"), state.get("world_size")) != (stage, world_size):
        raise CheckpointError(
            f"checkpoint {index} is ZeRO stage {state.get('zero_stage')} over {state.get('world_size')} "
            f"ranks, this run stage {stage} over {world_size} ranks: resume with the same --zero-stage and "
            "ranks, or convert it with get_fp32_state_dict_from_zero_checkpoint (README)"
        )


# --- end ZERO strategy ---


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_options(argv)
    # --- ZERO: one process per device. Started as `python train.py [--nproc-per-node N]`, this process has
    # only checked the arguments (bad input stops above, before any rank exists); it now starts the ranks
    # through torch's own launcher, as torchrun would, and waits. Each rank arrives here under torchrun.
    if not under_torchrun():
        launch_ranks(__file__, argv, cfg, IMPL)
    configure_cpu_threads()  # (the `deepspeed` launcher sets no OMP_NUM_THREADS: this does)
    rank, world_size, device, backend = start_process_group(cfg)  # one device per rank, a group
    deepspeed = init_deepspeed(cfg, device, backend)
    is_main = rank == 0  # rank 0 alone writes the record and the checkpoint index
    stage = cfg.strategy.zero_stage
    # --- end ZERO ---

    # ---- Data and model: the same in every impl -------------------------------------------------
    with exit_on_bad_input(IMPL):  # a dataset that fails its md5: one line, exit 2
        train_set, test_set, info = load_dataset(cfg)
    seed_everything(cfg.seed)  # before building: every impl starts from the same parameters
    model = build_model(cfg.model, info, cfg.gpt_layers, param_dtype(cfg), cfg.moe).to(device)
    # --- ZERO: every rank read the data and built the model itself: they must agree (one all-gather)
    with exit_on_bad_input(IMPL, say=is_main):
        check_ranks_agree(cfg, train_set, test_set, model)
    model.activation_checkpointing = cfg.activation_checkpointing
    if cfg.compile:  # torch.compile, block by block, before any strategy wraps the model
        compile_blocks(model)
    optimizer = make_optimizer(cfg, model.parameters())
    # --- ZERO: the engine partitions the model states as the config says, broadcasts rank 0's parameters,
    # and from here on does backward (loss scaling, gradient reduction), the optimizer step and zero_grad.
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=deepspeed_config(cfg, world_size)
    )
    n_steps = total_steps(cfg, len(train_set))
    cadence = Cadence(cfg, n_steps, steps_per_epoch(len(train_set), cfg.global_batch_size))
    record = RunRecord(
        IMPL, VERSION, cfg, world_size=world_size, device=device, backend=backend, write_files=is_main
    )  # --- ZERO: every rank keeps the numbers, rank 0 writes them
    record.add_strategy_facts(
        zero_stage=stage,
        offload_optimizer=cfg.strategy.offload_optimizer,
        offload_params=cfg.strategy.offload_params,
        deepspeed_version=deepspeed.__version__,
    )

    # ---- Resume: model, optimizer, scaler, RNG, record; the data order and lr follow the step ---
    start_step = 0
    if (path := resume_path(cfg)) is not None:
        state = load_zero_checkpoint(engine, path, cfg, n_steps, world_size, is_main)  # --- ZERO: its files
        start_step = resume_step(state, path, record, IMPL, say=is_main)  # --- ZERO: said once

    # The lr is a function of the step: built after a resume, it continues where the run left off.
    # --- ZERO: on the torch optimizer itself; DeepSpeed steps it on the flat partitions, keeping each
    # param group's lr.
    scheduler = make_lr_schedule(cfg, optimizer, n_steps, start_step)
    # --- ZERO: this rank's slice of every global batch (same order as single, any world size) ---
    micro_batches = train_loader(train_set, cfg, start_step, n_steps, rank, world_size, device=device)
    log = StepLog(
        record, cfg, IMPL, cadence, start_step, show=is_main, desc=f"{IMPL} ×{world_size}", device=device
    )
    state_bytes = None  # model-state bytes, measured once gradients and optimizer state both exist
    compute_dtype = next(engine.module.parameters()).dtype  # --- ZERO: bf16/fp16 params under those

    record.start_training()  # start-up (imports, data, model, set-up) ends: the run's clock starts
    with log, profiler(cfg, rank=rank) as prof:  # --- ZERO: one trace per rank
        for step in range(start_step, n_steps):
            started = log.step_starts(step)
            # This step's random numbers (dropout): a function of (seed, step), so a resumed run draws
            # what an uninterrupted one does. (Each impl says which stream each of its ranks draws.)
            seed_step(cfg.seed, step, stream=rank, devices=[device])  # --- ZERO: each rank its own stream
            # The step's loss is the mean over every scored target of the whole global batch: each
            # micro-batch adds its loss *sum* over this count. (The mean of the micro-batches' own means
            # would weigh a micro-batch scoring 3 targets as much as one scoring 60: padding, prompts.)
            scored = scored_targets(train_set, cfg, step)  # --- ZERO: of the whole batch, not this rank's
            step_loss = None
            for micro_step in range(cfg.grad_accum):
                x, y = next(micro_batches)  # on the device already, the next one on its way
                if x.is_floating_point():  # --- ZERO: images in the parameters' dtype (bf16/fp16)
                    x = x.to(compute_dtype)
                loss = loss_sum(engine(x), y) / scored
                # --- ZERO: the micro-batches' and the ranks' gradients must add up to the global batch's.
                # scale_wrt_gas=False: the engine would divide by --grad-accum (the count did it). At the
                # last micro-step it averages the gradients over the ranks (stage 0/1: all-reduce; 2/3:
                # reduce-scatter into each rank's partition), ÷ world size at every stage with no option
                # to sum (its gradient_predivide_factor only moves the divide): × world size undoes it.
                engine.backward(loss * world_size, scale_wrt_gas=False)
                if state_bytes is None and step > start_step and micro_step == cfg.grad_accum - 1:
                    # Gradients exist now (step() frees them) and the optimizer state since step 1.
                    state_bytes = zero_model_state_bytes(engine, optimizer)
                # --- ZERO: a no-op but at the last micro-step: optimizer step on this rank's
                # partition, then (stage 1/2) all-gather of the updated parameters; zero_grad.
                engine.step()
                step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()  # (K=1: no add)
            # --- ZERO: no scaler, optimizer.step() or zero_grad() here: engine.step() did them
            if not engine.was_step_applied():  # --- ZERO: fp16's loss scaler found inf/nan, skipped it
                record.add_skipped_step(step)
            scheduler.step()
            log.step_done(step_loss, started)  # (no wait for the GPU: the step is timed by events)
            prof.step()

            due = cadence.after(step)
            if due.log:
                # --- ZERO: sum the ranks' parts of the loss (one all-reduce for all pending steps), so
                # rank 0 reports the global-batch loss, not its own slice's.
                log.flush(due.done, reduce=all_reduce_sum)
            if due.eval:
                started = log.eval_starts()
                # --- ZERO: each rank scores its shard of the test set; sums are all-reduced. Each
                # rank's BatchNorm statistics came from its own slice: use rank 0's everywhere, the
                # ones the saved model has. Stage 3: parameters gathered whole for the evaluation
                # (shards differ in batch count, so forwards through the partitioned module, which
                # gather collectively, would not pair up across ranks).
                for buffer in engine.module.buffers():
                    dist.broadcast(buffer, src=0)
                batches = eval_batches(test_set, rank=rank, world_size=world_size)
                with deepspeed_gathered(engine.module.parameters(), stage):
                    totals = evaluate(engine.module, batches, device, cfg)
                dist.all_reduce(totals)
                log.evaluated(due.done, totals, started)
            if due.checkpoint:  # --- ZERO: every rank writes its partitions, rank 0 the index
                save_zero_checkpoint(engine, cfg, due.done, n_steps, record, world_size, is_main)

    # --- ZERO: the full fp32 state_dict of the core model, assembled from the partitions (keys identical
    # for every impl); every rank takes part (stage 3 gathers), rank 0 writes.
    if cfg.save_final:
        final = full_fp32_state_dict(engine, stage)
        if is_main:
            save_checkpoint(cfg.save_final, final)
    # --- ZERO: every rank's memory and model states (its partitions), beside the formulas', and what its
    # counted step communicated beside the formula's (distref.cost.zero), gathered to rank 0
    usage = model_usage(cfg.model, info, cfg.gpt_layers, cfg.moe)  # which parameters train: a forward on meta
    zero = deepspeed_config(cfg, world_size)["zero_optimization"]  # its bucket sizes, in elements
    predicted = zero_rank_cost(
        parameters_of(model.named_parameters(), usage),  # (stage 3: their whole shapes)
        world_size,
        rank,
        stage,
        bucket_elements=zero["reduce_bucket_size"],
        prefetch_elements=zero.get("stage3_prefetch_bucket_size", 0),
        grad_accum=cfg.grad_accum,
        precision=cfg.precision,
        offload=cfg.strategy.offload_optimizer or cfg.strategy.offload_params,
        optimizer=cfg.optimizer,
        step_bytes=torch.get_default_dtype().itemsize,
        unknown=usage.unknown,
        # --- ZERO: bf16/fp16 parameters compute in 16 bits, as DeepSpeed casts the module
        activations=predicted_for_run(
            cfg, info, world_size, device.type, parameters=parameters_in(compute_dtype, autocast=False)
        ),
    )
    finish_record(record, cfg.global_batch_size, state_bytes, world_size, predicted)  # --- ZERO: to rank 0
    if is_main:
        print_summary(record.data)
    return record.data


# ---- The command line: the core options (distref.cli) and ZeRO's own -----------------------------
# --- ZERO: its options, parsed once into ZeroOptions (cfg.strategy) ---
def add_options(parser: argparse.ArgumentParser) -> None:
    add_options_for(ZeroFlags)(parser)  # ZeroFlags' fields, each its --option
    # By hand: `option` would name it --local-rank (dashes), and the `deepspeed` launcher passes
    # --local_rank (hidden: torchrun's LOCAL_RANK is what is used).
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)


def bucket_elements(megabytes: float) -> int:
    """--bucket-mb as DeepSpeed takes it: a number of (4-byte) elements, rounded down."""
    return int(megabytes * 2**20 / 4)


def bucket_problem(megabytes: float, stage: int) -> str | None:
    """Why DeepSpeed 0.19 would refuse --bucket-mb at this stage (on every rank, in a traceback), or None:
    its config takes at least one element, and stages 1 and 2 an even number (stage_1_and_2.py asserts
    allgather_bucket_size % 2 == 0). Names the nearest sizes it takes."""
    elements = bucket_elements(megabytes)
    if stage in (1, 2) and (elements < 2 or elements % 2):
        need = "an even number (its buckets align to 2 elements)"
        nearest = [2] if elements < 2 else [elements - 1, elements + 1]
    elif elements < 1:
        need, nearest = "at least 1", [1]
    else:
        return None
    suggested = " or ".join(f"{shortest_megabytes(n)} ({n:,})" for n in nearest)
    plural = "" if elements == 1 else "s"
    return (
        f"--bucket-mb {megabytes:g} is {elements:,} element{plural} of 4 bytes; DeepSpeed 0.19 at ZeRO stage "
        f"{stage} takes {need}: use e.g. --bucket-mb {suggested}"
    )


def shortest_megabytes(elements: int) -> str:
    """The --bucket-mb with the fewest decimals that gives `elements` elements."""
    for decimals in range(1, 20):
        text = f"{math.ceil(elements * 4 / 2**20 * 10**decimals) / 10**decimals:.{decimals}f}"
        if bucket_elements(float(text)) == elements:
            return text
    return repr(elements * 4 / 2**20)


def check_options(cfg: RunConfig, world_size: int) -> str | None:
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed: pip install deepspeed==0.19.8 -c <the constraints file pinning torch>"
    stage = cfg.strategy.zero_stage
    if stage not in (0, 1, 2, 3):
        return f"--zero-stage {stage}: ZeRO has stages 0, 1, 2 and 3"
    if cfg.strategy.offload_params and stage != 3:
        return f"--offload-params needs --zero-stage 3 (only stage 3 partitions parameters; got {stage})"
    if problem := bucket_problem(cfg.strategy.bucket_mb, stage):
        return problem
    if cfg.strategy.offload_optimizer and stage == 0:
        return "--offload-optimizer needs --zero-stage 1, 2 or 3 (stage 0 has no optimizer partition)"
    if cfg.precision == "fp64":
        # Measured with 0.19.8: stage 0's gradient all-reduce asserts "unsupported grad type:
        # torch.float64"; stages 1-3 run, but their optimizer steps on fp32 master copies, i.e. not fp64.
        return "--precision fp64: DeepSpeed 0.19 trains in fp32, bf16 or fp16 only (fp32 master weights)"
    if cfg.precision == "bf16" and stage == 0:
        # DeepSpeed 0.19 runs bf16 at stage 0 through its fp16-style path, without fp32 master weights
        # (updates rounded to bf16), unlike stages 1-3: refused rather than a less accurate model silently.
        return "--precision bf16 needs --zero-stage 1, 2 or 3 (stage 0 keeps no fp32 master weights)"
    return batch_norm_in_16_bits_problem(cfg, "DeepSpeed's bf16 module")


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
        strategy_options=ZeroOptions,
    )


# --- end ZERO options ---


if __name__ == "__main__":
    with destroy_process_group_on_exit(IMPL):  # --- ZERO: explicit teardown (stage 2 aborted without)
        main()
    exit_without_interpreter_teardown()  # --- ZERO: gloo threads vs Python's shutdown (distref/distributed)
