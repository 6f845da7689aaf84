"""Anthropic's Messages API through a real Envoy: the `anthropic` SDK, unmodified, against
the tiny model (on a server with an API key, one request at a time). Answers agree with
OpenAI's chat route on the same conversation (the same chat template, tool grammar and
greedy decoding: an independent rendering of the request); the stream's events come in
Anthropic's order; errors come back typed, in Anthropic's shape and statuses."""

from __future__ import annotations

import base64
import io
import json

import anthropic
import openai
import pytest
import requests
from support.servers import ServerThread, tiny_settings
from support.tiers import server_fixture
from transformers import AutoTokenizer

pytestmark = pytest.mark.timeout(120)

KEY = "sekret"
QUESTION = "What is the capital of France?"
MESSAGES = [{"role": "user", "content": QUESTION}]
GREEDY = {"extra_body": {"temperature": 0}}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
# the same tool as OpenAI's chat route takes it
OPENAI_WEATHER = {
    "type": "function",
    "function": {
        "name": WEATHER["name"],
        "description": WEATHER["description"],
        "parameters": WEATHER["input_schema"],
    },
}


@server_fixture(scope="module")
def server(tiny_model_dir):
    # the whole context: tools are described in ~530 of the tiny model's byte-sized
    # tokens; one request at a time, so a held stream makes the next one overloaded
    settings = tiny_settings(
        tiny_model_dir, max_total_tokens=1024, api_key=KEY, max_concurrent_requests=1
    )
    srv = ServerThread(settings, http=True).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.http_url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def chat(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=KEY, max_retries=0, timeout=60)


def create(client, **fields) -> anthropic.types.Message:
    body = {"model": "tgi", "max_tokens": 10, "messages": MESSAGES, **GREEDY, **fields}
    return client.messages.create(**body)


def prompt_tokens(usage) -> int:
    """The prompt's length: the tokens computed and those the prefix cache served."""
    return usage.input_tokens + usage.cache_read_input_tokens


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


# create --------------------------------------------------------------------------------


def test_create_equals_the_chat_route(client, chat, server, tiny_model_dir):
    out = create(client)
    reference = chat.chat.completions.create(
        model="tgi", messages=MESSAGES, max_tokens=10, temperature=0
    )
    assert (out.type, out.role) == ("message", "assistant")
    assert out.id.startswith("msg_") and out.model == server.settings.model_id
    assert [block.type for block in out.content] == ["text"]
    assert out.content[0].text == reference.choices[0].message.content
    assert out.stop_reason == "max_tokens" and out.stop_sequence is None
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    usage = out.usage
    assert prompt_tokens(usage) == len(tokenizer(prompt).input_ids)
    assert usage.cache_creation_input_tokens == 0 and usage.output_tokens == 10


def test_the_prefix_cache_is_read_on_a_repeated_prompt(client):
    create(client)
    usage = create(client).usage
    assert usage.cache_read_input_tokens > 0 and usage.input_tokens >= 1


def test_system_and_blocks_render_as_chat_messages(client, chat):
    system = "You answer in one word."
    plain = create(client, system=system)
    blocks = create(
        client,
        system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
        metadata={"user_id": "u-1"},
    )
    reference = chat.chat.completions.create(
        model="tgi",
        messages=[{"role": "system", "content": system}, *MESSAGES],
        max_tokens=10,
        temperature=0,
    )
    assert text_of(plain) == text_of(blocks) == reference.choices[0].message.content
    assert prompt_tokens(plain.usage) == prompt_tokens(blocks.usage)


