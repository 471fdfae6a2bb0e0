"""distref.testing.run_ranks, the launcher most multi-process tests use: it must start the ranks torchrun
would, report a failed job as failed, stop the rest of a job when one rank fails, and never hang."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distref.cli import torchvision_problem
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
    nor traces gpt on meta again, and no run began in the server (a rank's record counts its start-up
    from its own parse); torchvision is imported there too."""
    script = tmp_path / "load.py"
    script.write_text(
        "import sys\n"
        "from distref.cli import parse_config\n"
        "from distref.config import PARSE_TIMES\n"
        "from distref.cost import usage\n"
        "from distref.data import load_dataset, datasets, mnist\n"
        "from distref.testing import DATA_ROOT\n"
        "parsed, made = len(PARSE_TIMES), mnist._IDX_DATASETS['mnist'][1]\n"
        "load_dataset(parse_config(['--model', 'lenet', '--dataset', 'synthetic'], 'x'))\n"
        "mine = load_dataset(parse_config(['--dataset', 'mnist', '--data-root', str(DATA_ROOT)], 'x'))\n"
        "gpt = parse_config(['--model', 'gpt', '--dataset', 'synthetic'], 'x')\n"
        "usage.model_usage(gpt.model, load_dataset(gpt)[2], gpt.gpt_layers, gpt.moe)\n"
        "print(parsed, datasets.synthetic_images.cache_info().misses, mine[0].x is made[0].x,\n"
        "      usage._own_model_usage.cache_info().hits, 'torchvision' in sys.modules)\n"
    )
    result = run_ranks(1, str(script), [], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    # (its one miss was the server's; gpt's usage was traced there: a hit here; torchvision where it imports)
    imports = torchvision_problem() is None
    assert result.stdout.split("\n")[0] == f"0 1 True 1 {imports}", result.stdout


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


# What the stand-ins fork: a tool's command lines, each as the process it names would run it.
SHOWS_ITSELF = """\
import os, sys, time
print(sys.argv[1:], os.environ.get("RANK"), os.environ.get("WORLD_SIZE"), sys.path[0] == os.path.dirname(__file__))
print("to stderr", file=sys.stderr, flush=True)
time.sleep(float(os.environ.get("SLEEP", "0")))
sys.exit(int(os.environ.get("EXIT_WITH", "0")))
"""
FORKED = "import sys; print('forked' if 'distref.cli' in sys.modules else 'fresh')"  # (the fork server's)


def test_a_tool_s_command_lines_run_forked_as_the_processes_they_name(tmp_path):
    """`python FILE` (its exit code, its folder first on sys.path, no rank variables), `python -m MODULE`,
    torchrun's --standalone --nproc-per-node N and a train.py's own --nproc-per-node N (N ranks, the
    launch option not theirs); anything else is not forked."""
    from distref.testing import forked_command

    script = tmp_path / "train.py"
    script.write_text(SHOWS_ITSELF)
    python = sys.executable
    alone = forked_command([python, str(script), "a"], env={**os.environ, "EXIT_WITH": "3"}).wait(60)
    assert (alone.returncode, alone.stdout, alone.stderr) == (3, "['a'] None None True\n", "to stderr\n")
    (tmp_path / "data.json").write_text('{"b": [1]}')
    module = forked_command([python, "-m", "json.tool", "--compact", "data.json"], cwd=tmp_path).wait(60)
    assert (module.returncode, module.stdout) == (0, '{"b":[1]}\n')
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), "b"]
    launched = [python, str(script), "--nproc-per-node", "2", "b"]
    for command in (torchrun, launched):
        ranks = forked_command(command).wait(60)
        assert ranks.returncode == 0 and sorted(ranks.stdout.splitlines()) == [
            "['b'] 0 2 True",
            "['b'] 1 2 True",
        ]
    # PYTHONPATH's folders on sys.path, after the file's
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "mine.py").write_text("import sys; print('mine'); sys.exit(4)")
    (tmp_path / "uses.py").write_text("import mine")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib")}
    for command in ([python, str(tmp_path / "uses.py")], [python, "-m", "mine"]):
        used = forked_command(command, env=env, cwd=tmp_path).wait(60)
        assert (used.returncode, used.stdout) == (4, "mine\n"), used.stderr
    no_ranks = [*torchrun[:4], "--nproc-per-node=0", *torchrun[5:]]
    for command in (
        [python, "-c", "print(1)"],
        [*torchrun[:3], "--max-restarts=1", *torchrun[3:]],
        ["ls"],
        no_ranks,
    ):
        assert forked_command(command) is None


