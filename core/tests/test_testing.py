"""distref.testing.run_ranks, the launcher most multi-process tests use: it must start the ranks torchrun
would, report a failed job as failed, stop the rest of a job when one rank fails, and never hang."""

import os
import subprocess
import time
from pathlib import Path

import pytest

from distref.testing import run_ranks, run_script

# A stand-in for a train.py: says what it was given, leaves its pid in the working directory, then fails
# or sleeps as asked.
RANK_SCRIPT = """
import os, sys, time
rank = int(os.environ["RANK"])
env = [os.environ[k] for k in ("WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")]
open(f"pid-{rank}", "w").write(str(os.getpid()))
print(f"rank {rank}: {__name__} {sys.argv[1:]} {env}", flush=True)
if rank == 1 and ("--fail" in sys.argv or "--raise" in sys.argv):  # once every rank has left its pid
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(os.path.exists(f"pid-{r}") for r in range(int(env[0]))):
        time.sleep(0.01)
if "--fail" in sys.argv and rank == 1:
    sys.exit(3)
if "--raise" in sys.argv and rank == 1:
    raise ValueError("rank 1 gave up")
if "--sleep" in sys.argv:
    time.sleep(float(sys.argv[sys.argv.index("--sleep") + 1]))
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(RANK_SCRIPT)
    return str(path)


def rank_pids(folder: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(folder.glob("pid-*"))]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_each_rank_runs_the_file_as_main_with_torchruns_variables(script, tmp_path):
    result = run_ranks(3, script, ["--x", "1"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [
        f"rank {r}: __main__ ['--x', '1'] ['3', '{r}', '3', '0']" for r in range(3)
    ]
    assert len(set(rank_pids(tmp_path))) == 3  # three processes, none of them this one
    assert os.getpid() not in rank_pids(tmp_path)


@pytest.mark.parametrize("how", ["--fail", "--raise"])
def test_a_failing_rank_fails_the_job_and_stops_the_others(script, tmp_path, how):
    started = time.monotonic()
    result = run_ranks(2, script, [how, "--sleep", "600"], timeout=120, cwd=tmp_path)
    assert result.returncode == 1
    assert time.monotonic() - started < 60  # rank 0, asleep for 600 s, was stopped rather than waited for
    assert len(rank_pids(tmp_path)) == 2 and not any(alive(pid) for pid in rank_pids(tmp_path))
    if how == "--raise":  # an uncaught exception: its traceback on stderr, as the interpreter prints it
        assert "Traceback" in result.stderr and "ValueError: rank 1 gave up" in result.stderr


def test_a_job_past_its_timeout_is_killed(script, tmp_path):
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_ranks(2, script, ["--sleep", "60"], timeout=5, cwd=tmp_path)
    assert time.monotonic() - started < 30  # killed at 5 s, not waited for
    assert len(rank_pids(tmp_path)) == 2 and not any(alive(pid) for pid in rank_pids(tmp_path))


def test_a_run_that_needs_torchvision_is_skipped_where_it_does_not_import(monkeypatch):
    """resnet18 and CIFAR-10 need torchvision; where it fails to import (a CUDA build on a CPU torch) or is
    missing (an export), their tests skip with the reason. MNIST needs none: never skipped."""
    import distref.testing.workloads as workloads

    monkeypatch.setattr(workloads, "_torchvision_problem", lambda: "it fails to import (RuntimeError: nms)")
    workloads.skip_where_torchvision_cannot_serve(["--model", "lenet", "--dataset", "mnist"])  # runs
    with pytest.raises(pytest.skip.Exception) as skipped:
        workloads.skip_where_torchvision_cannot_serve(workloads.batchnorm_args(2))
    assert (
        skipped.value.msg == "--model resnet18 needs torchvision, and it fails to import (RuntimeError: nms)"
    )
    monkeypatch.setattr(workloads, "_torchvision_problem", lambda: None)
    workloads.skip_where_torchvision_cannot_serve(["--dataset", "cifar10"])  # where it imports: runs


def test_every_module_the_fork_server_preloads_imports():
    """The fork server skips a preloaded name that does not import without a word: a stale name (they
    once named distref.testing.* modules that do not exist) made every rank import distref anew."""
    import importlib

    from distref.testing.ranks import PRELOADED, PRELOADED_WITHOUT_GPUS, preloaded

    for name in [*PRELOADED, *PRELOADED_WITHOUT_GPUS]:
        importlib.import_module(name)
    assert preloaded() == [*PRELOADED, *PRELOADED_WITHOUT_GPUS]  # (the CPU suite: GPUs hidden)


def test_ranks_forked_by_the_fork_server_import_nothing_it_imported(tmp_path):
    """A rank does not import again what the fork server preloaded (DeepSpeed's Muon optimizer and
    scikit-learn's datasets once cost every rank of theirs about a second of CPU)."""
    script = tmp_path / "imports.py"
    script.write_text("import sys\nprint(sorted(sys.modules))\n")
    result = run_ranks(1, str(script), [], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    imported = set(eval(result.stdout))
    from distref.testing.ranks import preloaded

    assert set(preloaded()) <= imported


def test_the_time_by_kind_table_sums_each_kind_and_the_first_kind_that_holds_wins():
    from types import SimpleNamespace

    from distref.testing.timing import CPU_SECONDS, STARTED_PROCESSES, most_cpu, time_by_kind

    def report(nodeid, duration, properties=(), keywords=(), cpu=None):
        properties = [*properties, *([(CPU_SECONDS, cpu)] if cpu is not None else [])]
        return SimpleNamespace(
            nodeid=nodeid, duration=duration, user_properties=properties, keywords=keywords
        )

    reports = [
        report("t.py::test_a", 1.0),
        report("t.py::test_a", 2.0, cpu=2.0),  # (another phase of the same test: its teardown has its CPU)
        report("t.py::test_b[compile-is-a-no-op]", 0.0),  # (its parameters do not make it a compile test)
        report("t.py::test_ranks", 10.0, [STARTED_PROCESSES], cpu=30.0),
        report("t.py::test_compiled_blocks", 5.0, [STARTED_PROCESSES], cpu=8.0),
        report("t.py::test_killed_rank", 20.0, [STARTED_PROCESSES], keywords=("faults",), cpu=0.0),
    ]
    rows = time_by_kind(reports)
    assert rows[2:] == [
        "| one process | 2 | 3 | 8% | 2 | 5% |",
        "| multi-process | 1 | 10 | 26% | 30 | 75% |",
        "| compile | 1 | 5 | 13% | 8 | 20% |",
        "| faults | 1 | 20 | 53% | 0 | 0% |",
        "| all | 5 | 38 | 100% | 40 | 100% |",
    ]
    assert most_cpu(reports, shown=2)[1:] == [
        "   30.0  t.py::test_ranks",
        "    8.0  t.py::test_compiled_blocks",
    ]


def test_a_test_s_cpu_seconds_count_its_ranks_and_its_scripts(tmp_path):
    """The CPU a test used counts what its processes used: a script's (waited for by this process) and the
    ranks the fork server forked (waited for by it), not only pytest's own process."""
    import sys

    from distref.testing.timing import cpu_seconds

    spin = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass\n"
    (tmp_path / "spin.py").write_text(spin)
    before = cpu_seconds()
    run_script([sys.executable, str(tmp_path / "spin.py")])
    assert cpu_seconds() - before >= 1.0
    before = cpu_seconds()
    assert run_ranks(2, str(tmp_path / "spin.py"), [], timeout=60).returncode == 0
    assert cpu_seconds() - before >= 2.0


def test_forked_ranks_draw_their_own_unseeded_numpy_numbers(tmp_path):
    """As torchrun's ranks (fresh interpreters) do: the fork server's numpy generator is not every rank's,
    or a dataset function of yours that is not seeded would pass the ranks' agreement check here."""
    script = tmp_path / "draw.py"
    script.write_text("import numpy\nprint(numpy.random.randint(2**62))\n")
    result = run_ranks(2, str(script), [], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    drawn = result.stdout.split()
    assert len(drawn) == 2 and drawn[0] != drawn[1]


def test_a_job_s_result_can_be_asked_for_again_and_a_killed_job_ends(tmp_path):
    """`wait` again returns the same result (its files are gone by then); `kill` ends a job a test gives
    up on (a fault test whose checkpoint never came left its ranks running)."""
    from distref.testing.ranks import start_ranks

    script = tmp_path / "say.py"
    script.write_text(
        "import sys, time\nprint('said', file=sys.stderr)\nif '--sleep' in sys.argv: time.sleep(600)\n"
    )
    job = start_ranks(2, str(script), [], cwd=tmp_path)
    first = job.wait(60)
    assert job.wait(60) is first and job.stderr() == first.stderr and first.stderr.count("said") == 2
    sleeping = start_ranks(2, str(script), ["--sleep"], cwd=tmp_path)
    sleeping.kill()
    assert not sleeping.running() and sleeping.wait(10).returncode == 1


def test_forked_ranks_take_the_suite_s_data_sets_made_by_the_fork_server(tmp_path):
    """distref.testing.preloaded_data makes the suite's sets in the fork server (a failure there is
    silent, so it is checked here): a rank loading lenet's synthetic set or MNIST does not make it again,
    and no run began in the server (a rank's record counts its start-up from its own parse)."""
    script = tmp_path / "load.py"
    script.write_text(
        "from distref.cli import parse_config\n"
        "from distref.config import PARSE_TIMES\n"
        "from distref.data import load_dataset, datasets, mnist\n"
        "from distref.testing import DATA_ROOT\n"
        "parsed, made = len(PARSE_TIMES), mnist._IDX_DATASETS['mnist'][1]\n"
        "load_dataset(parse_config(['--model', 'lenet', '--dataset', 'synthetic'], 'x'))\n"
        "mine = load_dataset(parse_config(['--dataset', 'mnist', '--data-root', str(DATA_ROOT)], 'x'))\n"
        "print(parsed, datasets.synthetic_images.cache_info().misses, mine[0].x is made[0].x)\n"
    )
    result = run_ranks(1, str(script), [], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "0 1 True", result.stdout  # (its one miss was the server's)


def test_the_preload_makes_mnist_and_never_stops_the_fork_server(mnist_root, monkeypatch):
    """In this process: after the preload, MNIST's set of these files is made, and no run was begun; a
    refusal of parse_config's (SystemExit) or any error while making the sets leaves the import whole."""
    import importlib

    from distref.config import PARSE_TIMES
    from distref.data import mnist
    from distref.testing import preloaded_data

    parsed = len(PARSE_TIMES)
    monkeypatch.setattr(mnist, "_IDX_DATASETS", {})
    preloaded_data.make_the_suite_s_data_sets()
    assert len(PARSE_TIMES) == parsed
    made = mnist._IDX_DATASETS["mnist"][1]
    assert mnist.idx_dataset(mnist_root / "MNIST" / "raw", "mnist") is made  # (these files' set)

    def refuse(*args, **kwargs):
        raise SystemExit(2)

    monkeypatch.setattr(preloaded_data, "parse_config", refuse)
    monkeypatch.setattr("distref.cli.parse_config", refuse)
    importlib.reload(preloaded_data)  # (its import makes the sets: it must not raise)
    assert len(PARSE_TIMES) == parsed


def test_the_record_s_eval_is_checked_by_its_loss_too(tmp_path):
    """check_record_scores_the_saved_model: a record whose accuracy is the saved model's but whose loss
    is not (a rank scoring with its own BatchNorm statistics may keep the accuracy of a few samples) is
    refused; the saved model's own scores pass."""
    from distref.testing import check_record_scores_the_saved_model, load_train_module
    from distref.testing.workloads import saved_model_scores

    args = ["--model", "lenet", "--dataset", "synthetic", "--steps", "2", "--eval-samples", "64"]
    load_train_module("single").main([*args, "--save-final", str(tmp_path / "final.pt")])
    accuracy, loss = saved_model_scores(tmp_path / "final.pt", args)
    record = {"final_accuracy": accuracy, "evals": [{"accuracy": accuracy, "loss": loss}]}
    check_record_scores_the_saved_model(record, tmp_path / "final.pt", args)
    record["evals"][-1]["loss"] = loss * (1 + 1e-3)
    with pytest.raises(AssertionError):
        check_record_scores_the_saved_model(record, tmp_path / "final.pt", args)
