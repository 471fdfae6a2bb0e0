"""The models every impl trains, each an ordered list of named blocks.

`BlockModel` is an `nn.Sequential` of named blocks, so model-parallel and pipeline impls can partition it
by block without special cases, and parameter names (`conv1.0.weight`, `block0.attn.q.weight`, ...) are
the same whichever impl trains it: a `--save-final` state_dict from any impl loads into any other.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import weakref
from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from distref.config import (
    GPT_MODELS,
    FactoryError,
    MoEConfig,
    first_line,
    is_factory,
    load_factory,
)
from distref.data.tensors import DatasetInfo


class BatchNormStatisticsKept:
    """A context: what runs inside leaves `module`'s BatchNorm running statistics (mean, var,
    num_batches_tracked) as they were on entering. Reusable: split backward (zero-bubble pipeline
    schedules: an input-gradient pass, then a weight-gradient pass) recomputes a checkpointed block
    twice, entering the same context each time.

    (Turning `track_running_stats` off instead would run a different batch-norm op than the forward being
    recomputed, which checkpointing rejects: it checks that the recomputation saves the same tensors.)"""

    def __init__(self, module: nn.Module):
        self.buffers = [
            b for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) for b in m.buffers()
        ]
        self.before: list[torch.Tensor] = []

    def __enter__(self) -> None:
        self.before = [b.clone() for b in self.buffers]

    def __exit__(self, *exc_info) -> None:
        with torch.no_grad():
            for buffer, value in zip(self.buffers, self.before, strict=True):
                buffer.copy_(value)


def _recompute_contexts(block: nn.Module) -> tuple[contextlib.nullcontext, BatchNormStatisticsKept]:
    # The recomputed forward would update BatchNorm's running mean/var (and num_batches_tracked) a second
    # time each step; the first forward updates them as usual, the recomputation's update is undone.
    return contextlib.nullcontext(), BatchNormStatisticsKept(block)


class BlockModel(nn.Sequential):
    """Named blocks applied in order. With `activation_checkpointing`, each block's activations are
    dropped after forward and recomputed in backward (non-reentrant checkpointing): less memory, ~1/3
    more compute, and the same parameters and buffers as without it."""

    def __init__(self, blocks: OrderedDict[str, nn.Module]):
        super().__init__(blocks)
        self.activation_checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self:
            if self.activation_checkpointing and torch.is_grad_enabled():
                contexts = functools.partial(_recompute_contexts, block)
                x = checkpoint(block, x, use_reentrant=False, context_fn=contexts)
            else:
                x = block(x)
        return x


def lenet(num_classes: int = 10) -> BlockModel:
    """The classic MNIST CNN of the PyTorch examples (without dropout, so that runs are deterministic
    whatever the world size): conv 1→10 k5, maxpool, conv 10→20 k5, maxpool, fc 320→50→10."""
    return BlockModel(
        OrderedDict(
            conv1=nn.Sequential(nn.Conv2d(1, 10, kernel_size=5), nn.MaxPool2d(2), nn.ReLU()),
            conv2=nn.Sequential(nn.Conv2d(10, 20, kernel_size=5), nn.MaxPool2d(2), nn.ReLU()),
            fc1=nn.Sequential(nn.Flatten(), nn.Linear(320, 50), nn.ReLU()),
            fc2=nn.Linear(50, num_classes),
        )
    )


def resnet18(num_classes: int = 10, in_channels: int = 3) -> BlockModel:
    """torchvision's ResNet-18 adapted to 32×32 inputs: a 3×3 stride-1 stem and no max-pool (the
    ImageNet stem would shrink CIFAR images to 8×8 before the first residual stage)."""
    from torchvision.models import resnet18 as tv_resnet18

    net = tv_resnet18(num_classes=num_classes)
    net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    return BlockModel(
        OrderedDict(
            stem=nn.Sequential(net.conv1, net.bn1, net.relu),
            layer1=net.layer1,
            layer2=net.layer2,
            layer3=net.layer3,
            layer4=net.layer4,
            head=nn.Sequential(net.avgpool, nn.Flatten(), net.fc),
        )
    )


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    moe: MoEConfig | None = None  # each block's MLP a mixture of experts (--experts), or dense


class Embedding(nn.Module):
    """Token and learned position embeddings. `positions`: where in the sequence the tokens it is given
    stand; None (the default): 0, 1, ... in order. A rank holding a slice of every sequence (context
    parallelism) sets its slice's positions."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.positions: torch.Tensor | None = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = (
            self.positions if self.positions is not None else torch.arange(idx.shape[1], device=idx.device)
        )
        return self.tok(idx) + self.pos(positions)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Each query attends to the keys at or before its position: (B, heads, T, head_dim) in and out."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate query, key and value projections (Llama's layout)
    rather than one fused qkv matrix: split by output rows (tensor parallelism's ColwiseParallel), each
    projection then gives a rank whole heads, whereas a fused [q; k; v] matrix would give rank 0 all of q
    and part of k. The number of heads is read from the projections' outputs, so the same forward runs on
    a rank holding n_head / tp of them. The key projection has no bias: it would add q·b to every score
    of a query's row, which softmax ignores, so its gradient is zero and its updates pure rounding noise
    (different in every correct implementation, which parity checks would flag). `attention`: how the
    heads' queries meet the keys (`causal_attention`; context parallelism sets one that meets the other
    ranks' slices of the sequence too)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = causal_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = self.attention(q, k, v)  # (B, heads, T, head_dim)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


# The local parts of DTensor parameters that `local` handed out, by id (weakly: an entry goes with its
# tensor, so a later tensor at the same address is not taken for one): model state, not activations, for
# the saved-tensor meter (distref.training.measure), which cannot tell a plain view of one (an expert's
# weight a matmul saves) from an input's.
PARAMETER_PARTS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part (the experts a rank holds, expert parallelism), or the tensor itself. (By
    its method: DTensor's public module is torch 2.5's, and core runs on 2.4.)"""
    if not callable(getattr(type(tensor), "to_local", None)):
        return tensor
    part = tensor.to_local()
    if isinstance(tensor, nn.Parameter) and not torch.compiler.is_compiling():
        whole = part if part._base is None else part._base
        PARAMETER_PARTS[id(whole)] = whole
    return part


class Experts(nn.Module):
    """E expert MLPs, each the dense block's (D → 4D → GELU → D), their weights stacked into one tensor
    each (w1: E × D × H, ...; torchtitan's GroupedExperts): expert e is row e of every tensor, so a rank
    holding some experts holds a shard of each (expert parallelism), and every impl's state_dict has the
    same names and shapes."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.b1 = nn.Parameter(torch.zeros(experts, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.b2 = nn.Parameter(torch.zeros(experts, dim))

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """`tokens` grouped by expert, `counts[e]` rows for the e-th expert held here: each group through
        its expert, in the same order. An expert given no token still takes part (its gradient is zero,
        not None, as every rank's optimizer then expects)."""
        w1, b1, w2, b2 = (local(p) for p in (self.w1, self.b1, self.w2, self.b2))
        out = []
        for e, rows in enumerate(tokens.split(counts)):
            out.append(torch.addmm(b2[e], F.gelu(torch.addmm(b1[e], rows, w1[e])), w2[e]))  # (as nn.Linear)
        return torch.cat(out)


class RoutingLog:
    """The routers' decisions for the record: tokens each MoE layer sent to each expert, and the weighted
    load-balancing loss, summed over a training step's forwards (`take` after each step). Process-wide, as
    the communication counter is (distref.training.traffic): every MoE layer adds to it in training
    (grad enabled), not in evaluation, not on meta, not when a checkpointed block recomputes its forward."""

    def __init__(self) -> None:
        self.counts: dict[int, torch.Tensor] = {}  # id(layer) → tokens per expert, layers in forward order
        self.balance: torch.Tensor | None = None

    def add(self, layer: nn.Module, counts: torch.Tensor, balance: torch.Tensor) -> None:
        if counts.is_meta or not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return  # (-1: not inside a backward, where checkpointing recomputes)
        key = id(layer)
        self.counts[key] = counts if key not in self.counts else self.counts[key] + counts
        self.balance = balance.detach() if self.balance is None else self.balance + balance.detach()

    def take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(tokens per expert, layers × E; the balance loss) since the last take, or None: no MoE ran."""
        if not self.counts:
            return None
        taken = torch.stack(list(self.counts.values())), self.balance
        self.counts, self.balance = {}, None
        return taken


ROUTING = RoutingLog()


class AddToLoss(torch.autograd.Function):
    """Returns `x` unchanged; in backward, `loss` is differentiated as if it had been added to the training
    loss (its gradient 1), whatever the loop does with the model's output (Megatron-Core's
    MoEAuxLossAutoScaler). So every impl's loop, written for the cross-entropy alone, trains the
    load-balancing loss too, the pipeline's stages included."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


class MoE(nn.Module):
    """A mixture of experts in place of a block's MLP (Switch Transformer, Fedus et al. 2021; GShard,
    Lepikhin et al. 2020; Mixtral's top-2): a router (linear → softmax over E experts → the top k, their
    probabilities renormalised to sum to 1) sends each token to k experts, and the token's output is their
    outputs weighed by those probabilities. Dropless: every expert takes every token sent to it (no capacity
    factor), so the function does not depend on how the batch is split, over ranks or micro-batches.

    The load-balancing loss is Switch's, α·E·Σ_i f_i·P_i (f_i: the fraction of the token choices that
    went to expert i, P_i: the mean router probability of expert i), computed per sequence as GShard
    computes it per group of tokens, and averaged over the global batch's sequences: each sequence's term
    is its own, so any split of the batch adds up the same gradient. It reaches the router through
    `AddToLoss`. The router runs in the parameters' precision (fp32 under bf16 autocast, as Megatron-Core
    and torchtitan keep it): a choice among experts should not hang on bf16's rounding.

    `run_experts(tokens, counts)`: the routed tokens grouped by expert, `counts[e]` of them for expert e,
    in → their outputs, in the same order. None: the experts run them here; expert parallelism sets one that
    sends each group to the rank holding its expert and brings the outputs back."""

    # Run eagerly under --compile (distref.training.compile disables dynamo on its forward): its groups'
    # sizes are data (the routing). Compiled, dynamo broke the graph at them and, with activation
    # checkpointing, recomputed the block through another graph whose saved tensors checkpointing refused
    # ("Recomputed values ... have different metadata", torch 2.13). (Not `@torch.compiler.disable` here:
    # that imports dynamo, a second of every run's start-up, where only a compiled run needs it.)
    runs_eagerly = True

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        moe = cfg.moe
        self.top_k, self.balance_weight = moe.top_k, moe.balance_loss / moe.sequences_per_step
        self.router = nn.Linear(cfg.n_embd, moe.experts, bias=False)
        self.experts = Experts(moe.experts, cfg.n_embd, 4 * cfg.n_embd)
        # None: self.experts run the tokens here (expert parallelism sets its all-to-all dispatch)
        self.run_experts: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(router probabilities, N × E; the k chosen experts of each token, N × k)."""
        weight = self.router.weight
        meta = tokens.is_meta  # (autocast has no meta device)
        with contextlib.nullcontext() if meta else torch.autocast(tokens.device.type, enabled=False):
            probs = F.linear(tokens.to(weight.dtype), weight).softmax(dim=-1)
        return probs, probs.topk(self.top_k, dim=-1).indices

    def balance_loss(self, probs: torch.Tensor, chosen: torch.Tensor, sequences: int) -> torch.Tensor:
        """α/B · Σ over this batch's sequences of E·Σ_i f_i·P_i (B: sequences in the global batch)."""
        experts = probs.shape[-1]
        choices = chosen.reshape(sequences, -1)  # each sequence's T·k choices
        f = torch.zeros(sequences, experts, dtype=probs.dtype, device=probs.device)
        f.scatter_add_(1, choices, torch.ones_like(choices, dtype=probs.dtype)).div_(choices.shape[1])
        p = probs.reshape(sequences, -1, experts).mean(dim=1)
        return self.balance_weight * experts * (f * p).sum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        tokens = x.reshape(B * T, D)
        probs, chosen = self.route(tokens)
        weights = probs.gather(1, chosen)
        if self.top_k > 1:  # (k = 1: the probability itself, Switch's gate; renormalised it would be 1,
            weights = weights / weights.sum(dim=-1, keepdim=True)  # and the router learn from nothing else)
        experts = probs.shape[-1]
        # Each (token, choice) pair, grouped by expert (a stable sort: within an expert, in token order)
        order = chosen.flatten().argsort(stable=True)
        if tokens.is_meta:  # (shapes only: as if every expert took its even share)
            counts = [len(order) // experts + (e < len(order) % experts) for e in range(experts)]
        else:
            counts = torch.bincount(chosen.flatten(), minlength=experts)
            if torch.is_grad_enabled():  # (training: evaluation has no loss to balance, nothing to log)
                balance = self.balance_loss(probs, chosen, B)
                ROUTING.add(self, counts, balance)
            counts = counts.tolist()  # (a host sync: the groups' sizes)
        routed = tokens[order // self.top_k]
        if not tokens.is_meta and torch.is_autocast_enabled(x.device.type):  # the experts' matmuls cast
            routed = routed.to(torch.get_autocast_dtype(x.device.type))  # them anyway: sent at half the bytes
        out = (self.run_experts or self.experts)(routed, counts)
        pairs = torch.empty_like(out).index_copy_(0, order, out)  # back in (token, choice) order
        y = (pairs.view(B * T, self.top_k, D) * weights.unsqueeze(-1).to(pairs.dtype)).sum(dim=1)
        if torch.is_grad_enabled() and not tokens.is_meta:
            y = AddToLoss.apply(y, balance)
        return y.view(B, T, D)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = (
            MoE(cfg)
            if cfg.moe is not None
            else nn.Sequential(
                nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.n_embd)
        # Not tied to the token embedding: tying would make the first and last block share a
        # parameter, which a pipeline split across devices cannot express.
        self.out = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def gpt_config(name: str, info: DatasetInfo, gpt_layers: int = 2, moe: MoEConfig | None = None) -> GPTConfig:
    """The shape of --model gpt (4 heads × 16, `gpt_layers` blocks: small enough for CPU tests) or of
    --model gpt2 (GPT-2 small's: 12 blocks of 12 heads × 64, a 1024-token context; the head is not tied
    to the embedding, so it has 163M parameters where GPT-2 has 124M). Either reads its vocabulary and
    context from the data (`info`)."""
    if name == "gpt2":
        return GPTConfig(info.num_classes, info.input_shape[0], n_layer=12, n_head=12, n_embd=768, moe=moe)
    return GPTConfig(vocab_size=info.num_classes, block_size=info.input_shape[0], n_layer=gpt_layers, moe=moe)


def gpt(cfg: GPTConfig) -> BlockModel:
    """A small decoder-only transformer (nanoGPT's shape: pre-LN blocks, GELU MLP, no dropout)."""
    blocks: OrderedDict[str, nn.Module] = OrderedDict(embed=Embedding(cfg))
    for i in range(cfg.n_layer):
        blocks[f"block{i}"] = TransformerBlock(cfg)
    blocks["head"] = Head(cfg)
    model = BlockModel(blocks)
    for name, p in model.named_parameters():  # GPT-2 init; residual projections scaled by depth
        if (
            name.endswith(("attn.q.weight", "attn.k.weight", "attn.v.weight", "mlp.0.weight", "out.weight"))
            or name.endswith(("mlp.router.weight", "mlp.experts.w1"))
            or "embed" in name
        ):
            nn.init.normal_(p, std=0.02)
        elif name.endswith(("proj.weight", "mlp.2.weight", "mlp.experts.w2")):
            nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))
        elif name.endswith("bias"):
            nn.init.zeros_(p)
    return model


def on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """What `build()` returns, built on the meta device (shapes, no memory, no initialisation), the
    random generators left as they were."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return build()


def plain_copy(model: nn.Module, build: Callable[[], nn.Module]) -> nn.Module:
    """A copy of `model`, its parameters and buffers, as a second model built by `build` would be once
    loaded with them, without building one (a copy is faster than initialising, and keeps what the
    state_dict does not hold). A model that deepcopy refuses (a non-leaf tensor held as an attribute, as
    nn.utils.weight_norm keeps; a lock or a handle, that pickle refuses) is built again and loaded instead."""
    try:
        return copy.deepcopy(model)
    except Exception:  # (what your model holds: whatever deepcopy raises)
        built = build()
        built.load_state_dict(model.state_dict())
        return built


def parameter_dtype(precision: str) -> torch.dtype:
    """The dtype a model's parameters are held in for a --precision: float64 under fp64, else float32
    (bf16/fp16 are autocast over fp32 parameters)."""
    return torch.float64 if precision == "fp64" else torch.float32


def build_model(
    name: str,
    info: DatasetInfo,
    gpt_layers: int = 2,
    dtype: torch.dtype = torch.float32,
    moe: MoEConfig | None = None,
) -> nn.Module:
    """The model for a dataset (`gpt_layers`: gpt's transformer blocks; `moe`: its MLPs a mixture of
    experts, RunConfig.moe), or what your MODULE:FUNCTION returns. Call after seeding: every impl must start from the same parameters. Initialised in fp32
    whatever `dtype` (float64 for --precision fp64 is the fp32 initialisation, widened), so every
    precision starts from the same values."""
    if is_factory(name):
        return own_model(name).to(dtype)
    return _build_model(name, info, gpt_layers, moe).to(dtype)


def own_model(spec: str) -> nn.Module:
    """Your model: what the function MODULE:FUNCTION returns, called without arguments. An nn.Sequential
    (whose forward is its blocks in order, by construction) becomes a BlockModel of the same blocks, by
    the same names: --activation-checkpointing then recomputes each block, as for this project's models.
    Raises FactoryError (one line) if it cannot be imported, fails, or returns no nn.Module."""
    factory = load_factory(spec, "--model")
    try:
        model = factory()
    except (Exception, SystemExit) as exc:  # (your code: whatever it raises is said in one line)
        raise FactoryError(
            f"--model {spec}: {spec.partition(':')[2]}() failed: {type(exc).__name__}: {first_line(exc)}"
        ) from None
    if not isinstance(model, nn.Module):
        raise FactoryError(f"--model {spec}: returned a {type(model).__name__}, not a torch.nn.Module")
    if type(model) is nn.Sequential or (
        isinstance(model, nn.Sequential) and type(model).forward is nn.Sequential.forward
    ):
        blocks, seen = OrderedDict(), set()
        for name, block in model._modules.items():  # (named_children() would skip a block used twice)
            if id(block) in seen and not [*block.parameters(), *block.buffers()]:
                block = copy.deepcopy(block)  # one nn.ReLU() used twice: a block of its own each time
            seen.add(id(block))
            blocks[name] = block
        as_blocks = BlockModel(blocks)
        if hasattr(model, "tp_plan"):  # (tensor_parallel's plan of your model: the same names)
            as_blocks.tp_plan = model.tp_plan
        return as_blocks
    return model


def _build_model(name: str, info: DatasetInfo, gpt_layers: int, moe: MoEConfig | None = None) -> BlockModel:
    if name == "lenet":
        if info.input_shape != (1, 28, 28):
            raise ValueError(f"lenet takes 1×28×28 images, {info.name} has {info.input_shape}")
        return lenet(info.num_classes)
    if name == "resnet18":
        return resnet18(info.num_classes, in_channels=info.input_shape[0])
    if name in GPT_MODELS:
        if info.kind != "sequence":
            raise ValueError(f"{name} takes token sequences, {info.name} holds images")
        return gpt(gpt_config(name, info, gpt_layers, moe))
    raise ValueError(f"unknown model {name}")
