"""Starting the ranks: `python train.py` checks the arguments, then starts them through torch's own
launcher (torch.distributed.run), as torchrun would; each rank reads its place from torchrun's environment.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from distref.config import RunConfig

SHUTDOWN_TIMEOUT_S = 5
# The logger of torchrun's rank supervision: the lines it prints when a rank fails and the others are stopped.
TORCH_SUPERVISION_LOGGER = "torch.distributed.elastic.multiprocessing.api"


def launch_ranks(train_file: str, argv: Sequence[str] | None, cfg: RunConfig, impl: str) -> NoReturn:
    """Run `train_file` as `--nproc-per-node` ranks on this machine through torch.distributed.run (the
    module behind torchrun), then exit: `python train.py --nproc-per-node 2 ...` is exactly
    `torchrun --standalone --nproc-per-node 2 train.py ...`. The caller has validated the arguments, so
    bad input never starts a rank. Exit code 0, or 1 with one line naming the first rank that failed
    (each rank's own error is printed above it); 2 where that rank exited 2, refusing something only the
    ranks read (a checkpoint of another run, a stage file not written for its index): then only the rank's
    own line is shown, not torchrun's report of the failure."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from distref.config import fail
    from distref.data.datasets import forget_own_datasets, prepare_dataset_files
    from distref.data.tensors import DataError
    from distref.record import process_started_at

    try:  # here, once: a missing or altered dataset is one line, before any rank or process group
        prepare_dataset_files(cfg)
    except DataError as exc:
        fail(str(exc), impl)
    # A dataset of yours was read by the checks: each rank reads its own (and the ranks check they read
    # the same: distref.distributed.agreement), so this process, which only waits, keeps no copy.
    forget_own_datasets()
    nproc, restarts = cfg.launch.nproc_per_node, cfg.launch.max_restarts
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
        # torchrun gained the option in torch 2.12: on an older one the default applies.
        *only_known(get_args_parser(), f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}"),
    ]
    print(f"{impl}: starting {nproc} ranks: torchrun {' '.join(torchrun_argv)} {train_file} ...", flush=True)
    # The ranks' records count start-up from this process's start, not their own (distref.record.run_start);
    # torch.distributed.run passes its environment on to them. Put back after: the caller may go on (tests).
    previous = {name: os.environ.get(name) for name in ("DISTREF_LAUNCHED_AT", "OMP_NUM_THREADS")}
    os.environ["DISTREF_LAUNCHED_AT"] = str(process_started_at())
    # One thread per rank, what torchrun sets anyway (distref.training.device.configure_cpu_threads), said
    # here so that torchrun does not print its banner about it; a value of yours stands.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # torchrun's own lines on a failed rank ("failed (exitcode: 2)", "Sending process … SIGTERM") are held
    # back: shown after a failure, but not under a rank's one-line refusal (exit code 2).
    held = HeldBackLogs(hold=not restarts)
    try:
        with held:
            run(get_args_parser().parse_args([*torchrun_argv, train_file, *rank_argv]))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode == 2:  # what the ranks refused (a checkpoint, data): rank 0's line says it all
            sys.exit(2)
        held.replay()
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        sys.stderr.write(f"{impl}: rank {rank} failed ({how}); its error is above\n")
        sys.exit(1)
    finally:
        for name, value in previous.items():
            restore_environment(name, value)
    sys.exit(0)


class HeldBackLogs(contextlib.AbstractContextManager):
    """Inside, the warnings and errors of torchrun's process supervision (TORCH_SUPERVISION_LOGGER: how it
    stops and reports failed ranks) are kept, not printed; `replay()` prints them. (With --max-restarts
    they are not held: each restart's reason matters when it happens.)"""

    def __init__(self, hold: bool = True) -> None:
        self.hold = hold
        self.held: list[logging.LogRecord] = []
        self.logger = logging.getLogger(TORCH_SUPERVISION_LOGGER)

    def filter(self, record: logging.LogRecord) -> bool:
        if self.hold:
            self.held.append(record)
        return not self.hold

    def __enter__(self) -> HeldBackLogs:
        self.logger.addFilter(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeFilter(self)

    def replay(self) -> None:
        for record in self.held:
            self.logger.handle(record)
        self.held = []


def only_known(torchrun_parser: argparse.ArgumentParser, *options: str) -> list[str]:
    """Those of `options` this torch's torchrun has: its own parser is asked (options come and go with
    torch's versions; their numbers say nothing certain)."""
    return [o for o in options if not torchrun_parser.parse_known_args([o, "train.py"])[1]]


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
