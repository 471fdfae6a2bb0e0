"""The launch scripts users submit (launch/slurm/*.sbatch), run on a real SLURM cluster of two nodes on this
machine (distref.testing.slurm): `nox -s slurm` runs these, after installing Debian's packages where it
can; `nox -s tests` skips them. Every result is held to the parity oracle, as everywhere.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from distref.testing import (
    DATA_ROOT,
    PARITY_TOLERANCE,
    ROOT,
    max_relative_difference,
    parity_args,
)
from distref.testing.slurm import LocalSlurm, unavailable_reason

pytestmark = pytest.mark.slurm

SCRIPTS = {
    "srun": ROOT / "launch" / "slurm" / "srun.sbatch",
    "torchrun": ROOT / "launch" / "slurm" / "torchrun.sbatch",
}

# Each impl on its parity workload, one rank on each of the two nodes, and what it is compared with:
# single --grad-accum K (AdamW sums the same micro-batches: exact at 2 ranks) or plain single (SGD), and
# the largest difference allowed.
PARITY = {
    "ddp": ("lenet", [], 2, 0.0),
    "fsdp": ("lenet", [], 2, 0.0),
    "deepspeed_zero": ("lenet", ["--zero-stage", "2"], 2, 0.0),
    "pipeline": ("gpt", ["--schedule", "1f1b", "--microbatches", "4"], 1, PARITY_TOLERANCE),
    "tensor_parallel": ("gpt", [], 1, PARITY_TOLERANCE),
    "context_parallel": ("gpt", [], 1, PARITY_TOLERANCE),
    "expert_parallel": ("gpt", [], 1, PARITY_TOLERANCE),
}
# Options that shape the model, given to single's reference too: gpt's mixture of experts
MODEL_OPTIONS = {"expert_parallel": ["--experts", "4"]}
# Through which scripts: srun.sbatch for all, torchrun.sbatch for ddp in CI (the script is the same for
# every impl, and each job costs ~15 CPU-seconds of a .ci/run that must stay under 12 minutes);
# DISTREF_SLURM_ALL=1 runs every impl through both (docs/clusters.md: all ten).
JOBS = [
    (impl, style)
    for impl in PARITY
    for style in SCRIPTS
    if style == "srun" or impl == "ddp" or os.environ.get("DISTREF_SLURM_ALL") == "1"
]
# The fault runs: ddp on the synthetic set, long enough to be stopped between checkpoints.
FAULT_RUN = [
    *("--model", "lenet", "--dataset", "synthetic", "--optimizer", "adamw", "--lr", "1e-3"),
    *("--steps", "200", "--global-batch-size", "32"),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if reason := unavailable_reason():
        pytest.skip(reason)
    with LocalSlurm(tmp_path_factory.mktemp("slurm")) as local:
        yield local


def submit(
    cluster: LocalSlurm, style: str, impl: str, args: list[str], out: Path, *options: str, per_node: int = 1
) -> str:
    """sbatch one of the scripts for impls/<impl>/train.py over both nodes, `per_node` ranks on each; its
    job id."""
    return cluster.submit(
        [str(SCRIPTS[style]), str(ROOT / "impls" / impl / "train.py"), *args],
        "--nodes=2",
        f"--ntasks-per-node={per_node if style == 'srun' else 1}",
        f"--output={out}",
        *options,
        env={"NPROC_PER_NODE": str(per_node)},  # torchrun.sbatch: ranks per node
        cwd=ROOT,
    )


# Ranks per node: 1, and 2 for ddp through srun.sbatch (LOCAL_RANK and LOCAL_WORLD_SIZE from SLURM's
# "2(x2)" tasks per node).
PER_NODE = {("ddp", "srun"): 2}


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory):
    """Every impl's jobs (JOBS), submitted at once (SLURM runs them side by side, and beside the fault
    tests): {(impl, style): (job id, folder)}."""
    from distref.data.mnist import prepare_mnist

    prepare_mnist(DATA_ROOT)  # (lenet's parity runs read real MNIST: the nodes share this disk)
    folder = tmp_path_factory.mktemp("jobs")
    submitted = {}
    for impl, style in JOBS:
        model, options, _, _ = PARITY[impl]
        run = folder / f"{impl}-{style}"
        args = [*parity_args(model), *MODEL_OPTIONS.get(impl, []), *options]
        args += ["--out", str(run), "--save-final", str(run / "final.pt")]
        per_node = PER_NODE.get((impl, style), 1)
        submitted[impl, style] = (
            submit(cluster, style, impl, args, run.with_suffix(".out"), per_node=per_node),
            run,
        )
    return submitted


@pytest.fixture(scope="module")
def uninterrupted(single_train, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The fault runs' parameters had nothing stopped them: single --grad-accum 2, which 2 ranks of ddp
    equal bit for bit (the same two half-batch sums), run in this process while the jobs run."""
    path = tmp_path_factory.mktemp("uninterrupted") / "final.pt"
    single_train.main([*FAULT_RUN, "--grad-accum", "2", "--save-final", str(path)])
    return torch.load(path, weights_only=True)


