"""The cost model at the world sizes users run: one rank of 8, 64 and 512, run in this process on torch's
fake process group through each impl's own parallelization code (distref.simulate), its step's
communication counted and its model states measured — equal, exactly, to distref.cost's formulas.
Real-size presets (a 1.3B- and a 7B-like gpt) run on fake or meta tensors: no memory, no arithmetic."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from distref.cost.counts import same
from distref.simulate import PRESETS, GPTShape, simulate

# Small shapes whose sizes do not divide by the worlds: at 512 ranks FSDP2's last ranks hold no row of a
# 64-row or 1000-row parameter, and the ranks before them a partial one.
SMALL = GPTShape(layers=2, hidden=64, heads=8, vocab=1000, seq=16)
DEEP = GPTShape(layers=6, hidden=64, heads=8, vocab=1000, seq=16)  # 8 blocks: a stage each for 8 ranks
DEEPER = GPTShape(layers=14, hidden=64, heads=8, vocab=1000, seq=16)  # 16 blocks: 2 stages each for 8
TP64 = GPTShape(layers=1, hidden=128, heads=64, vocab=1000, seq=64)  # 1-D tensor parallel over 64 ranks
# ... over 512: heads of width 1, the sequence split over the 512 too (sequence parallel); ranks 500-511
# hold no column of the vocabulary (⌈1000/512⌉ = 2 each)
TP512 = GPTShape(layers=1, hidden=512, heads=512, vocab=1000, seq=512)
# Ring attention cuts each sequence into 2C chunks: one position per chunk at C = 64 and C = 512
RING64 = GPTShape(layers=1, hidden=64, heads=8, vocab=1000, seq=128)
RING512 = GPTShape(layers=1, hidden=64, heads=8, vocab=1000, seq=1024)
GPT_1_3B, GPT_7B = PRESETS["gpt-1.3b"], PRESETS["gpt-7b"]
EVERY_BLOCK = ",".join(str(b) for b in range(1, 16))  # DEEPER cut into its 16 blocks


def check(impl: str, world_size: int, shape: GPTShape, rank: int, options=(), **kwargs):
    """Simulate, and require measurement and formula equal (calls and bytes of each kind; model-state
    bytes) and the step to have communicated something. Returns the simulation."""
    run = simulate(impl, world_size, shape, rank=rank, options=options, **kwargs)
    assert not run.differences(), "\n".join(run.differences())
    assert run.communication, "the step communicated nothing"
    return run


def block_parameters(shape: GPTShape) -> list[int]:
    """Parameters of each of gpt's blocks: the embeddings, the transformer blocks, the head."""
    h = shape.hidden
    return [(shape.vocab + shape.seq) * h, *[12 * h * h + 12 * h] * shape.layers, 2 * h + shape.vocab * h]


def kinds(run) -> dict[str, tuple[int, int]]:
    return {kind: (entry["calls"], entry["bytes"]) for kind, entry in run.communication.items()}


@pytest.mark.parametrize(
    "world_size, rank, options",
    [
        (8, 7, []),
        (64, 63, ["--bucket-cap-mb", "0.1"]),  # several buckets
        (512, 0, []),
    ],
)
def test_ddp(world_size, rank, options):
    run = check("ddp", world_size, SMALL, rank, options)
    psi, tensors = SMALL.parameters(), 2 + 15 * SMALL.layers + 3  # AdamW: two moments, a step per tensor
    assert run.model_state_bytes == {
        "parameters": 4 * psi,
        "gradients": 4 * psi,
        "optimizer": 8 * psi + 4 * tensors,
    }
    assert run.communication["all_reduce"]["bytes"] == 4 * psi  # every gradient, once


@pytest.mark.parametrize(
    "world_size, rank, options",
    [
        (8, 0, []),
        (64, 63, []),
        (512, 0, []),
        (512, 511, []),  # holds none of the 64-row parameters and of the 1000-row tables
        (512, 300, ["--no-reshard-after-forward"]),
        (8, 7, ["--hsdp", "2"]),
        (64, 63, ["--hsdp", "8"]),
        (512, 511, ["--hsdp", "8"]),
    ],
)
def test_fsdp_and_hsdp(world_size, rank, options):
    run = check("fsdp", world_size, SMALL, rank, options)
    units = 4  # embed, block0, block1, head (the root holds no parameter)
    gathers = units if "--no-reshard-after-forward" in options else 2 * units - 1  # the last keeps its
    assert kinds(run)["all_gather"][0] == gathers and kinds(run)["reduce_scatter"][0] == units
    assert ("all_reduce" in run.communication) == ("--hsdp" in options)  # HSDP: across the replicas


