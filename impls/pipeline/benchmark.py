"""The pipeline bubble, measured against theory, and the speed-up over model parallelism's naive schedule.

    python impls/pipeline/benchmark.py                      # or: nox -s pipeline-bench
    python impls/pipeline/benchmark.py --ranks 2 --microbatches 4 8 --schedules gpipe 1f1b --steps 20

Runs impls/pipeline/train.py for each schedule and micro-batch count M on the same split, and
impls/model_parallel/train.py (one micro-batch at a time) and impls/single/train.py on the same model,
data and global batch; every process has one thread. Prints one table from their records:

- bubble: the share of its time in `schedule.step` a rank is not computing (1 - the time its stages
  spent in forward and backward / that time, from the second step on), averaged over ranks;
- theory: (p-1)/(M+p-1) for GPipe and 1F1B with p equal stages, (p-1)/(V·M+p-1) interleaved over V stages
  per rank;
- efficiency = 1 - bubble against the theory's; speed against model_parallel and single;
- the measured idle time beyond the theory's, per micro-batch: what each micro-batch costs besides its
  compute (the schedule's Python, gloo's send/recv latency), which grows with M while the compute per
  micro-batch shrinks;
- peak activations held for backward on the first stage (GPipe holds M micro-batches, 1F1B p).

The default workload is gpt with 4 transformer blocks (6 blocks: with embed and head joined to their
neighbours, 2 or 4 stages of nearly equal cost), global batch 512.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
IMPLS = HERE.parent


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


def theory_bubble(schedule: str, m: int, p: int) -> float | None:
    """The idle share of a step with p equal stages; interleaving's formula assumes M >= p."""
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    return (p - 1) / (2 * m + p - 1) if m >= p else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python impls/pipeline/benchmark.py", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--ranks", type=int, default=2, help="pipeline ranks p (one pipeline)")
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved-1f1b"])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--global-batch-size", type=int, default=512)
    parser.add_argument("--gpt-layers", type=int, default=4)
    args = parser.parse_args(argv)
    p = args.ranks
    workload = ["--model", "gpt", "--dataset", "synthetic", "--gpt-layers", str(args.gpt_layers)]
    workload += ["--steps", str(args.steps), "--global-batch-size", str(args.global_batch_size)]
    workload += ["--eval-every", str(10 * args.steps), "--log-every", str(args.steps)]

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        single = run(IMPLS / "single" / "train.py", workload, Path(tmp) / "single")
        print(f"benchmark: model_parallel ×{p} ...", file=sys.stderr, flush=True)
        naive = run(
            IMPLS / "model_parallel" / "train.py", workload, Path(tmp) / "mp", ["--nproc-per-node", str(p)]
        )
        for schedule in args.schedules:
            for m in args.microbatches:
                if schedule == "1f1b" and m < p:
                    continue  # torch's 1F1B needs M >= p
                print(f"benchmark: {schedule} M={m} ...", file=sys.stderr, flush=True)
                options = ["--nproc-per-node", str(p), "--schedule", schedule, "--microbatches", str(m)]
                rec = run(HERE / "train.py", workload, Path(tmp) / f"{schedule}-{m}", options)
                rows.append((schedule, m, rec))

    print(
        f"\ngpt ({args.gpt_layers} transformer blocks) on synthetic, global batch {args.global_batch_size}, "
        f"{args.steps} steps, {p} ranks, 1 thread per process, {os.cpu_count()} CPUs\n"
    )
    print(
        "| schedule | M | stages | samples/s | vs model_parallel | vs single | bubble measured | "
        "bubble theory | efficiency / theory | idle beyond theory per micro-batch (ms) | "
        "stage-0 activations (KiB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    mp_busy = naive["strategy"]["busy_fraction"]
    print(
        f"| model_parallel (naive) | 1 | {p} | {naive['samples_per_s']:,.0f} | 1.00 | "
        f"{naive['samples_per_s'] / single['samples_per_s']:.2f} | {1 - sum(mp_busy) / len(mp_busy):.2f} | "
        f"{(p - 1) / p:.2f} | — | — | — |"
    )
    for schedule, m, rec in rows:
        measured, theory = rec["bubble_fraction"], theory_bubble(schedule, m, p)
        activations = rec["strategy"]["peak_activation_bytes"][0] / 1024
        # The schedule's share of a step is the busy time / busy fraction; the median step stands for it
        # closely (the optimizer step is the rest: a few ms).
        step_s = statistics.median(s["step_time_s"] for s in rec["steps"][1:])  # the first infers shapes
        if theory is None:
            versus = excess = "— (M < p)"
        else:
            versus = f"{(1 - measured) / (1 - theory):.2f}"
            excess = f"{(measured - theory) * step_s / m * 1000:.2f}"
        print(
            f"| {schedule} | {m} | {rec['strategy']['stages']} | {rec['samples_per_s']:,.0f} | "
            f"{rec['samples_per_s'] / naive['samples_per_s']:.2f} | "
            f"{rec['samples_per_s'] / single['samples_per_s']:.2f} | {measured:.2f} | "
            f"{'—' if theory is None else f'{theory:.2f}'} | {versus} | {excess} | {activations:,.0f} |"
        )
    print(f"\nsingle: {single['samples_per_s']:,.0f} samples/s")


if __name__ == "__main__":
    main()
