"""The your-model contract: what a model or dataset of yours, `--model MODULE:FUNCTION` and `--dataset
MODULE:FUNCTION`, must satisfy, and for which impls. Each rule is checked before any rank starts (the
last, the split model's forward, by the ranks before they train) and refused in one line where it does
not hold (docs/own-project.md, "The contract").

Every impl (`own_code_problem`, from distref.cli's validate):
  - each function imports and returns what it must (distref.models.own_model, distref.data.own_dataset):
    the model an nn.Module, the dataset (train, test) datasets of (input, target) pairs;
  - the model's forward takes a few of the dataset's inputs and gives a tensor of logits the loss takes
    with their targets: a finite loss, as many logits as the targets have classes or more; computed as
    the run computes (`--precision`: fp64 parameters and inputs, bf16 or fp16 autocast), on the CPU;
  - with --activation-checkpointing (in an impl that does not cut the model itself), the model is an
    nn.Sequential of blocks: what recomputes block by block.
Cut between ranks (model_parallel, pipeline: `cut_problem`): the model is an ordered sequence of blocks,
its children, each giving the next a tensor, whose composition is its forward (`block_sequence_problem`,
in the run's precision), no parameter is shared by two blocks (`tied_across_blocks`), and the cut gives
every part parameters.
Sharded block by block (fsdp: `own_model_tied_across_blocks`): no parameter shared by two blocks.
Split by tensor parallelism (tensor_parallel: `tp_model_problem`, then `tp_split_problem` on the ranks):
the model carries its plan, `tp_plan` {linear layer's name: "colwise" | "rowwise"}; no parameter is
shared by two blocks; each planned layer's features split over --tp; in an nn.Sequential each colwise
layer's split output reaches a rowwise layer before any other linear layer (`plan_order_problem`); and
the split model computes what the whole one does.

What an impl does with a model that holds to it (the strategy: its cut, its shards, its plan applied)
stays in the impl's train.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import textwrap
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from distref.config import GPT_MODELS, FactoryError, RunConfig, first_line, is_factory
from distref.data import DataError, sample_batch
from distref.distributed.partition import MODEL_DATASETS as PROJECT_DATASETS
from distref.distributed.partition import block_sizes, choose_cut_points, named_block_sizes
from distref.models import BlockModel, build_model, gpt_config, on_meta, own_model, parameter_dtype
from distref.training.device import autocast_for
from distref.training.measure import local_part
from distref.training.steps import loss_sum

PLAN_STYLES = ("colwise", "rowwise")  # what a tp_plan may name (impls/tensor_parallel: STYLES)
# Where the checks try a model: before any rank, so on the CPU, taking no GPU. A CUDA run's autocast is
# tried as the CPU's autocast in its dtype (both cast matmuls, convolutions and attention).
CHECKED_ON = torch.device("cpu")
# Code that is not the model's: where an operation failed is the last line outside these.
LIBRARIES = tuple(str(Path(file).parent) + os.sep for file in (torch.__file__, __file__))


def on_meta_else_real(build: Callable[[], nn.Module]) -> nn.Module:
    """What `build()` returns, on the meta device (no memory, no initialisation) where it builds there,
    else for real (a constructor of yours that reads a value: `.item()`, a copy to the CPU)."""
    try:
        return on_meta(build)
    except FactoryError:
        return build()


def as_the_run_computes(precision: str) -> contextlib.AbstractContextManager:
    """The autocast a run in `precision` computes its forward and loss under (distref.training.device:
    bf16, or fp16 on CUDA; none for fp32 and fp64), on the CPU where the checks try a model."""
    return autocast_for(precision, CHECKED_ON)


def run_inputs(x: torch.Tensor, precision: str) -> torch.Tensor:
    """A sample batch's inputs as the run's are: float ones in the parameters' dtype (float64 under
    fp64, as load_dataset makes them), tokens as they are."""
    return x.to(parameter_dtype(precision)) if x.is_floating_point() else x


@contextlib.contextmanager
def modules_running(model: nn.Module) -> Iterator[list[tuple[str, nn.Module]]]:
    """The model's submodules whose forward is running, outermost first (forward hooks keep the list):
    an exception leaves it as it was where it was raised, its last entry the module that raised it."""
    running: list[tuple[str, nn.Module]] = []

    def left(name: str) -> None:
        while running and running.pop()[0] != name:  # (and any an exception caught inside left behind)
            pass

    handles = []
    for name, module in model.named_modules():
        # (the model itself is no place in it; TorchScript modules take no hooks)
        if name and not isinstance(module, torch.jit.ScriptModule):
            entered = module.register_forward_pre_hook(lambda m, _, name=name: running.append((name, m)))
            handles += [entered, module.register_forward_hook(lambda m, _, __, name=name: left(name))]
    try:
        yield running
    finally:
        for handle in handles:
            handle.remove()


def failure(exc: Exception, running: list[tuple[str, nn.Module]]) -> str:
    """What failed, in one line: the module running when `exc` was raised, the last line of code outside
    torch and distref (the model's, or its library's: the operation that failed), and the exception's
    first line."""
    where = ""
    if running:
        name, module = running[-1]
        where = f" in its module '{name}' ({type(module).__name__})"
    frames = traceback.extract_tb(exc.__traceback__)
    frame = next((f for f in reversed(frames) if not f.filename.startswith(LIBRARIES)), None)
    if frame is not None:
        code = textwrap.shorten(frame.line or "", 80, placeholder=" ...")
        where += f", at {Path(frame.filename).name}:{frame.lineno}" + (f" `{code}`" if code else "")
    return f"{where}: {type(exc).__name__}: {first_line(exc)}"


def described(value: object) -> str:
    """What a forward gave instead of a tensor: its type, and a mapping's keys (a Hugging Face
    ModelOutput is one)."""
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} (keys: {', '.join(map(str, value))})"
    return f"a {type(value).__name__}"


@torch.no_grad()
def first_batch_problem(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str
) -> tuple[torch.Tensor | None, str | None]:
    """(logits, None) of `model` in eval mode on a first batch, forward and loss computed as a run in
    `precision` computes them (its parameters in their dtype already, `x` the run's inputs: run_inputs),
    or (None, why not) in one line."""
    with as_the_run_computes(precision), modules_running(model) as running:
        try:
            logits = model.eval()(x)
        except Exception as exc:  # (your code, or a shape that does not fit: said in one line)
            return None, (
                f"a batch of inputs {tuple(x.shape)} {x.dtype} with targets {tuple(y.shape)} fails in the "
                f"forward{failure(exc, running)}"
            )
        if not isinstance(logits, torch.Tensor):
            return None, (
                f"its forward gives {described(logits)}, not a tensor of logits: return the logits (a "
                "ModelOutput's .logits)"
            )
        try:
            loss = loss_sum(logits, y)  # (as training takes it: a batch scoring no target sums to 0)
        except Exception as exc:
            return None, (
                f"its logits {tuple(logits.shape)} for targets {tuple(y.shape)} fail in the loss "
                f"(cross-entropy): {type(exc).__name__}: {first_line(exc)}"
            )
    if not torch.isfinite(loss):
        return None, f"the loss of a first batch is {loss.item()}"
    return logits, None


def own_code_problem(cfg: RunConfig, cuts_model: bool) -> str | None:
    """A model or dataset of your own (MODULE:FUNCTION), tried before any rank starts: each imports, the
    dataset holds (input, target) pairs, the model is an nn.Module whose forward takes a few of the
    dataset's inputs and gives logits the loss takes with their targets, computed as the run computes
    (its --precision: parameters and inputs in its dtype, under its autocast). With
    --activation-checkpointing (in an impl that does not cut the model itself) the model is an
    nn.Sequential: what recomputes block by block. Models that are cut (model_parallel, pipeline) are
    checked further by the impl (`cut_problem`)."""
    try:
        x, y, info = sample_batch(cfg)
    except (DataError, FactoryError) as exc:
        return str(exc)
    x = run_inputs(x, cfg.precision)
    on = f"--model {cfg.model} on --dataset {cfg.dataset}"
    on += f" with --precision {cfg.precision}" if cfg.precision != "fp32" else ""
    # In fp32, on the meta device first: shapes and dtypes, no parameter initialised and nothing computed
    # (a GPT-2 small took ~20 s per rank on a CPU). A model that needs values to be built or run (.item(),
    # a copy to the CPU, data-dependent shapes) fails there: then it is built and run for real, where its
    # errors are what is said, and the loss must be finite. In other precisions a model of yours is tried
    # for real (this project's run in each): meta tensors are not autocast, and meta kernels let dtypes
    # through that CPU kernels refuse (index_add_ of float64 rows into a buffer made in float32 passed,
    # and the run died in its first step).
    model = None
    if cfg.precision == "fp32" or not is_factory(cfg.model):
        try:
            model = on_meta(lambda: build_model(cfg.model, info, cfg.gpt_layers))
            with torch.no_grad():
                logits = model.eval()(x.to("meta"))
                loss_sum(logits, y.to("meta"))  # (as training takes it)
        except Exception:  # (your code on meta tensors: tried for real below, where its error counts)
            model = None
    if model is None:
        try:
            model = build_model(cfg.model, info, cfg.gpt_layers, parameter_dtype(cfg.precision))
        except (FactoryError, ValueError) as exc:
            return str(exc)
        logits, problem = first_batch_problem(model, x, y, cfg.precision)
        if problem:
            return f"{on}: {problem}"
    if logits.shape[-1] < info.num_classes:  # (the first batch may not hold the largest target)
        return (
            f"{on}: the targets go up to {info.num_classes - 1}, but the model gives {logits.shape[-1]} "
            "logits (one per class)"
        )
    if cfg.activation_checkpointing and not cuts_model and not isinstance(model, BlockModel):
        return (
            f"--activation-checkpointing recomputes the blocks of an nn.Sequential; {cfg.model} returns a "
            f"{type(model).__name__}: build it as an nn.Sequential of blocks, or drop the option"
        )
    return None


# ---- Blocks: a model cut between ranks (model_parallel, pipeline) or sharded block by block (fsdp) ----
def tied_across_blocks(model: nn.Module) -> str | None:
    """The first parameter that two blocks share (tied weights, or one block with parameters used twice),
    in a few words, or None. Impls that split a model by its blocks (cut between ranks, sharded block by
    block) would hold two copies of it, trained apart; this project's models tie none."""
    owner: dict[int, tuple[str, str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        block = name.split(".")[0]
        first_block, first_name = owner.setdefault(id(parameter), (block, name))
        if first_block != block:
            return f"{first_name} and {name} are one parameter, in two blocks ({first_block}, {block})"
    return None


def own_model_tied_across_blocks(name: str) -> str | None:
    """`tied_across_blocks` of a model of yours (built again: validate built and tried it first); None for
    this project's."""
    if not is_factory(name):
        return None
    try:
        return tied_across_blocks(on_meta_else_real(lambda: own_model(name)))
    except FactoryError:
        return None  # (said by validate)


def batch_norm_in_16_bits_problem(cfg: RunConfig, who: str) -> str | None:
    """Why the run cannot compute with 16-bit parameters (FSDP2's bf16 policy, DeepSpeed's bf16 module:
    `who`), or None: its model has a BatchNorm (resnet18, or one in a model of yours), whose weights
    would be 16-bit and its running statistics fp32 buffers, which torch's batch_norm refuses ("expected
    scalar type BFloat16 but found Float", on the CPU and on CUDA)."""
    if cfg.precision not in ("bf16", "fp16"):
        return None
    if cfg.model == "resnet18":
        found = "resnet18's BatchNorm layers keep"
    elif is_factory(cfg.model):
        try:  # (its modules are what matters, not its weights)
            model = on_meta_else_real(lambda: own_model(cfg.model))
        except FactoryError:
            return None  # (said by validate)
        found = next(
            (
                f"its module '{name}' ({type(module).__name__}) keeps"
                for name, module in model.named_modules()
                if isinstance(module, nn.modules.batchnorm._BatchNorm)
            ),
            None,
        )
        if found is None:
            return None
    else:
        return None
    return (
        f"--model {cfg.model} --precision {cfg.precision}: {who} computes with {cfg.precision} parameters, "
        f"but {found} fp32 running statistics, which torch's batch_norm refuses; use --precision fp32"
    )


@torch.no_grad()
def block_sequence_problem(model: nn.Module, sample: torch.Tensor, precision: str = "fp32") -> str | None:
    """Why `model` is not an ordered sequence of blocks (its children, applied in order, each giving the
    next a tensor, giving its forward), or None: what model parallelism and pipelines cut between ranks
    (each part runs its blocks in order and sends a tensor on; whatever else the model's forward does
    would be lost without a word). Checked on a sample batch, in eval mode (no BatchNorm statistics
    change, no dropout), as a run in `precision` computes (the parameters in its dtype already, `sample`
    the run's inputs: run_inputs)."""
    blocks = list(model.named_children())
    if not blocks:
        return f"a {type(model).__name__} with no child modules: nothing to cut into blocks"
    if own := [name for name, _ in model.named_parameters(recurse=False)]:
        return f"its parameters {', '.join(own)} belong to no block: put them in a block (a child module)"
    was_training = model.training
    model.eval()
    try:
        with as_the_run_computes(precision), modules_running(model) as running:
            try:
                whole = model(sample)
            except Exception as exc:  # (validate tried it already: said here too, in one line)
                return f"its forward fails{failure(exc, running)}"
            x = sample
            for name, block in blocks:
                try:
                    x = block(x)
                except Exception as exc:
                    return f"applying its blocks in order fails{failure(exc, running)}"
                # (a ModelOutput, a dict, a tuple: what a rank cannot send the next)
                if not isinstance(x, torch.Tensor):
                    return (
                        f"its block {name} ({type(block).__name__}) gives {described(x)}, not a tensor: "
                        "each block's output is the next block's input, sent between ranks where the "
                        "model is cut; make each block return a tensor (e.g. wrap it in a module that "
                        "returns the output's hidden states)"
                    )
    finally:
        model.train(was_training)
    if (
        not isinstance(whole, torch.Tensor)
        or x.shape != whole.shape
        or not torch.allclose(x, whole, rtol=1e-5, atol=1e-6)
    ):
        names = ", ".join(name for name, _ in blocks)
        return (
            f"its forward is not its blocks ({names}) applied in order: an operation in forward (a ReLU, a "
            "flatten) would be dropped when it is cut; make each one a block, e.g. an nn.Sequential"
        )
    return None


def cut_problem(cfg: RunConfig, text: str | None, parts: int) -> str | None:
    """Why the run's model cannot be cut into `parts` parts (`text`: --partition), or None; checked before
    any rank starts. A model of your own (MODULE:FUNCTION) is built and tried on a sample batch of the
    run's data, in the run's precision: it must be an ordered sequence of blocks
    (`block_sequence_problem`), and the cut (distref.distributed.partition) must give every part
    parameters."""
    if not is_factory(cfg.model):
        return choose_cut_points(named_block_sizes(cfg.model, cfg.gpt_layers), text, parts, cfg.model)[1]
    try:
        x, _, info = sample_batch(cfg)
        model = build_model(cfg.model, info, dtype=parameter_dtype(cfg.precision))  # (as the run builds it)
    except (DataError, FactoryError) as exc:
        return str(exc)
    if tied := tied_across_blocks(model):  # (each part would train a copy of its own)
        return f"--model {cfg.model} cannot be cut between ranks: {tied}; keep tied parameters in one block"
    if problem := block_sequence_problem(model, run_inputs(x, cfg.precision), cfg.precision):
        return f"--model {cfg.model} cannot be cut between ranks: {problem}"
    return choose_cut_points(block_sizes(model), text, parts, cfg.model)[1]


# ---- A plan: a model split by tensor parallelism (tensor_parallel) ----------------------------------
def tp_model_problem(
    model_name: str, tp: int, *, sequence_parallel: bool | None, loss_parallel: bool | None
) -> str | None:
    """A model split over `tp` ranks by impls/tensor_parallel: gpt, whose heads and MLP units split `tp`
    ways, or a model of yours carrying a plan (`apply_own_plan`) naming its linear layers, each
    splittable `tp` ways (sequence and loss parallelism are gpt's). None if it splits."""
    if not is_factory(model_name):
        if model_name not in GPT_MODELS:
            return (
                f"--model {model_name}: tensor parallelism here splits gpt's attention heads and MLP, or a "
                "model of yours by its tp_plan; use --model gpt, gpt2 or MODULE:FUNCTION"
            )
        gpt = gpt_config(model_name, PROJECT_DATASETS[model_name])  # (heads and width: not the data's)
        if gpt.n_head % tp or (4 * gpt.n_embd) % tp:
            return (
                f"--tp {tp} must divide {model_name}'s {gpt.n_head} attention heads and its MLP's "
                f"{4 * gpt.n_embd} units"
            )
        return None
    if sequence_parallel or loss_parallel:
        return (
            "--sequence-parallel and --loss-parallel split gpt's layer norms and vocabulary, not a model "
            "of yours"
        )
    model = on_meta_else_real(lambda: build_model(model_name, None))  # (validate built it already: it builds)
    if tied := tied_across_blocks(model):  # a split parameter and its unsplit twin would drift apart
        return f"--model {model_name}: {tied}; tensor parallelism here splits layers of their own"
    plan = getattr(model, "tp_plan", None)
    if not isinstance(plan, dict) or not plan:
        return (
            f"--model {model_name}: tensor parallelism needs the model's plan, a `tp_plan` attribute "
            '{submodule name: "colwise" | "rowwise"}, e.g. {"fc1": "colwise", "fc2": "rowwise"}'
        )
    modules = dict(model.named_modules())
    for name, style in plan.items():
        if style not in PLAN_STYLES:
            return f'--model {model_name}: tp_plan[{name!r}] is {style!r}, not "colwise" or "rowwise"'
        if not isinstance(modules.get(name), nn.Linear):
            return f"--model {model_name}: tp_plan names {name!r}, which is not a linear layer of the model"
        features = modules[name].out_features if style == "colwise" else modules[name].in_features
        if features % tp:
            which = "outputs" if style == "colwise" else "inputs"
            return f"--model {model_name}: {name}'s {features} {which} ({style}) do not split over --tp {tp}"
    if isinstance(model, nn.Sequential) and (problem := plan_order_problem(model, plan)):
        return f"--model {model_name}: {problem}"
    return None


def plan_order_problem(model: nn.Sequential, plan: dict[str, str]) -> str | None:
    """A plan's layers in the order a (nested) nn.Sequential applies them: each colwise layer's split
    output must reach a rowwise layer (which sums it whole again) before any other linear layer, and the
    model must end whole. (What lies between, the ranks check: `tp_split_problem`.)"""
    split_by = None  # the colwise layer whose split output flows now, if any
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        style = plan.get(name)
        if style == "colwise" and split_by:
            return f"{name} is colwise, but its input is {split_by}'s split output: make {name} rowwise"
        if style == "rowwise" and not split_by:
            return f"{name} is rowwise, but its input is whole: a colwise layer must come before it"
        if style is None and split_by:
            return f"{name} takes {split_by}'s split output: make {name} rowwise (or add it to the plan)"
        split_by = name if style == "colwise" else None
    return f"the model ends split ({split_by} is colwise): end with a rowwise layer" if split_by else None


@torch.no_grad()
def tp_split_problem(
    model: nn.Module, whole: nn.Module, sample: torch.Tensor, device: torch.device, model_name: str
) -> str | None:
    """Why the split `model` (a model of yours, split by its tp_plan) does not compute what `whole`, the
    same parameters unsplit, does on `sample` (the first training inputs) on `device` in eval mode, or
    None; None for this project's models. Every rank gets the same answer (the split model's output is
    whole on every rank). A collective: every rank calls it."""
    if not is_factory(model_name):
        return None
    sample = sample.to(device)
    whole.to(device).eval()
    model.eval()
    # (DTensor's sharding propagation logs a failed shape check as a traceback of its own: said here)
    propagation_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = propagation_log.level
    propagation_log.setLevel(logging.CRITICAL)
    try:
        split = local_part(model(sample))
    except Exception as exc:
        return f"--model {model_name}: its tp_plan fails in forward ({type(exc).__name__}: {first_line(exc)})"
    finally:
        model.train()
        propagation_log.setLevel(level)
    expected = whole(sample)
    whole.to("cpu").train()
    if split.shape != expected.shape or not torch.allclose(split, expected, rtol=1e-4, atol=1e-5):
        return (
            f"--model {model_name}: split by its tp_plan {dict(model.tp_plan)} it does not compute its "
            "forward (a colwise layer's sliced output must reach a rowwise layer through element-wise "
            "operations only)"
        )
    return None