def test_the_subprocess_stand_in_gives_the_output_where_the_tool_asked(tmp_path, capsys):
    """forked_subprocess's Popen and run: stdout and stderr to a log (stderr=STDOUT), to a pipe the tool
    reads, captured; a command it does not fork runs as subprocess would run it."""
    from distref.testing import forked_subprocess

    stand_in, script = forked_subprocess(), tmp_path / "say.py"
    script.write_text(SHOWS_ITSELF)
    command = [sys.executable, str(script)]
    with open(tmp_path / "log", "w") as log:
        process = stand_in.Popen(command, stdout=log, stderr=stand_in.STDOUT)
        assert process.wait(timeout=60) == 0 and process.returncode == 0 and process.poll() == 0
    assert (tmp_path / "log").read_text() == "[] None None True\nto stderr\n"
    piped = stand_in.Popen(command, stdout=stand_in.PIPE, stderr=stand_in.STDOUT)
    assert piped.wait() == 0 and piped.stdout.read() == b"[] None None True\nto stderr\n"
    piped = stand_in.Popen(command, stdout=stand_in.PIPE)  # (stderr: this process's, as a child's would be)
    assert piped.wait() == 0 and piped.stdout.read() == b"[] None None True\n"
    assert capsys.readouterr().err == "to stderr\n"
    with open(tmp_path / "log", "wb") as log:  # (a log opened for bytes)
        assert stand_in.run(command, stdout=log, stderr=stand_in.STDOUT, timeout=60).returncode == 0
    assert (tmp_path / "log").read_bytes() == b"[] None None True\nto stderr\n"
    captured = stand_in.run(command, capture_output=True, text=True)
    assert (captured.stdout, captured.stderr) == ("[] None None True\n", "to stderr\n")
    assert stand_in.forked == [command] * 5
    (tmp_path / "where.py").write_text(FORKED)
    forked = stand_in.run([sys.executable, str(tmp_path / "where.py")], capture_output=True, text=True)
    real = stand_in.run([sys.executable, "-c", FORKED], capture_output=True)  # (-c: not forked)
    assert (forked.stdout, real.stdout) == ("forked\n", b"fresh\n") and len(stand_in.forked) == 6
    assert stand_in.TimeoutExpired is subprocess.TimeoutExpired
    # Past its timeout: killed (a tool then stops it, and waits again), what it wrote kept, the pipe closed
    slow = {**os.environ, "SLEEP": "60"}
    for stdout in (open(tmp_path / "slow.log", "w"), stand_in.PIPE):  # noqa: SIM115
        process = stand_in.Popen(command, stdout=stdout, stderr=stand_in.STDOUT, env=slow)
        time.sleep(1)
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=0.5)
        assert process.wait(timeout=10) == process.poll() == -9
        said = (
            (tmp_path / "slow.log").read_text() if stdout != stand_in.PIPE else process.stdout.read().decode()
        )
        assert said.startswith("[] None None True\nto stderr\n"), said


def test_what_every_worker_asks_for_is_made_once_per_run(tmp_path_factory, monkeypatch):
    """made_once (single's oracles, compiled single): under pytest-xdist, the worker that asks first makes
    the file and the others, asking meanwhile, wait for it and take it; another key, another file."""
    import threading

    from distref.testing import made_once

    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", f"made-once-{os.getpid()}-{time.time_ns()}")
    made: list[tuple] = []

    def make(key: tuple, path: Path) -> None:
        made.append(key)
        time.sleep(0.3)  # (the other workers ask meanwhile)
        path.write_text(repr(key))

    paths: list[Path] = []
    workers = [
        threading.Thread(
            target=lambda: paths.append(
                made_once(tmp_path_factory, "t", ("a", 1), lambda p: make(("a", 1), p))
            )
        )
        for _ in range(3)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    other = made_once(tmp_path_factory, "t", ("b", 1), lambda p: make(("b", 1), p))
    assert made == [("a", 1), ("b", 1)] and len(set(paths)) == 1 and other != paths[0]
    assert paths[0].read_text() == "('a', 1)" and other.read_text() == "('b', 1)"
