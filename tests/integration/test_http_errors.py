"""Every error of TGI's HTTP face through a real Envoy, with TGI's status and body
(OpenAI's under /v1/): the server's typed errors, Envoy's own rejections (among them
the Lua filter's refusal of a TGI body's unknown fields), overload and an unhealthy
replica.

Not reachable from outside yet, so covered by the status-table tests in
test_envoy_config.py instead: generation (424), incomplete_generation (500),
unauthenticated (401, until --api-key is enforced).
"""

from __future__ import annotations

import asyncio
import json
import re
from urllib.parse import urlsplit

import grpc
import huggingface_hub
import pytest
from support.http_client import PROMPT, Http, no_eos, openapi_validator, sse_events
from support.servers import ServerThread, tiny_settings
from support.tiers import server_fixture
from textgen.service.proto import generate_pb2 as pb
from textgen.service.proto import text_generation_service_pb2_grpc as svc_grpc
from transformers import AutoTokenizer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def web(http_server) -> Http:
    return Http(http_server.http_url)


# errors -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/"])
def test_validation_error_is_422_tgi_body(web, path):
    body = {"inputs": PROMPT, "parameters": {"temperature": 0}, "stream": path == "/"}
    status, headers, raw = web.call("POST", path, body)
    assert status == 422
    assert headers["content-type"] == "application/json"
    error = json.loads(raw)
    openapi_validator("ErrorResponse").validate(error)
    assert error == {"error": "`temperature` must be strictly positive", "error_type": "validation"}
    assert not [h for h in headers if h.startswith(("grpc-", "x-textgen"))]


def test_openai_route_errors_have_openai_shape(web):
    status, _, raw = web.call("POST", "/v1/chat/completions", {"messages": []})
    assert status == 422
    error = json.loads(raw)["error"]
    # the refused field, as OpenAI names it
    assert error["type"] == "validation" and error["message"] and error["param"] == "messages"
    status, _, raw = web.call("GET", "/v1/nothing-here")
    assert status == 404 and json.loads(raw)["error"]["type"] == "not_found"


@pytest.mark.parametrize(
    "body, fragment",
    [
        ('{"inputs": "x", "parameters": ', "Unexpected"),  # malformed JSON
        ('{"inputs": 5}', "inputs"),  # wrong field type
        ('{"inputs": "x", "parameters": {"max_new_tokens": "many"}}', "max_new_tokens"),
    ],
)
def test_bad_json_is_422_validation(web, body, fragment):
    status, _, raw = web.call("POST", "/generate", body)
    assert status == 422
    error = json.loads(raw)
    assert error["error_type"] == "validation" and fragment in error["error"]


def test_envoy_rejections_are_typed(web):
    status, _, raw = web.call("GET", "/no/such/route")
    assert (status, json.loads(raw)["error_type"]) == (404, "not_found")
    status, _, raw = web.call("GET", "/generate")
    assert (status, json.loads(raw)["error_type"]) == (405, "method_not_allowed")
    # TGI's payload limit: 2 MB
    big = {"inputs": "a" * 2_100_000, "parameters": {"max_new_tokens": 1}}
    for path in ("/generate", "/"):
        status, _, raw = web.call("POST", path, big)
        assert status == 413
        assert json.loads(raw)["error_type"] == "validation"


def test_unknown_query_parameter_is_ignored(web):
    status, _, raw = web.call(
        "POST", "/generate?foo=bar", {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}
    )
    assert status == 200, raw
    status, _, _ = web.call("GET", "/info?verbose=1")
    assert status == 200


# unknown fields of TGI's bodies: refused by Envoy's Lua filter (envoy/lua.py) --------


def request_count(web) -> float:
    status, _, raw = web.call("GET", "/metrics")
    assert status == 200
    return float(re.search(rb"^tgi_request_count (\S+)$", raw, re.MULTILINE).group(1))


GRAMMAR = {"type": "json", "value": {"type": "object", "properties": {"a": {"type": "string"}}}}


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/generate", {"inputs": PROMPT, "foo": 1}, "foo"),
        (
            "/generate",
            {"inputs": PROMPT, "parameters": {"max_new_token": 5}},
            "parameters.max_new_token",
        ),
        # null is refused too: no client sends an unknown field as null
        (
            "/generate",
            {"inputs": PROMPT, "parameters": {"max_new_tokens": 1, "foo": None}},
            "parameters.foo",
        ),
        (
            "/generate",
            {"inputs": PROMPT, "parameters": {"grammar": {**GRAMMAR, "strict": True}}},
            "parameters.grammar.strict",
        ),
        ("/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": 1}, "n": 2}, "n"),
        (
            "/generate_stream",
            {"inputs": PROMPT, "parameters": {"maxNewToken": 1}},
            "parameters.maxNewToken",
        ),
        (
            "/",
            {"inputs": PROMPT, "stream": False, "parameters": {"max_new_token": 1}},
            "parameters.max_new_token",
        ),
        (
            "/",
            {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 1}, "foo": None},
            "foo",
        ),
        # an escaped key is read as the transcoder reads it
        (
            "/generate",
            '{"inputs": "x", "parameters": {"max\\u005fnew_token": 1}}',
            "parameters.max_new_token",
        ),
    ],
)
def test_unknown_field_is_refused_by_name_before_the_server(web, path, body, field):
    """The transcoder drops a field its message lacks: `max_new_token` (a typo) would
    generate to the whole context. The Lua filter refuses it, naming it, and the request
    never reaches the server."""
    before = request_count(web)
    status, headers, raw = web.call("POST", path, body)
    assert status == 422, raw
    assert headers["content-type"] == "application/json"
    error = json.loads(raw)
    openapi_validator("ErrorResponse").validate(error)
    assert error["error_type"] == "validation"
    assert error["error"].startswith(f"unknown field `{field}`, expected one of `"), error
    assert request_count(web) == before


