"""The cost model's parts: communication counted at the dispatcher (distref.training.traffic), the formulas'
shared rules (distref.cost.counts), and model states against the ZeRO paper (distref.cost.memory)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from distref.cost.counts import add, buckets, bus_bytes, differences, same
from distref.cost.memory import optimizer_state_bytes, replicated, zero_paper
from distref.training.traffic import KINDS, CountCommunication, Traffic


@contextlib.contextmanager
def fake_world(rank: int, world_size: int):
    """One rank of a `world_size`-rank job in this process: torch's fake backend (nothing moves)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_every_kind_is_counted_with_the_bytes_the_rank_passes():
    """Each torch.distributed call, its functional twin, and a subgroup's: calls, bytes (all-gather and
    reduce-scatter: the unsharded side) and nccl-tests' bus bytes, by hand."""
    with fake_world(rank=3, world_size=8), CountCommunication() as counter:
        ten = torch.ones(10)  # 40 bytes
        dist.all_reduce(ten)
        dist.all_gather_into_tensor(torch.empty(80), ten)  # output 320 bytes
        dist.all_gather([torch.empty(10) for _ in range(8)], ten)  # outputs 320 bytes
        dist.reduce_scatter_tensor(torch.empty(10), torch.ones(80))  # input 320 bytes
        dist.broadcast(ten, src=0)
        dist.all_to_all_single(torch.empty(80), torch.ones(80))
        dist.send(torch.ones(3), dst=4)
        dist.recv(torch.empty(5, dtype=torch.float64), src=2)
        dist.barrier()
        funcol.all_reduce(torch.ones(6), "sum", dist.group.WORLD)  # DTensor's way: 24 bytes
        funcol.all_gather_tensor(torch.ones(6), 0, dist.group.WORLD)  # 6 × 8 ranks × 4 bytes
        funcol.reduce_scatter_tensor(torch.ones(16), "sum", 0, dist.group.WORLD)  # 64 bytes
        half = dist.new_group([0, 1, 2, 3])
        dist.all_reduce(torch.ones(4), group=half)  # 16 bytes in a group of 4
    counts = counter.counts
    assert {k: (v["calls"], v["bytes"]) for k, v in counts.items()} == {
        "all_reduce": (3, 40 + 24 + 16),
        "all_gather": (3, 320 + 320 + 192),
        "reduce_scatter": (2, 320 + 64),
        "broadcast": (1, 40),
        "all_to_all": (1, 320),
        "send": (1, 12),
        "recv": (1, 40),
        "barrier": (1, 0),
    }
    assert counts["all_reduce"]["bus_bytes"] == pytest.approx((40 + 24) * 2 * 7 / 8 + 16 * 2 * 3 / 4)
    assert counts["all_gather"]["bus_bytes"] == pytest.approx(832 * 7 / 8)
    assert counts["send"]["bus_bytes"] == 12
    assert set(KINDS) <= set(counts)


def test_nothing_is_counted_outside_a_phase_and_each_phase_once():
    traffic = Traffic()
    with fake_world(rank=0, world_size=2):
        traffic.begin_run()  # counts set-up
        dist.broadcast(torch.ones(2), src=0)
        traffic.session_starts(start_step=0, n_steps=5)  # the step counted: the third
        for step in range(5):
            traffic.step_starts(step)
            dist.all_reduce(torch.ones(step + 1))  # step 2 all-reduces 3 floats
            traffic.stop_counting()
            with traffic.counting("log"):
                dist.all_reduce(torch.ones(7 + step))  # only the first log counts: 7 floats
        dist.all_reduce(torch.ones(100))  # after the loop: counted nowhere
    summary = traffic.summary()
    assert summary["step"] == 2
    assert summary["phases"]["step"] == {"all_reduce": {"calls": 1, "bytes": 12, "bus_bytes": 12.0}}
    assert summary["phases"]["log"]["all_reduce"]["bytes"] == 28
    assert summary["phases"]["setup"]["broadcast"]["bytes"] == 8


@pytest.mark.parametrize(
    "start, n_steps, counted", [(0, 5, 2), (0, 2, None), (0, 1, None), (4, 10, 6), (9, 10, None)]
)
def test_the_counted_step_is_the_session_s_third_or_none(start, n_steps, counted):
    traffic = Traffic()
    traffic.session_starts(start, n_steps)
    for step in range(start, n_steps):
        traffic.step_starts(step)
    traffic.stop_counting()
    assert traffic.summary()["step"] == counted


