"""OpenAI's Responses API (/v1/responses) through a real Envoy, with the unmodified
`openai` SDK, on the tiny model: answers agree with TGI's /generate and with chat on the
same conversation, streams come in OpenAI's documented order and add up to the answer,
function tools round-trip (by items and by previous_response_id), and what can't be
honoured is a typed 422 naming the field. The same RPC over native gRPC, via the SDK.
Stored responses as the SDK reads them: retrieve, input_items (paged), delete, and a
typed 404 for one not kept."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import requests
from support.servers import ServerThread, tiny_settings
from support.tiers import server_fixture
from textgen.sdk import Client
from transformers import AutoTokenizer

pytestmark = pytest.mark.timeout(120)

QUESTION = "What is the capital of France?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
FORCED = {"type": "function", "name": "get_weather"}
GREEDY = {"model": "tgi", "temperature": 0}
ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


@server_fixture(scope="module")
def server(tiny_model_dir):
    # the tiny model's whole context: tools are described in ~530 of its byte-sized tokens
    srv = ServerThread(tiny_settings(tiny_model_dir, max_total_tokens=1024), http=True).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=60
    )


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def generate(server, inputs: str, max_new_tokens: int) -> dict:
    resp = requests.post(
        f"{server.http_url}/generate",
        json={"inputs": inputs, "parameters": {"max_new_tokens": max_new_tokens, "details": True}},
        timeout=60,
    )
    resp.raise_for_status()
    return resp.json()


def raw_stream(server, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE frame of a streamed /v1/responses call."""
    resp = requests.post(
        f"{server.http_url}/v1/responses", json={**body, "stream": True}, timeout=60
    )
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = []
    for frame in resp.text.split("\n\n"):
        if not frame.strip():
            continue
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def check_order(events: list[tuple[str, dict]]) -> list[str]:
    """Event names match their data's type, sequence numbers count from 0, and the types
    follow OpenAI's documented order; returns the types."""
    types = [data["type"] for _, data in events]
    assert [name for name, _ in events] == types
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    body = types[2:-1]
    while body:
        assert body[0] == "response.output_item.added", body
        kind = events[types.index(body[0])][1]["item"]["type"]
        if kind == "message":
            head = ["response.output_item.added", "response.content_part.added"]
            delta = "response.output_text.delta"
            tail = [
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
            ]
        else:
            head = ["response.output_item.added"]
            delta = "response.function_call_arguments.delta"
            tail = ["response.function_call_arguments.done", "response.output_item.done"]
        assert body[: len(head)] == head, body
        body = body[len(head) :]
        while body and body[0] == delta:
            body = body[1:]
        assert body[: len(tail)] == tail, body
        body = body[len(tail) :]
    return types


def test_plain_answer_equals_generate(client, server, tokenizer):
    out = client.responses.create(input=QUESTION, max_output_tokens=10, **GREEDY)
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
    )
    expected = generate(server, templated, 10)
    assert out.object == "response" and out.id.startswith("resp_")
    assert out.output_text == expected["generated_text"]
    (message,) = out.output
    assert message.type == "message" and message.role == "assistant"
    assert out.usage.input_tokens == len(tokenizer(templated)["input_ids"])
    assert out.usage.output_tokens == expected["details"]["generated_tokens"]
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    if expected["details"]["finish_reason"] == "length":
        assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    else:
        assert out.status == "completed" and out.incomplete_details is None


def test_instructions_are_the_system_message(client, server, tokenizer):
    out = client.responses.create(
        input=QUESTION, instructions="Answer in French.", max_output_tokens=10, **GREEDY
    )
    templated = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": QUESTION}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert out.instructions == "Answer in French."
    assert out.output_text == generate(server, templated, 10)["generated_text"]


def test_max_output_tokens_makes_an_incomplete_response(client, server):
    body = {"input": QUESTION, "max_output_tokens": 3, "ignore_eos": True, **GREEDY}
    out = client.responses.create(
        input=QUESTION, max_output_tokens=3, extra_body={"ignore_eos": True}, **GREEDY
    )
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 3 and out.output[0].status == "incomplete"
    events = raw_stream(server, body)
    assert check_order(events)[-1] == "response.incomplete"
    final = events[-1][1]["response"]
    assert final["status"] == "incomplete" and final["output"][0]["status"] == "incomplete"
    assert final["usage"]["output_tokens"] == 3


