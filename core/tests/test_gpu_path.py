"""The GPU path's logic, shown on the CPU (no CUDA here): what training's peak memory counts, and what
crosses gather_object. What only a GPU can show is listed in the impl READMEs as not run on one yet."""

import pytest
import torch

import distref.distributed.collectives
from distref.cli import parse_config
from distref.record import RunRecord


class FakeCudaMemory:
    """torch.cuda's allocation counters for one device: allocated now, and the peak since a reset."""

    def __init__(self):
        self.allocated = self.peak = 0

    def allocate(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def free(self, nbytes: int) -> None:
        self.allocated -= nbytes

    def max_memory_allocated(self, device=None) -> int:
        return self.peak

    def reset_peak_memory_stats(self, device=None) -> None:
        self.peak = self.allocated


def test_training_peak_memory_leaves_out_set_up_and_evaluation(monkeypatch):
    """Reset when set-up ends, taken at each flush (every impl flushes before it evaluates), reset after
    each evaluation: a 300-byte set-up transient and a 500-byte evaluation batch are not training's."""
    cuda = FakeCudaMemory()
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", cuda.max_memory_allocated)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", cuda.reset_peak_memory_stats)
    cfg = parse_config(["--dataset", "synthetic"], "single")
    record = RunRecord(
        "single", "0", cfg, 1, torch.device("cpu"), "none", memory_devices=[torch.device("cuda", 0)]
    )
    cuda.allocate(300)  # set-up: the model (100) and what building it needed for a moment
    cuda.free(200)
    record.start_training()
    cuda.allocate(50)  # a step's activations
    cuda.free(50)
    record.add_steps(0, [1.0], [0.1])  # the flush before an evaluation
    cuda.allocate(500)  # the evaluation's test-set batch
    cuda.free(500)
    record.add_eval(1, 0.1, 0.5, 1.0, 0.2)
    cuda.allocate(60)  # the next steps
    cuda.free(60)
    assert record.training_peak_memory() == [100 + 60]


