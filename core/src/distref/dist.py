"""Distributed helpers shared by the multi-process impls (ddp, model_parallel, pipeline, ...).

The process group itself is created in each impl's train.py, where a reader sees it; these are the
parts that are the same everywhere and have a non-obvious reason behind them.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist


def torchrun_env() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) from the variables torchrun sets (1 process
    without torchrun)."""
    env = os.environ
    return (
        int(env.get("RANK", 0)),
        int(env.get("WORLD_SIZE", 1)),
        int(env.get("LOCAL_RANK", 0)),
        int(env.get("LOCAL_WORLD_SIZE", 1)),
    )


def restart_safe_store(timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store for this attempt of a torchrun job, keyed by its restart count.

    torchrun shares its rendezvous TCPStore with the workers. After `--max-restarts` restarts the
    workers, the new attempt's gloo full-mesh would read the *old* attempt's addresses from it and fail
    with `connectFullMesh ... Connection refused` (PyTorch #135712, #167288). A PrefixStore per attempt
    (TORCHELASTIC_RESTART_COUNT) keeps each attempt's keys apart; a restarted job then ends
    bit-identical to an uninterrupted one.
    """
    store = dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
        wait_for_workers=False,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"distref/attempt{attempt}", store)


def all_reduce_mean(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """In-place mean across ranks. (gloo has no ReduceOp.AVG, so SUM then divide.)"""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    tensor /= world_size
    return tensor


@contextlib.contextmanager
def destroy_process_group_on_exit() -> Iterator[None]:
    """Tear the process group down on every exit path (normal, exception, SystemExit), so NCCL/gloo
    never print 'process group was not destroyed' warnings or leave peers waiting."""
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
