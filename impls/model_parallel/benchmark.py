"""Model parallelism's naive schedule, measured: speed against single, each rank's busy fraction against
the ideal 1/p, and the bytes each rank sends per step.

    python impls/model_parallel/benchmark.py                  # or: nox -s model_parallel-bench
    python impls/model_parallel/benchmark.py --model lenet --dataset mnist --parts 2 --steps 200

Runs impls/single/train.py and impls/model_parallel/train.py (one process per part) on the same model,
data and global batch, every process with one thread, and prints a table from their records. With one
micro-batch in flight, part r waits while the others compute: at best each rank is busy 1/p of a step
(if the parts cost the same), and the step takes as long as single's plus the hand-offs. The gain of
model parallelism is memory (each rank holds 1/p of the model state), not speed: impls/pipeline's
schedules recover the speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
SINGLE = HERE.parent / "single" / "train.py"


def run(train: Path, args: list[str], out: Path, extra: list[str] = ()) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(train), *extra, *args, "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    if result.returncode != 0:
        raise SystemExit(f"benchmark: {train.parent.name} failed: {result.stderr.strip().splitlines()[-1]}")
    return json.loads((out / "record.json").read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python impls/model_parallel/benchmark.py", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--dataset", default="synthetic")
    parser.add_argument("--parts", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--global-batch-size", type=int, default=64)
    args = parser.parse_args(argv)
    workload = ["--model", args.model, "--dataset", args.dataset, "--steps", str(args.steps)]
    workload += ["--global-batch-size", str(args.global_batch_size), "--eval-every", str(10 * args.steps)]
    workload += ["--data-root", os.environ.get("DISTREF_DATA", "data"), "--log-every", "50"]

    with tempfile.TemporaryDirectory() as tmp:
        single = run(SINGLE, workload, Path(tmp) / "single")
        rows = [("single", 1, single)]
        for p in args.parts:
            print(f"benchmark: {p} parts ...", file=sys.stderr, flush=True)
            rows.append(
                (
                    f"model_parallel ×{p}",
                    p,
                    run(HERE / "train.py", workload, Path(tmp) / f"mp{p}", ["--nproc-per-node", str(p)]),
                )
            )

    base = single["samples_per_s"]
    print(
        f"\n{args.model} on {args.dataset}, global batch {args.global_batch_size}, {args.steps} steps, 1 thread per process, {os.cpu_count()} CPUs\n"
    )
    print(
        "| run | parts (blocks) | samples/s | vs single | busy fraction per rank (ideal 1/p) | bytes sent per step per rank | model state per rank (KiB) |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, p, rec in rows:
        strategy = rec.get("strategy", {})
        parts = " \\| ".join(",".join(blocks) for blocks in strategy.get("parts", [])) or "all"
        busy = ", ".join(f"{b:.2f}" for b in strategy.get("busy_fraction", [1.0]))
        sent = ", ".join(f"{b:,}" for b in strategy.get("bytes_sent_per_step", [0]))
        state = ", ".join(f"{sum(s.values()) / 1024:,.0f}" for s in rec["model_state_bytes"])
        print(
            f"| {label} | {parts} | {rec['samples_per_s']:,.0f} | {rec['samples_per_s'] / base:.2f} | "
            f"{busy} ({1 / p:.2f}) | {sent} | {state} |"
        )


if __name__ == "__main__":
    main()
