"""impls/deepspeed_zero proven equal to impls/single at every ZeRO stage, partitioning what each stage
promises, converging on real MNIST, and resuming exactly.

On this project's models (lenet, gpt, resnet18: their parameter names, shapes and accuracy targets);
test_parity_with_single_on_your_model gives the same proof on yours (distref.testing.own)."""

from __future__ import annotations

import inspect
import json
import re
import sys

import pytest
import torch

from distref.testing import (
    COST_RUN,
    PARITY_TOLERANCE,
    check_activations_predicted,
    check_communication_predicted,
    check_killed_rank_ends_the_job,
    check_killed_rank_resumes_exactly,
    check_model_states_predicted,
    check_stopped_rank_is_named,
    launch,
    load_train_module,
    max_relative_difference,
    mnist_convergence_args,
    parity_args,
    run_script,
    score_saved_model,
    self_launched,
    train_path,
)
from distref.testing.cost import PARTLY_TRAINED_RUN, check_partly_trained_predicted
from distref.testing.own import check_parity_on_your_model
from distref.training import CheckpointError, latest_checkpoint

IMPL = "deepspeed_zero"
SYNTHETIC = ["--model", "lenet", "--dataset", "synthetic", "--optimizer", "sgd", "--lr", "0.01"]


def run_zero(nproc: int, args: list[str], timeout: float = 300):
    result = launch(nproc, IMPL, args, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


# A covering set of the matrix (stages 0-3 × offload × world 2/4 × lenet/gpt × --grad-accum); the
# whole cross product is what `nox -s parity` is for (stage 3 × gpt × 2 ranks × --grad-accum 2 left CI
# for it: stage 3 runs here with lenet at 4 ranks, gpt at stage 2). AdamW (lenet) is compared with single --grad-accum
# world·K, which sums the same micro-batch gradients: bit-identical where it also adds them in the same
# order (world 2, K 1: (g0 + g1) / 2 both ways); with K > 1 each rank adds its own K first, single adds
# them in a row (measured 4.7e-8). SGD (gpt, and gpt on masked targets) is compared with plain single too.
CASES = {
    "stage0-lenet-w2": (0, "lenet", 2, 1, []),
    "stage1-lenet-w2-offload-accum2": (1, "lenet", 2, 2, ["--offload-optimizer"]),
    "stage2-gpt-w4": (2, "gpt", 4, 1, []),
    "stage3-lenet-w4-offload-all-accum2": (3, "lenet", 4, 2, ["--offload-optimizer", "--offload-params"]),
    # masked targets (1 to 8 scored of 16), where every stage's ÷ world size must be undone: 3 code paths
    "stage0-masked-w2-accum2": (0, "masked", 2, 2, []),
    "stage2-masked-w2-accum2": (2, "masked", 2, 2, []),
    "stage3-masked-w2-accum2": (3, "masked", 2, 2, []),
}


@pytest.mark.parametrize("case", CASES)
def test_every_stage_equals_single_and_partitions_what_it_promises(case, single_reference, tmp_path):
    stage, model, world, accum, options = CASES[case]
    args = [*parity_args(model), "--zero-stage", str(stage), "--grad-accum", str(accum), *options]
    result = run_zero(world, [*args, "--save-final", str(tmp_path / "f.pt"), "--out", str(tmp_path / "o")])
    final = torch.load(tmp_path / "f.pt", weights_only=True)
    same_sums = single_reference(model, world * accum)
    diff = max_relative_difference(final, same_sums)
    if model == "lenet" and world == 2 and accum == 1:  # the same two half-batch sums, in the same order
        assert diff == 0.0, f"{case}: {diff:.2e} from single --grad-accum {world * accum}"
    assert diff < PARITY_TOLERANCE, f"{case}: {diff:.2e} from single --grad-accum {world * accum}"
    if model != "lenet":  # SGD: also against plain single
        plain = max_relative_difference(final, single_reference(model))
        assert plain < PARITY_TOLERANCE, f"{case}: {plain:.2e} from single"

    # What each rank holds (fp32 AdamW / SGD with momentum: one optimizer tensor per parameter for SGD).
    record = json.loads((tmp_path / "o" / "record.json").read_text())
    assert record["strategy"]["zero_stage"] == stage
    assert record["skipped_steps"] == []  # fp32: every boundary step was applied (engine.was_step_applied)
    held = record["model_state_bytes"]
    assert len(held) == world
    total = sum(p.numel() for p in final.values() if p.is_floating_point()) * 4  # fp32 bytes of the model
    for rank_held in held:
        params, grads, optim = rank_held["parameters"], rank_held["gradients"], rank_held["optimizer"]
        moments = 2 if model == "lenet" else 1  # AdamW: exp_avg, exp_avg_sq; SGD: momentum buffer
        if stage == 0:  # a full replica: parameters, gradients, optimizer state
            assert (params, grads) == (total, total) and optim >= moments * total
        else:  # optimizer states and a flat fp32 master copy (kept even in fp32): this rank's 1/world only
            assert optim == pytest.approx((moments + 1) * total / world, rel=0.02)
        if stage == 3:  # (each partition padded to a multiple of the world size)
            # With optimizer offload DeepSpeed keeps a second fp32 gradient partition for the CPU optimizer.
            copies = 2 if "--offload-optimizer" in options else 1
            assert params == pytest.approx(total / world, rel=0.02)
            assert grads == pytest.approx(copies * total / world, rel=0.02)
        else:
            assert params == total
        if stage >= 2:  # gradients reduce-scattered into partitions (plus DeepSpeed's reduce buffer)
            assert grads < total
    # The recorded accuracy (test shards scored on each rank, at stage 3 with parameters gathered) is that
    # of the model --save-final wrote, scored alone.
    assert record["final_accuracy"] == score_saved_model(tmp_path / "f.pt", parity_args(model))
    # Quiet: no DeepSpeed INFO lines or FutureWarnings from the ranks.
    assert "FutureWarning" not in result.stderr and "[INFO]" not in result.stdout + result.stderr


def test_bf16_trains_within_a_band_of_fp32(single_train, tmp_path):
    """bf16 (DeepSpeed's: bf16 parameters and activations, fp32 master weights at stages 1-3): losses stay
    within 2% of fp32 single's over 20 steps (measured 0.2%), and are not equal to them (it took effect)."""
    args = [*parity_args("lenet"), "--log-every", "1"]
    run_zero(2, [*args, "--zero-stage", "2", "--precision", "bf16", "--out", str(tmp_path / "bf16")])
    single = single_train.main([*args, "--out", str(tmp_path / "single")])
    record = json.loads((tmp_path / "bf16" / "record.json").read_text())
    bf16_losses = torch.tensor([s["loss"] for s in record["steps"]])
    fp32_losses = torch.tensor([s["loss"] for s in single["steps"]])
    relative = ((bf16_losses - fp32_losses).abs() / fp32_losses).max().item()
    assert 1e-4 < relative < 2e-2, relative
    assert record["skipped_steps"] == []  # bf16 has no loss scaler: nothing is skipped


# ---- checkpoints: DeepSpeed's sharded files, an index written last, exact resume -------------------------

ELASTIC = [*SYNTHETIC, "--steps", "200", "--global-batch-size", "32", "--checkpoint-every", "40"]
ELASTIC += ["--resume", "auto", "--zero-stage", "3"]


@pytest.mark.slow
@pytest.mark.faults
def test_killed_rank_resumes_exactly_and_the_checkpoint_converts_to_singles_state_dict(tmp_path):
    """A SIGKILLed rank under --max-restarts 1: resumed bit-identical; DeepSpeed's converter turns the checkpoint into single's state_dict."""
    single = [*SYNTHETIC, "--steps", "200", "--global-batch-size", "32", "--grad-accum", "2"]  # 2 ranks
    check_killed_rank_resumes_exactly(IMPL, ELASTIC, 200, tmp_path, single)
    # The last ZeRO-3 checkpoint (step 200, partitioned over 2 ranks) as one full fp32 state_dict, by
    # DeepSpeed's own converter: equal to the run's --save-final, and loadable by single's model.
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    converted = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "elastic"), tag="step-00000200")
    final = torch.load(tmp_path / "b.pt", weights_only=True)
    assert list(converted) == list(final)
    assert max_relative_difference({k: v.float() for k, v in converted.items()}, final) == 0.0


