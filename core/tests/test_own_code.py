"""Your own model and data: `--model MODULE:FUNCTION` and `--dataset MODULE:FUNCTION` in every impl.

Each function is checked before any rank starts and refused in one line where its contract does not
hold; what holds trains, in every impl, as single does (the impls' `test_parity_with_single_on_your_model`
proves that on distref.testing.own's example; here, a module written by the test in the folder a run
starts from).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import textwrap

import pytest
import torch

from distref.config import RunConfig
from distref.data import own_dataset
from distref.models import BlockModel, build_model
from distref.testing import (
    count_block_calls,
    load_train_module,
    run_forked,
    run_ranks,
    run_script,
    train_path,
)
from distref.your_model import cut_problem, own_code_problem

MINE = textwrap.dedent('''
    """A project's own models and datasets, as a user writes them."""
    import os
    from collections import OrderedDict

    import numpy as np
    import torch
    from torch import nn
    from torch.utils.data import Dataset, TensorDataset


    def mlp():
        return nn.Sequential(OrderedDict(fc1=nn.Linear(16, 32), act=nn.ReLU(), fc2=nn.Linear(32, 4)))


    class Dropped(nn.Module):
        """Blocks fc1, fc2, and a ReLU in forward: cut between fc1 and fc2, the ReLU would be lost."""

        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))


    def dropped():
        return Dropped()


    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 4)

        def forward(self, x):
            return self.fc2(x + torch.relu(self.fc1(x)))


    def residual():
        return Residual()


    def starts_without_parameters():
        return nn.Sequential(OrderedDict(scale=nn.Tanh(), fc1=nn.Linear(16, 8), fc2=nn.Linear(8, 4)))


    def softmax_between():
        """A plan that names linear layers but splits what is not element-wise: softmax over a slice."""
        model = nn.Sequential(OrderedDict(fc1=nn.Linear(16, 32), soft=nn.Softmax(-1), fc2=nn.Linear(32, 4)))
        model.tp_plan = {"fc1": "colwise", "fc2": "rowwise"}
        return model


    def wrong_input():
        return nn.Sequential(nn.Linear(10, 4))


    def not_a_module():
        return 3


    def raises():
        raise ValueError("boom\\nand a second line")


    def tied_weights():
        model = nn.Sequential(
            OrderedDict(a=nn.Linear(16, 16), act=nn.ReLU(), b=nn.Linear(16, 16), out=nn.Linear(16, 4))
        )
        model.b.weight = model.a.weight
        return model


    def shared_relu():
        act = nn.ReLU()  # one module, used twice
        return nn.Sequential(nn.Linear(16, 32), act, nn.Linear(32, 32), act, nn.Linear(32, 4))


    def rowwise_first():
        model = mlp()
        model.tp_plan = {"fc1": "rowwise"}
        return model


    def without_plan_pieces():
        model = mlp()
        model.tp_plan = {"act": "colwise"}
        return model


    def _tensors(n=256):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, 16, generator=g)
        return x, x[:, :4].argmax(dim=1)


    def data():
        x, y = _tensors()
        return TensorDataset(x[:192], y[:192]), TensorDataset(x[192:], y[192:])


    class Pairs(Dataset):
        """Any map-style dataset: numpy features, int labels."""

        def __init__(self, x, y):
            self.x, self.y = x.numpy(), y.tolist()

        def __len__(self):
            return len(self.y)

        def __getitem__(self, i):
            return self.x[i], self.y[i]


    def own_class():
        x, y = _tensors()
        return Pairs(x[:192], y[:192]), Pairs(x[192:], y[192:])


    def float_targets():
        x, y = _tensors()
        return TensorDataset(x, y.float()), TensorDataset(x, y.float())


    def one_set():
        return data()[0]


    def numpy_shuffled():
        """Shuffled by numpy's global random numbers: the same in every process only because they are
        seeded when the function is called."""
        x, y = _tensors()
        order = torch.as_tensor(np.random.permutation(len(x)))
        return TensorDataset(x[order][:192], y[order][:192]), TensorDataset(x[order][192:], y[order][192:])


    def other_in_each_process():
        import os

        g = torch.Generator().manual_seed(os.getpid())
        x = torch.randn(256, 16, generator=g)
        return TensorDataset(x, x[:, :4].argmax(dim=1)), TensorDataset(x, x[:, :4].argmax(dim=1))


    def class_10():
        x, y = _tensors()
        y[100] = 10  # a fifth class, deep in the set, for a model of 4 logits
        return TensorDataset(x, y), TensorDataset(x, y)


    def nan_input():
        x, y = _tensors()
        x[200, 3] = float("nan")
        return TensorDataset(x, y), TensorDataset(x, y)


    def first_unscored():
        """Its first samples score nothing (targets -100, as padding): their mean loss is 0/0."""
        x, y = _tensors()
        y[:8] = -100
        return TensorDataset(x, y), TensorDataset(x, y)


    def words():
        return [("a sentence", 0)] * 8, [("another", 1)] * 8


    def slow_on_rank_1():
        import time

        if os.environ.get("RANK") == "1":
            time.sleep(8)
        return data()


    def unseeded():
        """Initial weights from the clock: each rank builds other ones."""
        torch.seed()
        return dropout_mlp()


    class DataDependent(nn.Module):
        """A forward that reads a value (`.item()`): it cannot run on the meta device."""

        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

        def forward(self, x):
            hidden = torch.relu(self.fc1(x))
            return self.fc2(hidden if hidden.sum().item() >= 0 else -hidden)


    def data_dependent():
        return DataDependent()


    def built_from_values():
        """A constructor that reads a value (`.item()`): it cannot be built on the meta device."""
        model = mlp()
        width = int(model.fc1.weight.abs().sum().item() > 0) * 32
        assert width == 32
        return model


    def tied_built_from_values():
        """Tied weights, and a constructor that reads a value: checked for real, the tie still found."""
        model = tied_weights()
        assert model.a.weight.abs().sum().item() > 0
        return model


    class WithLock(nn.Sequential):
        """Holds a lock (a model with a cache, a file handle): deepcopy raises TypeError."""

        def __init__(self):
            super().__init__(OrderedDict(fc1=nn.Linear(16, 32), act=nn.ReLU(), fc2=nn.Linear(32, 4)))
            import threading

            self.lock = threading.Lock()


    def with_lock():
        return WithLock()


    def planned_from_values():
        """example_mlp's tensor-parallel plan, and a constructor that reads a value."""
        from distref.testing.own import example_mlp

        model = example_mlp()
        assert model.fc1.weight.abs().sum().item() > 0
        return model


    def weight_normed():
        """Holds a non-leaf tensor as an attribute (nn.utils.weight_norm's `weight`): deepcopy refuses it."""
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return nn.Sequential(
                OrderedDict(fc1=nn.utils.weight_norm(nn.Linear(16, 32)), act=nn.ReLU(), fc2=nn.Linear(32, 4))
            )


    class NanOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 4)

        def forward(self, x):
            return self.fc(x) * float("nan")


    def nan_out():
        return NanOut()


    class WithUnused(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.spare = nn.Linear(16, 32), nn.Linear(32, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))


    def with_unused():
        return WithUnused()


    class MaskProbe(nn.Module):
        """Dropout that keeps the masks it drew, one file per rank and step, in $MASKS."""

        def __init__(self, name):
            super().__init__()
            self.name, self.calls = name, 0

        def forward(self, x):
            out = nn.functional.dropout(x, 0.5, self.training)
            if self.training and "MASKS" in os.environ and not x.is_meta:  # (meta: the cost model's trace)
                rank = os.environ.get("RANK", "0")
                torch.save(out != 0, f"{os.environ['MASKS']}/{self.name}-{rank}-{self.calls}.pt")
                self.calls += 1
            return out


    def dropout_nested():
        """The colwise layer inside a block of its own (Linear, GELU): recomputed in backward, apart from
        the rowwise layer that ends its split."""
        model = nn.Sequential(
            OrderedDict(
                fc1=nn.Sequential(nn.Linear(16, 32), nn.GELU()), inner=MaskProbe("inner"),
                fc2=nn.Linear(32, 16), outer=MaskProbe("outer"), out=nn.Linear(16, 4),
            )
        )
        model.tp_plan = {"fc1.0": "colwise", "fc2": "rowwise"}
        return model


    def dropout_mlp():
        """Megatron's MLP with dropout inside the split (hidden units: each rank its own) and after it
        (whole on every rank of a tensor-parallel group)."""
        model = nn.Sequential(
            OrderedDict(
                fc1=nn.Linear(16, 32), inner=MaskProbe("inner"), fc2=nn.Linear(32, 16),
                outer=MaskProbe("outer"), out=nn.Linear(16, 4),
            )
        )
        model.tp_plan = {"fc1": "colwise", "fc2": "rowwise"}
        return model


    def ragged():
        return [(torch.zeros(16), 0), (torch.zeros(15), 1)], [(torch.zeros(16), 0)]


    class CausalLMOutput(OrderedDict):
        """As transformers' ModelOutput: a dict whose items are attributes too."""

        def __getattr__(self, name):
            if name in self:
                return self[name]
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")


    class LMHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 4)

        def forward(self, x):
            return CausalLMOutput(logits=self.fc(x))


    class LMOutputLast(nn.Module):
        """Its forward gives a tensor (the output's .logits), its last child a ModelOutput."""

        def __init__(self):
            super().__init__()
            self.fc1, self.act, self.lm = nn.Linear(16, 32), nn.ReLU(), LMHead()

        def forward(self, x):
            return self.lm(self.act(self.fc1(x))).logits


    def lm_output_last():
        return LMOutputLast()


    class DictBody(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 32)

        def forward(self, x):
            return {"hidden": torch.relu(self.fc(x))}


    class DictInside(nn.Module):
        """Its first child gives a dict, which its forward unpacks for the second."""

        def __init__(self):
            super().__init__()
            self.body, self.head = DictBody(), nn.Linear(32, 4)

        def forward(self, x):
            return self.head(self.body(x)["hidden"])


    def dict_inside():
        return DictInside()


    def dict_out():
        return DictBody()


    class Scattered(nn.Module):
        """Adds its rows into a buffer made in torch's default dtype (float32), as a mixture of experts
        gathers its experts' outputs: index_add_ refuses rows of another dtype (bf16 or fp16 under
        autocast, float64 under --precision fp64), where the meta device lets them through."""

        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 32)

        def forward(self, x):
            out = torch.zeros(x.shape[0], 32, device=x.device)
            return out.index_add_(0, torch.arange(x.shape[0], device=x.device), self.fc(x))


    def scattered():
        return nn.Sequential(
            OrderedDict(fc1=nn.Linear(16, 32), mix=Scattered(), act=nn.ReLU(), fc2=nn.Linear(32, 4))
        )


    class GroupedExperts(nn.Module):
        """Two experts in one torch._grouped_mm, as transformers computes Mixtral's by default: it takes
        float32, bf16 or fp16, and refuses float64 (and its meta kernel anything but bf16)."""

        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(2, 32, 32) / 32**0.5)

        def forward(self, x):
            offs = torch.tensor([x.shape[0] // 2, x.shape[0]], dtype=torch.int32, device=x.device)
            return torch._grouped_mm(x, self.w, offs=offs)


    def grouped():
        return nn.Sequential(
            OrderedDict(fc1=nn.Linear(16, 32), experts=GroupedExperts(), act=nn.ReLU(), fc2=nn.Linear(32, 4))
        )
''')


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A folder holding mine.py, the current folder (a run imports MODULE from where it starts)."""
    (tmp_path / "mine.py").write_text(MINE)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("mine", None)


ON_MINE = ["--dataset", "mine:data"]


@pytest.mark.parametrize(
    ("impl", "args", "said"),
    [
        (
            "single",
            ["--model", "mlp"],
            "--model: 'mlp': choose from lenet, resnet18, gpt, gpt2, or give MODULE:FUNCTION",
        ),
        ("single", ["--model", "mine:nothere", *ON_MINE], "mine ("),  # ... has no function nothere
        ("single", ["--model", "nomodule:mlp", *ON_MINE], "--model nomodule:mlp: cannot import nomodule"),
        (
            "single",
            ["--model", "mine:raises", *ON_MINE],
            "--model mine:raises: raises() failed: ValueError: boom",
        ),
        ("ddp", ["--model", "mine:not_a_module", *ON_MINE], "returned a int, not a torch.nn.Module"),
        ("single", ["--model", "mine:wrong_input", *ON_MINE], "a batch of inputs (4, 16) torch.float32"),
        ("single", ["--model", "lenet", *ON_MINE], "lenet takes 1×28×28 images, mine:data has (16,)"),
        (
            "fsdp",
            ["--model", "mine:residual", *ON_MINE, "--activation-checkpointing"],
            "--activation-checkpointing recomputes the blocks of an nn.Sequential; mine:residual returns a "
            "Residual",
        ),
        (
            "pipeline",
            ["--model", "mine:dropped", *ON_MINE],
            "its forward is not its blocks (fc1, fc2) applied",
        ),
        ("model_parallel", ["--model", "mine:dropped", *ON_MINE], "cannot be cut between ranks"),
        (
            "pipeline",
            ["--model", "mine:starts_without_parameters", *ON_MINE, "--partition", "1"],
            "--partition 1: part scale holds no parameters; every rank needs some",
        ),
        ("tensor_parallel", ["--model", "mine:mlp", *ON_MINE], "a `tp_plan` attribute"),
        (
            "tensor_parallel",
            ["--model", "mine:without_plan_pieces", *ON_MINE],
            "'act', which is not a linear",
        ),
        ("single", ["--model", "mine:mlp", "--dataset", "mine:float_targets"], "targets are torch.float32"),
        (
            "pipeline",
            ["--model", "mine:tied_weights", *ON_MINE],
            "a.weight and b.weight are one parameter, in two blocks (a, b); keep tied parameters in one block",
        ),
        ("fsdp", ["--model", "mine:tied_weights", *ON_MINE], "fsdp shards each block on its own"),
        (
            "fsdp",
            ["--model", "mine:tied_built_from_values", *ON_MINE],
            "fsdp shards each block on its own",
        ),
        (
            "tensor_parallel",
            ["--model", "mine:rowwise_first", *ON_MINE],
            "fc1 is rowwise, but its input is whole",
        ),
        (
            "single",
            ["--model", "mine:mlp", "--dataset", "mine:class_10"],
            "the targets go up to 10, but the model gives 4 logits",
        ),
        (
            "single",
            ["--model", "mine:mlp", "--dataset", "mine:nan_input"],
            "item 200's input holds nan or inf",
        ),
        (
            "single",
            ["--model", "mine:mlp", "--dataset", "mine:words"],
            "item 0's input, a str, is not a tensor",
        ),
        (
            "single",
            ["--model", "mine:mlp", "--dataset", "mine:one_set"],
            "must return (train, test) datasets",
        ),
        ("single", ["--model", "mine:mlp", "--dataset", "mine:ragged"], "inputs of several shapes"),
        ("single", ["--model", "mine:mlp", "--dataset", "mine:nothere"], "--dataset mine:nothere: mine ("),
        (  # (it printed AttributeError's traceback: "'CausalLMOutput' object has no attribute 'shape'")
            "pipeline",
            ["--model", "mine:lm_output_last", *ON_MINE],
            "cannot be cut between ranks: its block lm (LMHead) gives a CausalLMOutput (keys: logits), not a "
            "tensor",
        ),
        ("single", ["--model", "mine:dict_out", *ON_MINE], "its forward gives a dict (keys: hidden), not a"),
        (  # (tried in fp32 only, it passed, and every rank died in its first step)
            "ddp",
            ["--model", "mine:scattered", *ON_MINE, "--precision", "fp64"],
            "with --precision fp64: a batch of inputs (4, 16) torch.float64 with targets (4,) fails in the "
            "forward in its module 'mix' (Scattered), at mine.py:",
        ),
    ],
)
def test_a_broken_contract_is_one_line_before_any_rank(impl, args, said, project, capsys):
    """Each refused in one line, exit 2, by the parse every impl runs before it starts ranks."""
    with pytest.raises(SystemExit) as exited:
        load_train_module(impl).parse_options(args, 2 if impl != "single" else 1)
    assert exited.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and said in lines[0], lines


@pytest.mark.parametrize(
    ("model", "precision", "said"),
    [
        ("mlp", "fp64", None),
        ("mlp", "bf16", None),
        ("mlp", "fp16", None),
        ("scattered", "fp32", None),
        (
            "scattered",
            "fp64",
            "index_add_(): self (Float) and source (Double) must have the same scalar type",
        ),
        (
            "scattered",
            "bf16",
            "index_add_(): self (Float) and source (BFloat16) must have the same scalar type",
        ),
        ("scattered", "fp16", "index_add_(): self (Float) and source (Half) must have the same scalar type"),
        ("grouped", "fp32", None),
        (
            "grouped",
            "fp64",
            "RuntimeError: Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double",
        ),
    ],
)
def test_your_model_is_tried_as_the_run_computes(model, precision, said, project):
    """Before any rank, on the CPU, in the run's --precision: parameters and inputs in float64 under fp64,
    under bf16 or fp16 autocast (fp16: a CUDA run, tried with the CPU's fp16 autocast, no GPU touched).
    Tried in fp32 only, a model refusing the run's dtype passed, and each rank died in its first step
    (Mixtral's grouped-mm experts under fp64); now one line names the module, the line and the error."""
    if model == "grouped" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is newer than this torch")
    device = "cuda" if precision == "fp16" else "auto"  # (fp16 runs on CUDA)
    cfg = RunConfig(model=f"mine:{model}", dataset="mine:data", precision=precision, device=device)
    problem = own_code_problem(cfg, cuts_model=False)
    if said is None:
        assert problem is None
    else:
        module = "'mix' (Scattered)" if model == "scattered" else "'experts' (GroupedExperts)"
        assert problem.startswith(
            f"--model mine:{model} on --dataset mine:data with --precision {precision}: "
        )
        assert f"fails in the forward in its module {module}, at mine.py:" in problem, problem
        assert problem.endswith(said), problem
    assert not torch.cuda.is_initialized()


def test_a_model_cut_between_ranks_gives_tensors_block_to_block_in_the_run_s_precision(project):
    """Each block's output is what a rank sends the next: a child giving a dict or a ModelOutput is named
    (the last one's gave an AttributeError traceback). The model is built and tried as the run builds it,
    in its precision."""

    def cut(model: str, precision: str = "fp32") -> str | None:
        return cut_problem(
            RunConfig(model=f"mine:{model}", dataset="mine:data", precision=precision), None, 2
        )

    assert cut("dict_inside") == (
        "--model mine:dict_inside cannot be cut between ranks: its block body (DictBody) gives a dict (keys: "
        "hidden), not a tensor: each block's output is the next block's input, sent between ranks where the "
        "model is cut; make each block return a tensor (e.g. wrap it in a module that returns the output's "
        "hidden states)"
    )
    assert "its block lm (LMHead) gives a CausalLMOutput (keys: logits), not a tensor" in cut(
        "lm_output_last"
    )
    assert cut("mlp", "fp64") is None and cut("mlp", "bf16") is None
    said = cut("scattered", "bf16")
    assert said.startswith(
        "--model mine:scattered cannot be cut between ranks: its forward fails in its "
        "module 'mix' (Scattered), at mine.py:"
    ), said
    assert said.endswith("index_add_(): self (Float) and source (BFloat16) must have the same scalar type")


def test_your_model_and_data_train_from_the_folder_you_run_in(project):
    """single, run from the project's folder: the functions are imported from there; any map-style
    dataset of (input, target) pairs is read into tensors; MNIST (the default dataset) is not prepared;
    the record names the functions, and the model trained."""
    data_root = project / "data"
    out = project / "run"
    args = ["--model", "mine:mlp", "--dataset", "mine:own_class", "--data-root", str(data_root)]
    record = load_train_module("single").main(
        [*args, "--steps", "60", "--optimizer", "sgd", "--lr", "0.1", "--out", str(out)]
    )
    assert record["status"] == "completed"
    assert (record["config"]["model"], record["config"]["dataset"]) == ("mine:mlp", "mine:own_class")
    assert json.loads((out / "record.json").read_text())["config"]["model"] == "mine:mlp"
    assert record["final_accuracy"] > 0.8  # (4 classes: chance is 0.25)
    assert not data_root.exists()  # nothing prepared for a dataset the run does not use


def test_ranks_import_your_functions_and_the_cut_is_of_your_model(project):
    """pipeline's ranks, started in the project's folder (as torchrun starts them there): each imports
    mine.py and reads the same data (shuffled by numpy's random numbers, seeded for the call: the ranks'
    sha256 agree); the stages are cut from the model built (3 blocks, not lenet's 4)."""
    args = ["--model", "mine:mlp", "--dataset", "mine:numpy_shuffled", "--steps", "4"]
    result = run_ranks(2, str(train_path("pipeline")), args, env=dict(os.environ), timeout=120, cwd=project)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "cut at [1] (balancing parameter counts): fc1 | act,fc2" in result.stdout


@pytest.mark.faults
@pytest.mark.parametrize(
    ("impl", "args", "said"),
    [
        ("ddp", ["--dataset", "mine:other_in_each_process"], "the ranks read different data (rank 0: sha256"),
        ("pipeline", ["--dataset", "mine:other_in_each_process"], "other_in_each_process() must return"),
        ("fsdp", ["--model", "mine:unseeded"], "the ranks built different initial parameters (rank 0"),
        ("tensor_parallel", ["--model", "mine:unseeded"], "unseeded() must build the same model"),
    ],
)
def test_ranks_that_read_other_data_or_built_other_models_say_so_on_every_launch_path(
    impl, args, said, project
):
    """A dataset or model function that gives each process other samples or weights would train each
    rank on other data, or assemble one model from several, without a word: the ranks compare sha256s
    in one all-gather, under torchrun's ranks (here forked as torchrun starts them: no launcher checked
    anything) as under `python train.py`. One line, from rank 0."""
    full = {"--model": "mine:dropout_mlp", "--dataset": "mine:data"}
    full.update(zip(args[::2], args[1::2], strict=True))
    argv = [*(token for pair in full.items() for token in pair), "--steps", "2"]
    result = run_ranks(2, str(train_path(impl)), argv, env=dict(os.environ), timeout=120, cwd=project)
    # (run_ranks says 1 for any failed rank; `python train.py` passes a rank's 2 on: the test below)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    said_lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(said_lines) == 1 and said in said_lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_the_launcher_s_ranks_check_their_data_too_and_it_keeps_no_copy(project, monkeypatch):
    """`python train.py --nproc-per-node 2`: the same one line; and the launcher, which read the dataset
    to check the options, lets its copy go before it waits for the ranks."""
    args = ["--model", "mine:mlp", "--dataset", "mine:other_in_each_process", "--steps", "2"]
    result = run_script([sys.executable, str(train_path("ddp")), *args], cwd=project, timeout=120)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    said = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(said) == 1 and "the ranks read different data" in said[0], said
    assert "Traceback" not in result.stderr

    import torch.distributed.run

    from distref.data import datasets
    from distref.distributed import launch

    kept = {}
    monkeypatch.setattr(torch.distributed.run, "run", lambda _args: kept.update(datasets._OWN_DATASETS))
    argv = ["--model", "mine:mlp", "--dataset", "mine:data", "--nproc-per-node", "2"]
    cfg = load_train_module("ddp").parse_options(argv)
    assert datasets._OWN_DATASETS  # (read by the checks)
    with pytest.raises(SystemExit):
        launch.launch_ranks(str(train_path("ddp")), argv, cfg, "ddp")
    assert kept == {}


@pytest.mark.faults
def test_a_rank_slow_to_read_its_data_is_named_in_one_line_once_the_timeout_passes(project):
    """Each rank reads (and checks) the data before it joins the others: one that takes longer than
    --timeout ended the job in a DistStoreError traceback from init_process_group."""
    args = ["--model", "mine:mlp", "--dataset", "mine:slow_on_rank_1", "--steps", "2", "--timeout", "2"]
    result = run_ranks(2, str(train_path("ddp")), args, env=dict(os.environ), timeout=120, cwd=project)
    assert result.returncode == 1
    said = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(said) == 1, result.stderr[-2000:]
    assert "rank 0 waited 2 s (--timeout) for rank 1 to start and gave up" in said[0]
    assert "Traceback" not in result.stderr


def test_ddp_trains_a_model_with_an_unused_parameter_as_single_does(project, tmp_path):
    """DDP's reducer waits for every parameter's gradient: a parameter the loss never reaches ended step 2
    in `Expected to have finished reduction` on every rank. Found before training (a forward and backward
    on the meta device), named, and DDP told to look for it (find_unused_parameters); its gradient stays
    None, so SGD leaves it as single does."""
    args = ["--model", "mine:with_unused", "--dataset", "mine:data", "--steps", "3", "--optimizer", "sgd"]
    args += ["--global-batch-size", "32"]
    result = run_ranks(
        2,
        str(train_path("ddp")),
        [*args, "--save-final", str(tmp_path / "ddp.pt")],
        env=dict(os.environ),
        timeout=120,
        cwd=project,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ddp: spare.weight, spare.bias not used by the loss: DDP looks for unused" in result.stdout
    load_train_module("single").main([*args, "--save-final", str(tmp_path / "single.pt")])
    ddp, single = (torch.load(tmp_path / f"{name}.pt", weights_only=True) for name in ("ddp", "single"))
    for name in single:
        torch.testing.assert_close(ddp[name], single[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["fsdp", "pipeline"])
def test_a_model_with_unused_parameters_resumes_from_its_sharded_checkpoint_exactly(impl, tmp_path):
    """A parameter no loss reaches has no gradient, so no optimizer state in a torch.distributed.checkpoint
    folder: the resume loads the others' and creates none for it (torch's get_state_dict would, and DCP
    then refused the checkpoint as missing it). Bit-identical to a run that never stopped, and holding the
    same model states."""
    from distref.testing.cost import PARTLY_TRAINED_RUN

    args = [
        *PARTLY_TRAINED_RUN[: PARTLY_TRAINED_RUN.index("--steps")],
        "--steps",
        "4",
        "--global-batch-size",
        "24",
    ]

    def run(*more: str) -> None:
        result = run_ranks(2, str(train_path(impl)), [*args, "--timeout", "60", *more], timeout=180)
        assert result.returncode == 0, result.stderr[-2000:]

    run("--out", str(tmp_path / "whole"), "--save-final", str(tmp_path / "whole.pt"))
    run(
        "--out",
        str(tmp_path / "first"),
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--checkpoint-every",
        "2",
    )
    step_2 = str(tmp_path / "ckpt" / "step-00000002.pt")
    run("--out", str(tmp_path / "resumed"), "--resume", step_2, "--save-final", str(tmp_path / "resumed.pt"))
    whole, resumed = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("whole", "resumed"))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    records = [json.loads((tmp_path / n / "record.json").read_text()) for n in ("whole", "resumed")]
    assert records[0]["model_state_bytes"] == records[1]["model_state_bytes"]


def test_the_model_fingerprint_covers_every_value_buffers_and_zero_dim_ones_included():
    from distref.distributed.agreement import state_fingerprint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))  # num_batches_tracked: 0-dim
    before = state_fingerprint(model.state_dict().items())
    assert before == state_fingerprint(model.state_dict().items())
    model[1].num_batches_tracked += 1
    assert state_fingerprint(model.state_dict().items()) != before
    model[1].num_batches_tracked -= 1
    with torch.no_grad():
        model[0].weight[2, 1] += 1e-7
    assert state_fingerprint(model.state_dict().items()) != before
    # a strided buffer (a positional table's every other column) and a module's extra state
    strided = torch.arange(16.0).reshape(4, 4)[:, ::2]
    assert state_fingerprint([("pe", strided)]) == state_fingerprint([("pe", strided.contiguous())])
    assert state_fingerprint([("extra", {"a": 1})]) != state_fingerprint([("extra", {"a": 2})])


def read_masks(folder, name: str, rank: int, call: int) -> torch.Tensor:
    return torch.load(folder / f"{name}-{rank}-{call}.pt", weights_only=True)


def test_dropout_masks_are_each_rank_s_own_where_ranks_hold_other_data(project):
    """DDP: each rank's samples draw their own masks (seeded alike and never again, sample i of every rank
    got one mask); and a step's masks are a function of (seed, step): the same in a run of 2 steps as in
    the first 2 of 3."""
    masks = project / "masks"
    masks.mkdir()
    args = ["--model", "mine:dropout_mlp", "--dataset", "mine:data", "--global-batch-size", "16"]
    for steps in ("2", "3"):
        result = run_ranks(
            2,
            str(train_path("ddp")),
            [*args, "--steps", steps],
            env={**os.environ, "MASKS": str(masks)},
            timeout=120,
            cwd=project,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        if steps == "2":
            first = {rank: read_masks(masks, "inner", rank, 1) for rank in (0, 1)}
    assert first[0].shape == (8, 32)
    assert (first[0] == first[1]).float().mean() < 0.75  # independent: about half agree, not all
    assert torch.equal(first[0], read_masks(masks, "inner", 0, 1))  # step 1 again, in the 3-step run
    assert not torch.equal(read_masks(masks, "inner", 0, 1), read_masks(masks, "inner", 0, 2))


@pytest.mark.parametrize("model", ["dropout_mlp", "dropout_nested"])
def test_tensor_parallel_recomputes_the_masks_it_drew(model, project, tmp_path):
    """--activation-checkpointing draws a block's masks again in backward: from the same streams (the
    checkpoint restores the stream it is in; a colwise layer recomputed apart from its rowwise partner
    opens no region), so the run ends where one without recompute does."""
    args = ["--model", f"mine:{model}", "--dataset", "mine:data", "--steps", "3", "--optimizer", "sgd"]
    for name, extra in (("plain", []), ("recomputed", ["--activation-checkpointing"])):
        result = run_ranks(
            2,
            str(train_path("tensor_parallel")),
            [*args, *extra, "--save-final", str(tmp_path / name)],
            env=dict(os.environ),
            timeout=120,
            cwd=project,
        )
        assert result.returncode == 0, result.stderr[-2000:]
    plain, recomputed = (torch.load(tmp_path / n, weights_only=True) for n in ("plain", "recomputed"))
    assert all(torch.equal(plain[k], recomputed[k]) for k in plain)


def test_ddp_looks_for_unused_parameters_where_the_meta_forward_cannot_tell(project):
    """A forward that reads a value cannot run on the meta device: which parameters the loss reaches is
    unknown, so DDP looks in every backward, and says why (not naming every parameter as unused)."""
    args = ["--model", "mine:data_dependent", "--dataset", "mine:data", "--steps", "2"]
    result = run_ranks(2, str(train_path("ddp")), args, env=dict(os.environ), timeout=120, cwd=project)
    assert result.returncode == 0, result.stderr[-2000:]
    said = [line for line in result.stdout.splitlines() if "DDP looks for unused" in line]
    assert len(said) == 1 and "unknown which parameters the loss uses" in said[0], said
    assert "fc1.weight" not in said[0]


def test_a_model_that_cannot_be_built_on_the_meta_device_is_checked_for_real(project):
    """The contract is checked on the meta device first (no memory, no compute); a constructor that needs
    values (`.item()`) fails there, and is then built and checked for real, where it trains."""
    args = ["--model", "mine:built_from_values", "--dataset", "mine:data", "--steps", "2"]
    result = run_forked([sys.executable, str(train_path("single")), *args], cwd=project)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("model", ["mine:weight_normed", "mine:with_lock"])  # (RuntimeError, TypeError)
def test_a_model_deepcopy_refuses_is_built_again_for_fsdp_s_evaluation_copy(model, project):
    args = ["--model", model, "--dataset", "mine:data", "--steps", "2"]
    result = run_ranks(2, str(train_path("fsdp")), args, env=dict(os.environ), timeout=120, cwd=project)
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_plan_of_yours_built_only_for_real_is_checked_for_tensor_parallelism(project):
    args = ["--model", "mine:planned_from_values", "--dataset", "mine:data", "--check-ranks", "2"]
    result = run_forked([sys.executable, str(train_path("tensor_parallel")), *args], cwd=project)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]


def test_a_model_whose_first_loss_is_nan_is_not_told_to_lower_the_lr(project):
    """Checked on the meta device, nothing has a value: the first step says it (its loss comes from the
    initial parameters, before any update), not 'training diverged; lower --lr'."""
    args = ["--model", "mine:nan_out", "--dataset", "mine:data", "--steps", "3", "--log-every", "1"]
    result = run_forked([sys.executable, str(train_path("single")), *args], cwd=project)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert "the loss is nan at step 1" in lines[0] and "from its initial parameters" in lines[0]
    assert "lower --lr" not in lines[0]


@pytest.mark.parametrize("world, dp_shard", [(2, 1), (4, 2)])
def test_tensor_parallel_masks_differ_inside_the_split_and_agree_outside_it(world, dp_shard, project):
    """Megatron's two streams: inside the split (fc1 colwise → fc2 rowwise) each rank holds other hidden
    units, whose masks must be independent (seeded alike, units j and j+16 got one mask); after the
    rowwise layer the activation is whole on every rank of a tensor-parallel group, whose masks must be
    equal; data-parallel groups (--dp-shard) hold other samples, whose masks must be independent."""
    masks = project / "masks"
    masks.mkdir()
    args = [
        "--model",
        "mine:dropout_mlp",
        "--dataset",
        "mine:data",
        "--steps",
        "2",
        "--global-batch-size",
        "16",
    ]
    result = run_ranks(
        world,
        str(train_path("tensor_parallel")),
        [*args, "--dp-shard", str(dp_shard)],
        env={**os.environ, "MASKS": str(masks)},
        timeout=120,
        cwd=project,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for call in (0, 1):
        inner = [read_masks(masks, "inner", rank, call) for rank in range(world)]
        outer = [read_masks(masks, "outer", rank, call) for rank in range(world)]
        assert inner[0].shape == (16 // dp_shard, 16)  # this group's samples, this rank's 16 of 32 units
        assert (inner[0] == inner[1]).float().mean() < 0.75
        assert torch.equal(outer[0], outer[1])
        if dp_shard > 1:
            assert (outer[0] == outer[2]).float().mean() < 0.75  # (ranks 2, 3: the second group)


def test_a_module_used_twice_is_applied_twice(project):
    """One nn.ReLU() in two places of an nn.Sequential: both applied (named_children() lists it once),
    as the model you wrote computes; cut between ranks, each place is a block of its own."""
    torch.manual_seed(0)
    ours = build_model("mine:shared_relu", None)
    theirs = sys.modules["mine"].shared_relu()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(8, 16)
    assert torch.equal(ours(x), theirs(x))
    assert [name for name, _ in ours.named_children()] == ["0", "1", "2", "3", "4"]
    load_train_module("pipeline").parse_options(["--model", "mine:shared_relu", *ON_MINE], 2)  # accepted


def test_a_dataset_whose_first_samples_score_nothing_trains(project):
    """The contract check tries the loss as training takes it (a sum over scored targets, 0 for none),
    not a mean (0/0 = nan: it refused this valid dataset). Global batches of 2 include ones that score
    nothing: their loss is 0, the run completes. (In fp64 the check runs the loss for real: on the meta
    device, in fp32, it has no value to be nan.)"""
    fp64 = RunConfig(model="mine:mlp", dataset="mine:first_unscored", precision="fp64")
    assert own_code_problem(fp64, cuts_model=False) is None
    args = ["--model", "mine:mlp", "--dataset", "mine:first_unscored", "--global-batch-size", "2"]
    record = load_train_module("single").main([*args, "--steps", "60", "--log-every", "1"])
    losses = [step["loss"] for step in record["steps"]]
    assert record["status"] == "completed" and all(math.isfinite(loss) for loss in losses)


def test_your_dataset_as_tensors_and_info(project):
    train, test, info = own_dataset("mine:own_class")
    assert train.x.dtype == torch.float32 and train.x.shape == (192, 16) and test.y.dtype == torch.long
    assert (info.name, info.num_classes, info.input_shape, info.kind) == ("mine:own_class", 4, (16,), "image")
    x, y = sys.modules["mine"]._tensors()
    assert torch.equal(train.x, x[:192]) and torch.equal(test.y, y[192:])  # the pairs, in order


def test_a_dataset_read_item_by_item_is_stacked_in_chunks_and_a_tensor_dataset_taken_as_is(monkeypatch):
    """Items are stacked STACKED_AT_ONCE at a time (all at once, a tensor object per item, 1M items of 16
    floats peaked at 1.3 GB for 64 MB of data): every item lands in its place across the chunks, and a
    shape that differs in a later chunk is still said. A TensorDataset's own tensors are used as they are."""
    from torch.utils.data import TensorDataset

    from distref.data import datasets

    monkeypatch.setattr(datasets, "STACKED_AT_ONCE", 7)
    x, y = torch.randn(30, 3), torch.arange(30) % 4
    pairs = [(x[i].clone(), int(y[i])) for i in range(30)]
    read = datasets.as_tensors(pairs, "pairs")
    assert torch.equal(read.x, x) and torch.equal(read.y, y)
    pairs[20] = (torch.zeros(2), 0)
    with pytest.raises(datasets.DataError, match="inputs of several shapes"):
        datasets.as_tensors(pairs, "pairs")
    pairs[20] = (x[20], torch.tensor([1]))  # a target of shape (1,) among scalars, in the third chunk
    with pytest.raises(datasets.DataError, match=r"item 20's target has shape \(1,\), item 0's \(\)"):
        datasets.as_tensors(pairs, "pairs")
    taken = datasets.as_tensors(TensorDataset(x, y), "tensors")
    assert taken.x.data_ptr() == x.data_ptr() and torch.equal(taken.y, y)


def test_activation_checkpointing_recomputes_the_blocks_of_your_sequential(project):
    """An nn.Sequential of yours becomes a BlockModel of the same blocks (same parameter names): with
    activation checkpointing each block runs again in backward, and the gradients are the same."""
    torch.manual_seed(0)
    model = build_model("mine:mlp", None)
    assert isinstance(model, BlockModel) and list(model.state_dict()) == [
        "fc1.weight",
        "fc1.bias",
        "fc2.weight",
        "fc2.bias",
    ]
    x = torch.randn(8, 16)
    model(x).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    calls = count_block_calls(model)
    model.activation_checkpointing = True
    model(x).sum().backward()
    assert calls == {"fc1": 2, "act": 2, "fc2": 2}  # forward, then again in backward
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, model.parameters(), strict=True))


def test_the_balanced_cut_gives_every_part_parameters():
    """Parameter-less blocks (activations) are never a part alone: the balanced cut skips such cuts, and
    says when there is none."""
    from distref.distributed.partition import choose_cut_points

    sizes = {"act0": 0, "fc1": 5, "fc2": 5, "act2": 0}
    assert choose_cut_points(sizes, None, 2) == ([2], None)  # act0,fc1 | fc2,act2
    assert choose_cut_points(sizes, None, 3)[1] == (
        "--model the model cannot be cut into 3 parts that each hold parameters (blocks and their "
        "parameters: act0 0, fc1 5, fc2 5, act2 0)"
    )


def test_a_tp_plan_that_does_not_compute_the_model_is_refused_by_the_ranks(project):
    """Names and sizes right, the split wrong (a softmax over each rank's slice): the ranks find that
    the split model does not compute the whole one, and rank 0 says so in one line."""
    args = ["--model", "mine:softmax_between", *ON_MINE, "--steps", "2"]
    result = run_ranks(2, str(train_path("tensor_parallel")), args, timeout=120, cwd=project)
    assert result.returncode != 0
    said = [line for line in result.stderr.splitlines() if "error:" in line]
    assert said == [
        "tensor_parallel/train.py: error: --model mine:softmax_between: split by its tp_plan {'fc1': "
        "'colwise', 'fc2': 'rowwise'} it does not compute its forward (a colwise layer's sliced output "
        "must reach a rowwise layer through element-wise operations only)"
    ], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_a_checkpoint_of_your_model_as_it_was_is_refused_once_the_model_changed(project, capsys):
    """Resuming after the function changed (fc1 wider): one line naming what changed, not
    load_state_dict's traceback; unchanged, it resumes."""
    single = load_train_module("single")
    run = ["--model", "mine:mlp", *ON_MINE, "--checkpoint-dir", str(project / "ck")]
    single.main([*run, "--steps", "2", "--checkpoint-every", "2"])
    assert single.main([*run, "--steps", "3", "--resume", "auto"])["status"] == "completed"
    wider = MINE.replace(
        "fc1=nn.Linear(16, 32), act=nn.ReLU(), fc2=nn.Linear(32, 4)",
        "fc1=nn.Linear(16, 48), act=nn.ReLU(), fc2=nn.Linear(48, 4)",
    )
    (project / "mine.py").write_text(wider)
    sys.modules.pop("mine")
    importlib.invalidate_caches()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        single.main([*run, "--steps", "4", "--resume", "auto"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"single: error: checkpoint {project}/ck/step-00000002.pt holds another model than --model mine:mlp "
        "builds now (fc1.weight: [32, 16] then, [48, 16] now): the function changed since the checkpoint "
        "was written"
    ]