def test_a_ddp_step_is_counted_where_its_cpp_reducer_issues_it():
    """DDP all-reduces from C++ (its reducer, in autograd's hooks): still counted, as one bucket."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1000, 10))
        for _ in range(3):  # the first steps build and rebuild the buckets
            model(torch.ones(2, 1000)).sum().backward()
        with CountCommunication() as counter:
            model(torch.ones(2, 1000)).sum().backward()
    finally:
        # DDP's reducer holds the group: released before the group is destroyed (released after it, gloo's
        # destructor waited forever for its threads, hanging a CI worker at the test's end)
        model = None
        dist.destroy_process_group()
    assert counter.counts == {"all_reduce": {"calls": 1, "bytes": 10010 * 4, "bus_bytes": 0.0}}


def test_bus_bytes_follow_nccl_tests():
    assert bus_bytes("all_reduce", 1000, 4) == 1500
    assert bus_bytes("all_gather", 1000, 4) == 750
    assert bus_bytes("reduce_scatter", 1000, 4) == 750
    assert bus_bytes("all_to_all", 1000, 4) == 750
    assert bus_bytes("broadcast", 1000, 4) == bus_bytes("send", 1000, 4) == 1000


def test_counts_compare_calls_and_bytes_exactly():
    one = add({}, "all_reduce", 100, 2)
    assert same(one, add({}, "all_reduce", 100, 2))
    assert not same(one, add({}, "all_reduce", 101, 2))
    assert not same(one, add({}, "all_reduce", 100, 2, calls=2))
    assert not same(one, {})
    assert same(None, {})
    assert differences([one, one], [one, {}]) == [f"rank 1: measured {one} predicted {{}}"]


@pytest.mark.parametrize(
    "sizes, limits, expected",
    [
        ([10, 10, 10], [25], [30]),  # a bucket closes once it reaches the limit
        ([10, 10, 10, 10], [15], [20, 20]),
        ([30, 1, 1], [25], [30, 2]),  # one tensor beyond the limit is a bucket of its own
        ([5, 5, 5, 5], [5, 100], [5, 15]),  # the first bucket's own limit
        ([], [25], []),
    ],
)
def test_buckets_fill_as_ddp_s_reducer_fills_them(sizes, limits, expected):
    assert buckets(sizes, limits) == expected


def test_the_zero_paper_example():
    """ZeRO (arXiv 1910.02054), Figure 1: 7.5B parameters, 64 GPUs, mixed-precision Adam (K = 12):
    120 GB per GPU replicated, 31.4 GB with ZeRO-1, 16.6 GB with ZeRO-2, 1.9 GB with ZeRO-3."""
    per_gpu = [zero_paper(7.5e9, 64, stage) / 1e9 for stage in range(4)]
    assert [round(gb, 1) for gb in per_gpu] == [120.0, 31.4, 16.6, 1.9]


def test_torch_optimizers_hold_what_the_formula_says():
    """The formula against torch.optim's real state (AdamW: two moments and a step per tensor)."""
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    sizes = [p.numel() * 4 for p in model.parameters()]
    for name, optimizer in [
        ("adamw", torch.optim.AdamW(model.parameters())),
        ("sgd", torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)),
    ]:
        model(torch.ones(1, 7)).sum().backward()
        optimizer.step()
        held = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())
        assert held == optimizer_state_bytes(sizes, name)
    assert replicated(sizes, "sgd") == {"parameters": 232, "gradients": 232, "optimizer": 232}


def test_a_run_that_stops_before_its_loop_stops_counting():
    """Bad input found after the process group started (a checkpoint of another run) ends the run inside
    destroy_process_group_on_exit, before any StepLog: the set-up's counting must end with it, else every
    later run and test in this process would go on under the counting mode (slower, and IntervalTimer
    would time nothing). A new run also drops one left over."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    from distref.distributed.process_group import destroy_process_group_on_exit
    from distref.training.traffic import TRAFFIC

    with pytest.raises(SystemExit), destroy_process_group_on_exit():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        TRAFFIC.begin_run()  # as start_process_group does: set-up is counted
        assert is_in_torch_dispatch_mode()
        raise SystemExit(2)
    assert not is_in_torch_dispatch_mode() and not dist.is_initialized()
    TRAFFIC.begin_run()
    TRAFFIC.begin_run()  # a run that never said it ended: its counting stops when the next begins
    TRAFFIC.stop_counting()
    assert not is_in_torch_dispatch_mode()


def test_counting_starts_only_inside_a_run_s_loop():
    """A checkpoint built outside a run's loop (a test, a tool calling checkpoint_state) starts no
    counting that would outlive it; inside the loop the first checkpoint is counted, until the loop ends."""
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    traffic = Traffic()
    traffic.start("checkpoint")
    assert not is_in_torch_dispatch_mode() and "checkpoint" not in traffic.summary()["phases"]
    traffic.session_starts(start_step=0, n_steps=3)
    traffic.start("checkpoint")
    assert is_in_torch_dispatch_mode()
    traffic.session_ends()
    assert not is_in_torch_dispatch_mode() and "checkpoint" in traffic.summary()["phases"]
