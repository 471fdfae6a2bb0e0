"""Bad input: one line on stderr, exit code 2, before any training (or any process) starts."""

import sys

import pytest

from conftest import ROOT, run_script
from distref.config import parse_config

BAD = [
    (["--global-batch-size", "0"], "--global-batch-size: must be a positive integer"),
    (["--global-batch-size", "abc"], "--global-batch-size: invalid"),
    (["--model", "gpt", "--dataset", "mnist"], "--model gpt does not train on --dataset mnist"),
    (["--model", "vgg"], "--model: invalid choice"),
    (["--epochs", "1", "--steps", "5"], "not allowed with argument"),
    (["--global-batch-size", "10", "--grad-accum", "4"], "must be divisible by world size × --grad-accum"),
    (["--precision", "fp16", "--device", "cpu"], "--precision fp16 needs CUDA"),
    (["--target-accuracy", "1.5"], "must be in (0, 1]"),
    (["--lr", "-1"], "--lr: must be > 0"),
    (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
    (["--resume", "auto"], "--resume auto needs --checkpoint-dir"),
    (["--resume", "/nonexistent/ckpt.pt"], "no such checkpoint file"),
    (
        ["--dataset", "text", "--model", "gpt", "--data-root", "/nonexistent.txt"],
        "needs --data-root to be a text file",
    ),
    (["--profile"], "give --out DIR"),
]


@pytest.mark.parametrize(("argv", "message"), BAD)
def test_bad_values_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(argv, "single")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no usage block, no traceback
    assert message in err


def test_world_size_is_part_of_the_batch_check(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--global-batch-size", "6"], "ddp", world_size=4)
    assert "= 4 × 1 = 4" in capsys.readouterr().err
    assert parse_config(["--global-batch-size", "8"], "ddp", world_size=4).global_batch_size == 8


def test_existing_record_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "record.json").write_text("{}")
    with pytest.raises(SystemExit):
        parse_config(["--out", str(tmp_path)], "single")
    assert "already holds a record.json" in capsys.readouterr().err
    assert (tmp_path / "record.json").read_text() == "{}"


def test_real_command_line_fails_fast_and_cleanly():
    result = run_script(
        [sys.executable, str(ROOT / "impls/single/train.py"), "--model", "gpt", "--dataset", "cifar10"]
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "single/train.py: error: --model gpt does not train on --dataset cifar10 (use one of: text, synthetic)"
    ]
