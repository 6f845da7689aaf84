"""Every error of TGI's HTTP face through a real Envoy, with TGI's status and body
(OpenAI's under /v1/): the server's typed errors, Envoy's own rejections, overload
and an unhealthy replica.

Not reachable from outside yet, so covered by the status-table tests in
test_envoy_config.py instead: generation (424), incomplete_generation (500),
unauthenticated (401, until --api-key is enforced).
"""

from __future__ import annotations

import asyncio
import json
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
