"""ci/gpu_check.py, the one command that checks a GPU machine: what it plans for 1 and 2 GPUs (a faked
count: CI has none), that it stops starting jobs when its time is spent, how it reads what ran, that a
run off its formulas or off single's parameters fails it, and the same plan rehearsed on CPU (gloo), end
to end, for a few of its jobs."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from distref.testing import forked_subprocess

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "ci" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # (its dataclass looks itself up there)
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpu_check", None)


def names(jobs) -> list[str]:
    return [job.name for job in jobs]


def test_one_gpu_runs_what_fits_and_says_what_needs_two(gpu_check, tmp_path):
    jobs, not_run = gpu_check.plan_jobs(gpus=1, device="cuda", out=tmp_path, steps=40)
    skipped = dict(not_run)
    for impl in ("pipeline", "model_parallel", "tensor_parallel", "context_parallel", "expert_parallel"):
        assert skipped[f"{impl}-gpu"] == "needs 2 GPUs, 1 visible"
        assert f"{impl}-gpu" not in names(jobs)
    sessions = [j.name for j in jobs if j.group == "session"]
    assert sessions == ["dataparallel-gpu", "ddp-gpu", "deepspeed_zero-gpu", "fsdp-gpu", "single-gpu"]
    world_one = {j.name: j for j in jobs if j.group == "world 1"}
    impls = [
        "single",
        "ddp",
        "deepspeed_zero",
        "fsdp",
        "model_parallel",
        "tensor_parallel",
        "context_parallel",
    ]
    assert sorted(world_one) == sorted(f"{i} ×1 gpt {p}" for i in impls for p in ("fp32", "bf16"))
    # model_parallel as one process with both parts on the one GPU; the others as one rank
    assert "--devices" in (argv := world_one["model_parallel ×1 gpt fp32"].argv) and "cuda:0,cuda:0" in argv
    assert world_one["ddp ×1 gpt bf16"].argv[2:4] == ["--nproc-per-node", "1"]
    assert "--precision" in argv and argv[argv.index("--precision") + 1] == "fp32"
    # the gpu tests run first and alone; the bf16 runs (the speed table) alone
    assert jobs[0].name == "gpu tests" and jobs[0].alone and jobs[0].env == {"DISTREF_GPU_TESTS": "1"}
    assert all(f in jobs[0].argv for f in ("impls/ddp/tests/test_ddp.py", "impls/fsdp/tests/test_fsdp.py"))
    assert {j.name for j in jobs if j.alone} == {"gpu tests"} | {n for n in world_one if n.endswith("bf16")}
    assert {"ddp ×1 fp16", "ddp ×1 activation-checkpointing", "ddp ×1 profiler"} <= set(names(jobs))
    # expert_parallel, made for the mixture of experts, at world 1 with experts
    experts = next(j for j in jobs if j.name == "expert_parallel ×1 gpt experts")
    assert experts.argv[2:4] == ["--nproc-per-node", "1"] and "--experts" in experts.argv


def test_two_gpus_run_every_session(gpu_check, tmp_path):
    jobs, not_run = gpu_check.plan_jobs(gpus=2, device="cuda", out=tmp_path, steps=40)
    sessions = [j.name for j in jobs if j.group == "session"]
    assert sessions == [f"{impl}-gpu" for impl in gpu_check.IMPLS]
    assert not [name for name, _ in not_run if name.endswith("-gpu")]
    # a session's record lands in the check's folder
    ddp = next(j for j in jobs if j.name == "ddp-gpu")
    assert ddp.argv[-4:] == [
        "--out",
        str(tmp_path / "sessions" / "ddp"),
        "--save-final",
        str(ddp.out / "final.pt"),
    ]


def test_no_job_starts_after_the_budget_and_the_exit_code_says_what_failed(gpu_check, tmp_path):
    ok = gpu_check.Job("ok", "feature", [sys.executable, "-c", "print('fine')"])
    bad = gpu_check.Job("bad", "feature", [sys.executable, "-c", "import sys; sys.exit('one line why')"])
    late = gpu_check.Job("late", "world 1", [sys.executable, "-c", "pass"], alone=True)
    gpu_check.run_all([ok, bad, late], {"PATH": "/usr/bin"}, tmp_path, budget_s=1e-9, parallel=2)
    assert [j.status for j in (ok, bad, late)] == ["not run"] * 3
    assert "budget" in late.why
    for job in (ok, bad, late):
        job.status = "not run"
    gpu_check.run_all([ok, bad], {"PATH": "/usr/bin"}, tmp_path, budget_s=60, parallel=2)
    assert (ok.status, bad.status) == ("passed", "failed")
    assert bad.why == "exit code 1: one line why"


def test_the_table_reads_each_record_and_the_gpu_tests_junit(gpu_check, tmp_path):
    steps = [{"step": i, "loss": 1.0, "step_time_s": t} for i, t in enumerate([9, 9, 9, 0.010, 0.012, 0.011])]
    record = {
        "world_size": 1,
        "final_accuracy": 0.9899,
        "target_accuracy": 0.985,
        "time_to_target_s": 3.4,
        "steps": steps,
        "model_state_bytes": [{"parameters": 8, "gradients": 8, "optimizer": 16}],
        "model_state_bytes_predicted": [{"parameters": 8, "gradients": 8, "optimizer": 16}],
        "activation_bytes": {"measured": [17_567_940], "predicted": [17_502_340]},
        "communication": {"measured": [{}], "predicted": [{}]},
    }
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "record.json").write_text(json.dumps(record))
    job = gpu_check.Job("ddp ×1 gpt fp32", "world 1", ["x"], tmp_path / "run", status="passed", seconds=14.3)
    assert gpu_check.result_rows([job])[0][3] == "—"  # (a job that did not run: an older record not read)
    job.log = tmp_path / "ran.log"
    (row,) = gpu_check.result_rows([job])
    assert row[:6] == ["ddp ×1 gpt fp32", "passed", "14.3", "1", "0.9899 (target reached)", "11.0"]
    assert row[6:8] == ["exact", "exact"] and row[8].startswith("**differs**") and "+64.1 KiB" in row[8]
    (tmp_path / "gpu-tests.xml").write_text(
        '<testsuites><testsuite><testcase classname="impls.ddp.tests.test_ddp" name="test_nccl"/>'
        '<testcase classname="x.test_fsdp" name="test_two"><skipped message="needs 2 GPUs, 1 visible"/>'
        '</testcase><testcase classname="x.test_tp" name="test_bad"><failure message="no"/></testcase>'
        "</testsuite></testsuites>"
    )
    summary = gpu_check.gpu_test_summary(tmp_path)
    assert summary.splitlines()[0] == "1 passed, 1 failed, 1 skipped"
    assert "- skipped: test_fsdp::test_two: needs 2 GPUs, 1 visible" in summary
    assert "- failed: test_tp::test_bad" in summary


@pytest.mark.slow
def test_rehearsed_on_cpu_it_runs_records_and_compares_with_single(gpu_check, tmp_path, monkeypatch):
    """--device cpu: the plan's own commands, on gloo, for single and ddp ×1 (fp32) and the profiler."""
    stand_in = forked_subprocess()  # (its runs forked: no torch import each)
    monkeypatch.setattr(gpu_check, "subprocess", stand_in)
    out = tmp_path / "check"
    only = ["--only", "single ×1 gpt fp32", "--only", "ddp ×1 gpt fp32", "--only", "ddp ×1 profiler"]
    code = gpu_check.main(["--device", "cpu", "--steps", "3", "--out", str(out), *only])
    text = (out / "gpu-check.md").read_text()
    assert code == 0, text
    for name in ("single ×1 gpt fp32", "ddp ×1 gpt fp32", "ddp ×1 profiler"):
        row = next(line for line in text.splitlines() if line.startswith(f"| {name} |"))
        assert "| passed |" in row and row.endswith("| exact | exact | exact |"), row
    assert "- gpu tests: they need CUDA" in text and "- fsdp ×1 gpt fp32: left out by --only" in text
    # parity: ddp ×1 sums what single sums, in the same order
    parity = text.split("parity with single")[1]
    assert "| ddp ×1 (no parallelism) |" in parity and "0.0e+00" in parity
    assert "plan --validate` on every record (exit code 0)" in text
    assert (out / "world1" / "fp32" / "ddp" / "record.json").exists()
    forked = {" ".join(command) for command in stand_in.forked}
    assert sum("train.py" in command for command in forked) == 3, forked  # (and the report, the plan)


