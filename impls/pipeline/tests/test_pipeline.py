"""impls/pipeline proven equal to impls/single — bit for bit where the sums are the same — for every
schedule, converging, resuming exactly after a killed rank, and refusing bad input in one line.

On this project's models (lenet, gpt, resnet18: their parameter names, shapes and accuracy targets);
test_parity_with_single_on_your_model gives the same proof on yours (distref.testing.own)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from distref.testing import (
    COST_RUN,
    FP64_TOLERANCE,
    GPU_PARITY,
    PARITY_TOLERANCE,
    batchnorm_args,
    check_activations_predicted,
    check_communication_predicted,
    check_killed_rank_ends_the_job,
    check_killed_rank_resumes_exactly,
    check_model_states_predicted,
    check_stopped_rank_is_named,
    expected_time_to_target,
    launch,
    load_train_module,
    max_relative_difference,
    mnist_convergence_args,
    parity_args,
    score_saved_model,
    self_launched,
    skip_where_torchvision_cannot_serve,
)
from distref.testing.cost import PARTLY_TRAINED_RUN, check_partly_trained_predicted
from distref.testing.own import check_parity_on_your_model

# A send or receive that waits longer than this fails the job (a hung test fails instead of hanging CI).
TIMEOUT = ["--timeout", "60"]


def python_train(args: list[str], timeout: float = 300):
    """`python impls/pipeline/train.py ARGS`: the file starts its ranks itself."""
    return self_launched("pipeline", [*TIMEOUT, *args], timeout)


def run_pp(ranks: int, args: list[str], timeout: float = 300):
    """torchrun with `ranks` ranks (the tests start ranks directly: one process fewer than `python
    train.py --nproc-per-node`, which a test of its own covers)."""
    result = launch(ranks, "pipeline", [*TIMEOUT, *args], timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


# Each stage computes what single computes for its blocks, micro-batch by micro-batch, each micro-batch's
# loss sum divided by the global batch's scored targets, and the schedule sums the M micro-batch gradients
# as single --grad-accum M does: one pipeline is bit-identical to single --grad-accum M (lenet with AdamW
# on MNIST, gpt with SGD: the parity workloads; and gpt on masked targets, 1 to 8 scored of 16). With --dp 2 the two pipelines' sums
# are added in another order than single's: within PARITY_TOLERANCE (measured 2.5e-7 here; lenet with zbv and
# --dp 2 is checked in the record test: 4.8e-8). With SGD
# (gpt, masked) the oracle is also plain single, one batch: micro-batching reorders the sums only (measured
# 4.9e-7, 4.9e-7 and 4.6e-7 for the three gpt cases). On masked targets the mean of the micro-batches'
# means (scale_grads=True over per-micro-batch means) was 1.7e-1 from plain single at M = 4.
# Every schedule, M in {1, 4, 8}, 2 and 4 stage ranks, 2 to 8 stages, both models, with and without --dp
# (with the record test and the GPipe/1F1B test below).
PARITY_CASES = {
    "lenet-gpipe-2x1-M1": ("lenet", 2, ["--schedule", "gpipe", "--microbatches", "1"], 1, 0.0),
    "lenet-interleaved-1f1b-2x2-M8": (
        "lenet",
        2,
        ["--schedule", "interleaved-1f1b", "--microbatches", "8"],
        8,
        0.0,
    ),
    "lenet-zbv-2x2-M4": ("lenet", 2, ["--schedule", "zbv", "--microbatches", "4"], 4, 0.0),
    "gpt-interleaved-zero-bubble-4x2-M8": (
        "gpt",
        4,
        ["--schedule", "interleaved-zero-bubble", "--microbatches", "8", "--gpt-layers", "6"],
        8,
        0.0,
    ),
    "gpt-dualpipev-4x2-M8": (
        "gpt",
        4,
        ["--schedule", "dualpipev", "--microbatches", "8", "--gpt-layers", "6"],
        8,
        0.0,
    ),
    "gpt-gpipe-dp2-M4": (
        "gpt",
        4,
        ["--schedule", "gpipe", "--microbatches", "4", "--dp", "2"],
        8,
        PARITY_TOLERANCE,
    ),
    "masked-1f1b-2x1-M4": ("masked", 2, ["--schedule", "1f1b", "--microbatches", "4"], 4, 0.0),
    "masked-zbv-dp2-M2": (
        "masked",
        4,
        ["--schedule", "zbv", "--microbatches", "2", "--dp", "2"],
        4,
        PARITY_TOLERANCE,
    ),
}


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_parity_with_single(case, single_reference, tmp_path):
    model, ranks, options, grad_accum, tolerance = PARITY_CASES[case]
    layers = options[options.index("--gpt-layers") + 1] if "--gpt-layers" in options else "2"
    final = tmp_path / "final.pt"
    run_pp(ranks, [*parity_args(model), *options, "--save-final", str(final)])
    saved = torch.load(final, weights_only=True)
    reference = single_reference(model, grad_accum, ["--gpt-layers", layers])
    assert list(saved) == list(reference)  # the core model's keys, in its order: gathered from every stage
    diff = max_relative_difference(saved, reference)
    assert diff <= tolerance, f"{case}: max relative difference {diff:.2e} (allowed {tolerance})"
    if model != "lenet":  # SGD: micro-batching changes only the order of sums, so plain single is close too
        plain = single_reference(model, 1, ["--gpt-layers", layers])
        diff = max_relative_difference(saved, plain)
        assert diff <= PARITY_TOLERANCE, f"{case} vs plain single: {diff:.2e}"


def test_record_is_single_s_record_plus_the_pipeline(single_train, tmp_path):
    """2 pipelines × 2 ranks × 2 stages each (zbv: V-shaped): the final parameters equal single --grad-accum
    8's within PARITY_TOLERANCE (the pipelines' sums added in another order); per-step losses are the mean
    over the pipelines (single's, to rounding); the final accuracy is the saved model's, scored alone (each
    pipeline scores its share of the test set); the record carries the schedule, the stages each rank
    holds, each rank's model state (its stages only), the measured bubble and the activations held."""
    args = [*parity_args("lenet"), "--eval-every", "10"]
    run_pp(
        4,
        [
            *("--dp", "2", "--schedule", "zbv"),
            *args,
            *("--out", str(tmp_path / "pp"), "--save-final", str(tmp_path / "f.pt")),
        ],
    )
    single = single_train.main(
        [
            *args,
            "--grad-accum",
            "8",
            "--out",
            str(tmp_path / "single"),
            "--save-final",
            str(tmp_path / "s.pt"),
        ]
    )
    saved, reference = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in ("f", "s"))
    assert list(saved) == list(reference)
    assert max_relative_difference(saved, reference) <= PARITY_TOLERANCE
    record = json.loads((tmp_path / "pp" / "record.json").read_text())
    losses, expected = ([s["loss"] for s in r["steps"]] for r in (record, single))
    assert losses == pytest.approx(expected, rel=1e-6)
    assert record["final_accuracy"] == score_saved_model(tmp_path / "f.pt", args)
    assert [e["step"] for e in record["evals"]] == [10, 20]
    strategy = record["strategy"]
    assert (strategy["schedule"], strategy["microbatches"], strategy["stages"]) == ("zbv", 4, 4)
    assert strategy["stages_by_rank"] == [["conv1", "fc2"], ["conv2", "fc1"]]  # V-shaped: r and 2p-1-r
    sizes = {"conv1": 260, "conv2": 5020, "fc1": 16050, "fc2": 510}
    held = [4 * sum(sizes[b] for b in blocks) for blocks in strategy["stages_by_rank"]]
    params = [s["parameters"] for s in record["model_state_bytes"]]
    assert params == [*held, *held] == [(260 + 510) * 4, (5020 + 16050) * 4] * 2  # ranks 0-1, then 2-3
    assert [s["gradients"] for s in record["model_state_bytes"]] == params
    assert all(0 < b < 1 for b in strategy["busy_fraction"]) and len(strategy["busy_fraction"]) == 4
    assert record["bubble_fraction"] == pytest.approx(1 - sum(strategy["busy_fraction"]) / 4)
    assert all(a > 0 for a in strategy["peak_activation_bytes"])
    assert record["world_size"] == record["devices"] == 4


