"""The OpenAI request models (service/openai/protocol.py) on their own, no server: the
document describes exactly the fields they declare, and what they refuse comes back as
OpenAIRequestError naming the field as the client wrote it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from textgen.service.openai import protocol
from textgen.service.openai.common import OpenAIRequestError
from textgen.service.openai.parse import parse_body, parse_value
from textgen.service.openai.responses_protocol import ResponsesBody

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = json.loads((REPO / "envoy" / "openapi.json").read_text())["components"]["schemas"]


def make_openapi():
    spec = importlib.util.spec_from_file_location("make_openapi", REPO / "scripts/make_openapi.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(make_openapi().OPENAI_REQUESTS))
def test_the_document_declares_the_fields_the_model_reads(name):
    model = make_openapi().OPENAI_REQUESTS[name]
    fields = {f.alias or n for n, f in model.model_fields.items()}
    assert set(SCHEMAS[name]["properties"]) == fields
    required = {f.alias or n for n, f in model.model_fields.items() if f.is_required()}
    assert set(SCHEMAS[name].get("required", ())) == required
    # any other field is refused, unless null
    assert SCHEMAS[name]["additionalProperties"] == {"type": "null"}


TEXT_PARTS = (
    'must be a string or a list of text parts ({"type": "text", "text": ...}) and image'
    ' parts ({"type": "image_url", "image_url": {"url": "data:..." or "https://..."}})'
)


def chat(**fields) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def refusal(model, body: bytes) -> OpenAIRequestError:
    with pytest.raises(OpenAIRequestError) as info:
        parse_body(model, body)
    return info.value


def test_an_undeclared_field_is_refused_by_name_unless_null():
    error = refusal(protocol.ChatCompletionBody, chat(verbosity="high", n="2"))
    assert error.param == "verbosity"
    assert error.message == "`verbosity` is not supported"
    assert parse_body(protocol.ChatCompletionBody, chat(verbosity=None)).n is None
    error = refusal(ResponsesBody, b'{"input": "hi", "text": {"verbosity": "low"}}')
    assert (error.param, error.message) == ("text", "`text.verbosity` is not supported")


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"n": "2"}, "n", "`n` must be an integer"),
        ({"n": True}, "n", "`n` must be an integer"),
        ({"n": 2.0}, "n", "`n` must be an integer"),
        ({"top_p": 1.5}, "top_p", "`top_p` must be > 0 and <= 1. Given: 1.5"),
        ({"seed": 2**64}, "seed", f"`seed` must be >= 0 and <= {2**64 - 1}. Given: {2**64}"),
        ({"stop": [1]}, "stop", "`stop` must be a string or a list of strings"),
        ({"messages": []}, "messages", "`messages` must not be empty"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},  # no URL
            "messages",
            f"`messages[0].content` {TEXT_PARTS}",
        ),
        ({"top_logprobs": 2}, "top_logprobs", "`top_logprobs` requires `logprobs: true`"),
    ],
)
def test_a_refusal_names_the_field_as_sent(fields, param, message):
    error = refusal(protocol.ChatCompletionBody, chat(**fields))
    assert (error.param, error.message) == (param, message)


def test_union_tags_are_not_part_of_the_path():
    """pydantic's locations carry the union member tried ('list[...]', 'message'): the
    client's path doesn't."""
    body = b'{"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}'
    error = refusal(ResponsesBody, body)
    assert error.param == "input"
    assert error.message.startswith("`input[0].content[0]`: type 'input_audio' is not supported")
    error = refusal(ResponsesBody, b'{"input": 5}')
    assert error.message == "`input` must be a string or an array"


def test_the_body_itself():
    assert refusal(protocol.ChatCompletionBody, b"[]").message == "the body must be a JSON object"
    assert refusal(protocol.ChatCompletionBody, b"").param is None
    assert "not valid JSON" in refusal(protocol.ChatCompletionBody, b"{").message
    nan = chat()[:-1] + b', "top_p": NaN}'
    assert "finite" in refusal(protocol.ChatCompletionBody, nan).message


def test_a_decoded_body_follows_the_same_rules():
    with pytest.raises(OpenAIRequestError) as info:
        parse_value(protocol.VllmTokenizeBody, {"prompt": "hi", "add_special_tokens": "yes"})
    assert info.value.param == "add_special_tokens"
    assert info.value.message == "`add_special_tokens` must be a boolean"
    assert parse_value(protocol.VllmTokenizeBody, {"prompt": "hi", "chat_template": None}).prompt


def test_chat_template_kwargs_may_not_set_what_the_server_sets():
    body = parse_body(
        protocol.ChatCompletionBody,
        chat(chat_template_kwargs={"enable_thinking": False}, reasoning_effort="low"),
    )
    assert body.chat_template_kwargs == {"enable_thinking": False}
    for name in ("messages", "tools", "add_generation_prompt", "tokenize", "chat_template"):
        error = refusal(protocol.ChatCompletionBody, chat(chat_template_kwargs={name: 1}))
        assert error.param == "chat_template_kwargs" and f"`{name}`" in error.message
    error = refusal(protocol.ChatCompletionBody, chat(reasoning_effort="extreme"))
    assert error.param == "reasoning_effort"
    error = refusal(
        protocol.ChatCompletionBody,
        chat(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}),
    )
    assert error.param == "reasoning_effort"
    error = refusal(protocol.ChatCompletionBody, chat(chat_template_kwargs=["x"]))
    assert error.param == "chat_template_kwargs"
