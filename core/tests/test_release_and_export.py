"""Versions that cannot drift, and references that run outside this repo."""

import importlib.metadata
import itertools
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from distref import impl_dependencies, release
from distref.export import export
from distref.impl_folders import discover
from distref.testing import PARITY_TOLERANCE, ROOT, load_train_module, max_relative_difference, run_script

IMPLS = sorted(p.parent.name for p in (ROOT / "impls").glob("*/train.py"))


@pytest.mark.parametrize("impl", IMPLS)
def test_impl_is_released_at_its_current_version(impl):
    assert release.problems(ROOT / "impls" / impl) == []


def test_a_change_without_a_version_bump_is_caught(tmp_path):
    impl = tmp_path / "ddp"
    shutil.copytree(ROOT / "impls" / "ddp", impl, ignore=shutil.ignore_patterns("__pycache__"))
    (impl / "README.md").write_text("docs may change freely\n")
    assert release.problems(impl) == []
    (impl / "train.py").write_text((impl / "train.py").read_text() + '\nprint("a change")\n')
    version = release.declared_version(impl)
    assert any(f"changed since {version} was released: bump its version" in p for p in release.problems(impl))
    with pytest.raises(SystemExit, match=re.escape(f"still {version}: bump the version")):
        release.release(impl)
    pyproject = impl / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace(f'version = "{version}"', 'version = "9.9.9"'))
    with pytest.raises(SystemExit, match=re.escape("add a `## 9.9.9` entry")):
        release.release(impl)
    (impl / "CHANGELOG.md").write_text(
        "## 9.9.9 — smaller eval batches\n" + (impl / "CHANGELOG.md").read_text()
    )
    release.release(impl)
    assert release.problems(impl) == []


@pytest.mark.parametrize("in_git", [True, False], ids=["git-checkout", "plain-folder"])
def test_build_outputs_are_not_behaviour_but_new_files_are(in_git, tmp_path):
    """`pip install -e impls/<x>` writes an ignored *.egg-info/ there: no release problem. A new module
    (untracked, not ignored) is a change."""
    impl = tmp_path / "single"
    shutil.copytree(ROOT / "impls" / "single", impl, ignore=shutil.ignore_patterns("__pycache__"))
    if in_git:
        subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
        (tmp_path / ".gitignore").write_text("*.egg-info/\n")
    assert release.problems(impl) == []
    egg_info = impl / "distref_single.egg-info"
    egg_info.mkdir()
    (egg_info / "PKG-INFO").write_text("Metadata-Version: 2.1\n")
    assert release.problems(impl) == []
    (impl / "helpers.py").write_text("X = 1\n")
    assert any("changed since" in p for p in release.problems(impl))


# ---- export -----------------------------------------------------------------------------------------


def torch_only_python(tmp: Path, extra: Sequence[str] = ()) -> Path:
    """A fresh venv that sees what an exported project depends on — torch and numpy (torch's object
    collectives need it), the impl's own `extra` requirements (deepspeed), with their own dependencies —
    and nothing else: no distref, no torchvision. setuptools too (torch needs it anyway): the export's
    build backend, for `pip install --no-build-isolation` there (see `pip_install`)."""
    farm = tmp / "torch-only-site"
    farm.mkdir(parents=True)
    site = Path(torch.__file__).parents[1]
    todo, seen = ["torch", "numpy", "setuptools", *extra], set()
    while todo:
        try:
            dist = importlib.metadata.distribution(todo.pop())
        except importlib.metadata.PackageNotFoundError:  # another platform's (colorama for tqdm on Windows)
            continue
        name = dist.metadata["Name"].lower()
        if name in seen:
            continue
        seen.add(name)
        todo += [re.split(r"[ ;<>=!~\[(]", req)[0] for req in dist.requires or [] if "extra ==" not in req]
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}:
            if (site / top).exists() and not (farm / top).exists():
                (farm / top).symlink_to(site / top)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    venv_site = next((venv / "lib").glob("python3*/site-packages"))
    (venv_site / "torch_only.pth").write_text(str(farm) + "\n")
    return venv / "bin" / "python"


