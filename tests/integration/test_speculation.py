"""`--speculate N` served: the same tokens as without it (greedy and seeded), every accepted
token its own stream event over SSE and gRPC, /info saying what is on, metrics counting the
kept proposals; `--speculate-model` refused at startup when the tokenizers differ."""

from __future__ import annotations

import json

import grpc
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from support.http_client import Http, sse_events
from support.servers import ServerThread, tiny_settings
from support.tiers import server_fixture
from support.tiny_model import build_tiny_model, build_tokenizer
from textgen.service.proto import generate_pb2 as pb
from textgen.service.proto import text_generation_service_pb2 as svc
from textgen.service.proto import text_generation_service_pb2_grpc as svc_grpc
from textgen.service.settings.table import SettingError

pytestmark = pytest.mark.timeout(180)

# prompts that repeat themselves: n-gram lookup has something to propose
PROMPTS = [
    "def add(a, b):\n    return a + b\ndef add(a, b):\n    return a + b\ndef add(",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the",
    "What is the capital of France? The capital of France is Paris. What is the capital",
]


@server_fixture(scope="module")
def draft_server(tiny_model_dir):
    """The model as its own draft (it is almost always right), behind Envoy; every decode
    verifies (a draft as costly as the model never pays: adaptive speculation would stop)."""
    settings = tiny_settings(
        tiny_model_dir,
        speculate=3,
        speculate_model=str(tiny_model_dir),
        speculate_adaptive=False,
    )
    server = ServerThread(settings, http=True).start()
    yield server
    server.stop()


@server_fixture(scope="module")
def ngram_server(tiny_model_dir):
    """Adaptive (the default): which steps verify is timed, the tokens are the same."""
    server = ServerThread(tiny_settings(tiny_model_dir, speculate=4)).start()
    yield server
    server.stop()


def generate(target: str, prompt: str, **params) -> pb.GenerateResponse:
    with grpc.insecure_channel(target) as channel:
        stub = svc_grpc.TextGenerationServiceStub(channel)
        request = pb.GenerateRequest(
            inputs=prompt, parameters=pb.GenerateParameters(details=True, **params)
        )
        return stub.Generate(request, timeout=60)


def tokens(response: pb.GenerateResponse) -> list[tuple[int, str]]:
    return [(t.id, t.text) for t in response.details.tokens]


PARAMS = [
    {"max_new_tokens": 40},
    {"max_new_tokens": 40, "do_sample": True, "temperature": 0.7, "top_k": 20, "seed": 7},
    {"max_new_tokens": 40, "repetition_penalty": 1.2, "top_n_tokens": 2},
    {"max_new_tokens": 40, "stop": ["("]},
]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded", "penalty", "stop"])
def test_the_same_tokens_as_without_speculation(tiny_server, draft_server, ngram_server, params):
    before = draft_server.engine.stats()
    for prompt in PROMPTS:
        plain = generate(tiny_server.target, prompt, **params)
        for server in (draft_server, ngram_server):
            spec = generate(server.target, prompt, **params)
            assert tokens(spec) == tokens(plain)
            assert spec.generated_text == plain.generated_text
            assert spec.details.finish_reason == plain.details.finish_reason
            # per token, its alternatives: ListValues of Token structs
            assert top_ids(spec) == top_ids(plain)
    after = draft_server.engine.stats()
    proposed = after.spec_proposed_tokens - before.spec_proposed_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    # the draft proposes greedily, without penalties: the plain greedy requests keep most
    assert accepted > (0.8 if params == PARAMS[0] else 0.1) * proposed > 0
    assert ngram_server.engine.stats().spec_proposed_tokens > 0


def top_ids(response: pb.GenerateResponse) -> list[list[int]]:
    return [[v.struct_value["id"] for v in top.values] for top in response.details.top_tokens]


def test_every_accepted_token_is_its_own_event(draft_server):
    """Over SSE through Envoy and over gRPC: one event per token, indexes 1..n, the texts
    adding up to generated_text, although the engine gave most of them in runs."""
    before = draft_server.engine.stats()
    body = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 30, "details": True}}
    resp = Http(draft_server.http_url).open("POST", "/generate_stream", body)
    events = [event for _, event in sse_events(resp)]
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    final = events[-1]
    assert final["details"]["generated_tokens"] == len(events)
    assert (
        "".join(e["token"]["text"] for e in events if not e["token"]["special"])
        == final["generated_text"]
    )
    after = draft_server.engine.stats()
    assert after.steps - before.steps < len(events)  # fewer steps than tokens

    with grpc.insecure_channel(draft_server.target) as channel:
        stub = svc_grpc.TextGenerationServiceStub(channel)
        request = pb.GenerateRequest(
            inputs=PROMPTS[0], parameters=pb.GenerateParameters(max_new_tokens=30)
        )
        streamed = list(stub.GenerateStream(request, timeout=60))
    assert [m.index for m in streamed] == [e["index"] for e in events]
    assert [m.token.id for m in streamed] == [e["token"]["id"] for e in events]


def test_info_and_metrics(draft_server):
    http = Http(draft_server.http_url)
    status, _, raw = http.call("GET", "/info")
    info = json.loads(raw)
    assert status == 200
    assert info["speculate"] == 3 and info["speculate_max_batch"] == 8
    assert info["speculate_model"] == draft_server.settings.speculate_model
    generate(draft_server.target, PROMPTS[1], max_new_tokens=20)
    text = requests.get(f"{draft_server.http_url}/metrics", timeout=10).text
    samples = {
        s.name + json.dumps(s.labels, sort_keys=True): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    skipped_count = samples["tgi_request_skipped_tokens_count{}"]
    skipped_zero = samples['tgi_request_skipped_tokens_bucket{"le": "0.0"}']
    assert skipped_count > skipped_zero  # some steps gave a sequence more than one token
    stats = draft_server.engine.stats()
    assert samples["textgen_speculative_proposed_tokens{}"] == stats.spec_proposed_tokens > 0
    assert samples["textgen_speculative_acceptance_ratio{}"] == pytest.approx(
        stats.spec_accepted_tokens / stats.spec_proposed_tokens
    )
    assert samples["textgen_speculative_mean_accepted_length{}"] == pytest.approx(
        stats.spec_accepted_tokens / stats.spec_verifications
    )
    # not adaptive: nothing kept from proposing
    assert samples["textgen_speculative_sequences_off{}"] == 0
    assert samples["textgen_speculative_skipped_proposals{}"] == 0


def test_plain_server_info_says_off(tiny_server):
    with grpc.insecure_channel(tiny_server.target) as channel:
        info = svc_grpc.TextGenerationServiceStub(channel).Info(svc.InfoRequest(), timeout=10)
    assert info.speculate == 0 and not info.HasField("speculate_model")


@pytest.mark.server
def test_a_draft_with_another_tokenizer_is_refused(tiny_model_dir, tmp_path):
    other = build_tiny_model(tmp_path / "other")
    build_tokenizer(300).save_pretrained(other)  # same model files, another vocabulary
    settings = tiny_settings(tiny_model_dir, speculate=2, speculate_model=str(other))
    with pytest.raises(SettingError, match="--speculate-model .*tokenizer differs"):
        ServerThread(settings).start()
