"""Which parameters a step trains, in which order, and which modules it runs: a step on the meta device.

Only a parameter that receives a gradient has one, has optimizer state (torch's optimizers skip a
parameter whose .grad is None) and has its gradient communicated: not a frozen one (requires_grad=False)
and not one the forward never reads. What the strategies do with the others differs, and the formulas say
it per strategy: DDP leaves frozen parameters out of its buckets; FSDP2 gathers a unit's every parameter,
frozen or unused, and reduce-scatters only those with a gradient; DeepSpeed flattens and partitions the
trainable (requires_grad) ones at stages 1 and 2, all of them at stage 3, where it gathers only the
parameters of modules whose forward runs; stage 0 all-reduces a zero gradient for an unused trainable one.

The model is built again on the meta device (shapes, no storage: a model too large for the machine
costs nothing), run forward and backward on a meta batch of two samples: which parameters receive a
gradient, in which order, and which modules run (meta kernels follow the same graph, so the order is the
one a real backward takes).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
from torch import nn

from distref.config import MoEConfig, is_factory
from distref.models import build_model, on_meta


@dataclasses.dataclass(frozen=True)
class ParameterUse:
    """What a step does with one parameter, as the formulas take it (their default: every parameter
    trainable, read, in a module that runs)."""

    requires_grad: bool = True  # not frozen
    trained: bool = True  # receives a gradient: requires_grad, and autograd reaches it from the output
    runs: bool = True  # the module that gathers it (a ZeRO-3 module, an FSDP unit) runs its forward


@dataclasses.dataclass(frozen=True)
class Usage:
    """What one step of a model does with its parameters, by their names in model.named_parameters()
    (the names every impl keeps: a stage, a unit or a wrapped module's own)."""

    # parameters that receive a gradient, in the order backward accumulates them (what DDP's and DeepSpeed's
    # buckets fill in: not quite the parameters' reverse order, e.g. a convolution's weight before its bias)
    gradient_order: tuple[str, ...] = ()
    called: frozenset[str] = frozenset()  # modules whose forward runs, by name ("" the whole model)
    unknown: str | None = None  # why the model could not be traced (then no formula can use it)

    def is_trained(self, name: str) -> bool:
        return name in self.gradient_order

    def module_called(self, parameter_name: str) -> bool:
        """Whether the module that owns this parameter directly runs its forward."""
        return parameter_name.rpartition(".")[0] in self.called

    def block_called(self, parameter_name: str) -> bool:
        """Whether the model's top-level block holding this parameter runs its forward."""
        return parameter_name.partition(".")[0] in self.called

    def trained_flags(self, named_parameters) -> list[bool]:
        """For each of `named_parameters`' (name, parameter): whether it receives a gradient."""
        return [p.requires_grad and self.is_trained(name) for name, p in named_parameters]

    def gradient_indices(self, named_parameters) -> list[int]:
        """The indices into `named_parameters` ((name, parameter) pairs) of those that receive a gradient,
        in the order backward produces them."""
        index = {name: i for i, (name, p) in enumerate(named_parameters) if p.requires_grad}
        return [index[name] for name in self.gradient_order if name in index]

    def of(self, named_parameters, runs_by_block: bool = False) -> list[ParameterUse]:
        """Each of `named_parameters`' (name, parameter) ParameterUse; `runs` by the module that owns it
        directly, or with `runs_by_block` by the model's top-level block holding it."""
        called = self.block_called if runs_by_block else self.module_called
        return [
            ParameterUse(p.requires_grad, p.requires_grad and self.is_trained(name), called(name))
            for name, p in named_parameters
        ]


@dataclasses.dataclass(frozen=True)
class ModelParameters:
    """A model's parameters as the strategies' cost functions take them: plain values, in
    model.named_parameters() order (`parameters_of` reads them off a model and its Usage)."""

    shapes: tuple[tuple[int, ...], ...]
    element_bytes: tuple[int, ...]
    uses: tuple[ParameterUse, ...]
    gradient_order: tuple[int, ...]  # the indices of those with a gradient, in the order backward gives them

    @property
    def numels(self) -> list[int]:
        return [math.prod(shape) for shape in self.shapes]

    @property
    def bytes(self) -> list[int]:
        return [n * e for n, e in zip(self.numels, self.element_bytes, strict=True)]

    @property
    def trained(self) -> list[bool]:
        """Whether each receives a gradient."""
        return [use.trained for use in self.uses]


def parameters_of(named_parameters, usage: Usage, runs_by_block: bool = False) -> ModelParameters:
    """`named_parameters` ((name, parameter) pairs) with what `usage` says a step does with each (`runs`
    by the block holding it with `runs_by_block`: Usage.of). Their whole shapes: a DTensor's (FSDP2's
    shards) global one, a ZeRO-3 partition's `ds_shape`."""
    named = list(named_parameters)
    return ModelParameters(
        shapes=tuple(tuple(getattr(p, "ds_shape", p.shape)) for _, p in named),
        element_bytes=tuple(p.element_size() for _, p in named),
        uses=tuple(usage.of(named, runs_by_block)),
        gradient_order=tuple(usage.gradient_indices(named)),
    )


def parameters_by_block(model: nn.Module, usage: Usage) -> list[ModelParameters]:
    """`parameters_of` each of `model`'s top-level blocks (`runs`: whether the block runs), in order."""
    return [
        parameters_of(block.named_parameters(prefix=name), usage, runs_by_block=True)
        for name, block in model.named_children()
    ]


def traced_usage(model: nn.Module, input_shape: tuple[int, ...], tokens: bool) -> Usage:
    """`model` (on the meta device) run once forward and backward on a meta batch of two inputs of
    `input_shape` (token ids if `tokens`, else floats of the model's dtype)."""
    called: list[str] = []
    hooks = [
        module.register_forward_pre_hook(lambda _module, _args, name=name: called.append(name))
        for name, module in model.named_modules()
    ]
    ready: list[str] = []
    hooks += [
        parameter.register_post_accumulate_grad_hook(lambda _parameter, name=name: ready.append(name))
        for name, parameter in model.named_parameters()
        if parameter.requires_grad
    ]
    dtype = torch.long if tokens else next(model.parameters()).dtype
    try:
        with torch.enable_grad():  # (a caller's no_grad would leave every parameter without a gradient)
            output = model(torch.zeros((2, *input_shape), dtype=dtype, device="meta"))
            roots = [
                t for t in torch.utils._pytree.tree_leaves(output) if torch.is_tensor(t) and t.requires_grad
            ]
            if roots:
                torch.autograd.backward([sum(t.float().sum() for t in roots)])
    finally:
        for hook in hooks:
            hook.remove()
    return Usage(gradient_order=tuple(ready), called=frozenset(called))


def model_usage(model_name: str, info, gpt_layers: int, moe: MoEConfig | None = None) -> Usage:
    """The Usage of the model a run builds (`--model`, on `info`: distref.data.DatasetInfo; `moe`:
    RunConfig.moe); `unknown`
    says why where it cannot be found: a model of yours whose forward does not run on the meta device."""
    if is_factory(model_name):  # your MODULE:FUNCTION: traced every time (its code may change what it builds)
        return _traced_model_usage(model_name, info, gpt_layers, moe)
    return _own_model_usage(model_name, info, gpt_layers, moe, torch.nn.functional.linear)


# This project's models are built from their arguments alone, so a process traces each once: a gpt's step on
# meta is 40 ms of CPU, paid by every rank of every run, and a test suite's fork server traces its
# workloads' before it forks the ranks (distref.testing.preloaded_data). Usage is immutable. Keyed by
# torch.nn.functional.linear too: DeepSpeed's ZeRO-3 replaces it for good (mem_efficient_linear), and its
# backward gives a linear layer's weight gradient before its bias's (torch's: the bias's first), an order
# its reduce buckets follow.
@functools.lru_cache(maxsize=8)
def _own_model_usage(model_name: str, info, gpt_layers: int, moe: MoEConfig | None, _linear) -> Usage:
    return _traced_model_usage(model_name, info, gpt_layers, moe)


def _traced_model_usage(model_name: str, info, gpt_layers: int, moe: MoEConfig | None) -> Usage:
    try:
        model = on_meta(lambda: build_model(model_name, info, gpt_layers, moe=moe))
        return traced_usage(model, tuple(info.input_shape), tokens=info.kind == "sequence")
    except Exception as exc:  # (your model's code: whatever it raises)
        first_line = (str(exc).splitlines() or [""])[0]
        return Usage(
            unknown=f"which parameters receive a gradient is found by one forward on the meta device, and "
            f"{model_name}'s failed there ({type(exc).__name__}: {first_line})"
        )