def test_fsdp_rank_holds_its_rows_of_a_7b_model_at_512_ranks():
    """The ZeRO-3 arithmetic, per rank: (4 + 4 + 8)Ψ/N bytes in fp32 with AdamW, to FSDP2's padding
    (rank 0 holds a full ⌈d₀/N⌉ rows of every parameter; one step: test_the_first_step_is_steady)."""
    run = check("fsdp", 512, GPT_7B, 0, steps=1)
    psi, n = GPT_7B.parameters(), 512
    assert psi == 6_722_953_216
    assert run.model_state_bytes["parameters"] == pytest.approx(4 * psi / n, rel=0.002)
    assert run.model_state_bytes["optimizer"] == pytest.approx(8 * psi / n, rel=0.002)


@pytest.mark.parametrize(
    "world_size, shape, rank, options",
    [
        (8, SMALL, 7, []),
        (8, SMALL, 3, ["--no-sequence-parallel", "--no-loss-parallel"]),
        (64, TP64, 63, []),
        (512, TP512, 511, []),
        (512, TP512, 0, ["--no-sequence-parallel"]),
    ],
)
def test_tensor_parallel_1d(world_size, shape, rank, options):
    run = check("tensor_parallel", world_size, shape, rank, options)
    assert run.facts["mesh"] == {"dp_shard": 1, "tp": world_size}
    # sequence parallelism (gpt's default: on) gathers and scatters along the sequence; without it, the
    # layers' outputs are all-reduced
    sequence_parallel = "--no-sequence-parallel" not in options
    assert ("reduce_scatter" in run.communication) == sequence_parallel, run.communication.keys()


@pytest.mark.parametrize(
    "world_size, dp, tp, shape, rank",
    [
        (8, 2, 4, SMALL, 7),
        (64, 8, 8, SMALL, 63),
        (512, 64, 8, SMALL, 511),
        (512, 64, 8, SMALL, 8),
        (512, 64, 8, GPT_7B, 511),
    ],
)
def test_fsdp_over_tensor_parallel(world_size, dp, tp, shape, rank):
    steps = 1 if shape is GPT_7B else None  # (test_the_first_step_is_steady)
    run = check(
        "tensor_parallel", world_size, shape, rank, ["--dp-shard", str(dp), "--tp", str(tp)], steps=steps
    )
    assert run.facts["mesh"] == {"dp_shard": dp, "tp": tp}
    assert {"all_gather", "reduce_scatter", "all_reduce"} <= set(run.communication)


@pytest.mark.parametrize(
    "world_size, shape, rank, options",
    [
        (8, SMALL, 7, ["--dp-shard", "2"]),
        (8, SMALL, 6, ["--dp-shard", "2", "--cp-mode", "ulysses"]),
        (64, RING64, 63, []),
        (64, RING64, 37, ["--dp-shard", "4"]),
        (64, TP64, 63, ["--cp-mode", "ulysses"]),  # 64 heads for 64 ranks
        (512, RING512, 511, []),
        (512, RING64, 300, ["--dp-shard", "8"]),
        (512, TP512, 511, ["--cp-mode", "ulysses"]),
        (512, TP64, 100, ["--dp-shard", "8", "--cp-mode", "ulysses"]),
        (512, GPT_1_3B, 511, ["--dp-shard", "32", "--cp", "16", "--cp-mode", "ulysses"]),
    ],
)
def test_context_parallel(world_size, shape, rank, options):
    """Each rank holds slice rank % C of its group's sequences (the mesh's cp dimension innermost); its
    attention sends, by hand: with E = b·(s/C)·h elements of each of k and v per rank, per block and
    micro-batch, the ring's C − 1 forward and C − 1 backward hops of k and v (2E), and the key/value
    gradients' C hops home (2E, fp32), each a send and a recv; Ulysses' 8 all-to-alls of E (q, k, v to
    heads and the output back, forward and backward)."""
    steps = 1 if shape in (GPT_1_3B, RING512) else None  # (test_the_first_step_is_steady)
    run = check("context_parallel", world_size, shape, rank, options, steps=steps)
    dp = int(options[options.index("--dp-shard") + 1]) if "--dp-shard" in options else 1
    cp = world_size // dp
    assert run.facts["mesh"] == {"dp_shard": dp, "cp": cp} and run.facts["cp_rank"] == rank % cp
    E = shape.seq // cp * shape.hidden  # (one sequence per micro-step, fp32)
    if "ulysses" in options:
        assert kinds(run)["all_to_all"] == (8 * shape.layers, 8 * shape.layers * E * 4)
        assert not {"send", "recv"} & set(run.communication)
    else:
        hops = shape.layers * (2 * (cp - 1) + cp)
        assert kinds(run)["send"] == kinds(run)["recv"] == (hops, hops * 2 * E * 4)
        assert "all_to_all" not in run.communication
    assert {"all_gather", "reduce_scatter"} <= set(run.communication)  # FSDP2 over every rank