def test_stream_events_in_order_add_up_to_the_answer(client, server):
    body = {"input": QUESTION, "max_output_tokens": 12, **GREEDY}
    full = client.responses.create(**body)
    events = raw_stream(server, body)
    types = check_order(events)
    assert types.count("response.output_text.delta") > 1  # as the tokens are generated
    data = [d for _, d in events]
    deltas = "".join(d["delta"] for d in data if d["type"] == "response.output_text.delta")
    (done,) = [d for d in data if d["type"] == "response.output_text.done"]
    final = data[-1]["response"]
    assert deltas == done["text"] == full.output_text
    assert final["output"][0]["content"][0]["text"] == full.output_text
    assert final["usage"] == full.usage.model_dump(exclude_none=True)
    created = data[0]["response"]
    assert created["id"] == final["id"] and created["status"] == "in_progress"
    item_id = data[2]["item"]["id"]
    assert all(d["item_id"] == item_id for d in data[3:-2] if "item_id" in d)

    # the SDK's raw stream and its stream helper see the same
    sdk_types = [e.type for e in client.responses.create(stream=True, **body)]
    assert sdk_types == types
    with client.responses.stream(**body) as stream:
        helper = list(stream)
    assert [e.type for e in helper] == types
    assert helper[-1].response.output_text == full.output_text
    text_events = [e for e in helper if e.type == "response.output_text.delta"]
    assert text_events[-1].snapshot == full.output_text  # the helper's running text


def test_forced_function_tool_is_a_function_call(client):
    out = client.responses.create(
        input="What is the weather in Paris?", tools=[WEATHER], tool_choice=FORCED,
        max_output_tokens=150, **GREEDY,
    )  # fmt: skip
    (call,) = out.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert out.status == "completed" and out.tools[0].name == "get_weather"
    assert out.tool_choice.name == "get_weather"


def test_streamed_function_call_matches_the_full_answer(client, server):
    body = {
        "input": "What is the weather in Paris?", "tools": [WEATHER], "tool_choice": "required",
        "parallel_tool_calls": False, "max_output_tokens": 150, **GREEDY,
    }  # fmt: skip
    (call,) = client.responses.create(**body).output
    events = raw_stream(server, body)
    types = check_order(events)
    data = [d for _, d in events]
    added = data[2]["item"]
    assert added["type"] == "function_call" and added["name"] == call.name
    assert added["call_id"].startswith("call_") and added["arguments"] == ""
    pieces = [d["delta"] for d in data if d["type"] == "response.function_call_arguments.delta"]
    assert len(pieces) > 1  # the arguments arrive as they are generated
    (done,) = [d for d in data if d["type"] == "response.function_call_arguments.done"]
    assert "".join(pieces) == done["arguments"] == call.arguments
    assert types[-1] == "response.completed"
    with client.responses.stream(**body) as stream:
        final = stream.get_final_response()
    (streamed,) = final.output
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)