def test_a_job_whose_modules_do_not_import_is_listed_not_run(gpu_check, tmp_path):
    """Without the bundle (no nox, no deepspeed): the sessions and deepspeed's runs are listed with why,
    the rest run."""
    jobs, _ = gpu_check.plan_jobs(gpus=1, device="cuda", out=tmp_path, steps=40)
    kept, not_run = gpu_check.runnable(jobs, {"nox", "deepspeed"})
    why = dict(not_run)
    assert why["ddp-gpu"] == "nox not importable here: give --bundle (docs/gpu.md)"
    assert why["deepspeed_zero ×1 gpt bf16"] == "deepspeed not importable here: give --bundle (docs/gpu.md)"
    assert why["deepspeed_zero-gpu"].startswith("deepspeed, nox not importable")
    assert {j.name for j in kept} >= {"gpu tests", "ddp ×1 gpt fp32", "single ×1 gpt bf16"}
    assert not {j.group for j in kept} & {"session"}
    assert gpu_check.missing_modules({"json", "no_such_module_here"}, dict(os.environ)) == {
        "no_such_module_here"
    }


def test_a_hung_job_is_stopped_with_every_process_it_started(gpu_check, tmp_path, monkeypatch):
    """A hung NCCL run is the usual GPU failure: stopped after its own limit (not the budget), its whole
    tree with it (torchrun's ranks would hold the GPU for the jobs after)."""
    monkeypatch.setattr(gpu_check, "DEFAULT_JOB_LIMIT_S", 2.0)
    pid_file = tmp_path / "grandchild.pid"
    hang = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)"
    )
    job = gpu_check.Job("hung", "world 1", [sys.executable, "-c", hang])
    gpu_check.run_job(job, dict(os.environ), tmp_path, deadline=time.monotonic() + 600)
    assert job.status == "failed" and job.why.startswith("stopped after 2 s") and job.seconds < 30
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{grandchild}").exists():
        if Path(f"/proc/{grandchild}/stat").read_text().split()[2] == "Z":
            break  # (a zombie: ended, waiting for its parent, itself gone, to be reaped)
        time.sleep(0.1)
    alive = Path(f"/proc/{grandchild}/stat")
    assert not alive.exists() or alive.read_text().split()[2] == "Z"


