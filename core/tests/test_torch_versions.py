"""What the packages declare of torch is true: `python train.py --nproc-per-node N` works with a torchrun
that lacks the options a newer torch added (torch 2.11's has no --shutdown-timeout: every rank launch
ended "unrecognized arguments" there)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from torch.distributed.run import get_args_parser

ROOT = Path(__file__).resolve().parents[2]


def torchrun_parser_without(option: str) -> argparse.ArgumentParser:
    """torch 2.13's torchrun parser less `option`: what an older torch's parser is to the launcher."""
    parser = get_args_parser()
    for action in [a for a in parser._actions if option in a.option_strings]:
        parser._remove_action(action)
        for name in action.option_strings:
            del parser._option_string_actions[name]
    with pytest.raises(SystemExit):  # (it is gone: argparse refuses it)
        parser.parse_args([f"{option}=5", "train.py"])
    # torch 2.13's run() reads the value still: the default is what an older torch, without it, does
    parser.set_defaults(**{option.lstrip("-").replace("-", "_"): None})
    return parser


def launched_config(monkeypatch, parser_factory) -> object:
    """What launch_ranks hands torch's elastic agent (captured there: no rank starts)."""
    import torch.distributed.run as torch_run

    from distref.config import Launch, RunConfig
    from distref.distributed import launch_ranks

    launched = []
    monkeypatch.setattr(torch_run, "get_args_parser", parser_factory)

    def elastic_launch(config, entrypoint):
        launched.append(config)
        return lambda *args: {}

    monkeypatch.setattr(torch_run, "elastic_launch", elastic_launch)
    monkeypatch.setattr(torch.multiprocessing, "_set_thread_name", lambda name: None)  # run() renames us
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(SystemExit) as exit_:
        launch_ranks("train.py", ["--steps", "2"], RunConfig(launch=Launch(2, 0)), "x")
    assert exit_.value.code == 0
    (config,) = launched
    return config


def test_the_launcher_passes_only_the_options_this_torchs_torchrun_has(monkeypatch):
    from distref.distributed.launch import SHUTDOWN_TIMEOUT_S

    assert launched_config(monkeypatch, get_args_parser).shutdown_timeout == SHUTDOWN_TIMEOUT_S
    older = launched_config(monkeypatch, lambda: torchrun_parser_without("--shutdown-timeout"))
    assert older.nproc_per_node == 2 and older.shutdown_timeout != SHUTDOWN_TIMEOUT_S  # torch's default


def test_the_planner_says_in_one_line_when_torch_is_too_old_to_plan(monkeypatch, capsys):
    """The planner reads pipeline actions as letters (torch 2.11's; 2.9 and 2.10 number them): there it
    says so, exit 1, instead of a traceback from inside a schedule."""
    import enum

    import torch.distributed.pipelining.schedules as schedules

    from distref.plan.cli import main

    class NumberedActions(enum.Enum):  # torch 2.9-2.10's _ComputationType
        FORWARD = 1
        FULL_BACKWARD = 2

    monkeypatch.setattr(schedules, "_ComputationType", NumberedActions)
    assert main(["--model", "gpt", "--gpus", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"python -m distref.plan: error: the planner needs torch 2.11 or later (its pipeline schedules and DTensor); this is {torch.__version__}"
    )


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def oldest_torch_for(files, apis, floor: str = "2.0") -> tuple[str, list[str]]:
    """The newest `first` of the APIs the files use (at least `floor`), and which decide it."""
    text = "\n".join(f.read_text() for f in files)
    used = [api for api in apis if api["find"] in text]
    newest = max([floor, *(api["first"] for api in used)], key=version)
    return newest, [api["find"] for api in used if api["first"] == newest]


def test_each_package_declares_the_oldest_torch_its_code_runs_on():
    """Every pyproject's `torch>=` is the newest first release among the APIs its code uses
    (ci/torch_floor.toml, read off torch's released sources and run on them: docs/environment.md): an
    impl's own files and core's training path, which it imports. The planner's files apart: it checks."""
    import tomllib

    from distref import declared_torch
    from distref.plan.cli import PLANNER_TORCH

    apis = tomllib.loads((ROOT / "ci" / "torch_floor.toml").read_text())["api"]
    src = ROOT / "core" / "src" / "distref"
    planner = [*(src / "plan").rglob("*.py"), src / "simulate.py"]
    # torch.distributed.pipelining's side of core: imported by the impls that run a pipeline (and the
    # planner), so its APIs count for those, not for core's training path
    pipelining = src / "distributed" / "stages.py"
    training = [f for f in src.rglob("*.py") if f not in planner and f != pipelining]
    core_floor, why = oldest_torch_for(training, apis)
    assert declared_torch(ROOT / "core") == core_floor, why
    assert oldest_torch_for([*planner, pipelining], apis, core_floor)[0] == PLANNER_TORCH
    for impl in sorted(p.parent for p in (ROOT / "impls").glob("*/train.py")):
        files = [*impl.glob("*.py")]
        if "distref.distributed.stages" in (impl / "train.py").read_text():
            files.append(pipelining)
        needed, why = oldest_torch_for(files, apis, core_floor)
        assert declared_torch(impl) == needed, f"{impl.name}: {needed} for {why}"
