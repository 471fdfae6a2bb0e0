"""impls/context_parallel proven equal to impls/single (ring attention and Ulysses, 1-D and 2-D with
data-parallel groups, on short and long sequences), each rank holding its slice of every sequence, its
costs as the formulas say, resharding its checkpoints to another mesh, learning gpt's task across the
slices, and resuming exactly after a killed rank.

gpt only: the strategy splits attention's sequences (a model of yours has no attention it knows)."""

from __future__ import annotations

import json

import pytest
import torch

from distref.testing import (
    COST_RUN,
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
    self_launched,
)

IMPL = "context_parallel"
GPT = ["--model", "gpt", "--dataset", "synthetic"]


def run_cp(nproc: int, args: list[str], timeout: float = 300):
    result = launch(nproc, IMPL, args, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


# ---- The mechanics, in one process: the split, the blocks each rank computes, the merge -------------


def test_the_load_balanced_split_gives_each_rank_a_chunk_and_its_mirror():
    cp = load_train_module(IMPL)
    assert cp.slice_positions(16, 4, 0, load_balanced=True).tolist() == [0, 1, 14, 15]
    assert cp.slice_positions(16, 4, 3, load_balanced=True).tolist() == [6, 7, 8, 9]
    assert cp.slice_positions(16, 4, 1, load_balanced=False).tolist() == [4, 5, 6, 7]
    for balanced in (True, False):  # every position on exactly one rank
        held = torch.cat([cp.slice_positions(48, 4, r, load_balanced=balanced) for r in range(4)])
        assert sorted(held.tolist()) == list(range(48))


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_every_rank_computes_the_same_scores_at_every_hop_and_all_of_them_together_the_causal_ones(ranks):
    """The ring's block plan (ring_block) over the load-balanced split: at each hop every rank computes
    as many query-key scores (the balance), and over all hops and ranks each causal (query, key) pair is
    computed exactly once."""
    cp = load_train_module(IMPL)
    seq, chunk = 8 * ranks, 4
    positions = [cp.slice_positions(seq, ranks, r, load_balanced=True) for r in range(ranks)]
    pairs = []
    for hop in range(ranks):
        work = set()
        for rank in range(ranks):
            source = (rank - hop) % ranks
            rows, keys, causal = cp.ring_block(rank, source, chunk)
            q, k = positions[rank][rows], positions[source][keys]
            block = [
                (i, j)
                for a, i in enumerate(q.tolist())
                for b, j in enumerate(k.tolist())
                if not causal or b <= a
            ]
            assert all(j <= i for i, j in block)  # no key after its query
            work.add(len(block) if hop else len(q) * len(k))  # (hop 0: the diagonal block, masked)
            pairs += block
        assert len(work) == 1, f"hop {hop}: ranks do unequal work {work}"
    assert sorted(pairs) == [(i, j) for i in range(seq) for j in range(i + 1)]


def test_merging_blocks_by_log_sum_exp_is_attention_over_all_of_them():
    """Attention over keys A then B, merged by their log-sum-exp, equals one softmax over A and B; and the
    backward through each block, with the merged row's log-sum-exp, adds up to autograd's gradients."""
    cp = load_train_module(IMPL)
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 3, 6, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)
    )
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    out, lse = cp.attend(q.detach(), k.detach()[:, :, :2], v.detach()[:, :, :2], causal=False)
    block_out, block_lse = cp.attend(q.detach(), k.detach()[:, :, 2:], v.detach()[:, :, 2:], causal=False)
    cp.merge(out, lse, block_out, block_lse)
    assert torch.allclose(out, whole, rtol=0, atol=1e-14)

    grad_out = torch.randn(whole.shape, generator=g, dtype=torch.float64)
    whole.backward(grad_out)
    parts = [
        cp.attend_backward(q.detach(), k.detach()[:, :, s], v.detach()[:, :, s], grad_out, out, lse, False)
        for s in (slice(0, 2), slice(2, None))
    ]
    assert torch.allclose(parts[0][0] + parts[1][0], q.grad, atol=1e-13)
    assert torch.allclose(torch.cat([parts[0][1], parts[1][1]], dim=2), k.grad, atol=1e-13)
    assert torch.allclose(torch.cat([parts[0][2], parts[1][2]], dim=2), v.grad, atol=1e-13)