def test_gpipe_and_1f1b_equal_single_and_1f1b_holds_fewer_activations(single_reference, tmp_path):
    """M = 8, 2 stages: both bit-identical to single --grad-accum 8. GPipe runs all M forwards before any
    backward; 1F1B starts backward after p forwards and then alternates, so it holds a few micro-batches'
    saved activations instead of M."""
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        out, final = tmp_path / schedule, tmp_path / f"{schedule}.pt"
        options = [
            "--schedule",
            schedule,
            "--microbatches",
            "8",
            "--out",
            str(out),
            "--save-final",
            str(final),
        ]
        run_pp(2, [*parity_args("lenet"), *options])
        saved = torch.load(final, weights_only=True)
        assert max_relative_difference(saved, single_reference("lenet", 8)) == 0.0, schedule
        peaks[schedule] = json.loads((out / "record.json").read_text())["strategy"]["peak_activation_bytes"]
    # Per step, over what was held before it (the recorded peak): GPipe holds all 8 micro-batches'
    # activations on both stages; 1F1B holds p = 2 on the first stage and 1 on the last, which runs each
    # micro-batch's backward right after its forward.
    assert peaks["1f1b"][0] * 4 == peaks["gpipe"][0] > 0
    assert peaks["1f1b"][1] * 8 == peaks["gpipe"][1] > 0


