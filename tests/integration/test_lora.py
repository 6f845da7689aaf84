"""LoRA adapters through a real server and a real Envoy: three random adapters made with
peft on the tiny model (ranks 8, 16, 64 on other layers each), picked by TGI's
`adapter_id`, OpenAI's `model` (chat, completions, responses), Anthropic's `model` and
the SDK, each answer equal to peft's merged model's `generate`; a concurrent mix of them
and the base model; /v1/models and /info; loads and unloads at run time under load,
behind the API key."""

from __future__ import annotations

import copy
import json
import threading

import anthropic
import openai
import pytest
import requests
import torch
from peft import PeftModel
from support.lora_adapters import make_adapter
from support.servers import ServerThread, tiny_settings
from support.tiers import server_fixture
from textgen.sdk import Client
from textgen.sdk.errors import ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.timeout(120)

KEY = "sk-lora"
AUTH = {"authorization": f"Bearer {KEY}"}
ADAPTERS = {
    "r8": (8, ["q_proj", "v_proj"]),
    "r16": (16, ["o_proj", "gate_proj", "down_proj"]),
    "r64": (64, ["k_proj", "up_proj", "q_proj"]),
}
PROMPT = "The quick brown fox"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapter_dirs(base, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    dirs = {
        name: make_adapter(base, root / name, rank, targets, seed, std=0.3)
        for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items())
    }
    dirs["late"] = make_adapter(base, root / "late", 4, ["v_proj", "down_proj"], 9, std=0.3)
    return dirs


@pytest.fixture(scope="module")
def expected(base, adapter_dirs, tiny_model_dir) -> dict[str | None, list[int]]:
    """peft's merged model's greedy tokens for PROMPT, per adapter (None: the base)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    models = {None: base}
    for name, folder in adapter_dirs.items():
        models[name] = PeftModel.from_pretrained(copy.deepcopy(base), folder).merge_and_unload()
    out = {}
    for name, model in models.items():
        with torch.inference_mode():
            tokens = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                eos_token_id=None,
                pad_token_id=tokenizer.pad_token_id,
            )
        out[name] = tokens[0, ids.shape[1] :].tolist()
    assert len({tuple(t) for t in out.values()}) == len(out), "the adapters must matter"
    return out


@server_fixture(scope="module")
def server(tiny_model_dir, adapter_dirs):
    settings = tiny_settings(
        tiny_model_dir,
        no_envoy=False,
        api_key=KEY,
        lora_adapters=tuple((n, adapter_dirs[n]) for n in ADAPTERS),
        max_loras=3,
    )
    server = ServerThread(settings, http=True).start()
    yield server
    server.stop()


def tgi_tokens(server, adapter_id: str | None, **extra) -> list[int]:
    parameters = {"max_new_tokens": NEW_TOKENS, "details": True, "ignore_eos": True, **extra}
    if adapter_id is not None:
        parameters["adapter_id"] = adapter_id
    resp = requests.post(
        f"{server.http_url}/generate",
        json={"inputs": PROMPT, "parameters": parameters},
        headers=AUTH,
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    return [t["id"] for t in resp.json()["details"]["tokens"]]


def test_each_adapter_through_tgi_equals_pefts_merged_model(server, expected):
    for name in [None, *ADAPTERS]:
        assert tgi_tokens(server, name) == expected[name], name


def test_a_concurrent_mix_gives_each_request_its_own_answer(server, expected):
    names = [None, *ADAPTERS] * 4
    results: dict[int, list[int]] = {}

    def run(i: int, name: str | None) -> None:
        results[i] = tgi_tokens(server, name)

    threads = [threading.Thread(target=run, args=(i, n)) for i, n in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert {i: results.get(i) for i in range(len(names))} == {
        i: expected[n] for i, n in enumerate(names)
    }


def test_openai_model_picks_the_adapter_on_every_route(server, expected, tiny_model_dir):
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=KEY, max_retries=0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tokenizer.decode(expected["r16"])
    completion = client.completions.create(
        model="r16",
        prompt=PROMPT,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert (completion.model, completion.choices[0].text) == ("r16", text)
    # the base model by its id, and by "tgi"
    for base_name in (str(tiny_model_dir), "tgi"):
        base = client.completions.create(
            model=base_name, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert base.choices[0].text == tokenizer.decode(expected[None])
    messages = [{"role": "user", "content": PROMPT}]
    chats = {
        name: client.chat.completions.create(
            model=name, messages=messages, max_tokens=6, temperature=0
        )
        for name in ("r8", "r64")
    }
    assert chats["r8"].model == "r8"
    assert chats["r8"].choices[0].message.content != chats["r64"].choices[0].message.content
    # chat and responses render the same prompt: the same adapter gives the same answer
    response = client.responses.create(
        model="r8", input=messages, max_output_tokens=6, temperature=0
    )
    assert (response.model, response.output_text) == ("r8", chats["r8"].choices[0].message.content)
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(model="r9", messages=messages, max_tokens=2)
    assert info.value.body["param"] == "model"
    assert "unknown LoRA adapter 'r9'" in info.value.body["message"]


def test_anthropic_model_picks_the_adapter_and_an_unknown_one_is_not_found(server):
    """Anthropic's `model` picks an adapter as OpenAI's does (the same prompt: chat's
    answer); a name nothing serves is Anthropic's 404 not_found_error."""
    claude = anthropic.Anthropic(base_url=server.http_url, api_key=KEY, max_retries=0)
    chat = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": PROMPT}]
    message = claude.messages.create(
        model="r8", max_tokens=6, messages=messages, extra_body={"temperature": 0}
    )
    reference = chat.chat.completions.create(
        model="r8", messages=messages, max_tokens=6, temperature=0
    )
    assert (message.model, message.content[0].text) == (
        "r8",
        reference.choices[0].message.content,
    )
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="r9", max_tokens=2, messages=messages)
    assert info.value.body["error"]["type"] == "not_found_error"
    assert "unknown LoRA adapter 'r9'" in info.value.body["error"]["message"]


def test_tgi_refuses_an_unknown_adapter_naming_it(server):
    resp = requests.post(
        f"{server.http_url}/generate",
        json={"inputs": PROMPT, "parameters": {"adapter_id": "nope"}},
        headers=AUTH,
        timeout=30,
    )
    assert resp.status_code == 422
    assert resp.json()["error_type"] == "validation"
    assert "unknown LoRA adapter 'nope'" in resp.json()["error"]


def test_models_and_info_list_the_adapters(server, tiny_model_dir, adapter_dirs):
    models = requests.get(f"{server.http_url}/v1/models", headers=AUTH, timeout=30).json()
    cards = {m["id"]: m for m in models["data"]}
    assert list(cards) == [str(tiny_model_dir), "r8", "r16", "r64"]
    assert cards["r16"]["parent"] == str(tiny_model_dir)
    assert cards["r16"]["root"] == adapter_dirs["r16"]
    assert "parent" not in cards[str(tiny_model_dir)]
    info = requests.get(f"{server.http_url}/info", headers=AUTH, timeout=30).json()
    assert (info["lora_adapters"], info["max_loras"], info["max_lora_rank"]) == (
        ["r8", "r16", "r64"],
        3,
        64,
    )


def test_the_sdk_picks_adapters_and_manages_them(server, expected, adapter_dirs):
    with Client(server.target, api_key=KEY) as client:
        out = client.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, adapter_id="r64")
        assert [t.id for t in out.details.tokens] == expected["r64"]
        with pytest.raises(ValidationError, match="unknown LoRA adapter 'late'"):
            client.generate(PROMPT, adapter_id="late")
        assert client.load_lora_adapter("late", adapter_dirs["late"])[-1] == "late"
        out = client.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, adapter_id="late")
        assert [t.id for t in out.details.tokens] == expected["late"]
        assert "late" not in client.unload_lora_adapter("late")
        with pytest.raises(ValidationError, match="no LoRA adapter named 'late'"):
            client.unload_lora_adapter("late")


def test_load_and_unload_under_load_fail_no_request(server, expected, adapter_dirs):
    """Streams of every adapter run throughout; an adapter is loaded, used, and unloaded
    while its own requests run: every request that was accepted gets its whole answer."""
    stop = threading.Event()
    failures: list[str] = []
    done: list[str | None] = []

    def keep_asking(name: str | None) -> None:
        while not stop.is_set():
            tokens = tgi_tokens(server, name)
            if tokens != expected[name]:
                failures.append(f"{name}: {tokens}")
            done.append(name)

    workers = [threading.Thread(target=keep_asking, args=(n,)) for n in (None, "r8", "r64")]
    for w in workers:
        w.start()
    try:
        url = server.http_url
        resp = requests.post(
            f"{url}/v1/load_lora_adapter",
            json={"lora_name": "late", "lora_path": adapter_dirs["late"]},
            timeout=60,
        )
        assert resp.status_code == 401  # behind the API key
        resp = requests.post(
            f"{url}/v1/load_lora_adapter",
            json={"lora_name": "late", "lora_path": adapter_dirs["late"]},
            headers=AUTH,
            timeout=60,
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["lora_adapters"] == ["r8", "r16", "r64", "late"]
        # a stream of the new adapter, unloaded after its first token: it finishes with it
        stream = requests.post(
            f"{url}/generate_stream",
            json={
                "inputs": PROMPT,
                "parameters": {
                    "max_new_tokens": NEW_TOKENS,
                    "ignore_eos": True,
                    "adapter_id": "late",
                },
            },
            headers=AUTH,
            stream=True,
            timeout=60,
        )
        events = (json.loads(line[5:]) for line in stream.iter_lines() if line.startswith(b"data:"))
        tokens = [next(events)["token"]["id"]]
        resp = requests.post(
            f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=AUTH, timeout=60
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["lora_adapters"] == ["r8", "r16", "r64"]
        tokens += [event["token"]["id"] for event in events]
        assert tokens == expected["late"]
        resp = requests.post(
            f"{url}/generate",
            json={"inputs": PROMPT, "parameters": {"adapter_id": "late"}},
            headers=AUTH,
            timeout=30,
        )
        assert resp.status_code == 422
        bad = requests.post(
            f"{url}/v1/load_lora_adapter",
            json={"lora_name": "bad", "lora_path": "/nowhere/at/all"},
            headers=AUTH,
            timeout=30,
        )
        assert bad.status_code == 422  # in OpenAI's shape, as every /v1/ route
        assert bad.json()["error"]["message"] == (
            "LoRA adapter 'bad' (/nowhere/at/all) is neither an adapter folder nor a Hub repo id"
        )
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    assert not failures
    assert {None, "r8", "r64"} <= set(done)


def test_metrics_count_requests_by_loaded_adapter(server):
    text = requests.get(f"{server.http_url}/metrics", headers=AUTH, timeout=30).text
    assert 'textgen_lora_requests_total{adapter="r8"}' in text
    assert 'textgen_lora_generated_tokens_total{adapter="r64"}' in text
    assert 'adapter="late"' not in text  # unloaded: its series went with it


@pytest.mark.server
def test_bench_prices_the_adapters_against_the_base(tiny_model_dir, adapter_dirs, tmp_path):
    """`textgen bench --adapters`: the same load spread over the adapters, its tok/s over
    the base model's load (alternating rounds, the median ratio)."""
    import argparse

    from textgen.service.bench.command import add_bench_arguments, run

    pairs = tuple((n, adapter_dirs[n]) for n in ("r8", "r16"))
    server = ServerThread(tiny_settings(tiny_model_dir, lora_adapters=pairs)).start()
    try:
        parser = argparse.ArgumentParser()
        add_bench_arguments(parser)
        out = tmp_path / "report.json"
        args = parser.parse_args(
            ["--target", server.target, "--concurrency", "4", "--max-new-tokens", "6",
             "--ignore-eos", "--adapters", "r8,r16", "--rounds", "2", "--json", str(out)]
        )  # fmt: skip
        assert run(args) == 0
        stats = server.replica.servicer.recorder.metrics
        served = {n: stats.lora_requests.labels(n)._value.get() for n in ("r8", "r16")}
    finally:
        server.stop()
    lora = json.loads(out.read_text())["lora"]
    assert lora["adapters"] == ["r8", "r16"] and lora["errors"] == 0
    assert lora["output_tokens"] == 4 * 6 and len(lora["ratios"]) == 2
    assert served["r8"] >= 4 and served["r16"] >= 4  # two loads and their warm-ups, halved
