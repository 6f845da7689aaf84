"""OpenAI's face through a real Envoy: the `openai` SDK and huggingface_hub's chat
client, unmodified, against the tiny model; answers agree with TGI's /generate on the
same templated prompt; errors come back in OpenAI's shape."""

from __future__ import annotations

import huggingface_hub
import openai
import pytest
import requests
from textgen.sdk import http_streams
from transformers import AutoTokenizer

pytestmark = pytest.mark.timeout(60)

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(http_server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{http_server.http_url}/v1", api_key="unused", max_retries=0, timeout=30
    )


@pytest.fixture(scope="module")
def templated(tiny_model_dir) -> str:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def generate(http_server, inputs: str, max_new_tokens: int) -> str:
    resp = requests.post(
        f"{http_server.http_url}/generate",
        json={"inputs": inputs, "parameters": {"max_new_tokens": max_new_tokens}},
        timeout=30,
    )
    resp.raise_for_status()
    return resp.json()["generated_text"]


def test_chat_completion_equals_generate(client, http_server, templated):
    out = client.chat.completions.create(
        model="tgi", messages=MESSAGES, max_tokens=10, temperature=0
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == generate(http_server, templated, 10)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_stream_with_usage(client):
    full = client.chat.completions.create(
        model="tgi", messages=MESSAGES, max_tokens=10, temperature=0
    )
    stream = client.chat.completions.create(
        model="tgi",
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[
        0
    ].finish_reason
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    )


def test_completions_and_models(client, http_server):
    out = client.completions.create(
        model="tgi", prompt="The quick brown fox", max_tokens=6, temperature=0
    )
    assert out.object == "text_completion"
    assert out.choices[0].text == generate(http_server, "The quick brown fox", 6)
    streamed = client.completions.create(
        model="tgi", prompt="The quick brown fox", max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text
    models = client.models.list()
    assert [m.id for m in models.data] == [http_server.settings.model_id]


def test_huggingface_hub_chat_stream(http_server, client):
    hf = huggingface_hub.InferenceClient(base_url=http_server.http_url)
    chunks = list(
        hf.chat.completions.create(messages=MESSAGES, max_tokens=10, temperature=0, stream=True)
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    full = client.chat.completions.create(
        model="tgi", messages=MESSAGES, max_tokens=10, temperature=0
    )
    assert content == full.choices[0].message.content


@pytest.mark.parametrize(
    "body",
    [
        {"model": "tgi", "max_tokens": 5},
        {"model": "tgi", "messages": "hi"},
        {"model": "tgi", "messages": MESSAGES, "temperature": "hot"},
        {"model": "tgi", "messages": MESSAGES, "max_tokens": 100000},
    ],
)
def test_bad_requests_get_openai_errors(http_server, body):
    resp = requests.post(f"{http_server.http_url}/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 422
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["type"] == "validation" and error["message"]


def test_openai_sdk_raises_on_bad_request(client):
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(model="tgi", messages=MESSAGES, max_tokens=100000)
    # OpenAI's field names, in the message and as `param`, not TGI's max_new_tokens
    assert "`max_tokens` must be <=" in str(info.value)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(
            model="tgi",
            messages=MESSAGES,
            max_completion_tokens=100000,
            logprobs=True,
            top_logprobs=21,
        )
    assert info.value.body["param"] == "top_logprobs"


def test_sdk_http_streams_read_openai_to_the_end(client, http_server):
    """The SDK's standard-library helper reads each OpenAI stream to its end marker
    (chat and completions: `[DONE]`; responses: `response.completed`) without calling
    it incomplete, and says the same as the openai SDK."""
    url, body = http_server.http_url, {"model": "m", "max_tokens": 6, "temperature": 0}
    chunks = list(http_streams.chat_completions_stream(url, {**body, "messages": MESSAGES}))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    expected = client.chat.completions.create(messages=MESSAGES, stream=False, **body)
    assert text == expected.choices[0].message.content
    completions = list(http_streams.completions_stream(url, {**body, "prompt": "Hello"}))
    assert completions[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    events = list(
        http_streams.responses_stream(url, {"model": "m", "input": "Hi", "max_output_tokens": 6})
    )
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