@pytest.mark.parametrize(
    "world_size, shape, rank, options",
    [
        (8, DEEP, 0, ["--schedule", "gpipe"]),
        (8, DEEP, 3, ["--microbatches", "8"]),
        (8, DEEPER, 7, ["--schedule", "interleaved-1f1b", "--microbatches", "8", "--partition", EVERY_BLOCK]),
        (8, DEEPER, 2, ["--schedule", "zbv", "--microbatches", "8", "--partition", EVERY_BLOCK]),
        (64, DEEP, 9, ["--dp", "8", "--microbatches", "8"]),
        (512, DEEP, 511, ["--dp", "64", "--microbatches", "8"]),
        (64, GPT_1_3B, 63, ["--dp", "8", "--microbatches", "8", "--partition", "4,7,10,13,16,19,22"]),
    ],
)
def test_pipeline_stage_cuts(world_size, shape, rank, options):
    """Model states per stage rank (its blocks), each boundary crossed twice per micro-batch."""
    run = check("pipeline", world_size, shape, rank, options, steps=1 if shape is GPT_1_3B else None)
    microbatches = int(options[options.index("--microbatches") + 1]) if "--microbatches" in options else 4
    sends = {"send", "recv"} & set(run.communication)
    boundary = shape.seq * shape.hidden * 4  # a micro-batch of one sequence, fp32
    assert sends, "no stage boundary crossed"
    for kind in sends:  # each boundary of a stage with a stage on another rank: once per micro-batch
        calls, moved = kinds(run)[kind]
        assert moved == calls * boundary and calls % microbatches == 0
    # the rank holds its stages' blocks, counted here from the shape
    bounds = list(itertools.pairwise([0, *run.facts["cuts"], shape.layers + 2]))
    held = sum(sum(block_parameters(shape)[slice(*bounds[stage])]) for stage in run.facts["stages"])
    assert run.model_state_bytes["parameters"] == run.model_state_bytes["gradients"] == 4 * held
    if "--dp" in options:  # each gradient averaged over the pipelines
        assert kinds(run)["all_reduce"][1] == 4 * held


@pytest.mark.parametrize(
    "world_size, rank, stage",
    [(8, 7, 1), (64, 63, 2), (512, 0, 3)],  # ZeRO-3 as rank 0 only (distref.simulate says why)
)
def test_deepspeed_zero(world_size, rank, stage):
    pytest.importorskip("deepspeed")
    check("deepspeed_zero", world_size, SMALL, rank, ["--zero-stage", str(stage)])


@pytest.mark.parametrize(
    "impl, world_size, rank, options, settings",
    [
        ("ddp", 64, 63, ["--bucket-cap-mb", "0.1"], {"grad_accum": 2, "optimizer": "sgd"}),
        ("fsdp", 64, 63, ["--hsdp", "8"], {"precision": "bf16", "grad_accum": 2}),
        ("fsdp", 512, 100, [], {"optimizer": "sgd", "activation_checkpointing": True}),
        ("tensor_parallel", 64, 63, ["--tp", "8"], {"precision": "bf16", "activation_checkpointing": True}),
        ("tensor_parallel", 8, 7, ["--no-sequence-parallel"], {"activation_checkpointing": True}),
        ("tensor_parallel", 8, 5, [], {"optimizer": "sgd", "weight_decay": 0.1, "micro_batch": 3}),
        ("tensor_parallel", 64, 63, ["--tp", "8"], {"grad_accum": 2, "optimizer": "sgd"}),
        ("context_parallel", 64, 63, ["--cp", "8"], {"precision": "bf16", "grad_accum": 2}),
        ("context_parallel", 64, 62, ["--cp", "8"], {"activation_checkpointing": True, "micro_batch": 3}),
        ("context_parallel", 64, 61, ["--cp", "4", "--cp-mode", "ulysses"], {"precision": "bf16"}),
        (
            "context_parallel",
            64,
            63,
            ["--cp", "8", "--cp-mode", "ulysses"],
            {"activation_checkpointing": True, "optimizer": "sgd", "grad_accum": 2},
        ),
    ],
)
def test_precision_accumulation_checkpointing_and_optimizers(impl, world_size, rank, options, settings):
    """bf16 (FSDP2's mixed-precision gathers, autocast's bf16 outputs), --grad-accum, recomputed forwards
    and SGD's state, as the formulas have them."""
    check(impl, world_size, SMALL, rank, options, **settings)