BATCHNORM_MICROBATCHES = 4  # resnet18's 6 blocks as 2 or 4 stages; M=4 suits every schedule at p = 2


@pytest.fixture(scope="module")
def single_batchnorm_reference(tmp_path_factory, single_train):
    """single --grad-accum M on resnet18 (BatchNorm buffers): what every schedule must equal, buffers too."""
    skip_where_torchvision_cannot_serve(batchnorm_args(2))  # (and so the tests that use this reference)
    path = tmp_path_factory.mktemp("single-bn") / "final.pt"
    single_train.main(
        [*batchnorm_args(2), "--grad-accum", str(BATCHNORM_MICROBATCHES), "--save-final", str(path)]
    )
    return torch.load(path, weights_only=True)


# In CI, one schedule per way torch runs the stages (each case is a resnet18 run of ~15 s here, and .ci/run
# must stay under 12 minutes): one stage per rank (1f1b; gpipe takes the same path), several round-robin
# (interleaved-1f1b), split backward round-robin (interleaved-zero-bubble) and V-shaped (zbv; dualpipev
# the same placement and split backward). DISTREF_ALL_SCHEDULES=1 runs all six.
BATCHNORM_SCHEDULES = ["1f1b", "interleaved-1f1b", "interleaved-zero-bubble", "zbv"]
if os.environ.get("DISTREF_ALL_SCHEDULES") == "1":
    BATCHNORM_SCHEDULES += ["gpipe", "dualpipev"]


@pytest.mark.parametrize("schedule", BATCHNORM_SCHEDULES)
def test_every_schedule_with_batchnorm_and_recompute_equals_single(
    schedule, single_batchnorm_reference, tmp_path
):
    """resnet18 with --activation-checkpointing, 2 ranks: parameters and BatchNorm running statistics
    bit-identical to single --grad-accum 4. Guards two defects: the stages' own shape inference ran an
    extra train-mode forward at each session's first step (num_batches_tracked 5 for 4, running means off);
    and split backward (the zero-bubble schedules: input gradients, then weight gradients) recomputes a
    checkpointed block twice, which a one-shot recompute context could not be entered for."""
    final = tmp_path / "final.pt"
    options = ["--schedule", schedule, "--microbatches", str(BATCHNORM_MICROBATCHES)]
    run_pp(2, [*batchnorm_args(2), *options, "--activation-checkpointing", "--save-final", str(final)])
    saved = torch.load(final, weights_only=True)
    assert saved["stem.1.num_batches_tracked"] == 2 * BATCHNORM_MICROBATCHES
    assert max_relative_difference(saved, single_batchnorm_reference) == 0.0


def test_a_resumed_batchnorm_run_equals_single(single_batchnorm_reference, tmp_path):
    """A resumed session starts with a first step too: no extra forward there either."""
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1", "--resume", "auto"]
    args = [*batchnorm_args(2), "--schedule", "gpipe", "--microbatches", str(BATCHNORM_MICROBATCHES), *ckpt]
    run_pp(2, [*args, "--steps", "1"])
    run_pp(2, [*args, "--save-final", str(tmp_path / "final.pt")])
    saved = torch.load(tmp_path / "final.pt", weights_only=True)
    assert max_relative_difference(saved, single_batchnorm_reference) == 0.0


