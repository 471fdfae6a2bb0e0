"""Start-up: the seconds from `python train.py` to a run's first step, every impl, as a table.

    python ci/startup_bench.py                  # or: nox -s startup-bench
    python ci/startup_bench.py --repeats 5 --impls single ddp

Each impl trains one step of its smallest workload as a user starts it (`python impls/<impl>/train.py`,
multi-process impls with `--nproc-per-node 2`, which start their ranks through torch.distributed.run):
lenet on synthetic data, gpt for the impls made for it (a mixture of experts for expert_parallel). The
table gives the median over `--repeats` of the record's start-up (process start to the first step:
imports, data, model, process group, the strategy's set-up; the launching process's start for the ranks
it starts) and the whole command's wall time, beside the floor every process pays: `import torch`, and
torch._dynamo, which torch.optim imports at the first parameter group of any optimizer (torch/_compile.py).
Run it on a quiet machine: start-up is CPU time, and a busy neighbour doubles it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "core" / "src"))
from distref.impl_folders import discover  # noqa: E402

IMPLS = discover(ROOT / "impls")
LENET = ["--model", "lenet", "--dataset", "synthetic", "--global-batch-size", "16"]
GPT = ["--model", "gpt", "--dataset", "synthetic", "--global-batch-size", "16"]
FLOORS = {
    "python -c 'import torch'": "import torch",
    "… and torch._dynamo (torch.optim imports it)": "import torch, torch._dynamo",
}


def workload(impl: str) -> list[str]:
    """The impl's smallest run: one step, no evaluation worth its time, on the workload it is made for."""
    settings = IMPLS[impl]
    options = GPT if "gpt" in (settings.get("models") or []) else LENET
    if settings.get("experts") == "required":
        options = [*options, "--experts", "2"]
    ranks = ["--nproc-per-node", "2"] if settings.get("launcher") == "torchrun" else []
    return [*options, "--steps", "1", *ranks]


def one_start(impl: str) -> tuple[float, float]:
    """(the record's start-up, the command's wall time) of one run, in seconds."""
    with tempfile.TemporaryDirectory() as out:
        argv = [sys.executable, str(ROOT / "impls" / impl / "train.py"), *workload(impl), "--out", out]
        started = time.perf_counter()
        done = subprocess.run(
            argv, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        wall = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"startup_bench: {impl} failed: {done.stderr.strip().splitlines()[-1:]}")
        record = json.loads((Path(out) / "record.json").read_text())
    return record["startup_time_s"], wall


def floor(code: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python ci/startup_bench.py", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per impl: the median is shown")
    parser.add_argument("--impls", nargs="+", default=["single", *sorted(i for i in IMPLS if i != "single")])
    args = parser.parse_args(argv)
    if args.repeats < 1 or set(args.impls) - set(IMPLS):
        parser.error(f"--repeats must be >= 1 and --impls among {sorted(IMPLS)}")
    print("| what | ranks | start-up (s, median) | wall (s, median) |")
    print("|---|---:|---:|---:|")
    for name, code in FLOORS.items():
        print(f"| {name} | 1 | — | {statistics.median(floor(code) for _ in range(args.repeats)):.2f} |")
    for impl in args.impls:
        starts, walls = zip(*(one_start(impl) for _ in range(args.repeats)), strict=True)
        ranks = 2 if IMPLS[impl].get("launcher") == "torchrun" else 1
        print(
            f"| {impl} | {ranks} | {statistics.median(starts):.2f} | {statistics.median(walls):.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
