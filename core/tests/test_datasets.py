"""torchvision on this torch build, and the loaders that need no download."""

import pickle
import sys

import numpy as np
import pytest
import torch

from distref.config import RunConfig
from distref.data import IGNORE_INDEX, DataError, load_dataset
from distref.data.datasets import load_cifar10, load_text
from distref.data.mnist import DEBIAN_FASHION_MNIST, FASHION_MNIST_MD5, prepare_fashion_mnist


def test_torchvision_imports_and_its_compiled_ops_work():
    import torchvision

    boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 11.0, 11.0], [50.0, 50.0, 60.0, 60.0]])
    keep = torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8, 0.7]), iou_threshold=0.5)
    assert keep.tolist() == [0, 2]
    assert torchvision.models.resnet18(num_classes=10)(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def write_fake_cifar(root, n_per_batch=20):
    """Files in CIFAR-10's own python format (pickled dicts of uint8 rows, labels, batch names)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        batch = {
            "data": rng.integers(0, 256, (n_per_batch, 3 * 32 * 32), dtype=np.uint8),
            "labels": rng.integers(0, 10, n_per_batch).tolist(),
            "batch_label": name,
        }
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, f)
    return folder


def test_cifar10_real_loader_on_small_generated_files(tmp_path, monkeypatch):
    folder = write_fake_cifar(tmp_path)
    # torchvision checks each file's md5 against the real CIFAR-10; our small files cannot match.
    monkeypatch.setattr("torchvision.datasets.cifar.check_integrity", lambda *args, **kwargs: True)
    train, test, info = load_cifar10(tmp_path, download=False)
    assert len(train) == 100 and len(test) == 20 and info.input_shape == (3, 32, 32)
    with open(folder / "data_batch_1", "rb") as f:
        raw = pickle.load(f)
    first = torch.tensor(raw["data"][0], dtype=torch.float32).view(3, 32, 32) / 255  # CHW in the file
    assert train.y[0].item() == raw["labels"][0]
    # normalisation is affine per channel, so each channel still correlates perfectly with the file's
    # pixels: the HWC/CHW layout was not scrambled on the way.
    for channel in range(3):
        corr = np.corrcoef(train.x[0, channel].flatten(), first[channel].flatten())[0, 1]
        assert corr > 0.9999


def test_cifar10_missing_files_give_an_actionable_error(tmp_path):
    with pytest.raises(DataError, match="CIFAR-10 is not under"):
        load_cifar10(tmp_path, download=False)


def test_digits_and_synthetic_need_no_files():
    for model, dataset in [
        ("lenet", "digits"),
        ("lenet", "synthetic"),
        ("resnet18", "synthetic"),
        ("gpt", "synthetic"),
    ]:
        train, test, info = load_dataset(RunConfig(model=model, dataset=dataset))
        assert len(train) > len(test) > 100
        assert train.x.shape[1:] == info.input_shape


def test_reverse_task_scores_only_the_reversed_half():
    train, _, info = load_dataset(RunConfig(model="gpt", dataset="synthetic"))
    x, y = train[0]
    half = info.input_shape[0] // 2
    assert (y[:half] == IGNORE_INDEX).all()
    assert y[half:].tolist() == x[:half].flip(0).tolist()


def test_text_dataset_is_next_character_prediction(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("hello distributed world. " * 200)
    train, _, info = load_text(path, block_size=16)
    assert info.num_classes == len(set(path.read_text()))
    x, y = train[3]
    assert x[1:].tolist() == y[:-1].tolist()
    with pytest.raises(DataError, match="too short"):
        (tmp_path / "short.txt").write_text("tiny")
        load_text(tmp_path / "short.txt")


@pytest.mark.skipif(
    not DEBIAN_FASHION_MNIST.is_dir(), reason="Debian's dataset-fashion-mnist is not installed"
)
def test_fashion_mnist_from_debian_is_verified(tmp_path):
    raw = prepare_fashion_mnist(tmp_path)
    assert sorted(p.name for p in raw.iterdir()) == sorted(FASHION_MNIST_MD5)


def test_a_missing_cifar10_is_one_line_before_any_rank_starts(tmp_path):
    """`python train.py` of a multi-process impl checks the dataset before starting its ranks: one line,
    exit 2 (it was the same error from every rank, and torchrun's report of the failed rank). The download
    is made to fail here (a proxy nobody listens on), network or not."""
    from distref.testing import ROOT, run_script

    args = ["--model", "resnet18", "--dataset", "cifar10", "--data-root", str(tmp_path), "--steps", "1"]
    no_network = {"HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}
    result = run_script([sys.executable, str(ROOT / "impls" / "ddp" / "train.py"), *args], env=no_network)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ddp: error: CIFAR-10 is not under {tmp_path}"), lines
    assert "starting" not in result.stdout


@pytest.mark.parametrize(
    ("dataset", "length", "train", "test"),
    [("synthetic", 16, 20_000, 2_000), ("synthetic", 256, 1_250, 125), ("masked", 64, 5_000, 500)],
)
def test_sequence_length_makes_gpts_tasks_as_long_with_as_many_tokens(dataset, length, train, test):
    """--sequence-length N: the reversal of N/2 digits (the default 16 unchanged: the same 20,000 sequences
    as before the option), as many tokens in all; the last answer reads the first digit, N − 1 back."""
    default = load_dataset(RunConfig(model="gpt", dataset=dataset))[0]
    data, test_set, info = load_dataset(RunConfig(model="gpt", dataset=dataset, sequence_length=length))
    assert (
        data.x.shape == (train, length)
        and test_set.x.shape == (test, length)
        and info.input_shape == (length,)
    )
    if length == 16:
        assert torch.equal(data.x, default.x) and torch.equal(data.y, default.y)
    if dataset == "synthetic":  # the first digit is the last target; only the reversed half is scored
        assert torch.equal(data.y[:, -1], data.x[:, 0])
        assert (data.y != IGNORE_INDEX).sum(1).eq(length // 2).all()


def test_sequence_length_sets_text_blocks_and_gpt2s_context(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("abcdefghij" * 300)
    train, _, info = load_dataset(
        RunConfig(model="gpt", dataset="text", data_root=str(text), sequence_length=100)
    )
    assert train.x.shape[1] == 100 and info.input_shape == (100,)
    assert torch.equal(train.y[0, :-1], train.x[0, 1:])
    train, _, info = load_dataset(RunConfig(model="gpt2", dataset="synthetic", sequence_length=128))
    assert info.input_shape == (128,) and train.x.shape == (8192, 128)  # GPT-2's 1,024 × 1024 tokens


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            dict(model="lenet", dataset="mnist", sequence_length=16),
            "--sequence-length sets the tokens per sequence of gpt's and gpt2's data (--dataset synthetic, "
            "masked or text), not of --dataset mnist with --model lenet",
        ),
        (
            dict(model="gpt", dataset="distref.testing.own:example_tokens", sequence_length=16),
            "--sequence-length sets the tokens per sequence of gpt's and gpt2's data (--dataset synthetic, "
            "masked or text), not of --dataset distref.testing.own:example_tokens with --model gpt",
        ),
        (
            dict(model="gpt", dataset="masked", sequence_length=9),
            "--sequence-length 9: gpt's masked task is digits, a separator and the digits reversed, 2 × "
            "digits tokens in all: give an even length",
        ),
    ],
)
def test_a_sequence_length_the_data_cannot_take_is_one_line(options, message):
    from distref.cli import validate

    assert validate(RunConfig(**options)) == message


def test_a_sequence_length_whose_data_outgrows_the_memory_is_one_line(monkeypatch):
    """--sequence-length 10,000,000: 80 sequences of inputs and targets, 12.8 GB a process, was made by
    every rank and killed it (or never finished) after the ranks started. Refused before, saying why,
    counting the processes on this machine (torchrun's local ranks where it says)."""
    from distref.cli import validate
    from distref.data import datasets

    monkeypatch.setattr(datasets, "physical_memory", lambda: 24 * 10**9)
    message = validate(RunConfig(model="gpt", dataset="synthetic", sequence_length=10**7), world_size=2)
    assert message == (
        "--sequence-length 10000000: 2 process(es) here would each make 12.8 GB of token sequences (at least "
        "64 of them), more than this machine's 24.0 GB of memory: give a shorter length, or --dataset text"
    )
    long = RunConfig(model="gpt", dataset="synthetic", sequence_length=10**7)
    monkeypatch.setattr(datasets, "physical_memory", lambda: 20 * 10**9)
    assert datasets.sequence_length_problem(long, 1) is None  # one process of 12.8 GB fits 20 GB
    assert "2 process(es)" in datasets.sequence_length_problem(long, 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # (torchrun's: the ranks on this node, not the world)
    assert datasets.sequence_length_problem(long, 8) is None


def test_eval_samples_scores_the_first_n_test_samples_and_the_record_says_so(tmp_path):
    """--eval-samples N: the test set is its first N samples (every impl loads it through load_dataset),
    the record's config and its accuracy say so; N beyond the test set scores all of it."""
    from distref.cli import parse_config
    from distref.testing import load_train_module

    args = ["--model", "lenet", "--dataset", "synthetic", "--steps", "2", "--global-batch-size", "8"]
    _, whole, _ = load_dataset(parse_config(args, "x"))
    _, first, _ = load_dataset(parse_config([*args, "--eval-samples", "100"], "x"))
    assert len(first) == 100 and torch.equal(first.x, whole.x[:100]) and torch.equal(first.y, whole.y[:100])
    _, beyond, _ = load_dataset(parse_config([*args, "--eval-samples", str(len(whole) + 1)], "x"))
    assert len(beyond) == len(whole)
    with pytest.raises(SystemExit):  # (argparse: one line, exit 2)
        parse_config([*args, "--eval-samples", "0"], "x")
    record = load_train_module("single").main([*args, "--eval-samples", "100", "--out", str(tmp_path)])
    assert record["config"]["eval_samples"] == 100
    assert record["final_accuracy"] * 100 == pytest.approx(round(record["final_accuracy"] * 100))
