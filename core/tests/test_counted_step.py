"""The counted step: a session's third, the first steady one (issue 55). A session of fewer steps counts
none and its record says why; the report, `plan --validate` and the GPU check then say "not counted"
rather than compare, and a record from before the rule, whose counted step was a first or second one
(DDP's rebuilt buckets, ZeRO-3's trace check: broadcasts no formula has), is read the same way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distref import plan
from distref.record import not_counted
from distref.report import communication_cells, formula_differences, memory_cells
from distref.training.traffic import Traffic

RUN = ["--model", "gpt", "--dataset", "synthetic", "--global-batch-size", "16", "--optimizer", "sgd"]


@pytest.mark.parametrize(
    ("start", "n_steps", "counted", "why"),
    [
        (0, 5, 2, None),
        (4, 10, 6, None),
        (0, 3, 2, None),
        (0, 2, None, "a session of 2 steps: a session's third step is the one counted, its first steady one"),
        (0, 1, None, "a session of 1 step: a session's third step is the one counted, its first steady one"),
        (
            8,
            10,
            None,
            "a session of 2 steps: a session's third step is the one counted, its first steady one",
        ),
        # (resumed at its last step: none left)
        (4, 4, None, "a session of 0 steps: a session's third step is the one counted, its first steady one"),
    ],
)
def test_a_session_counts_its_third_step_or_none_saying_why(start, n_steps, counted, why):
    traffic = Traffic()
    traffic.session_starts(start, n_steps)
    for step in range(start, n_steps):
        traffic.step_starts(step)
    traffic.stop_counting()
    summary = traffic.summary()
    assert (summary["step"], summary["not_counted"]) == (counted, why)
    assert ("step" in summary["phases"]) == (counted is not None)


@pytest.fixture(scope="module")
def two_steps(single_train, tmp_path_factory) -> dict:
    """single's record of a 2-step session (a checkpoint at its end, resumed by the tests)."""
    out = tmp_path_factory.mktemp("two-steps")
    checkpoints = ["--checkpoint-dir", str(out / "ckpt"), "--checkpoint-every", "2"]
    single_train.main([*RUN, "--steps", "2", "--out", str(out), *checkpoints])
    return json.loads((out / "record.json").read_text())


def test_a_two_step_session_is_recorded_not_counted_and_not_compared(two_steps, tmp_path):
    """No communication or activations measured, and why; the report's cells say "not counted" (the
    activations' said "exact" over nothing) and differ from no formula; plan --validate does not compare."""
    communication = two_steps["communication"]
    assert communication["step"] is None and communication["measured"] == [None]
    assert (
        communication["not_counted"]
        == "a session of 2 steps: a session's third step is the one counted, its first steady one"
    )
    assert two_steps["activation_bytes"]["measured"] == [None]
    said = f"not counted ({communication['not_counted']})"
    assert communication_cells(two_steps) == ["not counted", "—", said]
    assert memory_cells(two_steps)[1:] == ["exact", "—", said]
    assert formula_differences(two_steps) == {}
    result = plan.validate_run(two_steps)
    assert result["not_counted"] == communication["not_counted"]
    assert result["communication_bus_bytes"][0] is None and result["activations"][0] is None
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "record.json").write_text(json.dumps(two_steps))
    line = plan.render_validation(plan.validate([tmp_path / "run"])).splitlines()[1]
    assert f"activations not counted; communication not counted ({communication['not_counted']});" in line


def test_a_record_from_before_the_rule_is_not_compared_on_its_second_step(two_steps):
    """A 2-step ZeRO-3 record of before: step 1 counted, with DeepSpeed's trace-check broadcasts, and no
    prediction (its formula is the third step's). Neither the report nor the plan sets it beside one."""
    record = json.loads(json.dumps(two_steps))
    del record["communication"]["not_counted"]
    record["communication"]["step"] = 1
    record["communication"]["measured"] = [{"broadcast": {"calls": 6, "bytes": 504, "bus_bytes": 504.0}}]
    record["communication"]["predicted"] = [{}]
    why = "step 1, its session's second, is not a steady one: a session's third is"
    assert not_counted(record) == why
    assert communication_cells(record)[2] == f"not counted ({why})" and formula_differences(record) == {}
    result = plan.validate_run(record)
    assert result["not_counted"] == why and result["communication_bus_bytes"][0] is None
    record["communication"]["step"] = 2  # (a session's third: counted, and compared)
    assert not_counted(record) is None
    assert formula_differences(record) == {
        "communication": "**differs** (measured − formula): rank 0 broadcast +6 calls, +504 B"
    }


def test_a_resume_with_no_steps_left_is_skipped_by_the_plan(single_train, two_steps, tmp_path):
    """Resumed at its last step: the session measures nothing (no model states, no counted step). The plan
    skips it in one line (it failed: "its model_state_bytes holds 0 ranks"); the report shows nothing
    measured, not "exact"."""
    checkpoint = Path(two_steps["config"]["checkpoint_dir"]) / "step-00000002.pt"
    out = tmp_path / "resumed"
    single_train.main([*RUN, "--steps", "2", "--resume", str(checkpoint), "--out", str(out)])
    record = json.loads((out / "record.json").read_text())
    assert plan.validate_run(record) == {
        "impl": "single",
        "skipped": "resumed at step 2 with no steps left: this session measured nothing",
    }
    why = (
        "not counted (a session of 0 steps: a session's third step is the one counted, its first steady one)"
    )
    assert memory_cells(record)[1:] == ["—", "—", why]
