"""Expert parallelism: gpt as a mixture of experts (--experts E), its experts spread over the ranks, each
token sent to the ranks holding its experts by all-to-all and its outputs brought back the same way; the
rest of the model data parallel (DDP) over the same ranks.

Every rank runs this file, started by torchrun or by `python train.py`, which checks the arguments and
then starts the ranks through torch's own launcher (torch.distributed.run). Each rank takes its own slice of
the global batch, as in DDP. In every MoE layer (distref.models.MoE) the router runs on the rank's own
tokens, and then (GShard, Lepikhin et al. 2020; torchtitan, Megatron-Core, DeepSpeed-MoE):

  1. the ranks exchange how many tokens each sends to each expert (an all-to-all of E counts),
  2. each token goes to the ranks holding its k experts (an all-to-all of the tokens, variable sizes),
  3. each rank runs its E/ep experts on the tokens every rank sent them,
  4. the outputs go back to the tokens' ranks (the reverse all-to-all), weighed there by the router.

Backward mirrors it: the two all-to-alls' gradients travel the other way. Dropless: every token reaches
its experts whatever the routing, so the step computes what single computes on the whole batch.

Gradients. Each rank's loss is its tokens' loss sum ÷ the global batch's scored targets, so the global
batch's gradient is the *sum* of the ranks' parts. The non-expert parameters (embeddings, attention,
layer norms, routers, head) are replicated: DDP all-reduces them as a sum. An expert's parameters live on
one rank of each expert-parallel group, and backward's all-to-all already brings it the gradient of every
token of that group sent to it: nothing to all-reduce, and nothing to divide by the world size (an
average would shrink the experts' gradients by it). With `--ep` smaller than the world, world/ep groups
each hold every expert: each copy's gradient is its group's tokens' part, all-reduced (summed) over the
copies. The load-balancing loss is each sequence's own term over the global batch (distref.models.MoE):
it needs no communication either.

    python impls/expert_parallel/train.py --nproc-per-node 2 --model gpt --dataset synthetic --experts 4
    python impls/expert_parallel/train.py --nproc-per-node 4 --ep 2 --experts 4 --top-k 1 --model gpt --dataset synthetic

Changes against impls/single/train.py are marked `# --- EP: ... ---`.
"""

import contextlib
import dataclasses
import functools

import torch
import torch.distributed as dist  # --- EP ---
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

