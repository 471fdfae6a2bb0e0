"""The data order contract: step t uses the same samples in every impl and at every world size."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distref.config import RunConfig
from distref.data import (
    TensorData,
    epoch_permutation,
    global_batch_indices,
    shard,
    steps_per_epoch,
    train_loader,
)
from distref.data.order import StepBatchSampler


@st.composite
def layouts(draw):
    world = draw(st.sampled_from([1, 2, 3, 4, 8]))
    accum = draw(st.sampled_from([1, 2, 4]))
    micro = draw(st.integers(1, 6))
    batch = world * accum * micro
    n = draw(st.integers(batch, batch * 7 + 5))
    return n, batch, world, accum, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=150, deadline=None)
@given(layouts(), st.integers(0, 40))
def test_shards_reassemble_the_global_batch_at_any_world_size(layout, step):
    n, batch, world, accum, seed = layout
    expected = global_batch_indices(n, batch, seed, step)
    assert len(expected) == batch
    pieces = [shard(expected, r, world, m, accum) for r in range(world) for m in range(accum)]
    # contiguous slices, rank-major then micro-step: concatenated they are the global batch, in order
    np.testing.assert_array_equal(np.concatenate(pieces), expected)


@settings(max_examples=60, deadline=None)
@given(layouts(), st.integers(0, 3))
def test_sampler_yields_each_ranks_slice_of_the_same_steps(layout, start_step):
    n, batch, world, accum, seed = layout
    total = start_step + 2 * steps_per_epoch(n, batch) + 1  # crosses epoch boundaries
    per_rank = [
        list(StepBatchSampler(n, batch, seed, start_step, total, r, world, accum)) for r in range(world)
    ]
    for i, step in enumerate(range(start_step, total)):
        got = [
            idx
            for r in range(world)
            for idx_list in per_rank[r][i * accum : (i + 1) * accum]
            for idx in idx_list
        ]
        np.testing.assert_array_equal(got, global_batch_indices(n, batch, seed, step))


def test_epochs_reshuffle_deterministically_without_set_epoch():
    n, batch, seed = 1000, 100, 7
    spe = steps_per_epoch(n, batch)
    epoch0 = np.concatenate([global_batch_indices(n, batch, seed, t) for t in range(spe)])
    epoch1 = np.concatenate([global_batch_indices(n, batch, seed, t) for t in range(spe, 2 * spe)])
    assert sorted(epoch0) == list(range(n)) == sorted(epoch1)  # each epoch is a permutation
    assert not np.array_equal(epoch0, epoch1)  # and a different one (pytorch/examples #1074)
    np.testing.assert_array_equal(epoch_permutation(n, seed, 1), epoch_permutation(n, seed, 1))
    assert not np.array_equal(epoch_permutation(n, seed, 0), epoch_permutation(n, seed + 1, 0))


def test_loader_resumes_mid_epoch_with_the_same_batches():
    data = TensorData(torch.arange(500).reshape(500, 1), torch.arange(500))
    cfg = RunConfig(global_batch_size=20, seed=3, grad_accum=2)
    full = [x.flatten().tolist() for x, _ in train_loader(data, cfg, 0, 40)]
    resumed = [x.flatten().tolist() for x, _ in train_loader(data, cfg, 13, 40)]
    assert resumed == full[13 * 2 :]


def test_scored_targets_counts_the_whole_global_batch_of_each_step():
    """The divisor of every impl's step loss: the scored targets (not IGNORE_INDEX) of step t's whole
    global batch, the same number on every rank (each counts it alone), whatever the world size."""
    from distref.data import scored_targets, synthetic_masked

    train, _, _ = synthetic_masked(n_train=200, n_test=1)
    cfg = RunConfig(global_batch_size=16, seed=3)
    counts = []
    for step in range(30):  # past the epoch's end (12 steps of 16 of 200): the next epoch's order
        batch = global_batch_indices(len(train), 16, 3, step)
        expected = int((train.y[batch] != -100).sum())
        assert scored_targets(train, cfg, step) == expected
        counts.append(expected)
    assert len(set(counts)) > 5  # masked: the count changes from step to step
    labels = TensorData(torch.zeros(50, 1, 2, 2), torch.arange(50) % 10)  # class labels: one per sample
    assert scored_targets(labels, RunConfig(global_batch_size=16), 1) == 16
    nothing = TensorData(torch.zeros(50, 4), torch.full((50, 4), -100))
    assert scored_targets(nothing, RunConfig(global_batch_size=16), 0) == 1  # loss 0, not 0/0
