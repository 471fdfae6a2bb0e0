"""Threads per process: what more OpenMP threads buy on an idle machine, and cost on a shared one.

    python impls/single/benchmark.py                 # or: nox -s single-bench
    python impls/single/benchmark.py --steps 300 --repeats 2 --threads 1 2

Runs impls/single/train.py (lenet, synthetic data) with each OMP_NUM_THREADS, with the default
OpenMP wait policy and with OMP_WAIT_POLICY=PASSIVE, first on an idle machine, then beside one busy
process (a Python loop: a neighbour on a shared box), and prints samples/s (best of --repeats) as a
table. This measurement is why every process defaults to one thread (distref.training.configure_cpu_threads).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

TRAIN = Path(__file__).with_name("train.py")


def samples_per_s(env: dict[str, str], steps: int) -> float:
    args = ["--model", "lenet", "--dataset", "synthetic", "--steps", str(steps), "--global-batch-size", "64"]
    args += ["--eval-every", str(10 * steps), "--log-every", str(steps)]
    result = subprocess.run(
        [sys.executable, str(TRAIN), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=600,
    )
    if result.returncode != 0:
        raise SystemExit(f"benchmark: train.py failed: {result.stderr.strip().splitlines()[-1]}")
    return float(re.search(r"([\d,]+) samples/s", result.stdout).group(1).replace(",", ""))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python impls/single/benchmark.py", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    args = parser.parse_args(argv)

    settings = [({"OMP_NUM_THREADS": str(n)}, f"{n} thread(s)") for n in sorted(set(args.threads))]
    settings += [
        ({"OMP_NUM_THREADS": str(n), "OMP_WAIT_POLICY": "PASSIVE"}, f"{n} threads, OMP_WAIT_POLICY=PASSIVE")
        for n in sorted(set(args.threads))
        if n > 1
    ]
    rows = {label: {} for _, label in settings}
    for load in ("idle", "beside a busy process"):
        busy = None
        if load != "idle":  # one neighbour spinning on a core, as on a shared machine
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(1)
        try:
            for env, label in settings:
                best = max(samples_per_s(env, args.steps) for _ in range(args.repeats))
                rows[label][load] = best
                print(f"{label}, {load}: {best:,.0f} samples/s", file=sys.stderr, flush=True)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()

    print(
        f"\nlenet, synthetic data, {args.steps} steps, global batch 64, best of {args.repeats}, {os.cpu_count()} CPUs\n"
    )
    print("| threads per process | idle (samples/s) | beside a busy process (samples/s) |\n|---|---|---|")
    for label, figures in rows.items():
        print(f"| {label} | {figures['idle']:,.0f} | {figures['beside a busy process']:,.0f} |")


if __name__ == "__main__":
    main()
