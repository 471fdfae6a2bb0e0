"""python -m distref.plan: the ZeRO paper's example, the plan against the fake process group at 64 ranks
(--simulate), the mesh search, the ranking, and bad input in one line. Against measured runs (--validate,
on the compare runs): core/tests/test_report_and_compare.py."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import subprocess
import sys

import pytest
import torch

from distref import plan
from distref.cost import activations as act
from distref.distributed.partition import MODEL_DATASETS, balanced_cut_points, part_bounds
from distref.models import build_model, gpt
from distref.plan.cli import parse_args, resolve_model
from distref.plan.cluster import GPUS, Cluster, Training
from distref.plan.costing import cost, cut_bounds, schedule_orders, step_flops, unit_shapes
from distref.plan.layouts import Layout, layouts
from distref.plan.model import MODELS, decoder, flops_measured, parameters_only, project_model
from distref.plan.ranking import make_plan
from distref.plan.simulation import simulate_row
from distref.simulate import PRESETS, GPTShape
from distref.testing.runs import load_train_module


def run_plan(capsys, *argv: str) -> tuple[int, str]:
    code = plan.main(list(argv))
    return code, capsys.readouterr().out


def test_the_interface_reproduces_the_zero_paper_example(capsys):
    """7.5B parameters, 64 GPUs, mixed-precision Adam: 120 / 31.4 / 16.6 / 1.9 GB per GPU for ZeRO stages
    0-3 (Rajbhandari et al., Figure 1) — from `--params N --gpus G --json`, the interface the checks use."""
    code, out = run_plan(capsys, "--params", "7.5e9", "--gpus", "64", "--json")
    assert code == 0
    rows = {row["strategy"]: row for row in json.loads(out)}
    states = {name: rows[name]["memory_per_gpu_bytes"]["model_states"] for name in rows}
    assert states["ddp"] == 120e9
    assert states["zero1"] == 31.40625e9 and states["zero2"] == 16.640625e9 and states["zero3"] == 1.875e9
    # FSDP at 4 micro-steps (256 sequences, 64 GPUs, 1 each) accumulates gradients whole until the last, as
    # impls/fsdp does; in one micro-step it holds what ZeRO-3 holds
    assert states["fsdp"] == 2 * 7.5e9 / 64 + 2 * 7.5e9 + 12 * 7.5e9 / 64
    _, out = run_plan(capsys, "--params", "7.5e9", "--gpus", "64", "--global-batch", "64", "--json")
    one_step = {row["strategy"]: row["memory_per_gpu_bytes"]["model_states"] for row in json.loads(out)}
    assert one_step["fsdp"] == one_step["zero3"] == 1.875e9
    assert states["zero2-offload"] == 2 * 7.5e9 + 2 * 7.5e9 / 64  # the optimizer's 12Ψ/N on the CPU
    assert rows["zero2-offload"]["cpu_bytes"] == 12 * 7.5e9 / 64
    assert all(
        row["memory_per_gpu_bytes"]["total"] == row["memory_per_gpu_bytes"]["model_states"]
        for row in rows.values()
    )
    assert not rows["ddp"]["fits"] and rows["zero1"]["fits"]  # 120 GB on an 80 GB H100
    ranked = json.loads(out)
    assert ranked[-1]["strategy"] == "ddp"  # what does not fit comes last


def test_simulate_runs_the_planned_sharding_at_64_ranks(capsys):
    """A 1.3B decoder on 64 GPUs, fp32: the best FSDP row, run through impls/fsdp's own sharding as rank 0 of
    64 on the fake process group, holds and communicates what the plan says, exactly."""
    model = decoder("1.3b", MODELS["1.3b"])
    cluster = Cluster(GPUS["h100-80gb"], 64)
    training = Training(64, 1, "fp32", "adamw", False, 0.4)
    made = make_plan(model, cluster, training)
    fsdp = next(row for row in made.rows if row.strategy == "fsdp")
    said = simulate_row(made, fsdp)
    states = fsdp.memory_per_gpu_bytes["model_states"]
    communication = sum(fsdp.communication_bytes.values())
    assert f"model states {int(states):,} B, plan (fp32) {states:,.0f} B" in said, said
    assert f"communication {communication:,.0f} bus bytes per step, plan {communication:,.0f}" in said, said
    # DDP's simulation builds real tensors: 23 GB of a 1.3B model's are refused, not allocated
    ddp = next(row for row in made.rows if row.strategy == "ddp")
    assert "too much to build here" in simulate_row(made, ddp)


def test_the_mesh_search_tries_powers_of_two_and_says_why_it_skipped_the_rest():
    model = decoder("7b", MODELS["7b"])
    found, skipped = layouts(model, Cluster(GPUS["h100-80gb"], 32))
    meshes = {(layout.strategy, layout.dp, layout.tp, layout.pp) for layout in found}
    assert {("tp", 16, 2, 1), ("tp", 8, 4, 1), ("tp", 4, 8, 1)} <= meshes
    assert ("pp-1f1b", 1, 1, 32) in meshes and ("pp-zbv", 2, 1, 16) in meshes and ("hsdp", 32, 1, 1) in meshes
    reasons = dict(skipped)
    assert (
        "beyond a node's 8 GPUs" in reasons["tp16"]
        and reasons["pp32-zbv"] == "more stages than the model's 34 blocks"
    )
    _, skipped = layouts(parameters_only(10**9), Cluster(GPUS["a100-40gb"], 8))
    assert "needs a decoder's shape" in dict(skipped)["tp"]


def test_a_mesh_asked_for_is_the_only_one_planned(capsys):
    """--tp 4 on 32 GPUs: tensor parallelism of degree 4 over 8 data-parallel groups, nothing else; --pp 3
    on 24 GPUs (not a power of two: asked for, so planned); --cp 4: ring and Ulysses over 4 ranks."""
    code, out = run_plan(capsys, "--model", "7b", "--gpus", "32", "--tp", "4", "--json")
    assert code == 0 and [(r["strategy"], r["mesh"]) for r in json.loads(out)] == [("tp", "dp8×tp4")]
    code, out = run_plan(capsys, "--model", "7b", "--gpus", "24", "--pp", "3", "--json")
    meshes = {r["mesh"] for r in json.loads(out)}
    assert code == 0 and meshes == {"dp8×pp3"}
    code, out = run_plan(capsys, "--model", "7b", "--gpus", "32", "--cp", "4", "--json")
    rows = {(r["strategy"], r["mesh"]) for r in json.loads(out)}
    assert code == 0 and rows == {("cp", "dp8×cp4"), ("cp-ulysses", "dp8×cp4")}


def test_a_pipeline_s_memory_follows_its_schedule():
    """The fullest pipeline rank r holds M micro-batches of its stage under GPipe, min(M, p − r) under 1F1B
    (GPipe arXiv 1811.06965; PipeDream-Flush); the bubble costs (p − 1)/M of compute, and the slowest
    stage sets the pace."""
    model = decoder("1.3b", MODELS["1.3b"])
    cluster = Cluster(GPUS["h100-80gb"], 8)
    training = Training(32, 1, "fp32", "adamw", False, 0.4)
    blocks, loss = model.formula(training.saving("pp-gpipe", model.gpt), False)
    bounds = cut_bounds(model, 8)

    def stage(r: int) -> int:  # one micro-batch's activations on stage r
        first, last = bounds[r]
        return act.stage_bytes(blocks[first:last], loss if r == 7 else None, 1)

    for schedule, in_flight in (("gpipe", lambda r: 32), ("1f1b", lambda r: min(32, 8 - r))):
        row = cost(Layout(f"pp-{schedule}", dp=1, pp=8), model, cluster, training)
        r = row.pipeline_rank
        assert row.memory_per_gpu_bytes["activations"] == in_flight(r) * stage(r), schedule
        # the bubble, and the slowest stage's FLOPs over the mean (the embedding's stage: fewer blocks)
        stage_flops = [sum(model.block_flops[first:last]) for first, last in bounds]
        imbalance = max(stage_flops) / (sum(stage_flops) / 8)
        compute = step_flops(model, training, 8) / (GPUS["h100-80gb"].peak_flops["fp32"] * 0.4)
        assert imbalance > 1.05 and row.compute_s == pytest.approx(compute * (1 + 7 / 32) * imbalance)


def test_the_decoder_flops_formula_agrees_with_torch_s_counter():
    """PaLM's 6N + 12·L·h·s per token against FlopCounterMode on the same decoder (meta device): within 2%
    (the counter leaves out layer norms and biases, and counts attention as SDPA does)."""
    for shape in (PRESETS["gpt-tiny"], GPTShape(4, 256, 8, 1000, 128)):
        with torch.device("meta"):
            module = gpt(shape.config())
        counted = flops_measured(module, (shape.seq,), tokens=True)
        assert decoder("x", shape).flops_per_sample == pytest.approx(counted, rel=0.02)


def test_the_balanced_cut_is_the_best_and_the_earliest_of_the_best():
    """The impls' cut, which the plan calls too: of every cut into parts that each hold parameters, one
    whose largest part is the smallest, and of several such (ties), the earliest cuts. resnet18 in 4
    stages: layer4 alone is the largest part, and the cuts before it come as early as they can."""
    sizes = [5, 1, 9, 2, 2, 7, 3, 8, 0, 9]
    for parts in range(2, len(sizes)):
        every = [
            list(cuts)
            for cuts in itertools.combinations(range(1, len(sizes)), parts - 1)
            if all(sum(sizes[a:z]) for a, z in part_bounds(list(cuts), len(sizes)))
        ]
        largest = {tuple(c): max(sum(sizes[a:z]) for a, z in part_bounds(c, len(sizes))) for c in every}
        best = min(largest.values())
        assert balanced_cut_points(sizes, parts) == min(c for c in every if largest[tuple(c)] == best)
    assert [a for a, _ in cut_bounds(project_model("resnet18"), 4)] == [0, 1, 4, 5]


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv", "dualpipev"])
def test_schedule_orders_are_torch_s_own(schedule, monkeypatch):
    """The planner's order of work is the one torch's schedule holds for each rank (impls/pipeline's
    stages, distref.distributed.stages.work_order): every stage the rank holds runs each micro-batch's
    forward once and its backward once (whole, or as input- then weight-gradient passes). The planner
    skips the schedule's lowering to sends and receives (costing.compute_order_only): the order is the
    one the schedule holds when built whole."""
    import contextlib

    from distref.plan import costing

    orders = schedule_orders(schedule, 2, 4)
    monkeypatch.setattr(costing, "compute_order_only", contextlib.nullcontext)
    assert schedule_orders.__wrapped__(schedule, 2, 4) == orders
    pipeline = load_train_module("pipeline")
    for rank, order in orders.items():
        held = sorted(pipeline.stage_indices(schedule, rank, 2, 2))
        assert sorted({stage for _, stage, _ in order}) == held
        for stage in held:
            for micro_batch in range(4):
                kinds = sorted(k for k, s, m in order if (s, m) == (stage, micro_batch))
                assert kinds in (["B", "F"], ["F", "I", "W"]), (rank, stage, micro_batch, kinds)
                done = [k for k, s, m in order if (s, m) == (stage, micro_batch)]
                assert done[0] == "F"  # a backward never runs before its forward


def test_nothing_fits_says_so_and_names_the_smallest_cluster_that_would(capsys):
    code, out = run_plan(capsys, "--model", "70b", "--gpu", "a100-40gb", "--gpus", "8")
    assert code == 0
    assert "Nothing fits on 8 GPUs. The smallest cluster that would: " in out
    gpus = int(out.split("The smallest cluster that would: ")[1].split()[0])
    model, training = (
        decoder("70b", MODELS["70b"]),
        Training(256, 1, "mixed", "adamw", False, 0.4),
    )
    bigger = make_plan(model, Cluster(GPUS["a100-40gb"], gpus), training)
    smaller = make_plan(model, Cluster(GPUS["a100-40gb"], gpus // 2), training)
    assert bigger.rows[0].fits and not smaller.rows[0].fits
    # 70B in fp32 at 4096 tokens keeps 172 GB of activations per sequence: only context parallelism, each
    # GPU holding 1/8 of a sequence, fits it on 24 GB L4s; tensor parallelism of 8 on no cluster of them
    code, out = run_plan(capsys, "--model", "70b", "--gpu", "l4", "--gpus", "8", "--precision", "fp32")
    assert code == 0 and "The smallest cluster that would: 2048 GPUs, with cp-ulysses dp256×cp8" in out
    code, out = run_plan(
        capsys, "--model", "70b", "--gpu", "l4", "--gpus", "8", "--precision", "fp32", "--tp", "8"
    )
    assert code == 0 and "Nothing fits, on any cluster" in out and "--activation-checkpointing" in out


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--model", "9b"], "unknown model '9b'"),
        (["--model", "7b", "--gpu", "v100"], "unknown GPU 'v100'"),
        (["--model", "7b", "--gpus", "12"], "12 GPUs do not fill nodes of 8"),
        (["--params", "-5"], "must be a positive whole number"),
        (["--params", "2.5"], "must be a positive whole number"),
        (["--model", "7b", "--mfu", "1.5"], "a fraction of the peak"),
        (["--model", "7b", "--params", "10"], "give --model NAME or --params N"),
        (["--model", "nowhere.module:build"], "cannot import 'build' from 'nowhere.module'"),
        (["--params", "1000", "--global-batch", "4"], "no layout can run"),
        (["--model", "125m", "--simulate", "999"], "--simulate 999: the plan has"),
        (["--model", "7b", "--gpus", "32", "--tp", "3"], "--tp 3 does not divide the 32 GPUs"),
        (["--model", "7b", "--tp", "2", "--pp", "2"], "no impl here combines tensor and pipeline"),
        (
            ["--model", "7b", "--tp", "2", "--cp", "2"],
            "--tp 2 with --cp 2: no impl here combines tensor and context",
        ),
        (["--model", "7b", "--gpus", "32", "--cp", "3"], "--cp 3 does not divide the 32 GPUs"),
        (["--model", "7b", "--cp", "3", "--gpus", "24"], "no layout can run: ring attention cuts"),
        (["--model", "7b", "--memory-gb", "1e300"], "argument --memory-gb: 1e300 is too large"),
        (["--model", "7b", "--peak-tflops", "1e300"], "argument --peak-tflops: 1e300 is too large"),
        (["--model", "125m", "--plot", "/nonexistent/plan.png"], "--plot /nonexistent/plan.png: no folder"),
        (
            ["--model", "125m", "--plot", "plan.xyz"],
            "--plot plan.xyz: name a file ending in one of .",
        ),
        (["--model", ":mlp"], "--model :mlp: give MODULE:FUNCTION"),
        # contradictions: options that would be ignored
        (
            ["--model", "125m", "--micro-batch", "2", "--grad-accum", "4"],
            "--micro-batch or --grad-accum, not both",
        ),
        (["--model", "125m", "--json", "--md"], "argument --md: not allowed with argument --json"),
        (["--model", "125m", "--sample-shape", "16"], "--sample-shape describes a module:function's input"),
        (["--model", "125m", "--tokens"], "--tokens describes a module:function's input"),
        (["--model", "mymodel:build", "--tokens"], "--tokens needs --sample-shape T"),
        (["--model", "lenet", "--seq", "64"], "--seq is a decoder preset's"),
        (["--validate", "runs/x", "--gpus", "8"], "it takes no --gpus"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, said, capsys):
    try:
        code = plan.main(argv)
    except SystemExit as e:  # (argparse's own checks exit)
        code = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and said in lines[0], err


def test_the_command_line_says_it_in_one_line_and_exits_2():
    """The same, as a user runs it: `python -m distref.plan`."""
    done = subprocess.run(
        [sys.executable, "-m", "distref.plan", "--model", "9b"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "unknown model '9b'" in done.stderr


def test_a_reader_gone_away_ends_the_plan_quietly():
    """`python -m distref.plan ... --json | head -1`: the reader closes the pipe before the plan is
    written; the plan ends as Unix tools do, without a traceback (nor torch's "[rank0]:" before each line,
    which every fake process group the schedules are built on added once more)."""
    plan_process = subprocess.Popen(
        [sys.executable, "-m", "distref.plan", "--model", "125m", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    plan_process.stdout.close()
    err = plan_process.stderr.read()
    assert plan_process.wait(timeout=120) == 141 and err == ""


def test_building_a_schedule_s_order_leaves_the_excepthook_as_it_was():
    hook = sys.excepthook
    schedule_orders.cache_clear()
    schedule_orders("zbv", 2, 4)
    assert sys.excepthook is hook


def test_an_error_of_your_model_in_several_lines_is_said_in_one(tmp_path, monkeypatch, capsys):
    (tmp_path / "twolines.py").write_text(
        "def build():\n    raise ValueError('the first line\\nthe second line')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert plan.main(["--model", "twolines:build"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ValueError: the first line the second line" in err, err


def test_project_models_and_any_module_are_planned(capsys, tmp_path, monkeypatch):
    """lenet with its proven activation formula; an nn.Module given as module:function, built on the meta
    device, with FLOPs counted by torch (its activations: no formula, said)."""
    code, out = run_plan(
        capsys, "--model", "lenet", "--gpu", "cpu", "--gpus", "2", "--global-batch", "64", "--json"
    )
    assert code == 0
    ddp = next(row for row in json.loads(out) if row["strategy"] == "ddp")
    lenet = project_model("lenet")
    assert (ddp["micro_batch"], ddp["grad_accum"]) == (1, 32)  # 64 = 2 ranks × 1 sample × 32 micro-steps
    sixteen_bits = act.saving_for("bf16", "cpu", "16-bit")  # mixed precision: 16-bit parameters
    assert ddp["memory_per_gpu_bytes"]["activations"] == act.stage_bytes(
        *lenet.formula(sixteen_bits, False), 1
    )
    (tmp_path / "mymodel.py").write_text(
        "import torch\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(1000, 4000), torch.nn.Linear(4000, 10))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out = run_plan(
        capsys, "--model", "mymodel:build", "--sample-shape", "1000", "--gpus", "8", "--json"
    )
    rows = json.loads(out)
    assert code == 0 and rows[0]["memory_per_gpu_bytes"]["activations"] is None
    assert any("activations: no formula for this model" in note for note in rows[0]["extrapolated"])
    model = resolve_model(parse_args(["--model", "mymodel:build", "--sample-shape", "1000"]))
    # counted: forward 2·N, weight gradients 2·N, and the input gradient of the second layer only (the
    # sample needs none): 6N's rule of thumb would say 24.2M
    weights = 1000 * 4000 + 4000 * 10
    assert model.flops_per_sample == 2 * weights + 2 * weights + 2 * 4000 * 10


def test_the_plot_is_drawn(tmp_path, capsys):
    from matplotlib.image import imread

    code, _ = run_plan(capsys, "--model", "125m", "--gpus", "8", "--plot", str(tmp_path / "plan.png"))
    height, width, _ = imread(tmp_path / "plan.png").shape
    assert code == 0 and width > 1000 and height > 500


def test_every_ranked_row_fits_before_any_that_does_not(capsys):
    code, out = run_plan(capsys, "--model", "13b", "--nodes", "2", "--json")
    rows = json.loads(out)
    fits = [row["fits"] for row in rows]
    assert code == 0 and fits == sorted(fits, reverse=True) and any(fits) and not all(fits)
    fitting = [row["tokens_per_s_per_gpu"] for row in rows if row["fits"]]
    assert all(float(f"{a:.3g}") >= float(f"{b:.3g}") for a, b in itertools.pairwise(fitting))


def test_each_collective_runs_on_the_link_its_group_spans():
    """HSDP on 4 nodes of 8: the shard group's gathers and reduce-scatters in the node, the replicas'
    all-reduce of each shard between nodes; tensor parallelism within a node, its FSDP between nodes."""
    model, training = decoder("7b", MODELS["7b"]), Training(256, 1, "mixed", "adamw", False, 0.4)
    cluster = Cluster(GPUS["h100-80gb"], 32)
    hsdp = cost(Layout("hsdp", dp=32, shard=8), model, cluster, training)
    shard_bytes = sum(
        math.prod(shape) for unit in unit_shapes(model) for shape in unit
    )  # (the model's elements; each rank's shard is 1/8, padded per row)
    inter = hsdp.communication_bytes["inter_node"]
    assert inter == pytest.approx(
        2 * 3 / 4 * 2 * shard_bytes / 8, rel=1e-3
    )  # all-reduce, 4 replicas, 2 bytes
    assert hsdp.communication_bytes["intra_node"] > 10 * inter
    tp = cost(Layout("tp", dp=8, tp=4), model, cluster, training)
    one_node = cost(Layout("tp", dp=2, tp=4), model, Cluster(GPUS["h100-80gb"], 8), training)
    assert one_node.communication_bytes["inter_node"] == 0 and tp.communication_bytes["inter_node"] > 0


def test_what_runs_after_the_backward_is_not_hidden():
    """Each collective hides only under the compute it can run beside: ZeRO-1 reduces at the step boundary
    and gathers after the optimizer step (all exposed), DDP's all-reduce in the last micro-step's backward
    (hidden up to 2/3 of that micro-step's compute), ZeRO-2's reductions in every backward."""
    model, training = decoder("7b", MODELS["7b"]), Training(256, 1, "mixed", "adamw", False, 0.4)
    cluster = Cluster(GPUS["h100-80gb"], 32)
    rows = {s: cost(Layout(s, dp=32), model, cluster, training) for s in ("zero1", "zero2", "ddp")}
    zero1 = rows["zero1"]
    assert zero1.step_s["overlap"] == pytest.approx(zero1.compute_s + zero1.communication_s)
    assert zero1.exposed["phase"] == "after" and zero1.exposed["link"] == "inter_node"
    ddp = rows["ddp"]
    window = ddp.compute_s * 2 / 3 / ddp.grad_accum
    assert ddp.step_s["overlap"] == pytest.approx(ddp.compute_s + max(0.0, ddp.communication_s - window))
    assert rows["zero2"].step_s["overlap"] < zero1.step_s["overlap"]


def test_pipelines_side_by_side_sum_their_gradients_and_take_the_first_s_buffers():
    """With --dp 2 each pipeline rank all-reduces its stages' gradients over the 2 pipelines and takes the
    first pipeline's BatchNorm statistics (impls/pipeline, distref.cost.pipeline): resnet18's fullest rank,
    the same micro-batches as one pipeline, moves that much more."""
    model = project_model("resnet18")
    rows = {
        dp: cost(
            Layout("pp-1f1b", dp=dp, pp=2),
            model,
            Cluster(GPUS["cpu"], 2 * dp),
            Training(8 * dp, 1, "fp32", "sgd", False, 0.4, grad_accum=4),
        )
        for dp in (1, 2)
    }
    rank = rows[2].pipeline_rank
    first, end = cut_bounds(model, 2)[rank]
    with torch.device("meta"):
        blocks = list(build_model("resnet18", MODEL_DATASETS["resnet18"]).children())[first:end]
    gradients = sum(p.numel() * 4 for block in blocks for p in block.parameters())
    buffers = sum(b.numel() * b.element_size() for block in blocks for b in block.buffers())
    assert rank == rows[1].pipeline_rank and buffers > 0
    moved = {dp: sum(row.communication_bytes.values()) for dp, row in rows.items()}
    assert moved[2] - moved[1] == 2 * (2 - 1) / 2 * gradients + buffers


@pytest.mark.parametrize(
    "precision, parameters", [("mixed", "16-bit"), ("autocast", "full"), ("fp32", "full")]
)
def test_activations_are_planned_as_each_precision_saves_them_on_cuda(precision, parameters, capsys):
    """A decoder on H100s: the whole-model rows' activations are distref.cost.activations' for that
    precision on CUDA's kernels (mixed: 16-bit parameters, cuDNN attention; autocast: fp32 stream and
    16-bit copies, cuDNN; fp32: the memory-efficient kernel's padded log-sum-exp), not an fp32 formula
    scaled; and the rows say which rules no GPU has measured."""
    code, out = run_plan(
        capsys, "--model", "125m", "--gpus", "8", "--precision", precision, "--global-batch", "8", "--json"
    )
    assert code == 0
    rows = {row["strategy"]: row for row in reversed(json.loads(out))}  # (each strategy's first row)
    bf16 = precision != "fp32"
    # fsdp as impls/fsdp computes under bf16 (its policy's 16-bit parameters, the loop's autocast),
    # zero as DeepSpeed's bf16 module does; ddp as the precision says
    for strategy, its_parameters in (
        ("ddp", parameters),
        ("fsdp", "16-bit under autocast" if bf16 else "full"),
        ("zero2", "16-bit" if bf16 else "full"),
    ):
        row = rows[strategy]
        sv = act.saving_for("bf16" if bf16 else "fp32", "cuda", its_parameters)
        expected = act.stage_bytes(*decoder("125m", MODELS["125m"]).formula(sv, False), row["micro_batch"])
        assert row["memory_per_gpu_bytes"]["activations"] == expected, strategy
        assert sv.attention == ("cudnn" if bf16 else "efficient")  # (head size 64)
        assert any(f"SDPA's {sv.attention} kernel on CUDA" in note for note in row["extrapolated"])
        assert not any("2 bytes" in note for note in row["extrapolated"])
    assert any("--precision autocast" in note for note in rows["ddp"]["extrapolated"]) == (
        precision == "mixed"
    )


def test_a_decoder_preset_s_pipeline_under_autocast_sends_the_fp32_residual_stream(capsys):
    """--precision autocast on a preset (no model built to run under autocast): each boundary sends the
    embeddings' or a block's output, the residual stream, in fp32 (autocast leaves it so), and its gradient."""
    code, out = run_plan(
        capsys, "--model", "125m", "--gpus", "2", "--pp", "2", "--precision", "autocast", "--json"
    )
    assert code == 0
    row = next(row for row in json.loads(out) if row["strategy"] == "pp-1f1b")
    assert not any("not estimated" in note for note in row["extrapolated"])
    shape = MODELS["125m"]
    micro_steps = row["grad_accum"]  # (one micro-batch of 1 sample per micro-step; forward and backward)
    assert row["communication_bytes"]["intra_node"] == 2 * micro_steps * 4 * shape.seq * shape.hidden


@pytest.mark.parametrize("precision", ["mixed", "autocast"])
def test_a_batchnorm_model_in_16_bits_is_not_planned_where_the_impls_refuse_it(precision):
    """resnet18 in 16 bits: impls/fsdp and impls/deepspeed_zero refuse it (BatchNorm's weights 16-bit, its
    running statistics fp32), so the plan skips their rows, saying why, and plans the others; in fp32 it
    plans them all."""
    model = project_model("resnet18")
    cluster = Cluster(GPUS["cpu"], 2)
    training = Training(8, 1, precision, "adamw", False, 0.4, device="cpu")
    found = make_plan(model, cluster, training)
    strategies = {row.strategy for row in found.rows}
    assert "ddp" in strategies and not strategies & {"fsdp", "zero1", "zero2", "zero3", "zero3-offload"}
    assert any("refuse a BatchNorm in 16 bits" in why for _, why in found.skipped)
    fp32 = make_plan(model, cluster, dataclasses.replace(training, precision="fp32"))
    assert {"fsdp", "zero3"} <= {row.strategy for row in fp32.rows}


def test_resnet18_without_torchvision_is_one_line(monkeypatch, capsys):
    """resnet18 is torchvision's: without it (core alone installs none) the plan says so in one line, exit 2,
    not an import's traceback."""
    import distref.plan.model

    monkeypatch.setattr(distref.plan.model, "torchvision_problem", lambda: "it is not installed")
    code = plan.main(["--model", "resnet18", "--gpu", "cpu", "--gpus", "2"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--model resnet18 needs torchvision, and it is not installed: pip install torchvision" in err


# ---- context parallelism (impls/context_parallel): gpt's sequences split over C ranks ---------------------

SMALL = GPTShape(layers=2, hidden=64, heads=8, vocab=1000, seq=64)
FOUR_PER_NODE = dataclasses.replace(GPUS["h100-80gb"], gpus_per_node=4)


@pytest.mark.parametrize("k", [1, 2])
def test_context_parallel_rows_cost_what_its_formulas_say(k):
    """dp2 × cp4 on nodes of 4 GPUs, fp32, one sequence per group and micro-step: by hand, with E = 64/4 ·
    64 = 1024 elements of each of k and v per rank and layer, the ring sends per layer 3 + 3 blocks of k, v
    (2E, fp32) forward and backward and their gradients 4 hops home (2E, fp32), each sent and received:
    2 layers × 10 × 8,192 bytes each way within the node; Ulysses 8 all-to-alls of E (q, k, v to heads,
    the output back, forward and backward), 3/4 of each on the bus. FSDP2 shards over all 8 ranks, across
    the nodes: rank 0 holds ⌈d₀/8⌉ rows of each parameter, and with K = 2 micro-steps whole gradients until
    the last. Compute is the step's FLOPs over all 8 GPUs."""
    model, training = decoder("small", SMALL), Training(2 * k, 1, "fp32", "adamw", False, 0.4)
    ring = cost(Layout("cp", dp=2, cp=4), model, Cluster(FOUR_PER_NODE, 8), training)
    ulysses = cost(Layout("cp-ulysses", dp=2, cp=4), model, Cluster(FOUR_PER_NODE, 8), training)
    assert ring.mesh == "dp2×cp4" and (ring.micro_batch, ring.grad_accum) == (1, k)
    assert ring.communication_bytes["intra_node"] == k * 2 * (2 * 10 * 8192)
    assert ulysses.communication_bytes["intra_node"] == k * 2 * 8 * 4096 * 3 / 4
    assert ring.communication_bytes["inter_node"] == ulysses.communication_bytes["inter_node"] > 0
    held = sum(math.ceil(shape[0] / 8) * math.prod(shape[1:]) for shape in model.shapes)
    tensors = 2 + 15 * SMALL.layers + 3  # AdamW's step: one fp32 scalar per tensor
    for row in (ring, ulysses):
        states = row.memory_per_gpu_bytes
        assert states["parameters"] == 4 * held and states["optimizer"] == 8 * held + 4 * tensors
        assert states["gradients"] == (4 * held if k == 1 else 4 * model.parameters)
        compute = step_flops(model, training, 8) / (GPUS["h100-80gb"].peak_flops["fp32"] * 0.4)
        assert row.compute_s == pytest.approx(compute)
    # mixed precision: the ZeRO paper's 2 + 2 + 12 bytes per parameter over all 8 ranks (gradients whole
    # while micro-steps accumulate)
    mixed = cost(
        Layout("cp", dp=2, cp=4),
        model,
        Cluster(FOUR_PER_NODE, 8),
        dataclasses.replace(training, precision="mixed"),
    )
    psi = model.parameters
    assert {kind: mixed.memory_per_gpu_bytes[kind] for kind in ("parameters", "gradients", "optimizer")} == {
        "parameters": 2 * psi / 8,
        "gradients": 2 * psi / 8 if k == 1 else 2 * psi,
        "optimizer": 12 * psi / 8,
    }
    # each rank's activations: the model's on its 16 of the 64 tokens (in fp32 on CUDA: as the ring saves)
    shorter = decoder("short", dataclasses.replace(SMALL, seq=16))
    whole = act.stage_bytes(*shorter.formula(act.saving_for("fp32", "cuda", attention="cpu"), False), 1)
    assert ring.memory_per_gpu_bytes["activations"] == whole


def test_the_ring_hides_under_attention_s_compute_and_ulysses_under_nothing():
    """The ring passes each key/value block on while computing attention on the one before: its hops hide
    under causal attention's compute, half of PaLM's 12·L·h·s FLOPs per token. Ulysses' all-to-alls wait
    for what they carry. 7B, dp2 × cp4 on nodes of 4, the network between them too fast to matter: at
    4,096 tokens attention is 7% of the compute and the ring shows beyond it; at 32,768 it is 28% and the
    ring hides."""
    fast_network = dataclasses.replace(FOUR_PER_NODE, inter_node_bytes_per_s=1e30)
    training = Training(2, 1, "mixed", "adamw", False, 0.4)
    L, h, C = 32, 4096, 4
    for s in (4096, 32768):
        model = decoder("7b", dataclasses.replace(MODELS["7b"], seq=s))
        ring = cost(Layout("cp", dp=2, cp=C), model, Cluster(fast_network, 8), training)
        ulysses = cost(Layout("cp-ulysses", dp=2, cp=C), model, Cluster(fast_network, 8), training)
        E = s // C * h  # (bf16 blocks, fp32 gradients)
        ring_s = 2 * L * (2 * (C - 1) * 2 * E * 2 + C * 2 * E * 4) / 450e9
        all_to_all_s = L * 8 * E * 2 * (C - 1) / C / 450e9
        per_token = 6 * (model.parameters - (MODELS["7b"].vocab + s) * h) + 12 * L * h * s
        attention_s = ring.compute_s * 6 * L * h * s / per_token
        assert ring.communication_bytes["intra_node"] / 450e9 == pytest.approx(ring_s)
        assert ring.step_s["overlap"] == pytest.approx(ring.compute_s + max(0, ring_s - attention_s))
        assert ulysses.step_s["overlap"] == pytest.approx(ulysses.compute_s + all_to_all_s)
        assert (ring_s > attention_s) == (s == 4096)
    assert ring.exposed is None or ring.exposed["phase"] != "attention"


def test_context_parallel_meshes_follow_the_sequence_and_the_heads():
    """Powers of two on 64 GPUs: ring attention where the sequence cuts into 2C chunks, Ulysses where C
    divides the heads and the sequence; beyond a node too (the ring then crosses nodes); none for a model
    without a decoder's shape."""
    model = decoder("x", GPTShape(layers=2, hidden=256, heads=32, vocab=1000, seq=48))
    found, skipped = layouts(model, Cluster(GPUS["h100-80gb"], 64))
    meshes = {(layout.strategy, layout.dp, layout.cp) for layout in found if layout.cp > 1}
    assert meshes == {("cp", 64 // c, c) for c in (2, 4, 8)} | {
        ("cp-ulysses", 64 // c, c) for c in (2, 4, 8, 16)
    }
    reasons = dict(skipped)
    assert (
        reasons["cp16"]
        == reasons["cp64"]
        == "ring attention cuts the 48 positions into 2C chunks: not evenly"
    )
    assert reasons["cp32-ulysses"] == "Ulysses splits the 48 positions: not evenly"
    assert reasons["cp64-ulysses"] == "must divide the 32 attention heads"
    _, skipped = layouts(parameters_only(10**9), Cluster(GPUS["h100-80gb"], 8))
    assert "splits a decoder's sequences" in dict(skipped)["cp"]


def test_the_ring_runs_on_the_link_its_group_spans():
    """The ring within a node when C fits in one, across nodes beyond; FSDP2 over every rank, across nodes
    once the world spans them."""
    model, training = decoder("small", SMALL), Training(2, 1, "fp32", "adamw", False, 0.4)
    within = cost(Layout("cp", dp=2, cp=4), model, Cluster(FOUR_PER_NODE, 8), training)
    across = cost(
        Layout("cp", dp=1, cp=8),
        model,
        Cluster(FOUR_PER_NODE, 8),
        Training(1, 1, "fp32", "adamw", False, 0.4),
    )
    assert within.communication_bytes["intra_node"] > 0 and across.communication_bytes["intra_node"] == 0
    one_node = cost(Layout("cp", dp=2, cp=4), model, Cluster(GPUS["h100-80gb"], 8), training)
    assert one_node.communication_bytes["inter_node"] == 0


def test_long_sequences_context_parallelism_beats_tensor_parallelism_and_alone_fits(capsys):
    """7B at 32,768 tokens on one node: the ring (dp2 × cp4) comes first, faster than the best tensor-
    parallel row, whose collectives in every layer are exposed while the ring's hops hide under attention;
    its why says so. Llama 3's 8B at 131,072 tokens on 4 nodes: only context-parallel rows fit (1/16 or 1/32
    of each sequence per GPU), and each fitting row's why says that."""
    code, out = run_plan(
        capsys, "--model", "7b", "--gpus", "8", "--seq", "32768", "--global-batch", "32", "--json"
    )
    rows = json.loads(out)
    best_tp = next(row for row in rows if row["strategy"] == "tp" and row["fits"])
    first = rows[0]
    assert code == 0 and (first["strategy"], first["mesh"]) == ("cp", "dp2×cp4")
    assert first["tokens_per_s_per_gpu"] > 1.05 * best_tp["tokens_per_s_per_gpu"]
    assert (
        f"faster than tp {best_tp['mesh']}" in first["why"]
        and "1/4 of each 32,768-token sequence" in first["why"]
    )
    code, out = run_plan(
        capsys, "--model", "8b", "--nodes", "4", "--seq", "131072", "--global-batch", "16", "--json"
    )
    fitting = [row for row in json.loads(out) if row["fits"]]
    assert code == 0 and fitting and {row["strategy"] for row in fitting} <= {"cp", "cp-ulysses"}
    assert all(row["why"].startswith("only context parallelism fits (1/") for row in fitting)


def test_simulate_runs_the_planned_context_parallel_sharding(capsys):
    """125M on 8 GPUs, fp32, one micro-step: ring and Ulysses over 4 ranks, 2 groups, run through
    impls/context_parallel's own code as rank 0 of 8 on the fake process group: what the plan says."""
    model = decoder("125m", MODELS["125m"])
    made = make_plan(model, Cluster(GPUS["h100-80gb"], 8), Training(2, 1, "fp32", "adamw", False, 0.4), cp=4)
    assert {(row.strategy, row.mesh) for row in made.rows} == {("cp", "dp2×cp4"), ("cp-ulysses", "dp2×cp4")}
    for row in made.rows:
        said = simulate_row(made, row)
        states, communication = (
            row.memory_per_gpu_bytes["model_states"],
            sum(row.communication_bytes.values()),
        )
        assert (
            f"--cp 4 --dp-shard 2 --cp-mode {'ulysses' if row.strategy == 'cp-ulysses' else 'ring'}" in said
        )
        assert f"model states {int(states):,} B, plan (fp32) {states:,.0f} B" in said, said
        assert f"communication {communication:,.0f} bus bytes per step, plan {communication:,.0f}" in said, (
            said
        )


# ---- expert parallelism (impls/expert_parallel): a mixture of experts' experts spread over ep ranks -------

MOE = GPTShape(layers=2, hidden=64, heads=8, vocab=1000, seq=64, experts=8, top_k=2)


def moe_elements(shape: GPTShape) -> tuple[int, int]:
    """(elements of every layer's experts, of everything else) by hand: each block's attention 4h² + 3h,
    two layer norms 4h, a router E·h and E experts of width f (2hf + f + h each); the embeddings (V + s)·h,
    the head's layer norm 2h and output V·h."""
    h, f, e, layers = shape.hidden, shape.expert_width, shape.experts, shape.layers
    experts = layers * e * (2 * h * f + f + h)
    dense = (shape.vocab + shape.seq) * h + layers * (4 * h * h + 7 * h + e * h) + 2 * h + shape.vocab * h
    return experts, dense


def test_the_mixture_of_experts_presets_are_their_published_shapes_in_this_layout():
    """Mixtral 8x7B (32 × 4096, 8 experts 14,336 wide, top-2) and OLMoE-1B-7B (16 × 2048, 64 experts 1,024
    wide, top-8): their parameters counted by hand, and PaLM's FLOPs over the weights a token meets (k of
    the E experts, everything else but the embeddings: 6 each) and attention's 12·L·h·s."""
    for name, total in (("mixtral-8x7b", 32_497_868_800), ("olmoe-1b-7b", 4_783_312_896)):
        shape = MODELS[name]
        experts, dense = moe_elements(shape)
        model = decoder(name, shape)
        assert model.parameters == experts + dense == shape.parameters() == total
        active = dense + experts // shape.experts * shape.top_k - (shape.vocab + shape.seq) * shape.hidden
        per_token = 6 * active + 12 * shape.layers * shape.hidden * shape.seq
        assert model.flops_per_sample == per_token * shape.seq and model.formula is None
    assert (MODELS["mixtral-8x7b"].experts, MODELS["mixtral-8x7b"].top_k) == (8, 2)
    assert (MODELS["olmoe-1b-7b"].experts, MODELS["olmoe-1b-7b"].expert_width) == (64, 1024)
    # the layout's parameter names are distref.models' own, in its order (a built gpt with experts)
    small = decoder("small", MOE)
    with torch.device("meta"):
        built = gpt(MOE.config())
    assert small.parameter_names == tuple(name for name, _ in built.named_parameters())
    assert small.shapes == [tuple(p.shape) for p in built.parameters()]


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_an_expert_parallel_row_costs_what_its_formulas_say(precision):
    """8 GPUs in nodes of 4, ep 4 (2 copies of the experts), 16 sequences of 64 tokens: K = 2 micro-steps
    of one sequence. By hand: each MoE layer and micro-step a rank sends 64·2 = 128 rows of h = 64 and, by
    uniform routing, receives as many, after the 8 counts (int64); backward both again: 5 all-to-alls
    within the node (3/4 of each on the bus, bf16 tokens in mixed). DDP all-reduces the rest's fp32
    gradients over all 8 ranks in the last backward (2·7/8 on the bus, across the nodes), the 2 copies
    each expert tensor's rows they hold after it (2·1/2). A rank holds 1/4 of the experts and the rest."""
    model = decoder("moe", MOE)
    cluster = Cluster(FOUR_PER_NODE, 8)
    training = Training(16, 1, precision, "adamw", False, 0.4)
    row = cost(Layout("ep", dp=8, ep=4), model, cluster, training)
    assert row.mesh == "dp8 (ep 4 × replicate 2)" and (row.micro_batch, row.grad_accum) == (1, 2)
    tokens = 2 if precision == "mixed" else 4  # (bytes of a routed row's element)
    rows = 64 * 2
    all_to_all = 2 * 2 * (8 * 8 + 4 * rows * 64 * tokens)  # layers × micro-steps × (counts + 4 of rows)
    assert row.communication_bytes["intra_node"] == all_to_all * 3 / 4
    experts, dense = moe_elements(MOE)
    ddp_bus, copies_bus = 4 * dense * 2 * 7 / 8, 4 * experts / 4 * 2 * 1 / 2
    assert row.communication_bytes["inter_node"] == pytest.approx(ddp_bus + copies_bus)
    held = dense + experts // 4
    states = row.memory_per_gpu_bytes
    tensors = 2 + 2 * 16 + 3  # (AdamW's step: one fp32 scalar per tensor)
    if precision == "fp32":
        assert (states["parameters"], states["gradients"]) == (4 * held, 4 * held)
        assert states["optimizer"] == 8 * held + 4 * tensors
    else:  # the ZeRO paper's 2 + 2 + 12 bytes per parameter held
        assert (states["parameters"], states["gradients"], states["optimizer"]) == (
            2 * held,
            2 * held,
            12 * held,
        )
    assert states["activations"] is None and states["total"] == states["model_states"]
    assert any("activations: not planned for a mixture of experts" in note for note in row.extrapolated)
    assert any(note.startswith("uniform routing") for note in row.extrapolated)
    # time: the all-to-alls and the copies' all-reduce after what they wait for, DDP's under the last
    # micro-step's backward
    compute = step_flops(model, training, 8) / (GPUS["h100-80gb"].peak_flops[precision] * 0.4)
    exposed = all_to_all * 3 / 4 / 450e9 + copies_bus / 50e9 + max(0, ddp_bus / 50e9 - compute * 2 / 3 / 2)
    assert row.compute_s == pytest.approx(compute)
    assert row.step_s["overlap"] == pytest.approx(compute + exposed)


def test_one_rank_holding_every_expert_routes_nothing():
    """--ep 1: every GPU holds every expert (the impl sets no dispatch): no all-to-all, the 8 copies'
    all-reduce of the experts' whole gradients; no routing assumed."""
    row = cost(
        Layout("ep", dp=8, ep=1),
        decoder("moe", MOE),
        Cluster(GPUS["h100-80gb"], 8),
        Training(8, 1, "fp32", "sgd", False, 0.4),
    )
    experts, dense = moe_elements(MOE)
    assert row.communication_bytes == {
        "intra_node": pytest.approx(4 * (experts + dense) * 2 * 7 / 8),
        "inter_node": 0,
    }
    assert not any(note.startswith("uniform routing") for note in row.extrapolated)
    assert row.memory_per_gpu_bytes["parameters"] == 4 * (experts + dense)


def test_a_mixture_of_experts_is_planned_by_expert_parallelism_alone(capsys):
    """OLMoE on 64 GPUs: an ep row for each degree that divides the GPUs and the 64 experts, whose why says
    what a GPU holds and that its activations are not estimated; the other strategies skipped, saying why
    (no other impl trains experts). --ep 8 plans that degree only. Mixtral on 8 H100s: a GPU holds at
    least one expert a layer and the rest whole, 99 GB: nothing fits on any number of them, as it says."""
    code, out = run_plan(capsys, "--model", "olmoe-1b-7b", "--gpus", "64", "--json")
    rows = json.loads(out)
    assert code == 0 and {row["strategy"] for row in rows} == {"ep"}
    assert sorted(row["mesh"] for row in rows) == sorted(
        f"dp64 (ep {ep} × replicate {64 // ep})" for ep in (1, 2, 4, 8, 16, 32, 64)
    )
    first = rows[0]
    assert "8 of each layer's 64 experts per GPU" in first["why"] and first["mesh"].startswith("dp64 (ep 8")
    assert first["why"].endswith("activations not planned (not for a mixture of experts yet)")
    code, out = run_plan(capsys, "--model", "olmoe-1b-7b", "--gpus", "64", "--ep", "8", "--json")
    assert code == 0 and [row["mesh"] for row in json.loads(out)] == ["dp64 (ep 8 × replicate 8)"]
    code, out = run_plan(capsys, "--model", "mixtral-8x7b", "--gpus", "8")
    experts, dense = moe_elements(MODELS["mixtral-8x7b"])
    least = 16 * (dense + experts // 8)  # (mixed precision: 2 + 2 + 12 bytes per parameter held)
    assert code == 0 and f"at least {least / 1e9:.1f} GB of model states per GPU here" in out
    assert "Skipped: ddp, zero1-3, fsdp, hsdp, tp, cp, pp, model_parallel: impls/expert_parallel alone" in out
    assert "Nothing fits, on any cluster of these GPUs: impls/expert_parallel spreads each layer's 8" in out


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--model", "olmoe-1b-7b", "--gpus", "32", "--ep", "3"], "--ep 3 does not divide the 32 GPUs"),
        (["--model", "olmoe-1b-7b", "--tp", "2", "--ep", "2"], "--tp 2 with --ep 2: no impl here combines"),
        # (--ep 1 is a mesh of its own, every GPU holding every expert: not data parallelism's degree 1)
        (["--model", "olmoe-1b-7b", "--tp", "2", "--ep", "1"], "--tp 2 with --ep 1: no impl here combines"),
        (
            ["--model", "7b", "--ep", "2"],
            "no layout can run: expert parallelism spreads a mixture of experts'",
        ),
        (["--model", "olmoe-1b-7b", "--cp", "2"], "no layout can run: impls/expert_parallel alone trains"),
        (["--model", "mixtral-8x7b", "--gpus", "16", "--ep", "16"], "must divide the 8 experts"),
    ],
)
def test_an_expert_parallel_mesh_that_cannot_run_is_one_line_and_exit_2(argv, said, capsys):
    code = plan.main(argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and said in lines[0], lines


def test_simulate_runs_the_planned_expert_parallel_sharding_at_64_ranks():
    """A small mixture of experts (64 a layer) on 64 GPUs, fp32, one micro-step: the ep 64 and ep 16 rows
    through impls/expert_parallel's own code as rank 0 of 64 on the fake process group hold and
    communicate what the plan says (the simulation's symmetric routing is the plan's uniform one)."""
    shape = dataclasses.replace(MOE, seq=16, experts=64)
    made = make_plan(
        decoder("moe", shape), Cluster(GPUS["h100-80gb"], 64), Training(64, 1, "fp32", "adamw", False, 0.4)
    )
    for row in (r for r in made.rows if r.layout.ep in (64, 16)):
        said = simulate_row(made, row)
        states = row.memory_per_gpu_bytes["model_states"]
        communication = sum(row.communication_bytes.values())
        assert f"expert_parallel --ep {row.layout.ep} at 64 ranks" in said, said
        assert f"model states {int(states):,} B, plan (fp32) {states:,.0f} B" in said, said
        assert f"communication {communication:,.0f} bus bytes per step, plan {communication:,.0f}" in said, (
            said
        )
