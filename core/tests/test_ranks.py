"""How many ranks a run gets on a GPU machine: the most, one per GPU, that the impl's workload allows;
and whether this torch can use the GPUs it counts. Pure logic, tested here without a GPU."""

import pytest
import torch

from distref import compare, impl_folders, ranks
from distref.cli import parse_config
from distref.testing import ROOT

LENET = ["--model", "lenet", "--dataset", "mnist", "--global-batch-size", "64"]


@pytest.mark.parametrize(("devices", "expected"), [(1, 1), (2, 2), (3, 2), (8, 4)])
def test_the_largest_count_that_fits_is_taken(devices, expected):
    """A batch of 64 and a model of 4 blocks: 3 GPUs give 2 ranks (64 does not split in 3), 8 give 4."""

    def problem_at(n: int) -> str | None:
        return "64 % n" if 64 % n else ("only 4 blocks" if n > 4 else None)

    chosen, refused = ranks.largest_fitting(devices, problem_at)
    assert chosen == expected
    assert len(refused) == devices - expected


@pytest.mark.parametrize(
    ("impl", "args", "devices", "expected", "said"),
    [
        ("ddp", LENET, 3, 2, "3 ranks: --global-batch-size 64 must be divisible by world size"),
        ("model_parallel", LENET, 8, 4, "5 ranks: 5 parts but --model lenet has only 4 blocks"),
        ("pipeline", LENET, 8, 4, "5 ranks: 5 parts but --model lenet has only 4 blocks"),
        ("tensor_parallel", ["--model", "gpt", "--dataset", "synthetic"], 8, 4, "--tp 8 must divide"),
        ("pipeline", LENET, 1, None, "a pipeline needs 2 or more"),
        ("single", LENET, 4, 1, "this impl starts no ranks"),
        ("dataparallel", LENET, 4, 1, "this impl starts no ranks"),
    ],
)
def test_each_impl_s_own_checks_choose_its_world_size(impl, args, devices, expected, said):
    chosen, line = ranks.fitting_world_size(ROOT / "impls" / impl / "train.py", args, devices)
    assert chosen == expected and said in line


@pytest.mark.parametrize(
    ("counted", "available", "capability", "arches", "problem"),
    [
        (0, False, (0, 0), [], "no CUDA device visible"),
        (2, False, (0, 0), [], "counts 2 GPU(s) but cannot use them"),  # a driver too old for the build
        (1, True, (9, 0), ["sm_80", "sm_90"], None),
        (1, True, (8, 6), ["sm_80", "sm_90"], None),  # sm_80 kernels run on 8.6
        (1, True, (12, 0), ["sm_80", "sm_90"], "sm_120 is not among this torch build's"),
        (1, True, (12, 0), ["sm_80", "compute_90"], None),  # PTX, compiled for the newer GPU
        (1, True, (7, 0), ["sm_80", "sm_90"], "sm_70 is not among"),
        (1, True, (9, 4), ["gfx90a", "gfx942"], None),  # ROCm names its architectures otherwise
    ],
)
def test_a_gpu_torch_counts_but_cannot_use_is_said(counted, available, capability, arches, problem):
    said = ranks.cuda_problem(counted, available, capability, arches)
    assert said == problem if problem is None else problem in said
    if problem and counted:
        assert "DISTREF_CONSTRAINTS" in said  # what to do about it


def test_more_ranks_on_this_machine_than_gpus_is_one_line(monkeypatch, capsys):
    """compare-gpu's world 2 on one GPU: refused before anything starts (rank 1's set_device(1) failed)."""
    import distref.cli

    monkeypatch.setattr(distref.cli, "uses_cuda", lambda cfg: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit):
        parse_config(["--dataset", "synthetic"], "ddp", world_size=2, distributed=True)
    assert "2 ranks on this machine need a CUDA device each, and 1 are visible" in capsys.readouterr().err
    # Under torchrun on several nodes the world is larger than one machine: its local ranks count.
    for name, value in {
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "x",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "1",
    }.items():
        monkeypatch.setenv(name, value)
    assert parse_config(["--dataset", "synthetic"], "ddp", distributed=True).dataset == "synthetic"


def test_compare_runs_every_impl_at_the_largest_world_every_workload_allows(monkeypatch, capsys):
    available = impl_folders.discover(ROOT / "impls")
    chosen = ["single", "ddp", "model_parallel", "pipeline"]
    assert compare.default_world(available, chosen, [*LENET, "--device", "cpu"]) == (2, [])
    monkeypatch.setattr(compare, "cuda_gpus", lambda: (8, "8 × a GPU"))
    assert compare.default_world(available, chosen, LENET) == (4, [])
    assert (
        "compare: world size 4, one rank per GPU of 8 × a GPU; not more: 8 ranks:" in capsys.readouterr().out
    )
    monkeypatch.setattr(compare, "cuda_gpus", lambda: (3, "3 × a GPU"))
    assert compare.default_world(available, ["single", "ddp"], LENET) == (2, [])


