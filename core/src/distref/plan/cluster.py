"""The hardware a plan runs on (GPU presets, each figure overridable) and the training set-up."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from distref.cost.activations import Saving, saving_for
from distref.cost.attention import sdpa_kernel

if TYPE_CHECKING:
    from distref.simulate import GPTShape

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class GPU:
    """One accelerator and its node: memory, dense peak FLOP/s by precision, and per-GPU bandwidth one
    way, within a node and out of it."""

    name: str
    memory_bytes: int
    peak_flops: dict[str, float]  # {"mixed": bf16 tensor cores, "fp32": fp32}
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    gpus_per_node: int


# Datasheet figures (dense, no sparsity). NVLink's bidirectional totals halved; the inter-node link is the
# node's NICs shared by its GPUs: DGX H100 8×400 Gb/s, DGX A100 8×200 Gb/s, an L4 node 100 Gb/s Ethernet.
GPUS = {
    "h100-80gb": GPU("H100 80GB SXM", 80 * GiB, {"mixed": 989.4e12, "fp32": 66.9e12}, 450e9, 50e9, 8),
    "a100-80gb": GPU("A100 80GB SXM", 80 * GiB, {"mixed": 312e12, "fp32": 19.5e12}, 300e9, 25e9, 8),
    "a100-40gb": GPU("A100 40GB SXM", 40 * GiB, {"mixed": 312e12, "fp32": 19.5e12}, 300e9, 25e9, 8),
    "l4": GPU("L4 24GB (PCIe)", 24 * GiB, {"mixed": 121e12, "fp32": 30.3e12}, 32e9, 12.5e9 / 8, 8),
    # This project's CI box: 2 cores as 2 ranks, 24 GiB; 2 × 2.5 GHz × 32 fp32 FLOP per cycle (AVX2 FMA),
    # no bf16 units; gloo's copies through shared memory assumed 5 GB/s.
    "cpu": GPU("CPU (2 cores)", 24 * GiB, {"mixed": 160e9, "fp32": 160e9}, 5e9, 1.25e9, 2),
}

RESERVED_BYTES = 2 * GiB  # per GPU, not for training: CUDA context, NCCL buffers, allocator fragmentation
DEFAULT_MFU = 0.4


@dataclasses.dataclass(frozen=True)
class Cluster:
    """`gpus` of one kind, `gpu.gpus_per_node` to a node; a group of consecutive ranks within a node runs
    over the node's links, one spanning nodes over the network."""

    gpu: GPU
    gpus: int

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpu.gpus_per_node)

    def link(self, group_span: int) -> str:
        """The link a group of consecutive ranks spanning `group_span` ranks runs over."""
        return "intra_node" if group_span <= self.gpu.gpus_per_node else "inter_node"

    def bandwidth(self, link: str) -> float:
        return self.gpu.intra_node_bytes_per_s if link == "intra_node" else self.gpu.inter_node_bytes_per_s


@dataclasses.dataclass(frozen=True)
class Training:
    global_batch: int  # samples (sequences) per optimizer step
    micro_batch: int  # samples per GPU per micro-step (a pipeline's micro-batch)
    # "mixed" (16-bit parameters and gradients, fp32 master and optimizer: DeepSpeed's), "autocast" (the
    # impls' --precision bf16: fp32 states, 16-bit compute) or "fp32"; for --validate's records also "fp64"
    precision: str
    optimizer: str  # "adamw" or "sgd"
    checkpointing: bool
    mfu: float
    grad_accum: int | None = None  # fixes K, and so the micro-batch, where given
    device: str = "cuda"  # whose kernels save the activations (--validate: the record's device)

    def saving(self, strategy: str, gpt: GPTShape | None = None, tp: int = 1) -> Saving:
        """How this training saves its activations under `strategy` (a layout's) on a model of `gpt`'s
        shape (None: no attention), with `tp` tensor-parallel ranks (Ulysses' context-parallel ranks: each
        attends with 1/C of the heads): dtypes by kind, autocast's copies, SDPA's kernel (by torch's rule
        for the device, not this machine's GPU). In 16 bits as each impl computes under --precision bf16:
        fsdp and context_parallel their policy's 16-bit parameters under autocast, deepspeed_zero its 16-bit
        module; the others fp32 parameters under autocast (`autocast`), or, as the ZeRO paper's mixed
        precision has it, 16-bit parameters (`mixed`)."""
        precision = "bf16" if self.precision in ("mixed", "autocast") else self.precision
        family = strategy.removesuffix("-offload").removesuffix("-ulysses")
        if precision != "bf16":
            parameters = "full"
        elif family in ("fsdp", "hsdp", "cp"):
            parameters = "16-bit under autocast"
        elif family.startswith("zero"):
            parameters = "16-bit"
        else:
            parameters = "16-bit" if self.precision == "mixed" else "full"
        attention = None
        if gpt is not None:
            head_size, heads = gpt.hidden // gpt.heads, gpt.heads // tp
            attention = sdpa_kernel(self.device, precision, head_size, heads, gpt.seq, ask_the_gpu=False)
        return saving_for(precision, self.device, parameters, attention)

    @property
    def element_bytes(self) -> int:  # a parameter's, a gradient's (and, but under autocast, an activation's)
        return {"mixed": 2, "fp32": 4, "fp64": 8, "autocast": 4}[self.precision]

    @property
    def compute_element_bytes(self) -> int:
        """An activation's bytes where 16-bit compute makes it: a linear layer's output."""
        return 2 if self.precision == "autocast" else self.element_bytes
