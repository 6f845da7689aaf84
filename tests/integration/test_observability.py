"""Metrics through Envoy move by exactly what a few requests should move them;
a traceparent from an HTTP client continues into the server's spans; timings in the
final stream message and trailing metadata add up; one JSON log line per request."""

from __future__ import annotations

import json
import logging
import threading
import time

import grpc
import pytest
import requests
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families
from support.servers import ServerThread, tiny_settings
from support.tiers import server_fixture
from textgen.sdk import Client, OverloadedError

pytestmark = pytest.mark.timeout(120)


@server_fixture(scope="module")
def traced_server(tiny_model_dir):
    """One request at a time (so a held stream makes the next one `overloaded`),
    spans kept in memory, Envoy in front."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    server = ServerThread(
        tiny_settings(tiny_model_dir, max_concurrent_requests=1),
        http=True,
        tracer_provider=provider,
    ).start()
    server.spans = exporter
    yield server
    server.stop()


def scrape(server) -> dict[str, float]:
    resp = requests.get(f"{server.http_url}/metrics", timeout=10)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            key = s.name + (
                "{" + ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items())) + "}"
                if s.labels
                else ""
            )
            samples[key] = s.value
    return samples


def delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_move_by_exactly_what_happened(traced_server):
    url = traced_server.http_url
    before = scrape(traced_server)

    ok = requests.post(
        f"{url}/generate",
        json={"inputs": "hello", "parameters": {"max_new_tokens": 5, "details": True}},
        timeout=30,
    )
    assert ok.status_code == 200
    generated = ok.json()["details"]["generated_tokens"]
    bad = requests.post(
        f"{url}/generate", json={"inputs": "hello", "parameters": {"temperature": 0}}, timeout=30
    )
    assert bad.status_code == 422

    # hold the only permit with an open stream, then get turned away (once: no SDK retry)
    with Client(traced_server.target, timeout=30, retries=0) as client:
        stream = client.generate_stream("hello", max_new_tokens=200)
        next(stream)
        with pytest.raises(OverloadedError):
            client.generate("hello", max_new_tokens=2)
        stream.close()

    # the server records the cancel when grpc.aio ends the RPC, just after close() returns
    deadline = time.monotonic() + 10
    after = scrape(traced_server)
    while delta(after, before, "textgen_requests_cancelled_total") < 1:
        assert time.monotonic() < deadline, "the cancelled stream was never counted"
        time.sleep(0.05)
        after = scrape(traced_server)
    assert delta(after, before, "tgi_request_count") == 4
    assert delta(after, before, "tgi_request_success") == 1
    assert delta(after, before, 'tgi_request_failure{err="validation"}') == 1
    assert delta(after, before, 'tgi_request_failure{err="overloaded"}') == 1
    assert delta(after, before, "textgen_requests_cancelled_total") == 1
    assert delta(after, before, "tgi_request_duration_count") == 1
    assert delta(after, before, "tgi_request_generated_tokens_count") == 1
    assert delta(after, before, "tgi_request_generated_tokens_sum") == generated
    assert delta(after, before, "tgi_request_max_new_tokens_sum") == 5
    assert delta(after, before, "textgen_time_to_first_token_seconds_count") >= 2
    assert after["tgi_batch_current_max_tokens"] == 4096
    assert after["textgen_kv_cache_blocks_total"] > 0
    for name in (
        "tgi_queue_size",
        "tgi_batch_current_size",
        "textgen_prefix_cache_hit_ratio",
        "textgen_preemptions",
        "textgen_prefill_tokens",
    ):
        assert name in after


def test_traceparent_continues_through_envoy(traced_server):
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    traced_server.spans.clear()
    resp = requests.post(
        f"{traced_server.http_url}/generate",
        json={"inputs": "hello", "parameters": {"max_new_tokens": 4}},
        headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
        timeout=30,
    )
    assert resp.status_code == 200
    spans = [
        s
        for s in traced_server.spans.get_finished_spans()
        if format(s.context.trace_id, "032x") == trace_id
    ]
    names = {s.name for s in spans}
    assert {"validation", "queue", "prefill", "decode"} <= names
    rpc = next(s for s in spans if s.name.endswith("/Generate"))
    assert rpc.attributes["textgen.generated_tokens"] == 4
    for key in ("textgen.queue_time", "textgen.prefill_time", "textgen.inference_time"):
        assert rpc.attributes[key] >= 0
    decode = next(s for s in spans if s.name == "decode")
    assert decode.parent.span_id == rpc.context.span_id
    assert decode.attributes["generated_tokens"] == 4


def test_stream_timings_add_up(tiny_server):
    from textgen.service.proto import generate_pb2 as pb
    from textgen.service.proto import text_generation_service_pb2_grpc as svc_grpc

    with grpc.insecure_channel(tiny_server.target) as channel:
        stub = svc_grpc.TextGenerationServiceStub(channel)
        call = stub.GenerateStream(
            pb.GenerateRequest(inputs="hello", parameters=pb.GenerateParameters(max_new_tokens=6)),
            timeout=30,
        )
        messages = list(call)
        trailers = dict(call.trailing_metadata())
    t = messages[-1].details.timings
    assert t.total_time >= t.queue_time + t.inference_time - 1e-6
    assert t.inference_time > 0 and t.validation_time >= 0
    assert abs(t.time_per_token * messages[-1].details.generated_tokens - t.inference_time) < 1e-6
    assert int(trailers["x-generated-tokens"]) == len(messages)
    assert int(trailers["x-total-time"]) >= int(trailers["x-inference-time"])


def test_one_json_log_line_per_request_without_the_prompt(tiny_server, caplog):
    secret = "my secret prompt 12345"
    with (
        caplog.at_level(logging.INFO, logger="textgen.requests"),
        Client(tiny_server.target, timeout=30) as client,
    ):
        client.generate(secret, max_new_tokens=3)
        done = threading.Event()
        # the log line is written as the RPC ends, on the server's thread
        for _ in range(100):
            if any(
                "request" in r.getMessage() for r in caplog.records if r.name == "textgen.requests"
            ):
                done.set()
                break
            done.wait(0.05)
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "textgen.requests"]
    assert lines, "no request log line"
    line = lines[-1]
    assert line["status"] == "ok" and line["method"] == "Generate"
    assert line["generated_tokens"] == 3 and line["input_tokens"] > 0
    assert line["finish_reason"] in ("length", "eos_token")
    assert all(secret not in r.getMessage() for r in caplog.records)
