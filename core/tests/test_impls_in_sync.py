"""Each impl's train.py is impls/single/train.py plus its strategy, and every change is marked.

Like accelerate's `by_feature` examples: diffing an impl against the baseline must show only the strategy.
Every hunk of that diff (outside the module docstring and the imports) has to carry the impl's marker
comment, `# --- <MARKER>` (the `marker` in its pyproject's [tool.distref]), on one of its lines or on one
of the 3 lines around it. An unmarked change, say a fix made in single and forgotten in ddp, fails here.
"""

import difflib
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASELINE = ROOT / "impls" / "single" / "train.py"
IMPLS = sorted(p.parent.name for p in (ROOT / "impls").glob("*/train.py") if p.parent.name != "single")
CONTEXT = 3


def body(path: Path) -> list[str]:
    """The file from its `IMPL = ` line on (docstring and imports are expected to differ)."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("IMPL = "))
    return lines[start + 1 :]


def marker(impl: str) -> str:
    with open(ROOT / "impls" / impl / "pyproject.toml", "rb") as f:
        return "# --- " + tomllib.load(f)["tool"]["distref"]["marker"]


def unmarked_hunks(baseline: list[str], variant: list[str], mark: str) -> list[str]:
    problems = []
    matcher = difflib.SequenceMatcher(a=baseline, b=variant, autojunk=False)
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            continue
        changed = [line for line in baseline[a0:a1] + variant[b0:b1] if line.strip()]
        if not changed:
            continue  # blank lines only
        window = variant[max(0, b0 - CONTEXT) : max(b1, b0 + 1) + CONTEXT]
        if not any(mark in line for line in window):
            removed = "\n".join(f"- {line}" for line in baseline[a0:a1])
            added = "\n".join(f"+ {line}" for line in variant[b0:b1])
            problems.append(f"unmarked change near variant line {b0 + 1}:\n{removed}\n{added}")
    return problems


@pytest.mark.parametrize("impl", IMPLS)
def test_every_change_against_single_is_marked(impl):
    problems = unmarked_hunks(body(BASELINE), body(ROOT / "impls" / impl / "train.py"), marker(impl))
    assert not problems, "\n\n".join(problems)


def test_the_check_catches_an_unmarked_change():
    baseline = ["a = 1", "b = 2", "c = 3"]
    assert unmarked_hunks(baseline, ["a = 1", "b = 3", "c = 3"], "# --- X")
    assert not unmarked_hunks(baseline, ["a = 1", "b = 3  # --- X: why", "c = 3"], "# --- X")
    assert not unmarked_hunks(baseline, ["a = 1", "# --- X: why", "x = 0", "b = 2", "c = 3"], "# --- X")
