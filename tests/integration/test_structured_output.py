"""Structured output on the embedded model, through a real Envoy: TGI's `grammar` (JSON
schema, regex) on /generate, OpenAI's `response_format`, and tool calling with the
unmodified `openai` SDK, streaming and not."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import huggingface_hub
import jsonschema
import openai
import pytest
import requests
from support.servers import ServerThread
from support.tiers import server_fixture
from textgen.sdk import Client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
DTYPE = os.environ.get("TEXTGEN_TEST_DTYPE", "float32")  # bfloat16: try the other path


def chat_prompt(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


@server_fixture(scope="module")
def server():
    from textgen.service.settings.table import Settings

    # float32 whatever the CPU: "auto" is bfloat16 where the CPU has native bf16, and the
    # greedy answers these tests lean on (a text answer under tool_choice auto, a short
    # JSON object) would then differ from machine to machine
    settings = Settings(
        hostname="127.0.0.1", grpc_port=0, no_envoy=True, max_batch_total_tokens=32768, dtype=DTYPE
    )
    srv = ServerThread(settings, http=True).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=300
    )


def generate(server, inputs: str, **parameters) -> dict:
    resp = requests.post(
        f"{server.http_url}/generate",
        json={"inputs": inputs, "parameters": {"details": True, **parameters}},
        timeout=300,
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


NAME = {"type": "string", "maxLength": 24}
# Bounds as a careful schema author writes them: a 135M model left free to type digits
# may never stop (`"priority": 1000000...` until max_new_tokens)
INT = {"type": "integer", "minimum": 0, "maximum": 100000}
NUM = {"type": "number", "minimum": -1000, "maximum": 1000}
SCHEMAS = [
    ("a person", _obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a city", _obj({"city": NAME, "country": NAME, "population": INT})),
    ("a book", _obj({"title": NAME, "author": NAME, "year": INT})),
    ("the weather", _obj({"temperature": NUM, "unit": {"enum": ["celsius", "fahrenheit"]}})),
    ("a yes/no answer", _obj({"answer": {"type": "boolean"}})),
    (
        "a list of fruits",
        _obj({"fruits": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 4}}),
    ),
    ("a point", _obj({"x": NUM, "y": NUM})),
    ("a product", _obj({"name": NAME, "price": NUM, "in_stock": {"type": "boolean"}})),
    (
        "a color",
        _obj(
            {
                "color": {"enum": ["red", "green", "blue"]},
                "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
            }
        ),
    ),
    ("a date", _obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}})),
    ("a user", _obj({"user": _obj({"id": INT, "email": NAME})})),
    (
        "scores",
        {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 100},
            "minItems": 2,
            "maxItems": 5,
        },
    ),
    ("a pet", _obj({"name": NAME, "species": {"enum": ["cat", "dog", "fish"]}, "age": INT})),
    (
        "a movie",
        _obj({"title": NAME, "rating": {"type": "number", "minimum": 0, "maximum": 10}}, ["title"]),
    ),
    ("a car", _obj({"make": NAME, "model": NAME, "electric": {"type": "boolean"}})),
    ("a number", {"type": "integer", "minimum": 0, "maximum": 1000}),
    (
        "a sentiment",
        _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}, "confidence": NUM}),
    ),
    ("an address", _obj({"street": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    (
        "a team",
        _obj(
            {
                "team": NAME,
                "members": {"type": "array", "items": _obj({"name": NAME}), "maxItems": 3},
            }
        ),
    ),
    ("a nullable note", _obj({"note": {"anyOf": [NAME, {"type": "null"}]}, "priority": INT})),
]


def test_twenty_schemas_in_one_batch_all_validate(server):
    """20 concurrent /generate requests, each with its own JSON schema: every output
    parses and validates, and ends because the JSON is complete."""

    def ask(item):
        what, schema = item
        prompt = chat_prompt(f"Give me {what} as JSON.")
        return generate(
            server, prompt, max_new_tokens=160, grammar={"type": "json", "value": schema}
        )

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        answers = list(pool.map(ask, SCHEMAS))
    for (what, schema), answer in zip(SCHEMAS, answers):
        value = json.loads(answer["generated_text"])
        jsonschema.validate(value, schema)
        assert answer["details"]["finish_reason"] == "eos_token", (what, answer["generated_text"])


def test_regex_and_json_schema_grammar_types(server):
    prompt = chat_prompt("What is a phone number?")
    out = generate(
        server, prompt, max_new_tokens=20, grammar={"type": "regex", "value": "[0-9]{3}-[0-9]{4}"}
    )
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", out["generated_text"])
    schema = _obj({"city": NAME})
    # TGI's json_schema form, and a schema sent as a string: same grammar, same greedy text
    a = generate(
        server,
        prompt,
        max_new_tokens=40,
        grammar={"type": "json_schema", "value": {"schema": schema}},
    )
    b = generate(
        server, prompt, max_new_tokens=40, grammar={"type": "json", "value": json.dumps(schema)}
    )
    assert a["generated_text"] == b["generated_text"]
    jsonschema.validate(json.loads(a["generated_text"]), schema)


def test_sampled_constrained_requests_follow_the_schema(server):
    schema = _obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})
    for seed in range(3):
        out = generate(
            server, chat_prompt("Describe a person as JSON."), max_new_tokens=80, do_sample=True,
            temperature=1.0, top_k=50, top_p=0.95, seed=seed,
            grammar={"type": "json", "value": schema},
        )  # fmt: skip
        jsonschema.validate(json.loads(out["generated_text"]), schema)


def test_constrained_neighbours_leave_greedy_outputs_unchanged(server):
    # prompts whose greedy path has no near-tie: fp32 CPU matmuls are not bitwise
    # batch-invariant, so a near-tie can flip with any change of batch (constrained or not)
    prompts = [chat_prompt(q) for q in ("What is the capital of France?", "Name a color.")]
    alone = [generate(server, p, max_new_tokens=24)["generated_text"] for p in prompts]
    schema = _obj({"answer": NAME})
    jobs = [(p, None) for p in prompts] + [(p, {"type": "json", "value": schema}) for p in prompts]

    def run(job):
        prompt, grammar = job
        extra = {"grammar": grammar} if grammar else {}
        return generate(server, prompt, max_new_tokens=24, **extra)["generated_text"]

    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(run, jobs))
    assert together[: len(prompts)] == alone
    for text in together[len(prompts) :]:
        assert text.startswith("{")


@pytest.mark.parametrize(
    ("grammar", "needle"),
    [
        ({"type": "regex", "value": "[a-"}, "unclosed character class"),
        ({"type": "json", "value": {"type": "florp"}}, "florp"),
        ({"type": "json", "value": "{not json"}, "not JSON"),
        ({"type": "json", "value": 3}, "must be an object"),
        ({"type": "xml", "value": "<a/>"}, "unknown type"),
        ({"type": "regex", "value": {"a": 1}}, "must be a string"),
    ],
)
def test_invalid_grammars_are_validation_errors(server, grammar, needle):
    resp = requests.post(
        f"{server.http_url}/generate",
        json={"inputs": "hi", "parameters": {"max_new_tokens": 5, "grammar": grammar}},
        timeout=60,
    )
    assert resp.status_code == 422, resp.text
    body = resp.json()
    assert body["error_type"] == "validation" and needle in body["error"]


def test_invalid_grammar_over_grpc_is_invalid_argument(server):
    with Client(server.target, timeout=60) as sdk, pytest.raises(Exception) as info:
        sdk.generate("hi", max_new_tokens=5, grammar={"type": "regex", "value": "(unclosed"})
    assert getattr(
        info.value, "code", None
    ) == grpc.StatusCode.INVALID_ARGUMENT or "INVALID_ARGUMENT" in str(info.value)
    # the engine is fine afterwards
    assert generate(server, "Hello", max_new_tokens=3)["details"]["generated_tokens"] == 3


# OpenAI -------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers",
        "parameters": _obj({"a": {"type": "number"}, "b": {"type": "number"}}),
    },
}
TOOLS = [WEATHER, ADD]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _check_call(call, tool: dict) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_response_format_json_schema_and_json_object(client):
    schema = _obj({"city": NAME, "temperature_c": {"type": "number"}})
    out = client.chat.completions.create(
        model="tgi", messages=ASK_WEATHER, max_tokens=80, temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": schema, "strict": True},
        },
    )  # fmt: skip
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    out = client.chat.completions.create(
        model="tgi",
        messages=[{"role": "user", "content": 'Reply with the JSON object {"ok": true}.'}],
        max_tokens=200, temperature=0, response_format={"type": "json_object"},
    )  # fmt: skip
    assert isinstance(json.loads(out.choices[0].message.content), dict)


# A schema the model would not follow unprompted: the keys and the code come from it alone.
CAPITAL = _obj({"capital": NAME, "country_code": {"enum": ["FR", "DE", "IT"]}})
ASK_CAPITAL = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]


def test_huggingface_hub_json_object_with_value_follows_the_schema(server):
    """TGI's `{"type": "json_object", "value": <schema>}` (json_object is an alias of json
    in TGI's router), as huggingface_hub's InferenceClient sends it."""
    hf = huggingface_hub.InferenceClient(base_url=server.http_url, timeout=300)
    out = hf.chat_completion(
        messages=ASK_CAPITAL, max_tokens=60, temperature=0,
        response_format={"type": "json_object", "value": CAPITAL},
    )  # fmt: skip
    jsonschema.validate(json.loads(out.choices[0].message.content), CAPITAL)


def test_langchain_structured_output_follows_the_schema(server):
    """LangChain's ChatHuggingFace.with_structured_output(method="json_schema") sends
    `{"type": "json_object", "schema": <schema>}`; it gets an answer of that shape."""
    from langchain_huggingface import ChatHuggingFace, HuggingFaceEndpoint

    llm = HuggingFaceEndpoint(
        endpoint_url=server.http_url, max_new_tokens=60, temperature=0.01, seed=0
    )
    structured = ChatHuggingFace(llm=llm).with_structured_output(
        {"title": "Capital", **CAPITAL}, method="json_schema"
    )
    jsonschema.validate(structured.invoke(ASK_CAPITAL[0]["content"]), CAPITAL)


def test_chat_ignore_eos_generates_every_token(client):
    """`ignore_eos` on chat (vLLM's extension, which benchmark tools send): without it
    the short answer ends at EOS; with it, max_tokens tokens come."""
    ask = {"model": "tgi", "messages": ASK_CAPITAL, "max_tokens": 48, "temperature": 0}
    short = client.chat.completions.create(**ask)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 48
    full = client.chat.completions.create(**ask, extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 48


def test_tool_calling_flow_with_the_openai_sdk(client):
    """tools -> tool_calls -> tool result -> final answer, as an agent loop runs it."""
    first = client.chat.completions.create(
        model="tgi", messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=80, temperature=0,
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    tool = {t["function"]["name"]: t for t in TOOLS}[call.function.name]
    _check_call(call, tool)

    messages = [
        *ASK_WEATHER,
        choice.message,  # the SDK's own message object goes back as it came
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"temperature": 18, "sky": "cloudy"}),
        },
    ]
    final = client.chat.completions.create(
        model="tgi",
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=40,
        temperature=0,
    )
    answer = final.choices[0]
    assert answer.message.tool_calls is None
    assert answer.message.content and answer.finish_reason in ("stop", "length")


def test_streamed_tool_call_matches_the_full_answer(client):
    kwargs = {
        "model": "tgi", "messages": ASK_WEATHER, "tools": TOOLS, "tool_choice": "required",
        "parallel_tool_calls": False, "max_tokens": 80, "temperature": 0,
    }  # fmt: skip
    full = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content is None
    head = first.tool_calls[0]
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == full.function.name and head.function.arguments == ""
    pieces = []
    for c in chunks[1:-1]:
        delta = c.choices[0].delta
        assert delta.role is None and delta.content is None
        (part,) = delta.tool_calls
        assert part.index == 0 and part.id is None and part.function.name is None
        pieces.append(part.function.arguments)
    assert len(pieces) > 1  # the arguments arrive as they are generated
    assert "".join(pieces) == full.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # the SDK's own stream accumulator agrees
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == (
        full.function.name,
        full.function.arguments,
    )


def test_named_tool_choice_calls_that_tool(client):
    out = client.chat.completions.create(
        model="tgi", messages=[{"role": "user", "content": "What is 2 plus 3?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=60, temperature=0,
    )  # fmt: skip
    calls = out.choices[0].message.tool_calls
    assert len(calls) == 1
    _check_call(calls[0], ADD)
    assert out.choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_and_auto_answer_in_text(client):
    for choice in ("none", "auto"):
        out = client.chat.completions.create(
            model="tgi", messages=[{"role": "user", "content": "Tell me a short joke."}],
            tools=TOOLS, tool_choice=choice, max_tokens=30, temperature=0,
        )  # fmt: skip
        message = out.choices[0].message
        assert message.tool_calls is None and message.content, choice
        assert "<tool_call>" not in message.content


@pytest.mark.parametrize(
    "extra",
    [
        {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS},
        {"tool_choice": "required"},
        {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
        {"tools": TOOLS, "tool_choice": "sometimes"},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "florp"}},
            }
        },
        {"response_format": {"type": "yaml"}},
    ],
)
def test_bad_tools_and_formats_are_openai_errors(client, extra):
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(model="tgi", messages=ASK_WEATHER, max_tokens=5, **extra)
    assert info.value.body["type"] == "validation"


def test_text_answer_beside_tools_streams_with_its_logprobs(client):
    kwargs = {
        "model": "tgi", "messages": [{"role": "user", "content": "Tell me a short joke."}],
        "tools": TOOLS, "tool_choice": "auto", "max_tokens": 20, "temperature": 0,
        "logprobs": True,
    }  # fmt: skip
    full = client.chat.completions.create(**kwargs).choices[0]
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.message.content
    streamed = [
        e.token for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert streamed == [e.token for e in full.logprobs.content]


# the Responses API ----------------------------------------------------------------------


def test_responses_api_on_the_embedded_model(client):
    """/v1/responses with the real model: it answers, calls a forced tool with arguments
    valid against the schema, and answers in text once the call's output comes back."""
    answer = client.responses.create(
        model="tgi", input="What is the capital of France?", max_output_tokens=30, temperature=0
    )
    assert "Paris" in answer.output_text
    weather = {"type": "function", **WEATHER["function"]}
    first = client.responses.create(
        model="tgi", input=ASK_WEATHER, tools=[weather], tool_choice={"type": "function",
        "name": "get_weather"}, max_output_tokens=80, temperature=0,
    )  # fmt: skip
    (call,) = first.output
    assert call.type == "function_call" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}
    final = client.responses.create(
        model="tgi", previous_response_id=first.id, input=[result], tools=[weather],
        tool_choice="none", max_output_tokens=40, temperature=0,
    )  # fmt: skip
    (message,) = final.output
    assert message.type == "message" and final.output_text.strip()
    assert "<tool_call>" not in final.output_text
