"""Where the running code comes from: its git commit. The standard library only, so that
`python -m distref.export` runs without torch (the run record imports it from here too)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_sha() -> str | None:
    """The commit of the checkout this file is in, or None outside git (a tarball, an export)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=5
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
