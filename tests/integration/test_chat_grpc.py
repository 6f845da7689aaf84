"""The OpenAI chat RPC over native gRPC, on the tiny model, through the SDK."""

from __future__ import annotations

import pytest
from textgen.sdk import Client, ValidationError
from textgen.service.openai.common import StopHoldback

pytestmark = pytest.mark.timeout(120)

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def client(tiny_server):
    with Client(tiny_server.target, timeout=60) as c:
        yield c


def test_stream_deltas_equal_the_completion(client, tiny_server):
    body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    full = client.chat_completions(body)
    chunks = list(
        client.chat_completions_stream({**body, "stream_options": {"include_usage": True}})
    )
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == full["choices"][0]["message"]["content"]
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert (
        len(finals) == 1
        and finals[0]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    )
    # the same prompt again: the prefix cache serves its full blocks
    cached = {
        **full["usage"],
        "prompt_tokens_details": chunks[-1]["usage"]["prompt_tokens_details"],
    }
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == cached
    assert cached["prompt_tokens_details"]["cached_tokens"] > 0
    tok = tiny_server.replica.loaded.tokenizer
    prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert full["usage"]["prompt_tokens"] == len(tok(prompt)["input_ids"])
    assert (
        full["usage"]["total_tokens"]
        == full["usage"]["prompt_tokens"] + full["usage"]["completion_tokens"]
    )


def test_list_of_parts_content_and_logprobs(client):
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is the capital"},
                    {"type": "text", "text": " of France?"},
                ],
            }
        ],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    plain = client.chat_completions(
        {**body, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    )
    parts = client.chat_completions(body)
    assert parts["choices"][0]["message"] == plain["choices"][0]["message"]
    entries = parts["choices"][0]["logprobs"]["content"]
    assert entries and all(len(e["top_logprobs"]) == 2 for e in entries)


@pytest.mark.parametrize(
    "body",
    [
        {"max_tokens": 5},
        {"messages": "hello"},
        {"messages": [{"role": "wizard", "content": "hi"}]},
        {"messages": MESSAGES, "max_tokens": "many"},
        {"messages": MESSAGES, "n": 0},
        {"messages": MESSAGES, "top_p": 1.5},
        {"messages": MESSAGES, "max_tokens": 100000},
    ],
)
def test_bad_requests_are_validation_errors(client, body):
    with pytest.raises(ValidationError):
        client.chat_completions(body)


def test_stop_is_left_out_of_the_content(client):
    body = {"messages": MESSAGES, "max_tokens": 16, "temperature": 0}
    free = client.chat_completions(body)["choices"][0]["message"]["content"]
    assert len(free) >= 6, "the tiny model's greedy answer is deterministic and long enough"
    stop = free[3:5]
    cut = free[: free.index(stop)]
    full = client.chat_completions({**body, "stop": stop})
    assert full["choices"][0]["message"]["content"] == cut
    assert full["choices"][0]["finish_reason"] == "stop"
    chunks = list(client.chat_completions_stream({**body, "stop": [stop]}))
    assert (
        "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == cut
    )


def test_stop_holdback_never_shows_a_partial_stop():
    hold = StopHoldback(("STOP",))
    shown = [hold.feed(t, final=False) for t in ["ab", "cS", "T", "x"]]
    assert shown == ["ab", "c", "", "STx"]
    hold = StopHoldback(("STOP",))
    shown = [hold.feed(t, final=False) for t in ["abS", "TO"]] + [hold.feed("Pzz", final=True)]
    assert "".join(shown) == "ab"


def test_completions_single_and_list_prompts(client):
    one = client.completions({"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0})
    assert one["object"] == "text_completion" and len(one["choices"]) == 1
    two = client.completions(
        {"prompt": ["The quick brown fox", "hello"], "max_tokens": 6, "temperature": 0}
    )
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert two["choices"][0]["text"] == one["choices"][0]["text"]
    assert two["usage"]["completion_tokens"] >= one["usage"]["completion_tokens"]


def test_completions_stream_echo_and_usage(client):
    body = {
        "prompt": ["The quick brown fox", "hello"],
        "max_tokens": 5,
        "temperature": 0,
        "echo": True,
    }
    full = client.completions(body)
    chunks = list(client.completions_stream({**body, "stream_options": {"include_usage": True}}))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts[0] == full["choices"][0]["text"] and texts[0].startswith("The quick brown fox")
    assert texts[1] == full["choices"][1]["text"]
    assert chunks[-1]["usage"] == full["usage"]


def test_completions_logprobs_and_suffix(client):
    resp = client.completions({"prompt": "hello", "max_tokens": 3, "temperature": 0, "logprobs": 2})
    lp = resp["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
    assert all(len(t) <= 2 for t in lp["top_logprobs"])
    with pytest.raises(ValidationError):
        client.completions({"prompt": "hello", "suffix": "world"})
    with pytest.raises(ValidationError):
        client.completions({"prompt": ["a"] * 5})
