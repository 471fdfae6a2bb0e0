"""The run record's schema, atomic checkpoints, and exact resume mid-epoch."""

import json
import resource

import jsonschema
import pytest
import torch

from distref.cli import parse_config
from distref.record import SCHEMA_PATH, RunRecord, load_record
from distref.testing import expected_time_to_target, max_relative_difference
from distref.training import checkpoint as ckpt
from distref.training import lr_factor, make_lr_schedule

FAST = [
    "--model",
    "lenet",
    "--dataset",
    "synthetic",
    "--global-batch-size",
    "32",
    "--optimizer",
    "sgd",
    "--lr",
    "0.05",
    "--log-every",
    "4",
]


def rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_record_follows_its_schema(single_train, tmp_path):
    out = tmp_path / "run"
    peak_before = rss_peak_bytes()
    single_train.main(
        [*FAST, "--steps", "30", "--eval-every", "10", "--target-accuracy", "0.25", "--out", str(out)]
    )
    record = load_record(out)
    jsonschema.validate(record, json.loads(SCHEMA_PATH.read_text()))
    assert record["status"] == "completed" and record["impl"]["name"] == "single"
    assert [s["step"] for s in record["steps"]] == list(range(30))
    assert [e["step"] for e in record["evals"]] == [10, 20, 30]
    # samples/s: global batch × timed steps / their time, the first (warm-up) step left out, and the step
    # whose communication was counted (slower: every operation through Python).
    assert record["communication"]["step"] == 2
    timed = [s["step_time_s"] for s in record["steps"][1:] if s["step"] != 2]
    assert record["samples_per_s"] == pytest.approx(32 * 28 / sum(timed), rel=1e-12)
    # Peak memory on CPU is this process's max RSS, which only grows: between before and after the run.
    assert peak_before <= record["peak_memory_bytes"][0] <= rss_peak_bytes()
    # Accuracy 0.19, 0.29, 0.25 (deterministic): the target is first reached at the second eval, and the
    # time is that eval's, not the last one's (also above the target).
    assert [e["accuracy"] >= 0.25 for e in record["evals"]] == [False, True, True]
    assert record["time_to_target_s"] == record["evals"][1]["elapsed_s"] > 0
    assert record["final_accuracy"] == record["evals"][-1]["accuracy"]
    steps_jsonl = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert steps_jsonl == record["steps"]
    assert record["config"]["global_batch_size"] == 32 and record["environment"]["backend"] == "none"


