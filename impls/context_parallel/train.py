"""Context parallelism: every sequence split over ranks, each holding a slice of its tokens (their
positions, embeddings and every activation), attention meeting the other slices by ring attention or
Ulysses; optionally 2-D with data-parallel groups (`--dp-shard D --cp C`).

Every rank runs this file, started by torchrun or by `python train.py`, which checks the arguments and
then starts the ranks through torch's own launcher (torch.distributed.run). The C ranks of a
context-parallel group read the same batch and keep 1/C of each sequence: every layer but attention works
on a token alone (embeddings, layer norms, MLP, head, loss), so it runs on the slice unchanged, and a
rank's activations are 1/C of the sequence's. Attention needs every earlier token:

  - ring (`--cp-mode ring`, Liu et al., arXiv 2310.01889): the key/value blocks travel around the ring of
    C ranks in C − 1 hops, each rank meeting one block per hop while the next is on its way, and the
    partial results are merged by their log-sum-exp (the online softmax). The causal split is load
    balanced: the sequence is cut into 2C chunks and rank i holds chunks i and 2C − 1 − i (torchtitan,
    Megatron-Core), so every rank does the same work at every hop. Backward sends the blocks around
    again, each block's key/value gradients travelling with it back home.
  - Ulysses (`--cp-mode ulysses`, Jacobs et al., arXiv 2309.14509): an all-to-all turns the q, k, v of
    "all heads, 1/C of the tokens" into "1/C of the heads, all the tokens"; each rank runs ordinary causal
    attention over its heads, and a second all-to-all turns the output back (heads must divide by C).

The parameters are the same on every rank of a group, each rank's gradients its slice's part: FSDP2
shards them over every rank, data-parallel groups and context-parallel ranks alike, and its
reduce-scatter sums the parts (torchtitan's order: the dp_shard × cp mesh flattened for FSDP).

    python impls/context_parallel/train.py --nproc-per-node 2 --model gpt --dataset synthetic --sequence-length 256
    python impls/context_parallel/train.py --nproc-per-node 4 --cp-mode ulysses --model gpt --dataset synthetic
    python impls/context_parallel/train.py --nproc-per-node 4 --dp-shard 2 --cp 2 --model gpt --dataset text --data-root input.txt

Changes against impls/single/train.py are marked `# --- CP: ... ---`.
"""

import dataclasses
import functools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from distref import impl_version
from distref.cli import add_options_for, exit_on_bad_input, option, parse_config
from distref.config import GPT_MODELS, RunConfig, positive_int, under_torchrun
from distref.cost.context_parallel import context_parallel_run_cost
from distref.data import load_dataset, scored_targets, sequence_length, steps_per_epoch, train_loader
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
from distref.distributed.partition import MODEL_DATASETS
from distref.models import build_model, causal_attention, gpt_config, plain_copy
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
from distref.training.measure import model_state_bytes, record_held_shapes
from distref.training.monitor import profiler
from distref.training.optim import make_grad_scaler, make_lr_schedule, make_optimizer, total_steps
from distref.training.steps import loss_sum

IMPL = "context_parallel"
VERSION = impl_version(__file__)


# --- CP: the strategy ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CPOptions:
    """Context parallelism's own options (cfg.strategy), each declared with its command-line option."""

    cp: int | None = option(
        "context-parallel degree: ranks that split every sequence, each holding 1/C of its tokens "
        "(default: world / --dp-shard, i.e. every rank)",
        metavar="C",
        type=positive_int,
    )
    dp_shard: int | None = option(
        "data-parallel groups of --cp ranks, each on its slice of the global batch (default: world / --cp)",
        metavar="D",
        type=positive_int,
    )
    cp_mode: str = option(
        "how attention meets the other ranks' tokens: ring (key/value blocks passed around the ranks, "
        "merged by log-sum-exp; the sequence split into 2C chunks, load balanced) or ulysses (all-to-all "
        "to whole sequences of 1/C of the heads and back; the heads must divide by C)",
        choices=("ring", "ulysses"),
        default="ring",
    )


