"""impls/model_parallel proven equal to impls/single — bit for bit — converging, and surviving a killed rank.

On this project's models (lenet, gpt, resnet18: their parameter names, shapes and accuracy targets);
test_parity_with_single_on_your_model gives the same proof on yours (distref.testing.own)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from distref.testing import (
    COST_RUN,
    FP64_TOLERANCE,
    GPU_PARITY,
    batchnorm_args,
    check_activations_predicted,
    check_communication_predicted,
    check_killed_rank_ends_the_job,
    check_killed_rank_resumes_exactly,
    check_model_states_predicted,
    check_stopped_rank_is_named,
    expected_time_to_target,
    launch,
    load_train_module,
    max_relative_difference,
    mnist_convergence_args,
    parity_args,
    run_forked,
    score_saved_model,
    self_launched,
    skip_where_torchvision_cannot_serve,
    train_path,
)
from distref.testing.cost import PARTLY_TRAINED_RUN, check_partly_trained_predicted
from distref.testing.own import check_parity_on_your_model

# A send or receive that waits longer than this fails the job (a hung test fails instead of hanging CI).
TIMEOUT = ["--timeout", "60"]


def python_train(args: list[str], timeout: float = 300):
    """`python impls/model_parallel/train.py ARGS`: the file starts its ranks itself."""
    return self_launched("model_parallel", [*TIMEOUT, *args], timeout)


def run_mp(args: list[str], timeout: float = 300):
    """`python train.py ARGS`, forked (distref.testing.run_forked: the launch itself has tests of its
    own): with `--nproc-per-node N`, the N ranks it starts; the one-process form (--devices), its process."""
    result = run_forked([sys.executable, str(train_path("model_parallel")), *TIMEOUT, *args], timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


# Every part computes exactly what single computes for its blocks, in the same order, and the loss
# scales all parts' gradients as single's does: equal to single bit for bit, not merely within 1e-5 —
# with --grad-accum K, to single --grad-accum K (the same micro-batch sums).
@pytest.mark.parametrize(
    ("model", "form", "grad_accum"),
    [
        ("lenet", ["--nproc-per-node", "2"], 1),
        ("lenet", ["--nproc-per-node", "4"], 2),
        ("gpt", ["--nproc-per-node", "2"], 2),
        ("gpt", ["--nproc-per-node", "4"], 1),
        ("lenet", ["--devices", "cpu,cpu"], 2),
        ("gpt", ["--devices", "cpu,cpu,cpu,cpu"], 1),
        ("masked", ["--nproc-per-node", "2"], 4),  # 1 to 8 scored targets of 16: each micro-batch its own
        ("masked", ["--devices", "cpu,cpu"], 2),
    ],
    ids=[
        "lenet-2-ranks",
        "lenet-4-ranks-accum",
        "gpt-2-ranks-accum",
        "gpt-4-ranks",
        "lenet-2-devices-accum",
        "gpt-4-devices",
        "masked-2-ranks-accum4",
        "masked-2-devices-accum2",
    ],
)
def test_bit_identical_to_single(model, form, grad_accum, single_reference, tmp_path):
    final = tmp_path / "final.pt"
    run_mp([*form, *parity_args(model), "--grad-accum", str(grad_accum), "--save-final", str(final)])
    saved = torch.load(final, weights_only=True)
    reference = single_reference(model, grad_accum)
    assert list(saved) == list(reference)  # the core model's keys, in its order: gathered from every part
    assert max_relative_difference(saved, reference) == 0.0


def test_bit_identical_to_single_with_batchnorm(single_train, tmp_path):
    """resnet18: BatchNorm's running statistics live in the parts too, and end equal to single's."""
    args = batchnorm_args(4)
    skip_where_torchvision_cannot_serve(args)
    single_train.main([*args, "--save-final", str(tmp_path / "single.pt")])
    run_mp(["--nproc-per-node", "2", *args, "--save-final", str(tmp_path / "mp.pt")])
    final, reference = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in ("mp", "single"))
    assert int(final["layer4.1.bn2.num_batches_tracked"]) == 4  # a buffer of the second part
    assert max_relative_difference(final, reference) == 0.0


def test_record_is_single_s_record_plus_the_partition(single_train, tmp_path):
    """Losses and accuracies from the last part equal single's exactly; the record carries the partition,
    each rank's model state (its own part only), the bytes each rank sends and its busy fraction."""
    args = [*parity_args("lenet"), "--eval-every", "10"]
    run_mp(
        [
            "--nproc-per-node",
            "2",
            *args,
            "--out",
            str(tmp_path / "mp"),
            "--save-final",
            str(tmp_path / "f.pt"),
        ]
    )
    single = single_train.main([*args, "--out", str(tmp_path / "single")])
    record = json.loads((tmp_path / "mp" / "record.json").read_text())
    assert [s["loss"] for s in record["steps"]] == [s["loss"] for s in single["steps"]]
    assert [e["accuracy"] for e in record["evals"]] == [e["accuracy"] for e in single["evals"]]
    assert record["final_accuracy"] == score_saved_model(tmp_path / "f.pt", args)
    assert record["world_size"] == record["devices"] == 2
    assert record["strategy"]["cut_points"] == [2]  # balanced: conv1+conv2 5,280 | fc1+fc2 16,560
    assert record["strategy"]["parts"] == [["conv1", "conv2"], ["fc1", "fc2"]]
    params = [s["parameters"] for s in record["model_state_bytes"]]
    assert params == [5280 * 4, 16560 * 4]  # each rank holds its own part only
    assert [s["gradients"] for s in record["model_state_bytes"]] == params
    # Per micro-batch of 32: rank 0 sends conv2's output (32×20×4×4 fp32) after a 64-byte header, rank 1
    # sends its gradient back.
    assert record["strategy"]["bytes_sent_per_step"] == [32 * 320 * 4 + 64, 32 * 320 * 4]
    assert all(0 < f <= 1 for f in record["strategy"]["busy_fraction"])
    assert len(record["peak_memory_bytes"]) == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--devices", "cpu,cpu,cpu,cpu,cpu"], "5 parts but --model lenet has only 4 blocks"),
        (["--partition", "3,1"], "--partition 3,1 makes 3 parts, but there are 2 ranks/devices"),
        (["--partition", "4"], "--partition 4: cut points must increase strictly within 1..3"),
        (["--partition", "2,1", "--devices", "cpu,cpu,cpu"], "cut points must increase strictly within 1..3"),
        (["--devices", "gpu:0,gpu:1"], "--devices gpu:0,gpu:1: unknown device"),
        (["--devices", "cpu:0,cpu:1"], "there is one CPU device in torch; use cpu,cpu"),
        (["--devices", "cpu"], "give 2 or more devices, one per part"),
        (["--precision", "fp16", "--device", "cpu"], "--precision fp16 needs CUDA"),
    ]
    + ([] if torch.cuda.device_count() >= 2 else [(["--devices", "cuda:0,cuda:1"], "needs 2 CUDA devices")]),
)
def test_bad_input_is_one_line(args, message, capsys):
    """What the launcher checks before starting any rank (2 ranks asked for), in this process."""
    mp = load_train_module("model_parallel")
    with pytest.raises(SystemExit) as exc:
        mp.parse_options(["--dataset", "synthetic", *args], 2)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("model_parallel/train.py: error: ") and message in err, err


