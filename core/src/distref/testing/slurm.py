"""A real SLURM cluster of two nodes on this one machine, for `nox -s slurm`: Debian's munge, slurmctld and
two slurmd (node names n1 and n2, both at 127.0.0.1), everything under one temporary folder and pointed
at by SLURM_CONF, so nothing is written to /etc. Every daemon is stopped by its PID when the cluster
closes, also when what ran on it failed.

    with LocalSlurm(tmp_path) as cluster:
        job = cluster.submit(["launch/slurm/srun.sbatch", "impls/ddp/train.py", "--steps", "5"], nodes=2)
        cluster.wait(job)           # "COMPLETED", "FAILED", "CANCELLED", ...

    python -m distref.testing.slurm        # start one and keep it up (prints how to use it; Ctrl-C stops)

What it needs: the commands of Debian's slurmctld, slurmd, slurm-client and munge; `missing_packages()`
names those not installed and `install_packages()` installs them with apt-get (as root).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMANDS = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client", "munged": "munge"}
NODES = ("n1", "n2")
CPUS_PER_NODE = 16  # what each node offers: every job of `nox -s slurm` at once (the 2 real cores are shared)
FINISHED = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
)


def missing_packages() -> list[str]:
    """Debian packages whose commands are not on PATH (nor in /usr/sbin, where Debian puts daemons)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return sorted({package for command, package in COMMANDS.items() if not shutil.which(command, path=path)})


