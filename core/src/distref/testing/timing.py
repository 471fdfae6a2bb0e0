"""Where the suite's time goes: each test's kind, and the table `nox -s tests` prints at its end.

A test is of the first kind that holds of it: a **fault** test (marked `faults`), a **compile** test
(torch.compile: "compile" in its name), a **multi-process** test (it started processes: ranks, a
`python train.py`, torchrun — `distref.testing.runs` notes it), else a **one-process** test (an impl's
`main` or core's code in pytest's own process). The table sums each kind's setup, call and teardown
time over the tests (with `-n 3`, three run at once: the sums exceed the wall time), and the CPU time
each used: its own process's, its processes' (torchrun and scripts, waited for) and its ranks' (forked by
the fork server, which waits for them). On 2 busy cores a test's seconds grow with what runs beside it;
its CPU seconds do not, and they are what the suite is bound by.
"""

from __future__ import annotations

import multiprocessing.forkserver
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

KINDS = ("one process", "multi-process", "compile", "faults")
CURRENT_TEST: list = []  # the running test (conftest sets it): what it does is noted on it
STARTED_PROCESSES = ("started", "processes")  # the user property of a test that started processes
CPU_SECONDS = "cpu_seconds"  # the user property holding a test's CPU seconds (conftest.py measures them)


def _waited_cpu_seconds(pid: int) -> float:
    """A process's CPU seconds and those of the children it has waited for (/proc/PID/stat)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime


def cpu_seconds() -> float:
    """The CPU seconds used so far by this process, the children it waited for (a torchrun and its ranks,
    a script) and the fork server that starts `run_ranks`' ranks with the ranks it has waited for."""
    times = os.times()
    used = times.user + times.system + times.children_user + times.children_system
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    if pid := getattr(server, "_forkserver_pid", None):
        used += _waited_cpu_seconds(pid)
    return used


def note_started_processes() -> None:
    """The running test starts processes (ranks, a script): the table counts it as multi-process."""
    if CURRENT_TEST and STARTED_PROCESSES not in CURRENT_TEST[0].user_properties:
        CURRENT_TEST[0].user_properties.append(STARTED_PROCESSES)


def test_kind(nodeid: str, properties: Iterable[tuple[str, Any]], keywords: Iterable[str]) -> str:
    """The kind of the test `nodeid`, from its user properties and its keywords (markers)."""
    if "faults" in keywords:
        return "faults"
    if "compile" in nodeid.split("::")[-1].split("[")[0]:  # (the test's name, not its parameters')
        return "compile"
    if tuple(STARTED_PROCESSES) in {tuple(p) for p in properties}:
        return "multi-process"
    return "one process"


def cpu_seconds_by_test(reports: Iterable[Any]) -> dict[str, float]:
    """Each test's CPU seconds, where measured (the teardown report carries them)."""
    return {
        report.nodeid: value
        for report in reports
        for key, value in getattr(report, "user_properties", ())
        if key == CPU_SECONDS
    }


def seconds_by_test(reports: Iterable[Any]) -> dict[str, float]:
    """Each test's seconds, its phases (setup, call, teardown) summed, from pytest's reports."""
    seconds: dict[str, float] = {}
    for report in reports:
        seconds[report.nodeid] = seconds.get(report.nodeid, 0.0) + getattr(report, "duration", 0.0)
    return seconds


def time_by_kind(reports: Iterable[Any]) -> list[str]:
    """The Markdown table of the tests' time by kind, from pytest's reports (each phase of each test; its
    `user_properties` and `keywords` travel from xdist's workers). Empty when no test ran."""
    reports = list(reports)
    seconds = seconds_by_test(reports)
    kinds: dict[str, str] = {}
    for report in reports:
        kind = test_kind(report.nodeid, report.user_properties, getattr(report, "keywords", {}))
        if kinds.get(report.nodeid) in (None, "one process"):  # (a later phase may know more)
            kinds[report.nodeid] = kind
    if not seconds:
        return []
    cpu = cpu_seconds_by_test(reports)
    total, total_cpu = sum(seconds.values()) or 1.0, sum(cpu.values()) or 1.0
    rows = [
        "\n| kind of test | tests | seconds (summed) | share | CPU seconds | share |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind in KINDS:
        tests = [n for n, k in kinds.items() if k == kind]
        spent, used = sum(seconds[n] for n in tests), sum(cpu.get(n, 0.0) for n in tests)
        rows.append(
            f"| {kind} | {len(tests)} | {spent:.0f} | {spent / total:.0%} | {used:.0f} | {used / total_cpu:.0%} |"
        )
    rows.append(f"| all | {len(seconds)} | {total:.0f} | 100% | {sum(cpu.values()):.0f} | 100% |")
    return rows


def most_cpu(reports: Iterable[Any], shown: int = 25) -> list[str]:
    """The tests that used the most CPU, most first (what to look at to make the suite shorter)."""
    cpu = sorted(((s, n) for n, s in cpu_seconds_by_test(reports).items()), reverse=True)[:shown]
    if not cpu:
        return []
    return [f"\nthe {len(cpu)} tests that used the most CPU (seconds):"] + [f"{s:7.1f}  {n}" for s, n in cpu]