def test_a_last_assistant_turn_is_continued(client, server, tiny_model_dir):
    """Prefill: the answer continues the assistant's text, as TGI's /generate continues
    the templated conversation with that text after it."""
    prefix = "The capital"
    continued = create(
        client, max_tokens=4, messages=[*MESSAGES, {"role": "assistant", "content": prefix}]
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    resp = requests.post(
        f"{server.http_url}/generate",
        json={"inputs": prompt + prefix, "parameters": {"max_new_tokens": 4}},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert text_of(continued) == resp.json()["generated_text"]


def test_stop_sequences(client, chat):
    text = text_of(create(client, max_tokens=16))
    stop = text[len(text) // 2 :][:2]
    out = create(client, max_tokens=16, stop_sequences=[stop, "never said"])
    assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", stop)
    assert text_of(out) == text[: text.find(stop)]
    reference = chat.chat.completions.create(
        model="tgi", messages=MESSAGES, max_tokens=16, temperature=0, stop=[stop]
    )
    assert text_of(out) == reference.choices[0].message.content


def test_sampling_knobs_are_honoured(client):
    """Sampled hot, top_k 1 (or a tiny top_p) leaves only the greedy token."""
    greedy = text_of(create(client))
    for knob in ({"top_k": 1}, {"top_p": 1e-6}):
        assert text_of(create(client, extra_body={"temperature": 1.0, **knob})) == greedy
    sampled = {text_of(create(client, extra_body={"temperature": 1.0})) for _ in range(3)}
    assert sampled != {greedy}


# stream --------------------------------------------------------------------------------


def test_stream_helper_equals_create(client):
    whole = create(client)
    with client.messages.stream(model="tgi", max_tokens=10, messages=MESSAGES, **GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == text_of(whole)
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in whole.content]
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert prompt_tokens(final.usage) == prompt_tokens(whole.usage)


def test_raw_events_in_anthropics_order(client, server):
    events = list(create(client, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("content_block_delta")
    assert deltas >= 1
    assert kinds == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0].message
    assert start.content == [] and start.stop_reason is None and start.usage.input_tokens > 0
    assert events[1].content_block.type == "text" and events[1].index == 0
    assert all(e.delta.type == "text_delta" for e in events[2 : 2 + deltas])
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 10
    # on the wire: each event named as its data's type, a ping after the first block's start
    body = {"model": "tgi", "max_tokens": 4, "messages": MESSAGES, "temperature": 0, "stream": True}
    resp = requests.post(
        f"{server.http_url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60
    )
    assert resp.headers["content-type"].startswith("text/event-stream")
    frames = [f for f in resp.text.split("\n\n") if f.strip()]
    named = []
    for frame in frames:
        fields = dict(line.split(": ", 1) for line in frame.splitlines())
        assert json.loads(fields["data"])["type"] == fields["event"]
        named.append(fields["event"])
    assert named[:4] == ["message_start", "content_block_start", "ping", "content_block_delta"]
    assert named[-3:] == ["content_block_stop", "message_delta", "message_stop"]


# tools ---------------------------------------------------------------------------------


def test_tool_use_out_and_tool_result_back_in(client, chat):
    first = create(client, max_tokens=100, tools=[WEATHER], tool_choice={"type": "any"})
    assert first.stop_reason == "tool_use"
    call = first.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.id.startswith("toolu_") and call.input["city"] in ("Paris", "Rome")
    reference = chat.chat.completions.create(
        model="tgi",
        messages=MESSAGES,
        max_tokens=100,
        temperature=0,
        tools=[OPENAI_WEATHER],
        tool_choice="required",
    )
    (expected,) = reference.choices[0].message.tool_calls
    assert call.input == json.loads(expected.function.arguments)

    # the result back in: the answer equals chat's on the same conversation
    result = [
        {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24 degrees"},
    ]
    conversation = [
        *MESSAGES,
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": result},
    ]
    second = create(
        client, max_tokens=8, messages=conversation, tools=[WEATHER], tool_choice={"type": "none"}
    )
    arguments = json.dumps(call.input)
    chat_conversation = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees"},
    ]
    reference = chat.chat.completions.create(
        model="tgi",
        messages=chat_conversation,
        max_tokens=8,
        temperature=0,
        tools=[OPENAI_WEATHER],
        tool_choice="none",
    )
    assert [block.type for block in second.content] == ["text"]
    assert text_of(second) == reference.choices[0].message.content
    assert prompt_tokens(second.usage) == reference.usage.prompt_tokens


def test_tool_use_streamed(client):
    whole = create(client, max_tokens=100, tools=[WEATHER], tool_choice={"type": "any"})
    with client.messages.stream(
        model="tgi",
        max_tokens=100,
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice={"type": "any"},
        **GREEDY,
    ) as s:
        events = list(s)
        final = s.get_final_message()
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [block.type for block in starts] == ["tool_use"] * len(whole.content)
    assert starts[0].input == {} and starts[0].id.startswith("toolu_")
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert json.loads("".join(pieces)) == whole.content[0].input
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content] == [(b.name, b.input) for b in whole.content]


def test_a_named_tool_and_one_call_at_most(client):
    out = create(
        client,
        max_tokens=100,
        tools=[WEATHER, {**WEATHER, "name": "get_time"}],
        tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
    )
    assert [(b.type, b.name) for b in out.content] == [("tool_use", "get_time")]


# count_tokens --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"system": "You answer in one word."},
        {"tools": [WEATHER]},
        {"messages": [*MESSAGES, {"role": "assistant", "content": "The"}]},
    ],
    ids=["plain", "system", "tools", "prefill"],
)
def test_count_tokens_counts_the_prompt_create_takes(client, fields):
    body = {"model": "tgi", "messages": MESSAGES, **fields}
    counted = client.messages.count_tokens(**body)
    usage = client.messages.create(max_tokens=1, **body, **GREEDY).usage
    assert counted.input_tokens == prompt_tokens(usage)


# errors --------------------------------------------------------------------------------


def png() -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (2, 2), "red").save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"max_tokens": anthropic.omit}, "`max_tokens` is required"),
        ({"model": anthropic.omit}, "`model` is required"),
        ({"extra_body": {"frequency_penalty": 1.0}}, "`frequency_penalty` is not supported"),
        ({"extra_body": {"temperature": 1.5}}, "`temperature` must be >= 0 and <= 1"),
        ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "`stop_sequences` supports up to 4"),
        ({"max_tokens": 5000}, "tokens + `max_tokens` must be <= 1024"),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "type 'document' is not supported",
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "`tools[0].type`"),
        ({"thinking": {"type": "enabled", "budget_tokens": 4}}, "this model does not think"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": png(),
                                },
                            },
                            {"type": "text", "text": "What is it?"},
                        ],
                    }
                ]
            },
            "`messages[0].content[0]`: this model is text-only; it takes no images",
        ),
    ],
    ids=[
        "no max_tokens",
        "no model",
        "unknown field",
        "hot",
        "stops",
        "too long",
        "document",
        "server tool",
        "thinking",
        "image",
    ],
)
def test_refused_with_anthropics_400(client, fields, named):
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, **fields)
    assert info.value.status_code == 400
    assert info.value.body["type"] == "error"
    error = info.value.body["error"]
    assert error["type"] == "invalid_request_error" and named in error["message"], error


