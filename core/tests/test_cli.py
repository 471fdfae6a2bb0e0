"""Bad input: one line on stderr, exit code 2, before any training (or any process) starts."""

import functools
import sys

import pytest
import torch

from distref.cli import parse_config
from distref.testing import ROOT, run_forked, run_script

BAD = [
    (["--global-batch-size", "0"], "--global-batch-size: must be a positive integer"),
    (["--global-batch-size", "abc"], "--global-batch-size: invalid"),
    (["--model", "gpt", "--dataset", "mnist"], "--model gpt does not train on --dataset mnist"),
    (["--model", "vgg"], "--model: 'vgg': choose from lenet, resnet18, gpt, gpt2, or give MODULE:FUNCTION"),
    (["--epochs", "1", "--steps", "5"], "not allowed with argument"),
    (["--global-batch-size", "10", "--grad-accum", "4"], "must be divisible by world size × --grad-accum"),
    (["--precision", "fp16", "--device", "cpu"], "--precision fp16 needs CUDA"),
    (["--target-accuracy", "1.5"], "must be in (0, 1]"),
    (["--lr", "-1"], "--lr: must be a finite number > 0"),
    (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
    (["--resume", "auto"], "--resume auto needs --checkpoint-dir"),
    (["--resume", "/nonexistent/ckpt.pt"], "no such checkpoint file"),
    (
        ["--dataset", "text", "--model", "gpt", "--data-root", "/nonexistent.txt"],
        "needs --data-root to be a text file",
    ),
    (["--profile"], "give --out DIR"),
    (["--data-root", "/etc/passwd"], "--data-root /etc/passwd: not a directory"),
    (["--data-root", "/etc/passwd/x"], "--data-root /etc/passwd/x: /etc/passwd is not a directory"),
]


@pytest.mark.parametrize(("argv", "message"), BAD)
def test_bad_values_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(argv, "single")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no usage block, no traceback
    assert message in err


WRITES_TO_D = ["--checkpoint-dir", "{d}", "--checkpoint-every", "2"]


@pytest.mark.parametrize(
    ("options", "said"),
    [
        # a new run into another run's folder, or branching from an older checkpoint into it
        (
            WRITES_TO_D,
            "--checkpoint-dir {d} already holds checkpoints of a run (the newest step-00000004.pt)",
        ),
        (
            [*WRITES_TO_D, "--resume", "{d}/step-00000002.pt"],
            "would write over --checkpoint-dir {d}'s step-00000004",
        ),
        (
            [*WRITES_TO_D, "--resume", "{other}/step-00000002.pt"],
            "--checkpoint-dir {d} holds checkpoints of another",
        ),
        # --save-final where a checkpoint's files go (parameters only: --resume auto would take it for one,
        # or it replaces one), there or not, resumed or not
        (
            ["--save-final", "{d}/step-00000004.pt"],
            "--save-final {d}/step-00000004.pt is where a checkpoint's",
        ),
        (["--save-final", "{other}/step-00000009.pt"], "is where a checkpoint's files go"),
        (["--save-final", "{d}/step-00000004/__0_0.distcp"], "is where a checkpoint's files go"),  # (DCP's)
        ([*WRITES_TO_D, "--resume", "auto", "--save-final", "{d}/step-00000004.pt"], "where a checkpoint's"),
        (
            ["--resume", "{d}/step-00000002.pt", "--save-final", "{d}/step-00000002.pt"],
            "where a checkpoint's",
        ),
        # an existing file: never in a new run; in a resumed one only an earlier --save-final (parameters only)
        (["--save-final", "{other}/final.pt"], "--save-final {other}/final.pt is a file already there"),
        (
            [*WRITES_TO_D, "--resume", "auto", "--save-final", "{other}/record.json"],
            "that no earlier --save-final",
        ),
    ],
)
def test_files_of_another_run_are_never_written_over(options, said, tmp_path, capsys):
    """--checkpoint-dir and --save-final, as --out: what another run wrote is refused in one line, and
    what a run may continue (its own newest checkpoint, its own --save-final) is not."""
    d, other = tmp_path / "d", tmp_path / "other"
    for folder in (d, other):
        folder.mkdir()
        for name in ("step-00000002.pt", "step-00000004.pt", "final.pt"):
            torch.save({"kept": 1}, folder / name)  # (a zip: --resume reads that much before anything)
        (folder / "record.json").write_text("{}")
    with pytest.raises(SystemExit) as exc:
        parse_config(["--dataset", "synthetic", *(o.format(d=d, other=other) for o in options)], "single")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and said.format(d=d, other=other) in err, err


def test_what_a_run_may_continue_is_not_refused(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    torch.save({"step": 4, "config": {}}, d / "step-00000004.pt")
    base = ["--dataset", "synthetic", "--checkpoint-dir", str(d), "--checkpoint-every", "2"]
    torch.save({"w": torch.zeros(2)}, tmp_path / "final.pt")  # an earlier session's --save-final
    for options in (
        ["--resume", "auto", "--save-final", str(tmp_path / "final.pt")],  # its own final, once more
        ["--resume", str(d / "step-00000004.pt")],  # the newest: nothing later to write over
        ["--checkpoint-every", "0"],  # writes no checkpoint
    ):
        assert parse_config([*base, *options], "single")


def test_a_restarted_attempt_continues_its_own_files(tmp_path, monkeypatch):
    """torchrun's --max-restarts: the restarted ranks parse the same options, and find the checkpoints and
    record the first attempt wrote: theirs, not another run's (they were refused, and the job with them)."""
    d = tmp_path / "d"
    d.mkdir()
    torch.save({"step": 4, "config": {}}, d / "step-00000004.pt")
    (tmp_path / "record.json").write_text("{}")
    argv = ["--dataset", "synthetic", "--checkpoint-dir", str(d), "--checkpoint-every", "2"]
    argv += ["--out", str(tmp_path)]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert parse_config(argv, "single")


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
    # --resume auto with no checkpoint yet starts a new run: it would write over the record as well.
    ckpt = tmp_path / "ckpt"
    with pytest.raises(SystemExit):
        parse_config(["--out", str(tmp_path), "--resume", "auto", "--checkpoint-dir", str(ckpt)], "single")
    assert "already holds a record.json" in capsys.readouterr().err
    ckpt.mkdir()
    (ckpt / "step-00000004.pt").write_bytes(b"")  # a checkpoint to continue: the record goes on
    assert parse_config(["--out", str(tmp_path), "--resume", "auto", "--checkpoint-dir", str(ckpt)], "single")
    assert (tmp_path / "record.json").read_text() == "{}"


def test_real_command_line_fails_fast_and_cleanly():
    result = run_script(
        [sys.executable, str(ROOT / "impls/single/train.py"), "--model", "gpt", "--dataset", "cifar10"]
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "single/train.py: error: --model gpt does not train on --dataset cifar10 (use one of: text, synthetic, masked)"
    ]


def test_a_data_root_that_cannot_be_created_is_refused(tmp_path, monkeypatch, capsys):
    import distref.config

    monkeypatch.setattr(distref.config.os, "access", lambda path, mode: False)  # root may write anywhere
    with pytest.raises(SystemExit):
        parse_config(["--data-root", str(tmp_path / "a" / "b")], "single")
    assert f"cannot be created ({tmp_path} is not writable)" in capsys.readouterr().err


def test_a_missing_data_root_is_created(tmp_path):
    """A data root that does not exist yet is fine (README: the dataset is prepared there)."""
    cfg = parse_config(["--data-root", str(tmp_path / "new" / "data")], "single")
    assert cfg.data_root == str(tmp_path / "new" / "data")
    assert parse_config(["--dataset", "synthetic", "--data-root", "/etc/passwd/x"], "single")  # not read


@pytest.mark.parametrize("impl", sorted(p.parent.name for p in (ROOT / "impls").glob("*/train.py")))
def test_help_works_with_plain_python_for_every_impl(impl):
    import tomllib

    with open(ROOT / "impls" / impl / "pyproject.toml", "rb") as f:
        launcher = tomllib.load(f)["tool"]["distref"]["launcher"]
    # Started as `python` starts it for one impl of each launcher; the others' files forked from the
    # fork server (the same file run as __main__, without the ~2 s of CPU of importing torch again).
    run = run_script if impl in ("single", "ddp") else run_forked
    result = run([sys.executable, str(ROOT / "impls" / impl / "train.py"), "-h"])
    assert result.returncode == 0, result.stderr
    assert "run contract (the same for every impl):" in result.stdout
    assert f"python impls/{impl}/train.py" in result.stdout  # the docstring's usage examples
    assert "(default: 64)" in result.stdout  # defaults shown
    # Collective timeouts and rank counts only where there are ranks.
    assert (
        ("--timeout SECONDS" in result.stdout)
        == ("--nproc-per-node N" in result.stdout)
        == (launcher == "torchrun")
    )


def test_launch_options_are_taken_out_of_what_the_ranks_get():
    from distref.distributed import without_launch_options

    argv = ["--nproc-per-node", "4", "--steps", "5", "--max-restarts=1", "--out", "x", "--max-restarts", "2"]
    assert without_launch_options(argv) == ["--steps", "5", "--out", "x"]


def test_defaults_yield_to_the_users_options():
    from distref.config import with_defaults

    defaults = {"--model": "lenet", "--epochs": "2", "--out": "runs/x"}
    assert with_defaults(defaults, ["--steps", "100", "--out=mine"]) == [
        "--model",
        "lenet",
        "--steps",
        "100",
        "--out=mine",
    ]
    assert with_defaults({"--steps": "5"}, ["--epochs", "1"]) == ["--epochs", "1"]
    assert with_defaults(defaults, []) == ["--model", "lenet", "--epochs", "2", "--out", "runs/x"]


# ---- every impl, the same table: bad input is one line and exit code 2 before any process group ----

IMPLS = sorted(p.parent.name for p in (ROOT / "impls").glob("*/train.py"))
# (impls it applies to, or None for all; the bad options; what the line says). {file} and {dir} are an
# existing file and folder: their contents must survive.
BAD_IN_EVERY_IMPL = [
    (None, ["--weight-decay", "-1"], "argument --weight-decay: must be a finite number >= 0, got -1"),
    (None, ["--weight-decay", "nan"], "argument --weight-decay: must be a finite number >= 0, got nan"),
    (None, ["--lr", "inf"], "argument --lr: must be a finite number > 0, got inf"),
    (None, ["--seed", "-1"], "argument --seed: must be in [0, 2**32 - 1], got -1"),
    (None, ["--seed", "4294967296"], "argument --seed: must be in [0, 2**32 - 1], got 4294967296"),
    (None, ["--global-batch-size", "32768"], "is larger than the synthetic training set"),
    (None, ["--out", "{file}"], "--out {file}: not a directory"),
    (None, ["--checkpoint-dir", "{file}"], "--checkpoint-dir {file}: not a directory"),
    (
        None,
        ["--save-final", "{file}/final.pt"],
        "--save-final {file}/final.pt: its folder {file}: not a directory",
    ),
    (None, ["--save-final", "{dir}"], "--save-final {dir}: a directory; give a file name"),
    (None, ["--out", "{dangling}"], "--out {dangling}: a symbolic link to nothing"),
    # Files another run wrote: never written over (the checkpoint and the file must survive)
    (None, ["--save-final", "{file}"], "--save-final {file} is a file already there, which this run would"),
    (
        None,
        ["--checkpoint-dir", "{checkpoints}", "--checkpoint-every", "2"],
        "--checkpoint-dir {checkpoints} already holds checkpoints of a run (the newest step-00000004.pt)",
    ),
    (None, ["--top-k", "2"], "--top-k shapes gpt's experts: give --experts too"),  # given, at its default
    (["deepspeed_zero"], ["--bucket-mb", "0"], "argument --bucket-mb: must be a finite number > 0, got 0"),
    (
        ["deepspeed_zero"],
        ["--bucket-mb", "inf"],
        "argument --bucket-mb: must be a finite number > 0, got inf",
    ),
    (["ddp"], ["--bucket-cap-mb", "nan"], "argument --bucket-cap-mb: must be a finite number > 0, got nan"),
    (["ddp"], ["--bucket-cap-mb", "0"], "argument --bucket-cap-mb: must be a finite number > 0, got 0"),
    (
        ["ddp", "deepspeed_zero", "fsdp", "model_parallel", "pipeline", "tensor_parallel"],
        ["--timeout", "inf"],
        "argument --timeout: must be a finite number > 0, got inf",
    ),
    (
        ["model_parallel"],
        ["--devices", "cpu,cpu", "--nproc-per-node", "4", "--max-restarts", "3"],
        "--nproc-per-node and --max-restarts are for runs of several ranks, but --devices cpu,cpu is one process",
    ),
]
BAD_CASES = [
    pytest.param(impl, args, message, id=f"{impl}-{'-'.join(args)}")
    for impl in IMPLS
    for impls, args, message in BAD_IN_EVERY_IMPL
    if impls is None or impl in impls
]


@functools.cache
def train_module(impl: str):
    from distref.testing import load_train_module

    return load_train_module(impl)


class Started(AssertionError):
    """Bad input got as far as loading data, starting ranks or a process group."""


@pytest.mark.parametrize(("impl", "args", "message"), BAD_CASES)
def test_bad_input_is_one_line_before_any_process_group_in_every_impl(
    impl, args, message, tmp_path, monkeypatch, capsys
):
    """Each impl's main(), in this process, with what would start work replaced by an error: the bad
    value must stop it first, in one line with exit code 2, and leave what exists as it was."""
    module = train_module(impl)

    def started(*args, **kwargs):
        raise Started(f"{impl} went on with bad input")

    for name in ("launch_ranks", "load_dataset"):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, started)
    monkeypatch.setattr(torch.distributed, "init_process_group", started)
    existing = tmp_path / "record.json"
    existing.write_text("kept")
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    checkpoint = tmp_path / "checkpoints" / "step-00000004.pt"
    checkpoint.parent.mkdir()
    checkpoint.write_text("kept")
    paths = {"file": str(existing), "dir": str(tmp_path), "dangling": str(tmp_path / "dangling")}
    paths["checkpoints"] = str(checkpoint.parent)
    own_model = ["--model", "gpt"] if impl == "tensor_parallel" else []  # made for gpt
    argv = [*own_model, "--dataset", "synthetic", *(a.format(**paths) for a in args)]
    with pytest.raises(SystemExit) as exc:
        module.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{impl}/train.py: error: "), err
    assert message.format(**paths) in err
    assert existing.read_text() == "kept" and checkpoint.read_text() == "kept"


@pytest.mark.parametrize("where", ["proc", "dangling-link"])
def test_a_data_root_that_cannot_be_created_is_one_line(where, tmp_path, capsys):
    """--data-root under /proc (writable to root by access(), yet no folder can be made there) or under a
    symbolic link to nothing: one line, exit 2, before anything runs (it was a FileNotFoundError or
    FileExistsError traceback from mkdir)."""
    from distref.testing import load_train_module

    if where == "proc":
        root, expected = "/proc/distref-data", "does not exist and cannot be created in /proc"
    else:
        (tmp_path / "link").symlink_to(tmp_path / "nowhere")
        root, expected = str(tmp_path / "link" / "data"), f"{tmp_path / 'link'} is a symbolic link to nothing"
    with pytest.raises(SystemExit) as exit_:
        load_train_module("single").main(["--data-root", root, "--steps", "1"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and expected in error, error
