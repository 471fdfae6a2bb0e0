"""python -m distref.plan --validate on a record of every impl, in each of its forms (one process per part
or --devices, tensor parallelism ×1 or on a 2-D mesh, context parallelism's ring and Ulysses, every ZeRO
stage's kind, --partition, --stages-per-rank, HSDP, offload), in fp32, fp64 and bf16, on this project's models and on models and data of your own: each
is validated against the layout it ran (exactly, where the plan's formulas are exact) or skipped with one
line saying why, never a traceback. The compare runs' records: core/tests/test_report_and_compare.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from distref import plan
from distref.testing import load_train_module
from distref.testing.own import EXAMPLE_DATASET, EXAMPLE_MODEL
from distref.testing.ranks import run_ranks
from distref.testing.runs import train_path

# Models and data of your own, as a user writes them (imported from the folder the runs start in)
YOURS = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset


def blocks():
    """Blocks whose balanced cut into 4 stages ties (the last block but one is the largest part alone):
    the impls take the earliest cuts. BatchNorm's statistics are buffers DDP broadcasts every step."""
    return nn.Sequential(
        nn.Linear(16, 8),
        nn.Linear(8, 16),
        nn.Linear(16, 8),
        nn.Linear(8, 15),
        nn.Sequential(nn.Linear(15, 128), nn.BatchNorm1d(128)),
        nn.Linear(128, 4),
    )


