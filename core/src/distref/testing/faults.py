"""Faults and how a run meets them: killing or stopping a rank (every multi-process impl), and the
`nox -s faults` table of expected behaviour and measured times.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from distref.parity_metric import max_relative_difference
from distref.testing.ranks import RankJob
from distref.testing.runs import ROOT, load_train_module, start, torchrun, train_path
from distref.testing.timing import CPU_SECONDS, CURRENT_TEST


def measured(what: str, seconds: float) -> None:
    """Record a measured time of the running fault test (the `nox -s faults` table shows it)."""
    if CURRENT_TEST:
        CURRENT_TEST[0].user_properties.append((what, round(seconds, 1)))


def fault_test_impl(nodeid: str) -> str:
    """The impl a fault test is about (impls/<impl>/tests/...), or "core" (the run contract's own)."""
    parts = nodeid.split("/")
    return parts[1] if parts[0] == "impls" else "core"


def fault_table(stats: dict) -> list[str]:
    """The `nox -s faults` table from pytest's terminal stats: one row per fault test: the impl, the
    fault, its expected behaviour (the test's docstring, first sentence; core/tests/test_faults_table.py
    keeps every fault test documented), outcome and measured times. (They travel in the reports'
    user_properties: xdist workers send them.) Empty when no fault test ran."""
    rows = []
    for outcome in ("passed", "failed", "error", "skipped"):
        for report in stats.get(outcome, []):
            if getattr(report, "when", "call") != "call" and outcome != "skipped":
                continue
            properties = dict(report.user_properties)
            if "expected" not in properties:  # not a fault test (`-m "not faults"` names the marker too)
                continue
            name = report.nodeid.split("::")[-1]
            expected = properties.pop("expected")
            # the times `measured` recorded (not the suite's own notes: processes started, CPU seconds)
            properties = {k: v for k, v in properties.items() if isinstance(v, float) and k != CPU_SECONDS}
            times = (
                ", ".join(f"{k} {v:g} s" for k, v in properties.items()) or f"{report.duration:.0f} s (test)"
            )
            rows.append(f"| {fault_test_impl(report.nodeid)} | `{name}` | {expected} | {outcome} | {times} |")
    if not rows:
        return []
    return [
        "\n| impl | fault test | expected behaviour | outcome | measured |",
        "|---|---|---|---|---|",
        *sorted(rows),
    ]


def expected_behaviour(function) -> str:
    """A fault test's expected behaviour: its docstring up to the first blank line, on one line."""
    doc = (function.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(doc.split())


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


# How a fault test starts its job. A fault is met by an impl's own code (its checkpoints, its process
# groups' --timeout, its ranks leaving on SIGTERM), whichever launcher started it: each impl meets its
# faults with ranks forked by the test's fork server (`distref.testing.start_ranks`, torchrun's ranks
# without their interpreters' start-up), and the launchers' own part (torchrun's restarts and failure
# report, `python train.py --nproc-per-node`'s) is tested once, in impls/ddp, with the launchers themselves.
FORKED, LAUNCHERS = "forked", "launchers"


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


def kill_rank1_once_it_checkpoints(job: RankJob, ckpt_dir: Path) -> float:
    """SIGKILL rank 1 of forked `job` once a checkpoint exists in `ckpt_dir`; returns the time of the kill."""
    from distref.training import latest_checkpoint

    deadline = time.time() + 120
    try:
        while latest_checkpoint(ckpt_dir) is None:
            assert job.running() and time.time() < deadline, "no checkpoint appeared: " + job.stderr()[-3000:]
            time.sleep(0.05)
    except BaseException:
        job.kill()  # (a job the test gives up on must not go on loading the machine)
        raise
    os.kill(job.pids[1], signal.SIGKILL)
    return time.time()


def check_killed_rank_resumes_exactly(
    impl: str,
    args: list[str],
    steps: int,
    tmp_path: Path,
    single_args: list[str] | None,
    launcher: str = FORKED,
) -> None:
    """Every multi-process impl: rank 1 SIGKILLed (with checkpoints and `--resume auto` in `args`), the
    job's next attempt (`torchrun --max-restarts 1` starts it) resumes from the last checkpoint and ends
    bit-identical to an uninterrupted run, with a record of all `steps` steps. The uninterrupted run is
    impls/single with `single_args` (the same workload, and the --grad-accum that makes it sum as the impl
    does), which the impl equals bit for bit: in this process, it costs no ranks' start-up. An impl that
    sums otherwise than any single run (tensor parallel: `single_args` None) is compared with its own
    uninterrupted run on 2 ranks. `launcher`: FORKED ranks, whose second attempt the test starts as torchrun
    would (TORCHELASTIC_RESTART_COUNT=1), or LAUNCHERS: torchrun itself restarts them."""
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
        result = start(2, impl, straight).wait(300) if launcher == FORKED else torchrun(2, impl, straight)
        assert result.returncode == 0, result.stderr[-3000:]
    ckpt_dir = tmp_path / "elastic"
    resumed = [*args, "--checkpoint-dir", str(ckpt_dir), "--save-final", str(tmp_path / "b.pt")]
    resumed += ["--out", str(tmp_path / "out")]
    if launcher == FORKED:
        job = start(2, impl, resumed)
        kill_rank1_once_it_checkpoints(job, ckpt_dir)
        failed = job.wait(120)
        assert failed.returncode == 1 and "the job failed: rank 1 " in failed.stderr, failed.stderr[-3000:]
        second = start(2, impl, resumed, restart_count=1).wait(300)
        assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
        stdout = second.stdout
    else:
        proc, _ = start_and_kill_rank1(str(train_path(impl)), resumed, ckpt_dir, 1)
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
    assert f"{impl}: resumed from" in stdout  # the second attempt continued from a checkpoint
    a, b = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in "ab")
    assert max_relative_difference(b, a) == 0.0  # bit-identical
    record = json.loads((tmp_path / "out" / "record.json").read_text())
    assert record["status"] == "completed" and [s["step"] for s in record["steps"]] == list(range(steps))


def check_killed_rank_ends_the_job(
    impl: str, args: list[str], tmp_path: Path, launcher: str = FORKED
) -> None:
    """Every multi-process impl: without restarts, a SIGKILLed rank ends the job within 60 s (its other
    ranks leave on SIGTERM), and the launcher's report names it (torchrun's, or `start_ranks`')."""
    ckpt_dir = tmp_path / "ckpt"
    run_args = [*args, "--checkpoint-dir", str(ckpt_dir)]
    if launcher == FORKED:
        job = start(2, impl, run_args)
        killed_at = kill_rank1_once_it_checkpoints(job, ckpt_dir)
        result = job.wait(120)
        returncode, stderr, named = (
            result.returncode,
            result.stderr,
            "the job failed: rank 1 " in result.stderr,
        )
    else:
        proc, killed_at = start_and_kill_rank1(str(train_path(impl)), run_args, ckpt_dir, 0)
        _, stderr = proc.communicate(timeout=120)
        returncode, named = proc.returncode, "rank      : 1" in stderr or "rank: 1" in stderr
    measured("job ended after the kill", time.time() - killed_at)
    assert time.time() - killed_at < 60, "the job outlived its killed rank by a minute"
    assert returncode != 0
    assert named, stderr[-3000:]  # the launcher's failure report


def check_stopped_rank_is_named(
    impl: str, args: list[str], tmp_path: Path, timeout_s: int = 5, launcher: str = FORKED
) -> None:
    """Every multi-process impl: a rank that stops (SIGSTOP: alive, silent) fails the job once a collective
    has waited --timeout, with one line naming the silent rank; then the job ends with exit code 1.

    torch 2.13's agent SIGKILLs a rank that ignores SIGTERM only 30 s after a failure (pytorch #192815;
    measured by hand: the job ends ~45 s after the stop with --timeout 10, README): this test kills the
    stopped rank itself once it is named, so that it does not sleep through those 30 s. A job that hangs
    instead (the bug this guards against) fails the test at a deadline: stderr is read as it grows, no
    read blocks, and every process of the job can be killed (LAUNCHERS: `python train.py
    --nproc-per-node 2`, run in its own session; FORKED: ranks `start_ranks` started)."""
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
    if launcher == FORKED:
        job = start(2, impl, run_args)
        pids, stderr_text, running = job.pids, job.stderr, job.running
    else:
        cmd = [sys.executable, str(train_path(impl)), "--nproc-per-node", "2", *run_args]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=ROOT, start_new_session=True
        )
        received = bytearray()

        def stderr_text() -> str:
            while select.select([proc.stderr], [], [], 0)[0] and (
                chunk := os.read(proc.stderr.fileno(), 65536)
            ):
                received.extend(chunk)
            return received.decode(errors="replace")

        pids, running = None, lambda: proc.poll() is None
    stopped = None
    try:
        deadline = time.time() + 120
        from distref.training import latest_checkpoint

        while latest_checkpoint(ckpt_dir) is None:  # training is under way
            assert running() and time.time() < deadline, "no checkpoint appeared: " + stderr_text()[-3000:]
            time.sleep(0.05)
        stopped = pids[1] if pids else worker_pid(str(ckpt_dir), 1, deadline)
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = time.time()
        give_up = stopped_at + timeout_s + 60
        named_at = ended_at = None
        while time.time() < give_up:
            ended = not running()  # (before reading: what the job wrote before it ended is read below)
            if named_at is None and "stopped responding" in stderr_text():
                named_at = time.time()
                os.kill(stopped, signal.SIGKILL)  # what torchrun does 30 s later
            if ended:
                ended_at = time.time()
                break
            time.sleep(0.1)
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGKILL)
        if launcher == FORKED:
            for pid in job.pids:  # any rank left, hung or not
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            result = job.wait(60)
            returncode, text = result.returncode, result.stderr
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and any rank left, hung or not
            proc.wait()
            text = stderr_text()
            proc.stderr.close()
            returncode = proc.returncode
    assert named_at is not None, f"no rank named within {timeout_s + 60} s of the stop: " + text[-3000:]
    assert ended_at is not None, f"the job was still running {timeout_s + 60} s after the stop"
    measured("failure named after the stop", named_at - stopped_at)
    measured("job ended after it was named", ended_at - named_at)
    named = [line for line in text.splitlines() if "stopped responding" in line]
    assert len(named) == 1 and named[0].startswith(f"{impl}: error: rank 1 stopped responding: "), named
    assert f"rank 0 waited for it {timeout_s} s (--timeout)" in named[0]
    assert named_at - stopped_at < timeout_s + 10  # --timeout, and a few seconds to hear from the others
    assert ended_at - named_at < 15 and returncode == 1
