"""Context parallelism on long sequences, measured: each rank's activations against single's (the point of
the strategy: 1/C of a sequence per rank), what each rank sends per step, and speed, beside tensor
parallelism (sequence parallel) and FSDP on the same model, data and global batch.

    python impls/context_parallel/benchmark.py                 # or: nox -s context_parallel-bench
    python impls/context_parallel/benchmark.py --sequence-lengths 256 1024 4096 --world-size 4

Runs impls/single, impls/context_parallel (ring and Ulysses), impls/tensor_parallel and impls/fsdp on gpt
(digit reversal, --sequence-length N), every process with one thread, and prints one table per sequence
length from their records: activations held for backward by the rank holding most (measured; the
formula's beside it), as a fraction of single's; bus bytes each rank moves per step (nccl-tests'
convention, distref.training.traffic); samples/s. By default one sequence a step, which data parallelism
cannot split (its row says so). On the CPU the speed is gloo's round trips, not a GPU's
links: read the memory and the bytes, and time on the GPU (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

IMPLS = Path(__file__).resolve().parent.parent
RUNS = {  # row: (impl, its own options)
    "single": ("single", []),
    "context_parallel ring": ("context_parallel", []),
    "context_parallel ulysses": ("context_parallel", ["--cp-mode", "ulysses"]),
    "tensor_parallel": ("tensor_parallel", []),
    "fsdp": ("fsdp", []),
}


def run(impl: str, options: list[str], world: int, workload: list[str], out: Path) -> dict | str:
    """The run's record, or the line with which the impl refused it (exit 2: e.g. fsdp, one sequence a
    step over 2 ranks)."""
    launch = [] if impl == "single" else ["--nproc-per-node", str(world)]
    result = subprocess.run(
        [sys.executable, str(IMPLS / impl / "train.py"), *launch, *workload, *options, "--out", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=3600,
    )
    last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
    if result.returncode == 2:
        return last.split("error: ", 1)[-1]
    if result.returncode != 0:
        raise SystemExit(f"benchmark: {impl} {' '.join(options)} failed: {last}")
    return json.loads((out / "record.json").read_text())


def row(name: str, record: dict | str, single_activations: int, world: int) -> str:
    if isinstance(record, str):
        return f"| {name} ×{world} | cannot: {record} | | | | |"
    activations = record["activation_bytes"]
    measured, predicted = max(activations["measured"]), max(activations["predicted"] or [0])
    bus = max(
        sum(kind["bus_bytes"] for kind in rank.values()) for rank in record["communication"]["measured"]
    )
    return (
        f"| {name} ×{record['world_size']} | {measured / 2**20:,.2f} | {predicted / 2**20:,.2f} | "
        f"{measured / single_activations:.2f} | {bus / 2**20:,.2f} | {record['samples_per_s']:,.1f} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python impls/context_parallel/benchmark.py", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--sequence-lengths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    # One sequence a step: the case context parallelism is for (data parallelism has no second sequence to
    # give the second rank; --global-batch-size 8 to compare with it)
    parser.add_argument("--global-batch-size", type=int, default=1)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        for length in args.sequence_lengths:
            workload = ["--model", "gpt", "--dataset", "synthetic", "--sequence-length", str(length)]
            workload += ["--steps", str(args.steps), "--global-batch-size", str(args.global_batch_size)]
            workload += ["--eval-every", str(10 * args.steps), "--log-every", str(args.steps)]
            records = {
                name: run(impl, options, args.world_size, workload, Path(tmp) / f"{length}-{i}")
                for i, (name, (impl, options)) in enumerate(RUNS.items())
            }
            single = max(records["single"]["activation_bytes"]["measured"])
            print(
                f"\ngpt (2 blocks of 64), {length} tokens, global batch {args.global_batch_size}, "
                f"{args.steps} steps, fp32, {args.world_size} ranks\n"
            )
            print(
                "| run | activations MiB (rank max) | formula MiB | vs single | bus MiB/step (rank max) | samples/s |"
            )
            print("|---|---|---|---|---|---|")
            for name, record in records.items():
                print(row(name, record, single, 1 if name == "single" else args.world_size))


if __name__ == "__main__":
    main()