def test_more_ranks_than_blocks_stops_before_any_rank_starts():
    result = python_train(["--nproc-per-node", "5", "--dataset", "synthetic"])
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1] == (
        "model_parallel/train.py: error: 5 parts but --model lenet has only 4 blocks"
    )
    assert "starting" not in result.stdout  # no rank was started


@pytest.mark.faults
def test_a_checkpoint_cut_elsewhere_is_refused(tmp_path):
    """A checkpoint of the model cut at other blocks is refused in one line naming both cuts."""
    ckpt = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "4"]
    run_mp(
        [
            "--nproc-per-node",
            "3",
            "--dataset",
            "synthetic",
            "--steps",
            "4",
            "--global-batch-size",
            "16",
            *ckpt,
        ]
    )
    again = [*TIMEOUT, "--partition", "1,3", "--dataset", "synthetic", "--steps", "8"]
    result = launch(3, "model_parallel", [*again, "--global-batch-size", "16", "--resume", "auto", *ckpt])
    assert result.returncode == 1
    assert result.stderr.count("was cut at [2, 3], this run at [1, 3]") >= 1


@pytest.mark.slow
def test_lenet_reaches_98_5_percent_on_real_mnist_with_2_parts(mnist_root, tmp_path):
    run_mp(
        ["--nproc-per-node", "2", *mnist_convergence_args(mnist_root), "--out", str(tmp_path)], timeout=900
    )
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["final_accuracy"] >= 0.985, record["evals"]
    assert record["time_to_target_s"] == expected_time_to_target(record) > 0


ELASTIC = [
    "--model",
    "lenet",
    "--dataset",
    "synthetic",
    "--optimizer",
    "sgd",
    "--lr",
    "0.01",
    "--steps",
    "100",
]
ELASTIC += ["--global-batch-size", "32", "--checkpoint-every", "20", "--resume", "auto", *TIMEOUT]


@pytest.mark.slow
@pytest.mark.faults
def test_killed_rank_restarts_from_checkpoint_with_the_same_result(tmp_path):
    """A SIGKILLed rank under --max-restarts 1: the job resumes from its last checkpoint and ends bit-identical to an uninterrupted run."""
    single = [*ELASTIC[:10], "--global-batch-size", "32"]  # the same workload; parts sum as single does
    check_killed_rank_resumes_exactly("model_parallel", ELASTIC, 100, tmp_path, single)


@pytest.mark.slow
@pytest.mark.faults
def test_killed_rank_without_restarts_ends_the_job_naming_it(tmp_path):
    """A SIGKILLed rank ends the job within 60 s; the launcher's report names it."""
    check_killed_rank_ends_the_job("model_parallel", ELASTIC, tmp_path)


