"""distref.schedulers: a task of `srun` and a PyTorchJob pod become ranks by torchrun's variables, and
nothing else does; `--check-ranks N` checks a job's options before its launcher starts any rank. (On a
real SLURM cluster: core/tests/test_slurm.py, `nox -s slurm`; with a PyTorchJob's environment:
core/tests/test_kubernetes.py.)"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from distref.schedulers import scheduler_info, take_rank_from_scheduler, tasks_on_node
from distref.testing import load_train_module

RANK_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@pytest.fixture
def clean_environment(monkeypatch, tmp_path):
    """No launcher's variables, and no scontrol on PATH (the first node is then named from the list)."""
    for key in {*os.environ, *RANK_VARIABLES}:
        if key.startswith(("SLURM_", "PET_", "TORCHELASTIC_")) or key in RANK_VARIABLES:
            # set, then deleted: monkeypatch then restores it as it was, absent included (what the code
            # under test sets in os.environ must not reach the tests that run after it in this process)
            monkeypatch.setenv(key, "")
            monkeypatch.delenv(key)
    monkeypatch.setenv("PATH", str(tmp_path))
    return monkeypatch


SRUN_TASK_3_OF_4 = {
    "SLURM_JOB_ID": "1234",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
}


def test_tasks_per_node_list_is_expanded():
    assert [tasks_on_node("2(x3),1", i) for i in range(4)] == [2, 2, 2, 1]
    assert tasks_on_node("8", 0) == 8


def test_an_srun_task_becomes_the_rank_slurm_numbers_it(clean_environment):
    for key, value in SRUN_TASK_3_OF_4.items():
        clean_environment.setenv(key, value)
    take_rank_from_scheduler()
    assert {k: os.environ[k] for k in RANK_VARIABLES} == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "gpu07",  # the step's first node: task 0's
        "MASTER_PORT": str(29500 + 234),
    }
    assert scheduler_info()["launched_by"] == "srun"


def test_what_the_user_set_is_kept(clean_environment):
    for key, value in {**SRUN_TASK_3_OF_4, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "6000"}.items():
        clean_environment.setenv(key, value)
    take_rank_from_scheduler()
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.0.0.7", "6000")


@pytest.mark.parametrize(
    "case",
    [
        {"SLURM_STEP_NUM_TASKS": "1"},  # srun -n1 python train.py: it starts its own ranks
        {"SLURM_STEP_ID": None},  # the batch script's own python
        {"LOCAL_RANK": "0", "RANK": "5"},  # srun torchrun ...: torchrun's rank
    ],
)
def test_a_process_that_is_no_srun_task_is_left_alone(case, clean_environment):
    for key, value in {**SRUN_TASK_3_OF_4, **case}.items():
        if value is None:
            clean_environment.delenv(key, raising=False)
        else:
            clean_environment.setenv(key, value)
    before = dict(os.environ)
    take_rank_from_scheduler()
    assert dict(os.environ) == before


def test_a_pytorchjob_pod_is_one_rank_on_its_first_device(clean_environment):
    for key, value in {
        "MASTER_ADDR": "job-master-0",
        "MASTER_PORT": "23456",
        "WORLD_SIZE": "4",
        "RANK": "2",
    }.items():
        clean_environment.setenv(key, value)
    take_rank_from_scheduler()
    assert (os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"], os.environ["RANK"]) == ("0", "1", "2")
    assert scheduler_info() is None


def test_bad_options_are_said_once_by_rank_0_of_an_srun_step(clean_environment, capsys):
    """Every task refuses the same options: rank 0 says why in one line, the others exit 2 silently."""
    ddp = load_train_module("ddp")
    clean_environment.setattr("distref.config.SPEAKER_GRACE_S", 0)  # (no launcher here to stop rank 1)
    bad = ["--model", "lenet", "--dataset", "synthetic", "--global-batch-size", "2"]
    said = []
    for rank in ("0", "1"):
        for key, value in {**SRUN_TASK_3_OF_4, "SLURM_PROCID": rank}.items():
            clean_environment.setenv(key, value)
        for key in RANK_VARIABLES:  # rank 0's run set them
            clean_environment.delenv(key, raising=False)
        with pytest.raises(SystemExit) as exit_:
            ddp.main(bad)
        assert exit_.value.code == 2
        said.append(capsys.readouterr().err)
    assert (
        said[0]
        .strip()
        .endswith("error: --global-batch-size 2 must be divisible by world size × --grad-accum = 4 × 1 = 4")
    )
    assert len(said[0].strip().splitlines()) == 1 and said[1] == ""


def test_check_ranks_checks_a_jobs_options_without_starting_any(clean_environment, capsys):
    ddp = load_train_module("ddp")
    args = ["--model", "lenet", "--dataset", "synthetic", "--global-batch-size", "8"]
    with pytest.raises(SystemExit) as fits:
        ddp.main([*args, "--check-ranks", "4"])
    assert fits.value.code == 0 and capsys.readouterr().out.strip() == "ddp: the options fit a run of 4 ranks"
    with pytest.raises(SystemExit) as refused:
        ddp.main([*args, "--check-ranks", "16"])
    assert refused.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("error: --global-batch-size 8 must be divisible by world size × --grad-accum = 16 × 1 = 16")
    )


def test_the_first_node_is_reached_at_its_address_in_slurms_configuration(clean_environment, tmp_path):
    """With scontrol (as on every SLURM node): the step's first node by `scontrol show hostnames`, its
    address by `scontrol show node` (NodeAddr: a node's name need not resolve)."""
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(
        "#!/bin/sh\n"
        'if [ "$2" = hostnames ]; then printf "gpu07\\ngpu08\\n"; '
        'else echo "NodeName=$4 Arch=x86_64 NodeAddr=10.1.0.${4#gpu0} NodeHostName=$4"; fi\n'
    )
    scontrol.chmod(0o755)
    for key, value in SRUN_TASK_3_OF_4.items():
        clean_environment.setenv(key, value)
    take_rank_from_scheduler()
    assert os.environ["MASTER_ADDR"] == "10.1.0.7"


