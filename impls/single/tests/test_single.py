"""impls/single: convergence on real data, and the features every impl shares.

On this project's models (lenet, gpt, resnet18: their parameter names, shapes and accuracy targets);
with yours, single is the baseline that the other impls' test_parity_with_single_on_your_model compare
with (distref.testing.own)."""

import pytest
import torch

from distref.testing import (
    COST_RUN,
    FP64_TOLERANCE,
    PARITY_TOLERANCE,
    batchnorm_args,
    check_activations_predicted,
    check_model_states_predicted,
    counting_block_calls,
    expected_time_to_target,
    max_relative_difference,
    mnist_convergence_args,
    parity_args,
    skip_where_torchvision_cannot_serve,
)
from distref.testing.cost import PARTLY_TRAINED_RUN, check_partly_trained_predicted

# lr 0.01: at 0.05 this synthetic workload amplifies fp32 rounding (sums in another order) to ~1e-4 in
# 20 steps, above the parity tolerance (see PARITY_WORKLOADS in distref.testing).
SYNTH = ["--model", "lenet", "--dataset", "synthetic", "--optimizer", "sgd", "--lr", "0.01", "--steps", "20"]


def test_lenet_reaches_98_5_percent_on_real_mnist(single_train, mnist_root, tmp_path):
    """The convergence workload of every impl's test (98.87%); `nox -s single-cpu` trains 2 epochs at 2e-3."""
    record = single_train.main([*mnist_convergence_args(mnist_root), "--out", str(tmp_path)])
    assert record["final_accuracy"] >= 0.985, record["evals"]
    assert record["time_to_target_s"] == expected_time_to_target(record) > 0
    assert [e["step"] for e in record["evals"]] == [468]  # at the end of the epoch


def test_gpt_learns_the_reverse_task(single_train):
    record = single_train.main(
        [
            "--model",
            "gpt",
            "--dataset",
            "synthetic",
            "--steps",
            "100",
            "--lr",
            "3e-3",
            "--eval-every",
            "10",
            "--target-accuracy",
            "0.99",
        ]
    )
    assert record["evals"][0]["accuracy"] < 0.5  # near chance (0.1) after 10 steps: the task is not trivial
    assert record["final_accuracy"] >= 0.99


def test_grad_accumulation_equals_one_big_batch(single_train, tmp_path):
    for accum in (1, 4):
        single_train.main(
            [
                *SYNTH,
                "--global-batch-size",
                "32",
                "--grad-accum",
                str(accum),
                "--save-final",
                str(tmp_path / f"accum{accum}.pt"),
            ]
        )
    a1, a4 = (torch.load(tmp_path / f"accum{k}.pt", weights_only=True) for k in (1, 4))
    assert max_relative_difference(a4, a1) < 1e-5


def test_split_steps_equal_plain_single_on_masked_targets(single_train, single_reference, tmp_path):
    """The oracle of every split, checked: on masked targets (a sample scores 1 to 8 of its 16), single
    --grad-accum K equals plain single: each micro-batch's loss sum is divided by the whole global batch's
    count of scored targets. fp32 SGD within rounding; fp64 AdamW (which turns any other weighting into an
    lr-sized step) within 1e-12. The mean of the micro-batches' own means was 8.5e-2 (K=2) and 1.7e-1 (K=4) away (fp32 SGD)."""
    plain = single_reference("masked")
    for accum in (2, 4):
        split = single_reference("masked", accum)
        assert max_relative_difference(split, plain) < PARITY_TOLERANCE, f"--grad-accum {accum}"
    fp64 = [*parity_args("masked"), "--precision", "fp64", "--optimizer", "adamw", "--lr", "1e-3"]
    for accum in (1, 4):
        single_train.main([*fp64, "--grad-accum", str(accum), "--save-final", str(tmp_path / f"a{accum}.pt")])
    a1, a4 = (torch.load(tmp_path / f"a{k}.pt", weights_only=True) for k in (1, 4))
    assert max_relative_difference(a4, a1) < FP64_TOLERANCE


def test_the_step_is_the_mean_over_the_whole_batchs_scored_targets(single_train, tmp_path):
    """single against a step computed here without its loop: the mean cross-entropy over the scored
    targets of the whole global batch (torch's own mean), one SGD step. The recorded loss is that mean too,
    with and without accumulation (not the mean of the micro-batches' means)."""
    from distref.cli import parse_config
    from distref.data import global_batch_indices, load_dataset
    from distref.models import build_model
    from distref.training import make_optimizer, seed_everything

    args = [*parity_args("masked"), "--steps", "1", "--lr-schedule", "constant", "--log-every", "1"]
    cfg = parse_config(args, "test")
    train_set, _, info = load_dataset(cfg)
    seed_everything(cfg.seed)
    model = build_model(cfg.model, info, cfg.gpt_layers)
    optimizer = make_optimizer(cfg, model.parameters())
    batch = global_batch_indices(len(train_set), cfg.global_batch_size, cfg.seed, 0)
    x, y = train_set.x[batch], train_set.y[batch]
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
    loss.backward()
    optimizer.step()
    scored = (y != -100).sum(1)
    assert scored.min() < scored.max(), "the batch must score unevenly, or the test proves nothing"
    for accum in (1, 4):
        record = single_train.main(
            [*args, "--grad-accum", str(accum), "--save-final", str(tmp_path / f"a{accum}.pt")]
        )
        assert record["steps"][0]["loss"] == pytest.approx(loss.item(), rel=1e-6), f"--grad-accum {accum}"
        trained = torch.load(tmp_path / f"a{accum}.pt", weights_only=True)
        assert max_relative_difference(trained, model.state_dict()) < 1e-6, f"--grad-accum {accum}"