def two_classes():
    """MNIST-shaped images of 2 classes."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 1, 28, 28, generator=g)
    y = (x.mean(dim=(1, 2, 3)) > 0).long()
    return TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])
'''
BASE = ["--steps", "3", "--global-batch-size", "12", "--dataset", "synthetic", "--log-every", "3"]
OWN = ["--model", EXAMPLE_MODEL, "--dataset", EXAMPLE_DATASET]
BLOCKS = ["--model", "yours:blocks", "--dataset", EXAMPLE_DATASET]
GPT = ["--model", "gpt"]
TOP1 = ["--experts", "4", "--top-k", "1"]
# name: (ranks, impl, options, what is planned: "exact" (model states, activations, communication equal to
# the byte, bf16 autocast's included), "no activations" (no formula: a model of yours; the rest exact), "close"
# (DeepSpeed's bf16: the ZeRO paper's bytes, without DeepSpeed's padding), or the reason it is skipped)
RUNS = {
    "single-lenet-2-classes": (1, "single", ["--dataset", "yours:two_classes"], "exact"),
    "single-fp64-yours": (1, "single", [*OWN, "--precision", "fp64"], "no activations"),
    "single-bf16-gpt-text": (
        1,
        "single",
        [*GPT, "--dataset", "text", "--precision", "bf16"],
        "exact",
    ),
    "dataparallel": (1, "dataparallel", [], "nn.DataParallel: one process"),
    "ddp-buffers": (2, "ddp", BLOCKS, "no activations"),
    "ddp-bf16": (2, "ddp", ["--precision", "bf16"], "exact"),
    "ddp-fp64-gpt": (2, "ddp", [*GPT, "--precision", "fp64"], "exact"),
    "model_parallel-partition": (2, "model_parallel", ["--partition", "1"], "exact"),
    "model_parallel-bf16-yours": (2, "model_parallel", [*OWN, "--precision", "bf16"], "no activations"),
    "model_parallel-devices-fp64": (
        1,
        "model_parallel",
        ["--devices", "cpu,cpu", "--precision", "fp64"],
        "exact",
    ),
    "pipeline-zbv-tied-cut": (
        2,
        "pipeline",
        [*BLOCKS, "--schedule", "zbv", "--microbatches", "3"],
        "no activations",
    ),
    "pipeline-partition-fp64": (2, "pipeline", ["--partition", "1", "--precision", "fp64"], "exact"),
    "pipeline-3-stages-per-rank": (
        2,
        "pipeline",
        [
            *GPT,
            "--gpt-layers",
            "4",
            "--schedule",
            "interleaved-1f1b",
            "--stages-per-rank",
            "3",
            "--microbatches",
            "2",
        ],
        "exact",
    ),
    "pipeline-bf16-gpt": (
        2,
        "pipeline",
        [*GPT, "--schedule", "gpipe", "--precision", "bf16"],
        "exact",
    ),
    "deepspeed_zero-stage-0": (2, "deepspeed_zero", ["--zero-stage", "0"], "exact"),
    "deepspeed_zero-bf16": (2, "deepspeed_zero", ["--zero-stage", "3", "--precision", "bf16"], "close"),
    "fsdp-offload-fp64": (2, "fsdp", ["--cpu-offload", "--precision", "fp64"], "exact"),
    "fsdp-bf16": (2, "fsdp", ["--precision", "bf16"], "exact"),  # (its policy's 16-bit parameters)
    "fsdp-bf16-gpt": (2, "fsdp", [*GPT, "--precision", "bf16"], "exact"),
    "fsdp-hsdp-yours": (2, "fsdp", [*OWN, "--hsdp", "2"], "no activations"),
    "tensor_parallel-x1": (1, "tensor_parallel", GPT, "exact"),
    "tensor_parallel-dp-shard-fp64": (
        2,
        "tensor_parallel",
        [*GPT, "--dp-shard", "2", "--precision", "fp64"],
        "exact",
    ),
    "tensor_parallel-bf16": (2, "tensor_parallel", [*GPT, "--precision", "bf16"], "exact"),
    "tensor_parallel-yours": (2, "tensor_parallel", OWN, "tensor parallelism by a tp_plan has no formula"),
    # (--sequence-length: the record's own, not the task's 16 tokens)
    "context_parallel-ring": (2, "context_parallel", [*GPT, "--sequence-length", "32"], "exact"),
    "context_parallel-ulysses-bf16": (
        2,
        "context_parallel",
        [*GPT, "--cp-mode", "ulysses", "--precision", "bf16"],
        "exact",
    ),
    "context_parallel-dp-shard-fp64": (
        2,
        "context_parallel",
        [*GPT, "--dp-shard", "2", "--precision", "fp64"],
        "exact",
    ),
    # (the plan has no activations for a mixture of experts yet; its all-to-alls as the counted step routed)
    "expert_parallel-top2": (2, "expert_parallel", [*GPT, "--experts", "4"], "no activations"),
    "expert_parallel-top1-bf16-checkpointed-accum": (
        2,
        "expert_parallel",
        [*GPT, *TOP1, "--precision", "bf16", "--activation-checkpointing", "--grad-accum", "2"],
        "no activations",
    ),
    "expert_parallel-ep1-fp64": (
        2,
        "expert_parallel",
        [*GPT, "--experts", "2", "--ep", "1", "--precision", "fp64"],
        "no activations",
    ),
}
IN_PROCESS = ("single", "dataparallel")  # (and --devices: one process)


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    """record(name): the folder of RUNS[name]'s run (3 steps, started in a folder holding `yours.py`),
    run the first time it is asked for (a test of one run makes that one alone)."""
    folder = tmp_path_factory.mktemp("validate")
    (folder / "yours.py").write_text(YOURS)
    (folder / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    sys.path.insert(0, str(folder))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def made(name: str) -> Path:
        ranks, impl, options, _ = RUNS[name]
        if not (folder / name / "record.json").is_file():
            text = ["--data-root", str(folder / "text.txt")] if "text" in options else []
            argv = [*BASE, *options, *text, "--out", str(folder / name)]
            if impl in IN_PROCESS or "--devices" in options:
                load_train_module(impl).main(argv)
            else:
                done = run_ranks(ranks, str(train_path(impl)), argv, env=env, timeout=300, cwd=folder)
                assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"
        return folder / name

    yield made
    sys.path.remove(str(folder))


@pytest.mark.parametrize("name", RUNS)
def test_validate_reads_every_impl_s_record(record, name):
    """Planned against what the run measured on its rank 0 (a pipeline's fullest rank), for the layout
    the record says it ran: equal to the byte where the plan's formulas are exact."""
    expected = RUNS[name][3]
    result = plan.validate_run(json.loads((record(name) / "record.json").read_text()))
    if expected not in ("exact", "no activations", "close"):
        assert expected in result["skipped"], result
        return
    assert "skipped" not in result, result
    for quantity in ("model_states", "activations", "communication_bus_bytes"):
        measured, planned = result[quantity]
        if quantity == "activations" and expected == "no activations":
            assert measured > 0 and planned is None, (quantity, result)
        elif expected == "close":
            assert planned == pytest.approx(measured, rel=1e-3), (quantity, result)
        else:
            assert planned == measured, (quantity, result)


def test_the_layout_validated_is_the_run_s(record, capsys):
    """The record's own cut, stages per rank, mesh and one-process form are what is planned, every line
    without a traceback; an option the plan does not model says what the plan took and what the run had."""
    folders = {name: record(name) for name in RUNS}
    capsys.readouterr()  # (what the runs made here said)
    assert plan.main(["--validate", *map(str, folders.values())]) == 0
    lines = {line.split(" ", 1)[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    said = {name: lines[str(folder)] for name, folder in folders.items()}
    assert "(pipeline, pp-1f1b pp2, cut at 1, rank" in said["pipeline-partition-fp64"]
    assert "pp-interleaved-1f1b pp2, 3 stages per rank" in said["pipeline-3-stages-per-rank"]
    assert "(model_parallel, model_parallel pp2, cut at 1, rank 0)" in said["model_parallel-partition"]
    assert "--devices cpu,cpu: one process holds every part" in said["model_parallel-devices-fp64"]
    assert "(tensor_parallel, tp tp1, rank 0)" in said["tensor_parallel-x1"]
    assert "(tensor_parallel, tp dp2×tp1, rank 0)" in said["tensor_parallel-dp-shard-fp64"]
    assert "(deepspeed_zero, zero0 dp2, rank 0)" in said["deepspeed_zero-stage-0"]
    assert "(context_parallel, cp cp2, rank 0)" in said["context_parallel-ring"]
    assert "(context_parallel, cp-ulysses cp2, rank 0)" in said["context_parallel-ulysses-bf16"]
    assert "(context_parallel, cp dp2×cp1, rank 0)" in said["context_parallel-dp-shard-fp64"]
    assert "(planned with cpu_offload=False; the run had cpu_offload=True)" in said["fsdp-offload-fp64"]
    assert "(expert_parallel, ep dp2 (ep 2 × replicate 1), rank 0)" in said["expert_parallel-top2"]
    assert "all-to-alls as the counted step (step 2) routed: rank 0's experts" in said["expert_parallel-top2"]
    assert "(expert_parallel, ep dp2 (ep 1 × replicate 2), rank 0)" in said["expert_parallel-ep1-fp64"]


def test_a_record_whose_data_has_moved_is_skipped_saying_why(record, tmp_path, capsys):
    """The dataset module, or the text file, a record names is gone: that record is skipped with the
    reason in one line, and the others are still validated."""
    moved = {
        "single-lenet-2-classes": {"dataset": "moved_away:two_classes"},
        "single-bf16-gpt-text": {"data_root": str(tmp_path / "moved.txt")},
    }
    for name, change in moved.items():
        recorded = json.loads((record(name) / "record.json").read_text())
        recorded["config"].update(change)
        (tmp_path / name).mkdir()
        (tmp_path / name / "record.json").write_text(json.dumps(recorded))
    runs = [str(tmp_path / name) for name in moved] + [str(record("ddp-bf16"))]
    capsys.readouterr()  # (what the runs made here said)
    assert plan.main(["--validate", *runs]) == 0
    out, err = capsys.readouterr()
    assert not err and len(out.splitlines()) == 4, out
    assert (
        "skipped: its model or data cannot be built here: --dataset moved_away:two_classes: cannot import"
        in out
    )
    assert f"skipped: its model or data cannot be built here: cannot read {tmp_path / 'moved.txt'}" in out
    assert f"{record('ddp-bf16')} (ddp, ddp dp2, rank 0)" in out


def test_an_expert_parallel_run_s_own_routing_sizes_its_all_to_alls(record):
    """One group holding every expert (ep = world): in the counted step rank 0's experts (0 … E/ep − 1)
    received every rank's tokens for them, the record's tokens per expert of those experts, layer by layer;
    planned with them, the all-to-alls are the run's (test_validate_reads_every_impl_s_record). Where
    groups copy the experts (ep < world) the record sums every group's: the plan's uniform routing, said."""
    from distref.plan.layouts import Layout
    from distref.plan.validate import recorded_routing

    recorded = json.loads((record("expert_parallel-top2") / "record.json").read_text())
    counted = recorded["communication"]["step"]
    per_expert = next(row for row in recorded["steps"] if row["step"] == counted)["tokens_per_expert"]
    rows, said = recorded_routing(recorded, Layout("ep", dp=2, ep=2))
    assert len(per_expert) == 2 and rows == (sum(per_expert[0][:2]), sum(per_expert[1][:2]))
    assert (
        said
        == f"all-to-alls as the counted step (step {counted}) routed: rank 0's experts received {sum(rows):,} rows"
    )
    rows, said = recorded_routing(recorded, Layout("ep", dp=4, ep=2))
    assert rows is None and said == (
        "all-to-alls under uniform routing (its tokens per expert sum every group's for the counted step)"
    )