def finished(cluster: LocalSlurm, job: tuple[str, Path]) -> Path:
    """Wait for the job; it must have COMPLETED. Its run folder."""
    job_id, run = job
    state = cluster.wait(job_id, timeout_s=240)
    output = run.with_suffix(".out").read_text() if run.with_suffix(".out").exists() else ""
    assert state == "COMPLETED", f"job {job_id}: {state}\n{output[-3000:]}"
    return run


def task_pid(job_id: str, rank: int, deadline: float) -> int:
    """The PID of task `rank` (SLURM_PROCID) of the job: its train.py process."""
    wanted = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_PROCID={rank}".encode()}
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            try:
                is_train = entry.name.isdigit() and b"train.py" in (entry / "cmdline").read_bytes()
                if is_train and wanted <= set((entry / "environ").read_bytes().split(b"\0")):
                    return int(entry.name)
            except OSError:
                continue
        time.sleep(0.05)
    raise TimeoutError(f"no task {rank} of job {job_id}")


def wait_for_checkpoint(folder: Path, job_id: str, cluster: LocalSlurm) -> None:
    from distref.training import latest_checkpoint

    deadline = time.monotonic() + 120
    while latest_checkpoint(folder) is None:
        assert cluster.state(job_id) in ("PENDING", "CONFIGURING", "RUNNING"), cluster.state(job_id)
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)


@pytest.mark.faults
def test_killed_task_fails_the_job_and_requeue_resumes_it_exactly(cluster, jobs, uninterrupted, tmp_path):
    """A task killed mid-run ends the job FAILED, its rank named; `scontrol requeue` reruns the same job,
    which resumes from the last checkpoint (--resume auto) and ends bit-identical to an uninterrupted run."""
    import json

    ckpt, out = tmp_path / "ckpt", tmp_path / "job.out"
    args = [*FAULT_RUN, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "20", "--resume", "auto"]
    args += ["--out", str(tmp_path / "run"), "--save-final", str(tmp_path / "final.pt")]
    job_id = submit(cluster, "srun", "ddp", args, out, "--requeue")
    wait_for_checkpoint(ckpt, job_id, cluster)
    os.kill(task_pid(job_id, 1, time.monotonic() + 60), signal.SIGKILL)
    assert cluster.wait(job_id) == "FAILED"
    assert "task 1: Killed" in out.read_text()  # srun names the rank: each task is one

    cluster.run(["scontrol", "requeue", job_id])
    cluster.wait_for_restart(job_id, restarts=1)  # (until then it still reads FAILED)
    # SLURM holds a requeued job back for 2 minutes (its BeginTime), for a real node's epilog to finish.
    # The test lets it start 2 s later: not at once, because slurmd refuses a job started within the
    # second its last run's credential was revoked ("Job credential revoked": the job then fails).
    cluster.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+2"])
    assert cluster.wait(job_id, timeout_s=240) == "COMPLETED", out.read_text()[-3000:]
    record = json.loads((tmp_path / "run" / "record.json").read_text())
    assert record["environment"]["scheduler"]["restart_count"] == 1
    assert record["resumes"], "the requeued job started over instead of resuming"
    resumed = torch.load(tmp_path / "final.pt", weights_only=True)
    assert max_relative_difference(resumed, uninterrupted) == 0.0