@pytest.mark.slow
@pytest.mark.faults
def test_killed_rank_without_restarts_ends_the_job_naming_it(tmp_path):
    """A SIGKILLed rank ends the job within 60 s; the launcher's report names it."""
    check_killed_rank_ends_the_job(IMPL, ELASTIC, tmp_path)


@pytest.mark.faults
def test_stopped_rank_is_named_once_the_timeout_passes(tmp_path):
    """A SIGSTOPped rank: one line names it after --timeout (5 s here), exit code 1.
    DeepSpeed's own process groups included: they waited torch's 30-minute default until 0.2.1."""
    check_stopped_rank_is_named(IMPL, [*SYNTHETIC, "--steps", "100000"], tmp_path)


@pytest.mark.faults
def test_checkpoint_of_another_layout_or_altered_is_refused_in_one_line(tmp_path):
    """A checkpoint of another ZeRO stage or world size, or with an altered file, is refused in one line before DeepSpeed reads it."""
    ckpt = tmp_path / "ckpt"
    args = [*SYNTHETIC, "--steps", "4", "--global-batch-size", "16", "--checkpoint-dir", str(ckpt)]
    run_zero(2, [*args, "--checkpoint-every", "2", "--zero-stage", "2"])
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "step-00000002",
        "step-00000002.pt",
        "step-00000004",
        "step-00000004.pt",
        "zero_to_fp32.py",  # DeepSpeed copies its converters beside the checkpoints
        "zero_to_torch.py",
    ]
    zero = load_train_module(IMPL)
    index = ckpt / "step-00000004.pt"
    state = torch.load(index, weights_only=True)  # the index alone: no DeepSpeed pickle is read
    with pytest.raises(CheckpointError, match="is ZeRO stage 2 over 2 ranks, this run stage 3 over 2 ranks"):
        zero.check_zero_checkpoint(index, state, stage=3, world_size=2)
    with pytest.raises(CheckpointError, match="is ZeRO stage 2 over 2 ranks, this run stage 2 over 4 ranks"):
        zero.check_zero_checkpoint(index, state, stage=2, world_size=4)
    zero.check_zero_checkpoint(index, state, stage=2, world_size=2)  # its own layout: accepted
    # A truncated DeepSpeed file: refused before DeepSpeed unpickles it, in one line (rank 0's).
    shard = next((ckpt / "step-00000004").glob("*optim_states.pt"))
    shard.write_bytes(shard.read_bytes()[:-10])
    altered = launch(2, IMPL, [*args, "--steps", "6", "--resume", "auto", "--zero-stage", "2"], timeout=120)
    assert altered.returncode != 0
    assert altered.stderr.count(f"checkpoint file {shard} is missing or not the one written") == 1
    assert 'train.py", line' not in altered.stderr  # no rank's traceback (torchrun adds its own report)
    # A folder DeepSpeed left half-written (its index not yet written) is never what --resume auto picks.
    index.unlink()
    (ckpt / "step-00000006").mkdir()
    assert latest_checkpoint(ckpt) == ckpt / "step-00000002.pt"


