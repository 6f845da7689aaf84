"""The Responses API's store (service/openai/response_store.py): bounded by a TTL and by
size, oldest first, and its ids; the items it keeps, as chat messages and as OpenAI's
input items (service/openai/responses.py); and how a stored response is shown: retrieved,
deleted, its input items paged (service/openai/stored_responses.py)."""

from __future__ import annotations

import json

import pytest
from textgen.envoy import affinity
from textgen.service.openai import stored_responses
from textgen.service.openai.common import OpenAIRequestError
from textgen.service.openai.response_store import (
    ENTRY_OVERHEAD,
    ID_PREFIX,
    RANDOM_HEX,
    ResponseStore,
    StoredResponse,
    new_response_id,
    replica_of,
)
from textgen.service.openai.responses import input_items, items_to_messages
from textgen.service.openai.stored_responses import ItemsQuery, ResponseNotFound


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def conversation(text: str) -> StoredResponse:
    return StoredResponse({"output": []}, (), ({"role": "user", "content": text},))


def size(stored: StoredResponse) -> int:
    return len(json.dumps(stored.__dict__, ensure_ascii=False)) + ENTRY_OVERHEAD


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


def test_a_deleted_entry_is_gone_and_frees_its_bytes():
    store = ResponseStore(max_bytes=10_000, ttl=60, clock=Clock())
    store.put("a", conversation("one"))
    store.put("b", conversation("two"))
    assert store.delete("a") and not store.delete("a")
    assert store.get("a") is None and store.get("b") is not None
    assert store.bytes == size(conversation("two"))


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


# ids -------------------------------------------------------------------------------


def test_an_id_names_the_replica_the_front_proxy_reached():
    plain = new_response_id()
    assert plain.startswith("resp_") and len(plain) == len("resp_") + 32
    assert replica_of(plain) is None
    for address in ("10.1.2.3:50051", "[::1]:7000", "textgen-0:50051"):
        rid = new_response_id(address)
        assert rid.startswith("resp_") and all(c in "0123456789abcdef" for c in rid[5:])
        assert replica_of(rid) == address
    # a header that is no address is left out of the id
    assert replica_of(new_response_id("x" * 100 + ":1")) is None
    assert replica_of(new_response_id("a b:1")) is None
    assert replica_of("resp_" + "0" * 32 + "zz") is None and replica_of("msg_1") is None


def test_envoy_decodes_the_ids_the_store_writes():
    """The front proxy's Lua (envoy/affinity.py) reads the address back from the id."""
    assert (affinity.RESPONSE_ID_PREFIX, affinity.RESPONSE_ID_RANDOM_HEX) == (ID_PREFIX, RANDOM_HEX)


# input items and their pages ---------------------------------------------------------


def test_input_becomes_openai_input_items_with_ids():
    items = input_items(
        [
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "id": "msg_mine", "role": "user",
             "content": [{"type": "input_text", "text": "Hi"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [TWO]},
        ]
    )  # fmt: skip
    assert [i["type"] for i in items] == ["message"] * 3 + ["function_call", "function_call_output"]
    assert items[0]["role"] == "developer"
    assert items[0]["content"] == [{"type": "input_text", "text": "Be brief."}]
    assert items[1]["id"] == "msg_mine"
    assert items[2]["content"][0]["type"] == "output_text"
    assert items[4]["output"] == "2" and items[4]["call_id"] == "c1"
    assert all(i["status"] == "completed" and i["id"] for i in items)
    assert len({i["id"] for i in items}) == len(items)
    (one,) = input_items("just text")
    assert one["role"] == "user" and one["content"][0]["text"] == "just text"


def stored_with(n: int) -> ResponseStore:
    store = ResponseStore(max_bytes=100_000, ttl=60, clock=Clock())
    items = tuple({"id": f"msg_{i}", "type": "message"} for i in range(n))
    store.put("resp_a", StoredResponse({"id": "resp_a", "output": []}, items, ()))
    return store


def page(store: ResponseStore, **query) -> dict:
    return json.loads(stored_responses.input_items(store, "resp_a", None, ItemsQuery(**query)))


def test_input_items_page_by_order_and_cursors():
    store = stored_with(5)
    first = page(store, limit=2)
    assert [i["id"] for i in first["data"]] == ["msg_4", "msg_3"]  # desc by default
    assert (first["first_id"], first["last_id"], first["has_more"]) == ("msg_4", "msg_3", True)
    rest = page(store, limit=2, after="msg_3")
    assert [i["id"] for i in rest["data"]] == ["msg_2", "msg_1"] and rest["has_more"]
    last = page(store, limit=2, after="msg_1")
    assert [i["id"] for i in last["data"]] == ["msg_0"] and not last["has_more"]
    asc = page(store, order="asc", limit=100)
    assert [i["id"] for i in asc["data"]] == [f"msg_{i}" for i in range(5)]
    assert [i["id"] for i in page(store, order="asc", limit=2, before="msg_3")["data"]] == [
        "msg_1",
        "msg_2",
    ]
    empty = page(stored_with(0))
    assert empty == {"object": "list", "data": [], "first_id": None, "last_id": None,
                     "has_more": False}  # fmt: skip


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": 101}, "limit"),
        ({"order": "up"}, "order"),
        ({"after": "msg_x"}, "after"),
        ({"before": "msg_x"}, "before"),
        ({"include": ("message.input_image.image_url",)}, "include"),
    ],
)
def test_a_bad_page_query_is_refused_naming_it(query, param):
    with pytest.raises(OpenAIRequestError) as info:
        page(stored_with(3), **query)
    assert info.value.param == param


def test_retrieve_delete_and_not_found():
    store = stored_with(1)
    assert json.loads(stored_responses.retrieve(store, "resp_a", None))["id"] == "resp_a"
    with pytest.raises(OpenAIRequestError):
        stored_responses.retrieve(store, "resp_a", None, stream=True)
    assert json.loads(stored_responses.delete(store, "resp_a", None)) == {
        "id": "resp_a",
        "object": "response",
        "deleted": True,
    }
    with pytest.raises(ResponseNotFound) as info:
        stored_responses.retrieve(store, "resp_a", None)
    assert "deleted" in info.value.message
    elsewhere = new_response_id("10.0.0.7:50051")
    with pytest.raises(ResponseNotFound) as info:
        stored_responses.delete(store, elsewhere, "10.0.0.8:50051")
    assert "stored by replica 10.0.0.7:50051" in info.value.message
    with pytest.raises(ResponseNotFound) as info:
        stored_responses.retrieve(ResponseStore(max_bytes=0), "resp_a", None)
    assert "--responses-store-mb 0" in info.value.message
