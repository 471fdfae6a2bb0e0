"""`nox -s faults` prints one table row per fault test: which impl, what is expected of it, what happened."""

import ast
import sys

import pytest

from distref.testing import ROOT, run_script

TEST_FILES = sorted([*ROOT.glob("impls/*/tests/test_*.py"), *ROOT.glob("core/tests/test_*.py")])


def fault_tests():
    for path in TEST_FILES:
        for node in ast.parse(path.read_text()).body:
            marks = [ast.unparse(d) for d in getattr(node, "decorator_list", [])]
            if isinstance(node, ast.FunctionDef) and "pytest.mark.faults" in marks:
                yield pytest.param(node, id=f"{path.relative_to(ROOT)}::{node.name}")


@pytest.mark.parametrize("test", fault_tests())
def test_every_fault_test_states_its_expected_behaviour(test):
    """The table's "expected behaviour" column is the test's docstring: each fault test has one, saying
    more than its name."""
    doc = ast.get_docstring(test)
    assert doc, f"{test.name}: a fault test says in its docstring what it expects"
    assert doc.split("\n\n")[0].strip().lower() != test.name.removeprefix("test_").replace("_", " ")


def test_the_table_names_each_row_s_impl_and_expected_behaviour():
    result = run_script(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-m",
            "faults",
            "core/tests/test_record_and_checkpoint.py::test_checkpoint_write_is_atomic",
        ],
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-2000:]
    assert "| impl | fault test | expected behaviour | outcome | measured |" in result.stdout
    expected = (
        "| core | `test_checkpoint_write_is_atomic` | A crash mid-write (disk full) leaves no file under a "
        "checkpoint's name; the previous one stays the newest. | passed |"
    )
    assert expected in result.stdout, result.stdout[-2000:]


def test_a_row_shows_the_times_measured_not_the_suite_s_own_notes():
    """A fault test's report also carries the suite's notes (it started processes, its CPU seconds): the
    row shows what `measured` recorded (a str among them once broke the table with a ValueError)."""
    from types import SimpleNamespace

    from distref.testing.faults import fault_table
    from distref.testing.timing import CPU_SECONDS, STARTED_PROCESSES

    properties = [("expected", "It ends."), STARTED_PROCESSES, ("job ended after the kill", 0.1)]
    report = SimpleNamespace(
        nodeid="impls/ddp/tests/test_ddp.py::test_x",
        when="call",
        duration=3.0,
        user_properties=[*properties, (CPU_SECONDS, 2.5)],
    )
    rows = fault_table({"passed": [report]})
    assert rows[-1] == "| ddp | `test_x` | It ends. | passed | job ended after the kill 0.1 s |"
