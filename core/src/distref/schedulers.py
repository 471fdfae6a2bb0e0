"""Ranks that a scheduler starts instead of torchrun: SLURM's `srun python train.py`, where every task of
the job step is a rank, and Kubernetes' PyTorchJob (Kubeflow's training operator), where every pod is one.

Both set variables of their own, not all of torchrun's. `take_rank_from_scheduler` completes torchrun's
contract from them, so that everything after it (the env:// rendezvous, one device per LOCAL_RANK, the
record) is the same as under torchrun.

srun, a task of a step of several tasks:

    RANK = SLURM_PROCID      WORLD_SIZE = SLURM_STEP_NUM_TASKS      LOCAL_RANK = SLURM_LOCALID
    LOCAL_WORLD_SIZE = this node's entry of SLURM_STEP_TASKS_PER_NODE ("2(x2)": 2 on each of 2 nodes)
    MASTER_ADDR = the address of the step's first node (the one with task 0), unless already set
    MASTER_PORT = 29500 + the job id mod 1000, unless already set (launch/slurm/srun.sbatch sets
                  `python -m distref.schedulers port`: one free on the first node, see rendezvous_port)

A PyTorchJob pod that runs `python train.py` (no torchrun in it): the operator sets MASTER_ADDR,
MASTER_PORT, WORLD_SIZE and RANK (the pod's index: the master 0, worker i i + 1), but no LOCAL_RANK:
each pod is one rank, so LOCAL_RANK = 0 and LOCAL_WORLD_SIZE = 1.

A step of one task (`srun -n1 python train.py`), a batch script's own `python train.py`, and torchrun's
ranks (`srun torchrun ...`, or torchrun in a pod: they have torchrun's LOCAL_RANK) are left as they are.
Standard library only: this sits at the bottom of core, beside config.
"""

from __future__ import annotations

import itertools
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path

BASE_PORT = 29500
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


class SchedulerError(ValueError):
    """A launcher's variable that is missing or not what it should be (one line: the caller exits 2)."""


def number(*names: str, default: str | None = None) -> int:
    """The first of the variables `names` that is set, as a non-negative integer (else `default`)."""
    value = next((os.environ[n] for n in names if n in os.environ), default)
    if value is None or not value.isdigit():
        shown = " or ".join(names)
        raise SchedulerError(f"{shown}={value!r} from the launcher: not a non-negative integer")
    return int(value)


def srun_task() -> bool:
    """Whether srun started this process as one task of a step of several tasks, with no torchrun
    between (torchrun's workers inherit SLURM's variables, and have torchrun's LOCAL_RANK)."""
    env = os.environ
    if "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env or "LOCAL_RANK" in env:
        return False
    return number("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", default="1") > 1


