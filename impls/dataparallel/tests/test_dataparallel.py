"""impls/dataparallel proven equal to impls/single, converging on real MNIST; multi-GPU when there is one.

On this project's models (lenet, gpt, resnet18: their parameter names, shapes and accuracy targets);
test_parity_with_single_on_your_model gives the same proof on yours (distref.testing.own)."""

import json
import sys

import pytest
import torch

from distref.testing import (
    COST_RUN,
    FP64_TOLERANCE,
    GPU_PARITY,
    PARITY_TOLERANCE,
    batchnorm_args,
    check_activations_predicted,
    check_model_states_predicted,
    expected_time_to_target,
    load_train_module,
    max_relative_difference,
    mnist_convergence_args,
    parity_args,
    run_script,
    skip_where_torchvision_cannot_serve,
    train_path,
)
from distref.testing.cost import PARTLY_TRAINED_RUN, check_partly_trained_predicted
from distref.testing.own import check_parity_on_your_model

TRAIN = str(train_path("dataparallel"))


@pytest.fixture(scope="module")
def dataparallel_train():
    return load_train_module("dataparallel")


@pytest.mark.parametrize(
    "extra",
    [
        ["--model", "lenet", "--grad-accum", "2"],
        ["--model", "gpt"],
        ["--model", "gpt", "--precision", "bf16"],
    ],
)
def test_model_states_and_activations_equal_the_formulas(dataparallel_train, extra, tmp_path):
    """On one device (no GPUs here) DataParallel runs the module as it is: nothing communicated, a full
    replica of the model states and one micro-batch's activations, equal to distref.cost's formulas."""
    record = dataparallel_train.main([*COST_RUN, *extra, "--out", str(tmp_path)])
    assert record["communication"]["measured"] == record["communication"]["predicted"] == [{}]
    check_model_states_predicted(record)
    check_activations_predicted(record)


def test_frozen_and_unused_parameters_hold_no_gradient_or_optimizer_state(dataparallel_train, tmp_path):
    """A model of yours with frozen and unused parameters: only those that receive a gradient have one
    and optimizer state, as the formula says."""
    record = dataparallel_train.main([*PARTLY_TRAINED_RUN, "--out", str(tmp_path)])
    check_partly_trained_predicted(record)


def test_masked_targets_with_accumulation_equal_plain_single(dataparallel_train, single_reference, tmp_path):
    """gpt on masked targets (a sample scores 1 to 8 of its 16), --grad-accum 4: equal to plain single."""
    args = [*parity_args("masked"), "--grad-accum", "4", "--save-final", str(tmp_path / "dp.pt")]
    dataparallel_train.main(args)
    final = torch.load(tmp_path / "dp.pt", weights_only=True)
    assert max_relative_difference(final, single_reference("masked")) < PARITY_TOLERANCE


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_parity_with_single(grad_accum, dataparallel_train, single_reference, tmp_path):
    args = [*parity_args("lenet"), "--grad-accum", str(grad_accum), "--save-final", str(tmp_path / "dp.pt")]
    dataparallel_train.main(args)
    reference = single_reference("lenet", grad_accum)
    final = torch.load(tmp_path / "dp.pt", weights_only=True)
    assert list(final) == list(reference)  # no "module." prefix: the core model's own keys
    assert max_relative_difference(final, reference) < PARITY_TOLERANCE


def test_parity_with_single_for_a_model_with_batchnorm(dataparallel_train, single_train, tmp_path):
    """resnet18: parameters and BatchNorm buffers (running statistics, num_batches_tracked) alike."""
    args = batchnorm_args(4)
    skip_where_torchvision_cannot_serve(args)
    single_train.main([*args, "--save-final", str(tmp_path / "single.pt")])
    dataparallel_train.main([*args, "--save-final", str(tmp_path / "dp.pt")])
    final, reference = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in ("dp", "single"))
    assert int(final["stem.1.num_batches_tracked"]) == 4
    assert max_relative_difference(final, reference) < PARITY_TOLERANCE


