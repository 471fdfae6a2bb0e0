"""ci/gpu_bench.py, the GPU benchmark: its statistics, tokens/s and MFU (GPT-2 small's FLOPs counted by
hand), the peak by card, the table and goals from fake records, the budget, its plan for 1 and 2 GPUs
(a faked count: CI has none), gpu_check running it, and a short rehearsal on CPU, end to end."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

from distref.testing import forked_subprocess

ROOT = Path(__file__).resolve().parents[2]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "ci" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclasses look themselves up there)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    yield load("gpu_bench")
    sys.modules.pop("gpu_bench", None)
    sys.modules.pop("gpu_check", None)


GPT2 = dict(n_params=162_313_728, n_layer=12, n_head=12, head_dim=64, seq_len=1024, vocab=50304)


def record(times_ms: list[float], counted: int | None = None, memory: list[int] = (2**30,)) -> dict:
    steps = [{"step": i, "loss": 1.0, "step_time_s": t / 1000} for i, t in enumerate(times_ms)]
    return {
        "status": "completed",
        "steps": steps[::-1],  # (read in step order whatever the order in the file)
        "communication": None if counted is None else {"step": counted},
        "peak_memory_bytes": list(memory),
        "startup_time_s": 12.5,
    }


def test_statistics_skip_the_warm_up_and_the_counted_step_and_need_30_steps(bench):
    # steps 0-4 warm up (9 s each); step 7's communication was counted (5 s); step i else takes i ms
    times = [9000.0] * 5 + [float(i) for i in range(5, 40)]
    times[7] = 5000.0
    measured = bench.measured_step_times(record(times, counted=7), warmup=5)
    assert measured == [i / 1000 for i in range(5, 40) if i != 7]
    stats = bench.step_stats(measured)
    # 34 steps, 5 6 8 9 … 39 ms: the median between the 17th (22) and 18th (23); the mean (770 - 7) / 34;
    # p90 the 31st of 34 (nearest rank: ceil(0.9 × 34) = 31), 36 ms, not the slowest (39)
    assert stats["steps"] == 34
    assert stats["median_ms"] == pytest.approx(22.5)
    assert stats["mean_ms"] == pytest.approx(763 / 34)
    assert stats["p90_ms"] == pytest.approx(36.0)
    assert bench.step_stats([i / 1000 for i in range(1, 31)])["p90_ms"] == pytest.approx(27.0)
    with pytest.raises(bench.TooFewSteps, match="29 steps measured, 30 needed"):
        bench.step_stats([0.01] * 29)
    assert bench.step_stats([0.01] * 3, minimum=1)["steps"] == 3  # --quick


def test_tokens_per_second_and_mfu_on_gpt2_small_counted_by_hand(bench):
    shape = bench.model_shape("gpt2")
    # N without the position embeddings (1024 × 768): the token embedding 50304 × 768 = 38,633,472; a
    # block 7,087,104 (two layer norms 2 × 1,536; q, v, proj 590,592 each; k, no bias, 589,824; the MLP
    # 2,362,368 + 2,360,064), 12 of them 85,045,248; the head's layer norm 1,536 and its untied 768 ×
    # 50304 weight 38,633,472
    assert shape.n_params == 38_633_472 + 12 * 7_087_104 + 1_536 + 38_633_472 == 162_313_728
    assert (shape.n_layer, shape.n_head, shape.head_dim, shape.seq_len) == (12, 12, 64, 1024)
    # 6N = 973,882,368; 12·L·H·Q·T = 12 × 12 × 12 × 64 × 1024 = 113,246,208
    assert shape.flops_per_token == 973_882_368 + 113_246_208 == 1_087_128_576
    tokens = bench.tokens_per_s(12, 1024, step_ms=100.0)
    assert tokens == pytest.approx(122_880)
    assert bench.mfu(shape.flops_per_token, tokens, gpus=1, peak_flops=989e12) == pytest.approx(
        0.135072, rel=1e-5
    )
    assert bench.mfu(shape.flops_per_token, tokens, gpus=2, peak_flops=989e12) == pytest.approx(
        0.067536, rel=1e-5
    )
    assert bench.model_shape("gpt").seq_len == 16  # the rehearsal's tiny gpt: the reversal task's 16 tokens


@pytest.mark.parametrize(
    ("card", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA H100 PCIe", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_the_dense_bf16_peak_by_card_name(bench, card, peak):
    found, said = bench.dense_bf16_peak(card)
    assert found == peak
    assert said.startswith(card) and (f"{peak / 1e12:.0f} TFLOP/s" in said if peak else "no " in said)


def fake_rows(bench, tmp_path, rows: list[tuple[str, bool, int, list[float]]]):
    made = []
    for name, compiled, world, times in rows:
        out = tmp_path / ("compiled" if compiled else "eager") / name.replace(" ", "-")
        out.mkdir(parents=True)
        (out / "record.json").write_text(json.dumps(record(times, memory=[2**30, 3 * 2**29])))
        made.append(bench.Row(name, compiled, world=world, gpus=world, out=out, status="ran"))
    return made


def test_the_table_ratios_and_goals_from_fake_records(bench, tmp_path):
    warm = [500.0] * 5
    rows = fake_rows(
        bench,
        tmp_path,
        [
            ("bare", False, 1, warm + [100.0] * 30),
            ("single", False, 1, warm + [101.0] * 30),
            ("ddp", False, 1, warm + [104.0] * 30),
            ("fsdp reshard", False, 1, warm + [110.0] * 30),
            ("tensor_parallel", False, 2, warm + [60.0] * 30),
            ("bare", True, 1, warm + [70.0] * 30),
            ("single", True, 1, warm + [75.0] * 30),
        ],
    )
    rows.append(bench.Row("pipeline", False, world=0, status="not run", why="a pipeline needs 2 or more"))
    rows.append(bench.Row("ddp", True, status="not run", why="the budget: about 90 s expected, 20 s left"))
    rows.append(bench.Row("fsdp reshard", True, status="failed", why="exit code 1: CUDA out of memory"))
    shape = bench.Shape(**GPT2)
    bench.fill_numbers(rows, shape, 989e12, warmup=5, minimum=30)
    by = {(r.name, r.compiled): r.numbers for r in rows}
    assert by[("single", False)]["vs_bare"] == pytest.approx(1.01)
    assert by[("ddp", False)]["vs_single"] == pytest.approx(104 / 101)
    assert by[("single", True)]["vs_bare"] == pytest.approx(75 / 70)  # (compiled against compiled)
    assert by[("single", True)]["compile_speedup"] == pytest.approx(101 / 75)
    assert by[("tensor_parallel", False)]["mfu"] == pytest.approx(0.135072 * 100 / 60 / 2, rel=1e-5)
    assert by[("ddp", False)]["peak_memory_gib"] == 1.5  # the most of any rank
    table = {tuple(r[:2]): r for r in bench.table_rows(rows, "no peak")}
    single = table[("single", "eager")]
    assert single[2:9] == ["1", "ran", "30", "101.0", "101.0", "101.0", "121,663"]
    assert single[9:] == ["13.4%", "1.50", "12.5", "1.010", "1.000", "—"]
    assert table[("single", "compiled")][-1] == "1.35"
    assert table[("pipeline", "eager")][2:5] == ["—", "not run: a pipeline needs 2 or more", "—"]
    said = dict(bench.goals(rows, "cuda"))
    assert said["single eager ≤ 1.02× the bare loop's step"] == "pass: 1.010×"
    assert said["single compiled ≥ 1.3× faster than eager"] == "pass: 1.35×"
    assert said["ddp eager at world 1 ≤ 1.05× single's step"] == "pass: 1.030×"
    assert said["fsdp reshard eager at world 1 ≤ 1.05× single's step"] == "**fail**: 1.089×"
    assert said["ddp compiled at world 1 ≤ 1.05× single's step"] == "— (not measured)"
    # a goal whose run failed is not met: a fail, saying why (it read "— (not measured)")
    assert said["fsdp reshard compiled at world 1 ≤ 1.05× single's step"] == (
        "**fail**: fsdp reshard compiled failed (exit code 1: CUDA out of memory)"
    )
    assert bench.goals(rows, "cpu") == [("every goal", "— (a CPU rehearsal: the goals are judged on a GPU)")]
    # a run with too few steps after the warm-up fails, saying so
    (short,) = fake_rows(bench, tmp_path / "short", [("single", False, 1, warm + [100.0] * 10)])
    bench.fill_numbers([short], shape, None, warmup=5, minimum=30)
    assert (short.status, short.why) == ("failed", "10 steps measured, 30 needed")


def test_rows_not_fitting_the_budget_are_not_run_and_say_so(bench, monkeypatch):
    monkeypatch.setattr(bench, "ESTIMATE_S", {False: 0.01, True: 100.0})
    rows = [bench.Row(name, compiled) for compiled in (False, True) for name in ("bare", "single", "ddp")]
    rows.insert(1, bench.Row("pipeline", False, status="not run", why="a pipeline needs 2 or more"))
    limits = []

    def instant(row, limit):
        limits.append(limit)
        row.status = "ran"

    bench.run_rows(rows, {}, Path("."), budget_s=10, timeout_s=3, runner=instant)
    assert [r.status for r in rows] == ["ran", "not run", "ran", "ran", "not run", "not run", "not run"]
    assert rows[1].why == "a pipeline needs 2 or more"
    assert (
        rows[4].why.startswith("the budget: about 100 s expected, ") and "s of --budget-s left" in rows[4].why
    )
    assert limits == [3, 3, 3]  # --timeout, less than what was left
    # after a row of its mode has run, what it took is what the next is expected to take
    rows = [bench.Row(name, False) for name in ("a", "b", "c", "d")]

    def half_a_second(row, limit):
        time.sleep(0.5)
        row.status = "ran"

    bench.run_rows(rows, {}, Path("."), budget_s=1.8, timeout_s=60, runner=half_a_second)
    assert [r.status for r in rows] == ["ran", "ran", "ran", "not run"]
    assert rows[2].seconds == pytest.approx(0.5, abs=0.2)


def test_the_plan_eager_rows_first_each_impl_at_the_largest_world(bench, tmp_path):
    def world_of(impl, options, gpus):
        return (None, "a pipeline needs 2 or more") if impl == "pipeline" and gpus < 2 else (gpus, "")

    impls = list(bench.IMPLS)
    rows = bench.plan_rows(1, "cuda", "gpt2", impls, 40, tmp_path, world_of=world_of, python="py")
    eager, compiled = rows[: len(rows) // 2], rows[len(rows) // 2 :]
    assert [r.name for r in eager][:2] == ["bare", "single"] and not any(r.compiled for r in eager)
    assert [r.name for r in compiled] == [r.name for r in eager] and all(r.compiled for r in compiled)
    names = [r.name for r in eager]
    assert {"fsdp reshard", "fsdp no-reshard", "ddp", "deepspeed_zero", "dataparallel"} <= set(names)
    by = {r.name: r for r in eager}
    assert "--reshard-after-forward" in by["fsdp reshard"].argv
    assert "--no-reshard-after-forward" in by["fsdp no-reshard"].argv
    assert by["model_parallel"].argv[2:4] == ["--devices", "cuda:0,cuda:0"]
    assert by["ddp"].argv[2:4] == ["--nproc-per-node", "1"]
    assert (by["pipeline"].status, by["pipeline"].why) == ("not run", "a pipeline needs 2 or more")
    # expert_parallel trains the mixture of experts it is made for (without --experts it refuses to run)
    experts = by["expert_parallel"].argv
    assert experts[experts.index("--experts") + 1] == "4" and by["expert_parallel"].experts == 4
    assert by["expert_parallel"].status == "planned" and by["ddp"].experts == 0
    assert "--experts" not in by["single"].argv and "--experts" not in by["ddp"].argv
    options = by["single"].argv[2:]
    assert options[:8] == [
        "--model",
        "gpt2",
        "--dataset",
        "synthetic",
        "--precision",
        "bf16",
        "--device",
        "cuda",
    ]
    assert "--compile" not in options and "--compile" in compiled[1].argv
    assert options[options.index("--global-batch-size") + 1] == "12"
    assert compiled[0].argv[1].endswith("gpu_bench.py") and compiled[0].argv[-1] == "--compile"
    # 2 GPUs: ranks one per GPU, model_parallel too; dataparallel's one process drives both
    rows = bench.plan_rows(
        2, "cuda", "gpt2", impls, 40, tmp_path, (False,), {"deepspeed_zero": "no deepspeed"}, world_of, "py"
    )
    by = {r.name: r for r in rows}
    assert by["model_parallel"].argv[2:4] == ["--nproc-per-node", "2"] and by["model_parallel"].gpus == 2
    assert (by["dataparallel"].world, by["dataparallel"].gpus, by["dataparallel"].argv[2]) == (
        2,
        2,
        "--model",
    )
    assert by["pipeline"].status == "planned" and by["single"].world == 1
    assert (by["deepspeed_zero"].status, by["deepspeed_zero"].why) == ("not run", "no deepspeed")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--steps", "34"], "--steps - --warmup is 29: 30 measured steps at least"),
        (["--steps", "5", "--quick"], "--steps must be more than --warmup"),
        (["--impls", "nope"], "--impls: no impl 'nope'"),
        (["--modes", "fast"], "--modes fast: give eager, compiled or eager,compiled"),
    ],
)
def test_bad_values_are_one_line_and_nothing_is_written(bench, tmp_path, capsys, argv, said):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--device", "cpu", "--out", str(tmp_path / "b"), *argv])
    assert exit_.value.code == 2
    assert said in capsys.readouterr().err.splitlines()[-1]
    assert not (tmp_path / "b").exists()


def test_gpu_check_runs_the_benchmark_last_and_shows_its_table(bench, tmp_path):
    gpu_check = bench.gpu_check
    jobs, _ = gpu_check.plan_jobs(gpus=1, device="cuda", out=tmp_path, steps=40, bench_budget_s=200)
    job = jobs[-1]
    assert (job.name, job.group, job.limit_s) == ("gpu benchmark", "bench", 260)
    assert job.argv[1].endswith("ci/gpu_bench.py") and job.argv[-2:] == ["--budget-s", "200"]
    rehearsal = gpu_check.plan_jobs(gpus=1, device="cpu", out=tmp_path, steps=2)[0][-1].argv
    assert rehearsal[rehearsal.index("--model") + 1] == "gpt" and "--quick" in rehearsal
    # run after every other job, the timed ones included, though listed first
    order = tmp_path / "order"
    say = lambda name: [sys.executable, "-c", f"open({str(order)!r}, 'a').write({name!r})"]  # noqa: E731
    ran = [
        gpu_check.Job("b", "bench", say("b")),
        gpu_check.Job("t", "world 1", say("t"), alone=True),
        gpu_check.Job("s", "feature", say("s")),
    ]
    gpu_check.run_all(ran, {"PATH": "/usr/bin"}, tmp_path, budget_s=60, parallel=2)
    assert order.read_text() == "stb"
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "gpu-bench.md").write_text("# GPU benchmark: x\n\n| a |\n\n## Goals\n")
    assert gpu_check.bench_section(tmp_path, ran) == "### GPU benchmark: x\n\n| a |\n\n#### Goals"


@pytest.mark.slow
def test_rehearsed_on_cpu_the_table_has_numbers(bench, tmp_path, monkeypatch):
    """--device cpu: the bare loop, single and ddp ×1 (torchrun), the tiny gpt, eager and compiled (with
    dynamo and AOTAutograd but not inductor's code generation: seconds, not minutes), end to end."""
    monkeypatch.setenv("DISTREF_COMPILE_BACKEND", "aot_eager")  # (the runs inherit it)
    stand_in = forked_subprocess()  # (its runs forked: no torch import each)
    monkeypatch.setattr(bench, "subprocess", stand_in)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # (each run sets its own threads: one)
    out = tmp_path / "bench"
    argv = ["--device", "cpu", "--quick", "--steps", "8", "--warmup", "3", "--impls", "single,ddp"]
    code = bench.main([*argv, "--out", str(out)])
    text = (out / "gpu-bench.md").read_text()
    assert code == 0, text
    numbers = json.loads((out / "gpu-bench.json").read_text())
    rows = {(r["name"], r["mode"]): r for r in numbers["rows"]}
    assert [r["name"] for r in numbers["rows"]] == ["bare", "single", "ddp"] * 2
    assert len(stand_in.forked) == 6  # (each row's run)
    for (name, mode), row in rows.items():
        n = row["numbers"]
        assert row["status"] == "ran" and row["world"] == 1, row
        assert n["steps"] == 5 and 0 < n["median_ms"] <= n["p90_ms"]
        assert n["tokens_per_s"] == pytest.approx(12 * 16 / (n["median_ms"] / 1000))
        assert n["peak_memory_gib"] > 0 and n["startup_s"] > 0 and n["mfu"] is None
        assert n["vs_bare"] == pytest.approx(n["median_ms"] / rows[("bare", mode)]["numbers"]["median_ms"])
        eager = rows[(name, "eager")]["numbers"]["median_ms"]
        assert n["compile_speedup"] == (None if mode == "eager" else pytest.approx(eager / n["median_ms"]))
        line = next(x for x in text.splitlines() if x.startswith(f"| {name} | {mode} | 1 | ran | 5 |"))
        assert float(line.split(" | ")[5]) == pytest.approx(n["median_ms"], abs=0.051)
    assert rows[("single", "compiled")]["numbers"]["vs_single"] == 1.0
    assert numbers["flops_per_token"] == 6 * numbers["shape"]["n_params"] + 12 * 2 * 4 * 16 * 16
    assert "--compile" in (out / "logs" / "compiled-ddp.log").read_text().splitlines()[0]
    assert (out / "runs" / "compiled" / "ddp" / "record.json").exists()
    for name in ("bare", "single"):  # (one thread each: two spinning threads made the bare loop 100x slower)
        record = json.loads((out / "runs" / "eager" / name / "record.json").read_text())
        assert record["environment"]["threads_per_rank"] == 1


def test_the_mixture_of_experts_row_s_flops_count_the_experts_a_token_meets(bench, tmp_path):
    """expert_parallel's GPT-2 small with 4 experts a block, top-2, counted by hand: each block's MLP
    (4,722,432) becomes 4 experts of that size, 2 of which a token meets, and a router of 768 × 4. Its
    MFU is by those FLOPs; against bare and single (the dense model) it has no ratio."""
    shape = bench.model_shape("gpt2", experts=4)
    assert shape.n_params == 162_313_728 + 12 * (2 * 4_722_432 - 4_722_432 + 768 * 4) == 219_019_776
    assert shape.flops_per_token == 6 * 219_019_776 + 113_246_208
    warm = [500.0] * 5
    rows = fake_rows(
        bench,
        tmp_path,
        [
            ("bare", False, 1, [*warm, *[100.0] * 30]),
            ("single", False, 1, [*warm, *[101.0] * 30]),
            ("expert_parallel", False, 1, [*warm, *[150.0] * 30]),
        ],
    )
    rows[2].experts = 4
    bench.fill_numbers(rows, bench.Shape(**GPT2), 989e12, warmup=5, minimum=30, expert_shape=shape)
    moe = rows[2].numbers
    assert moe["mfu"] == pytest.approx(shape.flops_per_token * 12 * 1024 / 0.150 / 989e12)
    assert moe["vs_bare"] is None and moe["vs_single"] is None and rows[1].numbers["vs_bare"] == 1.01
