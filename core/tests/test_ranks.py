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
    assert compare.default_world_size(available, chosen, [*LENET, "--device", "cpu"]) == 2
    monkeypatch.setattr(compare, "cuda_gpus", lambda: (8, "8 × a GPU"))
    assert compare.default_world_size(available, chosen, LENET) == 4
    assert (
        "compare: world size 4, one rank per GPU of 8 × a GPU; not more: 8 ranks:" in capsys.readouterr().out
    )
    monkeypatch.setattr(compare, "cuda_gpus", lambda: (3, "3 × a GPU"))
    assert compare.default_world_size(available, ["single", "ddp"], LENET) == 2


def test_a_workload_only_cuda_runs_is_fitted_on_the_gpus(monkeypatch):
    """fp16 needs CUDA: asked on a GPU machine (faked), the counts are judged with the run's own device."""
    import distref.cli

    monkeypatch.setattr(distref.cli, "uses_cuda", lambda cfg: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = ["--dataset", "synthetic", "--precision", "fp16", "--global-batch-size", "16"]
    assert ranks.fitting_world_size(ROOT / "impls" / "ddp" / "train.py", args, 2)[0] == 2
