"""Cutting a model's block list into consecutive parts (model parallel, pipeline).

A partition is given by cut points: `--partition 1,3` on a 4-block model means parts [0, 1), [1, 3) and
[3, 4) — block indices, so every part is whole blocks and keeps the core model's parameter names.
Without `--partition`, the cut is the one that balances parameter counts best (the largest part as small
as possible) among those that give every part parameters. The cuts are computed from the model built:
this project's, or a model of your own (--model MODULE:FUNCTION), checked to be a sequence of blocks
(distref.your_model.cut_problem).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import torch
from torch import nn

from distref.config import GPT2_CONTEXT, GPT2_VOCABULARY
from distref.data import DatasetInfo
from distref.models import build_model

# A representative dataset per model: the block structure does not depend on the data's size.
MODEL_DATASETS = {
    "lenet": DatasetInfo("mnist", 10, (1, 28, 28), "image"),
    "resnet18": DatasetInfo("cifar10", 10, (3, 32, 32), "image"),
    "gpt": DatasetInfo("synthetic", 11, (16,), "sequence"),
    "gpt2": DatasetInfo("synthetic", GPT2_VOCABULARY, (GPT2_CONTEXT,), "sequence"),
}


def block_sizes(model: nn.Module) -> dict[str, int]:
    """{block name: parameter count}, in order, of a built model (its children)."""
    return {name: sum(p.numel() for p in block.parameters()) for name, block in model.named_children()}


def named_block_sizes(model_name: str, gpt_layers: int = 2) -> dict[str, int]:
    """block_sizes of one of this project's models, without data or memory (built on the meta device)."""
    with torch.device("meta"):
        return block_sizes(build_model(model_name, MODEL_DATASETS[model_name], gpt_layers))


def parse_cut_points(text: str, n_blocks: int, parts: int) -> tuple[list[int] | None, str | None]:
    """(cut points, None) from `--partition` text, or (None, a one-line reason it is wrong)."""
    try:
        cuts = [int(c) for c in text.split(",")]
    except ValueError:
        return None, f"--partition {text}: cut points are block indices separated by commas, e.g. 2 or 1,3"
    if len(cuts) + 1 != parts:
        return None, f"--partition {text} makes {len(cuts) + 1} parts, but there are {parts} ranks/devices"
    if cuts != sorted(set(cuts)) or cuts[0] < 1 or cuts[-1] > n_blocks - 1:
        return None, f"--partition {text}: cut points must increase strictly within 1..{n_blocks - 1}"
    return cuts, None


def balanced_cut_points(sizes: Sequence[int], parts: int) -> list[int] | None:
    """The cut points that minimise the largest part's parameter count, among those that give every part
    parameters (None if there are none); of several such, the earliest cuts. Dynamic programming over
    (first block, parts left): fast for models of hundreds of blocks, and kept for the next call with the
    same blocks (the planner asks for each mesh of each cluster it tries)."""
    cuts = _balanced_cut_points(tuple(sizes), parts)
    return None if cuts is None else list(cuts)


@functools.lru_cache(maxsize=256)
def _balanced_cut_points(sizes: tuple[int, ...], parts: int) -> tuple[int, ...] | None:
    n = len(sizes)
    prefix = [0, *itertools.accumulate(sizes)]

    @functools.cache
    def smallest_largest(first: int, k: int) -> float:
        """The smallest largest part over the cuts of blocks[first:] into k parts with parameters."""
        if k == 1:
            return prefix[n] - prefix[first] or math.inf
        return min(
            (
                max(prefix[end] - prefix[first], smallest_largest(end, k - 1))
                for end in range(first + 1, n - k + 2)
                if prefix[end] > prefix[first]
            ),
            default=math.inf,
        )

    limit = smallest_largest(0, parts)
    if limit == math.inf:
        return None
    cuts, first = [], 0
    for k in range(parts, 1, -1):  # each cut as early as still leaves a cut of the rest within the limit
        first = next(
            end
            for end in range(first + 1, n - k + 2)
            if 0 < prefix[end] - prefix[first] <= limit and smallest_largest(end, k - 1) <= limit
        )
        cuts.append(first)
    return tuple(cuts)


def part_bounds(cuts: list[int], n_blocks: int) -> list[tuple[int, int]]:
    """[(first block, end block)] of each part."""
    return list(itertools.pairwise([0, *cuts, n_blocks]))


def choose_cut_points(
    sizes: dict[str, int], text: str | None, parts: int, model_name: str = "the model"
) -> tuple[list[int] | None, str | None]:
    """The cut points for `parts` parts of a model whose blocks have `sizes` parameters (`block_sizes`):
    `--partition` if given, else balanced; or (None, a one-line reason) when it cannot be cut so. Every
    part must hold parameters (a rank's optimizer has nothing to step otherwise)."""
    names, counts = list(sizes), list(sizes.values())
    if parts > len(counts):
        hint = f" (gpt has --gpt-layers + 2: use --gpt-layers {parts - 2})" if model_name == "gpt" else ""
        return None, f"{parts} parts but --model {model_name} has only {len(counts)} blocks{hint}"
    if text is not None:
        cuts, problem = parse_cut_points(text, len(counts), parts)
    else:
        cuts = balanced_cut_points(counts, parts)
        problem = (
            None
            if cuts is not None
            else (
                f"--model {model_name} cannot be cut into {parts} parts that each hold parameters "
                f"(blocks and their parameters: {', '.join(f'{n} {c}' for n, c in sizes.items())})"
            )
        )
    if problem:
        return None, problem
    for a, b in part_bounds(cuts, len(counts)):
        if not sum(counts[a:b]):
            empty = ",".join(names[a:b])
            return None, f"--partition {text}: part {empty} holds no parameters; every rank needs some"
    return cuts, None
