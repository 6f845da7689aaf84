"""The one error vocabulary (service/errors.py) against the places that restate it:
the contract's comment, the server's status table, Envoy's HTTP table and the published
OpenAPI description. (The SDK's exception map: tests/sdk/test_errors.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from textgen.envoy import config as envoy_config
from textgen.service.errors import SERVER_ERROR_TYPES, ErrorType, incomplete
from textgen.service.grpc.errors import STATUS_BY_ERROR_TYPE

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[2]


def test_the_contract_comment_lists_the_server_error_types():
    proto = (REPO / "api" / "textgen" / "v1" / "generate.proto").read_text()
    rows = re.findall(r"^//\s+([a-z_]+)\s+([A-Z_]+)\s+HTTP (\d{3})", proto, re.MULTILINE)
    assert [(t, c, int(s)) for t, c, s in rows] == [
        (t.value, t.grpc_code.name, t.http_status) for t in SERVER_ERROR_TYPES
    ]


def test_server_and_envoy_tables_are_the_vocabulary():
    assert STATUS_BY_ERROR_TYPE == {t.value: t.grpc_code for t in SERVER_ERROR_TYPES}
    assert envoy_config.HTTP_STATUS_BY_ERROR_TYPE == {
        t.value: t.http_status for t in SERVER_ERROR_TYPES
    }


def test_openapi_error_types_are_the_contract_types():
    spec = json.loads((REPO / "envoy" / "openapi.json").read_text())
    enum = spec["components"]["schemas"]["ErrorResponse"]["properties"]["error_type"]["enum"]
    assert enum == [t.value for t in ErrorType if t.in_contract]


def test_an_error_type_is_its_string():
    assert ErrorType("validation") is ErrorType.VALIDATION
    assert {ErrorType.OVERLOADED: 1}["overloaded"] == 1  # one dict key with its string
    assert f"{ErrorType.GENERATION}" == "generation"
    assert incomplete(ErrorType.GENERATION) is ErrorType.INCOMPLETE_GENERATION
    assert incomplete(ErrorType.VALIDATION) is ErrorType.VALIDATION