# ---- launching: bad input, plain python, the deepspeed launcher ----------------------------------------


@pytest.mark.parametrize(
    ("argv", "world", "message"),
    [
        (["--zero-stage", "4"], 2, "--zero-stage 4: ZeRO has stages 0, 1, 2 and 3"),
        (
            ["--zero-stage", "2", "--offload-params"],
            2,
            "--offload-params needs --zero-stage 3 (only stage 3 partitions parameters; got 2)",
        ),
        (
            ["--zero-stage", "0", "--offload-optimizer"],
            2,
            "--offload-optimizer needs --zero-stage 1, 2 or 3 (stage 0 has no optimizer partition)",
        ),
        (
            ["--zero-stage", "0", "--precision", "bf16"],
            2,
            "--precision bf16 needs --zero-stage 1, 2 or 3 (stage 0 keeps no fp32 master weights)",
        ),
        (  # (it crashed in the first forward: "expected scalar type BFloat16 but found Float")
            ["--zero-stage", "2", "--precision", "bf16", "--model", "resnet18"],
            2,
            "--model resnet18 --precision bf16: DeepSpeed's bf16 module computes with bf16 parameters, but "
            "resnet18's BatchNorm layers keep fp32 running statistics, which torch's batch_norm refuses; "
            "use --precision fp32",
        ),
        (
            ["--precision", "fp16", "--device", "cpu"],
            2,
            "--precision fp16 needs CUDA (GradScaler); on CPU use --precision bf16",
        ),
        (
            ["--global-batch-size", "10"],
            4,
            "--global-batch-size 10 must be divisible by world size × --grad-accum = 4 × 1 = 4",
        ),
        (  # 13107 elements: DeepSpeed asserts on every rank
            ["--zero-stage", "2", "--bucket-mb", "0.05"],
            2,
            "--bucket-mb 0.05 is 13,107 elements of 4 bytes; DeepSpeed 0.19 at ZeRO stage 2 takes an even "
            "number (its buckets align to 2 elements): use e.g. --bucket-mb 0.049996 (13,106) or 0.050004 "
            "(13,108)",
        ),
        (  # 0 elements: DeepSpeed's config refuses it (pydantic) on every rank
            ["--zero-stage", "3", "--bucket-mb", "1e-6"],
            2,
            "--bucket-mb 1e-06 is 0 elements of 4 bytes; DeepSpeed 0.19 at ZeRO stage 3 takes at least 1: "
            "use e.g. --bucket-mb 0.000004 (1)",
        ),
        (
            ["--zero-stage", "1", "--bucket-mb", "1e-6"],
            2,
            "--bucket-mb 1e-06 is 0 elements of 4 bytes; DeepSpeed 0.19 at ZeRO stage 1 takes an even "
            "number (its buckets align to 2 elements): use e.g. --bucket-mb 0.00001 (2)",
        ),
    ],
)
def test_bad_input_is_one_line_before_any_process_group(argv, world, message, capsys):
    zero = load_train_module(IMPL)
    with pytest.raises(SystemExit) as exc:
        zero.parse_options(["--dataset", "synthetic", *argv], world)
    assert exc.value.code == 2
    assert capsys.readouterr().err == f"deepspeed_zero/train.py: error: {message}\n"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("megabytes", [0.05, 1e-6, 7.6e-6, 0.0625, 0.005])