class FakeClock:
    """time.perf_counter for distref.record, moved by hand."""

    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_start_up_training_and_wall_time_are_three_clocks_summed_over_sessions(tmp_path, monkeypatch):
    """Wall time from the process's start; start-up from there to the first step; the run's clock (evals,
    time to target) from the first step, as MLPerf's; each summed over resumed sessions."""
    import distref.config
    import distref.record as rec

    clock = FakeClock(10.0)
    monkeypatch.setattr(rec.time, "perf_counter", clock)
    monkeypatch.setattr(rec, "seconds_since_process_start", lambda: 4.0)  # the process began at 6
    monkeypatch.setattr(distref.config, "PARSE_TIMES", [])
    monkeypatch.setattr(rec, "PARSE_TIMES", distref.config.PARSE_TIMES)
    monkeypatch.setattr(rec.sys, "argv", ["impls/single/train.py"])  # a process started to train
    monkeypatch.delenv("DISTREF_LAUNCHED_AT", raising=False)
    cfg = parse_config(["--dataset", "synthetic", "--target-accuracy", "0.5"], "single")
    record = rec.RunRecord("single", "0", cfg, 1, torch.device("cpu"), "none")
    clock.now = 13.0
    record.start_training()  # start-up: 13 - 6
    clock.now = 20.0
    record.add_eval(5, 0.1, 0.6, 1.0, 1.5)
    state = record.state()
    assert (record.data["startup_time_s"], record.data["evals"][0]["elapsed_s"]) == (7.0, 7.0)
    assert record.data["time_to_target_s"] == 7.0  # from the first step, start-up left out
    assert (state["startup_s"], state["wall_s"], state["elapsed_s"]) == (7.0, 14.0, 7.0)
    # A second session: a new process (started 2 s before its record), resumed from that state.
    distref.config.PARSE_TIMES.clear()
    clock.now = 100.0
    monkeypatch.setattr(rec, "seconds_since_process_start", lambda: 2.0)
    resumed = rec.RunRecord("single", "0", cfg, 1, torch.device("cpu"), "none")
    resumed.load_state({"record": state, "step": 5, "changes": {}}, tmp_path / "step.pt")
    clock.now = 101.0
    resumed.start_training()
    clock.now = 104.0
    resumed.add_eval(10, 0.2, 0.7, 0.9, 1.0)
    resumed.write()
    assert resumed.data["startup_time_s"] == 7.0 + 3.0
    assert resumed.data["evals"][1]["elapsed_s"] == 7.0 + 3.0
    assert resumed.data["wall_time_s"] == 14.0 + 6.0
    # main() run again in one process (tests, notebooks): its run starts when its options were parsed;
    # so does the first, in a process started for something else.
    monkeypatch.setattr(rec.time, "perf_counter", FakeClock(200.0))
    distref.config.PARSE_TIMES[:] = [50.0, 190.0]
    assert rec.RunRecord("single", "0", cfg, 1, torch.device("cpu"), "none").wall_time() == 10.0
    monkeypatch.setattr(rec.sys, "argv", ["ipykernel_launcher.py"])
    distref.config.PARSE_TIMES[:] = [195.0]
    assert rec.RunRecord("single", "0", cfg, 1, torch.device("cpu"), "none").wall_time() == 5.0
    # A rank that `python train.py --nproc-per-node N` started: from the launcher's start, 30 s ago.
    monkeypatch.setattr(rec.time, "time", lambda: 1000.0)
    monkeypatch.setenv("DISTREF_LAUNCHED_AT", "970.0")
    assert (
        rec.RunRecord("single", "0", cfg, 1, torch.device("cpu"), "none").wall_time() == 5.0
    )  # no rank: ignored
    for name, value in {
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }.items():
        monkeypatch.setenv(name, value)
    assert rec.RunRecord("single", "0", cfg, 1, torch.device("cpu"), "none").wall_time() == 30.0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # restarted: its own process start
    monkeypatch.setattr(rec.sys, "argv", ["train.py"])
    assert rec.RunRecord("single", "0", cfg, 1, torch.device("cpu"), "none").wall_time() == 2.0


def test_a_run_s_wall_time_counts_its_start_up_from_the_process_start(tmp_path):
    """`python train.py`: start-up (interpreter, imports, data, model) is in the record, and wall time
    is everything the process ran: at least start-up + training + evaluation, at most what was seen
    from outside."""
    import sys
    import time

    from distref.testing import ROOT, run_script

    started = time.perf_counter()
    result = run_script(
        [sys.executable, str(ROOT / "impls/single/train.py"), *FAST, "--steps", "5", "--out", str(tmp_path)]
    )
    seen = time.perf_counter() - started
    assert result.returncode == 0, result.stderr[-2000:]
    record = load_record(tmp_path)
    parts = record["startup_time_s"] + record["train_time_s"] + record["eval_time_s"]
    assert parts <= record["wall_time_s"] <= seen
    # Most of what was seen is start-up (torch's import alone takes seconds), not a few milliseconds.
    assert record["startup_time_s"] >= 0.5 * (seen - record["train_time_s"] - record["eval_time_s"])
    assert f"(start-up {record['startup_time_s']:.1f}s)" in result.stdout


def test_failed_run_leaves_a_failed_record(single_train, tmp_path, monkeypatch):
    out = tmp_path / "run"

    def broken_loss(logits, targets):
        raise FloatingPointError("loss exploded")

    monkeypatch.setattr(single_train, "loss_sum", broken_loss)
    with pytest.raises(FloatingPointError):
        single_train.main([*FAST, "--steps", "3", "--out", str(out)])
    record = load_record(out)
    assert record["status"] == "failed" and "loss exploded" in record["error"]


