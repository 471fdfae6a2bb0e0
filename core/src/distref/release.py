"""Impl versions that cannot drift: a recorded hash per released version.

Each impls/<impl>/release.json records the version last released and a sha256 over the files that
define the impl's behaviour: every file of the folder except tests/, README.md, CHANGELOG.md and
release.json itself, with pyproject.toml's `version = ` line left out. A test fails when those files
change and release.json does not follow; this command makes it follow, and only after a version bump:

    # edit impls/ddp/train.py ... then:
    #   bump `version` in impls/ddp/pyproject.toml and add a `## <version>` entry to its CHANGELOG.md
    python -m distref.release ddp

Documentation (README, CHANGELOG) and tests may change without a release. The shared core has its own
version (core/pyproject.toml), which every run record also carries.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import tomllib
from pathlib import Path

NOT_BEHAVIOUR = {"README.md", "CHANGELOG.md", "release.json"}
SKIP_DIRS = {"tests", "__pycache__", ".pytest_cache"}


def versioned_files(directory: Path) -> list[Path]:
    """The files git would version under `directory`: tracked, or untracked and not ignored. Build
    outputs (the `*.egg-info/` that `pip install -e impls/<x>` writes, caches) are not the impl. Outside
    a git checkout: every file but those build outputs."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "."],
            cwd=directory,
            capture_output=True,
            check=True,
        ).stdout.decode()
        files = [directory / name for name in listed.split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        files = [p for p in directory.rglob("*") if not any(part.endswith(".egg-info") for part in p.parts)]
    return sorted(p for p in files if p.is_file())  # tracked but deleted in the work tree: gone


def behaviour_files(impl_dir: Path) -> list[Path]:
    files = []
    for path in versioned_files(impl_dir):
        relative = path.relative_to(impl_dir)
        if not SKIP_DIRS & set(relative.parts) and relative.name not in NOT_BEHAVIOUR:
            files.append(path)
    return files


def behaviour_hash(impl_dir: Path) -> str:
    digest = hashlib.sha256()
    for path in behaviour_files(impl_dir):
        text = path.read_bytes()
        if path.name == "pyproject.toml":  # the version itself is not behaviour
            text = re.sub(rb"(?m)^version\s*=.*$", b"", text)
        digest.update(str(path.relative_to(impl_dir)).encode() + b"\0" + text + b"\0")
    return digest.hexdigest()


def declared_version(impl_dir: Path) -> str:
    with open(impl_dir / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["version"]


def changelog_has(impl_dir: Path, version: str) -> bool:
    changelog = (impl_dir / "CHANGELOG.md").read_text()
    return re.search(rf"(?m)^## {re.escape(version)}\b", changelog) is not None


def problems(impl_dir: Path) -> list[str]:
    """What is wrong with the impl's release state (empty when released and unchanged)."""
    name = impl_dir.name
    lock_path = impl_dir / "release.json"
    if not lock_path.exists():
        return [f"impls/{name} has no release.json: run `python -m distref.release {name}`"]
    lock = json.loads(lock_path.read_text())
    version = declared_version(impl_dir)
    found = []
    if not changelog_has(impl_dir, version):
        found.append(f"impls/{name}/CHANGELOG.md has no `## {version}` entry")
    if behaviour_hash(impl_dir) != lock["sha256"]:
        if version == lock["version"]:
            found.append(
                f"impls/{name} changed since {version} was released: bump its version in pyproject.toml, "
                f"add a CHANGELOG entry, then run `python -m distref.release {name}`"
            )
        else:
            found.append(f"impls/{name} {version} is not recorded: run `python -m distref.release {name}`")
    elif version != lock["version"]:
        found.append(
            f"impls/{name}: pyproject says {version}, release.json {lock['version']} (files unchanged)"
        )
    return found


def release(impl_dir: Path) -> dict:
    version = declared_version(impl_dir)
    lock_path = impl_dir / "release.json"
    current = behaviour_hash(impl_dir)
    if lock_path.exists():
        lock = json.loads(lock_path.read_text())
        if lock["sha256"] != current and lock["version"] == version:
            raise SystemExit(
                f"distref.release: error: impls/{impl_dir.name} changed but is still {version}: "
                "bump the version in its pyproject.toml first"
            )
    if not changelog_has(impl_dir, version):
        raise SystemExit(
            f"distref.release: error: add a `## {version}` entry to impls/{impl_dir.name}/CHANGELOG.md"
        )
    lock = {
        "version": version,
        "sha256": current,
        "files": [str(p.relative_to(impl_dir)) for p in behaviour_files(impl_dir)],
    }
    lock_path.write_text(json.dumps(lock, indent=1) + "\n")
    return lock


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m distref.release", description=__doc__.splitlines()[0])
    parser.add_argument("impls", nargs="+")
    parser.add_argument("--impls-dir", default="impls")
    args = parser.parse_args(argv)
    for name in args.impls:
        lock = release(Path(args.impls_dir) / name)
        print(
            f"impls/{name} {lock['version']}: recorded {lock['sha256'][:12]} over {len(lock['files'])} file(s)"
        )


if __name__ == "__main__":
    main()
