"""Raw HTTP for the tests of the HTTP faces: a standard-library client (nothing
between the test and the bytes), an SSE reader that timestamps frames, and
validators for TGI's published response schemas (tests/data/tgi-openapi.json)."""

from __future__ import annotations

import functools
import http.client
import json
import time
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import referencing

OPENAPI = Path(__file__).parent.parent / "data" / "tgi-openapi.json"  # TGI 3.3's published API
PROMPT = "The quick brown fox"
JSON = {"Content-Type": "application/json"}


class Http:
    """Raw HTTP/1.1 to Envoy with the standard library: nothing between us and the bytes."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port

    def open(self, method: str, path: str, body=None, headers=None) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        if body is not None and not isinstance(body, (bytes, str)):
            body = json.dumps(body)
        conn.request(
            method, path, body=body, headers={**JSON, **(headers or {})} if body is not None else {}
        )
        return conn.getresponse()

    def call(self, method: str, path: str, body=None, headers=None) -> tuple[int, dict, bytes]:
        resp = self.open(method, path, body, headers)
        with resp:
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()


def sse_events(resp: http.client.HTTPResponse):
    """(arrival time, decoded event) per `data:` frame, as the frames arrive."""
    while line := resp.readline():
        if line.startswith(b"data:"):
            yield time.monotonic(), json.loads(line[5:])


def no_eos(tokenizer) -> dict:
    """A logit bias that keeps the tiny random model from stopping early."""
    return {str(tokenizer.eos_token_id): -100.0}


def openapi_validator(name: str) -> jsonschema.Validator:
    """A validator for one of TGI's component schemas, with OpenAPI 3.0's
    `nullable` (not JSON Schema) translated to `null` being allowed."""
    return jsonschema.Draft202012Validator(
        {"$ref": f"tgi#/components/schemas/{name}"}, registry=_registry()
    )


@functools.cache
def _registry() -> referencing.Registry:
    doc = nullable_to_json_schema(json.loads(OPENAPI.read_text()))
    resource = referencing.Resource.from_contents(
        doc, default_specification=referencing.jsonschema.DRAFT202012
    )
    return referencing.Registry().with_resource("tgi", resource)


def nullable_to_json_schema(node):
    if isinstance(node, list):
        return [nullable_to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: nullable_to_json_schema(v) for k, v in node.items()}
    if node.pop("nullable", False):
        return {"anyOf": [node, {"type": "null"}]}
    return node