@pytest.mark.parametrize("causal", [True, False])
def test_the_fused_kernel_computes_the_definition(causal):
    """block_attention's fused CPU kernel (and its backward, given the whole rows' result and log-sum-exp)
    equals `attend`, the definition in plain operations, to fp64 rounding."""
    cp = load_train_module(IMPL)
    g = torch.Generator().manual_seed(1)
    q, k, v, grad_out = (torch.randn(2, 3, 8, 4, generator=g, dtype=torch.float64) for _ in range(4))
    out, lse = cp.block_attention(q, k, v, causal, torch.float64)
    expected_out, expected_lse = cp.attend(q, k, v, causal)
    assert torch.allclose(out, expected_out, rtol=0, atol=1e-14)
    assert torch.allclose(lse, expected_lse, rtol=0, atol=1e-14)
    fused = cp.block_attention_backward(q, k, v, grad_out, out, lse, causal, torch.float64)
    for got, expected in zip(fused, cp.attend_backward(q, k, v, grad_out, out, lse, causal), strict=True):
        assert torch.allclose(got, expected, rtol=0, atol=1e-13)


# ---- Equal to single --------------------------------------------------------------------------------

# The ring merges attention by log-sum-exp and each rank's slice adds its part of every gradient: other
# summation orders than single's, so fp32 AdamW (which amplifies rounding) is not exact against any single
# run. fp32 SGD is compared with plain single (1e-5), AdamW in fp64 (1e-12), as the parity matrix does.
CASES = {
    "ring2-sgd": (2, "sgd", [], "fp32"),
    "ulysses2-sgd": (2, "sgd", ["--cp-mode", "ulysses"], "fp32"),
    "ring4-adamw-accum2": (4, "adamw", ["--grad-accum", "2"], "fp64"),
    "ulysses4-adamw-accum2": (4, "adamw", ["--cp-mode", "ulysses", "--grad-accum", "2"], "fp64"),
    "dp2-ring2-adamw-accum2": (4, "adamw", ["--dp-shard", "2", "--cp", "2", "--grad-accum", "2"], "fp64"),
    "dp2-ulysses2-sgd": (4, "sgd", ["--dp-shard", "2", "--cp", "2", "--cp-mode", "ulysses"], "fp32"),
}
# AdamW at the parity matrix's lr, 0.01 (tensor_parallel measured fp64 rounding growing with the lr)
LR = {"sgd": "0.05", "adamw": "0.01"}


