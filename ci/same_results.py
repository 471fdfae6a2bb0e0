"""Proof that a change moved code and nothing else: every impl's final parameters, bit for bit.

    python ci/same_results.py save DIR     # before the change: each impl's `--save-final` state in DIR
    python ci/same_results.py check DIR    # after it: the same runs, compared with torch.equal

One fixed workload per model: 20 steps of lenet on MNIST and of gpt on the synthetic task (tensor_parallel:
gpt only), fp32 AdamW, 2 ranks where the impl runs several. Bit-identical holds on one machine with one
torch; another machine may sum in another order. Prints one line per run and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {
    "lenet": ["--model", "lenet", "--dataset", "mnist", "--steps", "20"],
    "gpt": ["--model", "gpt", "--dataset", "synthetic", "--steps", "20", "--lr", "3e-3"],
}


def impl_runs(only: list[str] | None = None) -> list[tuple[str, str, list[str]]]:
    """(impl, model, command without --out/--save-final) for every impl (or those in `only`) and the
    models it trains."""
    runs = []
    for train in sorted(ROOT.glob("impls/*/train.py")):
        if only and train.parent.name not in only:
            continue
        with open(train.parent / "pyproject.toml", "rb") as f:
            settings = tomllib.load(f).get("tool", {}).get("distref", {})
        ranks = ["--nproc-per-node", "2"] if settings.get("launcher") == "torchrun" else []
        for model in settings.get("models", list(WORKLOADS)):
            command = [sys.executable, str(train), *ranks, *WORKLOADS[model], "--seed", "0"]
            runs.append((train.parent.name, model, command))
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("mode", choices=("save", "check"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--impls", help="comma-separated (default: every impl)")
    args = parser.parse_args()
    runs = impl_runs(args.impls.split(",") if args.impls else None)
    args.folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DISTREF_DATA": os.environ.get("DISTREF_DATA", "data")}
    differing = 0
    for impl, model, command in runs:
        saved = args.folder / f"{impl}-{model}.pt"
        with tempfile.TemporaryDirectory() as tmp:
            final = saved if args.mode == "save" else Path(tmp) / "final.pt"
            full = [*command, "--data-root", env["DISTREF_DATA"], "--out", tmp, "--save-final", str(final)]
            result = subprocess.run(full, env=env, capture_output=True, text=True)
            if result.returncode != 0:
                print(f"{impl:16} {model:6} FAILED (exit {result.returncode}): {result.stderr[-500:]}")
                differing += 1
                continue
            if args.mode == "save":
                print(f"{impl:16} {model:6} saved {saved}")
                continue
            before, after = torch.load(saved, weights_only=True), torch.load(final, weights_only=True)
            same = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
            differing += not same
            print(f"{impl:16} {model:6} {'bit-identical' if same else 'DIFFERENT'} ({len(after)} tensors)")
    if args.mode == "check":
        print(f"{differing} of {len(runs)} runs differ")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