def test_tensors_cross_gather_object_as_cpu_tensors(monkeypatch):
    """model_parallel gathers optimizer state to rank 0: a CUDA tensor pickled by rank 1 would be
    unpickled onto cuda:1 in rank 0's process. Every tensor is sent as a CPU tensor."""

    class OnADevice(torch.Tensor):
        def cpu(self):
            return torch.Tensor._make_subclass(torch.Tensor, self.as_subclass(torch.Tensor))

    sent = []
    monkeypatch.setattr(distref.distributed.collectives.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(
        distref.distributed.collectives.dist, "gather_object", lambda obj, gathered, dst: sent.append(obj)
    )
    state = {
        "optimizer": {"state": {0: {"momentum_buffer": torch.zeros(2).as_subclass(OnADevice)}}},
        "step": 3,
    }
    distref.distributed.collectives.gather_to_rank0(state, world_size=2)
    buffer = sent[0]["optimizer"]["state"][0]["momentum_buffer"]
    assert type(buffer) is torch.Tensor and sent[0]["step"] == 3


def test_busy_and_waiting_time_on_cuda_are_read_from_stream_events(monkeypatch):
    """On a GPU the host only enqueues work (and NCCL's wait() blocks the stream, not the host): the
    intervals are CUDA events, read once the stream has passed them. Faked here: each event is stamped
    with a stream clock that runs ahead of the host's."""
    from distref.training import IntervalTimer

    stream_clock = [0.0]
    synchronized = []

    class FakeEvent:
        def __init__(self, enable_timing: bool):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = stream_clock[0]

        def synchronize(self):
            synchronized.append(self)

        def elapsed_time(self, end) -> float:
            return (end.at - self.at) * 1000  # milliseconds, as torch.cuda.Event says

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    timer = IntervalTimer(torch.device("cuda", 0))
    for waited in (2.0, 3.0):
        with timer.measure():
            stream_clock[0] += waited  # the stream waits for a neighbour; the host went on at once
    assert timer.seconds() == 5.0 and len(synchronized) == 2
    timer.reset()
    assert timer.seconds() == 0.0
    cpu = IntervalTimer(torch.device("cpu"))
    with cpu.measure():
        pass
    assert 0 <= cpu.seconds() < 1


def test_the_cpu_suite_runs_with_the_gpus_hidden():
    """`nox -s tests` on a GPU machine: the CPU suite (`--device auto`) must not land on CUDA; only the
    tests marked gpu see the GPUs (DISTREF_GPU_TESTS=1, run apart)."""
    import os

    assert os.environ.get("DISTREF_GPU_TESTS") == "1" or os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert torch.cuda.device_count() == 0 or os.environ.get("DISTREF_GPU_TESTS") == "1"


def test_a_skipped_gpu_test_fails_where_the_gpu_tests_must_run():
    """The GPU workflow sets DISTREF_REQUIRE_GPU=1: a gpu test that skips (no usable GPU) fails there."""
    import sys

    from distref.testing import run_script

    test = "impls/pipeline/tests/test_pipeline.py::test_two_gpus_match_single"
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", test]
    assert run_script(args, timeout=120).returncode == 0  # skipped, as everywhere without GPUs
    required = run_script(args, env={"DISTREF_REQUIRE_GPU": "1"}, timeout=120)
    assert required.returncode == 1 and "a gpu test skipped where DISTREF_REQUIRE_GPU=1" in required.stdout


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_an_optimizer_over_dtensors_and_plain_tensors_steps_where_foreach_is_the_default(
    optimizer, monkeypatch
):
    """expert_parallel's parameters mix DTensors (the experts) and plain tensors (the rest). On CUDA torch's
    default is foreach, whose kernels refuse the mix ("got mixed torch.Tensor and DTensor"): made here as
    on CUDA (the CPU made a foreach device), make_optimizer's step still runs, and steps as the plain loop."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.optim import optimizer as torch_optimizer

    from distref.training.optim import make_optimizer

    monkeypatch.setattr(torch_optimizer, "_get_foreach_kernels_supported_devices", lambda: ["cpu", "cuda"])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        plain = torch.nn.Parameter(torch.randn(4, 3))
        shard = torch.nn.Parameter(distribute_tensor(torch.randn(2, 3), mesh, [Shard(0)]))
        expected = [plain.detach().clone(), shard.to_local().detach().clone()]
        plain.grad, shard.grad = torch.ones(4, 3), distribute_tensor(torch.ones(2, 3), mesh, [Shard(0)])
        cfg = parse_config(["--optimizer", optimizer, "--lr", "0.1", "--dataset", "synthetic"], "test")
        make_optimizer(cfg, [plain, shard]).step()
        # (SGD: lr · grad; AdamW's first step: lr · sign(grad), the decoupled decay 0)
        assert torch.allclose(plain.detach(), expected[0] - 0.1, atol=1e-6)
        assert torch.allclose(shard.to_local().detach(), expected[1] - 0.1, atol=1e-6)
    finally:
        dist.destroy_process_group()


def test_a_dtensor_parameters_local_part_is_model_state_while_it_lives(tmp_path):
    """The saved-tensor meter takes a view of a DTensor parameter's local part (an expert's weight a matmul
    saves) for model state, and forgets it with the parameter: a later tensor at the same address is an
    activation again (a set of addresses once made a later test's activations 44% short)."""
    import gc

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from distref.models import PARAMETER_PARTS, local
    from distref.training.measure import SavedActivations

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        parameter = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
        meter = SavedActivations()
        saved = meter.pack(local(parameter)[1])  # (a row of it, as w1[e])
        assert meter.live == 0 and isinstance(saved, torch.Tensor)  # (returned as is: not counted)
        del parameter, saved
        gc.collect()
        assert len(PARAMETER_PARTS) == 0
    finally:
        dist.destroy_process_group()