def tasks_on_node(tasks_per_node: str, node_index: int) -> int:
    """This node's count in SLURM's compressed list: "2(x3),1" is 2, 2, 2, 1."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise SchedulerError(f"unexpected SLURM tasks-per-node list {tasks_per_node!r}")
        counts += [int(match[1])] * int(match[2] or 1)
    if not 0 <= node_index < len(counts):
        raise SchedulerError(
            f"SLURM_NODEID={node_index} is not a node of the tasks-per-node list {tasks_per_node!r}"
        )
    return counts[node_index]


def scontrol(*args: str) -> str:
    # (every rank asks: a slurmctld that does not answer must not hold them all)
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, check=True, timeout=30).stdout


def first_node_address(nodelist: str) -> str:
    """Where the step's first node (task 0's) is reached: its NodeAddr in SLURM's configuration, which
    is the node's name unless the cluster says otherwise. Without a working scontrol: the first name of
    the list ("gpu[03-04,07]" -> "gpu03")."""
    try:
        first = scontrol("show", "hostnames", nodelist).split()[0]
        address = re.search(r"NodeAddr=(\S+)", scontrol("show", "node", "-o", first))
        return address[1] if address else first
    except (OSError, subprocess.SubprocessError, IndexError):
        match = re.match(r"([^\[,]+)(?:\[([^\],-]+))?", nodelist)
        return match[1] + (match[2] or "") if match else nodelist


def become_rank_of_srun_step() -> None:
    """Under `srun` with several tasks: set torchrun's variables from SLURM's (module docstring)."""
    if not srun_task():
        return
    env = os.environ
    # every value checked before any is set: a bad one is one line, and nothing half-done
    rank, world, local = (
        number("SLURM_PROCID"),
        number("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
        number("SLURM_LOCALID"),
    )
    node = number("SLURM_NODEID", default="0")
    tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "1"))
    local_world = tasks_on_node(tasks_per_node, node)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if "MASTER_ADDR" not in env and not nodelist:
        raise SchedulerError("srun set neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST: no first node")
    env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"] = str(rank), str(world), str(local)
    env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"] = str(local_world), str(node)
    if "MASTER_ADDR" not in env:
        env["MASTER_ADDR"] = first_node_address(nodelist)
    env.setdefault("MASTER_PORT", str(BASE_PORT + number("SLURM_JOB_ID", default="0") % 1000))


def rendezvous_port(job_id: int, ephemeral_range: str = EPHEMERAL_RANGE) -> int:
    """A port for rank 0's store that is free on this node now and stays free until rank 0 listens.

    Not one the kernel picks (`bind(("", 0))`): that comes from the ephemeral range, from which every
    outgoing connection on the node also takes its local port, so in the seconds before rank 0 listens
    another job's gloo or NCCL connection can take it (EADDRINUSE, seen with two jobs on one node). A
    port below that range is only ever taken by a listener that asks for it: BASE_PORT + the job id mod
    1000, so two jobs on one node start apart, or where that is taken, the first free one in an order of
    the job's own: the other ports of BASE_PORT's thousand first (the range a cluster's firewall may open
    for training), then the rest. (Not the next one up: where ports are held a while, as a finished
    cluster's are, in TIME_WAIT, two jobs passed over the same held ones to the same free port and one of
    them failed.)"""
    try:
        low = int(Path(ephemeral_range).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default range starts here
    ports = range(1024, max(low, 1025))  # (above the ports only root may listen on)
    first = ports[(BASE_PORT + job_id % 1000 - ports.start) % len(ports)]
    window = [p for p in range(BASE_PORT, BASE_PORT + 1000) if p in ports and p != first]
    random.Random(job_id).shuffle(window)
    rest = (p for p in ports if not BASE_PORT <= p < BASE_PORT + 1000 and p != first)
    for port in itertools.chain([first], window, rest):
        with socket.socket() as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue  # in use (or in TIME_WAIT) here
        return port
    raise SchedulerError(f"no free port below {low} on this node for the rendezvous")


def pytorchjob_pod() -> bool:
    """Whether this process has the env:// variables a PyTorchJob pod gets (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) without torchrun's LOCAL_RANK: a pod that is one rank."""
    env = os.environ
    return (
        all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
        and "LOCAL_RANK" not in env
    )


def become_rank_of_pod() -> None:
    """In a PyTorchJob pod that runs train.py itself: the pod's one rank is its local rank 0."""
    if pytorchjob_pod():
        number("RANK"), number("WORLD_SIZE"), number("MASTER_PORT")  # (checked: one line if not numbers)
        os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = "0", "1"


def take_rank_from_scheduler() -> None:
    """Complete torchrun's variables from srun's or a PyTorchJob pod's, where this process is one of
    their ranks (the module's docstring); elsewhere do nothing."""
    become_rank_of_srun_step()
    become_rank_of_pod()


def scheduler_info() -> dict[str, str | int | None] | None:
    """For the run record: the SLURM job this run belongs to, or None outside one."""
    env = os.environ
    if "SLURM_JOB_ID" not in env:
        return None
    if "TORCHELASTIC_RUN_ID" in env:  # torchrun's ranks (`python train.py` starts them with its launcher)
        launched_by = "srun torchrun" if "SLURM_STEP_ID" in env else "torchrun"
    else:
        launched_by = "srun" if "SLURM_STEP_ID" in env else "sbatch"
    return {
        "name": "slurm",
        "job_id": env["SLURM_JOB_ID"],
        "job_name": env.get("SLURM_JOB_NAME"),
        "step_id": env.get("SLURM_STEP_ID"),
        "nodelist": env.get("SLURM_JOB_NODELIST"),
        "restart_count": int(env.get("SLURM_RESTART_COUNT", "0")),
        "launched_by": launched_by,
        "master_addr": env.get("MASTER_ADDR"),  # where rank 0 (its store) was reached
    }


if __name__ == "__main__":  # `python -m distref.schedulers port`: the sbatch scripts' rendezvous port
    if sys.argv[1:] != ["port"]:
        sys.exit("usage: python -m distref.schedulers port")
    try:
        print(rendezvous_port(number("SLURM_JOB_ID", default="0")))
    except SchedulerError as exc:
        sys.exit(f"python -m distref.schedulers port: error: {exc}")