def test_authentication(server):
    wrong = anthropic.Anthropic(base_url=server.http_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        create(wrong, max_tokens=1)
    assert info.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.count_tokens(model="tgi", messages=MESSAGES)
    # Anthropic's x-api-key (api_key) and a bearer token (auth_token) both carry the key
    bearer = anthropic.Anthropic(base_url=server.http_url, auth_token=KEY, max_retries=0)
    assert create(bearer, max_tokens=1).usage.output_tokens == 1
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "prompt-caching-2024-07-31"}
    resp = requests.post(
        f"{server.http_url}/v1/messages",
        json={"model": "tgi", "max_tokens": 1, "messages": MESSAGES},
        headers={"x-api-key": KEY, **headers},
        timeout=60,
    )
    assert resp.status_code == 200 and resp.json()["type"] == "message"


def test_not_found_in_anthropics_shape(server):
    resp = requests.post(
        f"{server.http_url}/v1/messages/batches", json={}, headers={"x-api-key": KEY}, timeout=30
    )
    assert resp.status_code == 404
    assert resp.json()["type"] == "error" and resp.json()["error"]["type"] == "not_found_error"


def test_a_full_server_answers_429_with_retry_after(client):
    """One request at a time: a stream that holds the permit makes the next request a
    rate_limit_error that says when to come back."""
    with client.messages.stream(
        model="tgi", max_tokens=1000, messages=[{"role": "user", "content": "Hi"}], **GREEDY
    ) as held:
        next(iter(held))  # message_start: the stream runs, holding the one permit
        with pytest.raises(anthropic.RateLimitError) as info:
            create(client, max_tokens=1)
    assert info.value.body["error"]["type"] == "rate_limit_error"
    assert int(info.value.response.headers["retry-after"]) >= 1


def test_a_draining_server_answers_529(client, server):
    servicer = server.replica.servicer
    servicer.draining = True
    try:
        with pytest.raises(anthropic.OverloadedError) as info:
            create(client, max_tokens=1)
    finally:
        servicer.draining = False
    assert info.value.status_code == 529
    assert info.value.body["error"]["type"] == "overloaded_error"
