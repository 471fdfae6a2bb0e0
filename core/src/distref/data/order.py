"""The data order every impl shares (what makes parity possible).

For a seed and a global batch size B, optimizer step t uses the same B sample indices in every impl and at
every world size. Epoch e = t // steps_per_epoch is a seeded permutation of the training set (seeded by
(seed, e), so forgetting a `set_epoch` call is impossible); step t takes the next B indices of it. Each rank
takes its contiguous slice of those B, and each gradient-accumulation micro-step its contiguous slice of
the rank's part. `TensorData.__getitems__` hands the DataLoader a whole micro-batch at once.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader

from distref.config import RunConfig
from distref.data.tensors import DataError, TensorData, whole_batch


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
    perm = _permutation_of_epoch(num_samples, seed, epoch)
    return perm[index * global_batch_size : (index + 1) * global_batch_size].clone()  # (not a view of it)


# The loop asks once per step; a permutation of 60,000 costs ~1 ms to draw.
_permutation_of_epoch = functools.lru_cache(maxsize=2)(epoch_permutation)


def scored_targets(dataset: TensorData, cfg: RunConfig, step: int) -> int:
    """How many targets of optimizer step `step`'s whole global batch are scored (not IGNORE_INDEX): what
    every impl divides the step's summed loss by, so that the loss is the mean over the global batch
    however the batch is split over ranks and micro-batches (docs/parity.md, "One global batch, one loss").

    Counted by each rank alone, no collective: every rank holds the whole dataset and the data order is a
    function of (seed, step), so every rank gets the same number, and the step communicates nothing more
    (the cost model's bytes are unchanged). In your own project, where a rank sees only its own samples,
    one all_reduce of the local count gives the same number (torchtitan does that). At least 1: a batch
    with nothing to score has loss 0 and no gradient, not 0/0."""
    indices = global_batch_indices(len(dataset), cfg.global_batch_size, cfg.seed, step)
    return max(int(dataset.scored_per_sample[indices].sum()), 1)


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
    *,
    device: torch.device | None = None,
    targets_device: torch.device | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Micro-batches for this rank, in the shared data order, from `start_step` on (exact resume), each
    (inputs, targets) on `device` (targets on `targets_device`, by default the same) when one is given
    (`ahead_on`), else where the dataset holds them."""
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
    cuda = device is not None and device.type == "cuda"
    loader = DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=whole_batch,
        num_workers=cfg.num_workers,
        persistent_workers=False,
        pin_memory=cuda,  # page-locked: the copy to the GPU can be asynchronous (`ahead_on`)
    )
    return ahead_on(loader, device, targets_device) if device is not None else iter(loader)


def ahead_on(
    batches, device: torch.device, targets_device: torch.device | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each (inputs, targets) of `batches` on `device` (targets on `targets_device`), the next one's copy
    queued when this one is handed out: on CUDA, from page-locked memory without blocking, so the host
    never waits for a copy and the GPU finds each batch there when its step begins. On the CPU there is
    no copy to overlap: each batch read when asked for, as it is."""
    if torch.device(device).type == "cpu" and (
        targets_device is None or torch.device(targets_device).type == "cpu"
    ):
        yield from batches
        return

    def sent(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        return x.to(device, non_blocking=True), y.to(targets_device or device, non_blocking=True)

    batches = iter(batches)
    if (first := next(batches, None)) is None:
        return
    upcoming = sent(first)
    for batch in batches:
        current, upcoming = upcoming, sent(batch)
        yield current
    yield upcoming


# Every impl scores the test set in batches of this size. (1000 took 40% more CPU than 500 for lenet on
# MNIST's test set: one thread's caches; gpt's was the same. On a GPU either is a few kernels.)
EVAL_BATCH_SIZE = 500


def eval_batches(dataset: TensorData, batch_size: int = EVAL_BATCH_SIZE, rank: int = 0, world_size: int = 1):
    """This rank's contiguous shard of the test set, in fixed order, in batches."""
    n = len(dataset)
    lo, hi = n * rank // world_size, n * (rank + 1) // world_size
    for start in range(lo, hi, batch_size):
        yield dataset.x[start : min(start + batch_size, hi)], dataset.y[start : min(start + batch_size, hi)]