@pytest.mark.parametrize("case", CASES)
def test_parity_with_single_each_rank_holding_its_slice_at_the_predicted_cost(
    case, single_reference, tmp_path
):
    """gpt, 20 steps of 32: the final parameters equal plain single's on the whole batch; each rank held
    1/C of every sequence (between blocks and of the logits); and what every rank sent, held and kept for
    backward in the counted step is exactly what distref.cost.context_parallel predicts."""
    world, optimizer, options, precision = CASES[case]
    chosen = ["--optimizer", optimizer, "--lr", LR[optimizer], "--precision", precision]
    args = [*parity_args("gpt"), *chosen, *options]
    run_cp(world, [*args, "--save-final", str(tmp_path / "f.pt"), "--out", str(tmp_path / "o")])
    final = torch.load(tmp_path / "f.pt", weights_only=True)
    diff = max_relative_difference(final, single_reference("gpt", 1, chosen))
    tolerance = PARITY_TOLERANCE if precision == "fp32" else FP64_TOLERANCE
    assert diff < tolerance, f"{case}: {diff:.2e} from single ({precision})"

    record = check_communication_predicted(tmp_path / "o", world)
    check_model_states_predicted(record)
    check_activations_predicted(record)
    strategy = record["strategy"]
    dp, cp = (2, 2) if "--dp-shard" in options else (1, world)
    assert strategy["mesh"] == {"dp_shard": dp, "cp": cp}
    assert strategy["cp_mode"] == ("ulysses" if "ulysses" in options else "ring")
    batch, seq = 32 // dp // (2 if "--grad-accum" in options else 1), 16
    assert strategy["held_shapes"] == {
        "between_blocks": [batch, seq // cp, 64],
        "logits": [batch, seq // cp, 11],
    }
    sent = record["communication"]["measured"][0]
    assert ("all_to_all" in sent) == ("ulysses" in options) and ("send" in sent) == ("ulysses" not in options)
    # FSDP2 over every rank: each holds 1/world of the parameters (whole rows of each: about 1/world)
    held = record["model_state_bytes"]
    total = sum(v.numel() for v in final.values()) * (8 if precision == "fp64" else 4)
    assert sum(r["parameters"] for r in held) == total
    # The recorded accuracy (test shards scored with the gathered model) is that of the saved model.
    assert record["final_accuracy"] == score_saved_model(tmp_path / "f.pt", [*parity_args("gpt"), *chosen])


@pytest.mark.parametrize(
    ("world", "options"),
    [(2, ["--grad-accum", "2"]), (4, ["--cp-mode", "ulysses"])],
    ids=["ring2-accum2", "ulysses4"],
)
def test_masked_targets_equal_plain_single(world, options, single_reference, tmp_path):
    """gpt on masked targets (a sample scores 1 to 8 of its 16), so the ranks' slices score different
    numbers of tokens: equal to plain single, each rank's loss sum over the whole batch's scored count."""
    run_cp(world, [*parity_args("masked"), *options, "--save-final", str(tmp_path / "f.pt")])
    final = torch.load(tmp_path / "f.pt", weights_only=True)
    diff = max_relative_difference(final, single_reference("masked"))
    assert diff < PARITY_TOLERANCE, f"{diff:.2e} from plain single"


def test_token_data_of_yours_is_split_at_its_own_length(single_train, tmp_path, capsys):
    """--model gpt on token sequences of yours (distref.testing.own:example_tokens, 20 tokens each): ring ×2
    equals single; --cp 4 would cut them into 8 chunks, which 20 tokens are not: one line, exit 2."""
    # (by the module's name, which an exported project's vendored copy changes: a string would not follow it)
    args = ["--model", "gpt", "--dataset", f"{own.__name__}:example_tokens", "--optimizer", "sgd"]
    args += ["--lr", "0.05", "--steps", "6", "--global-batch-size", "16"]
    single_train.main([*args, "--save-final", str(tmp_path / "s.pt")])
    run_cp(2, [*args, "--save-final", str(tmp_path / "c.pt")])
    a, b = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in ("s", "c"))
    assert max_relative_difference(b, a) < PARITY_TOLERANCE
    capsys.readouterr()
    with pytest.raises(SystemExit):
        load_train_module(IMPL).parse_options(args, 4)
    assert "the sequence's 20 tokens must divide by 8" in capsys.readouterr().err


def test_one_rank_a_group_takes_a_sequence_of_any_length(tmp_path):
    """--cp 1 (two data-parallel ranks, each its own whole sequences): nothing to cut, so 33 tokens of text
    are taken, every position held."""
    cp = load_train_module(IMPL)
    assert cp.slice_positions(33, 1, 0, load_balanced=True).tolist() == list(range(33))
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    args = ["--model", "gpt", "--dataset", "text", "--data-root", str(text), "--sequence-length", "33"]
    cfg = cp.parse_options([*args, "--cp", "1", "--global-batch-size", "8"], 2)
    assert cfg.sequence_length == 33


LONG = [*GPT, "--sequence-length", "256", "--steps", "6", "--global-batch-size", "8"]
LONG += ["--optimizer", "adamw", "--lr", "0.01", "--precision", "fp64"]


@pytest.mark.parametrize(
    ("world", "options"), [(4, []), (2, ["--cp-mode", "ulysses"])], ids=["ring4", "ulysses2"]
)
def test_a_long_sequence_equals_single_at_the_predicted_cost(world, options, single_train, tmp_path):
    """256 tokens (128 digits, the separator, the digits reversed: each answer up to 255 tokens back, on
    another rank's slice), fp64 AdamW: equal to single within 1e-12, costs as predicted, 1/C of the
    sequence a rank."""
    single_train.main([*LONG, "--save-final", str(tmp_path / "s.pt")])
    run_cp(world, [*LONG, *options, "--save-final", str(tmp_path / "c.pt"), "--out", str(tmp_path / "o")])
    a, b = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in ("s", "c"))
    assert max_relative_difference(b, a) < FP64_TOLERANCE
    record = check_communication_predicted(tmp_path / "o", world)
    check_model_states_predicted(record)
    check_activations_predicted(record)
    assert record["strategy"]["held_shapes"]["between_blocks"] == [8, 256 // world, 64]


def test_bf16_trains_within_a_band_of_fp32(single_train, tmp_path):
    """bf16 (FSDP2's policy and autocast; the ring's softmax and merge in fp32): losses within 2% of fp32
    single's over 20 steps and not equal to them (it took effect); the saved parameters are fp32."""
    args = [*parity_args("gpt"), "--log-every", "1"]
    out = tmp_path / "bf16"
    run_cp(2, [*args, "--precision", "bf16", "--out", str(out), "--save-final", str(tmp_path / "f.pt")])
    single = single_train.main([*args, "--out", str(tmp_path / "single")])
    record = json.loads((out / "record.json").read_text())
    bf16_losses = torch.tensor([s["loss"] for s in record["steps"]])
    fp32_losses = torch.tensor([s["loss"] for s in single["steps"]])
    relative = ((bf16_losses - fp32_losses).abs() / fp32_losses).max().item()
    assert 1e-5 < relative < 2e-2, relative
    assert {v.dtype for v in torch.load(tmp_path / "f.pt", weights_only=True).values()} == {torch.float32}


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_compiled_blocks_equal_single_compiled(mode, single_train, tmp_path, monkeypatch):
    """--compile (aot_eager here: seconds, the same graphs' arithmetic as eager) compiles each block with
    its ring attention or its all-to-alls, and trains what single compiled does."""
    monkeypatch.setenv("DISTREF_COMPILE_BACKEND", "aot_eager")
    args = [*parity_args("gpt"), "--steps", "6", "--compile"]
    single_train.main([*args, "--save-final", str(tmp_path / "s.pt")])
    run_cp(
        2, [*args, "--cp-mode", mode, "--save-final", str(tmp_path / "c.pt"), "--out", str(tmp_path / "o")]
    )
    a, b = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in ("s", "c"))
    assert max_relative_difference(b, a) < PARITY_TOLERANCE
    assert json.loads((tmp_path / "o" / "record.json").read_text())["strategy"]["compiled_graphs"] > 0