def pip_install(python: Path, dest: Path, *target: str) -> subprocess.CompletedProcess:
    """`pip install -c constraints.txt TARGET` in the exported project `dest`, into `python`'s venv, as its
    README says, but offline and reading no pip configuration (no index, no find-links): it succeeds only
    if everything the export depends on (torch, numpy, deepspeed, and theirs) is already installed there,
    and it installs the export alone. The pip is the test environment's, pointed at the venv (`pip
    --python`, pip >= 22.3: the venv has none of its own), without build isolation (which would fetch
    setuptools: the venv has it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env |= {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    cmd = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index"]
    cmd += ["--no-build-isolation", "--no-cache-dir", "-c", "constraints.txt", *target]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=dest, timeout=120, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Requirement already satisfied: torch" in result.stdout  # the pinned torch, seen as installed
    with open(dest / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    installed = [line for line in result.stdout.splitlines() if line.startswith("Successfully installed")]
    assert installed == [f"Successfully installed {project['name']}-{project['version']}"]
    return result


def where_python_imports(python: Path, package: str, cwd: Path) -> subprocess.CompletedProcess:
    """Where `import PACKAGE` comes from in `python`, started in `cwd` without putting it on sys.path (-P):
    from an install, not from the folder it runs in."""
    code = f"import {package}; print({package}.__file__)"
    return subprocess.run(
        [str(python), "-s", "-E", "-P", "-c", code], capture_output=True, text=True, cwd=cwd
    )


@pytest.fixture(scope="module")
def fresh_python(tmp_path_factory):
    python = torch_only_python(tmp_path_factory.mktemp("fresh"))
    probe = subprocess.run(
        [
            str(python),
            "-s",
            "-E",
            "-c",
            "import torch, importlib.util as u; "
            "print(torch.__version__, u.find_spec('distref'), u.find_spec('torchvision'))",
        ],
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split()[1:] == ["None", "None"]  # no monorepo, no torchvision: the dependencies alone
    return python


# The micro-batch sums each impl's default run makes per step (2 ranks; pipeline: 4 micro-batches).
SAME_SUMS = {"ddp": 2, "deepspeed_zero": 2, "fsdp": 2, "pipeline": 4}
SYNTHETIC = [
    "--model",
    "lenet",
    "--dataset",
    "synthetic",
    "--steps",
    "6",
    "--optimizer",
    "sgd",
    "--lr",
    "0.01",
    "--global-batch-size",
    "16",
]


def impl_requirements(impl: str) -> list[str]:
    """The names of what impls/<impl> needs beyond torch and distref-core (e.g. deepspeed)."""
    names = [re.split(r"[ ;<>=!~\[(]", d)[0] for d in impl_dependencies(ROOT / "impls" / impl)]
    return [n for n in names if n != "torch"]


@pytest.mark.parametrize("impl", IMPLS)
def test_exported_impl_trains_outside_the_repo_like_inside(impl, fresh_python, tmp_path):
    if extra := impl_requirements(impl):  # e.g. deepspeed: torch, numpy and that, nothing else
        fresh_python = torch_only_python(tmp_path / "fresh", extra)
    dest = export(impl, tmp_path / f"my-{impl}")
    assert not dest.resolve().is_relative_to(ROOT)
    expected = {
        "CHANGELOG.md",
        "README.md",
        "conftest.py",
        f"distref_{impl}",
        "pyproject.toml",
        "tests",
        "train.py",
        "constraints.txt",
    }
    assert expected <= {p.name for p in dest.iterdir()}
    assert "torch==" in (dest / "constraints.txt").read_text()
    readme = (dest / "README.md").read_text()
    assert "## Using this export" in readme and "pip install -c constraints.txt -e ." in readme
    shell = readme.split("```bash\n")[1].split("```")[0]
    assert all(" (" not in line.split("#")[0] for line in shell.splitlines())  # comments are comments
    assert f"impls/{impl}/train.py" not in readme  # paths as they are in the export
    assert_every_command_works_there(readme, dest)
    # Only what train.py, baseline/ and the tests import: none of the tools that run or compare impls.
    vendored = {p.stem for p in (dest / f"distref_{impl}").iterdir()}
    assert not vendored & {"compare", "parity", "report", "export", "release", "ranks", "impl_folders"}
    with open(dest / "pyproject.toml", "rb") as f:
        assert tomllib.load(f)["tool"]["distref"]["exported-from"]["impl"] == impl
    assert "from distref." not in (dest / "train.py").read_text()
    assert f"impl `{impl}`" in (dest / "README.md").read_text().splitlines()[0]  # version stamped
    # Its tests import (every `distref` import rewritten to the vendored package: `import distref.config`
    # once became `import distref_fsdp as distref.config`, a SyntaxError at collection).
    collected = run_script(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"], cwd=dest
    )
    assert collected.returncode == 0 and " error" not in collected.stdout, collected.stdout[-2000:]

    # `pip install .` (-e: test_exported_project_installs_editable_and_its_tests_run_on_the_install): the
    # vendored core, with its data files, is copied into the venv; the folder's own copy is then moved
    # away, so that the run below can only import what was installed
    package = f"distref_{impl}"
    pip_install(fresh_python, dest, ".")
    where = where_python_imports(fresh_python, package, tmp_path)
    assert where.returncode == 0, where.stderr
    installed = Path(where.stdout.strip())
    venv = fresh_python.parents[1]
    assert installed.parent.parent.name == "site-packages" and installed.is_relative_to(venv), installed
    assert (installed.parent / "record.schema.json").is_file()
    (dest / package).rename(tmp_path / f"{package}-source")

    def run_exported(*args: str) -> subprocess.CompletedProcess:
        """`python train.py ARGS` there, as its README says (ddp starts its 2 ranks itself)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {"OMP_NUM_THREADS": "1"}
        cmd = [str(fresh_python), "-s", "-E", *(args if args[0] == "-c" else ("train.py", *args))]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=dest, env=env, timeout=300)

    # The installed test helpers have no conftest.py above them: they take the project from where its tests
    # run (a StopIteration at import, once).
    located = run_exported("-c", f"import {package}.testing as t; print(t.ROOT, t.EXPORTED_IMPL)")
    assert located.stdout.split() == [str(dest.resolve()), impl], located.stderr[-2000:]

    # An impl made for one model (tensor_parallel: gpt) trains that model on the synthetic set instead, as
    # its README's first run says.
    models = discover(ROOT / "impls")[impl]["models"]
    workload = [*SYNTHETIC, "--model", models[0]] if models else SYNTHETIC
    assert (
        f"python train.py --model {models[0]} --dataset" if models else "python train.py --dataset"
    ) in readme
    exported = run_exported(*workload, "--save-final", str(tmp_path / "exported.pt"))
    assert exported.returncode == 0, exported.stdout[-2000:] + exported.stderr[-2000:]
    if impl == "ddp":  # the same core check in every impl: once, for one that would start ranks
        without_torchvision = run_exported("--dataset", "mnist")
        assert without_torchvision.returncode == 2
        assert without_torchvision.stderr.splitlines()[-1] == (
            f"{impl}/train.py: error: --dataset mnist needs torchvision: pip install torchvision (pinned "
            "with torch), or use --dataset synthetic"
        )
        assert "Traceback" not in without_torchvision.stderr and "starting" not in without_torchvision.stdout
    # Inside the repo, every impl trains exactly what single does with the same micro-batch sums (their own
    # tests prove it): single, in this process, is the in-repo result without starting any rank. Tensor
    # parallelism sums otherwise than any single run: SGD within the parity tolerance of plain single.
    same_sums = ["--grad-accum", str(SAME_SUMS.get(impl, 1))]
    single = load_train_module("single")
    single.main([*workload, *same_sums, "--save-final", str(tmp_path / "repo.pt")])
    result = torch.load(tmp_path / "exported.pt", weights_only=True)
    difference = max_relative_difference(result, torch.load(tmp_path / "repo.pt", weights_only=True))
    assert difference < PARITY_TOLERANCE if impl == "tensor_parallel" else difference == 0.0


