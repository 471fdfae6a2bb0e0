"""The parity proof on your model and data (--model/--dataset MODULE:FUNCTION) instead of this project's.

Every impl's tests check its strategy on this project's models (lenet, gpt, resnet18): their parameter
names, shapes and accuracy targets are those models'. `test_parity_with_single_on_your_model`, in each
impl's tests, runs the same proof on yours, when named:

    DISTREF_TEST_MODEL=my_project:mlp DISTREF_TEST_DATASET=my_project:data python -m pytest -k your_model

(from the folder MODULE is imported from: the project's). Without them it proves the same on the small
model and dataset below (`example_mlp`, `example_data`), given the same way, as MODULE:FUNCTION. The
proof: a few SGD steps of the impl and of single (the baseline), same seed, same data, same global
batch, end with the same parameters within PARITY_TOLERANCE.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from distref.parity_metric import max_relative_difference
from distref.testing.runs import load_train_module
from distref.testing.workloads import PARITY_TOLERANCE

MODEL_VARIABLE, DATASET_VARIABLE = "DISTREF_TEST_MODEL", "DISTREF_TEST_DATASET"


def example_mlp() -> nn.Module:
    """A model as you would write one: an nn.Sequential of named blocks (so that model_parallel and
    pipeline can cut it, and activation checkpointing recompute it block by block), with the plan
    tensor_parallel splits it by."""
    model = nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(16, 64),
            act1=nn.ReLU(),
            fc2=nn.Linear(64, 32),
            out=nn.Linear(32, 4),  # (takes fc2's output as tensor parallelism leaves it: all-reduced)
        )
    )
    model.tp_plan = {"fc1": "colwise", "fc2": "rowwise"}  # (Megatron's MLP: split rows, then columns)
    return model


def batch_norm_mlp() -> nn.Module:
    """A model of yours with a BatchNorm (its running statistics: fp32 buffers)."""
    return nn.Sequential(
        nn.Linear(16, 32), nn.Sequential(OrderedDict(norm=nn.BatchNorm1d(32))), nn.Linear(32, 4)
    )


def example_data() -> tuple[TensorDataset, TensorDataset]:
    """A dataset as you would give one: (train, test) torch TensorDatasets of (features, class) pairs."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(640, 16, generator=g)
    y = (x[:, :4] + 0.5 * x[:, 4:8]).argmax(dim=1)  # 4 classes, learnable
    return TensorDataset(x[:512], y[:512]), TensorDataset(x[512:], y[512:])


def example_tokens() -> tuple[TensorDataset, TensorDataset]:
    """Token sequences of yours, for --model gpt: 20 tokens of 10 kinds, each target the next token, the
    second half of a sequence repeating its first (a copy task, 10 tokens back)."""
    g = torch.Generator().manual_seed(0)
    half = torch.randint(0, 10, (576, 11), generator=g)
    tokens = torch.cat([half, half[:, :10]], dim=1)  # 21 tokens: inputs 0..19, targets 1..20
    x, y = tokens[:, :-1], tokens[:, 1:]
    return TensorDataset(x[:512], y[:512]), TensorDataset(x[512:], y[512:])


def skewed_tokens() -> tuple[TensorDataset, TensorDataset]:
    """Token sequences of yours where one token is most of every sequence (17 of 20 on average), each
    target the next token: a mixture of experts' router sends most tokens to the same expert (an uneven
    routing: impls/expert_parallel's tests)."""
    g = torch.Generator().manual_seed(0)
    others = torch.randint(1, 10, (576, 21), generator=g)
    tokens = torch.where(torch.rand(576, 21, generator=g) < 0.85, 0, others)
    x, y = tokens[:, :-1], tokens[:, 1:]
    return TensorDataset(x[:512], y[:512]), TensorDataset(x[512:], y[512:])


EXAMPLE_MODEL, EXAMPLE_DATASET = f"{__name__}:example_mlp", f"{__name__}:example_data"


def your_parity_args(steps: int = 10, global_batch_size: int = 32) -> list[str]:
    """The parity workload on your model and dataset (the example's where none is named): SGD, which
    keeps two correct runs within rounding of each other (AdamW would not: docs/parity.md)."""
    model = os.environ.get(MODEL_VARIABLE, EXAMPLE_MODEL)
    dataset = os.environ.get(DATASET_VARIABLE, EXAMPLE_DATASET if model == EXAMPLE_MODEL else "synthetic")
    return [
        *("--model", model, "--dataset", dataset, "--optimizer", "sgd", "--lr", "0.05"),
        *("--steps", str(steps), "--global-batch-size", str(global_batch_size)),
    ]


def check_parity_on_your_model(
    run_impl: Callable[[list[str]], object], tmp_path: Path, args: list[str] | None = None
) -> float:
    """Run the impl (`run_impl(args)`, which must succeed) and single, in this process, on your model and
    data (or on `args`); assert their final parameters agree within PARITY_TOLERANCE; return the
    difference."""
    args = args or your_parity_args()
    run_impl([*args, "--save-final", str(tmp_path / "impl.pt")])
    load_train_module("single").main([*args, "--save-final", str(tmp_path / "single.pt")])
    impl, single = (torch.load(tmp_path / f"{name}.pt", weights_only=True) for name in ("impl", "single"))
    assert impl.keys() == single.keys(), f"parameter names differ: {sorted(impl.keys() ^ single.keys())}"
    difference = max_relative_difference(impl, single)
    assert difference < PARITY_TOLERANCE, f"{args}: max relative difference {difference:.2e} from single"
    return difference


# ---- Start-up: how often a process builds your model and runs it on real tensors ------------------
COUNT_VARIABLE = "DISTREF_COUNT_FILE"  # where each process appends a line per build and per forward


def counted_mlp() -> nn.Module:
    """`example_mlp`, appending to $DISTREF_COUNT_FILE (when set) a line {"pid", "event"} for each build
    on a real device (not the meta device) and each forward of real tensors, as they happen (a rank may
    end without running atexit): tests/test_gpu_speed.py counts them per process."""
    if torch.empty(()).device.type != "meta":
        _count("build")
    model = example_mlp()

    def counted(module: nn.Module, inputs: tuple) -> None:
        if inputs[0].device.type != "meta":
            _count("forward")

    model.fc1.register_forward_pre_hook(counted)  # (the first block: own_model keeps the blocks)
    return model


def _count(event: str) -> None:
    if path := os.environ.get(COUNT_VARIABLE):
        with open(path, "a") as counts:
            counts.write(json.dumps({"pid": os.getpid(), "event": event}) + "\n")