def test_a_run_that_exits_0_without_a_completed_record_failed(gpu_check, tmp_path):
    """A session that skipped exits 0 too: passed needs the run's record, completed."""
    out = tmp_path / "run"
    silent = gpu_check.Job("silent", "session", [sys.executable, "-c", "print('skipped')"], out)
    gpu_check.run_job(silent, dict(os.environ), tmp_path, deadline=time.monotonic() + 60)
    assert silent.status == "failed" and silent.why == f"exit code 0 but no record in {out}: skipped"
    write = f"import json, os; os.makedirs({str(out)!r}); json.dump({{'status': 'failed', 'error': 'nan'}}, open({str(out / 'record.json')!r}, 'w'))"
    failed = gpu_check.Job("failed", "session", [sys.executable, "-c", write], out)
    gpu_check.run_job(failed, dict(os.environ), tmp_path, deadline=time.monotonic() + 60)
    assert failed.status == "failed" and failed.why == "record says failed: nan"


def test_an_impl_is_not_run_on_a_torch_older_than_it_declares(gpu_check, tmp_path):
    jobs, _ = gpu_check.plan_jobs(gpus=2, device="cuda", out=tmp_path, steps=40)
    kept, not_run = gpu_check.runnable(jobs, set(), gpu_check.version_tuple("2.11.0+cu130"))
    assert dict(not_run) == {"pipeline-gpu": "pipeline needs torch 2.12 or later, this is 2.11"}
    assert gpu_check.runnable(jobs, set(), (2, 12))[1] == []
    assert "tensor_parallel-gpu" in {j.name for j in kept}
    with pytest.raises(SystemExit):  # an --out with an older check in it: its records would be read
        (tmp_path / "old").mkdir()
        (tmp_path / "old" / "gpu-check.md").write_text("")
        gpu_check.main(["--device", "cpu", "--out", str(tmp_path / "old")])


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["--only", "nomatch"],
            "--only 'nomatch' matches no job; the jobs: context_parallel-cpu, dataparallel-cpu, ddp-cpu",
        ),
        (["--budget-s", "nan"], "--budget-s a number of seconds > 0"),
        (["--budget-s", "inf"], "--budget-s a number of seconds > 0"),
        (["--steps", "2"], "--steps must be >= 3: a run's communication and activations are counted"),
        (["--parallel", "0"], "--parallel must be >= 1"),
    ],
)
def test_bad_values_are_one_line_and_nothing_is_written(gpu_check, tmp_path, capsys, argv, said):
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--device", "cpu", "--out", str(tmp_path / "check"), *argv])
    assert exit_.value.code == 2
    assert said in capsys.readouterr().err.splitlines()[-1]
    assert not (tmp_path / "check").exists()