@pytest.mark.faults
def test_stopped_rank_is_named_once_the_timeout_passes(tmp_path):
    """A SIGSTOPped rank: one line names it after --timeout (5 s here), exit code 1.
    Here the collective that waits for it is a send or a receive between parts."""
    check_stopped_rank_is_named(
        "model_parallel", ["--model", "lenet", "--dataset", "synthetic", "--steps", "100000"], tmp_path
    )


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ CUDA GPUs: one part per GPU")
@pytest.mark.parametrize(
    "form", [["--nproc-per-node", "2", "--device", "cuda"], ["--devices", "cuda:0,cuda:1"]]
)
def test_both_forms_on_two_gpus_match_single(form, single_train, tmp_path):
    args = [*parity_args("lenet"), *GPU_PARITY]
    single_train.main([*args, "--save-final", str(tmp_path / "single.pt")])
    run_mp([*form, *args, "--save-final", str(tmp_path / "mp.pt")])
    final, reference = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in ("mp", "single"))
    assert max_relative_difference(final, reference) < FP64_TOLERANCE


@pytest.mark.parametrize(
    "parts, extra",
    [
        (2, ["--model", "lenet"]),
        (3, ["--model", "lenet", "--grad-accum", "2", "--optimizer", "sgd"]),  # M = 2 micro-batches
        (3, ["--model", "gpt", "--gpt-layers", "2", "--precision", "bf16"]),  # bf16 activations
        (2, ["--model", "lenet", "--devices", "cpu,cpu"]),  # one process: nothing to send
        (2, ["--model", "resnet18", "--precision", "bf16", "--global-batch-size", "8"]),  # 16-bit convs
    ],
    ids=["p2", "p3-accum", "p3-gpt-bf16", "one-process", "p2-resnet-bf16"],
)
def test_cost_equals_the_formulas(parts, extra, tmp_path):
    """What one step sends and receives, counted at the dispatcher, equals distref.cost.pipeline.
    model_parallel exactly (per micro-batch: a header and the activation forward, its gradient back), and
    each rank's model states those of its part."""
    ranks = 1 if "--devices" in extra else parts
    nproc = [] if ranks == 1 else ["--nproc-per-node", str(parts)]
    run_mp([*COST_RUN, *extra, *nproc, "--out", str(tmp_path)])
    record = check_communication_predicted(tmp_path, ranks)
    check_model_states_predicted(record)
    check_activations_predicted(record)  # one micro-batch at a time through this rank's blocks
    if ranks > 1:
        assert all(
            m["send"]["calls"] > 0 and m["recv"]["calls"] > 0 for m in record["communication"]["measured"]
        )


def test_cost_of_frozen_and_unused_parameters_equals_the_formulas(tmp_path):
    """A model of yours with frozen and unused parameters: each rank's model states hold gradients and
    optimizer state of its parameters that receive a gradient only."""
    run_mp([*PARTLY_TRAINED_RUN, "--nproc-per-node", "2", "--out", str(tmp_path)])
    check_partly_trained_predicted(json.loads((tmp_path / "record.json").read_text()))


def test_a_frozen_first_part_trains_the_rest_as_single_does(tmp_path):
    """A frozen first block (a pretrained backbone): the first part's output needs no gradient, and its
    backward (which failed: `element 0 of tensors does not require grad`) has nothing to do."""
    args = [*PARTLY_TRAINED_RUN, "--optimizer", "sgd", "--lr", "0.05"]
    args[1] = "distref.testing.partly_trained:frozen_first_block"
    check_parity_on_your_model(lambda a: run_mp([*a, "--nproc-per-node", "2"]), tmp_path, args)


def test_parity_with_single_on_your_model(tmp_path):
    """The parity proof on your model and data (distref.testing.own's example MLP where none is named).
    Yours: DISTREF_TEST_MODEL=MODULE:FUNCTION [DISTREF_TEST_DATASET=MODULE:FUNCTION] python -m pytest
    -k your_model"""
    check_parity_on_your_model(lambda args: run_mp(["--nproc-per-node", "2", *args]), tmp_path)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_fp64_losses_reach_rank_0_from_the_last_part(grad_accum, tmp_path):
    """In fp64 the last part's loss is float64, the other ranks' zero step loss float32: the losses'
    broadcast from the last rank needs one dtype on every rank (a float64 loss there made gloo refuse
    the sizes and abort the job), and the record gets the last part's losses."""
    final = tmp_path / "final.pt"
    args = [
        *parity_args("gpt"),
        "--precision",
        "fp64",
        "--grad-accum",
        str(grad_accum),
        "--nproc-per-node",
        "2",
    ]
    run_mp([*args, "--save-final", str(final), "--out", str(tmp_path)])
    record = json.loads((tmp_path / "record.json").read_text())
    assert all(step["loss"] > 0 for step in record["steps"])
