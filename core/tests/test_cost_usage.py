"""What the formulas take from a model besides its shapes (distref.cost.usage: which parameters receive a
gradient, in which order, which modules run), DeepSpeed's all-reduce pieces, stage 0, and the reason a
record gives for every prediction it leaves null."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from distref.cost import Predicted
from distref.cost.memory import replicated
from distref.cost.usage import ParameterUse, model_usage, parameters_by_block, parameters_of
from distref.cost.zero import bucket_all_reduces, stage0_all_reduces, zero_communication, zero_model_states
from distref.data import DatasetInfo
from distref.models import build_model
from distref.record import SCHEMA_PATH
from distref.testing.cost import PARTLY_TRAINED_RUN

INFOS = {
    "lenet": DatasetInfo("mnist", 10, (1, 28, 28), "image"),
    "resnet18": DatasetInfo("cifar10", 10, (3, 32, 32), "image"),
    "gpt": DatasetInfo("synthetic", 11, (16,), "sequence"),
}
EXAMPLE = DatasetInfo("distref.testing.own:example_data", 4, (16,), "image")


@pytest.mark.parametrize("model", list(INFOS))
def test_the_meta_step_finds_the_gradients_in_the_order_a_real_backward_produces_them(model):
    """This project's models train every parameter and run every module; the order the meta device's
    backward produces the gradients in is the one a real backward on the CPU takes (a convolution's
    weight before its bias, a layer norm's weight before its bias: not the parameters' reverse)."""
    info = INFOS[model]
    usage = model_usage(model, info, gpt_layers=2)
    torch.manual_seed(0)
    real = build_model(model, info, 2)
    produced: list[str] = []
    for name, parameter in real.named_parameters():
        parameter.register_post_accumulate_grad_hook(lambda _, name=name: produced.append(name))
    x = torch.zeros((2, *info.input_shape), dtype=torch.long if info.kind == "sequence" else torch.float32)
    real(x).sum().backward()
    assert usage.unknown is None and list(usage.gradient_order) == produced
    assert sorted(produced) == sorted(name for name, _ in real.named_parameters())
    assert usage.called == {name for name, _ in real.named_modules()}
    assert produced != [name for name, _ in real.named_parameters()][::-1]  # (what the formulas assumed)


def test_a_process_traces_this_project_s_models_once_and_yours_every_time(monkeypatch):
    """lenet's Usage is traced once per process (its arguments alone build it), and again where
    torch.nn.functional.linear was replaced; a model of yours is traced at each call: its function may
    build another model the next time."""
    from distref.cost import usage as usage_module

    traced: list[str] = []
    real_trace = usage_module.traced_usage
    monkeypatch.setattr(
        usage_module, "traced_usage", lambda *a, **k: traced.append("x") or real_trace(*a, **k)
    )
    info = DatasetInfo("synthetic-for-the-cache-test", 10, (1, 28, 28), "image")  # (a key no other test uses)
    with torch.no_grad():  # (traced with gradients whatever the caller's mode: a process keeps it)
        first = model_usage("lenet", info, gpt_layers=2)
    again = model_usage("lenet", info, gpt_layers=2)
    assert len(first.gradient_order) == 8  # (every parameter of lenet's: traced with gradients)
    assert again is first and len(traced) == 1
    mine = [model_usage("distref.testing.own:example_mlp", EXAMPLE, gpt_layers=2) for _ in range(2)]
    assert mine[0] == mine[1] and mine[0] is not mine[1] and len(traced) == 3
    # torch's linear replaced (DeepSpeed's ZeRO-3 does, for good): traced again, with the new one
    torch_linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *args: torch_linear(*args))
    assert model_usage("lenet", info, gpt_layers=2) == first and len(traced) == 4


def test_frozen_unused_and_never_called_parameters_are_told_apart():
    usage = model_usage("distref.testing.partly_trained:mlp", EXAMPLE, gpt_layers=2)
    assert set(usage.gradient_order) == {
        "fc1.bias",
        "fc2.linear.weight",
        "fc2.linear.bias",
        "out.weight",
        "out.bias",
    }
    model = build_model("distref.testing.partly_trained:mlp", EXAMPLE)
    uses = dict(
        zip((name for name, _ in model.named_parameters()), usage.of(model.named_parameters()), strict=True)
    )
    assert uses["fc1.weight"] == ParameterUse(requires_grad=False, trained=False, runs=True)  # frozen
    assert uses["norm.bias"] == ParameterUse(requires_grad=False, trained=False, runs=True)
    assert uses["fc2.spare"] == ParameterUse(requires_grad=True, trained=False, runs=True)  # never read
    assert uses["fc2.unused_head.weight"] == ParameterUse(requires_grad=True, trained=False, runs=False)
    assert uses["out.weight"] == ParameterUse()
    never_called = model_usage("distref.testing.partly_trained:two_heads", EXAMPLE, gpt_layers=2)
    assert not never_called.block_called("other_head.weight") and never_called.block_called("head.weight")


def test_a_model_that_cannot_run_on_the_meta_device_says_why(monkeypatch):
    class ReadsAValue(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * x.sum().item()  # data-dependent: no value on the meta device

    monkeypatch.setattr("distref.cost.usage.build_model", lambda *args: ReadsAValue(16, 4))
    usage = model_usage("mine:model", EXAMPLE, gpt_layers=2)
    assert usage.unknown.startswith("which parameters receive a gradient is found by one forward")
    assert "mine:model" in usage.unknown and usage.gradient_order == ()


def test_replicated_states_count_gradients_and_optimizer_state_of_trained_parameters_only():
    sizes = [40, 8, 100]
    assert replicated(sizes, "adamw", trained=[True, False, True]) == {
        "parameters": 148,
        "gradients": 140,
        "optimizer": 2 * 140 + 2 * 4,
    }


@pytest.mark.parametrize(
    "bucket, partition, expected",
    [
        ([(5280, 16000)], 7280, [2000, 7280, 6720]),  # lenet's fc1 over 3 partitions, each piece > B
        ([(0, 100), (100, 1000)], 7280, [1100]),  # pieces of one partition merge
        ([(0, 1000), (1000, 500)], 1200, [1500]),  # 1200 of partition 0 then 300 of 1: one call past B
        ([(0, 1311), (1311, 10)], 10000, [1321]),  # merged before the check: one call
        ([(7000, 600), (7600, 50)], 7280, [650]),  # 280 of partition 0, 320 + 50 of 1: not past B, one
    ],
)
def test_a_bucket_is_all_reduced_in_pieces_cut_at_partitions_once_they_pass_b(bucket, partition, expected):
    """DeepSpeed 0.19's average_tensor and allreduce_and_scatter, B = 1310 (--bucket-mb 0.005)."""
    assert bucket_all_reduces(bucket, partition, 1310) == expected


def test_stage_2_with_a_gradient_larger_than_a_bucket_issues_one_all_reduce_per_partition_it_spans():
    """lenet, 3 ranks, --bucket-mb 0.005 (1310 elements): 6 all-reduces, measured, where counting
    buckets said 4 — fc1's 16000-element weight spans 3 partitions — and no gradient norm (the config's
    compute_grad_norm false)."""
    named = list(build_model("lenet", INFOS["lenet"]).named_parameters())
    order = model_usage("lenet", INFOS["lenet"], gpt_layers=2).gradient_indices(named)
    numels = [p.numel() for _, p in named]
    counts = zero_communication(numels, 3, 2, bucket_elements=1310, prefetch_elements=0, gradient_order=order)
    # fc2's and fc1's biases and fc2's weight | fc1's weight: 2000, 7280, 6720 | conv2's weight | conv2's
    # bias, conv1's weight and bias
    assert counts["all_reduce"]["calls"] == 6
    assert counts["all_reduce"]["bytes"] == 4 * sum(numels)


def test_stage_0_is_ddp_s_all_reduce_in_fixed_buckets_and_a_replica():
    """Stage 0: no partition. The engine's all-reduce fills past 5e8 elements whatever --bucket-mb; an
    unused trainable parameter's gradient is zeros, all-reduced and stepped; a frozen one is neither."""
    assert stage0_all_reduces([300_000_000, 300_000_000, 1]) == [600_000_000, 1]
    uses = [ParameterUse(), ParameterUse(False, False), ParameterUse(True, False)]
    counts = zero_communication([10, 20, 30], 2, 0, bucket_elements=2, prefetch_elements=2, uses=uses)
    assert counts == {"all_reduce": {"calls": 1, "bytes": 160, "bus_bytes": 160.0}}
    states = zero_model_states([10, 20, 30], 2, 1, 0, "sgd", uses=uses)
    assert states == {"parameters": 240, "gradients": 160, "optimizer": 160}


def test_a_null_prediction_needs_its_reason():
    with pytest.raises(ValueError, match="no formula for communication, model_states, activations"):
        Predicted()
    predicted = Predicted(
        communication={}, activations=1, unavailable={"communication": "dropped", "model_states": "why"}
    )
    assert predicted.unavailable == {"model_states": "why"}  # a reason for a prediction made is dropped


def test_the_record_says_why_a_prediction_is_null(single_train, tmp_path):
    """A run of a model of yours: no activation formula, and the record's predicted_unavailable says so,
    in the schema's form; a run of lenet predicts everything and says nothing."""
    single_train.main([*PARTLY_TRAINED_RUN, "--out", str(tmp_path / "yours")])
    record = json.loads((tmp_path / "yours" / "record.json").read_text())
    jsonschema.validate(record, json.loads(SCHEMA_PATH.read_text()))
    assert record["activation_bytes"]["predicted"] is None
    assert list(record["predicted_unavailable"]) == ["activations"]
    lenet = ["--model", "lenet", "--dataset", "synthetic", "--steps", "3", "--global-batch-size", "8"]
    assert single_train.main([*lenet, "--out", str(tmp_path / "lenet")])["predicted_unavailable"] == {}


def test_parameters_of_describes_a_model_in_plain_values_for_the_cost_functions():
    """What each strategy's cost function takes (distref.cost.usage.parameters_of): shapes, bytes and what
    the step does with each parameter, in model.named_parameters() order; by block, `runs` by the block."""
    model = build_model("distref.testing.partly_trained:mlp", EXAMPLE)
    usage = model_usage("distref.testing.partly_trained:mlp", EXAMPLE, gpt_layers=2)
    described = parameters_of(model.named_parameters(), usage)
    assert described.shapes[:2] == ((64, 16), (64,)) and described.bytes[:2] == [64 * 16 * 4, 64 * 4]
    assert described.trained == usage.trained_flags(model.named_parameters())
    assert list(described.gradient_order) == usage.gradient_indices(list(model.named_parameters()))
    assert list(described.uses) == usage.of(model.named_parameters())
    by_block = parameters_by_block(model, usage)
    assert [len(block.shapes) for block in by_block] == [2, 0, 5, 2, 2]  # act1 holds none
    assert [shape for block in by_block for shape in block.shapes] == list(described.shapes)
    two_heads = build_model("distref.testing.partly_trained:two_heads", EXAMPLE)
    blocks = parameters_by_block(
        two_heads, model_usage("distref.testing.partly_trained:two_heads", EXAMPLE, 2)
    )
    runs = {
        name: all(use.runs for use in block.uses)
        for (name, _), block in zip(two_heads.named_children(), blocks, strict=True)
    }
    assert runs["head"] and not runs["other_head"]
