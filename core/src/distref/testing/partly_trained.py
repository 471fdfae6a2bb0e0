"""A model of yours that trains only part of itself: frozen parameters (`requires_grad=False`) and a
parameter its forward never reads. The cost tests run it (`--model distref.testing.partly_trained:mlp
--dataset distref.testing.own:example_data`): only parameters that receive a gradient have a gradient,
optimizer state and gradient communication, which the formulas must say exactly.

Blocks (each an FSDP unit, a pipeline or model_parallel stage's unit of cut):
    fc1    Linear(16, 64), its weight frozen, its bias trained: a unit both frozen and trained
    act1   ReLU
    fc2    Linear(64, 32), beside `spare`, a (5, 3) parameter no forward reads, and `unused_head`, a
           Linear(3, 5) never called (odd rows: padded by sharding)
    norm   LayerNorm(32), frozen whole: a unit with nothing to train, between trained ones
    out    Linear(32, 4)

`two_heads`: a model whose forward never calls one of its blocks, its first block frozen.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn


class WithSpare(nn.Module):
    """A Linear, beside a parameter its forward never reads (an unused head, a feature switched off)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.spare = nn.Parameter(torch.randn(5, 3))
        self.unused_head = nn.Linear(3, 5)  # a module never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def mlp() -> nn.Module:
    """Frozen and unused parameters in one model (see the module's docstring)."""
    model = nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(16, 64),
            act1=nn.ReLU(),
            fc2=WithSpare(64, 32),
            norm=nn.LayerNorm(32),
            out=nn.Linear(32, 4),
        )
    )
    model.fc1.weight.requires_grad_(False)
    model.norm.requires_grad_(False)
    model.tp_plan = {"fc1": "colwise", "fc2.linear": "rowwise"}  # (tensor_parallel's split)
    return model


def frozen_mlp() -> nn.Module:
    """The same model with the unused parameters frozen too: frozen ones only, every trainable one used."""
    model = mlp()
    model.fc2.spare.requires_grad_(False)
    model.fc2.unused_head.requires_grad_(False)
    return model


class TwoHeads(nn.Module):
    """A body and two heads, of which the forward calls one: the other is a block never run (an FSDP unit
    that gathers nothing, a ZeRO-3 module never fetched)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)
        self.other_head = nn.Linear(32, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def two_heads() -> nn.Module:
    """TwoHeads, its body frozen."""
    model = TwoHeads()
    model.body.requires_grad_(False)
    return model


def frozen_first_block() -> nn.Module:
    """A frozen first block (a pretrained embedding or backbone, fine-tuned above it): cut in two, the
    first part has nothing to train and its output needs no gradient."""
    model = nn.Sequential(
        OrderedDict(fc1=nn.Linear(16, 64), act1=nn.ReLU(), fc2=nn.Linear(64, 32), out=nn.Linear(32, 4))
    )
    model.fc1.requires_grad_(False)
    return model
