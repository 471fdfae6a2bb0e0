"""The impl folders (impls/<name>/): finding them, reading their [tool.distref] settings, and parsing a
command line exactly as an impl's own train.py would (its options and checks), for the tools that run them
(compare, parity, ranks)."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

from distref.config import RunConfig


def discover(impls_dir: Path) -> dict[str, dict]:
    """impl name -> its [tool.distref] settings, for every impls/<name>/train.py."""
    found = {}
    for train in sorted(impls_dir.glob("*/train.py")):
        with open(train.parent / "pyproject.toml", "rb") as f:
            settings = tomllib.load(f).get("tool", {}).get("distref", {})
        found[train.parent.name] = {
            "train": train,
            "launcher": settings.get("launcher", "python"),
            "models": settings.get("models"),  # None: every model; else the only ones it trains
            "min_gpus": settings.get("min_gpus", 1),  # its -gpu session's: one per part or rank
        }
    return found


def load_train_module(train: Path):
    """An impl's train.py as a module (train.py files are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"distref_ranks_{train.parent.name}", train)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def parse_as(train: Path, args: Sequence[str], ranks: int) -> RunConfig:
    """Parse `args` exactly as the impl's train.py does for `ranks` ranks (its `parse_options`: its own
    options, its checks, how its ranks share the batch): one line and exit 2 if bad."""
    module = load_train_module(train)
    if not hasattr(module, "parse_options"):
        raise SystemExit(
            f"distref: error: {train} has no parse_options(argv, world_size): every impl's train.py "
            "defines one, for the tools to parse its command line (docs/adding-an-impl.md)"
        )
    return module.parse_options(list(args), ranks)


def validate(train: Path, args: list[str], world_size: int, distributed: bool) -> RunConfig:
    """Parse `args` as the impl's train.py would (its own options and checks included); exit 2 if bad."""
    return parse_as(train, args, world_size if distributed else 1)


def gpu_test_files(root: Path) -> list[Path]:
    """The test files (core's and each impl's) holding tests marked `gpu`: `pytest -m gpu` given only
    these collects only what they import (a GPU machine without a registry may lack the rest's
    dependencies, torchvision among them)."""
    files = sorted(
        [*(root / "core" / "tests").glob("test_*.py"), *(root / "impls").glob("*/tests/test_*.py")]
    )
    return [f for f in files if "mark.gpu" in f.read_text()]