@pytest.mark.faults
def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    """A crash mid-write (disk full) leaves no file under a checkpoint's name; the previous one stays the newest."""
    good = ckpt.save_checkpoint(ckpt.checkpoint_path(tmp_path, 10), {"step": 10})

    def crash_mid_write(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash_mid_write)
    with pytest.raises(OSError):
        ckpt.save_checkpoint(ckpt.checkpoint_path(tmp_path, 20), {"step": 20})
    assert not ckpt.checkpoint_path(tmp_path, 20).exists()
    assert ckpt.latest_checkpoint(tmp_path) == good  # the half-written file never counts
    monkeypatch.undo()
    assert torch.load(good, weights_only=True) == {"step": 10}


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_resume_mid_epoch_ends_with_the_same_parameters(schedule, single_train, tmp_path):
    # 256 steps/epoch on synthetic data: step 10 is mid-epoch.
    ckpt_dir = tmp_path / "ckpt"
    FAST = [*globals()["FAST"], "--lr-schedule", schedule]
    args = [*FAST, "--steps", "20", "--checkpoint-dir", str(ckpt_dir), "--checkpoint-every", "10"]
    single_train.main([*args, "--save-final", str(tmp_path / "straight.pt"), "--out", str(tmp_path / "a")])
    assert ckpt.latest_checkpoint(ckpt_dir).name == "step-00000020.pt"
    single_train.main(
        [
            *FAST,
            "--steps",
            "20",
            "--resume",
            str(ckpt.checkpoint_path(ckpt_dir, 10)),
            "--save-final",
            str(tmp_path / "resumed.pt"),
            "--out",
            str(tmp_path / "b"),
        ]
    )
    straight = torch.load(tmp_path / "straight.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert max_relative_difference(resumed, straight) == 0.0  # bit-identical
    record = load_record(tmp_path / "b")
    assert [s["step"] for s in record["steps"]] == list(range(20))  # history restored from the checkpoint
    # The record notes the resume; only the options that differ from the checkpoint's run are listed.
    assert record["resumes"] == [
        {
            "step": 10,
            "checkpoint": str(ckpt.checkpoint_path(ckpt_dir, 10)),
            "changes": {
                "out": [str(tmp_path / "a"), str(tmp_path / "b")],
                "save_final": [str(tmp_path / "straight.pt"), str(tmp_path / "resumed.pt")],
                "checkpoint_dir": [str(ckpt_dir), None],
                "checkpoint_every": [10, 0],
            },
        }
    ]


def test_resume_auto_starts_fresh_without_checkpoints(single_train, tmp_path):
    record = single_train.main(
        [*FAST, "--steps", "4", "--resume", "auto", "--checkpoint-dir", str(tmp_path / "none")]
    )
    assert record["status"] == "completed" and len(record["steps"]) == 4


@pytest.mark.faults
def test_checkpoint_from_another_run_is_refused(single_train, tmp_path, capsys):
    """A checkpoint of another run (another --seed): refused in one line naming the option, exit code 2."""
    single_train.main([*FAST, "--steps", "4", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "4"])
    with pytest.raises(SystemExit) as exc:
        single_train.main(
            [*FAST, "--steps", "8", "--seed", "1", "--resume", "auto", "--checkpoint-dir", str(tmp_path)]
        )
    assert exc.value.code == 2
    assert "is from a different run (--seed 0 vs 1)" in capsys.readouterr().err


@pytest.mark.faults
def test_a_checkpoint_of_another_impl_or_a_final_state_is_refused(single_train, tmp_path, capsys):
    """A checkpoint another impl wrote (pipeline's, its stages by rank; model_parallel's, single's keys and
    its cut: a TypeError in the optimizer's load) or a --save-final file: refused in one line saying what
    it is, exit code 2 (it was a KeyError traceback)."""
    single_train.main([*FAST, "--steps", "4", "--save-final", str(tmp_path / "f.pt")])
    cfg = parse_config([*FAST, "--steps", "4"], "pipeline")
    record = RunRecord("pipeline", "0.10.0", cfg, 2, torch.device("cpu"), "gloo", write_files=False)
    pipeline_index = tmp_path / "step-4.pt"
    ckpt.save_checkpoint(
        pipeline_index, ckpt.checkpoint_state(cfg, 4, 4, record, stages_by_rank={}, scaler={})
    )
    # model_parallel's holds single's keys and more (each rank's parts, the cut): another layout, not single's
    cfg = parse_config([*FAST, "--steps", "4"], "model_parallel")
    record = RunRecord("model_parallel", "0.10.2", cfg, 2, torch.device("cpu"), "gloo", write_files=False)
    parts_index = tmp_path / "step-3.pt"
    parts = dict(model={}, optimizer={}, scaler={}, cut_points=[2])
    ckpt.save_checkpoint(parts_index, ckpt.checkpoint_state(cfg, 3, 4, record, **parts))
    for resume, said in (
        (pipeline_index, "is pipeline's (it holds scaler, stages_by_rank, not model, optimizer)"),
        (parts_index, "is model_parallel's (it holds cut_points, which this impl does not read)"),
        (tmp_path / "f.pt", "is not a checkpoint (a --save-final file holds parameters only)"),
    ):
        with pytest.raises(SystemExit) as exc:
            single_train.main([*FAST, "--steps", "8", "--resume", str(resume), "--out", str(tmp_path / "o")])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert not (tmp_path / "o").exists()  # refused before anything is written: no empty --out


def test_a_checkpoint_in_a_retired_format_is_refused_in_one_line(tmp_path):
    """pipeline's index before 0.10.0 (a file per stage rank, `stage_sha256`) is named as a format this
    version no longer reads, with what to do (not as another impl's)."""
    cfg = parse_config(["--dataset", "synthetic", "--steps", "4"], "pipeline")
    record = RunRecord("pipeline", "0.10.0", cfg, 2, torch.device("cpu"), "gloo", write_files=False)
    old_index = tmp_path / "step-00000002.pt"
    state = ckpt.checkpoint_state(cfg, 2, 4, record, stages_by_rank=[], stage_sha256={}, scaler={})
    ckpt.save_checkpoint(old_index, state)
    with pytest.raises(ckpt.CheckpointError) as refused:
        ckpt.load_checkpoint(old_index, cfg, 4, holds=("folder", "sha256", "scaler", "stages_by_rank"))
    assert "is in a format this version no longer reads: pipeline before 0.10.0" in str(refused.value)
    assert "\n" not in str(refused.value)


# ---- resume: what each option may do (README, "Resuming") ------------------------------------------


@pytest.mark.faults
def test_a_checkpoint_of_another_text_file_is_refused(single_train, tmp_path, capsys):
    """--dataset text: the file is the data (the report compares it as such): resuming on another file is
    another run, refused in one line (a file with another vocabulary would fail on the embedding's shape)."""
    for name, letters in (("a.txt", "abcdefgh"), ("b.txt", "hgfedcba")):
        (tmp_path / name).write_text((letters * 40 + "\n") * 10)
    args = [
        "--model",
        "gpt",
        "--dataset",
        "text",
        "--global-batch-size",
        "16",
        "--checkpoint-dir",
        str(tmp_path),
    ]
    single_train.main(
        [*args, "--data-root", str(tmp_path / "a.txt"), "--steps", "2", "--checkpoint-every", "2"]
    )
    with pytest.raises(SystemExit) as exc:
        single_train.main([*args, "--data-root", str(tmp_path / "b.txt"), "--steps", "4", "--resume", "auto"])
    assert exc.value.code == 2
    assert (
        f"is from a different run (--data-root {tmp_path / 'a.txt'} vs {tmp_path / 'b.txt'})"
        in capsys.readouterr().err
    )


def test_lr_schedule_is_a_function_of_the_step():
    cfg = parse_config(["--lr", "0.1", "--optimizer", "sgd"], "single")
    lrs = {}
    for start in (0, 7):
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr)
        if start:  # as after loading a checkpoint: the optimizer remembers the run's initial lr
            optimizer.param_groups[0]["initial_lr"] = cfg.lr
        scheduler = make_lr_schedule(cfg, optimizer, total=20, start_step=start)
        for _ in range(start, 20):
            lrs.setdefault(start, []).append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
    assert lrs[0][0] == 0.1 and lrs[0][10] == pytest.approx(0.05) and lrs[7] == lrs[0][7:]
    assert lrs[0] == [0.1 * lr_factor("cosine", s, 20) for s in range(20)]