def test_bucket_sizes_refused_are_those_deepspeed_refuses_and_those_named_it_takes(stage, megabytes):
    """DeepSpeed's own checks on a --bucket-mb, on its config and its stage-1/2 optimizer: this impl
    refuses exactly the sizes they refuse, and every size its message names passes them."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    zero = load_train_module(IMPL)
    stage_1_and_2 = inspect.getsource(DeepSpeedZeroOptimizer.__init__)  # its assertion, mirrored below
    assert "self.nccl_start_alignment_factor = 2" in stage_1_and_2
    assert "allgather_bucket_size % self.nccl_start_alignment_factor == 0" in stage_1_and_2

    def deepspeed_takes(elements: int) -> bool:
        try:
            DeepSpeedZeroConfig(stage=stage, reduce_bucket_size=elements, allgather_bucket_size=elements)
        except ValueError:  # (pydantic's ValidationError)
            return False
        return stage not in (1, 2) or elements % 2 == 0  # stage_1_and_2.py's assertion

    problem = zero.bucket_problem(megabytes, stage)
    assert (problem is None) == deepspeed_takes(zero.bucket_elements(megabytes))
    for suggested in re.findall(r"(?:--bucket-mb|or) ([0-9.e-]+) \(", problem or ""):
        assert zero.bucket_problem(float(suggested), stage) is None
        assert deepspeed_takes(zero.bucket_elements(float(suggested)))


def test_missing_deepspeed_is_one_line(monkeypatch, capsys):
    zero = load_train_module(IMPL)
    find_spec = zero.importlib.util.find_spec
    monkeypatch.setattr(
        zero.importlib.util, "find_spec", lambda name: None if name == "deepspeed" else find_spec(name)
    )
    with pytest.raises(SystemExit) as exc:
        zero.parse_options(["--dataset", "synthetic"], 2)
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        "deepspeed_zero/train.py: error: deepspeed is not installed: pip install deepspeed==0.19.8 -c <the "
        "constraints file pinning torch>\n"
    )


@pytest.mark.faults
def test_plain_python_refuses_bad_input_before_starting_any_rank():
    """Bad input to `python train.py`: one line, exit code 2, and no rank started."""
    result = self_launched(IMPL, ["--zero-stage", "5", "--dataset", "synthetic"], timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1:] == [
        "deepspeed_zero/train.py: error: --zero-stage 5: ZeRO has stages 0, 1, 2 and 3"
    ]
    assert "Traceback" not in result.stderr and "starting" not in result.stdout


def test_deepspeed_launcher_runs_it_with_the_same_result(single_train, tmp_path):
    """`deepspeed --num_gpus 2 train.py` (DeepSpeed's own launcher; on CPU it starts one process unless
    told --num_gpus) trains the same model as under torchrun."""
    args = [*SYNTHETIC, "--steps", "6", "--global-batch-size", "16"]
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2"]
    train = [str(train_path(IMPL)), *args, "--zero-stage", "3", "--save-final", str(tmp_path / "ds.pt")]
    result = run_script([*launcher, *train])
    assert result.returncode == 0, result.stderr[-3000:]
    single_train.main([*args, "--grad-accum", "2", "--save-final", str(tmp_path / "single.pt")])
    a, b = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in ("single", "ds"))
    assert max_relative_difference(b, a) == 0.0  # 2 ranks: single's two half-batch sums, bit for bit


@pytest.mark.slow
def test_lenet_reaches_98_5_percent_on_real_mnist_with_stage_2(mnist_root, tmp_path):
    run_zero(
        2, [*mnist_convergence_args(mnist_root), "--zero-stage", "2", "--out", str(tmp_path)], timeout=600
    )
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["world_size"] == 2 and record["strategy"]["zero_stage"] == 2
    assert record["final_accuracy"] >= 0.985, record["evals"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL; one rank per GPU)")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_on_gpus_matches_single(stage, single_train, tmp_path, monkeypatch):
    """DeepSpeed trains in fp32 at most (no fp64): here IEEE fp32, TF32 off in both runs (NVIDIA's
    override for the ranks, torch's flags in this process), so that 1e-5 holds on a GPU."""
    world = min(2, torch.cuda.device_count())
    args = [*parity_args("lenet"), "--device", "cuda"]
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    single_train.main([*args, "--grad-accum", str(world), "--save-final", str(tmp_path / "single.pt")])
    launched = launch(
        world,
        IMPL,
        [*args, "--zero-stage", str(stage), "--save-final", str(tmp_path / "zero.pt")],
        env={"NVIDIA_TF32_OVERRIDE": "0"},
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    final, reference = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in ("zero", "single"))
    assert max_relative_difference(final, reference) < PARITY_TOLERANCE


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL; one rank per GPU)")
def test_bf16_on_gpus_trains_within_a_band_of_fp32(single_train, tmp_path):
    world = min(2, torch.cuda.device_count())
    args = [*parity_args("lenet"), "--device", "cuda", "--log-every", "1"]
    run_zero(world, [*args, "--zero-stage", "2", "--precision", "bf16", "--out", str(tmp_path / "bf16")])
    single = single_train.main([*args, "--out", str(tmp_path / "single")])
    record = json.loads((tmp_path / "bf16" / "record.json").read_text())
    bf16, fp32 = (torch.tensor([s["loss"] for s in r["steps"]]) for r in (record, single))
    assert ((bf16 - fp32).abs() / fp32).max().item() < 2e-2


