"""impls/ddp proven equal to impls/single, converging on real MNIST, and surviving failures.

On this project's models (lenet, gpt, resnet18: their parameter names, shapes and accuracy targets);
test_parity_with_single_on_your_model gives the same proof on yours (distref.testing.own)."""

from __future__ import annotations

import json
import os
import socket
import sys

import pytest
import torch

from distref.cli import parse_config
from distref.record import RunRecord
from distref.testing import (
    COST_RUN,
    DATA_ROOT,
    FP64_TOLERANCE,
    GPU_PARITY,
    PARITY_TOLERANCE,
    batchnorm_args,
    check_activations_predicted,
    check_communication_predicted,
    check_killed_rank_ends_the_job,
    check_killed_rank_resumes_exactly,
    check_model_states_predicted,
    check_record_scores_the_saved_model,
    check_stopped_rank_is_named,
    counting_block_calls,
    expected_time_to_target,
    launch,
    load_train_module,
    max_relative_difference,
    mnist_convergence_args,
    parity_args,
    run_script,
    score_saved_model,
    self_launched,
    skip_where_torchvision_cannot_serve,
    tampered_mnist,
    torchrun,
    train_path,
)
from distref.testing.cost import PARTLY_TRAINED_RUN, check_partly_trained_predicted
from distref.testing.faults import LAUNCHERS
from distref.testing.own import check_parity_on_your_model
from distref.training.checkpoint import checkpoint_state, save_checkpoint

TRAIN = str(train_path("ddp"))
SYNTHETIC = ["--model", "lenet", "--dataset", "synthetic", "--optimizer", "sgd", "--lr", "0.01"]


