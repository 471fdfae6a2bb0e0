"""ci/mutants.toml stays applicable: `nox -s mutants` only finds out when it runs (minutes), after the code
a mutant edits has moved on (two went stale that way when --precision fp64 changed their lines)."""

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MUTANTS = tomllib.loads((ROOT / "ci" / "mutants.toml").read_text())["mutant"]


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m["name"] for m in MUTANTS])
def test_each_mutant_edits_one_place_and_names_tests_that_exist(mutant):
    assert (ROOT / mutant["file"]).read_text().count(mutant["find"]) == 1, "update its `find` with the code"
    for test in mutant["tests"]:
        path, _, name = test.partition("::")
        source = (ROOT / path).read_text()
        assert not name or f"def {name.split('[')[0]}(" in source, f"{test}: no such test"