# ---- Cost: what each option changes ------------------------------------------------------------------

# bf16 (k and v sent in 2 bytes, the ring's gradients summed in fp32), checkpointing (the recomputed
# forward's hops and all-to-alls), SGD with --grad-accum (FSDP2 reduces at the last micro-step only)
COST_CASES = {
    "ring2-bf16": (2, ["--precision", "bf16"]),
    "ulysses2-bf16": (2, ["--cp-mode", "ulysses", "--precision", "bf16"]),
    "ring2-checkpointed": (2, ["--activation-checkpointing"]),
    "ulysses4-checkpointed": (4, ["--cp-mode", "ulysses", "--activation-checkpointing"]),
    "ring4-sgd-accum2": (4, ["--optimizer", "sgd", "--grad-accum", "2"]),
}


@pytest.mark.parametrize("case", COST_CASES)
def test_cost_equals_the_formulas(case, tmp_path):
    world, options = COST_CASES[case]
    run_cp(world, ["--model", "gpt", *COST_RUN, *options, "--out", str(tmp_path)])
    record = check_communication_predicted(tmp_path, world)
    check_model_states_predicted(record)
    check_activations_predicted(record)


def test_ulysses_after_the_math_kernel_saves_no_second_copy_of_the_output():
    """On CUDA fp64 runs SDPA's math kernel (distref.cost.attention), which copies its output contiguous
    and saves that copy; under Ulysses the all-to-all sends it, and no other copy comes back to be saved.
    Measured on the CPU with SDPA forced to its math kernel (the same saves): Ulysses ×2, fp64, 8
    sequences of 16 tokens, 1,191,496 bytes per rank; the formula said 1,257,032 before it knew."""
    from distref.cost.context_parallel import context_parallel_activation_bytes

    shape = dict(micro_batch=8, seq=16, hidden=64, heads=4, layers=2, vocab=11, precision="fp64")
    assert context_parallel_activation_bytes(mode="ulysses", cp=2, device="cuda", **shape) == 1_191_496


