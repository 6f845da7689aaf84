"""The Responses API's store (service/openai/response_store.py): bounded by a TTL and by
size, oldest first; and the items it keeps, as chat messages (service/openai/responses.py)."""

from __future__ import annotations

import json

import pytest
from textgen.service.openai.common import OpenAIRequestError
from textgen.service.openai.response_store import ENTRY_OVERHEAD, ResponseStore
from textgen.service.openai.responses import items_to_messages


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def conversation(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def size(messages: list[dict]) -> int:
    return len(json.dumps(messages, ensure_ascii=False)) + ENTRY_OVERHEAD


def test_entries_expire_after_the_ttl():
    clock = Clock()
    store = ResponseStore(max_bytes=10_000, ttl=60, clock=clock)
    assert store.put("a", conversation("hi"))
    clock.now = 30
    assert store.put("b", conversation("yo"))
    assert store.get("a") == conversation("hi")
    clock.now = 61
    assert store.get("a") is None and store.get("b") == conversation("yo")
    assert len(store) == 1 and store.bytes == size(conversation("yo"))
    clock.now = 91
    assert store.get("b") is None and store.bytes == 0


def test_the_size_cap_evicts_the_oldest_first():
    one = size(conversation("x" * 100))
    store = ResponseStore(max_bytes=3 * one, ttl=60, clock=Clock())
    for key in "abc":
        assert store.put(key, conversation("x" * 100))
    assert store.put("d", conversation("x" * 100))
    assert store.get("a") is None
    assert [store.get(k) is not None for k in "bcd"] == [True, True, True]
    assert store.bytes == 3 * one <= store.max_bytes


def test_an_entry_over_the_cap_alone_is_not_kept():
    store = ResponseStore(max_bytes=1000, ttl=60, clock=Clock())
    assert store.put("small", conversation("hi"))
    assert not store.put("big", conversation("x" * 2000))
    assert store.get("big") is None and store.get("small") is not None


def test_storing_an_id_again_replaces_it():
    store = ResponseStore(max_bytes=10_000, ttl=60, clock=Clock())
    store.put("a", conversation("one"))
    store.put("a", conversation("two!"))
    assert store.get("a") == conversation("two!") and len(store) == 1
    assert store.bytes == size(conversation("two!"))


def test_a_zero_sized_store_keeps_nothing():
    store = ResponseStore(max_bytes=0)
    assert not store.enabled
    assert not store.put("a", conversation("hi")) and store.get("a") is None


TWO = {"type": "input_text", "text": "2"}


def test_items_become_chat_messages_and_calls_join_one_assistant_turn():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [TWO]},
    ]  # fmt: skip
    messages = items_to_messages(items, "input")
    assert messages[:2] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert messages[2]["role"] == "assistant"
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[3:] == [
        {"role": "tool", "content": "one", "tool_call_id": "c1"},
        {"role": "tool", "content": "2", "tool_call_id": "c2"},
    ]


@pytest.mark.parametrize(
    "item",
    [
        {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]},
        {"role": "wizard", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "f"},
        {"type": "function_call_output", "call_id": "c1", "output": 3},
        {"type": "computer_call", "call_id": "c1"},
        "hello",
    ],
)
def test_items_that_cannot_be_read_are_refused_naming_input(item):
    with pytest.raises(OpenAIRequestError) as info:
        items_to_messages([item], "input")
    assert info.value.param == "input" and "input[0]" in info.value.message
