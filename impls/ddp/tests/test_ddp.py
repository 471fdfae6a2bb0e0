"""impls/ddp proven equal to impls/single, converging on real MNIST, and surviving failures."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import (
    PARITY_TOLERANCE,
    ROOT,
    max_relative_difference,
    mnist_convergence_args,
    parity_args,
    torchrun,
    train_path,
)
from distref.checkpoint import latest_checkpoint

TRAIN = str(train_path("ddp"))
SYNTHETIC = ["--model", "lenet", "--dataset", "synthetic", "--optimizer", "sgd", "--lr", "0.01"]


def run_ddp(nproc: int, args: list[str], timeout: float = 300, extra_env: dict | None = None):
    result = torchrun(nproc, "ddp", args, timeout=timeout, env=extra_env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.parametrize("model", ["lenet", "gpt"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_parity_with_single(model, world_size, single_reference, tmp_path):
    final = tmp_path / "final.pt"
    run_ddp(
        world_size,
        [*parity_args(model), "--save-final", str(final)],
    )
    diff = max_relative_difference(torch.load(final, weights_only=True), single_reference(model))
    assert diff < PARITY_TOLERANCE, f"{model} at world {world_size}: max relative difference {diff:.2e}"


def test_two_ranks_are_bit_identical_to_single_with_the_same_split(single_reference, tmp_path):
    """2 ranks sum the same two half-batch gradients as single with --grad-accum 2, in the same order
    (the 1/2 scaling is exact in binary): not merely close, equal. (Over long runs that is what tells a
    bug from rounding: ddp ×2 vs plain single drifts to ~1e-1 in an epoch, ddp ×2 vs single
    --grad-accum 2 stays exactly 0.)"""
    final = tmp_path / "final.pt"
    run_ddp(2, [*parity_args("lenet"), "--save-final", str(final)])
    assert max_relative_difference(torch.load(final, weights_only=True), single_reference("lenet", 2)) == 0.0


@pytest.mark.parametrize(
    ("options", "grad_accum"),
    [
        ([], 2),  # accumulation with no_sync(), counted per rank
        (["--static-graph", "--grad-as-bucket-view", "--bucket-cap-mb", "0.005"], 1),  # many small buckets
        (["--activation-checkpointing"], 2),
    ],
    ids=["grad-accum", "static-graph-bucket-view-small-buckets", "activation-checkpointing"],
)
def test_parity_with_ddp_options(options, grad_accum, single_reference, tmp_path):
    final = tmp_path / "final.pt"
    run_ddp(
        2,
        [
            *parity_args("lenet"),
            "--grad-accum",
            str(grad_accum),
            *options,
            "--save-final",
            str(final),
        ],
    )
    diff = max_relative_difference(
        torch.load(final, weights_only=True), single_reference("lenet", grad_accum)
    )
    assert diff < PARITY_TOLERANCE, diff


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_compression_hooks_train_close_to_single(hook, single_reference, tmp_path):
    final = tmp_path / "final.pt"
    run_ddp(
        2,
        [
            *parity_args("lenet"),
            "--comm-hook",
            hook,
            "--save-final",
            str(final),
        ],
    )
    diff = max_relative_difference(torch.load(final, weights_only=True), single_reference("lenet"))
    assert 0 < diff < 0.05, diff  # compressed gradients: close, not equal


def test_powersgd_is_refused_on_cpu_before_training():
    result = torchrun(
        2, "ddp", ["--comm-hook", "powersgd", "--device", "cpu", "--dataset", "synthetic"], timeout=120
    )
    assert result.returncode != 0
    assert "--comm-hook powersgd is not reliable on gloo" in result.stderr
    assert result.stderr.count("powersgd is not reliable") == 1  # said once (rank 0), not once per rank


def test_batch_not_divisible_by_world_size_is_one_line(tmp_path):
    result = torchrun(4, "ddp", ["--dataset", "synthetic", "--global-batch-size", "6"], timeout=120)
    assert result.returncode != 0
    assert result.stderr.count("must be divisible by world size × --grad-accum = 4 × 1 = 4") == 1


def test_running_without_torchrun_says_how_to_start_it():
    env = {
        k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "MASTER_ADDR", "RANK", "WORLD_SIZE")
    }
    result = subprocess.run(
        [sys.executable, TRAIN, "--dataset", "synthetic"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "ddp: error: ddp runs one process per rank: start it with `torchrun --nproc-per-node N "
        "impls/ddp/train.py ...`"
    ]


@pytest.mark.slow
def test_lenet_reaches_98_5_percent_on_real_mnist(mnist_root, tmp_path):
    run_ddp(
        2,
        [
            *mnist_convergence_args(mnist_root),
            "--out",
            str(tmp_path),
        ],
        timeout=600,
    )
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["world_size"] == 2 and record["environment"]["backend"] == "gloo"
    assert record["final_accuracy"] >= 0.985, record["evals"]
    assert record["time_to_target_s"] is not None
    assert len(record["peak_memory_bytes"]) == 2 and min(record["peak_memory_bytes"]) > 0


# ---- failures: a killed rank ------------------------------------------------------------------------

ELASTIC = [
    *SYNTHETIC,
    "--steps",
    "400",
    "--global-batch-size",
    "32",
    "--checkpoint-every",
    "50",
    "--resume",
    "auto",
]


def worker_pid(marker: str, rank: int, deadline: float) -> int:
    """PID of the training process of `rank` whose command line contains `marker`."""
    while time.time() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            is_worker = "train.py" in cmdline and "torch.distributed.run" not in cmdline
            if is_worker and marker in cmdline and f"RANK={rank}".encode() in environ:
                return int(entry.name)
        time.sleep(0.1)
    raise TimeoutError(f"no rank {rank} worker for {marker}")


def start_and_kill_rank1(args: list[str], ckpt_dir: Path, max_restarts: int):
    """Start a 2-rank job, kill rank 1 with SIGKILL once a checkpoint exists; return (process, kill time)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        f"--max-restarts={max_restarts}",
        TRAIN,
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    deadline = time.time() + 120
    while latest_checkpoint(ckpt_dir) is None:
        assert proc.poll() is None and time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    os.kill(worker_pid(str(ckpt_dir), 1, deadline), signal.SIGKILL)
    return proc, time.time()