# ---- the verdicts: a run whose costs or parameters are wrong fails the check ---------------------------


def run_as_the_check_does(gpu_check, single_train, out: Path) -> Path:
    """single on the check's fp32 world-1 workload, 3 steps (its third counted), in this process."""
    options = [*gpu_check.GPT, *gpu_check.OPTIMIZER["fp32"], "--precision", "fp32", "--steps", "3"]
    single_train.main([*options, "--out", str(out), "--save-final", str(out / "final.pt")])
    return out


@pytest.fixture(scope="module")
def clean_run(gpu_check, single_train, tmp_path_factory) -> Path:
    return run_as_the_check_does(gpu_check, single_train, tmp_path_factory.mktemp("clean") / "run")


def check_runs(gpu_check, monkeypatch, tmp_path, runs: dict[str, Path]) -> tuple[int, str, str]:
    """gpu_check.main over world-1 jobs whose runs are `runs` (job name -> a finished run's folder, copied
    to be the job's own; the job itself does nothing): its exit code, gpu-check.md and what it printed.
    The report and plan --validate are left out: the verdicts alone decide."""
    jobs = []
    for name, made in runs.items():
        shutil.copytree(made, tmp_path / "runs" / name)
        jobs.append(gpu_check.Job(name, "world 1", [sys.executable, "-c", "pass"], tmp_path / "runs" / name))
    monkeypatch.setattr(gpu_check, "plan_jobs", lambda *args, **kwargs: (jobs, []))
    monkeypatch.setattr(gpu_check, "reports_and_validation", lambda *args, **kwargs: ("", []))
    code = gpu_check.main(["--device", "cpu", "--out", str(tmp_path / "check")])
    return code, (tmp_path / "check" / "gpu-check.md").read_text(), jobs


def row_status(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"| {name} |")).split(" | ")[1]


def test_a_run_off_single_s_parameters_fails_the_check_naming_it(
    gpu_check, single_train, clean_run, monkeypatch, tmp_path
):
    """The issue's planted bug, the loss × 1.5 (each micro-batch's loss_sum): a run that completes, whose
    costs are exact, but whose parameters are not single's. At world 1 plain single makes the same sums:
    beyond fp32's tolerance it fails the check (exit 1) and its row says so; a run that equals single
    passes, its parity.json (the report's parity column) saying by how much."""
    loss_sum = single_train.loss_sum
    monkeypatch.setattr(single_train, "loss_sum", lambda *args, **kwargs: 1.5 * loss_sum(*args, **kwargs))
    planted = run_as_the_check_does(gpu_check, single_train, tmp_path / "planted")
    monkeypatch.undo()
    runs = {"single ×1 gpt fp32": clean_run, "ddp ×1 gpt fp32": clean_run, "fsdp ×1 gpt fp32": planted}
    code, text, jobs = check_runs(gpu_check, monkeypatch, tmp_path, runs)
    assert code == 1, text
    assert row_status(text, "ddp ×1 gpt fp32") == "passed"
    failed = row_status(text, "fsdp ×1 gpt fp32")
    assert failed.startswith("failed: parity with single ") and "> 1e-05 (fp32, 3 steps" in failed, failed
    ddp, fsdp = (json.loads((job.out / "parity.json").read_text()) for job in jobs[1:])
    assert (ddp["difference"], ddp["passed"], ddp["tolerance"], ddp["oracle"]) == (0.0, True, 1e-5, "single")
    assert fsdp["passed"] is False and fsdp["difference"] > 1e-3


