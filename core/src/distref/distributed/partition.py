"""Cutting a model's block list into consecutive parts (model parallel, pipeline).

A partition is given by cut points: `--partition 1,3` on a 4-block model means parts [0, 1), [1, 3) and
[3, 4) — block indices, so every part is whole blocks and keeps the core model's parameter names.
Without `--partition`, the cut is the one that balances parameter counts best (the largest part as small
as possible), which for these small models is found by trying every cut.
"""

from __future__ import annotations

import itertools

import torch

from distref.data.tensors import DatasetInfo
from distref.models import build_model

# A representative dataset per model: the block structure does not depend on the data's size.
MODEL_DATASETS = {
    "lenet": DatasetInfo("mnist", 10, (1, 28, 28), "image"),
    "resnet18": DatasetInfo("cifar10", 10, (3, 32, 32), "image"),
    "gpt": DatasetInfo("synthetic", 11, (16,), "sequence"),
}


def block_sizes(model_name: str, gpt_layers: int = 2) -> dict[str, int]:
    """{block name: parameter count}, in order, without data or memory (built on the meta device)."""
    with torch.device("meta"):
        model = build_model(model_name, MODEL_DATASETS[model_name], gpt_layers)
    return {name: sum(p.numel() for p in block.parameters()) for name, block in model.named_children()}


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


def balanced_cut_points(sizes: list[int], parts: int) -> list[int]:
    """The cut points that minimise the largest part's parameter count (ties: the earliest cuts)."""
    best, best_cuts = None, None
    for cuts in itertools.combinations(range(1, len(sizes)), parts - 1):
        bounds = [0, *cuts, len(sizes)]
        largest = max(sum(sizes[a:b]) for a, b in itertools.pairwise(bounds))
        if best is None or largest < best:
            best, best_cuts = largest, list(cuts)
    return best_cuts


def part_bounds(cuts: list[int], n_blocks: int) -> list[tuple[int, int]]:
    """[(first block, end block)] of each part."""
    return list(itertools.pairwise([0, *cuts, n_blocks]))


def choose_cut_points(
    model_name: str, text: str | None, parts: int, gpt_layers: int = 2
) -> tuple[list[int] | None, str | None]:
    """The cut points for `parts` parts of `model_name`: `--partition` if given, else balanced; or
    (None, a one-line reason) when the model cannot be cut so."""
    sizes = list(block_sizes(model_name, gpt_layers).values())
    if parts > len(sizes):
        hint = f" (gpt has --gpt-layers + 2: use --gpt-layers {parts - 2})" if model_name == "gpt" else ""
        return None, f"{parts} parts but --model {model_name} has only {len(sizes)} blocks{hint}"
    if text is not None:
        return parse_cut_points(text, len(sizes), parts)
    return balanced_cut_points(sizes, parts), None
