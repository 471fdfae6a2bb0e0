"""The bookkeeping every train.py shares (distref.training.bookkeeping, .checkpoint, .measure) and the
typed run options: each helper's numbers, checked against what the loop used to compute inline."""

import dataclasses
import time

import pytest
import torch

from distref.cli import parse_config
from distref.config import RunConfig
from distref.record import RunRecord
from distref.training import Cadence, StepLog, TrainingDiverged, checkpoint_state
from distref.training.measure import SavedActivations, zero_model_state_bytes


def config(**options) -> RunConfig:
    return dataclasses.replace(parse_config(["--dataset", "synthetic"], "single"), **options)


def test_cadence_says_what_is_due_after_each_step():
    """Evaluation every --eval-every steps (else every epoch) and at the end, checkpoints every
    --checkpoint-every steps, and the losses before each of those as well as every --log-every steps."""
    cadence = Cadence(config(eval_every=0, checkpoint_every=4, log_every=3, checkpoint_dir="x"), 10, 5)
    due = [cadence.after(step) for step in range(10)]
    assert [d.done for d in due if d.eval] == [5, 10]  # every epoch of 5 steps, and the last
    assert [d.done for d in due if d.checkpoint] == [4, 8]
    assert [d.done for d in due if d.log] == [3, 4, 5, 6, 8, 9, 10]
    assert [d.done for d in due if d.last] == [10]
    every_2 = Cadence(config(eval_every=2), 5, 100)
    assert [every_2.after(s).done for s in range(5) if every_2.after(s).eval] == [2, 4, 5]


def test_step_log_flushes_losses_into_the_record_and_stops_a_diverged_run(tmp_path):
    cfg = config(out=str(tmp_path))
    record = RunRecord("single", "0", cfg, world_size=1, device=torch.device("cpu"), backend="none")
    cadence = Cadence(cfg, 4, 4)
    with StepLog(record, cfg, "single", cadence, 0, show=False) as log:
        for loss in (1.0, 0.5):
            assert log.step_done(torch.tensor(loss), time.perf_counter()) >= 0  # (the CPU: the host's clock)
        log.flush(2, reduce=lambda losses: losses * 2)  # e.g. a mean over ranks
        assert [(s["step"], s["loss"]) for s in record.data["steps"]] == [(0, 2.0), (1, 1.0)]
        log.evaluated(2, torch.tensor([3.0, 6.0, 10.0], dtype=torch.float64), time.perf_counter())
        assert record.data["evals"][-1]["accuracy"] == 0.6 and record.data["evals"][-1]["loss"] == 0.3
        assert record.data["evals"][-1]["epoch"] == 0.5
    with pytest.raises(TrainingDiverged), StepLog(record, cfg, "single", cadence, 2, show=False) as log:
        log.step_done(torch.tensor(float("nan")), time.perf_counter())
        log.flush(3)
    assert record.data["status"] == "failed" and "loss is nan at step 3" in record.data["error"]


def test_checkpoint_state_holds_the_impls_states_then_what_every_checkpoint_holds():
    cfg = config(steps=7)
    record = RunRecord("single", "0", cfg, world_size=1, device=torch.device("cpu"), backend="none")
    state = checkpoint_state(cfg, 3, 7, record, model={"w": 1}, optimizer={})
    assert list(state) == ["model", "optimizer", "step", "total_steps", "rng", "record", "config", "impl"]
    assert state["impl"] == {"name": "single", "version": "0"}  # (a resume by another impl records it)
    assert state["step"] == 3 and state["total_steps"] == 7 and state["config"] == cfg.to_dict()
    assert torch.equal(state["rng"], torch.get_rng_state())


