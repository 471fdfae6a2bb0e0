"""Every rank reads the data and builds the model itself: before training, the ranks check that they
all got the same, in one collective.

Nothing else would notice. A dataset function that draws from an unseeded generator, or reads a file
that differs between nodes, gives each rank other samples: data parallelism then trains each rank on data
the others never see, and the run completes. A model function that calls `torch.seed()` gives each rank
other initial weights: FSDP, tensor and pipeline parallelism then assemble one model from the slices of
several (DDP alone broadcasts rank 0's parameters, hiding it). So every rank hashes what it read and
built, and the ranks all-gather the hashes: 64 bytes per rank, once, on every launch path (torchrun, srun,
a PyTorchJob, `python train.py`), counted in the record's set-up communication.

What is hashed is what can differ: your dataset (--dataset MODULE:FUNCTION) and a text file (a copy per
node), your model's initial state (--model MODULE:FUNCTION). This project's models and generated datasets
come from fixed seeds, and MNIST, Fashion-MNIST and CIFAR-10 are checked against their md5 sums.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distref.config import RunConfig, is_factory
from distref.data.datasets import fingerprint
from distref.data.tensors import DataError, TensorData

DIGEST_BYTES = 32  # sha256


def state_fingerprint(tensors: Iterable[tuple[str, Any]]) -> str:
    """sha256 of named tensors (names, shapes, dtypes, values), wherever they are; anything else in a
    state_dict (a module's extra state) by its repr."""
    digest = hashlib.sha256()
    for name, tensor in tensors:
        if not isinstance(tensor, torch.Tensor):  # (a module's extra state: whatever it keeps)
            digest.update(f"{name} {tensor!r}".encode())
            continue
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
        digest.update(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_ranks_agree(cfg: RunConfig, train_set: TensorData, test_set: TensorData, model: nn.Module) -> None:
    """Raise DataError (one line, the same on every rank) where the ranks read different data or built
    different initial models. Call with the whole model, built and not yet split or wrapped, before
    training. A collective over every rank."""
    checked = {
        "data": fingerprint(train_set, test_set)
        if is_factory(cfg.dataset) or cfg.dataset == "text"
        else None,
        "model": state_fingerprint(model.state_dict().items()) if is_factory(cfg.model) else None,
    }
    if all(digest is None for digest in checked.values()):
        return
    mine = torch.tensor(
        [byte for digest in checked.values() for byte in bytes.fromhex(digest or "00" * DIGEST_BYTES)],
        dtype=torch.uint8,
    )
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    every_rank = [torch.empty_like(mine, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(every_rank, mine.to(device))
    for index, what in enumerate(checked):
        digests = [
            bytes(r[index * DIGEST_BYTES : (index + 1) * DIGEST_BYTES].tolist()).hex() for r in every_rank
        ]
        if len(set(digests)) > 1:
            raise DataError(disagreement(what, cfg, digests))


def disagreement(what: str, cfg: RunConfig, digests: list[str]) -> str:
    """The one line saying which ranks got what, and what to change."""
    groups: dict[str, list[int]] = {}
    for rank, digest in enumerate(digests):
        groups.setdefault(digest, []).append(rank)
    said = "; ".join(f"rank {', '.join(map(str, ranks))}: sha256 {d[:12]}" for d, ranks in groups.items())
    if what == "data":
        if cfg.dataset == "text":
            return f"--dataset text: the ranks read different text from {cfg.data_root} ({said}): every node needs the same file"
        function = cfg.dataset.partition(":")[2]
        return (
            f"--dataset {cfg.dataset}: the ranks read different data ({said}): {function}() must return the "
            "same samples every time it is called (the same files; random numbers from a seeded generator)"
        )
    function = cfg.model.partition(":")[2]
    return (
        f"--model {cfg.model}: the ranks built different initial parameters ({said}): {function}() must build "
        "the same model every time (initialise from torch's generator, which the impl seeds with --seed; "
        "never call torch.seed())"
    )