def test_each_replica_computes_in_the_run_s_precision_in_its_own_thread(dataparallel_train, monkeypatch):
    """On 2+ GPUs DataParallel runs each replica in a thread and re-enters autocast there without a dtype
    (CUDA's default: fp16). Here, on the CPU: the replicas it hands to parallel_apply, called in a thread
    under an fp16 autocast as torch would, compute in the run's bf16."""
    import threading

    from distref.cli import parse_config

    cfg = parse_config(["--precision", "bf16", "--dataset", "synthetic"], "dataparallel")
    cpu = torch.device("cpu")
    model = dataparallel_train.DataParallelWithAutocast(
        torch.nn.Linear(4, 2), None, lambda: dataparallel_train.autocast(cfg, cpu)
    )
    handed = []
    monkeypatch.setattr(
        torch.nn.DataParallel, "parallel_apply", lambda self, replicas, *a: handed.extend(replicas)
    )
    model.parallel_apply([torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)], [], [])
    dtypes = []

    def replica_thread(replica):
        with torch.amp.autocast("cpu", dtype=torch.float16):  # what the thread starts with
            dtypes.append(replica(torch.randn(3, 4)).dtype)

    threads = [threading.Thread(target=replica_thread, args=(r,)) for r in handed]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert dtypes == [torch.bfloat16, torch.bfloat16]


def test_the_cpu_is_refused_where_gpus_are_visible(dataparallel_train, monkeypatch, capsys):
    """nn.DataParallel takes every visible GPU whatever --device says: refused in one line there."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit) as exc:
        dataparallel_train.main(["--device", "cpu", "--dataset", "synthetic"])
    assert exc.value.code == 2
    assert "nn.DataParallel would take the visible GPUs anyway" in capsys.readouterr().err


def test_says_in_one_line_that_it_does_not_parallelise_without_gpus(tmp_path):
    result = run_script(
        [
            sys.executable,
            TRAIN,
            "--model",
            "lenet",
            "--dataset",
            "synthetic",
            "--steps",
            "2",
            "--device",
            "cpu",
        ]
    )
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stdout.splitlines() if "DataParallel runs the module as is" in line]
    assert notes == [
        "dataparallel: 0 GPU(s) visible: DataParallel runs the module as is, without parallelism"
    ]


def test_checkpoint_resume_and_record(dataparallel_train, tmp_path):
    args = [
        "--model",
        "lenet",
        "--dataset",
        "synthetic",
        "--optimizer",
        "sgd",
        "--lr",
        "0.01",
        "--global-batch-size",
        "32",
        "--steps",
        "12",
    ]
    ckpt = tmp_path / "ckpt"
    dataparallel_train.main(
        [
            *args,
            "--checkpoint-dir",
            str(ckpt),
            "--checkpoint-every",
            "6",
            "--save-final",
            str(tmp_path / "a.pt"),
        ]
    )
    record = dataparallel_train.main(
        [
            *args,
            "--resume",
            str(ckpt / "step-00000006.pt"),
            "--save-final",
            str(tmp_path / "b.pt"),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    a, b = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in "ab")
    assert max_relative_difference(b, a) == 0.0
    saved = json.loads((tmp_path / "out" / "record.json").read_text())
    assert saved["impl"]["name"] == "dataparallel" and saved == json.loads(json.dumps(record))


@pytest.mark.slow
def test_lenet_reaches_98_5_percent_on_real_mnist(dataparallel_train, mnist_root):
    record = dataparallel_train.main(mnist_convergence_args(mnist_root))
    assert record["final_accuracy"] >= 0.985, record["evals"]
    assert record["time_to_target_s"] == expected_time_to_target(record) > 0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ CUDA GPUs to split the batch across")
def test_parallelises_across_gpus_with_parity(dataparallel_train, single_train, mnist_root, tmp_path):
    args = [*parity_args("lenet"), *GPU_PARITY]
    single_train.main([*args, "--save-final", str(tmp_path / "single.pt")])
    record = dataparallel_train.main([*args, "--save-final", str(tmp_path / "dp.pt")])
    assert len(record["peak_memory_bytes"]) == torch.cuda.device_count()  # one figure per GPU used
    reference = torch.load(tmp_path / "single.pt", weights_only=True)
    final = torch.load(tmp_path / "dp.pt", weights_only=True)
    assert max_relative_difference(final, reference) < FP64_TOLERANCE  # the split batch sums in another order


def test_parity_with_single_on_your_model(dataparallel_train, tmp_path):
    """The parity proof on your model and data (distref.testing.own's example MLP where none is named).
    Yours: DISTREF_TEST_MODEL=MODULE:FUNCTION [DISTREF_TEST_DATASET=MODULE:FUNCTION] python -m pytest
    -k your_model"""
    check_parity_on_your_model(lambda args: dataparallel_train.main(args), tmp_path)
