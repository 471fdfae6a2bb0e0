"""The tools use of each train.py only what it declares ([tool.distref] tools_call in its pyproject.toml,
distref.impl_folders.TrainAPI), and patch nothing of what it builds.

distref.simulate and distref.plan run an impl's own functions (its apply_*, mesh and stage functions); a
train.py is a script users copy and change, so the functions they may rely on are a list the impl keeps,
and a tool reaching past it fails at once instead of depending on it unseen.
"""

import ast
import tomllib
from pathlib import Path

import pytest

from distref.impl_folders import TrainAPI, load_train_api

ROOT = Path(__file__).resolve().parents[2]
IMPLS = sorted(p.parent.name for p in (ROOT / "impls").glob("*/train.py"))
CORE = ROOT / "core" / "src" / "distref"
TOOLS = [CORE / "simulate.py", CORE / "impl_folders.py", *sorted((CORE / "plan").glob("*.py"))]
# Attribute assignments the tools make, each on an object of their own or through a declared hook.
ALLOWED_ASSIGNMENTS = {
    # every impl sets it on the model it builds: the simulated model is the tool's own
    ("simulate.py", "model.activation_checkpointing"),
    # the stage's part in the warm-up vote, through apply_pipeline's declared `wrap_stage` hook (docstring)
    ("simulate.py", "stage._warmup_forward_vote"),
    ("simulate.py", "stage._warmup_backward_result"),
    # puts back what DeepSpeed's ZeRO-3 replaced for the whole process (run_deepspeed_zero says why)
    ("simulate.py", "torch.nn.functional.linear"),
    # puts back the hook each process group wraps again (order_world says why)
    ("costing.py", "sys.excepthook"),
    # skips, then puts back, torch's lowering of a schedule's order to its sends and receives, which the plan
    # does not read (compute_order_only says why: nine tenths of a plan's time); `pipeline_order`, what it
    # reads, is the impl's own (test_plan's schedule tests compare it with impls/pipeline's)
    ("costing.py", "_PipelineScheduleRuntime._prepare_schedule_with_comms"),
}


def declared(impl: str) -> list[str]:
    with open(ROOT / "impls" / impl / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["distref"]["tools_call"]


@pytest.mark.parametrize("impl", IMPLS)
def test_each_impl_defines_what_it_declares_and_its_parse_options(impl):
    api = load_train_api(ROOT / "impls" / impl / "train.py")
    assert "parse_options" in declared(impl)  # compare, parity and ranks parse every impl's command line
    for name in declared(impl):
        assert getattr(api, name) is not None


def test_an_undeclared_name_is_refused_naming_the_list():
    api = load_train_api(ROOT / "impls" / "pipeline" / "train.py")
    with pytest.raises(
        AttributeError, match=r"does not declare 'evaluate_stages' for the tools: they may use only"
    ):
        api.evaluate_stages  # noqa: B018 (a function of train.py's own, not declared)
    assert api.declares("apply_pipeline") and not api.declares("main")


def used_on_train_modules(tree: ast.AST, tool: str) -> set[str]:
    """Names a tool reads off a train.py: X of `api.X` for every name bound to load_train_api(...) or
    pipeline_impl() (simulate's runners take it as `module`), of `pipeline_impl().X`, and getattr's."""
    apis = {"module"} if tool == "simulate.py" else set()
    for node in ast.walk(tree):
        loads = isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
        if loads and getattr(node.value.func, "id", None) in ("load_train_api", "pipeline_impl"):
            apis |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            value = node.value
            if isinstance(value, ast.Name) and value.id in apis:
                used.add(node.attr)
            if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "pipeline_impl":
                used.add(node.attr)
    return used - {"declares"}


def test_the_tools_use_only_declared_names():
    """simulate and plan read off a train.py only names some impl declares (TrainAPI checks the impl's own
    list when they run), load train.py files only through TrainAPI, and simulate's options classes are
    declared by their impls."""
    from distref.simulate import OPTIONS_CLASS

    every = {name for impl in IMPLS for name in declared(impl)}
    for tool in TOOLS:
        source = tool.read_text()
        assert tool.name == "impl_folders.py" or "load_train_module" not in source, tool
        undeclared = used_on_train_modules(ast.parse(source), tool.name) - every
        assert not undeclared, f"{tool.name} uses {undeclared} of a train.py, which no impl declares"
    for impl, options_class in OPTIONS_CLASS.items():
        assert options_class in declared(impl)


def test_the_tools_patch_nothing_of_what_an_impl_builds():
    """No monkey-patching in the tools: no unittest.mock, no setattr, and, where they run a train.py's
    functions, no attribute set on anything but their own objects (ALLOWED_ASSIGNMENTS says which and why)."""
    for tool in TOOLS:
        tree = ast.parse(tool.read_text())
        runs_impls = "load_train_api(" in tool.read_text() and tool.name != "impl_folders.py"
        for node in ast.walk(tree):
            assert not (isinstance(node, ast.Name) and node.id == "setattr"), tool.name
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [alias.name for alias in node.names] + [getattr(node, "module", None) or ""]
                assert not any("mock" in name for name in names), tool.name
            if runs_impls and isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Attribute) and not (
                        isinstance(target.value, ast.Name) and target.value.id == "self"
                    ):
                        assert (tool.name, ast.unparse(target)) in ALLOWED_ASSIGNMENTS, (
                            tool.name,
                            ast.unparse(target),
                        )


def test_train_api_is_what_parse_as_uses():
    """compare, parity and ranks parse a command line through the impl's declared parse_options."""
    from distref.impl_folders import parse_as

    cfg = parse_as(
        ROOT / "impls" / "pipeline" / "train.py", ["--dataset", "synthetic", "--schedule", "zbv"], 2
    )
    assert cfg.strategy.schedule == "zbv" and cfg.strategy.stages_per_rank == 2  # resolved: zbv's V
    assert isinstance(load_train_api(ROOT / "impls" / "single" / "train.py"), TrainAPI)


def test_an_impl_that_declares_no_parse_options_is_refused_in_one_line(tmp_path):
    """compare, parity and ranks parse an impl's command line through its declared parse_options: an impl
    folder whose pyproject.toml lists none is named, with where to list it."""
    from distref.impl_folders import parse_as

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "pyproject.toml").write_text('[project]\nname = "mine"\nversion = "0.1.0"\n')
    (tmp_path / "mine" / "train.py").write_text("def parse_options(argv, world_size):\n    return None\n")
    with pytest.raises(SystemExit) as refused:
        parse_as(tmp_path / "mine" / "train.py", [], 1)
    assert "declares no parse_options(argv, world_size) for the tools" in str(refused.value)
    assert "[tool.distref] tools_call" in str(refused.value)