@pytest.mark.parametrize(
    "impl, options",
    [
        ("fsdp", ["--hsdp", "8"]),
        ("tensor_parallel", ["--dp-shard", "8"]),
        ("context_parallel", ["--dp-shard", "8"]),
        ("pipeline", ["--dp", "8", "--microbatches", "8"]),
    ],
)
def test_the_first_step_is_steady(impl, options):
    """On the fake backend FSDP2, DTensor and the pipeline schedules communicate the same in their first
    step as in their second (the real runs count their third: DDP and ZeRO-3 settle after the first):
    the real-size presets run one step."""
    shape = DEEP if impl == "pipeline" else SMALL
    first = simulate(impl, 64, shape, rank=63, options=options, steps=1)
    second = simulate(impl, 64, shape, rank=63, options=options, steps=2)
    assert first.communication == second.communication and first.communication
    assert first.model_state_bytes == second.model_state_bytes


@pytest.mark.parametrize(
    "impl, world_size, shape, options, tensors",
    [
        ("fsdp", 8, SMALL, ["--hsdp", "2"], "fake"),
        ("tensor_parallel", 8, SMALL, ["--dp-shard", "2"], "fake"),
        ("context_parallel", 8, SMALL, ["--dp-shard", "2"], "fake"),
        ("context_parallel", 8, SMALL, ["--cp-mode", "ulysses"], "fake"),
        ("pipeline", 8, DEEP, ["--microbatches", "8"], "meta"),
    ],
)
def test_tensors_without_data_count_what_real_ones_do(impl, world_size, shape, options, tensors):
    """The substitution the simulation rests on: a step on fake (or meta) tensors communicates and holds
    exactly what the same step on real tensors does."""
    rank = world_size - 1
    without = simulate(impl, world_size, shape, rank=rank, options=options, tensors=tensors)
    real = simulate(impl, world_size, shape, rank=rank, options=options, tensors="real")
    assert same(without.communication, real.communication)
    assert without.model_state_bytes == real.model_state_bytes


@pytest.mark.parametrize(
    "impl, world_size, rank, options, why",
    [
        ("model_parallel", 8, 0, [], "no simulation"),
        ("ddp", 8, 0, ["--comm-hook", "bf16"], "leaves it empty"),
        ("deepspeed_zero", 64, 1, ["--zero-stage", "3"], "rank 0 only"),
        (
            "pipeline",
            64,
            0,
            ["--dp", "8", "--schedule", "interleaved-1f1b", "--microbatches", "8"],
            "--partition",
        ),
        ("tensor_parallel", 64, 0, ["--tp", "64"], "must divide the 8 attention heads"),
        ("context_parallel", 16, 0, [], "cuts the 16 positions into 2 × --cp 16 chunks"),
        ("context_parallel", 16, 0, ["--cp-mode", "ulysses"], "--cp 16 must divide the 8 attention heads"),
    ],
)
def test_what_the_fake_backend_cannot_run_is_refused_with_the_reason(impl, world_size, rank, options, why):
    shape = GPTShape(layers=30, hidden=64, heads=8, vocab=1000, seq=16) if impl == "pipeline" else SMALL
    with pytest.raises(ValueError, match=why):
        simulate(impl, world_size, shape, rank=rank, options=options)


