"""launch/kubernetes/*.yaml, the PyTorchJob manifests: each pod's command started here with exactly the
environment Kubeflow's training operator gives that pod, and the result held to the parity oracle. No
Kubernetes cluster runs here: what is tested is the contract between the operator and train.py.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from distref.testing import PARITY_TOLERANCE, ROOT, max_relative_difference, parity_args
from distref.testing.slurm import free_port

MANIFESTS = ROOT / "launch" / "kubernetes"


def operator_environment(job: dict, replica_type: str, index: int) -> dict[str, str]:
    """What the training operator (kubeflow.org/v1, pkg/controller.v1/pytorch: envvar.go, master.go) sets
    in the `pytorch` container of pod `index` of `replica_type`: MASTER_ADDR and MASTER_PORT (the master
    pod's service, port 23456 unless the container names one "pytorchjob-port"), the same as PET_MASTER_*,
    WORLD_SIZE = pods × nprocPerNode ("auto" or none counts 1), RANK = PET_NODE_RANK = the pod's index (a
    worker's + 1, after the master), PET_NPROC_PER_NODE, PET_NNODES = pods, PYTHONUNBUFFERED=0."""
    spec = job["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    pods = sum(r["replicas"] for r in replicas.values())
    nproc = spec.get("nprocPerNode", "auto")
    rank = index + (1 if replica_type == "Worker" else 0)
    master = f"{job['metadata']['name']}-master-0"
    return {
        "PYTHONUNBUFFERED": "0",
        "MASTER_ADDR": master,
        "MASTER_PORT": "23456",
        "PET_MASTER_ADDR": master,
        "PET_MASTER_PORT": "23456",
        "WORLD_SIZE": str(pods * (int(nproc) if nproc.isdigit() else 1)),
        "RANK": str(rank),
        "PET_NPROC_PER_NODE": nproc,
        "PET_NODE_RANK": str(rank),
        "PET_NNODES": str(pods),
    }


def start_pods(job: dict, run_args: list[str], tmp_path) -> list[subprocess.Popen]:
    """Every pod of the job as a process here: its container's command with `run_args` for its args (the
    CPU workload instead of the manifest's GPU run), and the operator's environment, the master's service
    name replaced by 127.0.0.1 and its port by a free one (no cluster DNS here)."""
    port = str(free_port())
    processes = []
    for replica_type, replica in job["spec"]["pytorchReplicaSpecs"].items():
        container = next(c for c in replica["template"]["spec"]["containers"] if c["name"] == "pytorch")
        for index in range(replica["replicas"]):
            # the container's own variables, then the operator's (appended after them: theirs win)
            env = {e["name"]: e["value"] for e in container.get("env", [])}
            env.update(operator_environment(job, replica_type, index))
            for key in ("MASTER_ADDR", "PET_MASTER_ADDR"):
                env[key] = "127.0.0.1"
            for key in ("MASTER_PORT", "PET_MASTER_PORT"):
                env[key] = port
            program, *rest = container["command"]
            launcher = (
                [sys.executable] if program == "python" else [sys.executable, "-m", "torch.distributed.run"]
            )
            outside = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
            processes.append(
                subprocess.Popen(
                    [*launcher, *rest, *run_args],
                    cwd=ROOT,  # the image's workingDir, /workspace: the project
                    env={**outside, "OMP_NUM_THREADS": "1", **env},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
    return processes


def finish(processes: list[subprocess.Popen]) -> list[str]:
    """Each pod's output, once all have exited 0."""
    try:
        outputs = [p.communicate(timeout=120)[0] for p in processes]
    finally:
        for p in processes:
            p.kill()
    for p, output in zip(processes, outputs, strict=True):
        assert p.returncode == 0, output[-3000:]
    return outputs


@pytest.mark.parametrize(
    ("manifest", "ranks"),
    [("ddp.yaml", 2), ("fsdp.yaml", 4)],  # a pod per rank; torchrun in each pod, 2 ranks a pod here
)
def test_pytorchjob_pods_train_as_single_does(manifest, ranks, single_reference, tmp_path):
    """The manifest's two pods, with the operator's variables, train lenet's parity workload as one world
    to single's parameters (--grad-accum = ranks: the same micro-batch sums), and the record counts every
    rank. With torchrun in the pods, the pod's own RANK (its index) and WORLD_SIZE (pods × nprocPerNode)
    are torchrun's to replace for each rank it starts."""
    job = yaml.safe_load((MANIFESTS / manifest).read_text())
    assert job["kind"] == "PyTorchJob" and job["apiVersion"] == "kubeflow.org/v1"
    if "nprocPerNode" in job["spec"]:  # 8 GPUs a pod in the manifest; 2 CPU ranks a pod here
        job = copy.deepcopy(job)
        job["spec"]["nprocPerNode"] = "2"
    args = [*parity_args("lenet"), "--out", str(tmp_path / "run"), "--save-final", str(tmp_path / "final.pt")]
    outputs = finish(start_pods(job, args, tmp_path))
    # One world, not a world per pod (each would reach the same parameters): one summary, from rank 0's
    # pod, and no pod started ranks of its own.
    assert sum(" completed | " in output for output in outputs) == 1, outputs
    assert not any(": starting " in output for output in outputs), outputs

    final = torch.load(tmp_path / "final.pt", weights_only=True)
    diff = max_relative_difference(final, single_reference("lenet", ranks))
    assert diff == 0.0 if ranks == 2 else diff < PARITY_TOLERANCE, diff  # 4 ranks add in another order
    record = json.loads((tmp_path / "run" / "record.json").read_text())
    assert record["world_size"] == ranks and record["status"] == "completed"


def test_the_manifests_run_the_impl_they_are_named_for():
    """Each manifest's pods all run its impl's train.py on CUDA, and their args are train.py's options."""
    from distref.impl_folders import parse_as

    for manifest in MANIFESTS.glob("*.yaml"):
        job = yaml.safe_load(manifest.read_text())
        impl = manifest.stem
        for replica in job["spec"]["pytorchReplicaSpecs"].values():
            container = replica["template"]["spec"]["containers"][0]
            assert container["name"] == "pytorch"  # where the operator puts its variables
            assert container["command"][-1] == f"impls/{impl}/train.py"
            assert "--device=cuda" in container["args"]
            cfg = parse_as(ROOT / "impls" / impl / "train.py", [*container["args"], "--device", "cpu"], 2)
            assert cfg.resume == "auto" and cfg.checkpoint_dir