def tool_round_trip(client) -> tuple[object, list]:
    """A forced call, then the conversation with its result, as an agent loop builds it."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(
        input=ask, tools=[WEATHER], tool_choice=FORCED, max_output_tokens=150, **GREEDY
    )
    (call,) = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}
    return first, [*ask, *first.output, result]


def test_function_call_output_round_trip_gives_the_chat_answer(client):
    first, conversation = tool_round_trip(client)
    final = client.responses.create(
        input=conversation, tools=[WEATHER], tool_choice="none", max_output_tokens=8,
        extra_body={"ignore_eos": True}, **GREEDY,
    )  # fmt: skip
    (message,) = final.output
    assert message.type == "message" and final.output_text
    # the same conversation as chat messages: the same prompt, so the same answer
    call = first.output[0]
    chat = client.chat.completions.create(
        messages=[
            conversation[0],
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": '{"sky": "sunny"}'},
        ],
        tools=[{"type": "function", "function": {k: WEATHER[k] for k in WEATHER if k != "type"}}],
        tool_choice="none", max_tokens=8, extra_body={"ignore_eos": True}, **GREEDY,
    )  # fmt: skip
    assert final.output_text == chat.choices[0].message.content
    assert final.usage.input_tokens == chat.usage.prompt_tokens


def test_previous_response_id_continues_the_conversation(client):
    first, conversation = tool_round_trip(client)
    tail = {"tools": [WEATHER], "tool_choice": "none", "max_output_tokens": 8, **GREEDY}
    by_items = client.responses.create(input=conversation, extra_body={"ignore_eos": True}, **tail)
    by_id = client.responses.create(
        previous_response_id=first.id, input=[conversation[-1]],
        extra_body={"ignore_eos": True}, **tail,
    )  # fmt: skip
    assert by_id.previous_response_id == first.id
    assert by_id.output_text == by_items.output_text
    assert by_id.usage.input_tokens == by_items.usage.input_tokens
    # a chain: the second one is kept too
    third = client.responses.create(previous_response_id=by_id.id, input="Thanks!", **tail)
    assert third.usage.input_tokens > by_id.usage.input_tokens + by_id.usage.output_tokens


def test_store_false_is_not_kept(client):
    out = client.responses.create(input=QUESTION, max_output_tokens=2, store=False, **GREEDY)
    assert out.store is False
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.responses.create(previous_response_id=out.id, input="more", **GREEDY)
    assert info.value.body["param"] == "previous_response_id"
    assert "not kept" in info.value.body["message"]


def test_text_format_json_schema_is_followed(client):
    body = {
        "input": "Is Paris in France? Answer in JSON.", "max_output_tokens": 60,
        "text": {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER}}, **GREEDY,
    }  # fmt: skip
    out = client.responses.create(**body)
    jsonschema.validate(json.loads(out.output_text), ANSWER)
    assert out.status == "completed" and out.text.format.type == "json_schema"
    # a completed stream: the SDK's helper assembles the same response
    with client.responses.stream(**body) as stream:
        final = stream.get_final_response()
    assert final.id != out.id and final.output_text == out.output_text


def test_logprobs_are_included_when_asked(client, server):
    body = {
        "input": QUESTION, "max_output_tokens": 5, "include": ["message.output_text.logprobs"],
        "top_logprobs": 2, **GREEDY,
    }  # fmt: skip
    out = client.responses.create(**body)
    logprobs = out.output[0].content[0].logprobs
    assert logprobs and all(len(entry.top_logprobs) == 2 for entry in logprobs)
    assert "".join(entry.token for entry in logprobs) == out.output_text
    data = [d for _, d in raw_stream(server, body)]
    streamed = [
        e["token"] for d in data if d["type"] == "response.output_text.delta" for e in d["logprobs"]
    ]
    assert streamed == [entry.token for entry in logprobs]
    plain = client.responses.create(**{**body, "include": None, "top_logprobs": None})
    assert plain.output[0].content[0].logprobs == []


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].image_url",  # a text-only model
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
        ({"input": [{"type": "reasoning", "summary": [{"type": "bogus"}]}]}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs"]}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"reasoning": {"summary": "auto"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"text": {"verbosity": "low"}}, "text"),
        ({"text": {"format": {"type": "yaml"}}}, "text"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"max_output_tokens": 100000}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"stop": ["."]}, "stop"),
        ({"input": []}, "input"),
    ],
)
def test_what_cannot_be_honoured_is_a_typed_422(client, extra, param):
    with pytest.raises(openai.UnprocessableEntityError) as info:
        # extra_body: sent as it is, fields the SDK doesn't know included
        client.responses.create(input=QUESTION, max_output_tokens=4, extra_body=extra, **GREEDY)
    error = info.value.body
    assert error["type"] == "validation" and error["param"] == param, error
    assert error["message"]


def test_native_grpc_sdk_agrees_with_http(client, server):
    body = {"input": QUESTION, "max_output_tokens": 8, "temperature": 0}
    http = client.responses.create(model="tgi", **body)
    with Client(server.target, timeout=60) as sdk:
        full = sdk.responses(body)
        events = list(sdk.responses_stream(body))
    assert full["object"] == "response" and full["output"][0]["content"][0]["text"] == (
        http.output_text
    )
    assert events[0]["type"] == "response.created" and events[-1]["type"] in (
        "response.completed",
        "response.incomplete",
    )
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == http.output_text


# the store, as OpenAI's API shows it (retrieve, input items, delete) --------------------


def test_a_stored_response_is_retrieved_listed_and_deleted(client):
    first = client.responses.create(input=QUESTION, max_output_tokens=4, **GREEDY)
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    items = client.responses.input_items.list(first.id)
    (item,) = items.data
    assert (item.type, item.role, item.content[0].text) == ("message", "user", QUESTION)
    assert (items.first_id, items.last_id, items.has_more) == (item.id, item.id, False)
    # a continuation lists what it was made from: the first one's items and output, then its own
    second = client.responses.create(
        previous_response_id=first.id, input="And Italy?", max_output_tokens=4, **GREEDY
    )
    asc = client.responses.input_items.list(second.id, order="asc")
    assert [(i.role, i.content[0].text) for i in asc.data] == [
        ("user", QUESTION),
        ("assistant", first.output_text),
        ("user", "And Italy?"),
    ]
    assert asc.data[0].id == item.id and asc.data[1].id == first.output[0].id
    # the default order is the newest first; the SDK pages on with `after`
    paged = list(client.responses.input_items.list(second.id, limit=1))
    assert [i.id for i in paged] == [i.id for i in reversed(asc.data)]
    assert client.responses.delete(first.id) is None
    for call in (
        lambda: client.responses.retrieve(first.id),
        lambda: client.responses.input_items.list(first.id),
        lambda: client.responses.delete(first.id),
    ):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.body["type"] == "not_found" and "deleted" in info.value.body["message"]
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.responses.create(previous_response_id=first.id, input="more", **GREEDY)
    assert info.value.body["param"] == "previous_response_id"
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_streamed_and_tool_responses_are_stored_as_they_completed(client, server):
    _, last_event = raw_stream(server, {"input": QUESTION, "max_output_tokens": 6, **GREEDY})[-1]
    final = last_event["response"]
    stored = requests.get(f"{server.http_url}/v1/responses/{final['id']}", timeout=30)
    assert stored.status_code == 200 and stored.json() == final
    first, conversation = tool_round_trip(client)
    assert client.responses.retrieve(first.id).output[0].type == "function_call"
    last = client.responses.create(
        input=conversation, tools=[WEATHER], tool_choice="none", max_output_tokens=4, **GREEDY
    )
    kinds = [i.type for i in client.responses.input_items.list(last.id, order="asc")]
    assert kinds == ["message", "function_call", "function_call_output"]
    listed = client.responses.input_items.list(last.id, order="asc").data
    assert listed[1].call_id == first.output[0].call_id and listed[2].output == '{"sky": "sunny"}'


def test_a_response_not_kept_is_a_typed_404(client):
    unkept = client.responses.create(input=QUESTION, max_output_tokens=2, store=False, **GREEDY)
    for rid in (unkept.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.retrieve(rid)
        error = info.value.body
        assert (error["type"], error["param"]) == ("not_found", "response_id")
        assert "store: false" in error["message"]


def test_what_the_store_routes_cannot_honour_is_a_typed_422(client, server):
    stored = client.responses.create(input=QUESTION, max_output_tokens=2, **GREEDY)
    refusals = [
        (lambda: client.responses.retrieve(stored.id, stream=True), "stream"),
        # the SDK writes `include[]=...`; Envoy's Lua filter makes it the `include` field
        (lambda: client.responses.retrieve(stored.id, include=["reasoning.encrypted_content"]),
         "include"),
        (lambda: client.responses.input_items.list(stored.id, include=["file_search_call.results"]),
         "include"),
        (lambda: client.responses.input_items.list(stored.id, limit=0), "limit"),
        (lambda: client.responses.input_items.list(stored.id, after="msg_unknown"), "after"),
    ]  # fmt: skip
    for call, param in refusals:
        with pytest.raises(openai.UnprocessableEntityError) as info:
            call()
        assert (info.value.body["type"], info.value.body["param"]) == ("validation", param)
    url = f"{server.http_url}/v1/responses/{stored.id}/input_items"
    resp = requests.get(url, params={"order": "sideways"}, timeout=30)
    assert resp.status_code == 422 and resp.json()["error"]["param"] == "order"
    resp = requests.post(f"{server.http_url}/v1/responses/{stored.id}", json={}, timeout=30)
    assert resp.status_code == 405
