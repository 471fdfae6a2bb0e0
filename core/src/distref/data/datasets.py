"""Every dataset a run can name (`--dataset`), loaded into memory: `load_dataset(cfg)`."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from distref.config import (
    GPT2_CONTEXT,
    GPT2_VOCABULARY,
    GPT_TASK_SEQUENCE,
    TEXT_BLOCK,
    FactoryError,
    RunConfig,
    default_sequence_length,
    first_line,
    is_factory,
    load_factory,
)
from distref.data.mnist import idx_dataset, prepare_fashion_mnist, prepare_mnist
from distref.data.tensors import IGNORE_INDEX, DataError, DatasetInfo, TensorData


def prepare_cifar10(root: Path) -> None:
    """Download (where there is a network) and verify CIFAR-10 under `root`, loading only its small test
    batch: launch_ranks runs it before any rank exists, so that a missing dataset is one line, not one per
    rank (and ranks never race to download it)."""
    from torchvision.datasets import CIFAR10

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            CIFAR10(str(root), train=False, download=True)  # (verifies every batch's md5 first)
    except Exception as exc:
        raise DataError(
            f"CIFAR-10 is not under {root}/cifar-10-batches-py and cannot be downloaded ({exc})"
        ) from exc


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
# SAME_SET_ONCE: the sets made here from a seed alone (synthetic, masked, digits) are kept by each
# process, the last two of each kind (lenet's and resnet18's images; two sequence lengths): nothing
# writes into a dataset's tensors, so runs in one process, and ranks forked from a process that made the
# set (sharing its pages), take the same tensors.
TRAIN_SET_SIZES = {"mnist": 60000, "fashion-mnist": 60000, "cifar10": 50000, "digits": 1437}


SYNTHETIC_TRAIN_SIZES = {"image": 8192, "gpt": 20000, "gpt2": 1024}


@functools.lru_cache(maxsize=2)  # (see SAME_SET_ONCE)
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


@functools.lru_cache(maxsize=2)  # (see SAME_SET_ONCE)
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


def synthetic_tokens(
    n_train: int = SYNTHETIC_TRAIN_SIZES["gpt2"],
    n_test: int = 16,
    vocabulary: int = GPT2_VOCABULARY,
    context: int = GPT2_CONTEXT,
):
    """`--dataset synthetic` for gpt2: uniformly random tokens, `context` long (GPT-2's by default), to
    measure speed on (nothing to learn: the loss stays near ln(vocabulary))."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocabulary, (n_train + n_test, context + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    info = DatasetInfo("synthetic", vocabulary, (context,), "sequence")
    return TensorData(x[:n_train], y[:n_train]), TensorData(x[n_train:], y[n_train:]), info


def gpt2_token_sequences(context: int) -> int:
    """Training sequences of gpt2's random tokens at `context` tokens: 1,024 at GPT-2's 1024, as many
    tokens in all at another length, at least 64."""
    return max(64, SYNTHETIC_TRAIN_SIZES["gpt2"] * GPT2_CONTEXT // context)


SEPARATOR = 10  # token between a digit string and its reversal
TOKENS_PER_TASK_SET = SYNTHETIC_TRAIN_SIZES["gpt"] * GPT_TASK_SEQUENCE  # a longer sequence, fewer of them


def task_sizes(sequence: int) -> dict[str, int]:
    """Training and test sequences of gpt's token tasks at `sequence` tokens: 20,000 and 2,000 at 16
    (and shorter); longer ones as many tokens in all, at least 64 and 16 sequences (a million tokens: 64
    sequences of inputs and targets, 1 GB)."""
    longer = max(sequence, GPT_TASK_SEQUENCE)
    return {
        "n_train": max(64, TOKENS_PER_TASK_SET // longer),
        "n_test": max(16, 2000 * GPT_TASK_SEQUENCE // longer),
    }


@functools.lru_cache(maxsize=2)  # (see SAME_SET_ONCE)
def synthetic_reverse(length: int = 8, n_train: int = SYNTHETIC_TRAIN_SIZES["gpt"], n_test: int = 2000):
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


PAD = SEPARATOR + 1  # input token after a shorter string's end (its targets are IGNORE_INDEX)


@functools.lru_cache(maxsize=2)  # (see SAME_SET_ONCE)
def synthetic_masked(max_length: int = 8, n_train: int = SYNTHETIC_TRAIN_SIZES["gpt"], n_test: int = 2000):
    """`--dataset masked`, for `gpt`: the reversal task with strings of 1 to `max_length` digits, padded to
    one length. Only the reversed digits are scored, so a sample scores 1 to `max_length` of its
    2·max_length targets, unevenly, as padded batches, fine-tuning prompts and masked language models do.
    It is the workload where a split step must take the mean over the global batch's scored targets: the
    mean of the micro-batches' or ranks' own means weighs a micro-batch of 3 scored targets as one of 60.
    """
    g = torch.Generator().manual_seed(8765)
    width = 2 * max_length + 1  # digits, separator, reversed digits: the longest sequence

    def make(n: int):
        length = torch.randint(1, max_length + 1, (n, 1), generator=g)
        digits = torch.randint(0, 10, (n, max_length), generator=g)
        position = torch.arange(width).expand(n, width)
        reading, answering = position < length, (position > length) & (position <= 2 * length)
        # position p < length reads digit p; position p in (length, 2·length] writes digit 2·length - p
        digit = digits.gather(
            1, torch.where(reading, position, 2 * length - position).clamp(0, max_length - 1)
        )
        seq = torch.where(reading | answering, digit, torch.where(position == length, SEPARATOR, PAD))
        x, y = seq[:, :-1].clone(), seq[:, 1:].clone()
        y[~answering[:, 1:]] = IGNORE_INDEX  # score the reversed digits only: `length` targets a sample
        return TensorData(x, y)

    info = DatasetInfo("masked", PAD + 1, (2 * max_length,), "sequence")
    return make(n_train), make(n_test), info


def own_dataset(spec: str) -> tuple[TensorData, TensorData, DatasetInfo]:
    """Your data: the function MODULE:FUNCTION, called without arguments, returns (train, test), each a
    map-style dataset (len() and [i]; a torch TensorDataset, a torchvision dataset, your own class) of
    (input, target) pairs: inputs of one shape, targets class indices (integers; IGNORE_INDEX, -100, is
    not scored). Both are read into memory once, as tensors: every impl then reads the same samples in the
    same order (distref.data.order), which parity needs. Float inputs are "image"-like (any shape), integer
    ones token sequences; the classes are those the targets hold (the largest + 1). Loaded once per
    process (the launcher checks it before any rank exists; each rank reads it again, and the ranks then
    check they read the same: distref.distributed.agreement). Raises DataError (one line) where the
    contract does not hold."""
    try:
        factory = load_factory(spec, "--dataset")
    except FactoryError as exc:
        raise DataError(str(exc)) from None
    if factory not in _OWN_DATASETS:  # (by the function itself: a module imported again is read again)
        _OWN_DATASETS[factory] = _load_own_dataset(spec, factory)
    return _OWN_DATASETS[factory]


_OWN_DATASETS: dict[Callable, tuple[TensorData, TensorData, DatasetInfo]] = {}


def forget_own_datasets() -> None:
    """Drop the datasets of yours read so far: the launcher, which read yours to check it, keeps no copy
    while its ranks train (each rank reads its own)."""
    _OWN_DATASETS.clear()


def fingerprint(train: TensorData, test: TensorData) -> str:
    """sha256 of a dataset's tensors (inputs and targets, train then test)."""
    digest = hashlib.sha256()
    for tensor in (train.x, train.y, test.x, test.y):
        digest.update(str((tuple(tensor.shape), tensor.dtype)).encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@contextlib.contextmanager
def seeded_random_state(seed: int = 0) -> Iterator[None]:
    """torch's, Python's and (where installed) numpy's global random numbers seeded, then put back: what
    your dataset function draws from them is the same in every process (each rank calls it again)."""
    python_state, torch_state = random.getstate(), torch.random.get_rng_state()
    try:
        import numpy
    except ImportError:
        numpy = None
    numpy_state = numpy.random.get_state() if numpy is not None else None
    random.seed(seed)
    torch.manual_seed(seed)
    if numpy is not None:
        numpy.random.seed(seed)
    try:
        yield
    finally:
        random.setstate(python_state)
        torch.random.set_rng_state(torch_state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)


def _load_own_dataset(spec: str, factory: Callable) -> tuple[TensorData, TensorData, DatasetInfo]:
    function = spec.partition(":")[2]
    try:
        with seeded_random_state():
            made = factory()
    except (Exception, SystemExit) as exc:  # (your code: whatever it raises is said in one line)
        raise DataError(
            f"--dataset {spec}: {function}() failed: {type(exc).__name__}: {first_line(exc)}"
        ) from None
    if not (isinstance(made, tuple | list) and len(made) == 2):
        raise DataError(
            f"--dataset {spec}: {function}() must return (train, test) datasets, not {type(made).__name__}"
        )
    train, test = (
        as_tensors(part, f"--dataset {spec}: its {which} set")
        for part, which in zip(made, ("training", "test"), strict=True)
    )
    if train.x.shape[1:] != test.x.shape[1:] or train.x.dtype != test.x.dtype:
        raise DataError(
            f"--dataset {spec}: training inputs are {tuple(train.x.shape[1:])} {train.x.dtype}, test inputs "
            f"{tuple(test.x.shape[1:])} {test.x.dtype}: they must match"
        )
    scored = torch.cat([train.y.flatten(), test.y.flatten()])
    scored = scored[scored != IGNORE_INDEX]
    if len(scored) == 0 or scored.min() < 0:
        raise DataError(
            f"--dataset {spec}: targets must be class indices >= 0 (or {IGNORE_INDEX}, not scored)"
        )
    kind = "image" if train.x.is_floating_point() else "sequence"
    classes = int(scored.max()) + 1
    if kind == "sequence":  # tokens in, tokens out (gpt): the vocabulary covers both
        classes = max(classes, int(torch.cat([train.x.flatten(), test.x.flatten()]).max()) + 1)
    return train, test, DatasetInfo(spec, classes, tuple(train.x.shape[1:]), kind)


STACKED_AT_ONCE = 4096  # items stacked together: a tensor object per item for all of them at once cost
# ~1 KB each (1M items of 16 floats, 64 MB of data, peaked at 1.3 GB)


def as_tensors(dataset, what: str) -> TensorData:
    """A map-style dataset of (input, target) pairs as TensorData: inputs stacked into one tensor,
    targets into one integer tensor. A torch TensorDataset of (inputs, targets) is taken as it is; any
    other is read item by item, stacked STACKED_AT_ONCE items at a time (the peak: about twice the data)."""
    if isinstance(dataset, TensorData):
        return dataset
    if type(dataset) is TensorDataset and len(dataset.tensors) == 2:  # (a subclass may change items)
        return checked_tensors(*dataset.tensors, what, shapes={tuple(dataset.tensors[0].shape[1:])})
    try:
        n = len(dataset)
    except TypeError:
        raise DataError(
            f"{what} is a {type(dataset).__name__}: a map-style dataset (len() and [i]) is needed"
        ) from None
    if n == 0:
        raise DataError(f"{what} is empty")
    input_chunks, target_chunks, shapes = [], [], set()
    inputs, targets = [], []
    for i in range(n):
        item = dataset[i]
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise DataError(f"{what}: item {i} is not an (input, target) pair but a {type(item).__name__}")
        for part, into in zip(item, ("input", "target"), strict=True):
            try:
                (inputs if into == "input" else targets).append(torch.as_tensor(part))
            except (TypeError, ValueError, RuntimeError) as exc:
                hint = (
                    " (a PIL image: give the dataset transform=ToTensor())"
                    if "Image" in type(part).__name__
                    else ""
                )
                raise DataError(
                    f"{what}: item {i}'s {into}, a {type(part).__name__}, is not a tensor or number{hint} "
                    f"({first_line(exc)})"
                ) from None
        shapes.add(tuple(inputs[-1].shape))
        if i == 0:
            target_shape = targets[0].shape
        elif targets[-1].shape != target_shape:
            raise DataError(
                f"{what}: item {i}'s target has shape {tuple(targets[-1].shape)}, item 0's "
                f"{tuple(target_shape)}: one is needed"
            )
        if len(inputs) == STACKED_AT_ONCE or i == n - 1:
            if len(shapes) == 1:  # (else said below)
                input_chunks.append(torch.stack(inputs))
            target_chunks.append(torch.stack(targets))
            inputs, targets = [], []
    x = torch.cat(input_chunks) if len(shapes) == 1 else None
    return checked_tensors(x, torch.cat(target_chunks), what, shapes)


def checked_tensors(x: torch.Tensor | None, y: torch.Tensor, what: str, shapes: set[tuple]) -> TensorData:
    """Inputs of one shape, integer targets, no nan or inf: the dataset contract (DataError otherwise)."""
    if len(shapes) > 1:
        raise DataError(
            f"{what}: inputs of several shapes ({', '.join(map(str, sorted(shapes)[:3]))}): one is needed"
        )
    if len(x) == 0:
        raise DataError(f"{what} is empty")
    if len(x) != len(y):
        raise DataError(f"{what}: {len(x)} inputs but {len(y)} targets")
    if y.is_floating_point() or y.dtype == torch.bool:
        raise DataError(
            f"{what}: targets are {y.dtype}; the loss (cross-entropy) needs class indices (integers)"
        )
    if x.is_floating_point() and not torch.isfinite(x).all():
        first = int((~torch.isfinite(x.flatten(1))).any(dim=1).nonzero()[0])
        raise DataError(f"{what}: item {first}'s input holds nan or inf")
    return TensorData(x.float() if x.is_floating_point() else x, y.long())


# What one sample of each named dataset is (known without loading it), for checking your model on it
# (`sample_batch`); synthetic: the images it makes for any model but gpt and resnet18.
NAMED_DATASET_SAMPLES = {
    "mnist": DatasetInfo("mnist", 10, (1, 28, 28), "image"),
    "fashion-mnist": DatasetInfo("fashion-mnist", 10, (1, 28, 28), "image"),
    "digits": DatasetInfo("digits", 10, (1, 28, 28), "image"),
    "cifar10": DatasetInfo("cifar10", 10, (3, 32, 32), "image"),
    "synthetic": DatasetInfo("synthetic", 10, (1, 28, 28), "image"),
}


def sample_batch(cfg: RunConfig, n: int = 4) -> tuple[torch.Tensor, torch.Tensor, DatasetInfo]:
    """(inputs, targets, info) of `n` samples like the run's data, for checking a model of your own
    before any rank starts: your dataset's first samples; a named dataset's shapes with random values
    (from a generator of its own: the run's random state is untouched), without loading it."""
    if is_factory(cfg.dataset):
        train, _, info = own_dataset(cfg.dataset)
        return train.x[:n], train.y[:n], info
    g = torch.Generator().manual_seed(0)
    if cfg.dataset == "text":
        block = text_block_size(cfg.model, cfg.sequence_length)
        vocab = len(set(read_text(Path(cfg.data_root), block)))
        tokens = torch.randint(0, vocab, (n, block + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:], text_info(vocab, block, cfg.model)
    if cfg.dataset == "masked":  # made, not read: its first samples
        train, _, info = synthetic_masked(sequence_length(cfg) // 2, **task_sizes(sequence_length(cfg)))
        return train.x[:n], train.y[:n], info
    info = NAMED_DATASET_SAMPLES[cfg.dataset]
    x = torch.randn(n, *info.input_shape, generator=g)
    return x, torch.randint(0, info.num_classes, (n,), generator=g), info


def text_train_size(n_characters: int, block_size: int = 64) -> int:
    """Training sequences a text of `n_characters` makes: whole blocks, the first 90% of them."""
    return int(0.9 * ((n_characters - 1) // block_size))


def train_set_size(cfg: RunConfig) -> int:
    """Samples in the run's training set, known without loading it (the text file is read, not
    tokenised): the config checks the global batch against it before any process starts."""
    if is_factory(cfg.dataset):
        return len(own_dataset(cfg.dataset)[0])
    if cfg.dataset == "masked" or (cfg.dataset == "synthetic" and cfg.model == "gpt"):
        return task_sizes(sequence_length(cfg))["n_train"]
    if cfg.dataset == "synthetic" and cfg.model == "gpt2":
        return gpt2_token_sequences(sequence_length(cfg))
    if cfg.dataset == "synthetic":
        return SYNTHETIC_TRAIN_SIZES["image"]
    if cfg.dataset == "text":
        block = text_block_size(cfg.model, cfg.sequence_length)
        return text_train_size(len(read_text(Path(cfg.data_root), block)), block)
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


def text_block_size(model: str, sequence: int | None = None) -> int:
    """Characters per --dataset text sequence: `sequence` (--sequence-length), else gpt2's context (1024),
    else 64."""
    if sequence is not None:
        return sequence
    return GPT2_CONTEXT if model == "gpt2" else TEXT_BLOCK


def sequence_length(cfg: RunConfig) -> int | None:
    """Tokens per sequence of the run's data: --sequence-length, else the dataset's own (gpt's tasks 16,
    text 64, gpt2's 1024), known without loading it; a dataset of yours: its inputs' length (it is read,
    once: `own_dataset` keeps it); None for images."""
    if is_factory(cfg.dataset):
        info = own_dataset(cfg.dataset)[2]
        return info.input_shape[0] if info.kind == "sequence" else None
    default = default_sequence_length(cfg.model, cfg.dataset)
    return default if default is None or cfg.sequence_length is None else cfg.sequence_length


def made_token_bytes(cfg: RunConfig) -> int:
    """Bytes of the token sequences a process makes for gpt's tasks or gpt2's random tokens (inputs and
    targets, int64; 0 for data that is read, not made)."""
    n = sequence_length(cfg)
    if cfg.dataset in ("synthetic", "masked") and cfg.model == "gpt":
        sizes = task_sizes(n)
        return (sizes["n_train"] + sizes["n_test"]) * n * 2 * 8
    if cfg.dataset == "synthetic" and cfg.model == "gpt2":
        return (gpt2_token_sequences(n) + 16) * (n + 1) * 8
    return 0


def physical_memory() -> int:
    """Bytes of memory this machine has."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def sequence_length_problem(cfg: RunConfig, world_size: int = 1) -> str | None:
    """Why --sequence-length does not fit the run's data (a line), or None. The sequences gpt's tasks make
    (at least 64 of N tokens) are made by every rank on this machine (`world_size`, or torchrun's local
    ranks): more than its memory is refused, where it would be killed, or swap, after starting."""
    if cfg.sequence_length is None:
        return None
    if default_sequence_length(cfg.model, cfg.dataset) is None:  # (images; a dataset of yours: its own)
        return (
            "--sequence-length sets the tokens per sequence of gpt's and gpt2's data (--dataset synthetic, "
            f"masked or text), not of --dataset {cfg.dataset} with --model {cfg.model}"
        )
    if cfg.model == "gpt" and cfg.dataset in ("synthetic", "masked") and cfg.sequence_length % 2:
        return (
            f"--sequence-length {cfg.sequence_length}: gpt's {cfg.dataset} task is digits, a separator and "
            "the digits reversed, 2 × digits tokens in all: give an even length"
        )
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if (made := made_token_bytes(cfg) * local_ranks) > (memory := physical_memory()):
        return (
            f"--sequence-length {cfg.sequence_length}: {local_ranks} process(es) here would each make "
            f"{made // local_ranks / 1e9:.1f} GB of token sequences (at least 64 of them), more than this "
            f"machine's {memory / 1e9:.1f} GB of memory: give a shorter length, or --dataset text"
        )
    return None


def text_info(characters: int, block_size: int, model: str) -> DatasetInfo:
    """--dataset text's DatasetInfo: its characters are the vocabulary; for gpt2, GPT-2's padded vocabulary
    (the characters its first ids), so that the model has GPT-2 small's shape whatever the text."""
    vocabulary = max(characters, GPT2_VOCABULARY) if model == "gpt2" else characters
    return DatasetInfo("text", vocabulary, (block_size,), "sequence")


def load_text(path: Path, block_size: int = 64, model: str = "gpt"):
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
    info = text_info(len(vocab), block_size, model)
    return TensorData(x[:cut], y[:cut]), TensorData(x[cut:], y[cut:]), info


def prepare_dataset_files(cfg) -> None:
    """Build and verify MNIST / Fashion-MNIST, download and verify CIFAR-10, under --data-root (a no-op
    when they are there), without loading them (CIFAR-10: its test batch): launch_ranks calls it before any rank exists, so that a missing dataset is one line
    (and ranks never race to build the same files)."""
    if cfg.dataset == "mnist":
        prepare_mnist(Path(cfg.data_root))
    elif cfg.dataset == "fashion-mnist":
        prepare_fashion_mnist(Path(cfg.data_root))
    elif cfg.dataset == "cifar10":
        prepare_cifar10(Path(cfg.data_root))


def load_dataset(cfg: RunConfig) -> tuple[TensorData, TensorData, DatasetInfo]:
    """(train, test, info) for the run; raises DataError with an actionable message. The test set is its
    first --eval-samples samples where that is given. Under `--precision fp64` the inputs are float64,
    like the parameters (labels and tokens stay integers)."""
    train, test, info = _load_dataset(cfg)
    if cfg.eval_samples is not None and cfg.eval_samples < len(test):  # --eval-samples: the first N
        test = TensorData(test.x[: cfg.eval_samples], test.y[: cfg.eval_samples])
    if cfg.precision == "fp64":
        train, test = (
            TensorData(d.x.double() if d.x.is_floating_point() else d.x, d.y) for d in (train, test)
        )
    return train, test, info


def _load_dataset(cfg: RunConfig) -> tuple[TensorData, TensorData, DatasetInfo]:
    root = Path(cfg.data_root)
    if is_factory(cfg.dataset):
        return own_dataset(cfg.dataset)
    if cfg.dataset == "mnist":
        return idx_dataset(prepare_mnist(root), "mnist")
    if cfg.dataset == "fashion-mnist":
        return idx_dataset(prepare_fashion_mnist(root), "fashion-mnist")
    if cfg.dataset == "cifar10":
        return load_cifar10(root)
    if cfg.dataset == "digits":
        return load_digits_dataset()
    if cfg.dataset == "text":
        return load_text(root, text_block_size(cfg.model, cfg.sequence_length), cfg.model)
    if cfg.dataset == "masked":
        return synthetic_masked(sequence_length(cfg) // 2, **task_sizes(sequence_length(cfg)))
    if cfg.dataset == "synthetic":
        if cfg.model == "gpt":
            return synthetic_reverse(sequence_length(cfg) // 2, **task_sizes(sequence_length(cfg)))
        if cfg.model == "gpt2":
            return synthetic_tokens(gpt2_token_sequences(sequence_length(cfg)), context=sequence_length(cfg))
        if cfg.model == "lenet" or is_factory(cfg.model):  # (a model of yours: lenet's images)
            return synthetic_images((1, 28, 28))
        # resnet18's images: 512 to score, not 2048 (scoring 2048 took 20 s of a 24-second 3-step run here)
        return synthetic_images((3, 32, 32), n_test=512)
    raise DataError(f"unknown dataset {cfg.dataset}")