@pytest.mark.faults
def test_a_checkpoint_file_not_written_for_its_index_is_refused_in_one_line(tmp_path):
    """Each index lists the sha256 of the files of its DCP folder: a file from another checkpoint (a
    copy, or one left by a crash between the folder and the index) is named by the resume in one line,
    before any rank loads it; every file as written resumes."""
    ckpt = tmp_path / "ckpt"
    args = ["--dataset", "synthetic", "--global-batch-size", "16", "--checkpoint-dir", str(ckpt)]
    run_pp(2, [*args, "--steps", "4", "--checkpoint-every", "2"])
    rank1 = ckpt / "step-00000004" / "__1_0.distcp"
    rank1.write_bytes((ckpt / "step-00000002" / "__1_0.distcp").read_bytes())  # a readable file
    refused = launch(2, "pipeline", [*TIMEOUT, *args, "--steps", "6", "--resume", "auto"], timeout=120)
    assert refused.returncode != 0
    assert (
        refused.stderr.count(f"pipeline: error: checkpoint file {rank1} is missing or not the one written")
        == 1
    )
    assert 'train.py", line' not in refused.stderr  # no rank's traceback
    (ckpt / "step-00000004.pt").unlink()  # the set at step 2 is whole: resumed from
    resumed = run_pp(2, [*args, "--steps", "6", "--resume", "auto"])
    assert "resumed from" in resumed.stdout and "step-00000002.pt at step 2" in resumed.stdout


def test_a_resume_under_another_layout_of_stages_equals_the_uninterrupted_run(tmp_path):
    """The checkpoint is keyed by parameter name (torch.distributed.checkpoint), not by rank: a run
    checkpointed on 2 ranks with zbv (4 stages, rank 0 holding the first and the last) resumes on 4 ranks
    with 1f1b (a stage each) and ends bit-identical to a run that never stopped. (Keyed by the optimizer's
    place instead, the optimizer state of 4 ranks would not load from 2.)"""
    args = ["--model", "gpt", "--dataset", "synthetic", "--global-batch-size", "16", "--steps", "4"]
    run_pp(2, [*args, "--schedule", "zbv", "--save-final", str(tmp_path / "whole.pt")])
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2"]
    run_pp(2, [*args, "--schedule", "zbv", *ckpt])
    step_2 = str(tmp_path / "ckpt" / "step-00000002.pt")
    final = str(tmp_path / "resumed.pt")
    resumed = run_pp(4, [*args, "--schedule", "1f1b", "--resume", step_2, "--save-final", final])
    assert "at step 2" in resumed.stdout
    whole, after = (torch.load(tmp_path / f, weights_only=True) for f in ("whole.pt", "resumed.pt"))
    assert max_relative_difference(after, whole) == 0.0


@pytest.mark.parametrize(
    ("args", "ranks", "message"),
    [
        (["--microbatches", "3"], 2, "--microbatches 3 must divide each pipeline's batch"),
        (["--dp", "3"], 4, "--dp 3 must divide the 4 ranks"),
        (["--dp", "2"], 2, "2 ranks with --dp 2 leave 1 rank per pipeline"),
        (["--schedule", "interleaved-1f1b", "--stages-per-rank", "1"], 2, "needs 2 or more stages per rank"),
        (["--schedule", "gpipe", "--stages-per-rank", "2"], 2, "--schedule gpipe runs one stage per rank"),
        (["--schedule", "zbv", "--stages-per-rank", "3"], 2, "places exactly 2 stages per rank"),
        ([], 5, "5 parts but --model lenet has only 4 blocks"),
        (["--schedule", "interleaved-1f1b"], 4, "8 parts but --model lenet has only 4 blocks"),
        (
            ["--model", "gpt", "--schedule", "interleaved-1f1b"],
            4,
            "8 parts but --model gpt has only 4 blocks (gpt has --gpt-layers + 2: use --gpt-layers 6)",
        ),
        (
            ["--schedule", "1f1b", "--microbatches", "2"],
            4,
            "--schedule 1f1b needs --microbatches >= the 4 stages",
        ),
        (
            ["--schedule", "dualpipev", "--microbatches", "2"],
            2,
            "dualpipev needs --microbatches >= its 4 stages",
        ),
        (
            [
                "--model",
                "gpt",
                "--gpt-layers",
                "6",
                "--schedule",
                "interleaved-zero-bubble",
                "--microbatches",
                "9",
                "--global-batch-size",
                "36",
            ],
            4,
            "needs --microbatches 9 to be a multiple of its 2 rounds",
        ),
        (["--grad-accum", "2"], 2, "--grad-accum: the schedule already accumulates over --microbatches"),
        (["--partition", "1,2"], 2, "--partition 1,2 makes 3 parts, but there are 2 ranks/devices"),
        (["--gpt-layers", "4"], 2, "--gpt-layers sets the depth of --model gpt, not of --model lenet"),
        (["--precision", "fp16", "--device", "cpu"], 2, "--precision fp16 needs CUDA"),
    ],
)
def test_bad_input_is_one_line(args, ranks, message, capsys):
    """What the launcher checks before starting any rank, in this process."""
    pp = load_train_module("pipeline")
    argv = ["--dataset", "synthetic", *args]
    with pytest.raises(SystemExit) as exc:
        pp.parse_options(argv, ranks)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pipeline/train.py: error: ") and message in err, err


