"""Distributed helpers shared by the multi-process impls (ddp, model_parallel, pipeline, ...).

The process group itself is created in each impl's train.py, where a reader sees it; these are the
parts that are the same everywhere and have a non-obvious reason behind them.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from distref.config import RunConfig

SHUTDOWN_TIMEOUT_S = 5


def launch_ranks(train_file: str, argv: Sequence[str] | None, cfg: RunConfig, impl: str) -> NoReturn:
    """Run `train_file` as `--nproc-per-node` ranks on this machine through torch.distributed.run (the
    module behind torchrun), then exit: `python train.py --nproc-per-node 2 ...` is exactly
    `torchrun --standalone --nproc-per-node 2 train.py ...`. The caller has validated the arguments, so
    bad input never starts a rank. Exit code 0, or 1 with one line naming the first rank that failed
    (each rank's own error is printed above it); 2 where that rank exited 2, refusing something only the
    ranks read (a checkpoint of another run, a stage file not written for its index)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from distref.config import fail
    from distref.data import DataError, prepare_dataset_files
    from distref.record import process_started_at

    try:  # here, once: a missing or altered dataset is one line, before any rank or process group
        prepare_dataset_files(cfg)
    except DataError as exc:
        fail(str(exc), impl)
    nproc, restarts = cfg.extra["nproc_per_node"], cfg.extra["max_restarts"]
    rank_argv = without_launch_options(sys.argv[1:] if argv is None else list(argv))
    torchrun_argv = [
        # Not --standalone: it rendezvouses at "localhost:0" and advertises the workers' store at this
        # machine's FQDN. (torch's TCPStore listens on every interface whatever the address: README.)
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0",
        "--local-addr=127.0.0.1",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={restarts}",
        # Seconds between SIGTERM and SIGKILL when the job is stopped (torchrun's default 30): a hung
        # rank never acts on SIGTERM. Every write here is atomic, so a shorter wait loses nothing.
        # torch 2.13 honours it on a signal (Ctrl-C), not yet after a rank failed (pytorch #192815).
        f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}",
    ]
    print(f"{impl}: starting {nproc} ranks: torchrun {' '.join(torchrun_argv)} {train_file} ...", flush=True)
    # The ranks' records count start-up from this process's start, not their own (distref.record.run_start);
    # torch.distributed.run passes its environment on to them. Put back after: the caller may go on (tests).
    previous = os.environ.get("DISTREF_LAUNCHED_AT")
    os.environ["DISTREF_LAUNCHED_AT"] = str(process_started_at())
    try:
        run(get_args_parser().parse_args([*torchrun_argv, train_file, *rank_argv]))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        sys.stderr.write(f"{impl}: rank {rank} failed ({how}); its error is above\n")
        sys.exit(2 if failure.exitcode == 2 else 1)  # 2: what the ranks refused (a checkpoint, data)
    finally:
        restore_environment("DISTREF_LAUNCHED_AT", previous)
    sys.exit(0)


def restore_environment(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def without_launch_options(argv: list[str]) -> list[str]:
    """`argv` less --nproc-per-node/--max-restarts (and their values): the ranks get the run's options."""
    kept, skip_value = [], False
    for token in argv:
        if skip_value:
            skip_value = False
        elif token in ("--nproc-per-node", "--max-restarts"):
            skip_value = True
        elif not token.startswith(("--nproc-per-node=", "--max-restarts=")):
            kept.append(token)
    return kept


def torchrun_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the variables torchrun sets."""
    env = os.environ
    return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])


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
SILENT_RANK_WAIT_S = 3.0  # how long ranks that timed out wait to hear from each other


def is_collective_timeout(exc: BaseException) -> bool:
    """gloo: `Timed out waiting 30000ms for recv operation to complete`; NCCL's watchdog: `... timed out`."""
    return isinstance(exc, RuntimeError) and "timed out" in str(exc).lower()


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


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)
_HEADER = 8  # int64s: dtype index, number of dims, up to 6 sizes


def send_tensor(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> int:
    """Send a tensor whose shape and dtype the receiver cannot know (batches differ in size, autocast
    changes the dtype): a fixed-size header first, then the data. `dst` is a global rank. Returns the
    bytes sent."""
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
    dist.send(header.to(tensor.device), dst, group=group)
    dist.send(tensor.contiguous(), dst, group=group)
    return header.numel() * header.element_size() + tensor.numel() * tensor.element_size()


def recv_tensor(src: int, device: torch.device, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Receive what `send_tensor` sent from global rank `src`, on `device`."""
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    dtype, dims = _DTYPES[int(header[0])], int(header[1])
    tensor = torch.empty(header[2 : 2 + dims].tolist(), dtype=dtype, device=device)
    dist.recv(tensor, src, group=group)
    return tensor


def gather_to_rank0(obj: Any, world_size: int) -> list:
    """Every rank's picklable `obj` on rank 0, as a list by rank (elsewhere empty). One process: [obj].
    Tensors in it travel as CPU tensors: a pickled CUDA tensor would be unpickled on rank 0 onto the
    sender's GPU index (rank 1's optimizer state onto cuda:1, from rank 0's process)."""
    if world_size == 1:
        return [obj]
    obj = torch.utils._pytree.tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, obj)
    gathered = [None] * world_size if dist.get_rank() == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered or []


def all_reduce_mean(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """In-place mean across ranks. (gloo has no ReduceOp.AVG, so SUM then divide.)"""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    tensor /= world_size
    return tensor


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
    """
    try:
        yield
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
        gc.collect()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