@pytest.mark.parametrize(
    ("model_args", "steps"),
    [
        ([*SYNTH, "--model", "gpt", "--optimizer", "adamw", "--lr", "1e-3", "--global-batch-size", "16"], 20),
        (batchnorm_args(5), 5),
    ],
    ids=["gpt-adamw", "resnet18-batchnorm"],
)
def test_activation_checkpointing_recomputes_and_changes_nothing(
    model_args, steps, single_train, tmp_path, monkeypatch
):
    """Same parameters *and buffers* (BatchNorm statistics updated once per step, not twice), bitwise;
    and the option took effect: every block ran once more per step (its recomputation in backward)."""
    skip_where_torchvision_cannot_serve(model_args)
    runs = {}
    for flag, name in (([], "plain"), (["--activation-checkpointing"], "ckpt")):
        calls = counting_block_calls(single_train, monkeypatch)
        single_train.main([*model_args, "--save-final", str(tmp_path / f"{name}.pt"), *flag])
        runs[name] = dict(calls)
    plain, ckpt = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("plain", "ckpt"))
    assert max_relative_difference(ckpt, plain) == 0.0
    extra = {name: runs["ckpt"][name] - runs["plain"][name] for name in runs["plain"]}
    assert set(extra.values()) == {steps}, extra


def test_bf16_autocast_trains_on_cpu_in_bf16(single_train, tmp_path):
    args = [*SYNTH, "--steps", "40", "--eval-every", "40"]
    fp32 = single_train.main([*args, "--save-final", str(tmp_path / "fp32.pt")])
    bf16 = single_train.main([*args, "--precision", "bf16", "--save-final", str(tmp_path / "bf16.pt")])
    a, b = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in ("fp32", "bf16"))
    # bf16 took effect (8-bit mantissas in forward: results differ from fp32) and still trains alike.
    assert 1e-3 < max_relative_difference(b, a) < 5e-2
    assert abs(bf16["final_accuracy"] - fp32["final_accuracy"]) < 0.02
    assert abs(bf16["steps"][-1]["loss"] - fp32["steps"][-1]["loss"]) < 0.05 * fp32["steps"][-1]["loss"]


def test_profile_and_tensorboard_write_their_files(single_train, tmp_path):
    single_train.main([*SYNTH, "--steps", "8", "--profile", "--tensorboard", "--out", str(tmp_path)])
    traces = list((tmp_path / "profile").glob("*.pt.trace.json"))
    assert traces and traces[0].stat().st_size > 1000
    # Where the time went, by operator, in one table: the profiled steps' matmuls and their backward
    table = (tmp_path / "profile" / "time-by-operator.rank0.txt").read_text()
    assert "Self CPU" in table and "aten::addmm" in table and "ProfilerStep*" in table, table[:2000]
    assert "PythonDispatchMode" not in table  # the step whose communication is counted is not profiled
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_data_loader_workers_do_not_change_the_result(single_train, tmp_path):
    for workers in (0, 2):
        single_train.main(
            [
                *SYNTH,
                "--global-batch-size",
                "32",
                "--num-workers",
                str(workers),
                "--save-final",
                str(tmp_path / f"w{workers}.pt"),
            ]
        )
    w0, w2 = (torch.load(tmp_path / f"w{k}.pt", weights_only=True) for k in (0, 2))
    assert max_relative_difference(w2, w0) == 0.0


@pytest.mark.parametrize(
    "extra",
    [
        ["--model", "lenet"],
        ["--model", "lenet", "--activation-checkpointing", "--grad-accum", "2"],
        ["--model", "gpt", "--gpt-layers", "3"],
        ["--model", "gpt", "--activation-checkpointing", "--precision", "fp64"],
        # bf16 autocast: 16-bit copies of inputs and weights, fp32 residual stream and statistics
        ["--model", "lenet", "--precision", "bf16", "--grad-accum", "2"],
        ["--model", "gpt", "--precision", "bf16"],
        ["--model", "gpt", "--precision", "bf16", "--activation-checkpointing"],
    ],
    ids=[
        "lenet",
        "lenet-checkpointed-accum",
        "gpt-3-layers",
        "gpt-checkpointed-fp64",
        "lenet-bf16-accum",
        "gpt-bf16",
        "gpt-bf16-checkpointed",
    ],
)
def test_model_states_and_activations_equal_the_formulas(single_train, extra, tmp_path):
    """One process: nothing communicated; model states and the activations a step holds for backward
    equal distref.cost's formulas exactly."""
    record = single_train.main([*COST_RUN, *extra, "--out", str(tmp_path)])
    assert record["communication"]["step"] == 2
    assert record["communication"]["measured"] == record["communication"]["predicted"] == [{}]
    check_model_states_predicted(record)
    check_activations_predicted(record)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_frozen_and_unused_parameters_hold_no_gradient_or_optimizer_state(single_train, optimizer, tmp_path):
    """A model of yours with frozen and unused parameters: only those that receive a gradient have one
    and optimizer state, as the formula says (distref.cost.usage finds which)."""
    record = single_train.main([*PARTLY_TRAINED_RUN, "--optimizer", optimizer, "--out", str(tmp_path)])
    check_partly_trained_predicted(record)