def test_bad_input_stops_before_any_rank_starts():
    result = python_train(["--nproc-per-node", "2", "--dataset", "synthetic", "--microbatches", "5"])
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1].startswith("pipeline/train.py: error: --microbatches 5 must divide")
    assert "starting" not in result.stdout  # no rank was started


def test_micro_batch_rules_are_torch_s_own(monkeypatch):
    """check_options says in advance exactly what torch 2.13's schedule constructors raise: every schedule,
    p in {2, 4}, M in 1..16, built on a fake process group (no communication, one process)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from distref.distributed.stages import ONE_STAGE_PER_RANK, schedule_problem

    pp = load_train_module("pipeline")
    disagreements = []
    for p in (2, 4):
        torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=p)
        try:
            for name, schedule_class in pp.SCHEDULES.items():
                v = 1 if name in ONE_STAGE_PER_RANK else 2
                for m in range(1, 17):
                    stages = [
                        PipelineStage(torch.nn.Linear(2, 2), s, p * v, torch.device("cpu"))
                        for s in pp.stage_indices(name, 0, p, v)
                    ]
                    try:
                        schedule_class(
                            stages[0] if v == 1 else stages, n_microbatches=m, loss_fn=pp.GlobalBatchMean()
                        )
                        torch_says = None
                    except ValueError as exc:
                        torch_says = str(exc)
                    we_say = schedule_problem(name, m, p, v)
                    if (torch_says is None) != (we_say is None):
                        disagreements.append((name, p, m, torch_says, we_say))
        finally:
            torch.distributed.destroy_process_group()
    assert not disagreements


@pytest.mark.slow
def test_lenet_reaches_98_5_percent_on_real_mnist(mnist_root, tmp_path):
    args = ["--microbatches", "2", *mnist_convergence_args(mnist_root)]
    run_pp(2, [*args, "--out", str(tmp_path)], timeout=900)
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["final_accuracy"] >= 0.985, record["evals"]
    assert record["time_to_target_s"] == expected_time_to_target(record) > 0


@pytest.mark.slow
def test_gpt_learns_the_reverse_task_through_an_interleaved_pipeline(tmp_path):
    """The single test's workload (99% token accuracy in 100 steps), 2 ranks × 2 stages."""
    args = ["--model", "gpt", "--dataset", "synthetic", "--steps", "100", "--lr", "3e-3"]
    args += ["--eval-every", "50", "--schedule", "interleaved-1f1b", "--microbatches", "4"]
    run_pp(2, [*args, "--out", str(tmp_path)])
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["final_accuracy"] >= 0.99, record["evals"]


ELASTIC = [
    "--model",
    "lenet",
    "--dataset",
    "synthetic",
    "--optimizer",
    "sgd",
    "--lr",
    "0.01",
    "--steps",
    "100",
    "--schedule",
    "zbv",  # both ranks hold two stages; rank 0 the first and the last
]
ELASTIC += ["--global-batch-size", "32", "--checkpoint-every", "20", "--resume", "auto", *TIMEOUT]


@pytest.mark.slow
@pytest.mark.faults
def test_killed_rank_restarts_from_checkpoint_with_the_same_result(tmp_path):
    """A SIGKILLed rank under --max-restarts 1: the job resumes from its last checkpoint and ends bit-identical to an uninterrupted run."""
    single = [*ELASTIC[:10], "--global-batch-size", "32", "--grad-accum", "4"]  # M = 4 micro-batches
    check_killed_rank_resumes_exactly("pipeline", ELASTIC, 100, tmp_path, single)


