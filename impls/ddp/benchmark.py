"""DDP scaling benchmark: single-process (1 thread) vs DDP with N ranks (1 thread each), in one run.

    python impls/ddp/benchmark.py                       # lenet on real MNIST, 2 ranks
    nox -s ddp-bench -- --ranks 2 --per-rank-batch 128 256

Both run the same workload, global batch N × per-rank batch, so the scaling efficiency is the one the
comparison report uses (distref.report.scaling_efficiency): (DDP samples/s ÷ single's) ÷ (N cores ÷ 1
core), strong scaling on equal hardware per process. Throughput is the run record's samples/s (warm-up
step and evaluation excluded). The runs never overlap; each configuration runs --repeats times,
interleaved with the others, and the best run of each counts, so a burst of background load on a shared
machine does not decide the ratio.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from distref.report import scaling_efficiency

ROOT = Path(__file__).resolve().parents[2]


def samples_per_s(cmd: list[str], out: Path) -> tuple[float, dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread per process, single included
    result = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, env=env, cwd=ROOT)
    if result.returncode:
        sys.exit(f"benchmark run failed: {' '.join(cmd)}\n{result.stderr[-2000:]}")
    record = json.loads((out / "record.json").read_text())
    return record["samples_per_s"], record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--per-rank-batch", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", default="lenet")
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--data-root", default=os.environ.get("DISTREF_DATA", str(ROOT / "data")))
    parser.add_argument("ddp_options", nargs="*", help="after --: extra options for impls/ddp/train.py")
    args = parser.parse_args()
    common = [
        "--model",
        args.model,
        "--dataset",
        args.dataset,
        "--data-root",
        args.data_root,
        "--steps",
        str(args.steps),
        "--log-every",
        "100",
        "--eval-every",
        str(args.steps),
    ]
    single = [sys.executable, str(ROOT / "impls/single/train.py"), *common]
    ddp = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.ranks}",
        str(ROOT / "impls/ddp/train.py"),
        *common,
        *args.ddp_options,
    ]

    best: dict[tuple[str, int], dict] = {}  # (name, per-rank batch) -> the record of its fastest run
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for batch in args.per_rank_batch:
                global_batch = batch * args.ranks  # the same workload for both
                for name, cmd in (("single", single), ("ddp", ddp)):
                    out = Path(tmp, f"{name}-{batch}-{repeat}")
                    sps, record = samples_per_s([*cmd, "--global-batch-size", str(global_batch)], out)
                    if sps > best.get((name, batch), {}).get("samples_per_s", 0.0):
                        best[name, batch] = record
                    print(
                        f"  {name:6s} global batch {global_batch:4d}, run {repeat + 1}: {sps:8,.0f} samples/s",
                        file=sys.stderr,
                    )

    env = record["environment"]
    print(
        f"\nDDP scaling: {args.model}/{args.dataset}, {args.steps} steps, torch {env['torch']}, "
        f"{env['cpu_count']} cores ({env['device_name']}), backend {env['backend']}, 1 thread per process, "
        f"best of {args.repeats}\n"
    )
    print(
        f"| per-rank batch | global batch | single (1 core) samples/s | DDP {args.ranks} ranks "
        f"({args.ranks} cores) samples/s | speed-up | scaling efficiency |"
    )
    print("|---|---|---|---|---|---|")
    for batch in args.per_rank_batch:
        single_record, ddp_record = best["single", batch], best["ddp", batch]
        speed_up = ddp_record["samples_per_s"] / single_record["samples_per_s"]
        efficiency = scaling_efficiency(ddp_record, single_record)
        print(
            f"| {batch} | {batch * args.ranks} | {single_record['samples_per_s']:,.0f} | "
            f"{ddp_record['samples_per_s']:,.0f} | {speed_up:.2f} | {efficiency:.2f} |"
        )


if __name__ == "__main__":
    main()
