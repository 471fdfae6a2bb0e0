"""What makes the loop fast on a GPU, checked on the CPU (issue 44): fused AdamW, batches copied one ahead,
steps timed by CUDA events read at log time (faked here: CI has no GPU), gpt2 (GPT-2 small's shape) as a
built-in workload, --compile in every impl where it composes (and proven equal to single compiled), and
start-up: one model build per process, the contract checked on the meta device."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from distref.cli import parse_config
from distref.data import load_dataset
from distref.data.order import ahead_on
from distref.models import build_model
from distref.parity_metric import max_relative_difference
from distref.testing.own import COUNT_VARIABLE, EXAMPLE_DATASET
from distref.testing.runs import launch, made_once, run_script, train_path
from distref.testing.workloads import PARITY_TOLERANCE
from distref.training import bookkeeping, optim
from distref.training.bookkeeping import StepClock
from distref.training.optim import make_optimizer


# ---- Fused AdamW -------------------------------------------------------------------------------------
def test_adamw_is_fused_on_cuda_and_foreach_on_the_cpu(monkeypatch):
    cfg = parse_config(["--optimizer", "adamw"], "single")
    linear = torch.nn.Linear(2, 2)
    assert not make_optimizer(cfg, linear.parameters()).defaults["fused"]  # the CPU: foreach, as before
    monkeypatch.setattr(optim, "FUSED_ADAMW_DEVICES", ("cpu",))  # (CI has no CUDA: the CPU stands in)
    assert make_optimizer(cfg, linear.parameters()).defaults["fused"] is True
    split = torch.nn.Parameter(torch.zeros(2))
    split.to_local = lambda: split  # (a DTensor beside plain tensors: a plan of yours splitting some)
    mixed = make_optimizer(cfg, [*linear.parameters(), split]).defaults
    assert not mixed["fused"] and mixed["foreach"] is False  # (CUDA's default foreach refuses the mix too)
    sgd = make_optimizer(parse_config(["--optimizer", "sgd"], "single"), linear.parameters())
    assert not sgd.defaults.get("fused")


def test_tensor_parallel_predicts_one_all_reduce_per_partial_gradient_with_the_fused_adamw():
    """Sequence parallelism's layer-norm gradients are partial sums: foreach AdamW (the CPU) reduces each
    at every read (3), the fused kernel (CUDA) once."""
    from distref.cost.tensor_parallel import tensor_parallel

    shape = dict(layers=2, hidden=64, vocabulary=11, sequence=16, micro_batch=4, tp=2)
    calls = {
        device: tensor_parallel(
            **shape, sequence_parallel=True, loss_parallel=True, optimizer="adamw", device=device
        )["all_reduce"]["calls"]
        for device in ("cpu", "cuda")
    }
    assert calls["cpu"] - calls["cuda"] == 2 * 10  # 10 partial gradients (ln1, ln2 of 2 blocks, head's ln)


# ---- Batches one ahead -------------------------------------------------------------------------------
class Batch:
    """A stand-in tensor: says when it is sent to a device, and where."""

    def __init__(self, name: str, events: list[str]):
        self.name, self.events = name, events

    def to(self, device, non_blocking: bool = False):
        assert non_blocking
        self.events.append(f"sent {self.name} to {device}")
        return f"{self.name}@{device}"


def test_the_next_batch_is_sent_when_this_one_is_handed_out():
    events: list[str] = []

    def batches():
        for i in range(3):
            events.append(f"read {i}")
            yield Batch(f"x{i}", events), Batch(f"y{i}", events)

    gpu, last = torch.device("cuda", 0), torch.device("cuda", 1)  # (never touched: Batch stands in)
    ahead = ahead_on(batches(), gpu, targets_device=last)
    assert next(ahead) == ("x0@cuda:0", "y0@cuda:1")
    # batch 1 was read and sent before batch 0 was handed out: its copy overlaps step 0
    assert events == [
        "read 0", "sent x0 to cuda:0", "sent y0 to cuda:1", "read 1", "sent x1 to cuda:0", "sent y1 to cuda:1"
    ]  # fmt: skip
    assert list(ahead) == [("x1@cuda:0", "y1@cuda:1"), ("x2@cuda:0", "y2@cuda:1")]
    assert list(ahead_on(iter([]), gpu)) == []


def test_on_the_cpu_each_batch_is_read_when_asked_for():
    read = []

    def batches():
        for i in range(3):
            read.append(i)
            yield torch.full((1,), i), torch.full((1,), i)

    ahead = ahead_on(batches(), torch.device("cpu"))
    x, _ = next(ahead)
    assert read == [0] and x.item() == 0  # nothing read ahead: no copy to overlap


# ---- Steps timed by CUDA events ----------------------------------------------------------------------
class FakeEvent:
    """torch.cuda.Event as StepClock uses it, on a fake GPU clock."""

    gpu_clock_ms = 0.0
    log: ClassVar[list[str]] = []

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.at = None

    def record(self):
        self.at = FakeEvent.gpu_clock_ms
        FakeEvent.log.append("record")

    def synchronize(self):
        FakeEvent.log.append("synchronize")

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.at - self.at


def test_cuda_steps_are_timed_by_events_read_at_log_time(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("a host wait per step"))
    FakeEvent.log, FakeEvent.gpu_clock_ms = [], 0.0
    clock = StepClock(torch.device("cuda", 0))
    for ms in (30.0, 40.0):
        started = clock.start()
        FakeEvent.gpu_clock_ms += ms
        assert clock.stop(started) is None  # not known yet: nothing waited for
    assert "synchronize" not in FakeEvent.log
    assert clock.times() == [0.030, 0.040]  # read now, from the events
    assert clock.times() == []


def test_step_timing_sync_waits_for_the_gpu_after_every_step(monkeypatch):
    waits = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: waits.append(device))
    clock = StepClock(torch.device("cuda", 0), sync=True)
    seconds = clock.stop(clock.start())
    assert waits == [torch.device("cuda", 0)] and seconds >= 0 and clock.times() == [seconds]
    cpu = StepClock(torch.device("cpu"))  # the CPU: its own clock, nothing to wait for
    assert cpu.stop(cpu.start()) >= 0 and waits == [torch.device("cuda", 0)]


def test_the_step_log_times_its_steps_on_the_run_device(monkeypatch):
    made = []
    monkeypatch.setattr(bookkeeping, "StepClock", lambda device, sync: made.append((device, sync)))
    for timing, sync in (("events", False), ("sync", True)):
        cfg = parse_config(["--step-timing", timing], "single")
        bookkeeping.StepLog(None, cfg, "single", bookkeeping.Cadence(cfg, 1, 1), 0, show=False, device="dev")
        assert made[-1] == ("dev", sync)


# ---- gpt2: GPT-2 small's shape -----------------------------------------------------------------------
def test_gpt2_has_gpt2_smalls_shape_on_synthetic_tokens():
    cfg = parse_config(["--model", "gpt2", "--dataset", "synthetic", "--global-batch-size", "12"], "single")
    train, _, info = load_dataset(cfg)
    assert tuple(train.x.shape[1:]) == (1024,) and info.num_classes == 50304
    assert int(train.x.max()) < 50304 and torch.equal(train.x[:, 1:], train.y[:, :-1])  # next-token targets
    with torch.device("meta"):
        model = build_model("gpt2", info)
    assert [name for name, _ in model.named_children()] == [
        "embed",
        *[f"block{i}" for i in range(12)],
        "head",
    ]
    block = model.block0
    assert block.attn.q.weight.shape == (768, 768) and block.mlp[0].weight.shape == (3072, 768)
    # 124M as GPT-2 (tied) counts it, plus the untied head's 50304 × 768
    assert sum(p.numel() for p in model.parameters()) == 163_100_160


def test_gpt2_on_text_keeps_gpt2s_vocabulary_and_context(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("abcdefgh" * 2000)
    args = ["--model", "gpt2", "--dataset", "text", "--data-root", str(text), "--global-batch-size", "2"]
    train, _, info = load_dataset(parse_config(args, "single"))
    assert tuple(train.x.shape[1:]) == (1024,) and info.num_classes == 50304


@pytest.mark.parametrize(
    "args, said",
    [
        (
            ["--model", "gpt2", "--gpt-layers", "4"],
            "--gpt-layers sets the depth of --model gpt, not of --model gpt2",
        ),
        (["--model", "gpt2", "--dataset", "masked"], "--model gpt2 does not train on --dataset masked"),
    ],
)
def test_gpt2_refuses_what_it_does_not_take(args, said):
    result = run_script([sys.executable, str(train_path("single")), *args, "--steps", "1"], timeout=120)
    assert result.returncode == 2 and said in result.stderr, result.stderr


def test_gpt2_has_its_costs_predicted():
    from distref.cost.activations import predicted_for_run

    cfg = parse_config(["--model", "gpt2", "--dataset", "synthetic", "--global-batch-size", "12"], "single")
    predicted, why = predicted_for_run(cfg, load_dataset(cfg)[2])
    assert why is None and predicted > 12 * 1024 * 768 * 12 * 4  # at least each block's input, in fp32


# ---- --compile -----------------------------------------------------------------------------------------
COMPILED = ["--model", "gpt", "--dataset", "synthetic", "--optimizer", "sgd", "--lr", "0.05", "--steps", "6"]
# What each impl runs compiled, at world 2, against single compiled the same way, and the graphs its rank 0
# must have compiled: one per kind of block it holds (embed, the transformer block: one graph for every
# layer, head), as single's 3; the first stage or part holds embed and block0.
COMPOSES = {
    "ddp": ("ddp", [], 3),
    "fsdp": ("fsdp", [], 3),
    "tensor_parallel": ("tensor_parallel", [], 3),
    "pipeline-1f1b": ("pipeline", ["--schedule", "1f1b"], 2),
    "pipeline-zbv": ("pipeline", ["--schedule", "zbv"], 2),  # (split backward: input, then weight gradients)
    "model_parallel": ("model_parallel", [], 2),
    "deepspeed_zero-2": ("deepspeed_zero", ["--zero-stage", "2"], 3),
    "deepspeed_zero-3": ("deepspeed_zero", ["--zero-stage", "3"], 3),
}
FAST_BACKEND = {"DISTREF_COMPILE_BACKEND": "aot_eager"}  # dynamo + AOTAutograd: composition, in seconds


@pytest.fixture(scope="session")
def single_compiled(tmp_path_factory):
    """single's final parameters on COMPILED, compiled with the backend that `backend` (an environment)
    chooses: run once per backend for the whole run (distref.testing.made_once), for every test that
    compares with it."""
    finals: dict[tuple, dict] = {}

    def train(out: Path, backend: dict) -> None:
        args = [*COMPILED, "--compile", "--save-final", str(out)]
        result = launch(1, "single", args, timeout=600, env=backend)  # (forked: torch imported once)
        assert result.returncode == 0, result.stderr[-2000:]

    def final(backend: dict) -> dict:
        key = tuple(sorted(backend.items()))
        if key not in finals:
            made = made_once(tmp_path_factory, "single-compiled", key, lambda out: train(out, backend))
            finals[key] = torch.load(made, weights_only=True)
        return finals[key]

    return final


@pytest.mark.parametrize("name", sorted(COMPOSES))
def test_compiled_blocks_compose_with_each_strategy_and_equal_single_compiled(
    name, single_compiled, tmp_path
):
    """Within PARITY_TOLERANCE, the eager parity tests' (fp32, SGD): per block, each compiled graph is the
    single's graph (or its slices'), so what differs is the order the ranks' sums are added in, as eager."""
    impl, options, graphs = COMPOSES[name]
    if impl == "deepspeed_zero":
        pytest.importorskip("deepspeed")
    final = tmp_path / "final.pt"
    args = [*COMPILED, *options, "--compile", "--save-final", str(final), "--out", str(tmp_path)]
    result = launch(2, impl, args, timeout=600, env=FAST_BACKEND)
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["strategy"]["compiled_graphs"] >= graphs  # (compiled, not run eagerly by another path)
    diff = max_relative_difference(torch.load(final, weights_only=True), single_compiled(FAST_BACKEND))
    assert diff < PARITY_TOLERANCE, f"{name} compiled vs single compiled: {diff:.2e}"


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).relu()


