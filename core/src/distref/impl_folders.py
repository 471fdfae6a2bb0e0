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
            # gpt's mixture of experts (--experts): "never" (refused), "optional" (single), "required"
            "experts": settings.get("experts", "never"),
        }
    return found


def load_train_module(train: Path):
    """An impl's train.py as a module (train.py files are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"distref_ranks_{train.parent.name}", train)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class TrainAPI:
    """What the tools (compare, parity, ranks, simulate, plan) may use of an impl's train.py: the names its
    pyproject.toml declares in [tool.distref] `tools_call`, and nothing else. A train.py is a script users
    copy and change: the list says what it must keep for the tools, and a tool reaching for anything else
    fails at once, naming the list, instead of depending on it unseen (core/tests/test_tool_api.py holds
    the tools to the lists)."""

    def __init__(self, train: Path):
        with open(train.parent / "pyproject.toml", "rb") as f:
            settings = tomllib.load(f).get("tool", {}).get("distref", {})
        self._train, self._declared = train, tuple(settings.get("tools_call", ()))
        self._module = load_train_module(train)
        if missing := [name for name in self._declared if not hasattr(self._module, name)]:
            raise SystemExit(
                f"distref: error: {train} does not define {', '.join(missing)}, which its pyproject.toml "
                "declares for the tools ([tool.distref] tools_call)"
            )

    def declares(self, name: str) -> bool:
        return name in self._declared

    def __getattr__(self, name: str):
        if name.startswith("_") or name not in self._declared:
            raise AttributeError(
                f"{self._train} does not declare {name!r} for the tools: they may use only "
                f"{', '.join(self._declared) or 'nothing'} ([tool.distref] tools_call in its pyproject.toml)"
            )
        return getattr(self._module, name)


def load_train_api(train: Path) -> TrainAPI:
    """An impl's train.py as the tools may use it (`TrainAPI`)."""
    return TrainAPI(train)


def parse_as(train: Path, args: Sequence[str], ranks: int) -> RunConfig:
    """Parse `args` exactly as the impl's train.py does for `ranks` ranks (its `parse_options`: its own
    options, its checks, how its ranks share the batch): one line and exit 2 if bad."""
    api = load_train_api(train)
    if not api.declares("parse_options"):
        raise SystemExit(
            f"distref: error: {train} declares no parse_options(argv, world_size) for the tools: every "
            "impl's train.py defines one, listed in [tool.distref] tools_call (docs/adding-an-impl.md)"
        )
    return api.parse_options(list(args), ranks)


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
