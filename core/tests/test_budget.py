"""ci/budget.py, the lines .ci/run ends with: the minutes of its budget, what the change added, a warning
above the budget and never a failure."""

import importlib.util
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_budget():
    spec = importlib.util.spec_from_file_location("ci_budget", ROOT / "ci" / "budget.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_budget_names_the_new_and_grown_tests_and_warns_above_twelve_minutes():
    budget = load_budget()
    before = {"a.py::test_old": 2.0, "a.py::test_grown": 1.0}
    now = {"a.py::test_old": 2.5, "a.py::test_grown": 30.0, "a.py::test_new": 40.0, "a.py::test_tiny": 0.1}
    lines = budget.report(now, before, minutes=13.5)
    assert lines[0] == "budget: .ci/run took 13.5 of its 12 minutes (112%)"
    assert "budget: 2 test(s) new since ci/test-durations.json, 40 s; the slowest:" in lines
    assert lines.index("    40.0 s  a.py::test_new") < lines.index("     0.1 s  a.py::test_tiny")
    assert "  + 29.0 s  a.py::test_grown (1.0 -> 30.0 s)" in lines  # (test_old grew 0.5 s: not listed)
    assert not any("test_old" in line for line in lines)
    assert lines[-1].startswith("budget: WARNING: 13.5 min is over the 12-minute budget")
    assert not any("WARNING" in line for line in budget.report(now, before, minutes=11.0))


def test_the_command_says_the_minutes_since_the_start_and_exits_0(tmp_path, capsys):
    durations = tmp_path / "durations.json"
    durations.write_text(json.dumps({"a.py::test_x": 1.0}))
    load_budget().main(["--started", str(time.time() - 60), "--durations", str(durations)])
    assert capsys.readouterr().out.startswith("budget: .ci/run took 1.0 of its 12 minutes (8%)")


def test_every_test_in_the_baseline_exists_in_the_suite_s_files():
    """ci/test-durations.json names tests by node id: each file it names is there (a renamed file would
    make every test in it look new)."""
    baseline = json.loads((ROOT / "ci" / "test-durations.json").read_text())
    files = {nodeid.split("::")[0] for nodeid in baseline}
    assert files and all((ROOT / f).is_file() for f in files), sorted(
        f for f in files if not (ROOT / f).is_file()
    )