def test_strategy_options_are_typed_frozen_and_kept_as_records_always_had_them():
    @dataclasses.dataclass(frozen=True)
    class Options:
        bucket_cap_mb: float

    def add_options(parser):
        parser.add_argument("--bucket-cap-mb", type=float, default=25.0)

    cfg = parse_config(["--bucket-cap-mb", "5"], "x", add_options, strategy_options=Options)
    assert cfg.strategy == Options(5.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.strategy.bucket_cap_mb = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0
    assert cfg.to_dict()["extra"] == {"bucket_cap_mb": 5.0}  # the record/checkpoint format is unchanged
    assert "strategy" not in cfg.to_dict() and "launch" not in cfg.to_dict()


def test_saved_activations_count_what_autograd_keeps_and_not_the_parameters():
    linear = torch.nn.Linear(8, 8, bias=False)
    meter = SavedActivations(linear.parameters())
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        out = linear(x).relu()  # saves x (4×8 fp32) for the matmul and the output for relu: not the weight
    assert meter.live == meter.peak == 2 * 4 * 8 * 4
    out.sum().backward()
    assert meter.live == 0 and meter.peak == 2 * 4 * 8 * 4


def test_zero_state_bytes_count_each_storage_once_by_kind():
    """DeepSpeed's engine, as zero_model_state_bytes reads it: the module's parameters (and stage 3's
    partitions), the optimizer's state keyed by its flat master partitions, and gradient buffers found
    on the ZeRO optimizer."""
    module = torch.nn.Linear(4, 4, bias=False)  # 64 bytes of fp32 weight
    master = torch.zeros(16)  # the flat fp32 partition the optimizer steps: 64 bytes
    master.grad = torch.zeros(16)  # 64
    optimizer = torch.optim.SGD([master], lr=0.1)
    optimizer.state[master] = {"momentum_buffer": torch.zeros(16), "step": 3}  # 64

    class ZeroOptimizer:
        def __init__(self):
            self.averaged_gradients = {0: [torch.zeros(8)]}  # 32, found by its name
            self.ipg_buffer = [master.grad]  # the same storage again: counted once
            self.loss_scale = torch.ones(())  # not a gradient buffer

    engine = type("Engine", (), {"module": module, "optimizer": ZeroOptimizer()})()
    held = zero_model_state_bytes(engine, optimizer)
    assert held == {"parameters": 64, "gradients": 64 + 32, "optimizer": 64 + 64}


def test_the_stage_meter_measures_from_the_second_step_what_its_stages_do():
    """distref.distributed.stages.StageMeter (impls/pipeline's measurement): the activations held and the
    timeline are the second step's (the first pays for warm-up), a wrapped stage's work is timed and put
    on the timeline with its micro-batch, and its parameters are not counted as activations."""
    from distref.distributed.stages import StageMeter

    class Stage:  # what the meter wraps of a PipelineStage
        stage_index = 3

        def __init__(self):
            self.submod = torch.nn.Linear(4, 4)

        def forward_one_chunk(self, chunk, x):
            return (self.submod(x) * x).sum()  # saves x twice (one storage) and the weight (a parameter)

        def backward_one_chunk(self, chunk, loss=None, full_backward=True, last_backward=False):
            return None

        def backward_weight_one_chunk(self, chunk, *args, **kwargs):
            return None

    meter = StageMeter(torch.device("cpu"))
    stage = meter.wrap(Stage())
    for step, size in ((0, 1000), (1, 10)):  # the first step holds far more than the second
        with meter.step(step):
            x = torch.ones(size, 4, requires_grad=True)
            loss = stage.forward_one_chunk(step + 5, x)
            stage.backward_one_chunk(step + 5, full_backward=False)
        del loss, x
    measured = meter.gathered(world_size=1)
    assert measured["peak_activation_bytes"] == [10 * 4 * 4 + 10 * 4 * 4]  # x, and the Linear's output
    [timeline] = measured["timeline"]
    assert timeline["step"] == 1 and [w[:3] for w in timeline["work"]] == [["F", 3, 6], ["I", 3, 6]]
    assert 0 < measured["busy_fraction"][0] <= 1
    assert measured["bubble_fraction"] == 1 - measured["busy_fraction"][0]


def test_handoff_meter_keeps_the_first_step_s_bytes_and_times_steps_outside_the_counted_one(monkeypatch):
    """impls/model_parallel's measurement (distref.distributed.handoffs): the bytes its first step sent, and
    the share of its steps' time not spent waiting; the counted step (slower) is timed neither way."""
    from distref.distributed.handoffs import HandoffMeter
    from distref.training.traffic import TRAFFIC

    monkeypatch.setattr(TRAFFIC, "counted_step", 2)
    meter = HandoffMeter()
    assert meter.gathered(world_size=1) == {"bytes_sent_per_step": [None], "busy_fraction": [None]}
    meter.sent(100)
    with meter.waiting():
        time.sleep(0.01)
    meter.step_done(0, 10.0)
    meter.sent(100)  # the second step's, and an evaluation's: not the first step's
    meter.step_done(1, 10.0)
    meter.step_done(2, 1000.0)  # the counted step
    facts = meter.gathered(world_size=1)
    assert facts["bytes_sent_per_step"] == [100]
    assert 0.9 < facts["busy_fraction"][0] < 1 - 0.009 / 20