@pytest.fixture
def checkpointed_run(single_train, tmp_path):
    """A 60-step run with evals every 10 steps and checkpoints every 30: returns (args, checkpoint dir)."""
    ckpt_dir = tmp_path / "ckpt"
    args = [*FAST, "--steps", "60", "--eval-every", "10", "--checkpoint-dir", str(ckpt_dir)]
    single_train.main([*args, "--checkpoint-every", "30", "--save-final", str(tmp_path / "straight.pt")])
    return args, ckpt_dir


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (["--lr", "0.5"], "--lr 0.05 vs 0.5"),
        (["--weight-decay", "0.5"], "--weight-decay 0.0 vs 0.5"),
        (["--optimizer", "adamw"], "--optimizer sgd vs adamw"),
        (["--global-batch-size", "64"], "--global-batch-size 32 vs 64"),
        (["--steps", "20"], "is at step 30, past the end of this run (20 steps): ask for at least 30 steps"),
    ],
)
def test_resume_refuses_options_it_cannot_honour(change, message, checkpointed_run, single_train, capsys):
    args, ckpt_dir = checkpointed_run
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        single_train.main([*args, *change, "--resume", str(ckpt.checkpoint_path(ckpt_dir, 30))])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_longer_run_on_resume_replans_the_schedule_and_says_so(
    checkpointed_run, single_train, tmp_path, capsys
):
    args, ckpt_dir = checkpointed_run
    out = tmp_path / "longer"
    capsys.readouterr()
    record = single_train.main(
        [*args, "--steps", "90", "--resume", str(ckpt.checkpoint_path(ckpt_dir, 30)), "--out", str(out)]
    )
    lr_was, lr_now = 0.05 * lr_factor("cosine", 30, 60), 0.05 * lr_factor("cosine", 30, 90)
    assert (
        f"the cosine lr schedule is re-planned over 90 steps: lr {lr_was:.3g} -> {lr_now:.3g}"
        in capsys.readouterr().out
    )
    changes = record["resumes"][0]["changes"]
    assert changes["steps"] == changes["total_steps"] == [60, 90]
    assert [s["step"] for s in record["steps"]] == list(range(90))
    assert [e["step"] for e in record["evals"]] == [10, 20, 30, 40, 50, 60, 70, 80, 90]