def mesh_shape(options: CPOptions, world_size: int) -> tuple[int, int]:
    """(data-parallel groups, context-parallel degree): as given, the one not given filling the world;
    neither given: every rank in one context-parallel group."""
    dp, cp = options.dp_shard, options.cp
    if cp is None:
        dp = dp or 1
        return dp, max(1, world_size // dp)
    return dp or max(1, world_size // cp), cp


def make_mesh(dp: int, cp: int, device: torch.device) -> DeviceMesh:
    """2-D mesh (dp_shard, cp): ranks 0..C-1 split the first group's sequences, C..2C-1 the second's, and
    so on. Context parallelism communicates in every layer (a ring hop or an all-to-all per attention):
    its group gets the neighbouring ranks (on a cluster, one node's fast links)."""
    return init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp_shard", "cp"))


def slice_positions(sequence: int, cp: int, cp_rank: int, load_balanced: bool) -> torch.Tensor:
    """Which positions of every sequence rank `cp_rank` of `cp` holds. Load balanced (ring attention): of
    2C chunks, chunk i and chunk 2C − 1 − i. A causal query meets only earlier keys, so contiguous slices
    would leave rank 0 one block of work per sequence and rank C − 1 C blocks; with the chunks paired,
    every rank meets the same number of keys. Else (Ulysses, which gathers whole sequences before
    attention): the i-th contiguous 1/C."""
    if cp == 1:  # (whole sequences, any length)
        return torch.arange(sequence)
    if not load_balanced:
        part = sequence // cp
        return torch.arange(cp_rank * part, (cp_rank + 1) * part)
    chunk = sequence // (2 * cp)
    mirrored = 2 * cp - 1 - cp_rank
    return torch.cat(
        [
            torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
            torch.arange(mirrored * chunk, (mirrored + 1) * chunk),
        ]
    )


def scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """q·kᵀ/√d; `causal` (q and k the same positions): a key after its query −∞ (softmax gives it 0)."""
    logits = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal:
        logits = logits.masked_fill(torch.ones_like(logits, dtype=torch.bool).triu(1), float("-inf"))
    return logits


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries q over these keys alone: softmax(q·kᵀ/√d)·v, and each query's log-sum-exp of
    its scores (the log of the softmax's denominator), which `merge` needs. `causal`: q and k are the same
    positions (a key after its query masked). The definition, in plain operations: `block_attention`
    runs it as a fused kernel where torch has one that returns the log-sum-exp."""
    logits = scores(q, k, causal)
    lse = torch.logsumexp(logits, dim=-1)
    return torch.exp(logits - lse.unsqueeze(-1)) @ v, lse


def attend_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k and v through one key block (flash attention's backward): its softmax
    probabilities recomputed from the scores and the whole row's log-sum-exp (`lse`, over every block),
    and each query's grad_out·out, with `out` the whole row's result (the softmax's own backward term)."""
    scale = q.shape[-1] ** -0.5
    probabilities = torch.exp(scores(q, k, causal) - lse.unsqueeze(-1))
    grad_v = probabilities.transpose(-2, -1) @ grad_out
    dot = (grad_out * out).sum(-1, keepdim=True)
    grad_scores = probabilities * (grad_out @ v.transpose(-2, -1) - dot)
    return grad_scores @ k * scale, grad_scores.transpose(-2, -1) @ q * scale, grad_v


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, exact: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend`, in at least fp32 (`exact`: 16-bit inputs widened first, so that each block's result
    is merged unrounded). On the CPU, torch's fused kernel, the one F.scaled_dot_product_attention runs
    there, which also returns the log-sum-exp and never holds a block's scores whole; elsewhere the plain
    operations, which hold a block's scores and their exponentials: b·heads·n² elements each at hop 0,
    half that at the others (n = s/C, a rank's tokens)."""
    q, k, v = (t.to(exact) for t in (q, k, v))
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return attend(q, k, v, causal)


def block_attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    exact: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`attend_backward`, in `exact` (16-bit inputs widened first): on the CPU the fused kernel's backward,
    given the whole rows' result and log-sum-exp (as SDPA's backward is given its own)."""
    q, k, v, grad_out, out = (t.to(exact) for t in (q, k, v, grad_out, out))
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse.contiguous(), 0.0, causal
        )
    return attend_backward(q, k, v, grad_out, out, lse, causal)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one key block's attention into the running result, in place (the online softmax). Over keys
    A and B, softmax(s)·v = (e^{lse_A}·out_A + e^{lse_B}·out_B) / (e^{lse_A} + e^{lse_B}): each partial
    result is its own softmax, weighted by its share of the whole denominator, e^{lse_X − lse}, with
    lse = log(e^{lse_A} + e^{lse_B}). Exact in real numbers, whatever the order of the blocks; in floating
    point it sums in another order than one softmax over every key (fp32: ~1e-7 relative)."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1)).add_(
        block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)
    )
    lse.copy_(new_lse)


def pass_on(tensor: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, list]:
    """Send `tensor` to the next rank of the ring and receive the previous rank's in its place: started,
    not waited for (the caller computes meanwhile). (The received tensor, the requests to wait on.)"""
    rank, size = group.rank(), group.size()
    received = torch.empty_like(tensor)
    requests = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + 1) % size), group),
            dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - 1) % size), group),
        ]
    )
    return received, requests


def arrived(received: torch.Tensor, requests: list) -> torch.Tensor:
    for request in requests:
        request.wait()
    return received


def ring_block(rank: int, source: int, chunk: int) -> tuple[slice, slice, bool]:
    """Which of this rank's queries meet which of the keys it holds from rank `source`, under the load
    balanced split (chunks rank, 2C − 1 − rank): (query rows, key rows, causal). Its own keys: all of
    them, causally. An earlier rank's: its first chunk precedes both of ours, its second follows both.
    A later rank's: both of its chunks precede our second chunk and follow our first. Half the work of a
    whole block at every hop, on every rank."""
    everything = slice(None)
    if source == rank:
        return everything, everything, True
    if source < rank:
        return everything, slice(0, chunk), False
    return slice(chunk, None), everything, False


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over every rank's keys, the key/value blocks passed around
    the ring of the context-parallel group. q, k, v: (B, heads, 2·chunk, head_dim), this rank's chunks."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        rank, size = group.rank(), group.size()
        chunk = q.shape[-2] // 2
        exact = torch.promote_types(q.dtype, torch.float32)  # the merge at least in fp32
        with torch.autocast(q.device.type, enabled=False):
            key_values = torch.stack([k, v])  # one message per hop; sent as computed (bf16: 2 bytes)
            # laid out (B, tokens, heads, head_dim), as SDPA's output is: the output projection's input
            # is then a view of it, not a copy
            out = q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=exact).transpose(1, 2)
            lse = q.new_empty(q.shape[:-1], dtype=exact)
            for hop in range(size):
                if hop < size - 1:  # the next block is on its way while this one is computed
                    incoming = pass_on(key_values, group)
                rows, keys, causal = ring_block(rank, (rank - hop) % size, chunk)
                k_block, v_block = key_values[:, :, :, keys]
                block_out, block_lse = block_attention(q[:, :, rows], k_block, v_block, causal, exact)
                if hop == 0:  # our own keys: every query has its first partial result
                    out.copy_(block_out)
                    lse.copy_(block_lse)
                else:
                    merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
                if hop < size - 1:
                    key_values = arrived(*incoming)
            out = out.to(q.dtype)
        ctx.group = group
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        rank, size = group.rank(), group.size()
        chunk = q.shape[-2] // 2
        exact = lse.dtype
        with torch.autocast(q.device.type, enabled=False):
            grad_q = torch.zeros(q.shape, dtype=exact, device=q.device)
            key_values = torch.stack([k, v])
            travelling = None  # the key/value gradients on their way from the previous rank
            for hop in range(size):
                if hop < size - 1:
                    incoming = pass_on(key_values, group)
                rows, keys, causal = ring_block(rank, (rank - hop) % size, chunk)
                k_block, v_block = key_values[:, :, :, keys]
                block_q, block_k, block_v = block_attention_backward(
                    q[:, :, rows],
                    k_block,
                    v_block,
                    grad_out[:, :, rows],
                    out[:, :, rows],
                    lse[:, :, rows],
                    causal,
                    exact,
                )
                grad_q[:, :, rows] += block_q
                # this block's key/value gradients from our queries, added to what the ranks it visited
                # before us sent along with it; then passed on with it (in fp32 at least: C terms)
                grad_key_values = torch.zeros(2, *k.shape, dtype=exact, device=k.device)
                grad_key_values[0][:, :, keys] = block_k
                grad_key_values[1][:, :, keys] = block_v
                if travelling is not None:
                    grad_key_values += arrived(*travelling)
                if hop < size - 1:
                    key_values = arrived(*incoming)
                if size > 1:  # after the last hop, this pass takes each block's gradients home
                    travelling = pass_on(grad_key_values, group)
            if size > 1:
                grad_key_values = arrived(*travelling)
        return grad_q.to(q.dtype), grad_key_values[0].to(k.dtype), grad_key_values[1].to(v.dtype), None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    return RingAttention.apply(q, k, v, group)


def sequence_to_heads(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, heads, tokens/C, d) → (B, heads/C, tokens, d): heads i·H/C.. go to rank i, which receives every
    rank's tokens of them, in rank order (contiguous slices: the whole sequence in order)."""
    B, H, n, d = t.shape
    size = group.size()
    send = t.reshape(B, size, H // size, n, d).transpose(0, 1).contiguous()  # (C, B, H/C, n, d)
    received = funcol.all_to_all_single_autograd(send, None, None, group)  # from rank i: its tokens
    return received.permute(1, 2, 0, 3, 4).reshape(B, H // size, size * n, d)


def heads_to_sequence(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The reverse: (B, heads/C, tokens, d) → (B, heads, tokens/C, d), laid out (B, tokens/C, heads, d)
    as SDPA's output is (the output projection's input a view of it)."""
    B, h, T, d = t.shape
    size = group.size()
    send = t.reshape(B, h, size, T // size, d).permute(2, 0, 1, 3, 4).contiguous()  # (C, B, h, n, d)
    received = funcol.all_to_all_single_autograd(send, None, None, group)  # from rank i: its heads
    return received.permute(1, 3, 0, 2, 4).reshape(B, T // size, size * h, d).transpose(1, 2)


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """All-to-all to whole sequences of 1/C of the heads, ordinary causal attention, all-to-all back."""
    q, k, v = (sequence_to_heads(t, group) for t in (q, k, v))
    return heads_to_sequence(causal_attention(q, k, v), group)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, *, mode: str, positions: torch.Tensor) -> nn.Module:
    """Every attention of gpt meets the other ranks' tokens (`mode`: ring or ulysses), and the position
    embedding looks up this rank's `positions`: the rest of the model runs on the slice unchanged. (One
    rank, holding whole sequences: its attention is left as it is, SDPA.)"""
    model.embed.positions = positions
    if cp_mesh.size() == 1:
        return model
    attention = ring_attention if mode == "ring" else ulysses_attention
    for block in (b for name, b in model.named_children() if name.startswith("block")):
        block.attn.attention = functools.partial(attention, group=cp_mesh.get_group())
    return model


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, precision: str) -> nn.Module:
    """fully_shard each block, then the root, over `mesh`: every rank (torchtitan shards over dp_shard ×
    cp, flattened). The ranks of a context-parallel group hold the same parameters, each computing its
    slice's part of their gradients: the reduce-scatter sums the parts and the groups' alike. bf16: as
    impls/fsdp, gathered and computed in bf16, reduced in fp32."""
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == "bf16"
        else MixedPrecisionPolicy()
    )
    reshard = mesh.size() > 1  # (one rank holds every shard: nothing to free)
    blocks = list(model.children())
    for i, block in enumerate(blocks):
        # The last block's parameters would be gathered again right away for backward: keep them.
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard and i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    # Sum the gradients, not average them: each rank's loss is already its part of the global batch's mean
    # (its tokens' loss sum ÷ the global batch's scored targets). Plain SUM on the wire.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def every_rank(mesh: DeviceMesh) -> DeviceMesh:
    """FSDP2's mesh: all dp_shard × cp ranks in one dimension, in rank order (torchtitan flattens the two
    dimensions of its mesh into "dp_shard_cp"; here they are the whole world)."""
    return init_device_mesh(mesh.device_type, (mesh.size(),), mesh_dim_names=("dp_shard_cp",))


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    mode: str,
    positions: torch.Tensor,
    precision: str = "fp32",
    compile: bool = False,
) -> nn.Module:
    """Attention over the context-parallel group, then FSDP2 over every rank (torchtitan's
    `parallelize_*`: apply_cp, [compile,] apply_fsdp). `positions`: this rank's (`slice_positions`)."""
    model = apply_cp(model, mesh["cp"], mode=mode, positions=positions)
    if compile:
        compile_blocks(model)
    return apply_fsdp(model, every_rank(mesh), precision=precision)


# --- end CP strategy ---


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_options(argv)
    # --- CP: one process per device, started here from plain python (as ddp does) once the arguments
    # are checked; under torchrun each rank arrives here directly
    if not under_torchrun():
        launch_ranks(__file__, argv, cfg, IMPL)
    configure_cpu_threads()
    rank, world_size, device, backend = start_process_group(cfg)  # --- CP: one device per rank, a group
    dp, cp = mesh_shape(cfg.strategy, world_size)
    mesh = make_mesh(dp, cp, device)
    dp_rank, cp_rank = mesh["dp_shard"].get_local_rank(), mesh["cp"].get_local_rank()
    is_main = rank == 0  # rank 0 alone writes the record, the checkpoint index and the final state_dict
    # --- end CP ---

    # ---- Data and model: the same in every impl -------------------------------------------------
    with exit_on_bad_input(IMPL):  # a dataset that fails its md5: one line, exit 2
        train_set, test_set, info = load_dataset(cfg)
    seed_everything(cfg.seed)  # before building: every impl starts from the same parameters
    model = build_model(cfg.model, info, cfg.gpt_layers, param_dtype(cfg), cfg.moe)
    # --- CP: a plain copy of the model, on the CPU, scores the gathered parameters (evaluation; copied
    # before the model moves to the device: one build per process, and no second model on the GPU)
    eval_model = plain_copy(
        model, lambda: build_model(cfg.model, info, cfg.gpt_layers, param_dtype(cfg), cfg.moe)
    )
    model = model.to(device)
    # --- CP: every rank read the data and built the model itself: they must agree (one all-gather)
    with exit_on_bad_input(IMPL, say=is_main):
        check_ranks_agree(cfg, train_set, test_set, model)
    model.activation_checkpointing = cfg.activation_checkpointing
    # --- CP: this rank's positions of every sequence; attention over the group, FSDP2 over every rank
    # (every rank built the same parameters, same seed: each keeps its shard)
    mode = cfg.strategy.cp_mode
    positions = slice_positions(info.input_shape[0], cp, cp_rank, load_balanced=mode == "ring").to(device)
    model = parallelize(
        model, mesh, mode=mode, positions=positions, precision=cfg.precision, compile=cfg.compile
    )
    optimizer = make_optimizer(cfg, model.parameters())  # over the shards: each rank steps its own
    scaler = make_grad_scaler(cfg, device)
    n_steps = total_steps(cfg, len(train_set))
    cadence = Cadence(cfg, n_steps, steps_per_epoch(len(train_set), cfg.global_batch_size))
    record = RunRecord(
        IMPL, VERSION, cfg, world_size=world_size, device=device, backend=backend, write_files=is_main
    )  # --- CP: every rank keeps the numbers, rank 0 writes them
    record.add_strategy_facts(  # --- CP: the mesh, the mode, and what each rank holds (first forward)
        mesh={"dp_shard": dp, "cp": cp},
        cp_mode=mode,
        held_shapes=record_held_shapes(model),
    )

    # ---- Resume: model, optimizer, scaler, RNG, record; the data order and lr follow the step ---
    start_step = 0
    if (path := resume_path(cfg)) is not None:
        # --- CP: the index (step-N.pt: step, record, options, RNG, file hashes) names a complete sharded
        # checkpoint, the folder step-N/ beside it (torch.distributed.checkpoint), whose hashes are checked
        # before DCP reads it. DCP reshards on load: any --cp / --dp-shard loads any other.
        with exit_on_bad_input(IMPL, say=is_main):  # --- CP: every rank finds it; rank 0 says it, once
            state = load_checkpoint(path, cfg, n_steps, holds=("folder", "sha256", "scaler"))
            load_sharded_checkpoint(model, optimizer, path, state)  # this rank's shards, in place
        scaler.load_state_dict(state["scaler"])
        start_step = resume_step(state, path, record, IMPL, say=is_main)  # --- CP: said once

    # The lr is a function of the step: built after a resume, it continues where the run left off.
    scheduler = make_lr_schedule(cfg, optimizer, n_steps, start_step)
    # --- CP: the data-parallel group's slice of every global batch; the C ranks of a context-parallel
    # group read the same one (same order as single, any mesh), and each keeps its positions of it
    micro_batches = train_loader(train_set, cfg, start_step, n_steps, dp_rank, dp, device=device)
    log = StepLog(
        record, cfg, IMPL, cadence, start_step, show=is_main, desc=f"{IMPL} {dp}×{cp} {mode}", device=device
    )
    state_bytes = None  # model-state bytes, measured once gradients and optimizer state both exist

    record.start_training()  # start-up (imports, data, model, set-up) ends: the run's clock starts
    with log, profiler(cfg, rank=rank) as prof:  # --- CP: one trace per rank
        for step in range(start_step, n_steps):
            started = log.step_starts(step)
            # This step's random numbers (dropout): a function of (seed, step), so a resumed run draws
            # what an uninterrupted one does. (Each impl says which stream each of its ranks draws.)
            seed_step(cfg.seed, step, stream=rank, devices=[device])  # --- CP: each rank its own tokens
            # The step's loss is the mean over every scored target of the whole global batch: each
            # micro-batch adds its loss *sum* over this count. (The mean of the micro-batches' own means
            # would weigh a micro-batch scoring 3 targets as much as one scoring 60: padding, prompts.)
            scored = scored_targets(train_set, cfg, step)  # --- CP: of the whole batch, not the slice's
            step_loss = None
            for micro_step in range(cfg.grad_accum):
                x, y = next(micro_batches)  # on the device already, the next one on its way
                x, y = x[:, positions], y[:, positions]  # --- CP: this rank's tokens and their targets
                # --- CP: reduce-scatter gradients only in the last micro-step's backward
                model.set_requires_gradient_sync(micro_step == cfg.grad_accum - 1)
                with autocast(cfg, device):
                    loss = loss_sum(model(x), y) / scored
                # The micro-batches' gradients add up to the global batch's, as one big batch gives.
                # --- CP: and so do the ranks' (each its slice's part): FSDP's reduce-scatter sums them
                scaler.scale(loss).backward()
                step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()  # (K=1: no add)
            scale = scaler.get_scale()  # fp16: a host sync, as scaler.step() makes anyway; else 1.0
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() < scale:  # inf/nan gradients: the update was skipped, the scale lowered
                record.add_skipped_step(step)
            scheduler.step()
            if state_bytes is None:  # --- CP: this rank's shards (DTensors' local parts)
                state_bytes = model_state_bytes(model.parameters(), optimizer)
            optimizer.zero_grad(set_to_none=True)
            log.step_done(step_loss, started)  # (no wait for the GPU: the step is timed by events)
            prof.step()

            due = cadence.after(step)
            if due.log:
                # --- CP: sum every rank's part of the loss (its slice of its group's batch; one all-reduce
                # for all pending steps): the global batch's mean
                log.flush(due.done, reduce=all_reduce_sum)
            if due.eval:
                started = log.eval_starts()
                # --- CP: each rank scores its shard of the test set, whole sequences, with a plain copy of
                # the gathered model (evaluate_gathered); the sums are all-reduced into global numbers.
                totals = evaluate_gathered(model, eval_model, test_set, device, cfg)
                log.evaluated(due.done, totals, started)
            if due.checkpoint:  # --- CP: every rank writes its shards in step-N/ (DCP), rank 0 the index
                index = checkpoint_path(cfg.checkpoint_dir, due.done)  # step-N.pt, written by rank 0
                state = checkpoint_state(cfg, due.done, n_steps, record, scaler=scaler.state_dict())
                save_sharded_checkpoint(model, optimizer, index, state, is_main)

    # --- CP: the core model's full state_dict, gathered from the shards by every rank; rank 0 writes it
    if cfg.save_final:
        final = full_state_dict(model)
        if is_main:
            save_checkpoint(cfg.save_final, final)
    # --- CP: every rank's memory, model states (its shards) and activations (its slice of the
    # sequence), and what its counted step communicated, beside the formulas' (distref.cost.context_parallel)
    predicted = context_parallel_run_cost(
        cfg, info, cp=cp, dp_shard=dp, shard_rank=rank, mode=mode, device=device.type
    )
    finish_record(record, cfg.global_batch_size, state_bytes, world_size, predicted)  # --- CP: to rank 0
    if is_main:
        print_summary(record.data)
    return record.data


# ---- The command line: the core options (distref.cli) and context parallelism's own ---------------
# --- CP: its options (CPOptions, declared with the strategy), parsed once into cfg.strategy ---
add_options = add_options_for(CPOptions)  # CPOptions' fields, each its --option


def check_options(cfg: RunConfig, world_size: int) -> str | None:
    options = cfg.strategy
    dp, cp = mesh_shape(options, world_size)
    if dp * cp != world_size:
        if options.cp is None or options.dp_shard is None:
            given = f"--cp {cp}" if options.cp else f"--dp-shard {dp}"
            return f"{given} must divide the {world_size} ranks"
        return f"--dp-shard {dp} × --cp {cp} = {dp * cp} ranks, but the job has {world_size}"
    if cfg.model not in GPT_MODELS:
        return (
            f"--model {cfg.model}: context parallelism here splits the sequences of gpt's attention; use "
            f"--model {' or '.join(GPT_MODELS)}"
        )
    sequence = sequence_length(cfg)  # (a dataset of yours: its inputs' length)
    if sequence is None:
        return (
            f"--dataset {cfg.dataset}: context parallelism splits sequences of tokens, and its inputs are not"
        )
    if cp > 1 and options.cp_mode == "ring" and sequence % (2 * cp):
        return (
            f"--cp {cp} with ring attention splits each sequence into 2 × {cp} = {2 * cp} chunks (the load "
            f"balanced causal split): the sequence's {sequence} tokens must divide by {2 * cp} "
            "(--sequence-length)"
        )
    heads = gpt_config(cfg.model, MODEL_DATASETS[cfg.model]).n_head  # (the data sets the rest)
    if cp > 1 and options.cp_mode == "ulysses" and (heads % cp or sequence % cp):
        return (
            f"--cp {cp} with Ulysses must divide {cfg.model}'s {heads} attention heads and the sequence's "
            f"{sequence} tokens (--sequence-length)"
        )
    if cfg.global_batch_size % (dp * cfg.grad_accum):
        return (
            f"--global-batch-size {cfg.global_batch_size} must be divisible by --dp-shard × --grad-accum "
            f"= {dp} × {cfg.grad_accum} = {dp * cfg.grad_accum}"
        )
    if cfg.precision == "fp16":
        # GradScaler's inf check would run on each rank's shard of the gradients: ranks could disagree on
        # skipping a step. bf16 has fp32's range and needs no scaler.
        return (
            "--precision fp16 is not supported with context parallelism here (no sharded loss scaler): "
            "use bf16"
        )
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
        splits_batch=False,  # --- CP: check_options splits the batch over --dp-shard only
        strategy_options=CPOptions,
    )


# --- end CP options ---


if __name__ == "__main__":
    with destroy_process_group_on_exit(IMPL):  # --- CP: clean teardown on every exit path
        main()
    exit_without_interpreter_teardown()  # --- CP: gloo threads vs Python's shutdown (distref/distributed)
