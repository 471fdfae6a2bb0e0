"""How many ranks a run can have on this machine: the most, up to one per visible GPU, that the impl's own
checks accept for the workload.

`nox -s <impl>-gpu` and `python -m distref.compare` on CUDA start one rank per GPU only where the workload
allows it: lenet has 4 blocks (model_parallel: at most 4 parts), 1F1B needs M >= p micro-batches, a global
batch of 64 splits over 1, 2, 4 or 8 ranks but not 3. The impl's train.py is the one place that knows
(its parse_config checks), so this asks it, for each candidate count, without printing its errors:

    python -m distref.ranks impls/ddp/train.py --gpus 3 -- --model lenet --global-batch-size 64
    world_size=2 (of 3 GPUs: 3 ranks: --global-batch-size 64 must be divisible by ...)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path

from distref.impl_folders import parse_as


def largest_fitting(
    devices: int, problem_at: Callable[[int], str | None], fewest: int = 1
) -> tuple[int | None, list[str]]:
    """The most ranks in [fewest, devices] for which `problem_at(ranks)` finds no problem, and why each
    larger count was refused ("N ranks: <problem>"); None if no count fits."""
    refused = []
    for ranks in range(devices, fewest - 1, -1):
        problem = problem_at(ranks)
        if problem is None:
            return ranks, refused
        refused.append(f"{ranks} ranks: {problem}")
    return None, refused


def workload_problem(train: Path, args: Sequence[str], ranks: int) -> str | None:
    """What the impl's train.py says about `args` run as `ranks` ranks (its one-line error), or None."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            parse_as(train, args, ranks)
    except SystemExit:
        return said.getvalue().strip().split("error: ", 1)[-1] or "refused"
    return None


def fitting_world_size(train: Path, args: Sequence[str], devices: int) -> tuple[int | None, str]:
    """The most ranks, one per device and at most `devices`, that the impl accepts for `args`, and a line
    that says so and why not more."""
    with open(train.parent / "pyproject.toml", "rb") as f:
        launcher = tomllib.load(f).get("tool", {}).get("distref", {}).get("launcher", "python")
    if launcher != "torchrun":
        return 1, "1 process: this impl starts no ranks (DataParallel drives every GPU from one)"
    # The run's own options, device included: on the GPU machine this is asked on, each count up to its GPUs
    # passes the device checks, and what refuses a count is the workload (fp16 needs the CUDA it has).
    ranks, refused = largest_fitting(devices, lambda n: workload_problem(train, args, n))
    if ranks is None:
        return None, f"no rank count up to {devices} fits this workload: " + "; ".join(refused)
    why = f"; not more: {'; '.join(refused)}" if refused else ""
    return ranks, f"{ranks} rank(s), one per device, of the {devices} here{why}"


def cuda_problem(
    counted: int, available: bool, capability: tuple[int, int], arch_list: list[str]
) -> str | None:
    """Why this torch build cannot train on the GPUs it counts, or None. `counted` comes from NVML and
    sees GPUs that a too-old driver or a build without their architecture cannot use; PyPI's torch
    2.13.0 is a CUDA 13 build."""
    if counted == 0:
        return "no CUDA device visible to torch (a CPU build, or no GPU)"
    if not available:
        return (
            f"torch counts {counted} GPU(s) but cannot use them (an NVIDIA driver older than this torch's "
            "CUDA build needs?): install a torch build for your driver, pinned in a constraints file that "
            "DISTREF_CONSTRAINTS names (README)"
        )
    # Kernels for sm_XY run on X.Y and later minors of X; PTX for compute_XY is compiled for any later GPU.
    arch = capability[0] * 10 + capability[1]
    built = [(a.split("_")[0], int(a.split("_")[1])) for a in arch_list if a.split("_")[-1].isdigit()]
    if not built:  # another kind of list (ROCm's gfx names): not checked here
        return None
    runs = [
        k
        for kind, k in built
        if ((kind == "sm" and k // 10 == arch // 10) or kind == "compute") and k <= arch
    ]
    if not runs:
        return (
            f"the GPU's architecture sm_{arch} is not among this torch build's ({', '.join(arch_list)}): "
            "install a build that has it, pinned in a constraints file that DISTREF_CONSTRAINTS names (README)"
        )
    return None


def cuda_gpus() -> tuple[int, str]:
    """(the GPUs this torch build can train on, a line saying which, or why none)."""
    import torch

    counted = torch.cuda.device_count()
    available = counted > 0 and torch.cuda.is_available()
    capability = torch.cuda.get_device_capability(0) if available else (0, 0)
    problem = cuda_problem(counted, available, capability, torch.cuda.get_arch_list() if available else [])
    if problem:
        return 0, problem
    return counted, f"{counted} × {torch.cuda.get_device_name(0)} (sm_{capability[0]}{capability[1]})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m distref.ranks", description=__doc__.splitlines()[0])
    parser.add_argument("train", type=Path, nargs="?", help="an impl's train.py")
    parser.add_argument("--gpus", type=int, help="devices on this machine")
    parser.add_argument("--cuda", action="store_true", help="print the GPUs this torch can train on")
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)  # -- then the run's options
    ns, run_args = parser.parse_args(argv[:split]), argv[split + 1 :]
    # Each answer is one line with a prefix of its own, which nox reads (torch may warn around it).
    if ns.cuda:
        gpus, said = cuda_gpus()
        print(f"cuda_gpus={gpus} {said}")
        return
    if ns.train is None or ns.gpus is None:
        parser.error("give TRAIN --gpus N [-- OPTIONS], or --cuda")
    if ns.gpus < 1:
        parser.error(f"--gpus must be >= 1, got {ns.gpus}")
    ranks, said = fitting_world_size(ns.train, run_args, ns.gpus)
    if ranks is None:
        sys.exit(f"{ns.train.parent.name}: {said}")
    print(f"world_size={ranks} {said}")


if __name__ == "__main__":
    main()
