"""Running impls from tests: their train.py as a module or a script, their ranks (forked from a process
that imported torch once, or through torchrun), in this repository or in a project `distref.export` wrote.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from distref.testing.ranks import RankJob, start_ranks
from distref.testing.timing import note_started_processes

# The repository (or exported project) root: the folder of the conftest.py above this package; where the
# package was installed elsewhere (an exported project's `pip install .`), the folder pytest runs in.
ROOT = next((p for p in Path(__file__).resolve().parents if (p / "conftest.py").is_file()), Path.cwd())
DATA_ROOT = Path(os.environ.get("DISTREF_DATA", ROOT / "data"))
EXPORTED_IMPL = None  # distref.export sets this in the copy an exported project vendors


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
    sys.modules[spec.name] = module  # as an import would: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_script(args: list[str], env: dict | None = None, timeout: float = 300, cwd: Path = ROOT):
    """Run a command with one thread per process (as every rank would) and return the CompletedProcess."""
    note_started_processes()
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(args, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd)


def self_launched(impl: str, args: list[str], timeout: float = 300):
    """`python impls/<impl>/train.py ARGS` for a multi-process impl: the file checks ARGS, then starts its
    own ranks (`--nproc-per-node`), as a user would run it."""
    return run_script([sys.executable, str(train_path(impl)), *args], timeout=timeout)


def launch(nproc: int, impl: str, args: list[str], timeout: float = 300, env: dict | None = None):
    """What `torchrun --standalone --nproc-per-node NPROC impls/<impl>/train.py ARGS` runs, and its result:
    the same ranks, forked from a process that has imported torch once (distref.testing.run_ranks), so
    that each does not spend ~2 s of CPU importing it. Tests of the launchers themselves (restarts,
    torchrun's failure report, `python train.py --nproc-per-node`) use `torchrun` and `self_launched`."""
    return start(nproc, impl, args, env=env).wait(timeout)


def start(nproc: int, impl: str, args: list[str], env: dict | None = None, restart_count: int = 0) -> RankJob:
    """`launch`'s ranks, started and not waited for (a fault test stops or kills one of them); its
    attempt `restart_count`, as torchrun's --max-restarts would start it."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return start_ranks(
        nproc, str(train_path(impl)), args, env=full_env, cwd=ROOT, restart_count=restart_count
    )


def torchrun(nproc: int, impl: str, args: list[str], **kwargs):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return run_script([*cmd, str(train_path(impl)), *args], **kwargs)
