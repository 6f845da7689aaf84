"""Which source this textgen runs from (GET /version, /info's `sha`).

A built image has no .git: the Dockerfile takes the commit as a build argument and sets
TEXTGEN_COMMIT (`docker build --build-arg TEXTGEN_COMMIT=$(git rev-parse HEAD) .`). A
source checkout (`make serve`, an editable install) is asked for its HEAD. Otherwise
(an installed wheel without the variable) the commit is unknown.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

COMMIT_ENV = "TEXTGEN_COMMIT"
_SHA = re.compile(r"[0-9a-f]{7,64}")


def source_commit() -> str | None:
    """The commit: TEXTGEN_COMMIT, else the checkout's HEAD; None when unknown."""
    stamped = os.environ.get(COMMIT_ENV, "").strip().lower()
    if stamped:
        return stamped if _SHA.fullmatch(stamped) else None
    # service/ of a checkout sits beside its .git (this file: service/processes/); an
    # installed package has none
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists() or not (root / "pyproject.toml").exists():
        return None
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):  # no git, or not a repository
        return None
    sha = out.stdout.strip()
    return sha if _SHA.fullmatch(sha) else None
