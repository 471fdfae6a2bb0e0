"""Random streams for the regions of a model that ranks split: dropout inside them must draw other masks
on each rank, outside them the same masks on the ranks that hold the same activations (Megatron-LM's RNG
tracker; impls/tensor_parallel's split layers, attached by the plan that splits them)."""

from __future__ import annotations

import torch
from torch import nn

from distref.training.device import stream_seed


class RandomStreams:
    """The random streams a tensor-parallel rank needs for dropout. Outside the split layers, activations
    are whole on every rank of a tensor-parallel group: their masks must be equal there, or the replicas
    part; `shared` is the stream of the step (distref.training.device.seed_step) the ranks holding the same
    activations draw. Inside a split region, from a colwise layer's output to the next rowwise layer's
    input, each rank holds other hidden units: their masks must be independent. On entering one, the
    generators are seeded from a number drawn from the shared CPU stream and the rank's index in its
    group (`split_rank`), and put back on leaving: activation checkpointing, which restores the shared
    stream to recompute, then recomputes the same masks."""

    def __init__(self, shared: int, split_rank: int, device: torch.device):
        self.shared, self.tp_rank, self.device = shared, split_rank, device
        self.outside: tuple[torch.Tensor, torch.Tensor | None] | None = None  # the shared states, inside

    def attach(self, model: nn.Module, plan: dict[str, str]) -> None:
        """Enter a split region after each colwise layer of `plan`, leave it before each rowwise one."""
        for name, style in plan.items():
            if style == "colwise":
                model.get_submodule(name).register_forward_hook(self.enter)
            else:
                model.get_submodule(name).register_forward_pre_hook(self.leave)

    def enter(self, *_) -> None:
        if self.outside is not None or in_backward():  # (q, k, v: three colwise layers open one region)
            return
        drawn = int(torch.randint(2**62, (1,)))  # from the shared CPU stream: the same on the whole group
        cuda = self.device.type == "cuda"
        self.outside = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if cuda else None)
        torch.random.default_generator.manual_seed(stream_seed(drawn, 0, self.tp_rank, "cpu"))
        if cuda:
            torch.cuda.default_generators[self.device.index or 0].manual_seed(
                stream_seed(drawn, 0, self.tp_rank, str(self.device))
            )

    def leave(self, *_) -> None:
        if self.outside is None or in_backward():
            return
        cpu_state, cuda_state = self.outside
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, self.device)
        self.outside = None


def in_backward() -> bool:
    """Whether autograd is running a backward here: activation checkpointing recomputing a block, whose
    random state the checkpoint has restored itself (a colwise layer recomputed without its rowwise
    partner must not open a region that nothing closes)."""
    return torch._C._current_graph_task_id() != -1
