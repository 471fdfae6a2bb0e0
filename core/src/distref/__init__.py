"""distref core: what is the same for every strategy (models, data order, run contract, record,
checkpoints, comparison report). Each strategy's own code lives in impls/<strategy>/train.py."""

from __future__ import annotations

import tomllib
from pathlib import Path

__version__ = "0.3.1"  # = core/pyproject.toml (0.3.1: MNIST read without importing torchvision)


def impl_version(train_file: str | Path) -> str:
    """The version of the impl whose train.py is `train_file`: its pyproject.toml's project.version."""
    pyproject = Path(train_file).resolve().parent / "pyproject.toml"
    with open(pyproject, "rb") as f:
        return tomllib.load(f)["project"]["version"]