def test_exported_project_installs_editable_and_its_tests_run_on_the_install(tmp_path):
    """The README's `pip install -c constraints.txt -e .` in a fresh venv (torch, numpy and pytest, no
    distref): the vendored core is importable from anywhere, and the export's own tests — a short training
    in-process, and one on 2 ranks — pass with it imported only through the install. (`pip install .` and a
    run of train.py on what it installed: test_exported_impl_trains_outside_the_repo_like_inside.)"""
    python = torch_only_python(tmp_path / "fresh", ["pytest"])
    dest = export("ddp", tmp_path / "my-ddp")
    before = where_python_imports(python, "distref_ddp", tmp_path)
    assert before.returncode == 1 and "No module named 'distref_ddp'" in before.stderr
    pip_install(python, dest, "-e", ".")
    after = where_python_imports(python, "distref_ddp", tmp_path)
    assert after.returncode == 0, after.stderr
    assert after.stdout.strip() == str(dest / "distref_ddp" / "__init__.py")  # editable: the folder's copy
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "DISTREF"))}
    # 4 steps in-process; a parse; and 2 ranks against single, started as the export's own tests start them
    # (distref.testing.launch: forked from a fork server that imports distref_ddp)
    tests = "ddp_options_take_effect or static_graph_with_grad_accum or (parity_with_single and 2-gpt)"
    result = subprocess.run(
        [str(python), "-s", "-E", "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", tests],
        capture_output=True,
        text=True,
        cwd=dest,
        env=env | {"OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "3 passed" in result.stdout
    assert "PytestUnknownMarkWarning" not in result.stdout  # its pyproject registers the tests' markers


def test_exported_tests_run_there(tmp_path):
    dest = export("dataparallel", tmp_path / "dp")
    result = run_script(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "checkpoint_resume or one_line",
        ],
        cwd=dest,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "2 passed" in result.stdout
    assert "PytestUnknownMarkWarning" not in result.stdout  # its pyproject registers the tests' markers


def assert_every_command_works_there(readme: str, dest: Path) -> None:
    """No command in an exported README needs the repository: no nox session, no distref tool, no path
    under impls/ or ci/ (in code blocks or in the prose's code spans); every file a command or a link
    names exists."""
    in_code, commands = False, []
    for line in readme.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif in_code:
            commands.append(line.split("#")[0])
    commands += re.findall(r"`([^`\n]+)`", readme)
    for command in commands:
        assert not re.search(r"\bnox\b|python -m distref\.|\bimpls/|\bci/|benchmark\.py", command), command
    for target in re.findall(r"\]\(([^)#\s]+)", readme):  # every relative link has its file there
        assert "://" in target or (dest / target).exists(), f"a link to {target}, not in the export"
    for command in commands:
        words = command.split()
        for python, script in itertools.pairwise(words):  # `python FILE`: a file of the project
            if python in ("python", "python3") and script.endswith(".py"):
                assert (dest / script).is_file(), f"{command}: no {script} in the export"
        for word in words:  # a launch file (sbatch SCRIPT, kubectl apply -f MANIFEST): shipped
            if word.endswith((".sbatch", ".yaml")):
                assert (dest / word).is_file(), f"{command}: no {word} in the export"


def test_export_refuses_a_non_empty_destination(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit, match="is not empty"):
        export("ddp", tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_core_version_is_the_one_in_its_pyproject():
    import distref

    with open(Path(distref.__file__).parents[2] / "pyproject.toml", "rb") as f:
        assert distref.__version__ == tomllib.load(f)["project"]["version"]


def test_an_export_from_outside_git_is_valid_python(monkeypatch, tmp_path):
    """From a tarball or a copy without .git (as ci/mutants.py makes) the commit is unknown: the stamp
    must still be Python (it once wrote JSON's `null` into the package's __init__.py)."""
    import distref.export

    monkeypatch.setattr(distref.export, "git_sha", lambda: None)
    dest = export("ddp", tmp_path / "my-ddp")
    namespace: dict = {}
    exec(compile((dest / "distref_ddp" / "__init__.py").read_text(), "__init__.py", "exec"), namespace)
    assert namespace["EXPORTED_FROM"]["git_sha"] is None and namespace["EXPORTED_FROM"]["impl"] == "ddp"


def test_a_multi_process_export_ships_the_cluster_launch_files(tmp_path):
    """Both SLURM scripts and the impl's own PyTorchJob manifest, running the export's train.py; none for
    single, which starts no ranks."""
    import yaml

    dest = export("ddp", tmp_path / "my-ddp")
    for script in ("srun.sbatch", "torchrun.sbatch"):
        path = dest / "launch" / "slurm" / script
        assert os.access(path, os.X_OK) and "impls/" not in path.read_text()
        assert f"launch/slurm/{script} train.py" in path.read_text()  # its usage line, as it is here
    assert [p.name for p in (dest / "launch" / "kubernetes").iterdir()] == ["ddp.yaml"]
    job = yaml.safe_load((dest / "launch" / "kubernetes" / "ddp.yaml").read_text())
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        assert replica["template"]["spec"]["containers"][0]["command"] == ["python", "train.py"]
    assert "launch/slurm/srun.sbatch train.py" in (dest / "README.md").read_text()
    assert not (export("single", tmp_path / "my-single") / "launch").exists()
