"""Anthropic's Messages API without a server (service/anthropic/): a body's conversation
as the chat messages the template gets, its tools as chat's tool plan, its refusals by
name; and the answer, whole and streamed, on recorded outputs (text, tool calls, a
reasoning model's thinking) cut into every chunking tried: the events, accumulated by the
`anthropic` SDK's own stream reader, give the message the whole answer is."""

from __future__ import annotations

import json
import random

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from support.tiny_model import build_tokenizer
from textgen.service.anthropic.messages import (
    MessagesRequest,
    parse_count_tokens_request,
    parse_messages_request,
)
from textgen.service.anthropic.output import MessageRenderer, MessageStream
from textgen.service.engine.types import FinishInfo, FinishReason, TokenEvent, TokenInfo
from textgen.service.intake.request import GenerateRequest
from textgen.service.openai.common import OpenAIRequestError
from textgen.service.openai.reasoning import (
    OPENED,
    START,
    THINK_CLOSE,
    THINK_OPEN,
    with_thought,
)
from textgen.service.openai.tools import Tool, ToolPlan

pytestmark = pytest.mark.timeout(60)

QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
WEATHER = {
    "name": "get_weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def parse(tokenizer, **fields) -> MessagesRequest:
    body = {"model": "tgi", "max_tokens": 16, "messages": [QUESTION], **fields}
    return parse_messages_request(json.dumps(body).encode(), tokenizer)


def prompt(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# the request ---------------------------------------------------------------------------


def test_blocks_and_strings_render_alike(tokenizer):
    blocks = parse(
        tokenizer,
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Hi."}]},
            {"role": "user", "content": "What is the weather in Paris?"},
        ],
    )
    expected = prompt(
        tokenizer,
        [
            {"role": "system", "content": "Be brief.\n\nBe kind."},
            {"role": "user", "content": "Hi.\n\nWhat is the weather in Paris?"},
        ],
    )
    assert blocks.generate.inputs == expected  # consecutive user turns are one
    assert blocks.generate.parameters.max_new_tokens == 16
    assert not blocks.stream and blocks.tools is None and blocks.reasoning is None


def test_tool_use_and_tool_result_are_chat_tool_calls_and_tool_messages(tokenizer):
    """The tiny template knows no tools: chat's rendering writes the calls and results in
    the tags, as it does for OpenAI's tool_calls and tool messages."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}
    failed = {
        "type": "tool_result",
        "tool_use_id": "toolu_2",
        "content": [{"type": "text", "text": "timeout"}],
        "is_error": True,
    }
    request = parse(
        tokenizer,
        messages=[
            QUESTION,
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Let me look.", "signature": ""},
                    {"type": "text", "text": "Looking."},
                    call,
                    {**call, "id": "toolu_2"},
                ],
            },
            {"role": "user", "content": [result, failed, {"type": "text", "text": "Well?"}]},
        ],
        tools=[WEATHER],
        tool_choice={"type": "none"},
    )
    calls = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    expected = prompt(
        tokenizer,
        [
            QUESTION,
            {"role": "assistant", "content": f"Looking.\n{calls}\n{calls}"},
            {
                "role": "user",
                "content": "<tool_response>\nSunny\n</tool_response>\n"
                "<tool_response>\nError: timeout\n</tool_response>",
            },
            {"role": "user", "content": "Well?"},
        ],
    )
    assert request.generate.inputs == expected  # the thinking left out
    assert request.tools is None  # tool_choice none: no tools, no grammar
    assert request.generate.lark is None


@pytest.mark.parametrize(
    ("choice", "plan"),
    [
        (None, ("auto", True)),
        ({"type": "auto", "disable_parallel_tool_use": True}, ("auto", False)),
        ({"type": "any"}, ("required", True)),
        ({"type": "tool", "name": "get_weather"}, ("function", False)),
    ],
)
def test_tool_choice_is_chats_plan(tokenizer, choice, plan):
    fields = {"tools": [WEATHER]} | ({"tool_choice": choice} if choice else {})
    request = parse(tokenizer, **fields)
    assert (request.tools.choice, request.tools.parallel) == plan
    assert request.generate.lark == request.tools.lark()
    assert [t.name for t in request.tools.tools] == ["get_weather"]
    assert request.generate.name("grammar") == "tools"


def test_sampling_fields(tokenizer):
    greedy = parse(tokenizer, temperature=0, top_k=5, stop_sequences=["."]).generate.parameters
    assert not greedy.do_sample and greedy.stop == (".",)
    sampled = parse(tokenizer, top_p=0.5, top_k=5).generate.parameters
    assert sampled.do_sample and (sampled.top_p, sampled.top_k) == (0.5, 5)
    assert parse(tokenizer).generate.parameters.do_sample  # Anthropic's default: 1.0


def test_a_last_assistant_turn_is_continued(tokenizer):
    request = parse(tokenizer, messages=[QUESTION, {"role": "assistant", "content": "It is"}])
    assert request.generate.inputs == prompt(tokenizer, [QUESTION]) + "It is"


def test_count_tokens_renders_the_same_prompt(tokenizer):
    fields = {"system": "Be brief.", "tools": [WEATHER]}
    counted = parse_count_tokens_request(
        json.dumps({"model": "tgi", "messages": [QUESTION], **fields}).encode(), tokenizer
    )
    assert counted.inputs == parse(tokenizer, **fields).generate.inputs


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_tokens": None}, "`max_tokens` is required"),
        ({"model": None}, "`model` is required"),
        ({"top_a": 1}, "`top_a` is not supported"),
        ({"messages": []}, "`messages` must not be empty"),
        ({"messages": [{"role": "system", "content": "x"}]}, "`messages[0].role` must be"),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "`messages[0].content[0]`: type 'document' is not supported",
        ),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "tool_result"}]}]},
            "`messages[0].content[0].tool_use_id` is required",
        ),
        (
            {
                "messages": [
                    QUESTION,
                    {"role": "user", "content": [{"type": "thinking", "thinking": "x"}]},
                ]
            },
            "`messages[1].content[0]`: a thinking block goes in assistant turns only",
        ),
        (
            {
                "messages": [
                    QUESTION,
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                    },
                ]
            },
            "the last turn is the assistant's tool_use",
        ),
        ({"system": [{"type": "image"}]}, "`system[0].type` must be 'text'"),
        ({"temperature": 1.5}, "`temperature` must be >= 0 and <= 1"),
        ({"metadata": {"user_id": "u", "tier": "gold"}}, "`metadata.tier` is not supported"),
        ({"tool_choice": {"type": "any"}}, "`tool_choice` is only allowed when `tools`"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "`tools[0].type` must be"),
        ({"tools": [WEATHER, WEATHER]}, "`tools` must have distinct function names"),
        ({"thinking": {"type": "adaptive"}}, "`thinking`: type 'adaptive' is not supported"),
        ({"thinking": {"type": "enabled", "budget_tokens": 8}}, "this model does not think"),
    ],
)
def test_refused_by_name(tokenizer, fields, message):
    body = {"model": "tgi", "max_tokens": 16, "messages": [QUESTION], **fields}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(OpenAIRequestError) as info:
        parse_messages_request(json.dumps(body).encode(), tokenizer)
    assert message in info.value.message


def test_a_thinking_budget_needs_the_tags_as_tokens():
    with pytest.raises(ValueError, match="tags as tokens"):
        with_thought("start: answer\nanswer: /.*/\n", OPENED, None, budget=8)
    grammar = with_thought("start: answer\nanswer: /.*/\n", OPENED, (5, 6), budget=8)
    assert "thought[max_tokens=8]: THOUGHT" in grammar and "thought? <[6]>" in grammar


# the answer ----------------------------------------------------------------------------


def request(
    tools: ToolPlan | None = None, reasoning: str | None = None, stop=()
) -> MessagesRequest:
    return MessagesRequest(
        generate=GenerateRequest(inputs="x"),
        stream=True,
        stop=tuple(stop),
        tools=tools,
        reasoning=reasoning,
    )


def run(
    output: str, chunks: list[str], reason: FinishReason, generated: str | None = None
) -> list[TokenEvent]:
    """The engine's events of `output` cut into `chunks` (one per token)."""
    finish = FinishInfo(reason, generated or output, len(chunks), 7, 0, 0.0, 0.01, cached_tokens=3)
    return [
        TokenEvent(i + 1, TokenInfo(i, text, -1.0, False), text, finish=finish if last else None)
        for i, (text, last) in enumerate(
            (text, i == len(chunks) - 1) for i, text in enumerate(chunks)
        )
    ]


def chunkings(text: str, count: int = 24) -> list[list[str]]:
    rng = random.Random(text)
    out = [[text], list(text)]
    for _ in range(count):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


def accumulated(renderer: MessageRenderer, events: list[TokenEvent]) -> tuple[dict, list[str]]:
    """The streamed events read back by the SDK (as client.messages.stream does), and
    their types in order."""
    stream = MessageStream(renderer)
    frames = b"".join(data for event in events for data in stream.events(event))
    snapshot, kinds, buffers = None, [], {}
    for frame in frames.decode().split("\n\n")[:-1]:
        name, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        kinds.append(event["type"])
        if event["type"] == "ping":
            continue
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=buffers)
    return snapshot.model_dump(exclude_none=True), kinds


