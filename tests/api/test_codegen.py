"""Generated code is committed; regenerating it from api/ must change nothing, and
the contract must pass `buf lint`."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GENERATED = ["service/proto", "sdk/_generated", "envoy/textgen.binpb"]
BUF = REPO / ".tools" / "node_modules" / ".bin" / "buf"

pytestmark = pytest.mark.server  # codegen and buf run as subprocesses


def _diff(a: Path, b: Path) -> list[str]:
    if a.is_file():
        return [] if filecmp.cmp(a, b, shallow=False) else [str(a)]
    cmp = filecmp.dircmp(a, b, ignore=["__pycache__"])
    out = [f"{a}/{n} (only committed)" for n in cmp.left_only]
    out += [f"{a}/{n} (only regenerated)" for n in cmp.right_only]
    _, mismatch, errors = filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)
    out += [f"{a}/{n}" for n in mismatch + errors]
    for sub in cmp.common_dirs:
        out += _diff(a / sub, b / sub)
    return out


@pytest.mark.timeout(120)
def test_generated_code_is_up_to_date(tmp_path):
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "codegen.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    drift = [d for rel in GENERATED for d in _diff(REPO / rel, tmp_path / rel)]
    assert not drift, f"generated code differs from api/ (run `make proto`): {drift}"


@pytest.mark.timeout(120)
def test_buf_lint_passes():
    if not BUF.exists():
        pytest.fail(
            "buf is not installed in .tools/ (`make tools` installs it from the npm registry)"
        )
    result = subprocess.run(
        [str(BUF), "lint"], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