@pytest.mark.parametrize(
    ("counts", "fits", "world", "left_out"),
    [
        # One GPU: pipeline needs 2 stages; the others run, at 1.
        (range(1, 2), {"ddp": {1, 2, 4}, "pipeline": {2, 3, 4}}, 1, {"pipeline"}),
        # A count that fits every impl: the largest such (4), not the largest count (8: ddp alone).
        (range(1, 9), {"ddp": {1, 2, 4, 8}, "model_parallel": {1, 2, 3, 4}, "pipeline": {2, 3, 4}}, 4, set()),
        # None fits all, three counts fit three impls each: the largest, 3, where tensor_parallel's 4 heads
        # do not split (it fits 1 and 2).
        (
            range(1, 4),
            {"ddp": {1, 3}, "tensor_parallel": {1, 2}, "pipeline": {2, 3}, "model_parallel": {1, 2, 3}},
            3,
            {"tensor_parallel"},
        ),
        # More impls at a smaller count win over more ranks for fewer impls.
        (range(1, 5), {"ddp": {1, 2, 4}, "fsdp": {1, 2}, "pipeline": {2}}, 2, set()),
        (range(1, 2), {"pipeline": set()}, 1, {"pipeline"}),  # none fits: the GPUs' count, all left out
    ],
)
def test_the_world_is_the_count_the_most_impls_fit_the_largest_of_a_tie(counts, fits, world, left_out):
    def problem_at(impl: str, n: int) -> str | None:
        return None if n in fits[impl] else f"{impl} refuses {n}"

    chosen, refused = compare.choose_world(list(fits), counts, problem_at)
    assert chosen == world
    assert refused == {impl: f"{impl} refuses {world}" for impl in left_out}


def test_why_an_impl_is_not_run_names_the_counts_it_fits_or_the_gpus_it_needs():
    fits = {"tensor_parallel": {1, 2}, "pipeline": {2, 3, 4}, "odd": set()}

    def problem_at(impl: str, n: int) -> str | None:
        return None if n in fits[impl] else f"{impl} refuses {n}"

    assert compare.why_not_run("tensor_parallel", 3, 3, problem_at) == (
        "world size 3 does not fit it (3 ranks: tensor_parallel refuses 3); it fits 1, 2: "
        "--impls tensor_parallel --world-size 2 runs it"
    )
    assert compare.why_not_run("pipeline", 1, 1, problem_at) == (
        "needs 2 GPUs, 1 visible (1 rank: pipeline refuses 1)"
    )
    assert (
        compare.why_not_run("odd", 1, 1, problem_at) == "fits no world size up to 8 (1 rank: odd refuses 1)"
    )
    assert compare.why_not_run("odd", 6, 6, problem_at).startswith("fits no world size up to 12 ")


ONE_GPU_PIPELINE = "needs 2 GPUs, 1 visible (1 rank: 1 ranks with --dp 1 leave 1 rank per pipeline: a pipeline needs 2 or more)"


def test_on_one_gpu_compare_runs_every_impl_that_fits_and_says_why_not_the_others(monkeypatch, capsys):
    """The most common GPU machine: every impl but pipeline runs at world size 1; pipeline is listed with
    its own reason and the GPUs it needs (it was: "no world size up to 1 GPUs fits every impl", nothing
    run)."""
    import distref.cli

    available = impl_folders.discover(ROOT / "impls")
    chosen = ["single", "ddp", "fsdp", "deepspeed_zero", "model_parallel", "pipeline", "dataparallel"]
    monkeypatch.setattr(compare, "cuda_gpus", lambda: (1, "1 × a GPU"))
    assert compare.default_world(available, chosen, LENET) == (1, [("pipeline", ONE_GPU_PIPELINE)])
    assert capsys.readouterr().out == "compare: world size 1, one rank per GPU of 1 × a GPU\n"
    # On the GPU machine itself, 2 ranks of a workload that fits are refused for the GPU count alone
    # (distref.cli.gpus_problem): that still reads as "needs 2 GPUs".
    monkeypatch.setattr(distref.cli, "uses_cuda", lambda cfg: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    pipeline = available["pipeline"]["train"]
    assert ranks.workload_problem(pipeline, LENET, 2).startswith("2 ranks on this machine need a CUDA device")
    assert compare.default_world(available, chosen, LENET) == (1, [("pipeline", ONE_GPU_PIPELINE)])


def test_on_two_or_three_gpus_every_impl_runs_at_the_count_they_all_fit(monkeypatch, capsys):
    """2 GPUs: every impl at 2. 3 GPUs and gpt: a batch of 48 splits in 3, but tensor_parallel's 4 heads
    do not: every impl runs at 2 rather than all but tensor_parallel and context_parallel at 3, and the line
    says why not 3."""
    available = impl_folders.discover(ROOT / "impls")
    monkeypatch.setattr(compare, "cuda_gpus", lambda: (2, "2 × a GPU"))
    lenet_impls = [impl for impl, info in available.items() if not info["models"]]
    assert compare.default_world(available, lenet_impls, LENET) == (2, [])
    assert capsys.readouterr().out == "compare: world size 2, one rank per GPU of 2 × a GPU\n"
    monkeypatch.setattr(compare, "cuda_gpus", lambda: (3, "3 × a GPU"))
    gpt = ["--model", "gpt", "--dataset", "synthetic", "--global-batch-size", "48"]
    chosen, _ = compare.made_for_the_model(available, list(available), gpt)  # (expert_parallel: not dense)
    assert compare.default_world(available, chosen, gpt) == (2, [])
    assert capsys.readouterr().out == (
        "compare: world size 2, one rank per GPU of 3 × a GPU; not more: 3 ranks: context_parallel: --cp 3 "
        "with ring attention splits each sequence into 2 × 3 = 6 chunks (the load balanced causal split): "
        "the sequence's 16 tokens must divide by 6 (--sequence-length); tensor_parallel: --tp 3 must divide "
        "gpt's 4 attention heads and its MLP's 256 units\n"
    )


def test_a_workload_only_cuda_runs_is_fitted_on_the_gpus(monkeypatch):
    """fp16 needs CUDA: asked on a GPU machine (faked), the counts are judged with the run's own device."""
    import distref.cli

    monkeypatch.setattr(distref.cli, "uses_cuda", lambda cfg: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = ["--dataset", "synthetic", "--precision", "fp16", "--global-batch-size", "16"]
    assert ranks.fitting_world_size(ROOT / "impls" / "ddp" / "train.py", args, 2)[0] == 2