def test_the_ring_sends_what_counted_by_hand(tmp_path):
    """ring ×2, gpt (2 blocks of 64), 24 sequences of 16 tokens: a rank holds n = 8 tokens, so k and v are
    E = 24·8·64 = 12,288 elements each. Per block: forward 1 hop of k and v (2E fp32: 98,304 bytes);
    backward 1 hop of them again and 2 of their gradients (the second takes them home): 4 sends and 4
    receives of 98,304 bytes per block, 8 of each per step."""
    run_cp(2, ["--model", "gpt", *COST_RUN, "--out", str(tmp_path)])
    sent = json.loads((tmp_path / "record.json").read_text())["communication"]["measured"][1]
    assert sent["send"] == sent["recv"] == {"calls": 8, "bytes": 8 * 98_304, "bus_bytes": 8 * 98_304.0}


# ---- Checkpoints, convergence, faults, bad input --------------------------------------------------------


@pytest.mark.faults
def test_a_checkpoint_of_one_mesh_resumes_on_another(single_train, tmp_path):
    """torch.distributed.checkpoint reshards on load: ring ×2 saves at step 6, 2 × 2 (data-parallel groups
    of Ulysses pairs) continues to 8, equal (fp64, AdamW: its state resharded too) to single."""
    ckpt = tmp_path / "ckpt"
    args = [*GPT, "--optimizer", "adamw", "--precision", "fp64", "--global-batch-size", "16", "--steps", "8"]
    single_train.main([*args, "--save-final", str(tmp_path / "straight.pt")])
    run_cp(2, [*args, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "6"])
    mesh = ["--dp-shard", "2", "--cp-mode", "ulysses"]
    final = ["--save-final", str(tmp_path / "resharded.pt")]
    resumed = run_cp(4, [*args, *mesh, "--checkpoint-dir", str(ckpt), "--resume", "auto", *final])
    assert "context_parallel: resumed from" in resumed.stdout and "step 6" in resumed.stdout
    a, b = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in ("straight", "resharded"))
    assert 0 < max_relative_difference(b, a) < FP64_TOLERANCE


