"""The process group's life: its start (one device per rank, a store that survives restarts, --timeout),
naming a rank that stopped answering, and a teardown that cannot hang: the same in every multi-process
impl, each with a non-obvious reason behind it.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import sys
import time
from collections.abc import Iterator
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from distref.config import RunConfig, first_line
from distref.distributed.launch import torchrun_env
from distref.training.device import pick_device
from distref.training.traffic import TRAFFIC


def restart_safe_store(timeout: datetime.timedelta) -> dist.Store:
    """The store of torch's own `env://` rendezvous, with this torchrun attempt's keys kept apart.

    torchrun shares its rendezvous TCPStore with the workers. After `--max-restarts` restarts the
    workers, the new attempt's gloo full-mesh would read the *old* attempt's addresses from it and fail
    with `connectFullMesh ... Connection refused` (PyTorch #135712, #167288). A PrefixStore per attempt
    (TORCHELASTIC_RESTART_COUNT) keeps each attempt's keys apart; a restarted job then ends
    bit-identical to an uninterrupted one. The store itself comes from torch's env:// handler (not a
    hand-made TCPStore client: one of those made ranks abort at exit, `terminate called without an
    active exception`, in about 1 run in 5 with 4 ranks on 2 cores).
    """
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    # Kept for naming the ranks a timed-out collective waited for (destroy_process_group_on_exit).
    _timeouts["store"] = dist.PrefixStore(f"timed_out/attempt{attempt}", store)
    _timeouts["seconds"] = timeout.total_seconds()
    return dist.PrefixStore(f"default_pg/attempt{attempt}", store)


_timeouts: dict[str, Any] = {}


def start_process_group(cfg: RunConfig) -> tuple[int, int, torch.device, str]:
    """This rank's place and device, and the process group over every rank: (rank, world size, device,
    backend). One device per rank (its LOCAL_RANK's GPU, or the CPU), NCCL on CUDA and gloo on the CPU; a
    collective or send/recv that waits longer than --timeout fails instead of hanging; the store is
    torchrun's, one per restart attempt (`restart_safe_store`); on CUDA `device_id` binds the group to
    this rank's GPU (NCCL makes its communicator at once; barrier() uses that GPU, not a guess)."""
    rank, world_size, local_rank = torchrun_env()
    device = pick_device(cfg.device, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=cfg.timeout)
    store = restart_safe_store(timeout)
    # Each rank says it arrived: where the group cannot form within --timeout (a rank slow to start,
    # reading its data before it gets here, or never started), the ranks that waited name the others.
    arrived = dist.PrefixStore("arrived", store)
    arrived.set(str(rank), "")
    try:
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
    except dist.DistStoreError as exc:
        absent = [r for r in range(world_size) if not arrived.check([str(r)])]
        raise GroupNotFormed(
            f"rank {rank} waited {cfg.timeout:g} s (--timeout) for rank {', '.join(map(str, absent)) or '?'} "
            f"to start and gave up: a rank slow to start (reading its data?) needs a larger --timeout "
            f"({first_line(exc)})"
        ) from None
    TRAFFIC.begin_run()  # count the communication of set-up, then of one step (distref.training.traffic)
    return rank, world_size, device, backend


class GroupNotFormed(Exception):
    """Not every rank joined the process group within --timeout (said in one line on exit)."""


SILENT_RANK_WAIT_S = 3.0  # how long ranks that timed out wait to hear from each other


def is_collective_timeout(exc: BaseException) -> bool:
    """gloo: `Timed out waiting 30000ms for recv operation to complete`, or `Application timeout caused pair
    closure` where an earlier operation on the pair timed out (an async all-reduce of DDP's comm hook);
    NCCL's watchdog: `... timed out`."""
    said = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("timed out" in said or "application timeout" in said)


def silent_ranks(store: dist.Store, rank: int, world_size: int, wait_s: float) -> list[int]:
    """After a collective timed out here: the ranks that did not time out too, i.e. never joined it.

    Every rank whose collective times out says so in the store (its own TCP connection: it still works
    when the process group does not); a rank that is stopped, hung or stuck elsewhere never does. The
    ranks that waited give each other `wait_s` to report (they time out nearly together)."""
    store.set(str(rank), "timed out")
    deadline = time.monotonic() + wait_s
    while True:
        missing = [r for r in range(world_size) if not store.check([str(r)])]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.1)


def exit_without_interpreter_teardown() -> NoReturn:
    """End a rank that finished successfully without running Python's interpreter shutdown.

    Even after `destroy_process_group`, gloo's worker threads can outlive it into `Py_FinalizeEx`; one
    that then needs the GIL is force-unwound through a C++ `noexcept` frame and the rank aborts
    (SIGABRT), failing a job whose results are already saved. Everything is written (atomically) and
    the process group is gone by now, so flush and leave with exit code 0. Errors never come here:
    they propagate normally, so torchrun still reports them.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def destroy_process_group_on_exit(prog: str = "train.py") -> Iterator[None]:
    """Tear the process group down on every exit path (normal, exception, SystemExit), and turn a
    collective that timed out (--timeout) into one line naming the ranks it waited for.

    A collective timeout alone says `Timed out waiting 30000ms for recv operation` and names neither the
    silent rank nor the step; `silent_ranks` finds the ranks that never joined, and the lowest rank that
    waited says which (exit code 1; the backend's own message is kept at the end of the line).

    Collect garbage first, so objects in reference cycles that use the process group (DDP's) go while
    Python is fully alive. Seen here (torch 2.13, gloo, 4 ranks on 2 cores, ~15% of runs): a rank
    aborting at exit with `terminate called without an active exception`, its core dump showing
    `ProcessGroupGloo::runLoop` threads alive inside `Py_FinalizeEx`. Collecting first cut that to ~4%;
    `exit_without_interpreter_teardown` removes the rest (0 in 25 runs under extra CPU load).

    What exists when the run begins (the modules train.py imported: torch's, hundreds of thousands of
    objects) lives as long as the process, so it is frozen out of every collection (`gc.freeze`): that
    last one, and Python's own during the run, then traverse only the run's objects. Traversing it all
    took 0.15 s of CPU per rank at exit here, 0.18 s in a rank forked from a process that imported it
    (the fork server of the tests: each object the collector touched was copied out of shared pages).
    Only where nothing was frozen yet (a process's run, not one entered again or inside a test process,
    which froze its own imports): freezing keeps whatever garbage exists at that moment for good.
    """
    if not gc.get_freeze_count():
        gc.freeze()
    try:
        yield
    except GroupNotFormed as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        raise SystemExit(1) from None
    except Exception as exc:
        if not (is_collective_timeout(exc) and "store" in _timeouts and dist.is_initialized()):
            raise
        rank, world_size = dist.get_rank(), dist.get_world_size()
        missing = silent_ranks(_timeouts["store"], rank, world_size, SILENT_RANK_WAIT_S)
        waited = [r for r in range(world_size) if r not in missing]
        if missing and rank == min(waited):
            first_line = str(exc).strip().splitlines()[0][:200]
            sys.stderr.write(
                f"{prog}: error: rank {', '.join(map(str, missing))} stopped responding: a collective of "
                f"rank {', '.join(map(str, waited))} waited for it {_timeouts['seconds']:g} s (--timeout) "
                f"and gave up ({first_line})\n"
            )
        raise SystemExit(1) from exc
    finally:
        TRAFFIC.run_ends()  # (a run that ended before its loop, bad input, was counting its set-up)
        gc.collect()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