@pytest.mark.slow
@pytest.mark.faults
def test_killed_rank_without_restarts_ends_the_job_naming_it(tmp_path):
    """A SIGKILLed rank ends the job within 60 s; the launcher's report names it; its checkpoint resumes,
    also under another layout of stages."""
    check_killed_rank_ends_the_job("pipeline", ELASTIC, tmp_path)
    # The checkpoint it left (zbv: rank 0 holds conv1 and fc2) resumes with 1f1b (conv1, conv2 | fc1, fc2)
    other = [*ELASTIC[: ELASTIC.index("--schedule")], *ELASTIC[ELASTIC.index("--schedule") + 2 :]]
    result = launch(2, "pipeline", [*other, "--checkpoint-dir", str(tmp_path / "ckpt")])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resumed from" in result.stdout


@pytest.mark.faults
def test_stopped_rank_is_named_once_the_timeout_passes(tmp_path):
    """A SIGSTOPped rank: one line names it after --timeout (5 s here), exit code 1.
    Here the collective that waits for it is a stage's send or receive."""
    check_stopped_rank_is_named(
        "pipeline", ["--model", "lenet", "--dataset", "synthetic", "--steps", "100000"], tmp_path
    )


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ CUDA GPUs: one stage rank per GPU")
def test_two_gpus_match_single(single_train, tmp_path):
    args = [*parity_args("lenet"), *GPU_PARITY]
    single_train.main([*args, "--grad-accum", "4", "--save-final", str(tmp_path / "single.pt")])
    run_pp(2, [*args, "--save-final", str(tmp_path / "pp.pt")])
    final, reference = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in ("pp", "single"))
    assert max_relative_difference(final, reference) < FP64_TOLERANCE


COST_CASES = {  # ranks, options: every schedule at 2 ranks, 4-rank pipelines, and 2 pipelines × 2 ranks
    "p2-gpipe": (2, ["--model", "lenet", "--schedule", "gpipe"]),
    "p2-1f1b": (2, ["--model", "lenet", "--schedule", "1f1b", "--microbatches", "2"]),
    "p4-1f1b-gpt-checkpointed": (4, ["--model", "gpt", "--microbatches", "8", "--activation-checkpointing"]),
    "p2-interleaved-1f1b": (2, ["--model", "lenet", "--schedule", "interleaved-1f1b"]),
    "p2-interleaved-zero-bubble": (2, ["--model", "lenet", "--schedule", "interleaved-zero-bubble"]),
    "p2-zbv": (2, ["--model", "lenet", "--schedule", "zbv"]),  # stages 1 and 2 on one rank: no send
    "p2-dualpipev": (2, ["--model", "lenet", "--schedule", "dualpipev"]),
    "p2-zbv-bf16": (2, ["--model", "lenet", "--schedule", "zbv", "--precision", "bf16"]),
    "p2-interleaved-zero-bubble-gpt-bf16": (
        2,
        ["--model", "gpt", "--schedule", "interleaved-zero-bubble", "--precision", "bf16"],
    ),
    "p4-1f1b-gpt-bf16": (4, ["--model", "gpt", "--gpt-layers", "2", "--precision", "bf16"]),
    "p4-interleaved-1f1b-gpt": (
        4,
        ["--model", "gpt", "--gpt-layers", "6", "--schedule", "interleaved-1f1b", "--microbatches", "8"],
    ),
    "dp2xp2-gpipe-resnet": (
        4,
        ["--model", "resnet18", "--dp", "2", "--schedule", "gpipe", "--global-batch-size", "8"],
    ),
}


