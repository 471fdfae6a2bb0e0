"""Running impls from tests: their train.py as a module or a script, their ranks (forked from a process
that imported torch once, or through torchrun), in this repository or in a project `distref.export` wrote.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import io
import os
import subprocess
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from distref.distributed.launch import without_launch_options
from distref.testing.ranks import RankJob, start_process, start_ranks
from distref.testing.timing import note_started_processes

# The repository (or exported project) root: the folder of the conftest.py above this package; where the
# package was installed elsewhere (an exported project's `pip install .`), the folder pytest runs in.
ROOT = next((p for p in Path(__file__).resolve().parents if (p / "conftest.py").is_file()), Path.cwd())
DATA_ROOT = Path(os.environ.get("DISTREF_DATA", ROOT / "data"))
EXPORTED_IMPL = None  # distref.export sets this in the copy an exported project vendors


def train_path(impl: str) -> Path:
    """impls/<impl>/train.py here; in an exported project, ./train.py or baseline/<impl>/train.py."""
    if EXPORTED_IMPL is None:
        return ROOT / "impls" / impl / "train.py"
    return ROOT / "train.py" if impl == EXPORTED_IMPL else ROOT / "baseline" / impl / "train.py"


def load_train_module(impl: str):
    """Import an impl's train.py as a module (train.py files are scripts, not an importable package)."""
    path = train_path(impl)
    spec = importlib.util.spec_from_file_location(f"distref_impl_{impl}_train", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def shared_folder(tmp_path_factory, name: str) -> Path | None:
    """A folder every pytest-xdist worker of this run shares (beside their own temporary folders), or
    None outside xdist."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        return None
    folder = tmp_path_factory.getbasetemp().parent / f"{name}-{run}"
    folder.mkdir(exist_ok=True)
    return folder


def made_once(tmp_path_factory, name: str, key: tuple, make: Callable[[Path], object]) -> Path:
    """The file `make(path)` writes for `key`, made once for the whole run: under pytest-xdist by whichever
    worker asks first (the others wait for its file, in a folder they share), else in this process."""
    shared = shared_folder(tmp_path_factory, name)
    if shared is None:
        path = tmp_path_factory.mktemp(name) / "made"
        make(path)
        return path
    path = shared / hashlib.sha256(repr(key).encode()).hexdigest()[:20]
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes)
        if not path.exists():
            written = tmp_path_factory.mktemp(name) / "made"
            make(written)
            os.replace(written, path)
    return path


def child_environment(env: dict | None = None) -> dict:
    """What a test's processes run with: this one's variables, one thread each (as every rank has), output
    unbuffered, and `env`."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}


def run_script(args: list[str], env: dict | None = None, timeout: float = 300, cwd: Path = ROOT):
    """Run a command with one thread per process (as every rank would) and return the CompletedProcess."""
    note_started_processes()
    full_env = child_environment(env)
    return subprocess.run(args, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd)


def run_forked(args: list[str], env: dict | None = None, timeout: float = 300, cwd: Path = ROOT):
    """run_script's result for `args` (`python FILE ARGS`, `python -m MODULE ARGS`, `python train.py
    --nproc-per-node N ARGS`), run forked from the fork server (forked_command): what the process does,
    without its ~2 s of CPU importing torch; a test of the command line itself, or of its launcher, uses
    run_script."""
    full_env = child_environment(env)
    job = forked_command(args, full_env, cwd)
    return run_script(args, env, timeout, cwd) if job is None else job.wait(timeout)


def self_launched(impl: str, args: list[str], timeout: float = 300):
    """`python impls/<impl>/train.py ARGS` for a multi-process impl: the file checks ARGS, then starts its
    own ranks (`--nproc-per-node`), as a user would run it."""
    return run_script([sys.executable, str(train_path(impl)), *args], timeout=timeout)


def launch(nproc: int, impl: str, args: list[str], timeout: float = 300, env: dict | None = None):
    """What `torchrun --standalone --nproc-per-node NPROC impls/<impl>/train.py ARGS` runs, and its result:
    the same ranks, forked from a process that has imported torch once (distref.testing.run_ranks), so
    that each does not spend ~2 s of CPU importing it. Tests of the launchers themselves (restarts,
    torchrun's failure report, `python train.py --nproc-per-node`) use `torchrun` and `self_launched`."""
    return start(nproc, impl, args, env=env).wait(timeout)


def start(nproc: int, impl: str, args: list[str], env: dict | None = None, restart_count: int = 0) -> RankJob:
    """`launch`'s ranks, started and not waited for (a fault test stops or kills one of them); its
    attempt `restart_count`, as torchrun's --max-restarts would start it."""
    full_env = child_environment(env)
    return start_ranks(
        nproc, str(train_path(impl)), args, env=full_env, cwd=ROOT, restart_count=restart_count
    )


def torchrun(nproc: int, impl: str, args: list[str], **kwargs):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return run_script([*cmd, str(train_path(impl)), *args], **kwargs)


def _count(value: str | None) -> int | None:
    """A launch option's number of ranks; None for anything else ("auto", missing)."""
    return int(value) if value is not None and value.isdigit() and int(value) > 0 else None


def _torchrun_ranks(options: Sequence[str]) -> tuple[int, int] | None:
    """(ranks, index of the script) of `torchrun OPTIONS FILE ARGS` when its options are only --standalone
    and a number of --nproc-per-node (the ones forked_command emulates); else None."""
    nproc, i = None, 0
    while i < len(options) and options[i].startswith("-"):
        name, equals, value = options[i].partition("=")
        if name in ("--nproc-per-node", "--nproc_per_node"):
            nproc = _count(value if equals else (options[i + 1] if i + 1 < len(options) else None))
            if nproc is None:
                return None
            i += 1 if equals else 2
        elif options[i] == "--standalone":
            i += 1
        else:
            return None
    return (nproc, i) if nproc is not None and i < len(options) else None


def _self_launched_ranks(args: Sequence[str]) -> int | None:
    """N of `python train.py ARGS --nproc-per-node N` (or `--nproc-per-node=N`): the ranks it starts;
    0 where the launch cannot be emulated (no number of ranks, restarts asked for), None without it."""
    nproc = None
    for i, token in enumerate(args):
        name, equals, value = token.partition("=")
        given = value if equals else (args[i + 1] if i + 1 < len(args) else None)
        if name == "--nproc-per-node":
            nproc = _count(given) or 0
        elif name == "--max-restarts" and given != "0":
            return 0  # (forked ranks are not restarted)
    return nproc


def forked_command(
    command: Sequence[str], env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None
) -> RankJob | None:
    """Start what `command` would, forked from the fork server as `launch` forks ranks, where it is a
    command line of this Python that a tool under test runs (compare, the GPU check and benchmark):
    `python FILE ARGS` (an impl's train.py given `--nproc-per-node N`: the N ranks its launcher would
    start), `python -m MODULE ARGS`, and `python -m torch.distributed.run [--standalone] --nproc-per-node N
    FILE ARGS`. None for any other command, which the caller runs as it is. The launchers' own code does
    not run (their tests run the real thing: its checks before any rank starts, its restarts); the
    ranks' and the scripts' does."""
    command = [os.fspath(token) for token in command]
    if len(command) < 2 or command[0] != sys.executable:
        return None
    env = dict(os.environ if env is None else env)  # (subprocess's meaning of env)
    if command[1:3] == ["-m", "torch.distributed.run"]:
        if (torchrun := _torchrun_ranks(command[3:])) is None:
            return None
        nproc, script = torchrun
        return start_ranks(nproc, command[3 + script], command[4 + script :], env=env, cwd=cwd)
    if command[1] == "-m" and len(command) > 2:
        return start_process(command[2], command[3:], env=env, cwd=cwd, module=True)
    if command[1].endswith(".py"):
        script, args = command[1], command[2:]
        if (nproc := _self_launched_ranks(args)) is not None and Path(script).name == "train.py":
            if nproc == 0:
                return None
            return start_ranks(nproc, script, without_launch_options(args), env=env, cwd=cwd)
        return start_process(script, args, env=env, cwd=cwd)
    return None


def _write(target, text: str, inherited) -> None:
    """`text` where Popen's `stdout`/`stderr` said: a file object opened as text or as bytes, None (this
    process's own `inherited` stream, as a child would inherit it), DEVNULL (nowhere)."""
    if target is None:
        target = inherited
    if hasattr(target, "write"):
        target.write(text if isinstance(target, io.TextIOBase) else text.encode(errors="replace"))
        target.flush()


class _ForkedPopen:
    """subprocess.Popen's part the tools use (`wait`, `poll`, `returncode`, `pid`, `stdout` when PIPE),
    for a forked job: its output is written, when it ends, where Popen's `stdout` and `stderr` say. After
    a timeout (the job killed, where Popen would leave it running: a tool stops it then) `wait` returns
    -9 with what it wrote."""

    def __init__(self, job: RankJob, args: Sequence[str], stdout, stderr):
        self._job, self.args, self._out, self._err = job, list(args), stdout, stderr
        self.pid, self.returncode, self.stdout = job.pids[0], None, None
        if stdout == subprocess.PIPE:  # (read as the job's output comes: at its end, here)
            read_end, write_end = os.pipe()
            self.stdout, self._pipe = open(read_end, "rb"), open(write_end, "wb")  # noqa: SIM115

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                result = self._job.wait(3600 if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                self._deliver(self._job.wait())  # (killed: exit code -9, and what it wrote)
                raise
            self._deliver(result)
        return self.returncode

    def _deliver(self, result: subprocess.CompletedProcess) -> None:
        merged = self._err == subprocess.STDOUT
        if self.stdout is not None:
            with self._pipe:  # (closed, whatever happens: the reader sees the end)
                self._pipe.write((result.stdout + (result.stderr if merged else "")).encode(errors="replace"))
            if not merged:
                _write(self._err, result.stderr, sys.stderr)
        else:
            _write(self._out, result.stdout, sys.stdout)
            _write(self._out if merged else self._err, result.stderr, sys.stderr)
        self.returncode = result.returncode

    def poll(self) -> int | None:
        return None if self._job.running() and self.returncode is None else self.wait()


# What forked_subprocess's Popen takes besides the command: anything else (stdin, text, encoding, ...) and
# the command runs as it is
_POPEN_ARGUMENTS = {"stdout", "stderr", "env", "cwd", "start_new_session"}


def forked_subprocess() -> types.SimpleNamespace:
    """A stand-in for the `subprocess` module of a tool under test (`monkeypatch.setattr(tool,
    "subprocess", forked_subprocess())`): its Popen and run fork what `forked_command` can, as the
    tool's own calls would have run it, and leave every other command, and the rest, to subprocess. Its
    `forked` lists the command lines it forked (a test shows that they were)."""
    forked: list[list[str]] = []

    def popen(args, **kwargs):
        job = (
            forked_command(args, kwargs.get("env"), kwargs.get("cwd"))
            if set(kwargs) <= _POPEN_ARGUMENTS
            else None
        )
        if job is None:
            return subprocess.Popen(args, **kwargs)
        forked.append(list(map(str, args)))
        return _ForkedPopen(job, args, kwargs.get("stdout"), kwargs.get("stderr"))

    def run(args, timeout=None, **kwargs):
        capture, text = kwargs.get("capture_output", False), kwargs.get("text", False)
        plain = {k: v for k, v in kwargs.items() if k not in ("capture_output", "text")}
        piped = capture or plain.get("stdout") == subprocess.PIPE
        if not set(plain) <= _POPEN_ARGUMENTS or (piped and not text):  # (check, input, bytes: as it is)
            return subprocess.run(args, timeout=timeout, **kwargs)
        job = forked_command(args, plain.get("env"), plain.get("cwd"))
        if job is None:
            return subprocess.run(args, timeout=timeout, **kwargs)
        forked.append(list(map(str, args)))
        if piped:
            result = job.wait(3600 if timeout is None else timeout)
            return subprocess.CompletedProcess(list(args), result.returncode, result.stdout, result.stderr)
        process = _ForkedPopen(job, args, plain.get("stdout"), plain.get("stderr"))
        return subprocess.CompletedProcess(list(args), process.wait(timeout))

    names = {name: getattr(subprocess, name) for name in dir(subprocess) if not name.startswith("_")}
    return types.SimpleNamespace(**{**names, "Popen": popen, "run": run, "forked": forked})
