"""impls/expert_parallel proven equal to impls/single (top-1 and top-2, world 2 and 4, every expert once or
copied over groups, an uneven routing, --grad-accum, checkpointing), each rank holding E/ep experts, its
all-to-alls and model states as the formulas say from the step's own routing, its routing recorded as
single's, resharding its checkpoints to another world size, and resuming exactly after a killed rank.

gpt only: the strategy spreads the experts of gpt's mixture-of-experts MLPs (--experts)."""

from __future__ import annotations

import json

import pytest
import torch

from distref.testing import (
    COST_RUN,
    EXPORTED_IMPL,
    FP64_TOLERANCE,
    GPU_PARITY,
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
    own,
    parity_args,
    score_saved_model,
)

IMPL = "expert_parallel"
GPT = ["--model", "gpt", "--dataset", "synthetic"]
MOE = ["--experts", "4"]
# (by the module's name, which an exported project's vendored copy changes: a string would not follow it)
SKEWED = ["--model", "gpt", "--dataset", f"{own.__name__}:skewed_tokens"]


def run_ep(nproc: int, args: list[str], timeout: float = 300):
    result = launch(nproc, IMPL, args, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def read_record(out) -> dict:
    return json.loads((out / "record.json").read_text())


def routing(record: dict) -> list:
    return [row["tokens_per_expert"] for row in record["steps"]]


# ---- The dispatch, in one process: what each rank sends where ----------------------------------------


def test_the_dispatch_on_one_rank_is_the_experts_themselves():
    """With a group of one, all_to_all_experts sends every token to itself and regroups nothing: the same
    outputs as the experts run in place (the permutations are the identity)."""
    import torch.distributed as dist

    from distref.models import Experts

    ep = load_train_module(IMPL)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        experts = Experts(4, 8, 16).double()
        for p in experts.parameters():
            torch.nn.init.normal_(p)
        tokens, counts = torch.randn(11, 8, dtype=torch.float64), [3, 0, 5, 3]
        got = ep.all_to_all_experts(tokens, counts, experts=experts, group=dist.group.WORLD)
        assert torch.equal(got, experts(tokens, counts))
    finally:
        dist.destroy_process_group()


# ---- Equal to single --------------------------------------------------------------------------------

# An expert's gradient is summed over the rows of every rank's tokens sent to it, in another order than
# single's, and DDP sums the ranks' parts of the rest: fp32 SGD against plain single (1e-5), AdamW in fp64
# (1e-12), as the parity matrix does.
CASES = {
    "ep2-top2-sgd": (2, "sgd", ["--experts", "4", "--top-k", "2"], "fp32"),
    "ep2-top1-sgd": (2, "sgd", ["--experts", "4", "--top-k", "1"], "fp32"),
    "ep4-top2-adamw-accum2": (4, "adamw", ["--experts", "4", "--top-k", "2", "--grad-accum", "2"], "fp64"),
    "ep4-top1-adamw-8experts": (4, "adamw", ["--experts", "8", "--top-k", "1"], "fp64"),
    "ep2of4-top2-adamw": (4, "adamw", ["--experts", "4", "--ep", "2"], "fp64"),
    "ep2-top2-checkpointed-sgd": (2, "sgd", ["--experts", "4", "--activation-checkpointing"], "fp32"),
}
LR = {"sgd": "0.05", "adamw": "0.01"}


@pytest.mark.parametrize("case", CASES)
def test_parity_with_single_each_rank_holding_its_experts_at_the_predicted_cost(
    case, single_reference, tmp_path
):
    """gpt with E experts a block, 20 steps of 32: the final parameters equal plain single's on the whole
    batch; the record's routing (tokens per expert, every step) is single's; each rank held E/ep experts;
    and what every rank sent and kept in the counted step is what distref.cost.expert_parallel predicts
    from that step's routing."""
    world, optimizer, options, precision = CASES[case]
    # (single's reference: the same run without the strategy's own options and checkpointing)
    rest = ["--activation-checkpointing"] if "--activation-checkpointing" in options else []
    rest += ["--ep", options[options.index("--ep") + 1]] if "--ep" in options else []
    kept = [o for o in options if o not in rest]
    chosen = ["--optimizer", optimizer, "--lr", LR[optimizer], "--precision", precision, *kept]
    args = [*parity_args("gpt"), *chosen, *rest, "--log-every", "1"]
    run_ep(world, [*args, "--save-final", str(tmp_path / "f.pt"), "--out", str(tmp_path / "o")])
    final = torch.load(tmp_path / "f.pt", weights_only=True)
    diff = max_relative_difference(final, single_reference("gpt", 1, [*chosen, "--log-every", "1"]))
    tolerance = PARITY_TOLERANCE if precision == "fp32" else FP64_TOLERANCE
    assert diff < tolerance, f"{case}: {diff:.2e} from single ({precision})"

    record = check_communication_predicted(tmp_path / "o", world)
    check_model_states_predicted(record)
    check_activations_predicted(record)
    experts = int(options[options.index("--experts") + 1])
    k = int(options[options.index("--top-k") + 1]) if "--top-k" in options else 2
    ep = int(options[options.index("--ep") + 1]) if "--ep" in options else world
    assert record["strategy"]["mesh"] == {"ep_replicate": world // ep, "ep": ep}
    for step in routing(record):  # every token of the global batch, k times, in every layer
        assert [sum(layer) for layer in step] == [32 * 16 * k] * 2
        assert all(len(layer) == experts for layer in step)
    # Each rank holds E/ep of every expert tensor and all of the rest
    expert_numel = sum(v.numel() for n, v in final.items() if ".experts." in n)
    numel = sum(v.numel() for v in final.values())
    element = 8 if precision == "fp64" else 4
    held = {r["parameters"] for r in record["model_state_bytes"]}
    assert held == {element * (numel - expert_numel + expert_numel // ep)}
    sent = record["communication"]["measured"][0]
    checkpointed = "--activation-checkpointing" in options
    assert sent["all_to_all"]["calls"] == 2 * (8 if checkpointed else 5) * (
        2 if "--grad-accum" in options else 1
    )
    assert ("all_reduce" in sent) and sent["all_reduce"]["calls"] == 1 + (4 * 2 if world // ep > 1 else 0)
    # The recorded accuracy (test shards scored with the gathered model) is that of the saved model
    assert record["final_accuracy"] == score_saved_model(tmp_path / "f.pt", [*parity_args("gpt"), *chosen])


def test_the_routing_recorded_is_singles_step_by_step(single_train, tmp_path):
    """fp64, top-2 over 4 experts, ep ×4: each step's tokens per expert (summed over the ranks) are single's,
    and so is the load-balancing loss."""
    args = [*parity_args("gpt"), "--experts", "4", "--precision", "fp64", "--steps", "8", "--log-every", "1"]
    single_train.main([*args, "--out", str(tmp_path / "s")])
    run_ep(4, [*args, "--out", str(tmp_path / "e")])
    single, ep = read_record(tmp_path / "s"), read_record(tmp_path / "e")
    assert routing(ep) == routing(single)
    for a, b in zip(single["steps"], ep["steps"], strict=True):
        assert abs(a["balance_loss"] - b["balance_loss"]) < 1e-12 * a["balance_loss"]
        assert 0 < a["balance_loss"] < 0.1  # α·E·Σ f·P: 0.01 at an even routing, at most α·E


def test_an_uneven_routing_most_tokens_to_one_expert_equals_single(single_train, tmp_path):
    """Token data of yours where one token is most of every sequence (distref.testing.own:skewed_tokens):
    the router sends most tokens to one expert, none to others (measured: 90% of a layer's tokens to one
    expert, two experts empty). The all-to-alls' sizes differ rank by rank, and are still predicted
    exactly from the step's routing, and so are the activations each rank's experts hold; the result is
    single's (fp64)."""
    args = [*SKEWED, "--experts", "4", "--top-k", "1", "--optimizer", "adamw", "--lr", "0.01"]
    args += ["--precision", "fp64", "--steps", "8", "--global-batch-size", "32", "--log-every", "1"]
    single_train.main([*args, "--save-final", str(tmp_path / "s.pt")])
    run_ep(2, [*args, "--save-final", str(tmp_path / "e.pt"), "--out", str(tmp_path / "o")])
    a, b = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in ("s", "e"))
    assert max_relative_difference(b, a) < FP64_TOLERANCE
    record = check_communication_predicted(tmp_path / "o", 2)
    check_activations_predicted(record)  # (the busy expert's rank holds its many rows' hidden)
    busiest = max(max(layer) / sum(layer) for step in routing(record) for layer in step)
    assert busiest > 0.8, busiest
    assert any(0 in layer for step in routing(record) for layer in step)  # an expert given no token
    # By hand from the counted step's routing: rank r receives (and returns) its experts' tokens (fp64)
    routed = record["steps"][2]["tokens_per_expert"]
    for rank, sent in enumerate(record["communication"]["measured"]):
        received = sum(sum(layer[2 * rank : 2 * rank + 2]) for layer in routed)
        assert sent["all_to_all"]["bytes"] == 2 * (32 + 2 * 16 * 20 * 64 * 8) + 2 * received * 64 * 8


@pytest.mark.parametrize(
    ("world", "options"), [(2, ["--grad-accum", "2"]), (4, ["--ep", "2"])], ids=["ep2-accum2", "ep2of4"]
)
def test_masked_targets_equal_plain_single(world, options, single_reference, tmp_path):
    """gpt's masked task (1 to 8 of 16 targets scored, unevenly over the ranks), with experts: each rank's
    loss is its scored tokens' sum ÷ the global batch's count, so the ranks' and micro-batches' parts add
    up to single's mean; SGD against plain single, in fp64. (In fp32, ep ×2 --grad-accum 2 routed one of
    2,048 token choices to another expert than single at step 11, two probabilities closer than fp32's
    rounding of the ranks' sums, and ended 2.4e-3 from single: top-k routing is discontinuous.)"""
    moe = ["--experts", "4", "--precision", "fp64"]
    run_ep(world, [*parity_args("masked"), *moe, *options, "--save-final", str(tmp_path / "f.pt")])
    final = torch.load(tmp_path / "f.pt", weights_only=True)
    diff = max_relative_difference(final, single_reference("masked", 1, moe))
    assert diff < FP64_TOLERANCE, f"{diff:.2e} from plain single"


def test_grad_accum_equals_single_on_the_whole_batch_and_single_with_grad_accum(single_train, tmp_path):
    """The load-balancing loss is each sequence's own term, so micro-batches add up to the whole batch:
    single --grad-accum 4 equals single on the whole batch (fp64), and ep ×2 --grad-accum 2 equals both.
    (A per-batch loss, Switch's over all the batch's tokens, would differ with the micro-batches.)"""
    args = [*GPT, *MOE, "--optimizer", "adamw", "--lr", "0.01", "--precision", "fp64"]
    args += ["--steps", "6", "--global-batch-size", "16"]
    single_train.main([*args, "--save-final", str(tmp_path / "whole.pt")])
    single_train.main([*args, "--grad-accum", "4", "--save-final", str(tmp_path / "accum.pt")])
    run_ep(2, [*args, "--grad-accum", "2", "--save-final", str(tmp_path / "ep.pt")])
    whole, accum, ep = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in ("whole", "accum", "ep"))
    assert max_relative_difference(accum, whole) < FP64_TOLERANCE
    assert max_relative_difference(ep, whole) < FP64_TOLERANCE


def test_bf16_trains_within_a_band_of_fp32(tmp_path):
    """bf16 (autocast): the tokens cross in bf16 (half the bytes, predicted), the routers in fp32; the
    losses stay within 2% of fp32's."""
    args = [*parity_args("gpt"), *MOE, "--log-every", "1"]
    run_ep(2, [*args, "--out", str(tmp_path / "fp32")])
    run_ep(2, [*args, "--precision", "bf16", "--out", str(tmp_path / "bf16")])
    fp32, bf16 = read_record(tmp_path / "fp32"), read_record(tmp_path / "bf16")
    losses = [torch.tensor([s["loss"] for s in r["steps"]]) for r in (fp32, bf16)]
    relative = ((losses[1] - losses[0]).abs() / losses[0]).max().item()
    assert 1e-5 < relative < 2e-2, relative
    check_communication_predicted(tmp_path / "bf16", 2)
    a2a = [r["communication"]["measured"][0]["all_to_all"]["bytes"] for r in (fp32, bf16)]
    assert a2a[1] < a2a[0] * 0.51  # (the counts' 8E bytes aside, half)


def test_compiled_blocks_equal_single_compiled(single_train, tmp_path, monkeypatch):
    """--compile (aot_eager here) compiles each block, its all-to-alls inside, and trains what single
    compiled does."""
    monkeypatch.setenv("DISTREF_COMPILE_BACKEND", "aot_eager")
    args = [*parity_args("gpt"), *MOE, "--steps", "6", "--compile"]
    single_train.main([*args, "--save-final", str(tmp_path / "s.pt")])
    run_ep(2, [*args, "--save-final", str(tmp_path / "e.pt"), "--out", str(tmp_path / "o")])
    a, b = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in ("s", "e"))
    assert max_relative_difference(b, a) < PARITY_TOLERANCE
    assert read_record(tmp_path / "o")["strategy"]["compiled_graphs"] > 0


# ---- Cost: what each option changes ------------------------------------------------------------------

COST_CASES = {
    "ep2-bf16": (2, ["--precision", "bf16"]),
    "ep4-top1-checkpointed": (4, ["--top-k", "1", "--activation-checkpointing"]),
    "ep2of4-sgd-accum2": (4, ["--ep", "2", "--optimizer", "sgd", "--grad-accum", "2"]),
    "ep4-8experts-bf16-accum3": (4, ["--experts", "8", "--precision", "bf16", "--grad-accum", "3"]),
    "ep1of2": (2, ["--ep", "1"]),
}


@pytest.mark.parametrize("case", COST_CASES)
def test_cost_equals_the_formulas(case, tmp_path):
    world, options = COST_CASES[case]
    run_ep(world, ["--model", "gpt", *COST_RUN, *MOE, *options, "--out", str(tmp_path)])
    record = check_communication_predicted(tmp_path, world)
    check_model_states_predicted(record)
    check_activations_predicted(record)  # (each rank's experts on the rows it received)
    if "--ep" in options and options[options.index("--ep") + 1] == "1":  # every rank every expert
        assert "all_to_all" not in record["communication"]["measured"][0]


def test_the_all_to_alls_send_what_counted_by_hand(tmp_path):
    """ep ×2, 24 sequences of 16 tokens, top-2 of 4 experts, gpt's hidden 64, fp32: a rank's 12 sequences
    are 192 tokens, 384 rows sent in each layer's dispatch (98,304 bytes) whatever the routing, and the
    gradients of its 384 rows' outputs sent back in backward: per layer, the counts (4 × 8 bytes) and 2 of
    98,304 bytes; with what it received and returned (the routing's), 5 calls a layer."""
    run_ep(2, ["--model", "gpt", *COST_RUN, *MOE, "--out", str(tmp_path)])
    record = read_record(tmp_path)
    routed = record["steps"][2]["tokens_per_expert"]  # the counted step's, both ranks' tokens
    received = sum(sum(layer[:2]) for layer in routed), sum(sum(layer[2:]) for layer in routed)
    for rank, sent in enumerate(record["communication"]["measured"]):
        expected = 2 * (32 + 2 * 98_304) + 2 * received[rank] * 64 * 4
        assert sent["all_to_all"] == {"calls": 10, "bytes": expected, "bus_bytes": expected / 2}


# ---- Checkpoints, convergence, faults, bad input --------------------------------------------------------


@pytest.mark.faults
def test_a_checkpoint_resumes_at_another_world_size_and_ep(single_train, tmp_path):
    """torch.distributed.checkpoint reshards on load: ep ×2 saves at step 6, 4 ranks as 2 groups of --ep 2
    continue to 8, then ep ×4 ... equal (fp64, AdamW: its state resharded too) to single."""
    ckpt = tmp_path / "ckpt"
    args = [*GPT, *MOE, "--optimizer", "adamw", "--precision", "fp64", "--global-batch-size", "16"]
    args += ["--steps", "8"]
    single_train.main([*args, "--save-final", str(tmp_path / "straight.pt")])
    run_ep(2, [*args, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "6"])
    final = ["--save-final", str(tmp_path / "resharded.pt")]
    resumed = run_ep(4, [*args, "--ep", "2", "--checkpoint-dir", str(ckpt), "--resume", "auto", *final])
    assert "expert_parallel: resumed from" in resumed.stdout and "step 6" in resumed.stdout
    a, b = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in ("straight", "resharded"))
    assert 0 < max_relative_difference(b, a) < FP64_TOLERANCE


def test_gpt_with_experts_learns_the_reversal(tmp_path):
    """The nox run's workload, half its steps: gpt with 4 experts a block, top-2, ep ×2, digit reversal, 100
    steps of 64, AdamW 3e-3: >= 95% of the reversed tokens (chance 10%), the routing not collapsed onto
    one expert. Measured (seeds 0, 1, 2): 99.2%, 95.9%, 100% at step 25, 100% from step 50 on."""
    args = [*GPT, *MOE, "--steps", "100", "--global-batch-size", "64", "--lr", "3e-3"]
    run_ep(2, [*args, "--eval-every", "50", "--target-accuracy", "0.95", "--out", str(tmp_path)])
    record = read_record(tmp_path)
    assert record["final_accuracy"] >= 0.95, record["evals"]
    assert record["steps"][-1]["loss"] < record["steps"][0]["loss"] / 10
    last = record["steps"][-1]["tokens_per_expert"]
    assert all(max(layer) / sum(layer) < 0.5 for layer in last), last  # (even: 1/4 each)


ELASTIC = [*GPT, *MOE, "--optimizer", "sgd", "--lr", "0.05", "--steps", "20", "--global-batch-size", "32"]
ELASTIC += ["--checkpoint-every", "5", "--resume", "auto", "--eval-every", "10"]


@pytest.mark.slow
@pytest.mark.faults
def test_killed_rank_resumes_exactly(tmp_path):
    """A SIGKILLed rank under --max-restarts 1: the job resumes from its last checkpoint and ends
    bit-identical to its own uninterrupted run."""
    check_killed_rank_resumes_exactly(IMPL, ELASTIC, 20, tmp_path, None)


@pytest.mark.slow
@pytest.mark.faults
def test_killed_rank_without_restarts_ends_the_job_naming_it(tmp_path):
    """A SIGKILLed rank ends the job within 60 s (its peers blocked in an all-to-all); torchrun's report
    names it."""
    check_killed_rank_ends_the_job(IMPL, [*ELASTIC, "--steps", "200"], tmp_path)


@pytest.mark.faults
def test_stopped_rank_is_named_once_the_timeout_passes(tmp_path):
    """A SIGSTOPped rank: one line names it after --timeout (5 s here), exit code 1."""
    check_stopped_rank_is_named(IMPL, [*GPT, *MOE, "--steps", "100000"], tmp_path)


@pytest.mark.parametrize(
    ("argv", "world", "message"),
    [
        ([*GPT], 2, "give --experts E"),
        ([*GPT, "--experts", "3"], 2, "--experts 3 must divide by --ep 2"),
        ([*GPT, *MOE, "--ep", "3"], 4, "--ep 3 must divide the 4 ranks"),
        ([*GPT, *MOE, "--top-k", "5"], 2, "--top-k 5 sends each token to more experts than there are"),
        (["--model", "lenet", "--dataset", "synthetic", *MOE], 2, "--experts makes gpt's MLPs experts"),
        ([*GPT, "--top-k", "1"], 2, "--top-k shapes gpt's experts: give --experts too"),
        ([*GPT, *MOE, "--global-batch-size", "5"], 2, "must be divisible by world size"),
    ],
    ids=["no-experts", "experts-vs-ep", "ep-vs-world", "top-k", "lenet", "top-k-alone", "batch"],
)
def test_bad_input_is_one_line_before_any_process_group(argv, world, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_train_module(IMPL).parse_options(argv, world)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1], err


@pytest.mark.skipif(EXPORTED_IMPL is not None, reason="an exported project has this impl and single only")
@pytest.mark.parametrize("impl", ["ddp", "fsdp", "pipeline", "tensor_parallel", "context_parallel"])
def test_the_impls_that_do_not_train_experts_say_so_in_one_line(impl, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_train_module(impl).parse_options([*GPT, *MOE], 2)
    assert exit_info.value.code == 2
    assert f"--experts 4: {impl} does not train gpt's mixture of experts here" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ CUDA GPUs (NCCL; one rank per GPU)")
def test_on_gpus_matches_single_and_bf16_runs(single_train, tmp_path):
    args = [*parity_args("gpt"), *MOE, "--device", "cuda", "--log-every", "1"]
    run_ep(2, [*args, *GPU_PARITY, "--save-final", str(tmp_path / "e.pt"), "--out", str(tmp_path / "o")])
    single_args = [a for a in args if a != "--device" and a != "cuda"]
    single_train.main([*single_args, *GPU_PARITY, "--save-final", str(tmp_path / "s.pt")])
    a, b = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in ("s", "e"))
    assert max_relative_difference(b, a) < FP64_TOLERANCE
    check_communication_predicted(tmp_path / "o", 2)
    run_ep(2, [*args, "--precision", "bf16", "--out", str(tmp_path / "bf16")])
    check_communication_predicted(tmp_path / "bf16", 2)
