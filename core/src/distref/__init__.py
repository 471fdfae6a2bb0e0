"""distref core: what is the same for every strategy (models, data order, run contract, record,
checkpoints, comparison report). Each strategy's own code lives in impls/<strategy>/train.py."""

from __future__ import annotations

import tomllib
from pathlib import Path

__version__ = "0.23.0"  # = core/pyproject.toml (a test keeps them equal)


def impl_dependencies(impl_dir: str | Path) -> list[str]:
    """What an impl needs besides distref-core: its pyproject.toml's dependencies (torch, deepspeed, ...)."""
    with open(Path(impl_dir) / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"].get("dependencies", [])
    return [d for d in deps if not d.startswith("distref")]


def declared_torch(impl_dir: str | Path) -> str:
    """The oldest torch a package declares: the X of its pyproject.toml's `torch>=X` (docs/environment.md,
    "Which torch")."""
    with open(Path(impl_dir) / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    (torch_dep,) = [d.replace(" ", "") for d in deps if d.replace(" ", "").startswith("torch>=")]
    return torch_dep[len("torch>=") :]


def impl_version(train_file: str | Path) -> str:
    """The version of the impl whose train.py is `train_file`: its pyproject.toml's project.version."""
    pyproject = Path(train_file).resolve().parent / "pyproject.toml"
    with open(pyproject, "rb") as f:
        return tomllib.load(f)["project"]["version"]