@pytest.mark.slow
def test_killed_rank_restarts_from_checkpoint_with_the_same_result(tmp_path):
    run_ddp(
        2, [*ELASTIC, "--checkpoint-dir", str(tmp_path / "straight"), "--save-final", str(tmp_path / "a.pt")]
    )
    ckpt_dir = tmp_path / "elastic"
    proc, _ = start_and_kill_rank1(
        [
            *ELASTIC,
            "--checkpoint-dir",
            str(ckpt_dir),
            "--save-final",
            str(tmp_path / "b.pt"),
            "--out",
            str(tmp_path / "out"),
        ],
        ckpt_dir,
        1,
    )
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert "ddp: resumed from" in stdout  # the second attempt continued from a checkpoint
    straight = torch.load(tmp_path / "a.pt", weights_only=True)
    restarted = torch.load(tmp_path / "b.pt", weights_only=True)
    assert max_relative_difference(restarted, straight) == 0.0  # bit-identical
    record = json.loads((tmp_path / "out" / "record.json").read_text())
    assert record["status"] == "completed" and [s["step"] for s in record["steps"]] == list(range(400))


@pytest.mark.slow
def test_killed_rank_without_restarts_ends_the_job_naming_it(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    proc, killed_at = start_and_kill_rank1([*ELASTIC, "--checkpoint-dir", str(ckpt_dir)], ckpt_dir, 0)
    _, stderr = proc.communicate(timeout=120)
    assert time.time() - killed_at < 60, "the job outlived its killed rank by a minute"
    assert proc.returncode != 0
    assert "rank      : 1" in stderr or "rank: 1" in stderr, stderr[-3000:]  # torchrun's failure report


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_node_rendezvous_matches_single_node(single_reference, tmp_path):
    port = free_port()
    args = [
        *parity_args("lenet"),
        "--save-final",
        str(tmp_path / "f.pt"),
    ]
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=distref-test",
                TRAIN,
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for _ in range(2)
    ]
    outputs = [agent.communicate(timeout=300) for agent in agents]
    for agent, (_, err) in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, err[-3000:]
    diff = max_relative_difference(
        torch.load(tmp_path / "f.pt", weights_only=True), single_reference("lenet")
    )
    assert diff < PARITY_TOLERANCE, diff