def without_ids(blocks: list[dict]) -> list[dict]:
    """Blocks without the calls' ids (new on each answer)."""
    return [{k: v for k, v in block.items() if k != "id"} for block in blocks]


def whole(renderer: MessageRenderer, events: list[TokenEvent]) -> dict:
    return json.loads(renderer.message(events))


WEATHER_PLAN = ToolPlan((Tool("get_weather", None, WEATHER["input_schema"]),), "auto")
CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
)
CASES = {
    # name: (request, output, finish, content types, stop_reason)
    "text": (request(), "Paris, of course.", FinishReason.EOS_TOKEN, ["text"], "end_turn"),
    "cut": (request(), "Paris is the cap", FinishReason.LENGTH, ["text"], "max_tokens"),
    "calls": (
        request(WEATHER_PLAN), CALLS, FinishReason.EOS_TOKEN, ["tool_use"] * 2, "tool_use",
    ),
    "text with tools": (
        request(WEATHER_PLAN), "No need to call.", FinishReason.EOS_TOKEN, ["text"], "end_turn",
    ),
    "thinking": (
        request(reasoning=OPENED),
        f"The user asks about Paris.\n{THINK_CLOSE}\n\nSunny.",
        FinishReason.EOS_TOKEN,
        ["thinking", "text"],
        "end_turn",
    ),
    "thinking, then calls": (
        request(WEATHER_PLAN, reasoning=START),
        f"{THINK_OPEN}\nA call.\n{THINK_CLOSE}\n\n{CALLS}",
        FinishReason.EOS_TOKEN,
        ["thinking", "tool_use", "tool_use"],
        "tool_use",
    ),
    "cut while thinking": (
        request(reasoning=OPENED), "Still think", FinishReason.LENGTH, ["thinking", "text"],
        "max_tokens",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_streamed_equals_whole_in_any_chunking(name):
    req, output, reason, types, stop_reason = CASES[name]
    for chunks in chunkings(output):
        renderer = MessageRenderer("m", req, input_tokens=7)
        events = run(output, chunks, reason)
        message = whole(renderer, events)
        assert [block["type"] for block in message["content"]] == types
        assert message["stop_reason"] == stop_reason
        assert message["usage"] == {
            "input_tokens": 4,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 3,
            "output_tokens": len(chunks),
        }
        streamed, kinds = accumulated(renderer, events)
        assert without_ids(streamed["content"]) == without_ids(message["content"]), chunks
        assert (streamed["stop_reason"], streamed["usage"]) == (stop_reason, message["usage"])
        assert kinds[:3] == ["message_start", "content_block_start", "ping"]
        assert kinds[-2:] == ["message_delta", "message_stop"]
        assert kinds.count("content_block_start") == kinds.count("content_block_stop") == len(types)


def test_the_answer_blocks():
    renderer = MessageRenderer("m", CASES["thinking, then calls"][0], input_tokens=7)
    output = CASES["thinking, then calls"][1]
    content = whole(renderer, run(output, [output], FinishReason.EOS_TOKEN))["content"]
    assert content[0] == {"type": "thinking", "thinking": "A call.", "signature": ""}
    assert [(b["name"], b["input"]) for b in content[1:]] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert all(b["id"].startswith("toolu_") for b in content[1:])
    # a call cut short keeps the budget's reason, and an input of {}
    cut = CALLS[:60]
    message = whole(renderer, run(cut, [cut], FinishReason.LENGTH))
    assert message["stop_reason"] == "max_tokens" and message["content"][-1]["input"] == {}


def test_a_stop_sequence_is_named_and_left_out():
    req = request(stop=["never", "STOP"])
    output = "Hello STOP"
    for chunks in chunkings(output):
        renderer = MessageRenderer("m", req, input_tokens=7)
        events = run(output, chunks, FinishReason.STOP_SEQUENCE)
        message = whole(renderer, events)
        assert message["content"] == [{"type": "text", "text": "Hello "}]
        assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "STOP")
        streamed, _ = accumulated(renderer, events)
        assert streamed["content"] == message["content"]
        assert streamed["stop_sequence"] == "STOP"
