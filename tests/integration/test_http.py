"""TGI's HTTP face through a real Envoy in front of a real server (tiny model):
third-party clients unmodified, raw HTTP (SSE framing, headers, POST /), TGI's
response schemas, native gRPC on the same port, and `textgen serve` supervising
its Envoy. Errors: test_http_errors.py."""

from __future__ import annotations

import json
import os
import signal
import time
from urllib.parse import urlsplit

import grpc
import huggingface_hub
import jsonschema
import pytest
import text_generation
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from support.http_client import PROMPT, Http, no_eos, openapi_validator, sse_events
from support.serve_process import textgen_serve
from support.servers import ServerThread
from textgen.sdk import ValidationError, http_streams
from textgen.service.proto import generate_pb2 as pb
from textgen.service.proto import text_generation_service_pb2_grpc as svc_grpc
from textgen.service.settings.table import Settings
from transformers import AutoTokenizer

pytestmark = [
    pytest.mark.timeout(60),
    # text-generation 0.7 calls pydantic v1 methods
    pytest.mark.filterwarnings("ignore::DeprecationWarning:text_generation"),
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def web(http_server) -> Http:
    return Http(http_server.http_url)


@pytest.fixture(scope="module")
def grpc_stub(http_server):
    """Straight to the gRPC server, bypassing Envoy: the reference answers."""
    with grpc.insecure_channel(http_server.target) as channel:
        yield svc_grpc.TextGenerationServiceStub(channel)


def reference(grpc_stub, prompt: str, max_new_tokens: int) -> pb.GenerateResponse:
    request = pb.GenerateRequest(
        inputs=prompt, parameters=pb.GenerateParameters(max_new_tokens=max_new_tokens, details=True)
    )
    return grpc_stub.Generate(request, timeout=30)


# third-party clients ----------------------------------------------------------------


def test_inference_client_text_generation(http_server, grpc_stub):
    client = huggingface_hub.InferenceClient(base_url=http_server.http_url)
    expected = reference(grpc_stub, PROMPT, 8)
    ids = [t.id for t in expected.details.tokens]

    assert client.text_generation(PROMPT, max_new_tokens=8) == expected.generated_text

    out = client.text_generation(PROMPT, max_new_tokens=8, details=True)
    assert out.generated_text == expected.generated_text
    assert [t.id for t in out.details.tokens] == ids
    assert out.details.finish_reason == expected.details.finish_reason
    assert out.details.generated_tokens == len(ids)

    texts = list(client.text_generation(PROMPT, max_new_tokens=8, stream=True))
    assert "".join(texts) == expected.generated_text

    events = list(client.text_generation(PROMPT, max_new_tokens=8, stream=True, details=True))
    assert [e.token.id for e in events] == ids
    assert events[-1].generated_text == expected.generated_text
    assert events[-1].details.generated_tokens == len(ids)
    assert all(e.details is None for e in events[:-1])


def test_inference_client_raises_tgi_errors(http_server):
    client = huggingface_hub.InferenceClient(base_url=http_server.http_url)
    with pytest.raises(huggingface_hub.errors.ValidationError, match="temperature"):
        client.text_generation(PROMPT, max_new_tokens=4, temperature=0.0, do_sample=True)
    with pytest.raises(huggingface_hub.errors.ValidationError):
        next(iter(client.text_generation(PROMPT, max_new_tokens=100_000, stream=True)))


def test_tgi_client(http_server, grpc_stub):
    client = text_generation.Client(http_server.http_url, timeout=30)
    expected = reference(grpc_stub, PROMPT, 8)
    ids = [t.id for t in expected.details.tokens]

    response = client.generate(PROMPT, max_new_tokens=8)
    assert response.generated_text == expected.generated_text
    assert [t.id for t in response.details.tokens] == ids

    events = list(client.generate_stream(PROMPT, max_new_tokens=8))
    assert [e.token.id for e in events] == ids
    assert events[-1].generated_text == expected.generated_text
    assert events[-1].details.finish_reason.value == expected.details.finish_reason

    with pytest.raises(text_generation.errors.ValidationError):
        client.generate(PROMPT, max_new_tokens=100_000)


# raw HTTP: routes, headers, schemas -------------------------------------------------


def test_generate_stream_is_incremental_sse(web, tokenizer, grpc_stub):
    body = {
        "inputs": PROMPT,
        "parameters": {"max_new_tokens": 150, "logit_bias": no_eos(tokenizer)},
    }
    started = time.monotonic()
    resp = web.open("POST", "/generate_stream", body)
    with resp:
        assert resp.status == 200
        assert resp.getheader("content-type") == "text/event-stream"
        assert resp.getheader("x-accel-buffering") == "no"
        assert resp.getheader("cache-control") == "no-cache"
        assert resp.getheader("grpc-status") is None
        events = list(sse_events(resp))
    times = [t for t, _ in events]
    assert len(events) == 150
    # Buffered somewhere, every frame would arrive at once at the end.
    assert times[0] - started < 0.5 * (times[-1] - started), times[:3]
    stream_response = openapi_validator("StreamResponse")
    for _, event in events:
        stream_response.validate(event)
    assert [e["index"] for _, e in events] == list(range(1, 151))
    final = events[-1][1]
    request = pb.GenerateRequest(
        inputs=PROMPT,
        parameters=pb.GenerateParameters(
            max_new_tokens=150, logit_bias={tokenizer.eos_token_id: -100.0}
        ),
    )
    assert final["generated_text"] == grpc_stub.Generate(request, timeout=30).generated_text
    assert final["details"]["finish_reason"] == "length"
    assert final["details"]["generated_tokens"] == 150
    assert all("generated_text" not in e for _, e in events[:-1])


def test_sdk_http_streams_read_tgi_to_the_end(http_server, grpc_stub):
    """The SDK's standard-library helper: every event, ending at the final one, equal to
    the gRPC answer; a refusal raises its class."""
    events = list(
        http_streams.generate_stream(http_server.http_url, PROMPT, timeout=30, max_new_tokens=8)
    )
    assert [e["index"] for e in events] == list(range(1, 9))
    assert events[-1]["generated_text"] == reference(grpc_stub, PROMPT, 8).generated_text
    with pytest.raises(ValidationError, match="top_n_tokens"):
        list(
            http_streams.generate_stream(http_server.http_url, PROMPT, timeout=30, top_n_tokens=99)
        )


def test_generate_has_tgi_headers_and_schema(web):
    status, headers, raw = web.call(
        "POST",
        "/generate",
        {
            "inputs": PROMPT,
            "parameters": {
                "max_new_tokens": 5,
                "details": True,
                "decoder_input_details": True,
                "top_n_tokens": 2,
            },
        },
    )
    assert status == 200, raw
    assert headers["content-type"] == "application/json"
    for name in (
        "x-compute-type",
        "x-total-time",
        "x-validation-time",
        "x-queue-time",
        "x-inference-time",
        "x-time-per-token",
        "x-prompt-tokens",
        "x-generated-tokens",
    ):
        assert name in headers, name
    assert headers["x-generated-tokens"] == "5"
    assert not [h for h in headers if h.startswith(("grpc-", "x-textgen"))]
    body = json.loads(raw)
    openapi_validator("GenerateResponse").validate(body)
    assert len(body["details"]["tokens"]) == 5
    assert body["details"]["prefill"][0]["logprob"] is None
    assert len(body["details"]["top_tokens"]) == 5 and len(body["details"]["top_tokens"][0]) == 2


def test_compat_route_switches_on_stream(web):
    params = {"max_new_tokens": 4}
    status, _, raw = web.call("POST", "/", {"inputs": PROMPT, "parameters": params})
    assert status == 200, raw
    array = json.loads(raw)
    assert isinstance(array, list) and len(array) == 1
    jsonschema.validate(
        array, {"type": "array", "items": {"type": "object", "required": ["generated_text"]}}
    )
    openapi_validator("GenerateResponse").validate(array[0])

    # a "stream" inside the prompt is not the top-level field
    tricky = {
        "inputs": 'say "stream": true',
        "parameters": {**params, "grammar": None},
        "stream": False,
    }
    status, _, raw = web.call("POST", "/", tricky)
    assert status == 200 and isinstance(json.loads(raw), list)

    resp = web.open("POST", "/?unused=1", {"inputs": PROMPT, "parameters": params, "stream": True})
    with resp:
        assert resp.status == 200
        assert resp.getheader("content-type") == "text/event-stream"
        assert resp.getheader("x-accel-buffering") == "no"
        events = [e for _, e in sse_events(resp)]
    assert len(events) == 4 and events[-1]["generated_text"] == array[0]["generated_text"]


def test_info_tokenize_health_metrics(web, http_server, tokenizer):
    status, _, raw = web.call("GET", "/info")
    assert status == 200
    info = json.loads(raw)
    openapi_validator("Info").validate(info)
    assert info["model_id"] == http_server.settings.model_id and info["router"] == "textgen"

    status, _, raw = web.call("POST", "/tokenize", {"inputs": "hello café"})
    assert status == 200
    tokens = json.loads(raw)
    openapi_validator("TokenizeResponse").validate(tokens)  # TGI's bare array
    assert [t["id"] for t in tokens] == tokenizer("hello café")["input_ids"]

    assert web.call("GET", "/health")[0] == 200

    # Reaches the server: once the Metrics RPC is served (service/grpc/metrics_rpc.py)
    # it is Prometheus text; before that, a typed UNIMPLEMENTED, never a 404.
    status, headers, raw = web.call("GET", "/metrics")
    if status == 200:
        assert headers["content-type"].startswith("text/plain")
    else:
        assert (status, json.loads(raw)["error_type"]) == (501, "unimplemented")


# native gRPC on the HTTP port -------------------------------------------------------


def test_native_grpc_through_envoy(http_server, grpc_stub):
    port = urlsplit(http_server.http_url).port
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = svc_grpc.TextGenerationServiceStub(channel)
        expected = reference(grpc_stub, PROMPT, 6)
        request = pb.GenerateRequest(
            inputs=PROMPT, parameters=pb.GenerateParameters(max_new_tokens=6)
        )
        assert stub.Generate(request, timeout=30).generated_text == expected.generated_text
        assert (
            "".join(m.token.text for m in stub.GenerateStream(request, timeout=30))
            == expected.generated_text
        )

        bad = pb.GenerateRequest(inputs=PROMPT, parameters=pb.GenerateParameters(temperature=0))
        with pytest.raises(grpc.RpcError) as caught:
            stub.Generate(bad, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(caught.value)
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info) and info.reason == "validation"
    assert ("x-textgen-error-type", "validation") in tuple(caught.value.trailing_metadata())


# the embedded model ------------------------------------------------------------------


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.timeout(600)  # the first use converts the embedded GGUF
def test_embedded_model_over_http():
    server = ServerThread(Settings(grpc_port=0, max_batch_total_tokens=16384), http=True).start()
    try:
        client = huggingface_hub.InferenceClient(base_url=server.http_url)
        assert "Paris" in client.text_generation("The capital of France is", max_new_tokens=8)
        streamed = client.text_generation("The capital of France is", max_new_tokens=8, stream=True)
        assert "Paris" in "".join(streamed)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        chat = client.chat.completions.create(
            model="textgen", messages=question, max_tokens=20, temperature=0
        )
        assert "Paris" in chat.choices[0].message.content
    finally:
        server.stop()


# `textgen serve` --------------------------------------------------------------------


@pytest.mark.server
def test_textgen_serve_starts_and_supervises_envoy(tiny_model_dir):
    """The CLI starts the replica and Envoy, logs the HTTP URL and a curl line;
    when Envoy dies the whole service stops (exit 1), not half up."""
    args = ["--model-id", str(tiny_model_dir), "--dtype", "float32", "--grpc-port", "0",
            "--port", "0", "--max-batch-total-tokens", "4096"]  # fmt: skip
    with textgen_serve(*args, until="curl -N") as served:
        assert served.http_url and served.envoy_pid, served.log
        assert f"curl -N {served.http_url}/generate_stream" in served.log
        assert Http(served.http_url).call("GET", "/health")[0] == 200

        os.kill(served.envoy_pid, signal.SIGKILL)
        assert served.proc.wait(timeout=30) == 1
        assert "exited" in served.proc.stderr.read()
        with pytest.raises(ProcessLookupError):  # reaped by textgen, not left a zombie
            os.kill(served.envoy_pid, 0)