@pytest.mark.faults
def test_scancel_leaves_the_last_checkpoint_to_resume_from(cluster, jobs, uninterrupted, tmp_path):
    """scancel stops the job (CANCELLED) and leaves its last checkpoint intact: a resubmission with
    --resume auto continues from it and ends bit-identical to an uninterrupted run."""
    ckpt = tmp_path / "ckpt"
    args = [*FAULT_RUN, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "20", "--resume", "auto"]
    args += ["--save-final", str(tmp_path / "final.pt")]
    job_id = submit(cluster, "srun", "ddp", args, tmp_path / "first.out")
    wait_for_checkpoint(ckpt, job_id, cluster)
    cluster.run(["scancel", job_id])
    assert cluster.wait(job_id) == "CANCELLED"
    assert not (tmp_path / "final.pt").exists(), "the job finished before scancel: nothing was tested"

    again = submit(cluster, "srun", "ddp", args, tmp_path / "again.out")
    assert cluster.wait(again, timeout_s=240) == "COMPLETED", (tmp_path / "again.out").read_text()[-3000:]
    assert "resum" in (tmp_path / "again.out").read_text().lower()
    resumed = torch.load(tmp_path / "final.pt", weights_only=True)
    assert max_relative_difference(resumed, uninterrupted) == 0.0


@pytest.mark.faults
@pytest.mark.parametrize("style", list(SCRIPTS))
def test_more_tasks_than_the_batch_allows_fails_the_job_with_one_line(style, cluster, tmp_path):
    """Two ranks for a global batch of 1: the job FAILS, and its output says why in one line, with no
    traceback (srun: rank 0's line, the other rank refuses the same arguments silently; torchrun: the
    script checks the options before starting any torchrun)."""
    out = tmp_path / "job.out"
    args = ["--model", "lenet", "--dataset", "synthetic", "--steps", "2", "--global-batch-size", "1"]
    job_id = submit(cluster, style, "ddp", args, out)
    assert cluster.wait(job_id) == "FAILED"
    output = out.read_text()
    errors = [line for line in output.splitlines() if "error: --global" in line]
    assert errors == [
        "ddp/train.py: error: --global-batch-size 1 must be divisible by world size × --grad-accum = 2 × 1 = 2"
    ], output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    if style == "torchrun":  # checked in the batch script (--check-ranks): no torchrun started
        assert "torchrun" not in output and "ChildFailedError" not in output, output[-3000:]


# Last: while the fault tests above ran, SLURM ran these jobs beside them.
@pytest.mark.parametrize(("impl", "style"), JOBS)
def test_each_impl_across_two_nodes_equals_single(
    impl, style, cluster, jobs, single_reference, record_property
):
    """sbatch <style>.sbatch impls/<impl>/train.py over two nodes ends with single's parameters, and the
    record names the job and each rank's node."""
    import json

    model, _, grad_accum, tolerance = PARITY[impl]
    per_node = PER_NODE.get((impl, style), 1)
    if per_node > 1:  # AdamW: single --grad-accum world sums the same micro-batches, in another order
        grad_accum, tolerance = grad_accum * per_node, PARITY_TOLERANCE
    run = finished(cluster, jobs[impl, style])
    final = torch.load(run / "final.pt", weights_only=True)
    diff = max_relative_difference(final, single_reference(model, grad_accum, MODEL_OPTIONS.get(impl, [])))
    record = json.loads((run / "record.json").read_text())
    nodes = ", ".join(record["environment"]["rank_nodes"])
    reference = f"single --grad-accum {grad_accum}" if grad_accum > 1 else "single"
    row = f"| {impl} | {style}.sbatch | {jobs[impl, style][0]} | COMPLETED | {nodes} | {diff:.1e} ({reference}) |"
    record_property("slurm_job", row)
    assert diff <= tolerance, f"{impl} by {style}: {diff:.2e} from single --grad-accum {grad_accum}"

    job_id = jobs[impl, style][0]
    scheduler = record["environment"]["scheduler"]
    assert scheduler["job_id"] == job_id and scheduler["nodelist"] == "n[1-2]"
    assert scheduler["launched_by"] == {"srun": "srun", "torchrun": "srun torchrun"}[style]
    assert record["world_size"] == 2 * per_node
    assert sorted(record["environment"]["rank_nodes"]) == ["n1"] * per_node + ["n2"] * per_node
    if style == "srun":  # rank 0's node, n1, at its own address (n2 is at 127.0.0.2)
        assert scheduler["master_addr"] == "127.0.0.1" and record["environment"]["rank_nodes"][0] == "n1"
