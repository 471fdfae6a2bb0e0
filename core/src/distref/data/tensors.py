"""What every dataset becomes: tensors held in memory (`TensorData`), what a model needs to know of
them (`DatasetInfo`), and the one error a dataset raises (`DataError`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

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

    @functools.cached_property
    def scored_per_sample(self) -> torch.Tensor:
        """How many of each sample's targets are scored (not IGNORE_INDEX): 1 for a class label, up to the
        sequence length for tokens. Counted once; `data.order.scored_targets` sums it over a step's batch."""
        return (self.y != IGNORE_INDEX).reshape(len(self.y), -1).sum(1)


def whole_batch(batch):
    return batch  # __getitems__ already returns stacked tensors