def run_ddp(nproc: int, args: list[str], timeout: float = 300, extra_env: dict | None = None):
    result = launch(nproc, "ddp", args, timeout=timeout, env=extra_env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.parametrize("model", ["lenet", "gpt"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_parity_with_single(model, world_size, single_reference, tmp_path):
    final = tmp_path / "final.pt"
    run_ddp(
        world_size,
        [*parity_args(model), "--save-final", str(final)],
    )
    result = torch.load(final, weights_only=True)
    diff = max_relative_difference(result, single_reference(model))
    assert diff < PARITY_TOLERANCE, f"{model} at world {world_size}: max relative difference {diff:.2e}"
    if (model, world_size) == ("lenet", 2):
        # 2 ranks sum the same two half-batch gradients as single with --grad-accum 2, in the same order
        # (the 1/2 scaling is exact in binary): not merely close, equal. (Over long runs that is what tells
        # a bug from rounding: ddp ×2 vs plain single drifts to ~1e-1 in an epoch, ddp ×2 vs single
        # --grad-accum 2 stays exactly 0.)
        assert max_relative_difference(result, single_reference("lenet", 2)) == 0.0


def test_masked_targets_over_ranks_and_micro_batches_equal_plain_single(single_reference, tmp_path):
    """gpt on masked targets (a sample scores 1 to 8 of its 16): 2 ranks × --grad-accum 2, each micro-batch
    scoring its own number, equal plain single (the mean over the global batch's scored targets; the mean
    of the ranks' and micro-batches' means, 4 splits, was 1.7e-1 away). The logged loss is that global mean too."""
    args = [*parity_args("masked"), "--grad-accum", "2", "--log-every", "1"]
    run_ddp(2, [*args, "--save-final", str(tmp_path / "ddp.pt"), "--out", str(tmp_path / "o")])
    final = torch.load(tmp_path / "ddp.pt", weights_only=True)
    diff = max_relative_difference(final, single_reference("masked"))
    assert diff < PARITY_TOLERANCE, f"{diff:.2e} from plain single"
    first = json.loads((tmp_path / "o" / "record.json").read_text())["steps"][0]["loss"]
    single = load_train_module("single").main([*parity_args("masked"), "--steps", "1", "--log-every", "1"])
    assert first == pytest.approx(single["steps"][0]["loss"], rel=1e-6)


@pytest.mark.parametrize(
    ("options", "grad_accum"),
    [
        ([], 2),  # accumulation with no_sync(), counted per rank
        (["--static-graph", "--grad-as-bucket-view", "--bucket-cap-mb", "0.005"], 1),  # many small buckets
        (["--activation-checkpointing"], 2),
    ],
    ids=["grad-accum", "static-graph-bucket-view-small-buckets", "activation-checkpointing"],
)
def test_parity_with_ddp_options(options, grad_accum, single_reference, tmp_path):
    final = tmp_path / "final.pt"
    run_ddp(
        2,
        [
            *parity_args("lenet"),
            "--grad-accum",
            str(grad_accum),
            *options,
            "--save-final",
            str(final),
        ],
    )
    diff = max_relative_difference(
        torch.load(final, weights_only=True), single_reference("lenet", grad_accum)
    )
    assert diff < PARITY_TOLERANCE, diff


# SGD, not AdamW: AdamW normalises gradients, so it hardly sees their scale (a hook that summed instead of
# averaging moved AdamW's result by 1.7e-3 vs 1.6e-3 correct; with SGD: 0.24 vs 1.9e-3).
HOOK_WORKLOAD = ["--model", "lenet", "--dataset", "mnist", "--data-root", str(DATA_ROOT), "--steps", "20"]
HOOK_WORKLOAD += ["--global-batch-size", "32", "--optimizer", "sgd", "--lr", "0.05"]


@pytest.mark.parametrize(
    ("hook", "bound"),
    [("fp16", 1e-3), ("bf16", 1e-2)],  # measured: 1.5e-4 (10-bit mantissa), 1.9e-3 (7-bit mantissa)
)
def test_compression_hooks_train_close_to_single(hook, bound, single_train, tmp_path):
    single_train.main([*HOOK_WORKLOAD, "--save-final", str(tmp_path / "single.pt")])
    run_ddp(2, [*HOOK_WORKLOAD, "--comm-hook", hook, "--save-final", str(tmp_path / "ddp.pt")])
    final, reference = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in ("ddp", "single"))
    diff = max_relative_difference(final, reference)
    assert 10 * PARITY_TOLERANCE < diff < bound, diff  # compressed: measurably not exact, yet close


def test_powersgd_result_is_multiplied_back_into_a_sum(monkeypatch):
    """PowerSGD averages inside its hook (no option to sum); ddp wraps it to multiply the result back by
    the world size. (PowerSGD itself runs only on NCCL: refused on gloo, below.)"""
    ddp = load_train_module("ddp")
    monkeypatch.setattr(ddp.dist, "get_world_size", lambda group=None: 3)

    def averaging_hook(state, bucket):  # three ranks holding this same gradient: their mean is it
        done = torch.futures.Future()
        done.set_result((bucket + bucket + bucket) / 3)
        return done

    summed = ddp.times_world_size(averaging_hook)(None, torch.full((4,), 2.0))
    assert torch.equal(summed.wait(), torch.full((4,), 6.0))  # the three ranks' sum


def test_powersgd_is_refused_on_cpu_before_training():
    result = launch(
        2, "ddp", ["--comm-hook", "powersgd", "--device", "cpu", "--dataset", "synthetic"], timeout=120
    )
    assert result.returncode != 0
    assert "--comm-hook powersgd is not reliable on gloo" in result.stderr
    assert result.stderr.count("powersgd is not reliable") == 1  # said once (rank 0), not once per rank


@pytest.mark.faults
def test_batch_not_divisible_by_world_size_is_one_line(tmp_path):
    """A global batch the ranks cannot split: one line (rank 0's), before any process group."""
    result = launch(4, "ddp", ["--dataset", "synthetic", "--global-batch-size", "6"], timeout=120)
    assert result.returncode != 0
    assert result.stderr.count("must be divisible by world size × --grad-accum = 4 × 1 = 4") == 1


def python_train(args: list[str], timeout: float = 300):
    """`python impls/ddp/train.py ARGS`, outside torchrun: the file starts its own ranks."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "MASTER_ADDR", "RANK", "WORLD_SIZE")
    }
    return run_script([sys.executable, TRAIN, *args], env=env, timeout=timeout)


def test_plain_python_starts_the_ranks_itself_with_the_same_result(single_reference, tmp_path):
    """`python train.py --nproc-per-node 2` = `torchrun --nproc-per-node 2 train.py`: bit-identical to
    single --grad-accum 2, like the torchrun run of the test above."""
    result = python_train(
        ["--nproc-per-node", "2", *parity_args("lenet"), "--save-final", str(tmp_path / "f.pt")]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "ddp: starting 2 ranks: torchrun --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:0 --local-addr=127.0.0.1 --nproc-per-node=2"
        in result.stdout
    )
    final = torch.load(tmp_path / "f.pt", weights_only=True)
    assert max_relative_difference(final, single_reference("lenet", 2)) == 0.0


@pytest.mark.faults
def test_plain_python_refuses_bad_input_before_starting_any_rank():
    """Bad input to `python train.py`: one line, exit code 2, and no rank started."""
    result = python_train(["--nproc-per-node", "3", "--dataset", "synthetic", "--global-batch-size", "8"])
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1:] == [  # (torch may warn before it, where numpy is missing)
        "ddp/train.py: error: --global-batch-size 8 must be divisible by world size × --grad-accum "
        "= 3 × 1 = 3"
    ]
    assert "Traceback" not in result.stderr
    assert "starting" not in result.stdout  # no rank was started


@pytest.mark.faults
def test_a_failing_rank_ends_the_job_in_one_line_naming_it(single_train, tmp_path):
    """A rank that fails (resuming a checkpoint of another run, which only the ranks read): the job ends,
    one line naming the rank under its error; exit code 2, the rank's own (bad input it found)."""
    args = ["--dataset", "synthetic", "--steps", "2", "--global-batch-size", "16"]
    single_train.main([*args, "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2"])
    result = python_train([*args, "--seed", "1", "--resume", str(tmp_path / "step-00000002.pt")])
    assert result.returncode == 2
    # The rank's own line, and nothing of torchrun's after it ("failed (exitcode: 2)", "Sending process")
    assert result.stderr.endswith("is from a different run (--seed 0 vs 1)\n"), result.stderr[-2000:]
    assert "exitcode" not in result.stderr and "SIGTERM" not in result.stderr


def test_a_text_file_too_short_to_train_on_is_one_line_before_any_rank(tmp_path):
    too_short = tmp_path / "short.txt"
    too_short.write_text("too short to train on\n")
    result = python_train(["--model", "gpt", "--dataset", "text", "--data-root", str(too_short)])
    assert result.returncode == 2 and "starting" not in result.stdout
    assert result.stderr.splitlines()[-1] == (
        f"ddp/train.py: error: {too_short} is too short: need at least 641 characters"
    )


def test_launch_options_are_refused_under_torchrun():
    result = torchrun(2, "ddp", ["--nproc-per-node", "2", "--dataset", "synthetic"], timeout=120)
    assert result.returncode != 0
    assert result.stderr.count("--nproc-per-node/--max-restarts start ranks from plain python") == 1


def test_records_describe_the_saved_model(mnist_root, single_train, tmp_path):
    """Rank 0's record must hold the global numbers: per-step losses averaged over ranks (equal to single's
    losses on the whole batch), and a test accuracy equal to that of the model --save-final wrote, scored
    alone. 3 ranks: test-set shards of unequal size (10000 / 3)."""
    args = [*parity_args("lenet"), "--global-batch-size", "48", "--eval-every", "10"]
    run_ddp(3, [*args, "--save-final", str(tmp_path / "ddp.pt"), "--out", str(tmp_path / "ddp")])
    single = single_train.main([*args, "--out", str(tmp_path / "single")])
    record = json.loads((tmp_path / "ddp" / "record.json").read_text())
    assert record["final_accuracy"] == score_saved_model(tmp_path / "ddp.pt", args)
    ddp_losses = torch.tensor([s["loss"] for s in record["steps"]])
    single_losses = torch.tensor([s["loss"] for s in single["steps"]])
    torch.testing.assert_close(ddp_losses, single_losses, rtol=1e-5, atol=0)
    assert [e["accuracy"] for e in record["evals"]] == pytest.approx([e["accuracy"] for e in single["evals"]])


def test_batchnorm_model_is_evaluated_with_rank_0s_statistics(tmp_path):
    """On CPU each rank's BatchNorm keeps its own running statistics (no SyncBatchNorm): the recorded
    accuracy must be that of the model rank 0 saves, not a mix of two models' halves."""
    args = batchnorm_args(6)
    skip_where_torchvision_cannot_serve(args)
    run_ddp(2, [*args, "--save-final", str(tmp_path / "final.pt"), "--out", str(tmp_path / "out")])
    record = json.loads((tmp_path / "out" / "record.json").read_text())
    check_record_scores_the_saved_model(record, tmp_path / "final.pt", args)


def test_static_graph_with_grad_accum_is_refused_in_one_line(capsys):
    ddp = load_train_module("ddp")
    with pytest.raises(SystemExit) as exc:
        argv = ["--dataset", "synthetic", "--static-graph", "--grad-accum", "2"]
        ddp.parse_options(argv, 2)
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        "ddp/train.py: error: --static-graph cannot be combined with --grad-accum > 1 (no_sync) in torch "
        "2.13; drop one\n"
    )


@pytest.mark.faults
def test_bad_data_root_is_one_line_before_any_process_group(tmp_path):
    """A --data-root that cannot be a folder: one line, before any process group."""
    result = launch(2, "ddp", ["--data-root", "/etc/passwd/x"], timeout=120)
    assert result.returncode != 0
    assert result.stderr.count("--data-root /etc/passwd/x: /etc/passwd is not a directory") == 1
    assert "NotADirectoryError" not in result.stderr


@pytest.mark.faults
def test_an_altered_dataset_is_one_line_before_any_rank_starts(mnist_root, tmp_path):
    """`python train.py` prepares and md5-checks the dataset once, before starting the ranks: a file that
    is not the published one stops it in one line (exit 2), and no rank ever starts."""
    labels = tampered_mnist(mnist_root, tmp_path)
    result = self_launched("ddp", ["--nproc-per-node", "2", "--data-root", str(tmp_path)], timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ddp: error: {labels}") and "refusing to use it" in last
    assert "Traceback" not in result.stderr and "starting" not in result.stdout


@pytest.mark.faults
def test_a_checkpoint_of_another_impl_is_one_line_from_the_ranks(tmp_path):
    """--resume on a checkpoint another impl wrote (a pipeline index: its stages by rank, no model): every
    rank refuses it before loading anything, one line and exit 2, not a KeyError traceback per rank."""
    cfg = parse_config([*SYNTHETIC, "--steps", "4"], "pipeline")
    index = tmp_path / "step-2.pt"
    record = RunRecord("pipeline", "0.10.0", cfg, 2, torch.device("cpu"), "gloo", write_files=False)
    save_checkpoint(index, checkpoint_state(cfg, 2, 4, record, stages_by_rank={0: "step-2.0.pt"}, scaler={}))
    result = self_launched(
        "ddp", ["--nproc-per-node", "2", *SYNTHETIC, "--steps", "4", "--resume", str(index)]
    )
    assert result.returncode == 2, result.stderr[-2000:]
    said = (
        f"ddp: error: checkpoint {index} is pipeline's (it holds scaler, stages_by_rank, not model, "
        "optimizer): resume it with the impl that wrote it"
    )
    assert result.stderr.strip().splitlines()[-1] == said  # the rank's line alone, not torchrun's
    assert (
        "Traceback" not in result.stderr
        and "KeyError" not in result.stderr
        and "SIGTERM" not in result.stderr
    )


@pytest.fixture
def ddp_in_this_process(monkeypatch):
    """Run impls/ddp's main() here as a world of 1 (gloo), so a test can look inside the DDP object.
    Returns run(argv) -> (record, the DDP module)."""
    ddp = load_train_module("ddp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    for key, value in {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    wrapped = []
    apply_ddp = ddp.apply_ddp
    monkeypatch.setattr(ddp, "apply_ddp", lambda *a: wrapped.append(apply_ddp(*a)) or wrapped[-1])

    def run(argv: list[str]):
        try:
            record = ddp.main(argv)
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        return record, wrapped[-1]

    return ddp, run


def test_ddp_options_take_effect(ddp_in_this_process):
    """Not only that results match (test_parity_with_ddp_options): DDP really built small buckets, a
    static graph and bucket-view gradients (activation checkpointing: the next test)."""
    _, run = ddp_in_this_process
    args = ["--model", "lenet", "--dataset", "synthetic", "--steps", "4", "--global-batch-size", "8"]
    _, plain = run(args)
    default = plain._get_ddp_logging_data()
    assert default["rebuilt_bucket_sizes"] == "87360"  # lenet's 21,840 fp32 gradients: one 25 MB bucket
    assert default.get("static_graph", 0) == 0 and default["gradient_as_bucket_view"] == 0
    assert plain.find_unused_parameters is False  # (lenet: every parameter used)
    _, looking = run([*args, "--find-unused-parameters"])
    assert looking.find_unused_parameters is True
    options = ["--static-graph", "--grad-as-bucket-view", "--bucket-cap-mb", "0.005"]
    _, tuned = run([*args, *options])
    data = tuned._get_ddp_logging_data()
    assert data["rebuilt_bucket_sizes"] == "66240, 20000, 1120"  # a 5 KB cap: 3 buckets
    assert data["static_graph"] == 1 and data["gradient_as_bucket_view"] == 1


def test_activation_checkpointing_recomputes_under_ddp(ddp_in_this_process, tmp_path, monkeypatch):
    ddp, run = ddp_in_this_process
    calls = counting_block_calls(ddp, monkeypatch)
    args = ["--model", "lenet", "--dataset", "synthetic", "--steps", "3", "--global-batch-size", "8"]
    args += ["--eval-every", "100"]  # one eval at the end
    run(args)
    plain = dict(calls)
    run([*args, "--activation-checkpointing"])
    assert {name: calls[name] - plain[name] for name in calls} == dict.fromkeys(calls, 3)


@pytest.mark.slow
def test_lenet_reaches_98_5_percent_on_real_mnist(mnist_root, tmp_path):
    run_ddp(
        2,
        [
            *mnist_convergence_args(mnist_root),
            "--out",
            str(tmp_path),
        ],
        timeout=600,
    )
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["world_size"] == 2 and record["environment"]["backend"] == "gloo"
    assert record["final_accuracy"] >= 0.985, record["evals"]
    assert record["time_to_target_s"] == expected_time_to_target(record) > 0
    assert len(record["peak_memory_bytes"]) == 2 and min(record["peak_memory_bytes"]) > 100 * 2**20


# ---- failures: a killed rank ------------------------------------------------------------------------

ELASTIC = [
    *SYNTHETIC,
    "--steps",
    "400",
    "--global-batch-size",
    "32",
    "--checkpoint-every",
    "50",
    "--resume",
    "auto",
]


@pytest.mark.slow
@pytest.mark.faults
def test_killed_rank_restarts_from_checkpoint_with_the_same_result(tmp_path):
    """A SIGKILLed rank under --max-restarts 1: the job resumes from its last checkpoint and ends bit-identical to an uninterrupted run."""
    single = [*SYNTHETIC, "--steps", "400", "--global-batch-size", "32", "--grad-accum", "2"]  # 2 ranks
    check_killed_rank_resumes_exactly("ddp", ELASTIC, 400, tmp_path, single, launcher=LAUNCHERS)


@pytest.mark.slow
@pytest.mark.faults
def test_killed_rank_without_restarts_ends_the_job_naming_it(tmp_path):
    """A SIGKILLed rank ends the job within 60 s; torchrun's report names it."""
    check_killed_rank_ends_the_job("ddp", ELASTIC, tmp_path, launcher=LAUNCHERS)


@pytest.mark.faults
def test_stopped_rank_is_named_once_the_timeout_passes(tmp_path):
    """A SIGSTOPped rank: one line names it after --timeout (5 s here), exit code 1."""
    check_stopped_rank_is_named("ddp", [*SYNTHETIC, "--steps", "100000"], tmp_path, launcher=LAUNCHERS)


@pytest.mark.faults
def test_a_diverged_run_stops_every_rank_in_one_line(tmp_path):
    """nan loss: every rank stops at the same flush, rank 0 alone names the step, exit code 1."""
    out = tmp_path / "out"
    args = [*SYNTHETIC, "--optimizer", "sgd", "--lr", "1e9", "--steps", "30", "--out", str(out)]
    result = self_launched("ddp", ["--nproc-per-node", "2", *args], timeout=120)
    assert result.returncode == 1
    named = [line for line in result.stderr.splitlines() if "training diverged" in line]
    record = json.loads((out / "record.json").read_text())
    first_bad = next(s["step"] for s in record["steps"] if s["loss"] is None) + 1
    assert named == [
        f"ddp: error: the loss is nan at step {first_bad}: training diverged; lower --lr (now 1e+09). "
        "Checkpoints from before it are kept"
    ]
    assert record["status"] == "failed" and "Traceback" not in result.stderr


def test_fp64_equals_plain_single_at_three_ranks_with_adamw_and_accumulation(tmp_path):
    """fp64 (the parity matrix's proof where fp32 AdamW cannot be exact): 3 ranks × --grad-accum 2 against
    plain single; `nox -s parity` runs every world size, accumulation and optimizer."""
    args = ["--model", "lenet", "--dataset", "synthetic", "--steps", "10", "--global-batch-size", "48"]
    args += ["--precision", "fp64", "--optimizer", "adamw", "--lr", "0.01"]
    result = launch(3, "ddp", [*args, "--grad-accum", "2", "--save-final", str(tmp_path / "ddp.pt")])
    assert result.returncode == 0, result.stderr[-3000:]
    load_train_module("single").main([*args, "--save-final", str(tmp_path / "single.pt")])
    ddp, single = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in ("ddp", "single"))
    assert all(v.dtype == torch.float64 for v in ddp.values() if v.is_floating_point())
    assert 0 < max_relative_difference(ddp, single) < FP64_TOLERANCE  # summed in another order, yet equal


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ CUDA GPUs (NCCL; one rank per GPU)")
def test_two_gpus_match_single(single_train, tmp_path):
    """`nox -s ddp-gpu`'s path: NCCL, one rank per GPU, equal to single --grad-accum 2 (fp64 on CUDA)."""
    args = [*parity_args("lenet"), *GPU_PARITY, "--out", str(tmp_path / "ddp")]
    run_ddp(2, [*args, "--save-final", str(tmp_path / "ddp.pt")])
    single_train.main(
        [*parity_args("lenet"), *GPU_PARITY, "--grad-accum", "2", "--save-final", str(tmp_path / "s.pt")]
    )
    final, reference = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in ("ddp", "s"))
    assert max_relative_difference(final, reference) < FP64_TOLERANCE
    record = json.loads((tmp_path / "ddp" / "record.json").read_text())
    assert record["environment"]["backend"] == "nccl" and len(record["peak_memory_bytes"]) == 2


@pytest.mark.parametrize(
    "world_size, extra",
    [
        (2, ["--model", "lenet", "--activation-checkpointing"]),
        (
            3,
            ["--model", "lenet", "--grad-accum", "2", "--optimizer", "sgd"],
        ),  # still one all-reduce per bucket and step
        (3, ["--model", "gpt", "--bucket-cap-mb", "0.05"]),  # several buckets
        (2, ["--model", "lenet", "--comm-hook", "bf16"]),  # half the bytes
        (2, ["--model", "lenet", "--comm-hook", "bf16", "--precision", "fp64"]),  # a quarter
        (2, ["--model", "resnet18", "--grad-accum", "2", "--global-batch-size", "8"]),  # BatchNorm buffers
        (2, ["--model", "gpt", "--precision", "bf16", "--grad-accum", "2"]),  # autocast's copies
    ],
    ids=[
        "w2",
        "w3-accum",
        "w3-gpt-buckets",
        "w2-bf16",
        "w2-bf16-fp64",
        "w2-resnet-buffers",
        "w2-gpt-autocast",
    ],
)
def test_cost_equals_the_formulas(world_size, extra, tmp_path):
    """What one step sends, counted at the dispatcher, equals distref.cost.data_parallel.ddp exactly, and
    each rank's model states distref.cost.memory.replicated."""
    skip_where_torchvision_cannot_serve(extra)
    run_ddp(world_size, [*COST_RUN, *extra, "--out", str(tmp_path)])
    record = check_communication_predicted(tmp_path, world_size)
    check_model_states_predicted(record)
    check_activations_predicted(record)
    all_reduce = record["communication"]["measured"][0]["all_reduce"]
    assert all_reduce["calls"] >= (2 if "--bucket-cap-mb" in extra else 1)


@pytest.mark.parametrize(
    "world_size, extra",
    [
        (2, []),  # an unused parameter: find_unused_parameters, and its map all-reduced every step
        # 100-byte buckets, filled in backward's order after the unused gradients: 5 (6 had they come last)
        (3, ["--grad-accum", "2", "--bucket-cap-mb", "0.0000954"]),
        (2, ["--model", "distref.testing.partly_trained:frozen_mlp"]),  # frozen only: left out of buckets
    ],
    ids=["w2-frozen-and-unused", "w3-accum-small-buckets", "w2-frozen"],
)
def test_cost_of_frozen_and_unused_parameters_equals_the_formulas(world_size, extra, tmp_path):
    """A model of yours with frozen and unused parameters: DDP's buckets hold the trainable ones (an
    unused one's zero gradient too), gradients and optimizer state only those that receive a gradient."""
    run_ddp(world_size, [*PARTLY_TRAINED_RUN, *extra, "--out", str(tmp_path)])
    check_partly_trained_predicted(json.loads((tmp_path / "record.json").read_text()))


def test_parity_with_single_on_your_model(tmp_path):
    """The parity proof on your model and data (distref.testing.own's example MLP where none is named).
    Yours: DISTREF_TEST_MODEL=MODULE:FUNCTION [DISTREF_TEST_DATASET=MODULE:FUNCTION] python -m pytest
    -k your_model"""
    check_parity_on_your_model(lambda args: run_ddp(2, args), tmp_path)
