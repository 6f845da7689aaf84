"""The gRPC server on a tiny random model: generation, streaming, info, tokenize,
health, reflection, and agreement with transformers' own generate."""

from __future__ import annotations

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from textgen.service.proto import generate_pb2 as pb
from textgen.service.proto import text_generation_service_pb2 as svc
from textgen.service.proto import text_generation_service_pb2_grpc as svc_grpc
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def stub(tiny_server):
    with grpc.insecure_channel(tiny_server.target) as channel:
        yield svc_grpc.TextGenerationServiceStub(channel)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def greedy_reference(reference, prompt: str, max_new_tokens: int) -> list[int]:
    model, tok = reference
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def request(inputs: str, **params) -> pb.GenerateRequest:
    return pb.GenerateRequest(inputs=inputs, parameters=pb.GenerateParameters(**params))


def test_generate_matches_transformers_greedy(stub, reference):
    prompt = "The quick brown fox"
    expected = greedy_reference(reference, prompt, 12)
    resp = stub.Generate(request(prompt, max_new_tokens=12, details=True), timeout=60)
    assert [t.id for t in resp.details.tokens] == expected[: len(resp.details.tokens)]
    assert resp.details.generated_tokens == len(resp.details.tokens)
    _, tok = reference
    assert resp.generated_text == tok.decode(
        expected[: len(resp.details.tokens)], skip_special_tokens=True
    )
    assert resp.details.finish_reason in ("length", "eos_token")
    assert resp.details.input_length == len(tok(prompt)["input_ids"])
    timings = resp.details.timings
    assert timings.total_time >= timings.queue_time + timings.inference_time - 1e-3


def test_generate_without_details_has_no_details(stub):
    resp = stub.Generate(request("Hello", max_new_tokens=3), timeout=60)
    assert not resp.HasField("details")


def test_stream_agrees_with_generate(stub):
    prompt = "What is the capital of France?"
    full = stub.Generate(request(prompt, max_new_tokens=10, details=True), timeout=60)
    messages = list(stub.GenerateStream(request(prompt, max_new_tokens=10), timeout=60))
    assert [m.index for m in messages] == list(range(1, len(messages) + 1))
    assert [m.token.id for m in messages] == [t.id for t in full.details.tokens]
    last = messages[-1]
    assert last.generated_text == full.generated_text
    assert last.details.finish_reason == full.details.finish_reason
    assert last.details.generated_tokens == len(messages)
    assert all(not m.HasField("details") for m in messages[:-1])
    streamed = "".join(m.token.text for m in messages if not m.token.special)
    assert streamed == full.generated_text


def test_return_full_text_and_top_n_tokens(stub):
    resp = stub.Generate(
        request("café", max_new_tokens=4, details=True, return_full_text=True, top_n_tokens=3),
        timeout=60,
    )
    assert resp.generated_text.startswith("café")
    assert len(resp.details.top_tokens) == len(resp.details.tokens)
    for token, alternatives in zip(resp.details.tokens, resp.details.top_tokens):
        alts = [v.struct_value for v in alternatives.values]
        assert len(alts) == 3
        # greedy: the chosen token is the most probable one
        assert int(alts[0]["id"]) == token.id


def test_decoder_input_details(stub, reference):
    resp = stub.Generate(
        request("hello world", max_new_tokens=2, decoder_input_details=True), timeout=60
    )
    _, tok = reference
    prefill = resp.details.prefill
    assert [p.id for p in prefill] == tok("hello world")["input_ids"]
    assert prefill[0].logprob.WhichOneof("kind") == "null_value"
    assert all(p.logprob.number_value <= 0 for p in prefill[1:])


def test_stop_sequence_across_tokens(stub):
    free = stub.Generate(request("The quick", max_new_tokens=16), timeout=60).generated_text
    stop = free[3:6]  # a stop string inside the free-running text
    assert len(stop) == 3
    resp = stub.Generate(
        request("The quick", max_new_tokens=16, stop=[stop], details=True), timeout=60
    )
    assert resp.details.finish_reason == "stop_sequence"
    assert resp.generated_text.endswith(stop) or stop in resp.generated_text
    assert len(resp.generated_text) < len(free) or free.endswith(stop)


def test_seeded_sampling_is_reproducible(stub):
    params = {
        "max_new_tokens": 8,
        "do_sample": True,
        "temperature": 1.5,
        "seed": 1234,
        "details": True,
    }
    a = stub.Generate(request("Hello", **params), timeout=60)
    b = stub.Generate(request("Hello", **params), timeout=60)
    assert [t.id for t in a.details.tokens] == [t.id for t in b.details.tokens]
    assert a.details.seed == 1234


def test_best_of(stub):
    resp = stub.Generate(
        request("Hello", max_new_tokens=4, best_of=2, do_sample=True, details=True), timeout=60
    )
    assert len(resp.details.best_of_sequences) == 1
    best = sum(t.logprob for t in resp.details.tokens)
    other = sum(t.logprob for t in resp.details.best_of_sequences[0].tokens)
    assert best >= other


def test_info(stub, tiny_server):
    info = stub.Info(svc.InfoRequest(), timeout=10)
    assert info.model_id == tiny_server.settings.model_id
    assert info.max_total_tokens == 512 and info.max_input_tokens == 511
    assert info.model_dtype == "float32" and info.model_device_type == "cpu"
    assert not info.HasField("quantize")  # weights as loaded (tests/service/test_quantize.py)
    assert info.router == "textgen" and info.version
    # the engine's torch threads: the CPUs this process may use; validation's workers
    from textgen.service.processes.cpus import default_torch_threads

    assert info.torch_threads == default_torch_threads() == tiny_server.engine.torch_threads
    assert info.validation_workers == tiny_server.settings.validation_workers
    assert not info.cuda_graphs  # on CPU graphs are off by default (refused when asked for)
    assert info.compile is False  # --compile is opt-in
    assert info.arrival_gap_ms == tiny_server.settings.arrival_gap_ms == 1.0  # the default


def test_tokenize(stub, reference):
    _, tok = reference
    text = "hello café 🎉"
    resp = stub.Tokenize(svc.TokenizeRequest(inputs=text), timeout=10)
    assert [t.id for t in resp.tokens] == tok(text)["input_ids"]
    for t in resp.tokens:
        assert text[t.start : t.stop] == t.text


def test_health_and_models(stub, tiny_server):
    stub.Health(svc.HealthRequest(), timeout=10)
    models = stub.ListModels(svc.ListModelsRequest(), timeout=10)
    assert models.object == "list" and models.data[0].id == tiny_server.settings.model_id
    with grpc.insecure_channel(tiny_server.target) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
        assert status.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_service(tiny_server):
    with grpc.insecure_channel(tiny_server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert "textgen.v1.TextGenerationService" in names
    assert "grpc.health.v1.Health" in names


def test_cancel_frees_the_sequence(tiny_server, stub):
    import time

    call = stub.GenerateStream(request("Hello", max_new_tokens=400), timeout=60)
    first = next(call)
    assert first.index == 1
    call.cancel()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        stats = tiny_server.engine.stats()
        if stats.running == 0 and stats.waiting == 0:
            break
        time.sleep(0.02)
    stats = tiny_server.engine.stats()
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)
