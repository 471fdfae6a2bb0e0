"""torch.compile as every impl applies it (--compile): each block on its own, before the strategy wraps
the model, as torchtitan compiles each transformer block before FSDP or tensor parallelism."""

from __future__ import annotations

import os

import torch
from torch import nn


def compile_backend() -> str:
    """Inductor by default. The tests set "aot_eager" to check that a strategy composes with compiled
    blocks in seconds (dynamo's graphs and AOTAutograd's backward, without inductor's code generation).
    Read when a run compiles, not at import: the tests' ranks fork from a process that imported it."""
    return os.environ.get("DISTREF_COMPILE_BACKEND", "inductor")


def compile_blocks(model: nn.Module) -> nn.Module:
    """torch.compile each block of `model` (its children; a model of yours that has none: the whole
    model), in place, and return it. Per block rather than the whole model: the blocks of a transformer
    are alike, so one graph serves them all (compiled once, not once per layer), and a strategy's hooks
    between blocks (FSDP's gathers, a pipeline's cut, DDP's buckets) stay outside the graphs.

    Each block's `forward` is what is compiled, not the module (`torch.compile(block)` would rename its
    parameters `_orig_mod.…`) nor its call (`block.compile()`: dynamo skips torch.nn's own code there, so
    an nn.Sequential or nn.Linear block compiles nothing): the parameters keep their names, checkpoints
    and `--save-final` load into an eager model, and the hooks a strategy puts on a block run outside."""
    for module in model.modules():  # what must run eagerly inside a compiled block (distref.models.MoE)
        if getattr(module, "runs_eagerly", False):
            module.forward = torch.compiler.disable(module.forward)
    blocks = list(model.children()) or [model]
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=compile_backend())
    return model