def test_longer_run_with_a_constant_lr_equals_one_planned_that_long(single_train, tmp_path):
    """With nothing to re-plan, extending a run on resume is exact: same as a run asked for 40 steps."""
    base = [*FAST, "--lr-schedule", "constant", "--checkpoint-dir", str(tmp_path / "c")]
    single_train.main([*base, "--steps", "20", "--checkpoint-every", "20"])
    single_train.main([*base, "--steps", "40", "--resume", "auto", "--save-final", str(tmp_path / "r.pt")])
    single_train.main(
        [*FAST, "--lr-schedule", "constant", "--steps", "40", "--save-final", str(tmp_path / "s.pt")]
    )
    resumed, straight = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in "rs")
    assert max_relative_difference(resumed, straight) == 0.0


def test_target_accuracy_given_on_resume_is_judged_over_the_whole_history(checkpointed_run, single_train):
    args, ckpt_dir = checkpointed_run
    resume = ["--resume", str(ckpt.checkpoint_path(ckpt_dir, 30))]
    record = single_train.main([*args, *resume, "--target-accuracy", "0.3"])
    # Accuracy 0.18 at step 10, 0.31 at step 20: reached before the checkpoint (step 30), in the history.
    assert [e["accuracy"] >= 0.3 for e in record["evals"][:2]] == [False, True]
    assert record["time_to_target_s"] == record["evals"][1]["elapsed_s"] == expected_time_to_target(record)
    # Resumed from the last checkpoint (step 60 of 60): no step, no eval, the target judged on history alone.
    finished = single_train.main(
        [*args, "--resume", str(ckpt.checkpoint_path(ckpt_dir, 60)), "--target-accuracy", "0.3"]
    )
    assert finished["time_to_target_s"] == finished["evals"][1]["elapsed_s"]
    assert [s["step"] for s in finished["steps"]] == list(range(60))
    unreachable = single_train.main([*args, *resume, "--target-accuracy", "1.0"])
    assert max(e["accuracy"] for e in unreachable["evals"]) < 1.0
    assert unreachable["time_to_target_s"] is None