BF16 = ["--precision", "bf16"]
# 0.0625 MB = 16384 elements: gpt's 102400 parameters fill 11 reduce buckets (a --bucket-mb giving an odd
# number of elements is refused at stages 1 and 2: allgather_bucket_size must be a multiple of 2). 0.005 MB
# = 1310 elements, less than lenet's fc1 and conv2 weights: each is all-reduced in one piece per partition
# it spans (fc1's 16000 elements: 3 at 3 and 4 ranks).
COST_CASES = {
    "stage0-lenet-w2": (0, 2, ["--model", "lenet"]),  # DDP's: one all-reduce, a replica of the states
    "stage1-lenet-w2": (1, 2, ["--model", "lenet"]),
    "stage1-lenet-w4-small-buckets": (1, 4, ["--model", "lenet", "--bucket-mb", "0.005"]),
    "stage2-lenet-w3-small-buckets": (2, 3, ["--model", "lenet", "--bucket-mb", "0.005"]),
    "stage2-lenet-w1": (2, 1, ["--model", "lenet"]),  # one rank: nothing to gather
    "stage1-gpt-w2-buckets": (1, 2, ["--model", "gpt", "--bucket-mb", "0.0625"]),  # in parameter order
    "stage2-gpt-w3-padded": (2, 3, ["--model", "gpt"]),  # 102400 → 102402 elements: rank 2 holds padding
    "stage2-gpt-w2-buckets": (2, 2, ["--model", "gpt", "--bucket-mb", "0.0625"]),  # in backward's order
    "stage2-lenet-w3-sgd-accum2": (2, 3, ["--model", "lenet", "--optimizer", "sgd", "--grad-accum", "2"]),
    "stage3-lenet-w2": (3, 2, ["--model", "lenet"]),
    "stage3-gpt-w3-padded": (3, 3, ["--model", "gpt"]),  # every tensor padded to a multiple of 3
    "stage3-lenet-w3-sgd-accum2": (3, 3, ["--model", "lenet", "--optimizer", "sgd", "--grad-accum", "2"]),
    # One rank: nothing gathered, so stage 3 beyond one prefetch bucket has its formula (5 reduce buckets)
    "stage3-lenet-w1-small-buckets": (3, 1, ["--model", "lenet", "--bucket-mb", "0.005"]),
    # bf16 (stages 1-3): bf16 buffers, gradients and collectives, fp32 masters and optimizer states;
    # stages 1/2 all-reduce neither an overflow flag nor a norm: the config turns both off (as in fp32)
    "stage1-lenet-w3-bf16-small-buckets": (1, 3, ["--model", "lenet", *BF16, "--bucket-mb", "0.005"]),
    "stage1-lenet-w1-bf16": (1, 1, ["--model", "lenet", *BF16]),  # (a flag would be all-reduced here too)
    "stage2-gpt-w2-bf16-accum2": (2, 2, ["--model", "gpt", *BF16, "--grad-accum", "2"]),
    "stage2-gpt-w3-bf16-sgd-padded": (2, 3, ["--model", "gpt", *BF16, "--optimizer", "sgd"]),
    "stage3-gpt-w3-bf16-padded": (3, 3, ["--model", "gpt", *BF16]),
    "stage3-lenet-w2-bf16-accum2": (3, 2, ["--model", "lenet", *BF16, "--grad-accum", "2"]),
    "stage3-gpt-w1-bf16-buckets": (3, 1, ["--model", "gpt", *BF16, "--bucket-mb", "0.0625"]),
}