@pytest.mark.parametrize(
    "path, body",
    [
        # the proto's JSON names (lowerCamelCase), which the transcoder binds too; a key
        # with an escape, read as the transcoder reads it
        ("/generate", '{"inputs": "x", "parameters": {"max\\u005fnew_tokens": 1}}'),
        # keys inside strings, escaped quotes, the arbitrary keys of logit_bias, of a
        # grammar's schema and of nested arrays are not the body's
        (
            "/generate",
            {
                "inputs": 'say "foo": 1, \\"bar\\": {"baz": 2}',
                "parameters": {
                    "max_new_tokens": 2,
                    "stop": ['"foo":', "}"],
                    "logit_bias": {"5": 0.5},
                    "grammar": {
                        "type": "json",
                        "value": {
                            "type": "object",
                            "properties": {
                                "foo": {"type": "string"},
                                "stream": {"type": "integer"},
                            },
                            "description": '{"nope": 1}',
                            "examples": [{"foo": "x", "stream": 1}],
                        },
                    },
                },
            },
        ),
        (
            "/generate_stream",
            {"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "grammar": None}},
        ),
        ("/generate", {"inputs": PROMPT, "parameters": None, "stream": False}),
        (
            "/",
            {
                "inputs": PROMPT,
                "parameters": {"maxNewTokens": 2, "doSample": False},
                "stream": True,
            },
        ),
    ],
)
def test_known_fields_in_both_spellings_are_accepted(web, path, body):
    status, _, raw = web.call("POST", path, body)
    assert status == 200, raw


def test_camel_case_fields_are_honoured(web, tokenizer):
    params = {"maxNewTokens": 3, "topNTokens": 2, "details": True, "logitBias": no_eos(tokenizer)}
    status, _, raw = web.call("POST", "/generate", {"inputs": PROMPT, "parameters": params})
    assert status == 200, raw
    details = json.loads(raw)["details"]
    assert details["generated_tokens"] == 3 and len(details["top_tokens"][0]) == 2


# overload and health (their own replicas) -------------------------------------------


@server_fixture(scope="module")
def busy_server(tiny_model_dir):
    server = ServerThread(
        tiny_settings(tiny_model_dir, max_concurrent_requests=1), http=True
    ).start()
    yield server
    server.stop()


def test_overloaded_is_429(busy_server, tokenizer):
    web = Http(busy_server.http_url)
    body = {
        "inputs": PROMPT,
        "parameters": {"max_new_tokens": 400, "logit_bias": no_eos(tokenizer)},
    }
    holder = web.open("POST", "/generate_stream", body)
    with holder:
        next(sse_events(holder))  # the one permit is taken while this stream is open
        for path in ("/generate", "/generate_stream", "/"):
            status, _, raw = web.call(
                "POST", path, {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}
            )
            assert status == 429, (path, raw)
            assert json.loads(raw) == {"error": "Model is overloaded", "error_type": "overloaded"}
        port = urlsplit(busy_server.http_url).port
        with (
            grpc.insecure_channel(f"127.0.0.1:{port}") as channel,
            pytest.raises(grpc.RpcError) as caught,
        ):
            stub = svc_grpc.TextGenerationServiceStub(channel)
            stub.Generate(pb.GenerateRequest(inputs=PROMPT), timeout=10)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(huggingface_hub.errors.OverloadedError):
            huggingface_hub.InferenceClient(base_url=busy_server.http_url).text_generation(
                PROMPT, max_new_tokens=2
            )


@pytest.mark.server
def test_unhealthy_replica(tiny_model_dir):
    server = ServerThread(tiny_settings(tiny_model_dir), http=True).start()
    try:
        web = Http(server.http_url)
        server.engine.shutdown()  # the engine is down, the gRPC server still up
        status, _, raw = web.call("GET", "/health")
        assert (status, json.loads(raw)) == (
            503,
            {"error": "unhealthy", "error_type": "healthcheck"},
        )
        status, _, raw = web.call("POST", "/generate", {"inputs": PROMPT})
        assert (status, json.loads(raw)["error_type"]) == (503, "unavailable")

        stop_grpc_server(server)
        status, _, raw = web.call("GET", "/health")  # Envoy answers alone: no upstream
        assert (status, json.loads(raw)) == (
            503,
            {"error": "unhealthy", "error_type": "healthcheck"},
        )
        status, _, raw = web.call("POST", "/generate", {"inputs": PROMPT})
        assert (status, json.loads(raw)["error_type"]) == (503, "unavailable")
    finally:
        server.stop()


def stop_grpc_server(server: ServerThread) -> None:
    asyncio.run_coroutine_threadsafe(server.replica.server.stop(0), server.loop).result(10)