def test_options_changed_on_resume_apply_and_are_recorded(checkpointed_run, single_train, tmp_path):
    """--grad-accum and --eval-every change how the rest of the run is computed and measured, not what it
    computes: allowed, applied, and listed in the record."""
    args, ckpt_dir = checkpointed_run
    record = single_train.main(
        [
            *args,
            "--grad-accum",
            "2",
            "--eval-every",
            "15",
            "--resume",
            str(ckpt.checkpoint_path(ckpt_dir, 30)),
            "--save-final",
            str(tmp_path / "resumed.pt"),
        ]
    )
    assert [e["step"] for e in record["evals"]] == [10, 20, 30, 45, 60]  # old cadence, then the new one
    assert record["resumes"][0]["changes"]["grad_accum"] == [1, 2]
    assert record["resumes"][0]["changes"]["eval_every"] == [10, 15]
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    straight = torch.load(tmp_path / "straight.pt", weights_only=True)
    assert 0 < max_relative_difference(resumed, straight) < 1e-5  # another summation order, same run


def test_gpt_depth_must_match_on_resume_and_older_checkpoints_mean_the_default(
    single_train, tmp_path, capsys
):
    """A checkpoint of gpt with 2 transformer blocks cannot continue with --gpt-layers 3 (one line, exit 2);
    a checkpoint written before --gpt-layers existed (no gpt_layers in its options) is read as the default."""
    args = ["--model", "gpt", "--dataset", "synthetic", "--global-batch-size", "16", "--optimizer", "sgd"]
    args += ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2"]
    single_train.main([*args, "--steps", "2"])
    path = ckpt.checkpoint_path(tmp_path, 2)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        single_train.main([*args, "--steps", "4", "--gpt-layers", "3", "--resume", str(path)])
    assert exc.value.code == 2 and "--gpt-layers 2 vs 3" in capsys.readouterr().err
    state = torch.load(path, weights_only=True)
    del state["config"]["gpt_layers"]
    torch.save(state, path)
    cfg = parse_config([*args, "--steps", "4", "--resume", str(path)], "single")
    assert ckpt.load_checkpoint(path, cfg, 4)["changes"] == {"steps": [2, 4], "total_steps": [2, 4]}


