"""The house rules, in `make test`: ruff (lint, and the formatter's layout) over every
hand-written Python folder, and the layer contracts of pyproject.toml's
[tool.importlinter] (lint-imports): the server's layers (entry points -> replica ->
settings -> faces -> request path -> engine -> models -> errors), the SDK nothing of the
server, protobuf stops at service/grpc/, Envoy's config takes only the error vocabulary."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.server, pytest.mark.timeout(120)]  # ruff, lint-imports: subprocesses

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
FOLDERS = ["service", "envoy", "sdk", "scripts", "tests", "deploy"]


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=100, check=False
    )


def test_ruff_check():
    result = run(str(BIN / "ruff"), "check", *FOLDERS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format():
    result = run(str(BIN / "ruff"), "format", "--check", *FOLDERS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_layer_contracts():
    result = run(str(BIN / "lint-imports"), "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout
