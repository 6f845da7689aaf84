"""Several models behind one `textgen proxy` (README "Several models"): two replicas of two
different tiny models (`serve --no-envoy`), one proxy with a pool for each. Through the
proxy, each model answers as its own replica does asked directly (and the two differ):
OpenAI's routes by the body's `model` (the `openai` SDK; a LoRA adapter's name too) and
Anthropic's /v1/messages (the `anthropic` SDK), TGI's
by the x-model-id header, native gRPC by that metadata; /v1/models lists both; an unknown
model is a 404 naming it; a stored response is found in its model's pool."""

from __future__ import annotations

import json
import subprocess
import sys

import anthropic
import grpc
import openai
import pytest
from support.http_client import Http
from support.replica_processes import Proxy, Replica, free_port
from support.tiers import server_fixture
from support.tiny_model import build_tiny_model
from textgen.sdk import Client
from textgen.sdk.errors import NotFoundError
from textgen.service.proto import generate_pb2 as pb
from textgen.service.proto import text_generation_service_pb2 as svc_pb
from textgen.service.proto import text_generation_service_pb2_grpc as svc_grpc

pytestmark = pytest.mark.timeout(300)

PROMPT = "The quick brown fox"
TOKENS = 12
LIST = svc_pb.ListModelsRequest()
ADAPTER = "beta-sql"  # a LoRA adapter of beta's replica: it routes to beta's pool


@server_fixture(scope="module")
def pools(tmp_path_factory):
    """The replicas (alpha's, beta's), their model ids, and the proxy of both pools."""
    root = tmp_path_factory.mktemp("pools")
    models = [build_tiny_model(root / "alpha", seed=1), build_tiny_model(root / "beta", seed=2)]
    adapter = f"{ADAPTER}={build_adapter(models[1], root / ADAPTER)}"
    replicas = [
        Replica(models[0], free_port(), root / "alpha.log"),
        Replica(models[1], free_port(), root / "beta.log", "--lora-adapters", adapter),
    ]
    try:
        for replica in replicas:
            replica.wait_serving()
        # a model's id is what its replica reports: here, the folder it was loaded from
        names = [r.stub.ListModels(LIST, timeout=10).data[0].id for r in replicas]
        proxy = Proxy([], root / "proxy.log", pools={n: [r.port] for n, r in zip(names, replicas)})
        try:
            yield replicas, names, proxy
        finally:
            proxy.stop()
    finally:
        for replica in replicas:
            replica.stop()


def build_adapter(model_dir, folder) -> str:
    """A random LoRA adapter of the model in `model_dir` (it changes the answers)."""
    import torch
    from support.lora_adapters import make_adapter
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return make_adapter(base, folder, 4, ["q_proj", "v_proj", "down_proj"], seed=3, std=0.3)


def direct_completion(replica: Replica, model: str) -> str:
    with Client(replica.target, timeout=60) as client:
        body = {"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
        return client.completions(body)["choices"][0]["text"]


def direct_generate(replica: Replica) -> str:
    params = pb.GenerateParameters(max_new_tokens=TOKENS)
    request = pb.GenerateRequest(inputs=PROMPT, parameters=params)
    return replica.stub.Generate(request, timeout=60).generated_text


def openai_client(proxy: Proxy) -> openai.OpenAI:
    url = f"http://127.0.0.1:{proxy.http_port}/v1"
    return openai.OpenAI(base_url=url, api_key="-", timeout=60, max_retries=0)


def test_each_model_answers_as_its_own_replica(pools):
    replicas, names, proxy = pools
    client = openai_client(proxy)
    direct = [direct_completion(r, n) for r, n in zip(replicas, names)]
    assert direct[0] != direct[1], "the two tiny models must differ for this test to mean much"
    for name, expected in zip(names, direct):
        answer = client.completions.create(
            model=name, prompt=PROMPT, max_tokens=TOKENS, temperature=0
        )
        assert answer.choices[0].text == expected
        assert answer.model == name
        # streamed too: the body is read before the stream starts
        stream = client.completions.create(
            model=name, prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=True
        )
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected


def test_chat_goes_by_the_body_model(pools):
    replicas, names, proxy = pools
    client = openai_client(proxy)
    messages = [{"role": "user", "content": PROMPT}]
    body = {"messages": messages, "max_tokens": TOKENS, "temperature": 0}
    for replica, name in zip(replicas, names):
        with Client(replica.target, timeout=60) as direct:
            expected = direct.chat_completions({**body, "model": name})
        answer = client.chat.completions.create(model=name, **body)
        assert answer.choices[0].message.content == expected["choices"][0]["message"]["content"]


def test_anthropic_messages_go_by_the_body_model(pools):
    """Anthropic's /v1/messages by its body's `model` too; one no pool serves is
    Anthropic's 404 not_found_error."""
    replicas, names, proxy = pools
    claude = anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{proxy.http_port}", api_key="-", timeout=60, max_retries=0
    )
    messages = [{"role": "user", "content": PROMPT}]
    body = {"messages": messages, "max_tokens": TOKENS, "temperature": 0}
    for replica, name in zip(replicas, names):
        with Client(replica.target, timeout=60) as direct:
            expected = direct.chat_completions({**body, "model": name})
        answer = claude.messages.create(
            model=name, max_tokens=TOKENS, messages=messages, extra_body={"temperature": 0}
        )
        assert answer.content[0].text == expected["choices"][0]["message"]["content"]
    with pytest.raises(anthropic.NotFoundError) as raised:
        claude.messages.create(model="no-such-model", max_tokens=2, messages=messages)
    assert raised.value.body["type"] == "error"
    assert raised.value.body["error"]["type"] == "not_found_error"
    assert "no-such-model" in raised.value.body["error"]["message"]


def test_models_lists_every_pool(pools):
    _, names, proxy = pools
    listed = openai_client(proxy).models.list().data
    assert [m.id for m in listed] == [*names, ADAPTER]
    assert {m.owned_by for m in listed} == {"textgen"}
    assert listed[2].model_extra["parent"] == names[1]


def test_a_lora_adapter_routes_to_its_base_models_pool(pools):
    replicas, names, proxy = pools
    expected = direct_completion(replicas[1], ADAPTER)
    assert expected != direct_completion(replicas[1], names[1])
    answer = openai_client(proxy).completions.create(
        model=ADAPTER, prompt=PROMPT, max_tokens=TOKENS, temperature=0
    )
    assert answer.choices[0].text == expected


def test_an_unknown_model_is_a_404_naming_it(pools):
    _, names, proxy = pools
    with pytest.raises(openai.NotFoundError) as raised:
        openai_client(proxy).completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    error = raised.value
    assert error.code == "model_not_found" and error.param == "model"
    assert "no-such-model" in error.message and names[0] in error.message
    status, _, body = Http(f"http://127.0.0.1:{proxy.http_port}").call(
        "POST", "/generate", {"inputs": PROMPT}, {"x-model-id": "no-such-model"}
    )
    assert status == 404 and b'"error_type":"not_found"' in body.replace(b" ", b"")


def test_tgi_routes_and_native_grpc_go_by_the_header(pools):
    replicas, names, proxy = pools
    http = Http(f"http://127.0.0.1:{proxy.http_port}")
    direct = [direct_generate(r) for r in replicas]
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": TOKENS}}
    for name, expected in zip(names, direct):
        status, _, answer = http.call("POST", "/generate", body, {"x-model-id": name})
        assert status == 200, answer
        assert json.loads(answer)["generated_text"] == expected
    # no model named: the first pool
    status, _, answer = http.call("POST", "/generate", body)
    assert status == 200 and json.loads(answer)["generated_text"] == direct[0]
    with grpc.insecure_channel(f"127.0.0.1:{proxy.http_port}") as channel:
        stub = svc_grpc.TextGenerationServiceStub(channel)
        request = pb.GenerateRequest(
            inputs=PROMPT, parameters=pb.GenerateParameters(max_new_tokens=TOKENS)
        )
        for name, expected in zip(names, direct):
            reply = stub.Generate(request, metadata=(("x-model-id", name),), timeout=60)
            assert reply.generated_text == expected
        with pytest.raises(grpc.RpcError) as raised:
            stub.Generate(request, metadata=(("x-model-id", "no-such-model"),), timeout=60)
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
        assert "no-such-model" in raised.value.details()


def test_a_pool_named_for_a_model_its_replicas_dont_serve_is_refused(pools):
    """The proxy asks each pool's replicas for their models at start: a name they don't
    report would list a model nobody serves under that name."""
    replicas, names, _ = pools
    started = subprocess.run(
        [sys.executable, "-m", "textgen.service.cli", "proxy", "--pool",
         f"{names[0]}=127.0.0.1:{replicas[0].port}", "--pool",
         f"gpt-4o=127.0.0.1:{replicas[1].port}", "--port", str(free_port()),
         "--pool-timeout", "20"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert started.returncode == 1, started.stdout + started.stderr
    assert f"--pool gpt-4o: the replica at 127.0.0.1:{replicas[1].port} serves " in started.stderr
    assert repr(names[1]) in started.stderr


def test_native_grpc_openai_methods_go_by_their_json_model(pools):
    """The SDK's OpenAI methods over gRPC carry the body's `model` as HTTP does: no
    metadata needed."""
    replicas, names, proxy = pools
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
    with Client(f"127.0.0.1:{proxy.http_port}", timeout=60) as client:
        for replica, name in zip(replicas, names):
            answer = client.completions({**body, "model": name})["choices"][0]["text"]
            assert answer == direct_completion(replica, name)
        with pytest.raises(NotFoundError) as raised:
            client.completions({**body, "model": "no-such-model"})
    assert "no-such-model" in str(raised.value)


def test_a_stored_response_is_found_in_its_models_pool(pools):
    """A retrieval names no model: its id names the replica that stored it, whose pool
    the proxy picks (not the first pool's)."""
    _, names, proxy = pools
    client = openai_client(proxy)
    made = client.responses.create(
        model=names[1], input=PROMPT, max_output_tokens=TOKENS, temperature=0
    )
    found = client.responses.retrieve(made.id)
    assert (found.id, found.model, found.output_text) == (made.id, names[1], made.output_text)
