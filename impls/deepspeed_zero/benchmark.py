"""What each ZeRO stage keeps per rank, measured, next to the formula and DeepSpeed's own estimator.

    python impls/deepspeed_zero/benchmark.py                 # or: nox -s deepspeed_zero-bench
    python impls/deepspeed_zero/benchmark.py --worlds 2 --gpt-layers 8 --steps 10

Runs impls/deepspeed_zero/train.py (fp32, AdamW, gpt on the synthetic set) at stages 0-3 for each world
size, every rank with one thread, and prints per-rank model-state bytes (parameters + gradients +
optimizer states, measured on the tensors each rank holds: train.py's `zero_model_state_bytes`) against
the ZeRO paper's formula for fp32 Adam with Ψ parameters over N ranks — stage 0: 16Ψ; stage 1:
4Ψ + 4Ψ + 8Ψ/N; stage 2: 4Ψ + 12Ψ/N; stage 3: 16Ψ/N — and against
`estimate_zero2/3_model_states_mem_needs` (DeepSpeed's estimator, which assumes 16-bit parameters and
fp32 master weights). Also each run's samples/s (2 cores: comparable within one table only).
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
TRAIN = HERE / "train.py"


def run(args: list[str], out: Path, nproc: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(TRAIN), "--nproc-per-node", str(nproc), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    if result.returncode != 0:
        raise SystemExit(f"benchmark: deepspeed_zero failed: {result.stderr.strip().splitlines()[-1]}")
    return json.loads((out / "record.json").read_text())


def formula_bytes(stage: int, params: int, world: int) -> float:
    """Per-rank model-state bytes of fp32 Adam under ZeRO (Rajbhandari et al., with K = 8 for fp32)."""
    return {
        0: 16 * params,
        1: 4 * params + 4 * params + 8 * params / world,
        2: 4 * params + 12 * params / world,
        3: 16 * params / world,
    }[stage]


def deepspeed_estimate(stage: int, params: int, largest_layer: int, world: int) -> float | None:
    """DeepSpeed's estimator for one GPU's model states (no offload), where it has one (stages 2 and 3)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    if stage == 2:
        return estimate_zero2_model_states_mem_needs(params, world, 1, cpu_offload=False)[1]
    if stage == 3:
        return estimate_zero3_model_states_mem_needs(
            params, largest_layer, world, 1, cpu_offload=False, cpu_offload_params=False
        )[1]
    return None


def model_sizes(gpt_layers: int) -> tuple[int, int]:
    """(parameters, largest tensor) of gpt at this depth on the synthetic set."""
    sys.path.insert(0, str(HERE.parents[1] / "core" / "src"))
    from distref.cli import parse_config
    from distref.data import load_dataset
    from distref.models import build_model

    cfg = parse_config(["--model", "gpt", "--dataset", "synthetic", "--gpt-layers", str(gpt_layers)], "bench")
    model = build_model("gpt", load_dataset(cfg)[2], gpt_layers)
    return sum(p.numel() for p in model.parameters()), max(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python impls/deepspeed_zero/benchmark.py", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--gpt-layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--global-batch-size", type=int, default=64)
    args = parser.parse_args(argv)
    workload = ["--model", "gpt", "--dataset", "synthetic", "--gpt-layers", str(args.gpt_layers)]
    workload += ["--steps", str(args.steps), "--global-batch-size", str(args.global_batch_size)]
    workload += ["--eval-every", str(10 * args.steps), "--optimizer", "adamw"]
    params, largest = model_sizes(args.gpt_layers)
    print(
        f"gpt --gpt-layers {args.gpt_layers}: Ψ = {params:,} parameters (fp32, AdamW), largest tensor {largest:,}"
    )
    print()
    print(
        "| ranks | stage | params | grads | optimizer | measured / rank | formula | measured ÷ formula | DeepSpeed estimate | samples/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            for stage in args.stages:
                record = run([*workload, "--zero-stage", str(stage)], Path(tmp) / f"w{world}s{stage}", world)
                held = record["model_state_bytes"]
                mean = {
                    k: sum(h[k] for h in held) / len(held) for k in ("parameters", "gradients", "optimizer")
                }
                measured = sum(mean.values())
                formula = formula_bytes(stage, params, world)
                # DeepSpeed keeps a flat fp32 copy of each rank's partition for the optimizer at stages 1-3,
                # even in fp32 training: the paper's fp32 formula has no such copy.
                with_master = formula + (4 * params / world if stage else 0)
                estimate = deepspeed_estimate(stage, params, largest, world)
                shown = f"{estimate / 1024:,.0f} KiB" if estimate else "—"
                print(
                    f"| {world} | {stage} | {mean['parameters'] / 1024:,.0f} KiB | {mean['gradients'] / 1024:,.0f} KiB "
                    f"| {mean['optimizer'] / 1024:,.0f} KiB | {measured / 1024:,.0f} KiB | {formula / 1024:,.0f} KiB "
                    f"| {measured / formula:.2f} | {with_master / 1024:,.0f} KiB | {measured / with_master:.2f} "
                    f"| {shown} | {record['samples_per_s']:,.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