def test_gpt_learns_a_reversal_across_the_slices(tmp_path):
    """gpt on digit reversal over 64 tokens (32 digits: every answer on another part of the sequence than
    its digit, mostly another rank's), ring ×2, 200 steps of 64, AdamW 3e-3: >= 95% of the reversed
    tokens (chance 10%). Measured: 15% at step 50, 100% from step 100 on, 20 s."""
    args = [*GPT, "--sequence-length", "64", "--steps", "200", "--global-batch-size", "64", "--lr", "3e-3"]
    run_cp(2, [*args, "--eval-every", "100", "--target-accuracy", "0.95", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["final_accuracy"] >= 0.95, record["evals"]
    assert record["time_to_target_s"] is not None
    assert record["steps"][-1]["loss"] < record["steps"][0]["loss"] / 10


ELASTIC = [*GPT, "--optimizer", "sgd", "--lr", "0.05", "--steps", "20", "--global-batch-size", "32"]
ELASTIC += ["--checkpoint-every", "5", "--resume", "auto", "--eval-every", "10"]


@pytest.mark.slow
@pytest.mark.faults
def test_killed_rank_resumes_exactly(tmp_path):
    """A SIGKILLed rank under --max-restarts 1: the job resumes from its last checkpoint and ends
    bit-identical to its own uninterrupted run (the ring sums otherwise than any single run)."""
    check_killed_rank_resumes_exactly(IMPL, ELASTIC, 20, tmp_path, None)


@pytest.mark.slow
@pytest.mark.faults
def test_killed_rank_without_restarts_ends_the_job_naming_it(tmp_path):
    """A SIGKILLed rank ends the job within 60 s; the launcher's report names it."""
    check_killed_rank_ends_the_job(IMPL, [*ELASTIC, "--steps", "200"], tmp_path)


@pytest.mark.faults
def test_stopped_rank_is_named_once_the_timeout_passes(tmp_path):
    """A SIGSTOPped rank: one line names it after --timeout (5 s here), exit code 1."""
    check_stopped_rank_is_named(IMPL, [*GPT, "--steps", "100000"], tmp_path)


@pytest.mark.parametrize(
    ("argv", "world", "message"),
    [
        (
            ["--model", "lenet"],
            2,
            "--model lenet: context parallelism here splits the sequences of gpt's attention; use --model "
            "gpt or gpt2",
        ),
        ([*GPT, "--cp", "3"], 4, "--cp 3 must divide the 4 ranks"),
        ([*GPT, "--dp-shard", "3"], 4, "--dp-shard 3 must divide the 4 ranks"),
        ([*GPT, "--dp-shard", "2", "--cp", "4"], 4, "--dp-shard 2 × --cp 4 = 8 ranks, but the job has 4"),
        (
            [*GPT, "--sequence-length", "12"],
            4,
            "--cp 4 with ring attention splits each sequence into 2 × 4 = 8 chunks (the load balanced causal "
            "split): the sequence's 12 tokens must divide by 8 (--sequence-length)",
        ),
        (
            [*GPT, "--cp-mode", "ulysses"],
            8,
            "--cp 8 with Ulysses must divide gpt's 4 attention heads and the sequence's 16 tokens "
            "(--sequence-length)",
        ),
        (
            [*GPT, "--dp-shard", "2", "--global-batch-size", "10", "--grad-accum", "2"],
            4,
            "--global-batch-size 10 must be divisible by --dp-shard × --grad-accum = 2 × 2 = 4",
        ),
        (
            [*GPT, "--sequence-length", "17"],
            2,
            "--sequence-length 17: gpt's synthetic task is digits, a separator and the digits reversed, "
            "2 × digits tokens in all: give an even length",
        ),
    ],
)
def test_bad_input_is_one_line_before_any_process_group(argv, world, message, capsys):
    cp = load_train_module(IMPL)
    with pytest.raises(SystemExit) as exc:
        cp.parse_options(["--dataset", "synthetic", *argv], world)
    assert exc.value.code == 2
    assert capsys.readouterr().err == f"context_parallel/train.py: error: {message}\n"


def test_fp16_is_refused_with_the_reason_even_where_cuda_would_take_it(monkeypatch, capsys):
    import distref.cli

    monkeypatch.setattr(distref.cli, "uses_cuda", lambda cfg: True)
    cp = load_train_module(IMPL)
    with pytest.raises(SystemExit):
        cp.parse_options([*GPT, "--precision", "fp16"], 2)
    assert "no sharded loss scaler): use bf16" in capsys.readouterr().err


@pytest.mark.faults
def test_plain_python_refuses_bad_input_before_starting_any_rank():
    """Bad input to `python train.py`: one line, exit code 2, and no rank started."""
    result = self_launched(IMPL, ["--dataset", "synthetic"], timeout=120)  # lenet, the run contract's default
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1:] == [
        "context_parallel/train.py: error: --model lenet: context parallelism here splits the sequences of "
        "gpt's attention; use --model gpt or gpt2"
    ]
    assert "Traceback" not in result.stderr and "starting" not in result.stdout


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ CUDA GPUs (NCCL; one rank per GPU)")
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_on_gpus_matches_single_and_bf16_runs(mode, single_train, tmp_path):
    args = [*parity_args("gpt"), "--device", "cuda", "--log-every", "1", "--cp-mode", mode]
    run_cp(2, [*args, *GPU_PARITY, "--save-final", str(tmp_path / "c.pt"), "--out", str(tmp_path / "o")])
    single_args = [a for a in args if a not in ("--cp-mode", mode)]
    single_train.main([*single_args, *GPU_PARITY, "--save-final", str(tmp_path / "s.pt")])
    a, b = (torch.load(tmp_path / f"{k}.pt", weights_only=True) for k in ("s", "c"))
    assert max_relative_difference(b, a) < FP64_TOLERANCE
    check_communication_predicted(tmp_path / "o", 2)
    run_cp(2, [*args, "--precision", "bf16", "--out", str(tmp_path / "bf16")])
    record = json.loads((tmp_path / "bf16" / "record.json").read_text())
    assert record["status"] == "completed" and all(s["loss"] is not None for s in record["steps"])


def test_a_sequence_whose_data_outgrows_the_memory_is_refused_counting_every_rank(monkeypatch, capsys):
    """10,000,000 tokens: every rank makes 12.8 GB of sequences (it reads its group's whole batch, then
    keeps its slice). Two ranks on a machine of 24 GB: one line, exit 2, before any rank, though each rank
    holds 1/C of each sequence (the batch is not split over them: the data is still made whole)."""
    from distref.data import datasets

    monkeypatch.setattr(datasets, "physical_memory", lambda: 24 * 10**9)
    with pytest.raises(SystemExit) as exc:
        load_train_module(IMPL).parse_options([*GPT, "--sequence-length", "10000000"], 2)
    assert exc.value.code == 2 and "2 process(es) here would each make 12.8 GB" in capsys.readouterr().err