from distref import impl_version
from distref.cli import add_options_for, exit_on_bad_input, option, parse_config
from distref.config import RunConfig, positive_int, under_torchrun
from distref.cost.expert_parallel import expert_parallel_run_cost, is_expert_parameter
from distref.cost.usage import model_usage
from distref.data import load_dataset, scored_targets, steps_per_epoch, train_loader
from distref.distributed import (
    all_reduce_sum,
    check_ranks_agree,
    destroy_process_group_on_exit,
    evaluate_gathered,
    exit_without_interpreter_teardown,
    finish_record,
    launch_ranks,
    start_process_group,
)
from distref.models import MoE, build_model, plain_copy
from distref.record import RunRecord, print_summary
from distref.training.bookkeeping import Cadence, StepLog
from distref.training.checkpoint import (
    checkpoint_path,
    checkpoint_state,
    full_state_dict,
    load_checkpoint,
    load_sharded_checkpoint,
    resume_path,
    resume_step,
    save_checkpoint,
    save_sharded_checkpoint,
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
from distref.training.traffic import TRAFFIC

IMPL = "expert_parallel"
VERSION = impl_version(__file__)


# --- EP: the strategy ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EPOptions:
    """Expert parallelism's own options (cfg.strategy), each declared with its command-line option."""

    ep: int | None = option(
        "expert-parallel degree: ranks that share out the experts, E/ep each (default: the world). Smaller "
        "than the world: world/ep groups each hold every expert, the copies' gradients all-reduced",
        metavar="N",
        type=positive_int,
    )


BUCKET_CAP_MB = 25.0  # DDP's buckets for the non-expert gradients (its default, given explicitly)


def make_mesh(world_size: int, ep: int, device: torch.device) -> DeviceMesh:
    """2-D mesh (ep_replicate, ep): ranks 0..ep-1 hold one copy of the experts, ep..2ep-1 the next, and so
    on. The all-to-alls run in every MoE layer, forward and backward: the expert-parallel group gets the
    neighbouring ranks (on a cluster, one node's fast links)."""
    return init_device_mesh(device.type, (world_size // ep, ep), mesh_dim_names=("ep_replicate", "ep"))


class RoutedRows:
    """What each MoE layer's all-to-alls carried on this rank in the step whose communication is counted
    (`recording` while it runs): (rows sent, rows received) per layer call, for the cost formula
    (distref.cost.expert_parallel); no other step's, so nothing grows with the run. A recomputed forward
    (activation checkpointing) is not a routing of its own: not listed."""

    def __init__(self) -> None:
        self.recording = False
        self.rows: list[tuple[int, int]] = []

    def add(self, sent: int, received: int) -> None:
        if self.recording and torch._C._current_graph_task_id() == -1:  # (-1: not in a backward)
            self.rows.append((sent, received))


def all_to_all_experts(
    tokens: torch.Tensor,
    counts: list[int],
    *,
    experts: nn.Module,
    group: dist.ProcessGroup,
    routed: RoutedRows | None = None,
) -> torch.Tensor:
    """MoE.run_experts over the expert-parallel `group`: `tokens` grouped by expert (`counts[e]` for
    expert e, of all E) go to the rank holding their expert (rank i of the group holds experts i·E/ep to
    (i+1)·E/ep − 1: the shard of `experts` it holds), which runs them and sends the outputs back, in the
    order they came. funcol's autograd all-to-all sends the gradients back the same way in backward."""
    ep = group.size()
    local_experts = len(counts) // ep
    send = torch.tensor(counts, device=tokens.device)
    # 1. Every rank learns how many tokens each rank sends to each of its experts (row r: rank r's)
    received = funcol.all_to_all_single(send, None, None, group).view(ep, local_experts).tolist()
    send_sizes = [sum(counts[i * local_experts : (i + 1) * local_experts]) for i in range(ep)]  # to rank i
    receive_sizes = [sum(row) for row in received]
    if routed is not None:
        routed.add(tokens.shape[0], sum(receive_sizes))
    # 2. The tokens to their experts' ranks: from each rank, grouped by its expert there
    arrived = funcol.all_to_all_single_autograd(tokens, receive_sizes, send_sizes, group)
    arrived = funcol.wait_tensor(arrived)
    pieces = arrived.split([n for row in received for n in row])  # (rank r, expert j), rank-major
    by_expert = [pieces[r * local_experts + j] for j in range(local_experts) for r in range(ep)]
    # 3. Each local expert on every token sent to it (from every rank, in rank order)
    per_expert = [sum(received[r][j] for r in range(ep)) for j in range(local_experts)]
    outputs = experts(torch.cat(by_expert), per_expert)
    outputs = outputs.split([received[r][j] for j in range(local_experts) for r in range(ep)])
    # 4. Back in (rank, expert) order, and back to the ranks the tokens came from
    back = torch.cat([outputs[j * ep + r] for r in range(ep) for j in range(local_experts)])
    returned = funcol.all_to_all_single_autograd(back, send_sizes, receive_sizes, group)
    return funcol.wait_tensor(returned)


def apply_ep(model: nn.Module, mesh: DeviceMesh, *, routed: RoutedRows | None = None) -> nn.Module:
    """Each MoE layer's experts sharded over the mesh's "ep" dimension (DTensors: rank i of a group keeps
    experts i·E/ep.., every group a copy, "ep_replicate"), and its run_experts the all-to-all dispatch
    (`all_to_all_experts`). Every rank built the same parameters (same seed): each keeps its shard, with no
    communication."""
    ep_rank, ep = mesh["ep"].get_local_rank(), mesh["ep"].size()
    for module in model.modules():
        if isinstance(module, MoE):
            experts = module.experts
            for name, parameter in list(experts.named_parameters(recurse=False)):
                rows = parameter.shape[0] // ep  # (this rank's experts: rows ep_rank·E/ep ...)
                mine = parameter.data[ep_rank * rows : (ep_rank + 1) * rows].clone()
                shard = DTensor.from_local(mine, mesh, [Replicate(), Shard(0)], run_check=False)
                experts.register_parameter(name, nn.Parameter(shard))
            if mesh["ep"].size() > 1:  # (one rank holding every expert: they run where the tokens are)
                module.run_experts = functools.partial(
                    all_to_all_experts, experts=experts, group=mesh["ep"].get_group(), routed=routed
                )
    return model


def apply_ddp(model: nn.Module, device: torch.device) -> DDP:
    """DDP over every rank for the non-expert parameters (the experts are each on their own ranks: DDP is
    told to leave them out), their gradients all-reduced as a sum (`summing_hook`)."""
    DDP._set_params_and_buffers_to_ignore_for_model(
        model, [name for name, _ in model.named_parameters() if is_expert_parameter(name)]
    )
    ddp_model = DDP(
        model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=BUCKET_CAP_MB
    )
    ddp_model.register_comm_hook(None, summing_hook)
    return ddp_model


def summing_hook(_, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce a bucket of gradients as a sum over the ranks (DDP's own hook averages: ÷ world), in
    place: the future gives the bucket back (not the work's result, which torch's fake process group
    leaves empty: distref.simulate runs this hook, as impls/ddp's)."""
    buffer = bucket.buffer()
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda _: buffer)


def all_reduce_expert_gradients(model: nn.Module, mesh: DeviceMesh) -> None:
    """With world/ep copies of every expert, each copy's gradient is its group's tokens' part: sum them
    over the copies (the "ep_replicate" dimension). One copy (ep = world): nothing to do."""
    replicas = mesh["ep_replicate"]
    if replicas.size() == 1:
        return
    for name, parameter in model.named_parameters():
        if is_expert_parameter(name) and parameter.grad is not None:
            dist.all_reduce(parameter.grad.to_local(), group=replicas.get_group())


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    device: torch.device,
    *,
    compile: bool = False,
    routed: RoutedRows | None = None,
) -> DDP:
    """Experts over the expert-parallel ranks, then DDP over every rank for the rest (torchtitan's
    `parallelize_*`: apply_ep, [compile,] apply_ddp)."""
    model = apply_ep(model, mesh, routed=routed)
    if compile:
        compile_blocks(model)
    return apply_ddp(model, device)


# --- end EP strategy ---


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_options(argv)
    # --- EP: one process per device, started here from plain python (as ddp does) once the arguments
    # are checked; under torchrun each rank arrives here directly
    if not under_torchrun():
        launch_ranks(__file__, argv, cfg, IMPL)
    configure_cpu_threads()
    rank, world_size, device, backend = start_process_group(cfg)  # --- EP: one device per rank, a group
    ep = cfg.strategy.ep or world_size
    mesh = make_mesh(world_size, ep, device)
    is_main = rank == 0  # rank 0 alone writes the record, the checkpoint index and the final state_dict
    # --- end EP ---

    # ---- Data and model: the same in every impl -------------------------------------------------
    with exit_on_bad_input(IMPL):  # a dataset that fails its md5: one line, exit 2
        train_set, test_set, info = load_dataset(cfg)
    seed_everything(cfg.seed)  # before building: every impl starts from the same parameters
    model = build_model(cfg.model, info, cfg.gpt_layers, param_dtype(cfg), cfg.moe)
    # --- EP: a plain copy of the model, on the CPU, scores the gathered parameters (evaluation; copied
    # before the model moves to the device: one build per process, and no second model on the GPU)
    eval_model = plain_copy(
        model, lambda: build_model(cfg.model, info, cfg.gpt_layers, param_dtype(cfg), cfg.moe)
    )
    model = model.to(device)
    # --- EP: every rank read the data and built the model itself: they must agree (one all-gather)
    with exit_on_bad_input(IMPL, say=is_main):
        check_ranks_agree(cfg, train_set, test_set, model)
    model.activation_checkpointing = cfg.activation_checkpointing
    # --- EP: experts over the expert-parallel ranks, the rest DDP over every rank
    routed = RoutedRows()
    model = parallelize(model, mesh, device, compile=cfg.compile, routed=routed)
    optimizer = make_optimizer(cfg, model.parameters())  # (an expert's state where its shard is)
    scaler = make_grad_scaler(cfg, device)
    n_steps = total_steps(cfg, len(train_set))
    cadence = Cadence(cfg, n_steps, steps_per_epoch(len(train_set), cfg.global_batch_size))
    record = RunRecord(
        IMPL, VERSION, cfg, world_size=world_size, device=device, backend=backend, write_files=is_main
    )  # --- EP: every rank keeps the numbers, rank 0 writes them
    record.add_strategy_facts(mesh={"ep_replicate": world_size // ep, "ep": ep})  # --- EP

    # ---- Resume: model, optimizer, scaler, RNG, record; the data order and lr follow the step ---
    start_step = 0
    if (path := resume_path(cfg)) is not None:
        # --- EP: the index (step-N.pt: step, record, options, RNG, file hashes) names a complete sharded
        # checkpoint, the folder step-N/ beside it (torch.distributed.checkpoint), whose hashes are checked
        # before DCP reads it. DCP reshards on load: any world size and --ep loads any other.
        with exit_on_bad_input(IMPL, say=is_main):  # --- EP: every rank finds it; rank 0 says it, once
            state = load_checkpoint(path, cfg, n_steps, holds=("folder", "sha256", "scaler"))
            load_sharded_checkpoint(model, optimizer, path, state)  # this rank's shards, in place
        scaler.load_state_dict(state["scaler"])
        start_step = resume_step(state, path, record, IMPL, say=is_main)  # --- EP: said once

    # The lr is a function of the step: built after a resume, it continues where the run left off.
    scheduler = make_lr_schedule(cfg, optimizer, n_steps, start_step)
    # --- EP: this rank's slice of every global batch (same order as single, any world size) ---
    micro_batches = train_loader(train_set, cfg, start_step, n_steps, rank, world_size, device=device)
    log = StepLog(
        record,
        cfg,
        IMPL,
        cadence,
        start_step,
        show=is_main,
        desc=f"{IMPL} ×{world_size} ep {ep}",
        device=device,
    )
    state_bytes = None  # model-state bytes, measured once gradients and optimizer state both exist

    record.start_training()  # start-up (imports, data, model, set-up) ends: the run's clock starts
    with log, profiler(cfg, rank=rank) as prof:  # --- EP: one trace per rank
        for step in range(start_step, n_steps):
            started = log.step_starts(step)
            routed.recording = step == TRAFFIC.counted_step  # --- EP: its all-to-all sizes, for the formula
            # This step's random numbers (dropout): a function of (seed, step), so a resumed run draws
            # what an uninterrupted one does. (Each impl says which stream each of its ranks draws.)
            seed_step(cfg.seed, step, stream=rank, devices=[device])  # --- EP: each rank its own stream
            # The step's loss is the mean over every scored target of the whole global batch: each
            # micro-batch adds its loss *sum* over this count. (The mean of the micro-batches' own means
            # would weigh a micro-batch scoring 3 targets as much as one scoring 60: padding, prompts.)
            scored = scored_targets(train_set, cfg, step)  # --- EP: of the whole batch, not this rank's
            step_loss = None
            for micro_step in range(cfg.grad_accum):
                x, y = next(micro_batches)  # on the device already, the next one on its way
                # --- EP: DDP all-reduces the non-expert gradients only in the last micro-step's backward
                last_micro_step = micro_step == cfg.grad_accum - 1
                with contextlib.nullcontext() if last_micro_step else model.no_sync():
                    with autocast(cfg, device):
                        loss = loss_sum(model(x), y) / scored
                    # The micro-batches' gradients add up to the global batch's, as one big batch gives.
                    # --- EP: and so do the ranks': DDP sums the non-expert parts, the all-to-all's
                    # backward brings each expert its tokens' parts from every rank of its group
                    scaler.scale(loss).backward()
                step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()  # (K=1: no add)
            all_reduce_expert_gradients(model.module, mesh)  # --- EP: sum the experts' copies (--ep < world)
            scale = scaler.get_scale()  # fp16: a host sync, as scaler.step() makes anyway; else 1.0
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() < scale:  # inf/nan gradients: the update was skipped, the scale lowered
                record.add_skipped_step(step)
            scheduler.step()
            if state_bytes is None:  # --- EP: this rank's experts (DTensors' local parts) and the rest
                state_bytes = model_state_bytes(model.parameters(), optimizer)
            optimizer.zero_grad(set_to_none=True)
            log.step_done(step_loss, started)  # (no wait for the GPU: the step is timed by events)
            prof.step()

            due = cadence.after(step)
            if due.log:
                # --- EP: sum every rank's part of the loss and of the routing (one all-reduce for all
                # pending steps): the global batch's mean, and its tokens per expert
                log.flush(due.done, reduce=all_reduce_sum)
            if due.eval:
                started = log.eval_starts()
                # --- EP: each rank scores its shard of the test set with a plain copy of the gathered
                # model (evaluate_gathered: the experts' forward is collectives, and shards may differ in
                # batch count); the sums are all-reduced into global numbers.
                totals = evaluate_gathered(model, eval_model, test_set, device, cfg)
                log.evaluated(due.done, totals, started)
            if due.checkpoint:  # --- EP: every rank writes its shards in step-N/ (DCP), rank 0 the index
                index = checkpoint_path(cfg.checkpoint_dir, due.done)  # step-N.pt, written by rank 0
                state = checkpoint_state(cfg, due.done, n_steps, record, scaler=scaler.state_dict())
                save_sharded_checkpoint(model, optimizer, index, state, is_main)

    # --- EP: the core model's full state_dict, the experts gathered from their ranks; rank 0 writes it
    if cfg.save_final:
        final = full_state_dict(model)
        if is_main:
            save_checkpoint(cfg.save_final, final)
    # --- EP: every rank's memory and model states (its experts and a replica of the rest), and what its
    # counted step communicated, beside the formulas' (distref.cost.expert_parallel): the all-to-alls'
    # sizes are the counted step's routing
    usage = model_usage(cfg.model, info, cfg.gpt_layers, cfg.moe)  # which parameters train: a forward on meta
    predicted = expert_parallel_run_cost(
        cfg,
        info,
        usage,
        world_size=world_size,
        ep=ep,
        routed=routed.rows,
        bucket_cap_mb=BUCKET_CAP_MB,
        device=device.type,
    )
    finish_record(record, cfg.global_batch_size, state_bytes, world_size, predicted)  # --- EP: to rank 0
    if is_main:
        print_summary(record.data)
    return record.data


# ---- The command line: the core options (distref.cli) and expert parallelism's own ----------------
# --- EP: its options (EPOptions, declared with the strategy), parsed once into cfg.strategy ---
add_options = add_options_for(EPOptions)  # EPOptions' fields, each its --option


def check_options(cfg: RunConfig, world_size: int) -> str | None:
    ep = cfg.strategy.ep or world_size
    if world_size % ep:
        return f"--ep {ep} must divide the {world_size} ranks (world/ep groups, each holding every expert)"
    if not cfg.experts:
        return "expert parallelism spreads gpt's experts over the ranks: give --experts E (and --model gpt)"
    if cfg.experts % ep:
        return f"--experts {cfg.experts} must divide by --ep {ep}: each rank of a group holds E/ep experts"
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
        strategy_options=EPOptions,
        trains_experts=True,  # --- EP
    )


# --- end EP options ---


if __name__ == "__main__":
    with destroy_process_group_on_exit(IMPL):  # --- EP: clean teardown on every exit path
        main()
    exit_without_interpreter_teardown()  # --- EP: gloo threads vs Python's shutdown (distref/distributed)
