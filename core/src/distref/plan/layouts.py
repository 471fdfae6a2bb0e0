"""Layouts: a strategy on a mesh, and the search over what a user would try."""

from __future__ import annotations

import dataclasses
import math

from distref.plan.cluster import Cluster
from distref.plan.model import MODELS, Model

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zero-bubble", "zbv", "dualpipev")
# every GPU a replica of the model's work, what they share partitioned: DDP, DeepSpeed ZeRO, FSDP2
DATA_PARALLEL = ("ddp", "zero1", "zero2", "zero3", "zero1-offload", "zero2-offload", "zero3-offload", "fsdp")
# impls/context_parallel's attention over the ranks that split each sequence: ring (its default), Ulysses
CONTEXT_PARALLEL = ("cp", "cp-ulysses")
# Why a mixture of experts gets impls/expert_parallel's rows alone
ONLY_EXPERT_PARALLEL = (
    "impls/expert_parallel alone trains gpt's mixture of experts (the other impls refuse --experts)"
)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A strategy on a mesh, as the impls lay it out: tensor (or context) parallelism over the innermost
    ranks, then the pipeline's stages, data parallelism outermost."""

    strategy: (
        str  # ddp, zero1-3, zero*-offload, fsdp, hsdp, tp, cp, cp-ulysses, pp-<schedule>, model_parallel, ep
    )
    # data-parallel ranks (for hsdp: shard × replicas; for cp: groups of cp ranks; for ep: every rank, each
    # its slice of the batch)
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1  # ranks that split each sequence
    shard: int = 1  # hsdp's shard group
    # A pipeline as a run laid it out (--validate): its stages per rank and --partition; None: the
    # schedule's default and the balanced cut
    stages_per_rank: int | None = None
    partition: str | None = None
    ep: int = 1  # ranks that share out each MoE layer's experts (dp / ep copies of them)
    # The rows rank 0's experts received in a run's counted step, per MoE layer (--validate); None: uniform
    # routing (each rank receives the rows it sends)
    routed_rows: tuple[int, ...] | None = None

    @property
    def mesh(self) -> str:
        # (a strategy's own dimension shown at degree 1 too: --validate's tensor_parallel ×1, model_parallel
        # in one process)
        tp = self.tp > 1 or self.strategy == "tp"
        pp = self.pp > 1 or self.strategy == "model_parallel" or self.strategy.startswith("pp-")
        cp = self.cp > 1 or self.strategy in CONTEXT_PARALLEL
        parts = [f"dp{self.dp}"] if self.dp > 1 or not (tp or pp or cp) else []
        parts += [f"tp{self.tp}"] if tp else []
        parts += [f"cp{self.cp}"] if cp else []
        parts += [f"pp{self.pp}"] if pp else []
        text = "×".join(parts)
        if self.strategy == "hsdp":
            text += f" (shard {self.shard} × replicate {self.dp // self.shard})"
        if self.strategy == "ep":
            text += f" (ep {self.ep} × replicate {self.dp // self.ep})"
        if self.stages_per_rank is not None:
            text += f", {self.stages_per_rank} stages per rank"
        if self.partition is not None:
            text += f", cut at {self.partition}"
        return text


def powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, … up to `limit`."""
    return [2**i for i in range(int(math.log2(limit)) + 1)] if limit >= 1 else []


def layouts(
    model: Model,
    cluster: Cluster,
    tp: int | None = None,
    pp: int | None = None,
    cp: int | None = None,
    ep: int | None = None,
) -> tuple[list[Layout], list[tuple[str, str]]]:
    """Every strategy and mesh a user would try on `cluster` (powers of two per dimension; only a tensor-,
    pipeline-, context- or expert-parallel degree `tp` / `pp` / `cp` / `ep` where one is given), and what
    was skipped, with why. A mixture of experts: expert parallelism's meshes alone."""
    g, per_node = cluster.gpus, cluster.gpu.gpus_per_node
    found: list[Layout] = []
    skipped: list[tuple[str, str]] = []
    if model.gpt is not None and model.gpt.experts:
        if any(degree not in (None, 1) for degree in (tp, pp, cp)):
            return [], [("tp, pp, cp", ONLY_EXPERT_PARALLEL)]
        return expert_parallel_layouts(model, g, [ep] if ep else powers_of_two(g))
    if ep is not None:
        mixtures = ", ".join(name for name, shape in MODELS.items() if shape.experts)
        return [], [("ep", f"expert parallelism spreads a mixture of experts' experts (--model {mixtures})")]
    if cp not in (None, 1):  # (one degree is asked for at most: distref.plan.cli.check_mesh)
        return context_parallel_layouts(model, g, [cp])
    if tp in (None, 1) and pp in (None, 1) and g == 1:
        found += [
            Layout(strategy, dp=1)
            for strategy in DATA_PARALLEL
            if strategy in ("ddp",) or "offload" in strategy
        ]
        skipped.append(("zero1-3, fsdp", "one GPU: nothing to partition (DDP's numbers)"))
    elif tp in (None, 1) and pp in (None, 1):
        found += [Layout(strategy, dp=g) for strategy in DATA_PARALLEL]
    if tp in (None, 1) and pp in (None, 1):
        if cluster.nodes > 1 and g % per_node == 0:
            found.append(Layout("hsdp", dp=g, shard=per_node))
        else:
            skipped.append(("hsdp", "one node: HSDP's replicas would be FSDP's shards"))
    if g & (g - 1) and tp is None and pp is None and cp is None:
        skipped.append(
            ("tp, cp, pp", f"{g} GPUs is not a power of two: meshes are searched in powers of two")
        )
        return found, skipped
    if model.gpt is None:
        skipped.append(("tp", "tensor parallelism needs a decoder's shape (--model 125m … 70b)"))
    for degree in ([tp] if tp else powers_of_two(g)[1:]) if pp in (None, 1) else []:
        if model.gpt is None or degree == 1:
            break
        heads = model.gpt.heads
        if degree > per_node:
            skipped.append(
                (
                    f"tp{degree}",
                    f"beyond a node's {per_node} GPUs: every layer's collectives would cross nodes",
                )
            )
        elif heads % degree:
            skipped.append((f"tp{degree}", f"must divide the {heads} attention heads"))
        elif model.gpt.seq % degree:
            skipped.append(
                (f"tp{degree}", f"sequence parallelism splits the {model.gpt.seq} positions: not evenly")
            )
        else:
            found.append(Layout("tp", dp=g // degree, tp=degree))
    blocks = len(model.block_parameters)
    for degree in ([pp] if pp else powers_of_two(g)[1:]) if tp in (None, 1) else []:
        if degree == 1:
            break
        if blocks < 2:
            skipped.append(("pp, model_parallel", "the model has no blocks to cut between"))
            break
        for schedule in SCHEDULES:
            stages = degree * (1 if schedule in ("gpipe", "1f1b") else 2)
            if stages > blocks:
                skipped.append((f"pp{degree}-{schedule}", f"more stages than the model's {blocks} blocks"))
            else:
                found.append(Layout(f"pp-{schedule}", dp=g // degree, pp=degree))
        if degree == g and degree <= blocks:
            found.append(Layout("model_parallel", pp=degree))
    if tp is None and pp is None and cp is None:
        more, why = context_parallel_layouts(model, g, powers_of_two(g)[1:])
        found += more
        skipped += why
    return found, skipped


def context_parallel_layouts(
    model: Model, gpus: int, degrees: list[int]
) -> tuple[list[Layout], list[tuple[str, str]]]:
    """impls/context_parallel on `gpus`, each degree C of `degrees` (C ranks split each sequence, gpus / C
    groups of them): ring attention where the sequence cuts into 2C chunks (its load-balanced split),
    Ulysses where C divides the heads and the sequence. Beyond a node too: the ring's hops then cross
    nodes (what sequences too long for one node's GPUs need). What is skipped, with why."""
    if model.gpt is None:
        return [], [("cp", "context parallelism splits a decoder's sequences (--model 125m … 70b)")]
    found, skipped = [], []
    seq, heads = model.gpt.seq, model.gpt.heads
    for degree in degrees:
        if seq % (2 * degree):
            skipped.append(
                (f"cp{degree}", f"ring attention cuts the {seq} positions into 2C chunks: not evenly")
            )
        else:
            found.append(Layout("cp", dp=gpus // degree, cp=degree))
        if heads % degree:
            skipped.append((f"cp{degree}-ulysses", f"must divide the {heads} attention heads"))
        elif seq % degree:
            skipped.append((f"cp{degree}-ulysses", f"Ulysses splits the {seq} positions: not evenly"))
        else:
            found.append(Layout("cp-ulysses", dp=gpus // degree, cp=degree))
    return found, skipped


def expert_parallel_layouts(
    model: Model, gpus: int, degrees: list[int]
) -> tuple[list[Layout], list[tuple[str, str]]]:
    """impls/expert_parallel on `gpus`, each degree of `degrees` that divides the GPUs and the experts
    (each rank of a group of that many holds E/ep of each layer's experts, gpus / ep groups hold a copy
    each; every rank takes its slice of the batch). Beyond a node too: the all-to-alls then cross nodes.
    What is skipped, with why: the other strategies, and the degrees that do not divide."""
    experts = model.gpt.experts
    found = []
    skipped = [("ddp, zero1-3, fsdp, hsdp, tp, cp, pp, model_parallel", ONLY_EXPERT_PARALLEL)]
    for degree in degrees:
        if gpus % degree:
            skipped.append((f"ep{degree}", f"must divide the {gpus} GPUs"))
        elif experts % degree:
            skipped.append((f"ep{degree}", f"must divide the {experts} experts"))
        else:
            found.append(Layout("ep", dp=gpus, ep=degree))
    return found, skipped
