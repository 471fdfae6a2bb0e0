"""The hardware a plan runs on (GPU presets, each figure overridable) and the training set-up."""

from __future__ import annotations

import dataclasses
import math

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
    # "mixed" (16-bit parameters and gradients, fp32 master and optimizer) or "fp32"; for --validate's
    # records also "fp64" and "autocast" (the impls' --precision bf16: fp32 states, 16-bit compute)
    precision: str
    optimizer: str  # "adamw" or "sgd"
    checkpointing: bool
    mfu: float
    grad_accum: int | None = None  # fixes K, and so the micro-batch, where given

    @property
    def element_bytes(self) -> int:  # a parameter's, a gradient's (and, but under autocast, an activation's)
        return {"mixed": 2, "fp32": 4, "fp64": 8, "autocast": 4}[self.precision]

    @property
    def compute_element_bytes(self) -> int:
        """An activation's bytes where 16-bit compute makes it: a linear layer's output."""
        return 2 if self.precision == "autocast" else self.element_bytes