def run_single_until_exit(single_train, args: list[str], capsys) -> tuple[int, str, str]:
    """single's main in this process, expected to exit: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exited:
        single_train.main(args)
    out, err = capsys.readouterr()
    return exited.value.code, out, err


@pytest.mark.faults
def test_unreadable_checkpoints_are_named_in_one_line_and_auto_falls_back(single_train, tmp_path, capsys):
    """A truncated or corrupted checkpoint is named in one line; --resume auto falls back to the newest readable one."""
    ckpt_dir = tmp_path / "ckpt"
    args = [*FAST, "--steps", "12", "--checkpoint-dir", str(ckpt_dir), "--checkpoint-every", "4"]
    single_train.main([*args, "--save-final", str(tmp_path / "straight.pt")])
    newest, middle, oldest = (ckpt.checkpoint_path(ckpt_dir, s) for s in (12, 8, 4))
    # A copy cut short (no zip central directory) and a flipped byte inside the data (CRC mismatch).
    newest.write_bytes(newest.read_bytes()[:-200])
    data = bytearray(middle.read_bytes())
    data[len(data) // 2] ^= 0xFF
    middle.write_bytes(data)
    capsys.readouterr()
    for broken, why in ((newest, "is unreadable"), (middle, "fails its CRC check")):
        code, _, err = run_single_until_exit(
            single_train, [*FAST, "--steps", "12", "--resume", str(broken)], capsys
        )
        assert code == 2 and len(err.splitlines()) == 1, err
        assert str(broken) in err and why in err and "Traceback" not in err
    # --resume auto skips both, says so, and resumes from step 4: the run still ends bit-identical.
    single_train.main([*args, "--resume", "auto", "--save-final", str(tmp_path / "resumed.pt")])
    out = capsys.readouterr().out
    assert f"falling back to {oldest}" in out and str(newest) in out and str(middle) in out
    assert f"resumed from {oldest} at step 4" in out
    straight, resumed = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in ("straight", "resumed"))
    assert max_relative_difference(resumed, straight) == 0.0
    # A file named as the newest checkpoint that is none (parameters only, as --save-final writes) is
    # skipped as well, saying so.
    newest.write_bytes((tmp_path / "straight.pt").read_bytes())
    single_train.main([*FAST, "--steps", "12", "--checkpoint-dir", str(ckpt_dir), "--resume", "auto"])
    assert f"{newest} is not a checkpoint (parameters only" in capsys.readouterr().out
    # Nothing readable left: one line, exit 2, rather than silently training from step 0.
    for path in ckpt_dir.glob("step-*.pt"):
        path.write_bytes(b"not a checkpoint")
    code, out, err = run_single_until_exit(single_train, [*args, "--resume", "auto"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "no readable checkpoint" in err, err
    assert "resumed" not in out


@pytest.mark.faults
def test_a_diverged_run_stops_at_its_step_and_keeps_its_checkpoints(single_train, tmp_path, capsys):
    """nan loss: the run stops in one line naming the step, exit code 1; its checkpoints and a failed record stay."""
    out, ckpt_dir = tmp_path / "run", tmp_path / "ckpt"
    args = [
        "--model",
        "lenet",
        "--dataset",
        "synthetic",
        "--optimizer",
        "sgd",
        "--lr",
        "1e9",
        "--steps",
        "30",
    ]
    args += ["--log-every", "1", "--checkpoint-dir", str(ckpt_dir), "--checkpoint-every", "1"]
    args += ["--out", str(out), "--save-final", str(tmp_path / "final.pt")]
    code, _, _ = run_single_until_exit(single_train, args, capsys)
    record = load_record(out)
    first_bad = next(s["step"] for s in record["steps"] if s["loss"] is None) + 1  # 1-based, as printed
    assert (
        code
        == f"single: error: the loss is nan at step {first_bad}: training diverged; lower --lr (now 1e+09). Checkpoints from before it are kept"
    )
    assert record["status"] == "failed" and f"at step {first_bad}:" in record["error"]
    assert len(record["steps"]) == first_bad  # it stopped there
    jsonschema.validate(record, json.loads(SCHEMA_PATH.read_text()))  # nan is written as null: valid JSON
    # Every step before it was checkpointed; nothing after it, and no final model, was written.
    assert ckpt.latest_checkpoint(ckpt_dir) == ckpt.checkpoint_path(ckpt_dir, first_bad - 1)
    assert not (tmp_path / "final.pt").exists()
    assert torch.load(ckpt.latest_checkpoint(ckpt_dir), weights_only=True)["step"] == first_bad - 1


@pytest.mark.faults
def test_fp16_skipped_steps_are_counted_in_the_record_across_a_resume(single_train, tmp_path, monkeypatch):
    """fp16: a step whose scaled gradients overflow is skipped by the loss scaler; the record lists each
    one (as many as the scale was halved), and a resumed run keeps the list of the steps before it."""
    import math

    import distref.cli

    # The CLI asks fp16 for CUDA; torch's CPU autocast and GradScaler run the same algorithm here. The
    # scale starts at 2**40 (not 2**16) so that the first steps overflow for certain.
    monkeypatch.setattr(distref.cli, "uses_cuda", lambda cfg: True)
    monkeypatch.setattr(
        single_train,
        "make_grad_scaler",
        lambda cfg, device: torch.amp.GradScaler(
            device.type, init_scale=2.0**40, enabled=cfg.precision == "fp16"
        ),
    )
    ckpt_dir = tmp_path / "ckpt"
    args = [
        *FAST,
        "--precision",
        "fp16",
        "--device",
        "cpu",
        "--steps",
        "30",
        "--checkpoint-dir",
        str(ckpt_dir),
    ]
    single_train.main([*args, "--checkpoint-every", "10", "--out", str(tmp_path / "run")])
    skipped = load_record(tmp_path / "run")["skipped_steps"]
    final_scale = torch.load(ckpt.checkpoint_path(ckpt_dir, 30), weights_only=True)["scaler"]["scale"]
    halvings = round(math.log2(2.0**40 / final_scale))  # no growth in 30 steps (growth_interval 2000)
    assert 5 <= len(skipped) == halvings < 30 and skipped[0] == 0 and skipped == sorted(skipped)
    assert min(skipped) < 10 < max(skipped)  # skips on both sides of the resume point below

    single_train.main(
        [*args, "--resume", str(ckpt.checkpoint_path(ckpt_dir, 10)), "--out", str(tmp_path / "resumed")]
    )
    assert load_record(tmp_path / "resumed")["skipped_steps"] == skipped


def test_sequence_length_must_match_on_resume_given_or_not(single_train, tmp_path, capsys):
    """A checkpoint of gpt's task at its default 16 tokens continues with --sequence-length 16 (the same
    data) and is refused at 32, one line saying both lengths."""
    args = ["--model", "gpt", "--dataset", "synthetic", "--global-batch-size", "16", "--optimizer", "sgd"]
    args += ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2"]
    single_train.main([*args, "--steps", "2"])
    path = ckpt.checkpoint_path(tmp_path, 2)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        single_train.main([*args, "--steps", "4", "--sequence-length", "32", "--resume", str(path)])
    assert exc.value.code == 2 and "(--sequence-length 16 vs 32)" in capsys.readouterr().err
    cfg = parse_config([*args, "--steps", "4", "--sequence-length", "16", "--resume", str(path)], "single")
    assert ckpt.load_checkpoint(path, cfg, 4)["changes"] == {
        "steps": [2, 4],
        "sequence_length": [None, 16],
        "total_steps": [2, 4],
    }


@pytest.mark.parametrize(
    ("changed", "said"),
    [
        (["--experts", "2"], "(--experts 4 vs 2)"),
        (["--experts", "4", "--top-k", "1"], "(--top-k 2 vs 1)"),
        (["--experts", "4", "--balance-loss", "0.1"], "(--balance-loss 0.01 vs 0.1)"),
        ([], "(--experts 4 vs 0)"),
    ],
    ids=["experts", "top-k", "balance-loss", "dense"],
)
def test_the_mixture_of_experts_must_match_on_resume(changed, said, single_train, tmp_path, capsys):
    """A checkpoint of gpt with 4 experts, top-2, α 0.01 is another model (another router, another loss)
    than one with other experts, another k or α, or a dense one: refused in one line naming both."""
    args = ["--model", "gpt", "--dataset", "synthetic", "--global-batch-size", "16", "--optimizer", "sgd"]
    args += ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2"]
    single_train.main([*args, "--experts", "4", "--steps", "2"])
    path = ckpt.checkpoint_path(tmp_path, 2)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        single_train.main([*args, *changed, "--steps", "4", "--resume", str(path)])
    assert exc.value.code == 2 and said in capsys.readouterr().err
    single_train.main(
        [*args, "--experts", "4", "--steps", "4", "--resume", str(path)]
    )  # the same run: continues


def test_another_impl_continues_a_checkpoint_of_its_layout_and_the_record_says_which(single_train, tmp_path):
    """A checkpoint names the impl that wrote it: one whose state another reads as its own (single's
    whole state_dict, dataparallel's) is continued, and the record's `resumes` names both; the same impl
    records no change; a checkpoint from before core 0.20.0 says its writer was not recorded."""
    from distref.testing import load_train_module

    dataparallel = load_train_module("dataparallel")
    folder = tmp_path / "c"
    single_train.main([*FAST, "--steps", "4", "--checkpoint-dir", str(folder), "--checkpoint-every", "2"])
    assert torch.load(folder / "step-00000004.pt", weights_only=True)["impl"] == {
        "name": "single",
        "version": single_train.VERSION,
    }
    resumed = ["--steps", "6", "--checkpoint-dir", str(folder), "--resume", "auto"]
    by_dataparallel = dataparallel.main([*FAST, *resumed])
    impl_change = [f"single {single_train.VERSION}", f"dataparallel {dataparallel.VERSION}"]
    assert by_dataparallel["resumes"][0]["changes"]["impl"] == impl_change
    assert "impl" not in single_train.main([*FAST, *resumed])["resumes"][0]["changes"]
    older = torch.load(folder / "step-00000004.pt", weights_only=True)
    del older["impl"]
    ckpt.save_checkpoint(folder / "step-00000004.pt", older)
    changes = single_train.main([*FAST, *resumed])["resumes"][0]["changes"]
    assert changes["impl"] == ["not recorded", f"single {single_train.VERSION}"]
