"""CI's time budget, said at the end of `.ci/run`: the minutes it took of its 12, and what the change added.

    python ci/budget.py --started EPOCH_SECONDS --durations runs/test-durations.json
    python ci/budget.py --durations runs/test-durations.json --update   # make it the new baseline

The suite writes each test's seconds (setup + call + teardown) to --durations (conftest.py, where
DISTREF_TEST_DURATIONS names the file). This compares them with ci/test-durations.json, the suite as it
was when the budget was last measured (docs/testing.md): the slowest tests that are new since then, and
those that grew the most. Above the budget it warns, and never fails: the machine is shared, and a slow
run on a busy one is not a defect of the change. A change whose tests push a quiet machine past the budget
is (DEVELOPERS.md): the lines say which tests to look at.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "ci" / "test-durations.json"
BUDGET_MIN = 12.0
SHOWN = 8


def read(path: Path) -> dict[str, float]:
    return json.loads(path.read_text()) if path.is_file() else {}


def report(now: dict[str, float], before: dict[str, float], minutes: float | None) -> list[str]:
    """The lines .ci/run ends with."""
    lines = []
    if minutes is not None:
        lines.append(
            f"budget: .ci/run took {minutes:.1f} of its {BUDGET_MIN:g} minutes ({minutes / BUDGET_MIN:.0%})"
        )
    lines.append(
        f"budget: the tests summed {sum(now.values()) / 60:.1f} min over {len(now)} tests (3 at a time)"
    )
    new = sorted(((s, t) for t, s in now.items() if t not in before), reverse=True)
    if new:
        lines.append(
            f"budget: {len(new)} test(s) new since ci/test-durations.json, {sum(s for s, _ in new):.0f} s; the slowest:"
        )
        lines += [f"  {s:6.1f} s  {t}" for s, t in new[:SHOWN]]
    grown = sorted(((now[t] - before[t], t) for t in now.keys() & before.keys()), reverse=True)
    grown = [(d, t) for d, t in grown[:SHOWN] if d >= 5.0]
    if grown:
        lines.append("budget: grown the most since then:")
        lines += [f"  +{d:5.1f} s  {t} ({before[t]:.1f} -> {now[t]:.1f} s)" for d, t in grown]
    if minutes is not None and minutes > BUDGET_MIN:
        lines.append(
            f"budget: WARNING: {minutes:.1f} min is over the {BUDGET_MIN:g}-minute budget; on a quiet machine that "
            "is a defect of the change that made it (DEVELOPERS.md): look at the tests above"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python ci/budget.py", description=__doc__.splitlines()[0])
    parser.add_argument("--durations", type=Path, required=True, help="the suite's seconds per test (JSON)")
    parser.add_argument("--started", type=float, help="when .ci/run started (seconds since the epoch)")
    parser.add_argument("--update", action="store_true", help="make --durations the baseline")
    args = parser.parse_args(argv)
    now = read(args.durations)
    if args.update:
        BASELINE.write_text(json.dumps({t: round(s, 1) for t, s in sorted(now.items())}, indent=0) + "\n")
        print(f"budget: {BASELINE.relative_to(ROOT)} now holds {len(now)} tests")
        return
    minutes = (time.time() - args.started) / 60 if args.started else None
    for line in report(now, read(BASELINE), minutes):
        print(line)


if __name__ == "__main__":
    main()
