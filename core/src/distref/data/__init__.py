"""Data: every dataset a run can name (`datasets`, with MNIST's files in `mnist`), held as tensors
(`tensors`), and the order every impl reads them in (`order`: what makes parity possible)."""

from distref.data.datasets import (
    SYNTHETIC_TRAIN_SIZES,
    TRAIN_SET_SIZES,
    load_dataset,
    own_dataset,
    prepare_dataset_files,
    read_text,
    sample_batch,
    sequence_length,
    sequence_length_problem,
    synthetic_images,
    synthetic_masked,
    synthetic_reverse,
    train_set_size,
)
from distref.data.order import (
    epoch_permutation,
    eval_batches,
    global_batch_indices,
    scored_targets,
    shard,
    steps_per_epoch,
    train_loader,
)
from distref.data.tensors import IGNORE_INDEX, DataError, DatasetInfo, TensorData

__all__ = [
    "IGNORE_INDEX",
    "SYNTHETIC_TRAIN_SIZES",
    "TRAIN_SET_SIZES",
    "DataError",
    "DatasetInfo",
    "TensorData",
    "epoch_permutation",
    "eval_batches",
    "global_batch_indices",
    "load_dataset",
    "own_dataset",
    "prepare_dataset_files",
    "read_text",
    "sample_batch",
    "scored_targets",
    "sequence_length",
    "sequence_length_problem",
    "shard",
    "steps_per_epoch",
    "synthetic_images",
    "synthetic_masked",
    "synthetic_reverse",
    "train_loader",
    "train_set_size",
]