@pytest.mark.parametrize("case", COST_CASES)
def test_cost_equals_the_formulas(case, tmp_path):
    """What one step sends, counted at the dispatcher, equals distref.cost.zero.zero_communication exactly
    (calls and bytes of every kind on every rank), and each rank's model states zero_model_states."""
    stage, world, extra = COST_CASES[case]
    run_zero(world, [*COST_RUN, "--zero-stage", str(stage), *extra, "--out", str(tmp_path)])
    record = check_communication_predicted(tmp_path, world)
    check_model_states_predicted(record)
    check_activations_predicted(record)
    kinds = {  # stages 1/2: ZeRO-DP's 2Ψ of the paper, as an all-reduce of the gradients and an all-gather
        0: {"all_reduce"},
        1: {"all_reduce", "all_gather"},
        2: {"all_reduce", "all_gather"},
        3: {"all_gather", "reduce_scatter", "all_reduce"},
    }[stage]
    assert set(record["communication"]["measured"][0]) == (kinds - {"all_gather"} if world == 1 else kinds)


def test_a_two_step_session_at_stage_3_counts_no_step_and_says_why(tmp_path):
    """A session of 2 steps has no steady step to count: its second is where ZeRO-3 checks its recorded
    fetch trace across ranks (6 broadcasts no formula counts; it was once counted, and compared). The
    record counts none and says why; its model states are still measured and predicted."""
    run_zero(1, [*COST_RUN, "--steps", "2", "--zero-stage", "3", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["communication"]["step"] is None and record["communication"]["measured"] == [None]
    assert (
        "a session of 2 steps: a session's third step is the one counted"
        in record["communication"]["not_counted"]
    )
    check_model_states_predicted(record)


@pytest.mark.parametrize(
    "stage, extra",
    [
        (0, []),  # an unused parameter's gradient all-reduced as zeros, and stepped
        (1, []),
        (2, []),
        (2, ["--model", "distref.testing.partly_trained:two_heads"]),  # a partition of unused ones only
        (3, []),  # every parameter partitioned and gathered, frozen too; an unused module's: not gathered
        (3, ["--model", "distref.testing.partly_trained:two_heads"]),
    ],
    ids=["stage0", "stage1", "stage2", "stage2-two-heads", "stage3", "stage3-two-heads"],
)
def test_cost_of_frozen_and_unused_parameters_equals_the_formulas(stage, extra, tmp_path):
    """A model of yours with frozen and unused parameters: stages 0-2 leave the frozen ones out of their
    buffers and partitions; only gradients that exist are reduced; every rank's states as the formula."""
    run_zero(2, [*PARTLY_TRAINED_RUN, "--zero-stage", str(stage), *extra, "--out", str(tmp_path)])
    check_partly_trained_predicted(json.loads((tmp_path / "record.json").read_text()))


def test_parity_with_single_on_your_model(tmp_path):
    """The parity proof on your model and data (distref.testing.own's example MLP where none is named).
    Yours: DISTREF_TEST_MODEL=MODULE:FUNCTION [DISTREF_TEST_DATASET=MODULE:FUNCTION] python -m pytest
    -k your_model"""
    check_parity_on_your_model(lambda args: run_zero(2, args), tmp_path)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_config_leaves_out_work_nothing_uses_where_deepspeed_takes_it(stage, world):
    """No overlap_comm on one rank (nothing to overlap: stream syncs and a second bucket buffer only); no
    gradient norm at stages 1/2 without optimizer offload (clipping is off; test_cost_equals_the_formulas:
    no norm all-reduced or kept); no bf16 overflow check (single's bf16 never skips a step; there: no flag
    all-reduced). DeepSpeed's own ZeRO config takes each (it refuses compute_grad_norm false at stages 0, 3)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = load_train_module(IMPL)
    precision = ["--precision", "bf16"] if stage else []  # (stage 0 in bf16 is refused)
    for offload in ([], ["--offload-optimizer"]) if stage else ([],):  # (stage 0 has nothing to offload)
        argv = [*SYNTHETIC, *precision, "--zero-stage", str(stage), *offload]
        config = zero.deepspeed_config(zero.parse_options(argv, world), world)
        settings = config["zero_optimization"]
        DeepSpeedZeroConfig(**settings)  # (pydantic's ValidationError where DeepSpeed refuses one)
        assert settings["overlap_comm"] == (stage >= 2 and world > 1)
        assert settings.get("compute_grad_norm", True) == (stage not in (1, 2) or bool(offload))
        assert config["bf16"]["check_grad_overflow"] is False