def test_compiled_blocks_run_compiled_after_the_counted_step():
    """The counted step runs under a dispatch mode, where dynamo does not trace: met there, a compiled
    block would run eagerly for the rest of the run (torch 2.13). Counting runs it eagerly on purpose,
    keeping dynamo out, so the steps after it run the compiled graph again."""
    from distref.training.traffic import Traffic

    compiled_calls = []

    def backend(graph, example_inputs):
        return lambda *args: (compiled_calls.append(1), graph(*args))[1]

    block = Block()
    block.compile(backend=backend)
    traffic = Traffic()
    traffic.session_starts(0, 5)  # the third step (2) is counted
    for step in range(5):
        traffic.step_starts(step)
        block(torch.randn(2, 4))
        traffic.stop_counting()
    assert traffic.counted_step == 2
    assert len(compiled_calls) == 4  # every step but the counted one


def test_inductor_compiled_ddp_equals_single_compiled_and_eager_single_closely(single_compiled, tmp_path):
    """With inductor (the default backend): ddp ×2 as single compiled, within the parity tolerance; and
    single compiled as single eager within 1e-4 (inductor fuses the ops of a block, so they round
    differently: not a strategy's difference, which is why every impl is held to single compiled)."""
    compiled = single_compiled({})
    final = tmp_path / "final.pt"
    result = launch(2, "ddp", [*COMPILED, "--compile", "--save-final", str(final)], timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert max_relative_difference(torch.load(final, weights_only=True), compiled) < PARITY_TOLERANCE
    eager = tmp_path / "eager.pt"
    result = launch(1, "single", [*COMPILED, "--save-final", str(eager)])
    assert result.returncode == 0, result.stderr[-2000:]
    assert 0 < max_relative_difference(torch.load(eager, weights_only=True), compiled) < 1e-4


def test_inductor_compiled_zero_bubble_pipeline_equals_single_compiled(single_compiled, tmp_path):
    """Zero-bubble schedules run each stage's backward in two passes over one graph (input gradients,
    then weight gradients), which inductor's compiled backward refuses unless it keeps its buffers."""
    final = tmp_path / "final.pt"
    args = [*COMPILED, "--schedule", "zbv", "--compile", "--save-final", str(final)]
    result = launch(2, "pipeline", args, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    diff = max_relative_difference(torch.load(final, weights_only=True), single_compiled({}))
    assert diff < PARITY_TOLERANCE, f"zbv compiled vs single compiled: {diff:.2e}"


def test_dataparallel_refuses_compile_in_one_line():
    result = run_script(
        [sys.executable, str(train_path("dataparallel")), *COMPILED, "--compile"], timeout=120
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "--compile: nn.DataParallel copies" in lines[0]


def test_compile_compiles_blocks_made_of_torchs_own_layers(tmp_path):
    """lenet's blocks are nn.Sequential of torch's layers, whose code dynamo skips when their call is
    compiled (`Module.compile`): each block's forward is what compile_blocks compiles."""
    args = ["--model", "lenet", "--dataset", "synthetic", "--steps", "3", "--compile", "--out", str(tmp_path)]
    args += ["--save-final", str(tmp_path / "final.pt")]
    result = run_script([sys.executable, str(train_path("single")), *args], env=FAST_BACKEND, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["strategy"]["compiled_graphs"] == 4  # conv1, conv2, fc1, fc2: a graph each
    assert list(torch.load(tmp_path / "final.pt", weights_only=True))[:1] == ["conv1.0.weight"]


# ---- Start-up: one build per process ---------------------------------------------------------------
@pytest.mark.parametrize("impl", ["single", "ddp", "fsdp", "tensor_parallel"])
def test_each_process_builds_the_model_once_and_runs_it_only_to_train(impl, tmp_path):
    """Your model (it counts): validate checks it on the meta device, the launcher builds nothing, each
    rank builds it once (fsdp's and tensor_parallel's evaluation copy is copied, not built) and runs it
    only in training and evaluation (3 steps, one micro-batch each; the test set of 128 in one batch),
    and tensor_parallel's check of your plan."""
    counts = tmp_path / "counts.jsonl"
    args = ["--model", "distref.testing.own:counted_mlp", "--dataset", EXAMPLE_DATASET, "--steps", "3"]
    args += ["--global-batch-size", "32", "--lr", "0.01"]
    if impl == "single":
        result = run_script([sys.executable, str(train_path(impl)), *args], env={COUNT_VARIABLE: str(counts)})
    else:
        result = run_script(
            [sys.executable, str(train_path(impl)), "--nproc-per-node", "2", *args],
            env={COUNT_VARIABLE: str(counts)},
            timeout=300,
        )
    assert result.returncode == 0, result.stderr[-2000:]
    by_process: dict[int, Counter] = {}
    for line in counts.read_text().splitlines():
        event = json.loads(line)
        by_process.setdefault(event["pid"], Counter())[event["event"]] += 1
    ranks = 1 if impl == "single" else 2
    assert len(by_process) == ranks, by_process  # (the launcher built nothing for real)
    # 3 steps, then the test set in one batch; tensor_parallel checks a plan of yours once, running the
    # split model and its whole copy on 4 samples (tp_split_problem)
    forwards = 3 + 1 + (2 if impl == "tensor_parallel" else 0)
    for counted in by_process.values():
        assert counted == {"build": 1, "forward": forwards}, by_process


# ---- FSDP's resharding choice ------------------------------------------------------------------------
@pytest.mark.parametrize("world_size, reshards", [(1, False), (2, True)])
def test_fsdp_reshards_after_forward_only_with_two_shards_or_more(world_size, reshards, tmp_path):
    """By default: a rank that holds every shard has nothing to free after forward (its gathered
    parameters are a copy), so it keeps them; the record says which it did, and its communication is
    the formula's for that choice."""
    args = ["--model", "gpt", "--dataset", "synthetic", "--steps", "3", "--out", str(tmp_path)]
    result = launch(world_size, "fsdp", args, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["strategy"]["reshard_after_forward"] is reshards
    communication = record["communication"]
    assert communication["measured"] == communication["predicted"]