@pytest.mark.parametrize("case", list(COST_CASES))
def test_cost_equals_the_formulas(case, tmp_path):
    """What one step sends and receives, counted at the dispatcher, equals distref.cost.pipeline.pipeline
    exactly (M sends of each boundary's activation, M of its gradient; with --dp an all-reduce per
    parameter and a broadcast per buffer), and each rank's model states those of its stages."""
    ranks, extra = COST_CASES[case]
    skip_where_torchvision_cannot_serve(extra)
    run_pp(ranks, [*COST_RUN, *extra, "--out", str(tmp_path)])
    record = check_communication_predicted(tmp_path, ranks)
    check_model_states_predicted(record)
    # each stage's micro-batches held at once in the schedule's order: all M on GPipe's, p - s on
    # 1F1B's stage s, the others' from their pipeline_order, a split backward letting go of part at
    # "I" and the rest at "W", a tensor two stages on one rank save (zbv, dualpipev) counted once;
    # under autocast one cast of each weight for the whole step (one autocast region)
    check_activations_predicted(record)
    assert all(m["send"]["calls"] > 0 and m["recv"]["calls"] > 0 for m in record["communication"]["measured"])


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_cost_of_frozen_and_unused_parameters_equals_the_formulas(schedule, tmp_path):
    """A model of yours with frozen and unused parameters: each rank's model states hold gradients and
    optimizer state of its parameters that receive a gradient only (its stages' sends are unchanged)."""
    run_pp(2, [*PARTLY_TRAINED_RUN, "--schedule", schedule, "--out", str(tmp_path)])
    check_partly_trained_predicted(json.loads((tmp_path / "record.json").read_text()))


def test_frozen_and_unused_parameters_train_over_pipelines_as_single_does(tmp_path):
    """--dp 2: the pipelines sum their gradients, those that have one (a frozen or unused parameter has
    none: its all-reduce failed on None)."""
    args = [*PARTLY_TRAINED_RUN, "--optimizer", "sgd", "--lr", "0.05"]
    check_parity_on_your_model(lambda a: run_pp(4, [*a, "--dp", "2"]), tmp_path, args)


def test_the_record_holds_each_rank_s_timeline_of_one_step(tmp_path):
    """The report's timeline (ScheduleTimeline): each rank's forwards and backwards in one step, in
    torch's 1F1B order, each micro-batch once, one at a time within the step, and placed against the
    other rank's by the wall clock so that each micro-batch crosses the ranks in order."""
    import datetime  # (this test's alone)

    m = 4
    schedule = ["--model", "lenet", "--schedule", "1f1b", "--microbatches", str(m)]
    run_pp(2, [*COST_RUN, *schedule, "--out", str(tmp_path)])
    record = json.loads((tmp_path / "record.json").read_text())
    timeline = record["strategy"]["timeline"]
    assert len(timeline) == 2
    # Step 2 of 3 is the one whose traffic is counted (every operation through Python: slower): the
    # timeline is of the last one not counted.
    assert record["communication"]["step"] == 2
    # 1F1B: stage s runs p - s forwards first, then one backward, one forward; M of each
    order = {0: "F0 F1 B0 F2 B1 F3 B2 B3", 1: "F0 B0 F1 B1 F2 B2 F3 B3"}
    for rank, step in enumerate(timeline):
        assert step["step"] == 1 and step["counted"] is False
        assert [w[1] for w in step["work"]] == [rank] * 2 * m  # its stage
        assert " ".join(f"{action}{micro}" for action, _, micro, _, _ in step["work"]) == order[rank]
        times = [t for w in step["work"] for t in w[3:]]
        assert times == sorted(times) and len(set(times)) == len(times)  # in order, none overlapping
        assert times[0] > 0 and times[-1] < step["schedule_s"] < 5  # within the step's schedule

    def interval(rank: int, action: str, micro: int) -> tuple[float, float]:
        start, end = next(w[3:] for w in timeline[rank]["work"] if w[0] == action and w[2] == micro)
        return timeline[rank]["started_at"] + start, timeline[rank]["started_at"] + end

    # Each rank's start is its wall clock's (the rows' placement in the report), during the run
    began, ended = (
        datetime.datetime.fromisoformat(record[k]).timestamp() for k in ("started_at", "finished_at")
    )
    assert all(began <= step["started_at"] <= ended + 1 for step in timeline)  # (the record's: whole seconds)
    for micro in range(m):  # the activation goes 0 → 1, its gradient 1 → 0
        assert interval(1, "F", micro)[0] > interval(0, "F", micro)[1]
        assert interval(0, "B", micro)[0] > interval(1, "B", micro)[1]


def test_parity_with_single_on_your_model(tmp_path):
    """The parity proof on your model and data (distref.testing.own's example MLP where none is named).
    Yours: DISTREF_TEST_MODEL=MODULE:FUNCTION [DISTREF_TEST_DATASET=MODULE:FUNCTION] python -m pytest
    -k your_model"""
    check_parity_on_your_model(lambda args: run_pp(2, args), tmp_path)