def test_a_run_off_its_cost_formula_fails_the_check_naming_it(
    gpu_check, single_train, clean_run, monkeypatch, tmp_path
):
    """A run whose activations are 64 bytes off their formula (a planted formula bug) fails the check,
    its row saying what differs, as the report's cost table does; its parameters are single's."""
    predicted_for_run = single_train.predicted_for_run

    def planted_formula(*args, **kwargs):
        held, why = predicted_for_run(*args, **kwargs)
        return held + 64, why

    monkeypatch.setattr(single_train, "predicted_for_run", planted_formula)
    planted = run_as_the_check_does(gpu_check, single_train, tmp_path / "planted")
    monkeypatch.undo()
    runs = {"single ×1 gpt fp32": clean_run, "ddp ×1 gpt fp32": planted}
    code, text, _ = check_runs(gpu_check, monkeypatch, tmp_path, runs)
    assert code == 1, text
    assert row_status(text, "single ×1 gpt fp32") == "passed"
    assert row_status(text, "ddp ×1 gpt fp32") == (
        "failed: activations **differs** (measured − formula): rank 0 -64 B"
    )


def test_parity_is_checked_only_where_single_makes_the_same_sums(gpu_check, tmp_path):
    """The project's oracle rule (distref.parity.oracle), no tolerance of the check's own: bf16 has no exact
    oracle; fp32 AdamW none for tensor parallelism (its row-wise sums); SGD and fp32 AdamW of a strategy
    that sums as single does, within 1e-5."""

    def record(impl: str, precision: str, optimizer: str) -> dict:
        config = {"precision": precision, "optimizer": optimizer, "steps": 40, "grad_accum": 1, "extra": {}}
        return {"impl": {"name": impl}, "world_size": 1, "config": config}

    missing = tmp_path / "none.pt"
    assert gpu_check.parity_check(record("ddp", "bf16", "adamw"), missing, missing)["not_checked"] == (
        "no exact oracle in bf16: the tolerances are fp32's and fp64's"
    )
    said = gpu_check.parity_check(record("tensor_parallel", "fp32", "adamw"), missing, missing)
    assert said["not_checked"].startswith("TP sums each row-wise layer's products across ranks")
    for impl, optimizer in (("tensor_parallel", "sgd"), ("fsdp", "adamw")):
        said = gpu_check.parity_check(record(impl, "fp32", optimizer), missing, missing)
        assert said == {
            "steps": 40,
            "precision": "fp32",
            "oracle": "single",
            "tolerance": 1e-5,
            "error": "no final.pt from this run or from single",
        }


def test_the_profiler_row_runs_the_steps_the_profiler_traces(gpu_check, tmp_path):
    """--profile needs 6 steps (it traces steps 3-5): the row runs them even in a 3-step rehearsal."""
    from distref.training.monitor import PROFILED_UNTIL

    assert {name: fewest for name, _, fewest in gpu_check.FEATURES}["profiler"] == PROFILED_UNTIL
    jobs, _ = gpu_check.plan_jobs(gpus=1, device="cpu", out=tmp_path, steps=3)
    profiler = next(job for job in jobs if job.name == "ddp ×1 profiler")
    assert profiler.argv[profiler.argv.index("--steps") + 1] == str(PROFILED_UNTIL)
