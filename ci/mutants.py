"""Known-bad edits the test suite must catch: `nox -s mutants` (README, "Testing").

Each mutant in ci/mutants.toml is one deliberate bug: a `find` string (it must occur exactly once in
`file`, so a mutant cannot silently stop applying when the code moves) and its `replace`ment, with the
`tests` that must fail on it. For each, the working tree (tracked and untracked-not-ignored files, so
uncommitted changes count) is copied to a temporary folder, the edit applied, and the tests run there
with pytest. The tests first run once on the unmutated copy and must pass: a test that fails anyway
proves nothing about a mutant.

A mutant is *killed* when pytest reports failing tests (exit code 1); a crash, a collection error or a
time-out is reported as such, not as a kill. The session fails if any mutant is not killed.

    python ci/mutants.py                         # all of them, two at a time (--jobs)
    python ci/mutants.py --only ddp-loss-not-averaged --only time-to-target-zero
    python ci/mutants.py --list                  # the table of them (Markdown), for docs/testing.md
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = ROOT / "ci" / "mutants.toml"
TIMEOUT_S = 900


def load_mutants() -> list[dict]:
    with open(MUTANTS, "rb") as f:
        mutants = tomllib.load(f)["mutant"]
    names = [m["name"] for m in mutants]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise SystemExit(f"mutants: duplicate names in {MUTANTS.name}: {sorted(duplicates)}")
    return mutants


def copy_work_tree(dest: Path) -> None:
    """What git would commit from the working tree: tracked files as they are now, plus new ones."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def mutated(mutant: dict, tree: Path) -> str:
    """The text of the mutant's file in `tree` with its edit applied."""
    text = (tree / mutant["file"]).read_text()
    found = text.count(mutant["find"])
    if found != 1:
        raise SystemExit(
            f"mutants: {mutant['name']}: `find` occurs {found} times in {mutant['file']} (must be once): "
            "update ci/mutants.toml with the code"
        )
    return text.replace(mutant["find"], mutant["replace"])


def run_tests(tree: Path, tests: list[str], workers: int = 1) -> tuple[int, str, float]:
    """pytest in `tree`, importing that tree's distref (PYTHONPATH goes before the editable install);
    `workers` > 1: that many at a time (pytest-xdist), and all of them run (no -x)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tree / "core" / "src"), os.environ.get("PYTHONPATH", "")]),
        "DISTREF_DATA": os.environ.get("DISTREF_DATA", str(ROOT / "data")),  # datasets are shared, read-only
        "OMP_NUM_THREADS": "1",
    }
    at_a_time = ["-n", str(workers), "--dist", "worksteal"] if workers > 1 else ["-x"]
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *at_a_time,
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        *tests,
    ]
    start = time.perf_counter()
    try:
        result = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return -1, "", time.perf_counter() - start
    return result.returncode, result.stdout + result.stderr, time.perf_counter() - start


def first_failure(output: str) -> str:
    """The first failing test's name (without its file and parameters) in pytest's short summary."""
    match = re.search(r"^FAILED [^:]+::(\w+)", output, re.MULTILINE)
    return match.group(1) if match else "?"


def mutant_table(mutants: list[dict]) -> str:
    """The mutants as a Markdown table: name, the file it edits, the tests that must kill it."""
    rows = ["| mutant (a deliberate bug) | file | killed by |", "|---|---|---|"]
    for m in mutants:
        tests = ", ".join(f"`{t.split('::')[-1]}`" for t in m["tests"])
        rows.append(f"| `{m['name']}` | `{m['file']}` | {tests} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python ci/mutants.py", description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="run this mutant (repeatable)")
    parser.add_argument("--list", action="store_true", help="print the mutants as a Markdown table and exit")
    parser.add_argument(
        "--jobs", type=int, default=2, help="mutants tested at a time (default: 2, the cores here)"
    )
    args = parser.parse_args(argv)
    mutants = load_mutants()
    if args.list:
        print(mutant_table(mutants))
        return 0
    if args.only:
        unknown = set(args.only) - {m["name"] for m in mutants}
        if unknown:
            parser.error(f"no such mutant: {', '.join(sorted(unknown))} (see --list)")
        mutants = [m for m in mutants if m["name"] in args.only]

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="distref-mutants-") as tmp:
        baseline = Path(tmp) / "baseline"
        copy_work_tree(baseline)
        for m in mutants:  # every edit must still apply before anything runs
            mutated(m, baseline)
        needed = sorted({t for m in mutants for t in m["tests"]})
        print(f"mutants: the {len(needed)} test(s) they name, on the unmutated tree ...", flush=True)
        code, output, seconds = run_tests(baseline, needed, workers=args.jobs + 1)  # (as nox -s tests: 3)
        if code != 0:
            print(output[-5000:])
            print(f"mutants: the tests fail without any mutant (exit {code}): fix them first")
            return 1
        print(f"mutants: unmutated tree passes ({seconds:.0f} s)", flush=True)

        def run_mutant(m: dict) -> tuple[str, str, str, float]:
            tree = Path(tmp) / m["name"]
            shutil.copytree(baseline, tree)
            (tree / m["file"]).write_text(mutated(m, tree))
            code, output, seconds = run_tests(tree, m["tests"])
            shutil.rmtree(tree)
            if code == 1:
                verdict = f"killed by {first_failure(output)}"
            else:
                verdict = {0: "SURVIVED", -1: f"time-out ({TIMEOUT_S} s)"}.get(code, f"error (exit {code})")
            print(f"mutants: {m['name']}: {verdict} ({seconds:.0f} s)", flush=True)
            return m["name"], m["file"], verdict, seconds

        # Each mutant's tests run in a pytest of their own, mostly on one core: --jobs of them at a time
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            rows = list(pool.map(run_mutant, mutants))
        survivors = [name for name, _, verdict, _ in rows if not verdict.startswith("killed")]

    width = max(len(r[0]) for r in rows)
    print(f"\n| {'mutant':<{width}} | file | verdict | s |\n|{'-' * (width + 2)}|---|---|---|")
    for name, file, verdict, seconds in rows:
        print(f"| {name:<{width}} | `{file}` | {verdict} | {seconds:.0f} |")
    print(
        f"\n{len(rows) - len(survivors)} killed, {len(survivors)} not killed ({time.perf_counter() - started:.0f} s)"
    )
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