def install_packages(packages: list[str]) -> None:
    """apt-get install `packages` (13 MB, seconds); only root can. The packages' own files go where Debian
    puts them; this module writes nothing else outside its folder."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:  # a stale package list: update it once and try again
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"apt-get install {' '.join(packages)} failed: {done.stderr.strip()[-500:]}")


def unavailable_reason() -> str | None:
    """Why this machine cannot run the cluster (after installing what root can), or None."""
    missing = missing_packages()
    if missing and os.geteuid() == 0 and shutil.which("apt-get"):
        install_packages(missing)
        missing = missing_packages()
    if missing:
        return (
            f"the SLURM cluster needs Debian's {', '.join(missing)} (apt-get install {' '.join(missing)}); "
            "not installed, and only root can install them"
        )
    if os.geteuid() != 0:
        return "the local SLURM cluster runs its daemons as root (SlurmUser=root); this is not root"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sbin(command: str) -> str:
    return shutil.which(command, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin"])) or command


class LocalSlurm:
    """The cluster's daemons under `folder`, started on entering and stopped (by PID) on leaving."""

    def __init__(self, folder: Path, nodes: tuple[str, ...] = NODES, cpus_per_node: int = CPUS_PER_NODE):
        self.folder = Path(folder)
        self.nodes, self.cpus_per_node = nodes, cpus_per_node
        self.daemons: dict[str, subprocess.Popen] = {}
        self.socket_folder: Path | None = None
        self.env = dict(os.environ)

    # -- the daemons ------------------------------------------------------------------------------
    def __enter__(self) -> LocalSlurm:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        f = self.folder
        for sub in ("munge", "state", "spool", "log"):
            (f / sub).mkdir(parents=True, exist_ok=True)
        # munged wants its key readable by it alone, and every folder above its socket searchable by
        # everyone (pytest's temporary folders are not): the socket gets a folder of its own in /tmp.
        (f / "munge").chmod(0o700)
        self.socket_folder = Path(tempfile.mkdtemp(prefix="distref-munge-"))
        self.socket_folder.chmod(0o755)
        socket_path, key = self.socket_folder / "munge.socket", f / "munge" / "munge.key"
        subprocess.run([sbin("mungekey"), "-c", "-k", str(key)], check=True, capture_output=True)
        self.daemons["munged"] = self._daemon(
            "munged",
            [
                sbin("munged"),
                "-F",
                f"--socket={socket_path}",
                f"--key-file={key}",
                f"--log-file={f / 'log' / 'munged.log'}",
                f"--pid-file={f / 'munge' / 'munged.pid'}",
                f"--seed-file={f / 'munge' / 'munged.seed'}",
            ],
        )
        self._wait_for(lambda: socket_path.exists(), "munged to open its socket", "munged.log")
        conf = f / "slurm.conf"
        conf.write_text(self.slurm_conf(socket_path))
        self.env["SLURM_CONF"] = str(conf)
        self.daemons["slurmctld"] = self._daemon("slurmctld", [sbin("slurmctld"), "-D", "-i"])
        for node in self.nodes:
            self.daemons[f"slurmd-{node}"] = self._daemon(
                f"slurmd-{node}", [sbin("slurmd"), "-D", "-N", node]
            )
        self._wait_for(self._all_idle, f"nodes {', '.join(self.nodes)} to be idle", "slurmctld.log")

    def slurm_conf(self, munge_socket: Path) -> str:
        f = self.folder
        host = socket.gethostname()
        lines = [
            "ClusterName=distref",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            "SlurmUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={munge_socket}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "ReturnToService=2",
            "MailProg=/bin/true",
            "KillWait=5",  # seconds between scancel's SIGTERM and SIGKILL (default 30)
            "MinJobAge=600",  # finished jobs stay visible to squeue/scontrol (no accounting database)
            "SchedulerParameters=sched_interval=1",
            "SlurmdParameters=config_overrides",
            f"StateSaveLocation={f / 'state'}",
            f"SlurmdSpoolDir={f / 'spool' / '%n'}",
            f"SlurmctldPidFile={f / 'slurmctld.pid'}",
            f"SlurmdPidFile={f / 'slurmd.%n.pid'}",
            f"SlurmctldLogFile={f / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={f / 'log' / 'slurmd.%n.log'}",
        ]
        for index, node in enumerate(self.nodes):
            # Each node at an address of its own on the loopback network (127.0.0.1, 127.0.0.2, ...), so
            # that a job reaching its first node by the wrong one's address is seen.
            lines.append(
                f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.{index + 1} Port={free_port()} "
                f"CPUs={self.cpus_per_node} State=UNKNOWN"
            )
        lines.append(
            f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP"
        )
        return "\n".join(lines) + "\n"

    def _daemon(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(self.folder / "log" / f"{name}.out", "wb")  # noqa: SIM115 (closed with the process)
        # A session of its own: a Ctrl-C in the terminal reaches this process, which stops them in order.
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )

    def _wait_for(self, ready, what: str, log: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [n for n, p in self.daemons.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"not within {timeout_s:g} s"
                raise RuntimeError(f"local SLURM: waiting for {what}: {why}; see {self.folder / 'log' / log}")
            time.sleep(0.1)

    def _all_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout
        states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
        return all(states.get(node) == "idle" for node in self.nodes)

    def stop(self) -> None:
        """Cancel every job, SIGTERM every daemon (the slurmds first, munged last), SIGKILL what is left
        after 10 s; then SIGKILL every process of this cluster still alive (a job step's slurmstepd and
        what it started outlive their slurmd: all have this cluster's SLURM_CONF in their environment)."""
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(
                    ["scancel", "--full", "--user", "root"], env=self.env, capture_output=True, timeout=10
                )
        for name in [n for n in self.daemons if n.startswith("slurmd")] + ["slurmctld", "munged"]:
            process = self.daemons.get(name)
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in self.daemons.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for pid in self.processes():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self.daemons.clear()
        if self.socket_folder is not None:
            shutil.rmtree(self.socket_folder, ignore_errors=True)

    def processes(self) -> list[int]:
        """PIDs of the processes that belong to this cluster: their environment names its SLURM_CONF
        (every job inherits it from sbatch; slurmstepd from slurmd)."""
        mark = f"SLURM_CONF={self.env.get('SLURM_CONF', '')}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if "SLURM_CONF" in self.env and mark in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
        return found

    # -- jobs -------------------------------------------------------------------------------------
    def run(self, cmd: list[str], check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster."""
        return subprocess.run(
            cmd,
            env={**self.env, **kwargs.pop("env", {})},
            capture_output=True,
            text=True,
            check=check,
            **kwargs,
        )

    def submit(
        self,
        script_and_args: list[str],
        *sbatch_options: str,
        env: dict | None = None,
        cwd: Path | None = None,
    ) -> str:
        """sbatch it; the job id."""
        done = self.run(["sbatch", "--parsable", *sbatch_options, *script_and_args], env=env or {}, cwd=cwd)
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, NodeList, Restarts, ...)."""
        out = self.run(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_for_restart(self, job_id: str, restarts: int, timeout_s: float = 30.0) -> None:
        """After `scontrol requeue`: until SLURM has counted the job's `restarts`-th start."""
        deadline = time.monotonic() + timeout_s
        while int(self.job(job_id).get("Restarts", "0")) < restarts:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} was not requeued within {timeout_s:g} s")
            time.sleep(0.1)

    def state(self, job_id: str) -> str:
        return self.job(job_id).get("JobState", "UNKNOWN")

    def wait(self, job_id: str, timeout_s: float = 120.0, until: tuple[str, ...] = FINISHED) -> str:
        """Poll until the job reaches one of `until` (sbatch --wait polls every 10 s); its state."""
        deadline = time.monotonic() + timeout_s
        while (state := self.state(job_id)) not in until:
            if time.monotonic() > deadline:
                self.run(["scancel", job_id], check=False)
                raise TimeoutError(f"job {job_id} still {state} after {timeout_s:g} s (cancelled)")
            time.sleep(0.2)
        return state


def main() -> None:
    """Start a cluster and keep it up until Ctrl-C; with --install, install what it needs and exit (what
    .ci/run does while the tests run: this file needs only the standard library)."""
    reason = unavailable_reason()
    if "--install" in sys.argv[1:]:
        print(f"local SLURM: {reason or 'slurmctld, slurmd, slurm-client and munge are installed'}")
        return
    if reason:
        sys.exit(f"distref.testing.slurm: {reason}")
    folder = Path(tempfile.mkdtemp(prefix="distref-slurm-"))
    with LocalSlurm(folder) as cluster:
        print(f"a SLURM cluster of {len(cluster.nodes)} nodes is up; in another shell:")
        print(f"    export SLURM_CONF={cluster.env['SLURM_CONF']}")
        print("    sinfo; sbatch --nodes 2 launch/slurm/srun.sbatch impls/ddp/train.py --dataset synthetic")
        print("Ctrl-C stops it.", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()


if __name__ == "__main__":
    main()
