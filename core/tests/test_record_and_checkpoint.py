"""The run record's schema, atomic checkpoints, and exact resume mid-epoch."""

import json

import jsonschema
import pytest
import torch

from conftest import max_relative_difference
from distref import checkpoint as ckpt
from distref.record import SCHEMA_PATH, load_record

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


def test_record_follows_its_schema(single_train, tmp_path):
    out = tmp_path / "run"
    single_train.main(
        [*FAST, "--steps", "30", "--eval-every", "10", "--target-accuracy", "0.25", "--out", str(out)]
    )
    record = load_record(out)
    jsonschema.validate(record, json.loads(SCHEMA_PATH.read_text()))
    assert record["status"] == "completed" and record["impl"] == {"name": "single", "version": "0.1.0"}
    assert [s["step"] for s in record["steps"]] == list(range(30))
    assert [e["step"] for e in record["evals"]] == [10, 20, 30]
    assert record["samples_per_s"] > 0 and record["peak_memory_bytes"][0] > 0
    assert (
        record["time_to_target_s"] is not None and record["final_accuracy"] == record["evals"][-1]["accuracy"]
    )
    steps_jsonl = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert steps_jsonl == record["steps"]
    assert record["config"]["global_batch_size"] == 32 and record["environment"]["backend"] == "none"


def test_failed_run_leaves_a_failed_record(single_train, tmp_path, monkeypatch):
    out = tmp_path / "run"

    def broken_loss(logits, targets):
        raise FloatingPointError("loss exploded")

    monkeypatch.setattr(single_train, "loss_fn", broken_loss)
    with pytest.raises(FloatingPointError):
        single_train.main([*FAST, "--steps", "3", "--out", str(out)])
    record = load_record(out)
    assert record["status"] == "failed" and "loss exploded" in record["error"]


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
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


def test_resume_mid_epoch_ends_with_the_same_parameters(single_train, tmp_path):
    # 256 steps/epoch on synthetic data: step 10 is mid-epoch.
    ckpt_dir = tmp_path / "ckpt"
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


def test_resume_auto_starts_fresh_without_checkpoints(single_train, tmp_path):
    record = single_train.main(
        [*FAST, "--steps", "4", "--resume", "auto", "--checkpoint-dir", str(tmp_path / "none")]
    )
    assert record["status"] == "completed" and len(record["steps"]) == 4


def test_checkpoint_from_another_run_is_refused(single_train, tmp_path, capsys):
    single_train.main([*FAST, "--steps", "4", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "4"])
    with pytest.raises(SystemExit) as exc:
        single_train.main(
            [*FAST, "--steps", "8", "--seed", "1", "--resume", "auto", "--checkpoint-dir", str(tmp_path)]
        )
    assert exc.value.code == 2
    assert "is from a different run (--seed 0 vs 1)" in capsys.readouterr().err