def test_a_zero3_simulation_leaves_torch_as_it_found_it():
    """DeepSpeed's ZeRO-3 replaces F.linear for the whole process: after a simulation it is torch's own
    again, or every later model in this process (a DDP test's) would compute its Linear gradients
    through DeepSpeed's wrapper, in another order (other DDP buckets)."""
    pytest.importorskip("deepspeed")
    import torch

    linear = torch.nn.functional.linear
    check("deepspeed_zero", 8, SMALL, 0, ["--zero-stage", "3"])
    assert torch.nn.functional.linear is linear


# ---- expert parallelism (impls/expert_parallel): each MoE layer's experts spread over ep ranks ----------

# 64 experts a layer: one a rank at --ep 64; 8: every expert in each group of 8 ranks, 8 copies of them
MOE64 = GPTShape(layers=2, hidden=64, heads=8, vocab=1000, seq=16, experts=64, top_k=2)
MOE8 = GPTShape(layers=2, hidden=64, heads=8, vocab=1000, seq=16, experts=8, top_k=1)


def expert_and_dense_elements(shape: GPTShape) -> tuple[int, int]:
    """Elements of each layer's experts (w1, b1, w2, b2 stacked over E), and of everything else."""
    h, f, e = shape.hidden, 4 * shape.hidden, shape.experts
    experts = shape.layers * e * (2 * h * f + f + h)
    return experts, shape.parameters() - experts


@pytest.mark.parametrize(
    "shape, rank, ep, settings",
    [
        (MOE64, 0, 64, {}),
        (MOE64, 63, 16, {"precision": "bf16"}),  # 4 copies of the experts; bf16 tokens
        (MOE8, 37, 8, {"grad_accum": 2, "activation_checkpointing": True}),  # recomputed forwards resend
        (MOE8, 5, 1, {}),  # every rank holds every expert: its tokens stay, no all-to-all
    ],
)
def test_expert_parallel(shape, rank, ep, settings):
    """Rank `rank` of 64 through impls/expert_parallel's own make_mesh and parallelize (its all-to-all
    dispatch, DDP for the rest): by hand, each MoE layer and micro-step sends its 16·k rows out and
    receives as many (the simulation's symmetric routing: distref.simulate.SymmetricRouting), each of
    them h wide, after the E counts (int64); backward sends both again, a checkpointed block's recomputed
    forward the first three. The rank keeps E/ep of each expert tensor and every other parameter whole."""
    run = check("expert_parallel", 64, shape, rank, ["--ep", str(ep)], **settings)
    k, micro_steps = shape.top_k, settings.get("grad_accum", 1)
    element = 2 if settings.get("precision") == "bf16" else 4
    rows, counts = 16 * k, 8 * shape.experts
    forwards = 2 if settings.get("activation_checkpointing") else 1
    calls_per_layer = 3 * forwards + 2
    bytes_per_layer = forwards * (counts + 2 * rows * 64 * element) + 2 * rows * 64 * element
    if ep == 1:
        assert "all_to_all" not in run.communication
    else:
        assert kinds(run)["all_to_all"] == (
            shape.layers * micro_steps * calls_per_layer,
            shape.layers * micro_steps * bytes_per_layer,
        )
    experts, dense = expert_and_dense_elements(shape)
    held = dense + experts // ep
    assert run.model_state_bytes["parameters"] == run.model_state_bytes["gradients"] == 4 * held
    assert run.facts["mesh"] == {"ep_replicate": 64 // ep, "ep": ep}
    # DDP all-reduces the rest in one bucket; 64/ep > 1 copies of the experts all-reduce each expert
    # tensor's rows they hold (4 a layer), one copy nothing
    copies = 0 if ep == 64 else 4 * shape.layers
    assert kinds(run)["all_reduce"] == (1 + copies, 4 * (dense + (copies and experts // ep)))


@pytest.mark.parametrize(
    "impl, shape, options, why",
    [
        ("expert_parallel", SMALL, [], "give --experts E"),
        ("expert_parallel", MOE8, ["--ep", "16"], "--experts 8 must divide by --ep 16"),
        ("expert_parallel", dataclasses.replace(MOE8, top_k=9), [], "more experts than the 8"),
        ("expert_parallel", dataclasses.replace(MOE8, expert_hidden=100), [], "4 × 64 wide, not 100"),
        ("fsdp", MOE8, [], "trained by impls/expert_parallel alone"),
    ],
)
def test_what_expert_parallelism_cannot_simulate_is_refused_with_the_reason(impl, shape, options, why):
    with pytest.raises(ValueError, match=why):
        simulate(impl, 64, shape, options=options)