def test_a_one_process_impl_refuses_to_run_as_several_srun_tasks(clean_environment, capsys):
    """single under `srun` with 4 tasks would be 4 runs writing the same files: one line, exit 2."""
    for key, value in SRUN_TASK_3_OF_4.items():
        clean_environment.setenv(key, value)
    with pytest.raises(SystemExit) as exit_:
        load_train_module("single").main(["--dataset", "synthetic", "--steps", "1"])
    assert exit_.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            "error: single runs in one process, and srun started 4 tasks: submit it with --ntasks 1 "
            "(srun.sbatch starts a process per task)"
        )
    )


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"SLURM_STEP_TASKS_PER_NODE": "abc"}, "unexpected SLURM tasks-per-node list 'abc'"),
        ({"SLURM_NODEID": "5"}, "SLURM_NODEID=5 is not a node of the tasks-per-node list '2(x2)'"),
        ({"SLURM_LOCALID": None}, "SLURM_LOCALID=None from the launcher: not a non-negative integer"),
        ({"SLURM_STEP_NUM_TASKS": "abc"}, "SLURM_STEP_NUM_TASKS or SLURM_NTASKS='abc' from the launcher"),
        ({"SLURM_STEP_NODELIST": None, "SLURM_JOB_NODELIST": None}, "srun set neither SLURM_STEP_NODELIST"),
    ],
)
def test_a_bad_srun_variable_is_one_line(change, expected, clean_environment, capsys):
    """What srun should have set, missing or malformed: one line, exit 2, before any process group."""
    for key, value in {**SRUN_TASK_3_OF_4, **change}.items():
        if value is not None:
            clean_environment.setenv(key, value)
    with pytest.raises(SystemExit) as exit_:
        load_train_module("ddp").main(["--model", "lenet", "--dataset", "synthetic", "--steps", "1"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and expected in error, error
    assert "RANK" not in os.environ  # nothing half-set


def test_check_ranks_refuses_what_it_cannot_check(clean_environment, capsys):
    with pytest.raises(SystemExit) as exit_:
        load_train_module("ddp").main(
            ["--dataset", "synthetic", "--check-ranks", "2", "--nproc-per-node", "4"]
        )
    assert exit_.value.code == 2 and "drop --nproc-per-node/--max-restarts" in capsys.readouterr().err


def test_rendezvous_port_is_free_below_the_ephemeral_range_and_apart_by_job(tmp_path):
    """The sbatch scripts' port: never one the kernel hands to a connection (another job's gloo took such
    a port between the script's pick and rank 0's listen: EADDRINUSE), one in use is passed over, and
    two jobs on one node start apart."""
    import socket
    import subprocess
    import sys

    from distref.schedulers import BASE_PORT, rendezvous_port

    ephemeral = tmp_path / "ip_local_port_range"
    ephemeral.write_text("40000\t60999\n")
    first_choice = rendezvous_port(7, str(ephemeral))
    assert first_choice == BASE_PORT + 7 or first_choice > BASE_PORT + 7  # (+7 itself unless in use)
    with socket.socket() as holder:  # someone else listens there now: the next free one
        holder.bind(("", first_choice))
        holder.listen()
        assert (
            first_choice != rendezvous_port(7, str(ephemeral))
            and 1024 <= rendezvous_port(7, str(ephemeral)) < 40000
        )
    assert rendezvous_port(7, str(ephemeral)) != rendezvous_port(8, str(ephemeral))
    ephemeral.write_text("30000\t60999\n")  # BASE_PORT + 999 would be ephemeral: wrapped below 30000
    assert all(1024 <= rendezvous_port(job, str(ephemeral)) < 30000 for job in (0, 499, 999))
    printed = subprocess.run(
        [sys.executable, "-m", "distref.schedulers", "port"],
        env={**os.environ, "SLURM_JOB_ID": "12"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert 1024 <= int(printed) < low


def test_two_jobs_whose_first_ports_are_held_do_not_take_the_same_next_one(tmp_path):
    """Where ports are held a while (a finished cluster's jobs 1-12 leave theirs in TIME_WAIT), jobs 3 and
    4 of the next must not both pass over them to the same free port (the second's rank 0 then failed to
    listen: EADDRINUSE, seen running the SLURM session twice in a minute)."""
    import socket

    from distref.schedulers import BASE_PORT, rendezvous_port

    ephemeral = tmp_path / "ip_local_port_range"
    ephemeral.write_text("40000\t60999\n")
    with contextlib.ExitStack() as held:
        for port in range(BASE_PORT + 1, BASE_PORT + 13):
            holder = held.enter_context(socket.socket())
            try:
                holder.bind(("", port))
            except OSError:
                continue  # (held already)
        chosen = {job: rendezvous_port(job, str(ephemeral)) for job in range(3, 9)}
    assert not set(chosen.values()) & set(range(BASE_PORT + 1, BASE_PORT + 13))
    assert len(set(chosen.values())) == len(chosen), chosen


@pytest.mark.parametrize("job_id", ["abc", "-5", ""])
def test_rendezvous_port_of_a_bad_job_id_is_one_line(job_id):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "distref.schedulers", "port"],
        env={**os.environ, "SLURM_JOB_ID": job_id},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"python -m distref.schedulers port: error: SLURM_JOB_ID={job_id!r} from the launcher: not a "
        "non-negative integer"
    ]
