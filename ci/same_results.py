"""Proof that a change moved code and nothing else: every impl's final parameters, bit for bit.

    python ci/same_results.py save DIR     # before the change: each impl's `--save-final` state in DIR
    python ci/same_results.py check DIR    # after it: the same runs, compared with torch.equal

One fixed workload per model: 20 steps of lenet on MNIST and of gpt on the synthetic task (tensor_parallel:
gpt only), fp32 AdamW, 2 ranks where the impl runs several; and the impls' other forms (`VARIANTS`: other
pipeline schedules, 2-D meshes, ZeRO-3, ...). Beside the parameters, the record's deterministic numbers
(communication and model states measured and predicted, activations, reasons for a missing prediction, the
strategy's facts but its timings) must be equal too. Bit-identical holds on one machine with one torch;
another machine may sum in another order. Prints one line per run and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
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

# (impl, model, extra options, ranks): the forms beside each impl's default.
VARIANTS = [
    ("pipeline", "gpt", ["--schedule", "zbv", "--microbatches", "4"], 2),
    ("pipeline", "lenet", ["--schedule", "interleaved-1f1b", "--microbatches", "4"], 2),
    ("pipeline", "lenet", ["--schedule", "gpipe", "--dp", "2"], 4),
    ("tensor_parallel", "gpt", ["--dp-shard", "2", "--tp", "2"], 4),
    ("model_parallel", "lenet", ["--devices", "cpu,cpu"], None),
    ("fsdp", "gpt", ["--grad-accum", "2"], 2),
    ("deepspeed_zero", "gpt", ["--zero-stage", "3"], 2),
    ("ddp", "lenet", ["--grad-accum", "4"], 2),
]
# A record's numbers that depend on the run's timing, not on what it computed.
TIMED_FACTS = ("busy_fraction", "timeline")


def deterministic(record: dict) -> dict:
    """What a record says that a rerun of the same code must say again."""
    communication = {k: v for k, v in record.get("communication", {}).items() if k != "counting_overhead_s"}
    strategy = {k: v for k, v in record.get("strategy", {}).items() if k not in TIMED_FACTS}
    kept = ("model_state_bytes", "model_state_bytes_predicted", "activation_bytes", "predicted_unavailable")
    return {**{k: record.get(k) for k in kept}, "communication": communication, "strategy": strategy}


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
    for impl, model, extra, n in VARIANTS:
        if only and impl not in only:
            continue
        train = ROOT / "impls" / impl / "train.py"
        ranks = ["--nproc-per-node", str(n)] if n else []
        command = [sys.executable, str(train), *ranks, *WORKLOADS[model], "--seed", "0", *extra]
        runs.append((impl, f"{model}{''.join(extra)}", command))
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
        saved_record = saved.with_suffix(".json")
        with tempfile.TemporaryDirectory() as tmp:
            final = saved if args.mode == "save" else Path(tmp) / "final.pt"
            full = [*command, "--data-root", env["DISTREF_DATA"], "--out", tmp, "--save-final", str(final)]
            result = subprocess.run(full, env=env, capture_output=True, text=True)
            if result.returncode != 0:
                print(f"{impl:16} {model:6} FAILED (exit {result.returncode}): {result.stderr[-500:]}")
                differing += 1
                continue
            numbers = deterministic(json.loads((Path(tmp) / "record.json").read_text()))
            if args.mode == "save":
                saved_record.write_text(json.dumps(numbers, indent=1, sort_keys=True))
                print(f"{impl:16} {model:6} saved {saved}")
                continue
            before, after = torch.load(saved, weights_only=True), torch.load(final, weights_only=True)
            same = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
            same_numbers = json.loads(saved_record.read_text()) == json.loads(json.dumps(numbers))
            differing += not (same and same_numbers)
            verdict = "bit-identical" if same else "DIFFERENT"
            verdict += ", record's numbers equal" if same_numbers else ", record's numbers DIFFER"
            print(f"{impl:16} {model:6} {verdict} ({len(after)} tensors)")
    if args.mode == "check":
        print(f"{differing} of {len(runs)} runs differ")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
