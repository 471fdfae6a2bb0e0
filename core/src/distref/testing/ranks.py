"""Run a train.py as N ranks without starting N Python interpreters: for test suites.

`torchrun --nproc-per-node 2 train.py ...` starts three interpreters (its agent and two ranks), and
each spends ~2 s of CPU importing torch before it does anything. A test suite that runs hundreds of
short jobs spends most of its time there. `run_ranks` starts the ranks as forks of a fork server that
has imported torch and distref once (what PyTorch's own distributed tests do with `fork`), and gives
each rank what torchrun gives it: the same environment variables, a TCPStore hosted by the launching
process (as torchrun's agent hosts it), the rank's output on the job's stdout/stderr, `train.py` run
as `__main__`, and the whole job stopped when one rank fails. It is torchrun without its elastic agent:
no restarts and no failure report, so tests of those (killed ranks, launch options) use torchrun itself.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence

import torch.distributed as dist
import torch.multiprocessing
from torch.multiprocessing.spawn import ProcessException

from distref.testing.timing import note_started_processes

# Imported once by the fork server, so that no rank imports them again.
PRELOADED = [
    "torch",
    "torch._dynamo",  # (a second of it: torch.optim's first param group imports it, compiled or not)
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
    "torch.distributed.algorithms.ddp_comm_hooks",
    # distref's own modules (a name that does not import is skipped without a word by the fork server:
    # these once named distref.testing.* modules that do not exist, and every rank imported distref anew)
    "distref.cli",
    "distref.config",
    "distref.cost",
    "distref.data",
    "distref.distributed",
    "distref.models",
    "distref.record",
    "distref.training",
    "distref.training.checkpoint",
    # scikit-learn's digits (`--dataset digits`, the BatchNorm tests' set): 0.9 s of CPU a rank
    "sklearn.datasets",
    # Last: the data sets the suite trains on, made once here (its import makes them)
    "distref.testing.preloaded_data",
]
# DeepSpeed's, where no GPU is visible (the CPU suite; conftest.py hides them): 1.2 s of CPU a rank of
# deepspeed_zero, most of it the Muon optimizer its ZeRO check imports on every engine's start (it imports
# torch._inductor). DeepSpeed picks its accelerator as it is imported: on a GPU machine the fork server
# must not look for one before it forks the ranks.
PRELOADED_WITHOUT_GPUS = ["deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer"]


def preloaded() -> list[str]:
    """What the fork server imports: PRELOADED, and PRELOADED_WITHOUT_GPUS where no GPU is visible."""
    return PRELOADED + (PRELOADED_WITHOUT_GPUS if os.environ.get("CUDA_VISIBLE_DEVICES") == "" else [])


def _rank_main(
    local_rank: int,
    train_file: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    out: str,
    err: str,
    rank_variables: bool = True,
    module: bool = False,
) -> None:
    """One rank, in a fresh fork of the fork server: `python train_file *argv` as torchrun would start it
    (without `rank_variables`: as `python` would; `module`: `python -m train_file`)."""
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):  # every rank appends to the job's two files, as under torchrun
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)
    # (line-buffered: a rank's line reaches the job's file whole, beside the other ranks'; a script that
    # ends with its own os._exit loses a last line without its newline, which `python -u` would keep)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own stdout)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    if rank_variables:
        os.environ.update({"RANK": str(local_rank), "LOCAL_RANK": str(local_rank)})
        os.environ.update({"GROUP_RANK": "0", "ROLE_RANK": str(local_rank)})
    sys.argv = [train_file, *argv]
    # A fresh interpreter seeds numpy's global generator from the OS; a fork inherits the fork server's
    # (numpy is preloaded with scikit-learn), and every rank would draw the same "unseeded" numbers,
    # hiding a dataset function of yours that is not seeded (Python's `random` reseeds itself at fork).
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    code = 0
    try:
        # what `python FILE` and `python -m MODULE` put first on sys.path: the file's folder (the cwd),
        # then PYTHONPATH's folders
        first = os.getcwd() if module else os.path.dirname(os.path.abspath(train_file))
        sys.path[0:0] = [first, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        if module:
            runpy.run_module(train_file, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(train_file, run_name="__main__")
    except SystemExit as exc:  # what the interpreter does with it
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(ValueError):  # (a script may close its stdout, as `json.tool` does)
            stream.flush()
    os._exit(
        code
    )  # a train.py ends its ranks this way too (distref.distributed.exit_without_interpreter_teardown)


class RankJob:
    """Ranks `start_ranks` started and has not waited for: their pids (rank i's is `pids[i]`), to stop or
    kill one as a fault test does, and `wait`, which returns what `run_ranks` returns."""

    def __init__(
        self, context, store, tmp: tempfile.TemporaryDirectory, argv: list[str], plain: bool = False
    ):
        self._context, self._store, self._tmp, self._argv = context, store, tmp, argv
        self._plain = plain  # one process as `python` runs it: its own exit code, no launcher's report
        self._result: subprocess.CompletedProcess | None = None
        self.pids: list[int] = [process.pid for process in context.processes]

    def running(self) -> bool:
        """Whether a rank of the job is still alive."""
        return any(process.is_alive() for process in self._context.processes)

    def stderr(self) -> str:
        """What the ranks have written to stderr so far (all of it, once `wait` has returned)."""
        if self._result is not None:
            return self._result.stderr
        with open(os.path.join(self._tmp.name, "stderr")) as stderr:
            return stderr.read()

    def kill(self) -> None:
        """SIGKILL every rank still alive and wait for them (a test that gives up on its job)."""
        for process in self._context.processes:
            process.kill()
            process.join()

    def wait(self, timeout: float = 300) -> subprocess.CompletedProcess:
        """Wait for every rank to end: exit code 0 when each succeeded, else 1, the others stopped (SIGTERM,
        then SIGKILL 30 s later, as torchrun's agent does), and the failure named on stderr, as torchrun's
        report names it. Raises subprocess.TimeoutExpired (the ranks killed) after `timeout` seconds.
        Called again, it returns the same result (after a timeout: exit code -9, what the ranks wrote)."""
        if self._result is not None:
            return self._result
        deadline, returncode, failure = time.monotonic() + timeout, 0, ""
        try:
            while not self._context.join(max(deadline - time.monotonic(), 0)):  # True once all have ended
                if time.monotonic() >= deadline:
                    self.kill()
                    self._finish(-signal.SIGKILL, f"the job ran past its timeout ({timeout:.0f} s): killed\n")
                    raise subprocess.TimeoutExpired(
                        self._argv, timeout, self._result.stdout, self._result.stderr
                    )
        except ProcessException as exc:  # (exited, or raised before train.py ran)
            if self._plain:
                returncode = getattr(exc, "exit_code", None) or 1
            else:
                returncode = 1  # a rank failed: torch has stopped the others, as torchrun's agent does
                failure = f"run_ranks: the job failed: rank {exc.error_index} ({exc})\n"
        self._finish(returncode, failure)
        return self._result

    def _finish(self, returncode: int, failure: str) -> None:
        """The job's result, from what its ranks wrote (undecodable bytes replaced, line endings kept)."""
        out, err = (os.path.join(self._tmp.name, name) for name in ("stdout", "stderr"))
        with (
            open(out, errors="replace", newline="") as stdout,
            open(err, errors="replace", newline="") as stderr,
        ):
            self._result = subprocess.CompletedProcess(
                self._argv, returncode, stdout.read(), stderr.read() + failure
            )
        self._close()

    def _close(self) -> None:
        self._store = None  # the ranks are gone: close the store's server
        self._tmp.cleanup()


def _fork(
    nproc: int,
    target: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str | os.PathLike | None,
    store=None,
    module: bool = False,
) -> RankJob:
    """`nproc` processes forked from the fork server, each running `target argv` (`_rank_main`: as a rank
    where there is a `store`, else as `python` runs it), their output in the job's two files."""
    note_started_processes()
    # (the preload takes effect when this process starts its fork server)
    multiprocessing.get_context("forkserver").set_forkserver_preload(preloaded())
    tmp = tempfile.TemporaryDirectory()
    out, err = os.path.join(tmp.name, "stdout"), os.path.join(tmp.name, "stderr")
    open(out, "w").close()
    open(err, "w").close()
    ranks = store is not None
    context = torch.multiprocessing.start_processes(
        _rank_main,
        args=(target, list(argv), dict(env), os.fspath(cwd or os.getcwd()), out, err, ranks, module),
        nprocs=nproc,
        join=False,
        start_method="forkserver",
    )
    return RankJob(context, store, tmp, [target, *argv], plain=not ranks)


def start_ranks(
    nproc: int,
    train_file: str,
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    restart_count: int = 0,
) -> RankJob:
    """Start `train_file argv` as `nproc` ranks on this machine, as `torchrun --standalone --nproc-per-node
    nproc` would start them (its attempt `restart_count`: 1 is what `--max-restarts` starts after a failed
    first attempt), and return without waiting for them."""
    store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
    job_env = {
        **(os.environ if env is None else env),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nproc),
        "ROLE_NAME": "default",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # the ranks are clients of `store`, as of torchrun's agent's
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(restart_count),
        "TORCHELASTIC_RUN_ID": "distref-testing",
    }
    return _fork(nproc, train_file, argv, job_env, cwd, store=store)


def start_process(
    script: str,
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    module: bool = False,
) -> RankJob:
    """Start `python script argv` (`module`: `python -m script argv`) as one process forked from the fork
    server, without torchrun's variables: a one-process command of a tool under test, which would
    otherwise spend ~2 s of CPU importing torch. Its job: `wait` returns what subprocess.run would."""
    return _fork(1, script, argv, os.environ if env is None else env, cwd, module=module)


def run_ranks(
    nproc: int,
    train_file: str,
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
    cwd: str | os.PathLike | None = None,
) -> subprocess.CompletedProcess:
    """Run `train_file argv` as `nproc` ranks on this machine, as `torchrun --standalone
    --nproc-per-node nproc` would, and return what a subprocess.run of torchrun returns: exit code 0 when
    every rank succeeded, else 1 (the other ranks are stopped), and the ranks' stdout and stderr.
    Raises subprocess.TimeoutExpired (the ranks killed) after `timeout` seconds."""
    return start_ranks(nproc, train_file, argv, env=env, cwd=cwd).wait(timeout)
