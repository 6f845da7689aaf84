"""The tool-call parser and grammar builder on their own (no model): however the text is
split into stream deltas, the calls come out the same, in OpenAI's chunk shapes."""

from __future__ import annotations

import json

import pytest
from textgen.service.openai.common import OpenAIRequestError
from textgen.service.openai.tools import ToolCallParser, parse_output, parse_tools, prepare_messages

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "add"}},
]
TWO_CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Pa}ris \\" {", "days": [1, {"a": 2}]}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
)


def plan(choice="auto", **extra):
    return parse_tools({"tools": TOOLS, "tool_choice": choice, **extra})


def replay(text: str, cuts: list[int]) -> tuple[ToolCallParser, list[dict]]:
    parser, deltas, last = ToolCallParser(plan()), [], 0
    for cut in [*cuts, len(text)]:
        deltas += parser.feed(text[last:cut])
        last = cut
    return parser, deltas


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_any_split_gives_the_same_calls(step):
    parser, deltas = replay(TWO_CALLS, list(range(step, len(TWO_CALLS), step)))
    calls = [(c.name, c.arguments, c.complete) for c in parser.calls]
    assert calls == [
        ("get_weather", '{"city": "Pa}ris \\" {", "days": [1, {"a": 2}]}', True),
        ("add", '{"a": 1, "b": 2}', True),
    ]
    heads = [d["tool_calls"][0] for d in deltas if "id" in d["tool_calls"][0]]
    assert [(h["index"], h["type"], h["function"]) for h in heads] == [
        (0, "function", {"name": "get_weather", "arguments": ""}),
        (1, "function", {"name": "add", "arguments": ""}),
    ]
    for index, call in enumerate(parser.calls):
        pieces = [d["tool_calls"][0]["function"]["arguments"] for d in deltas
                  if d["tool_calls"][0]["index"] == index
                  and "id" not in d["tool_calls"][0]]  # fmt: skip
        assert "".join(pieces) == call.arguments
        json.loads(call.arguments)


def test_plain_answers_and_held_prefixes():
    parser = ToolCallParser(plan())
    assert parser.feed("<tool") == []  # might still open a call
    assert parser.feed("box> is a tag") == [{"content": "<toolbox> is a tag"}]
    assert parser.feed("!") == [{"content": "!"}]
    assert parse_output(plan(), "<tool").content == "<tool"  # ended undecided: plain text
    assert not parse_output(plan(), "Hello").is_calls


def test_choices_build_grammars():
    assert "start: answer | calls" in plan("auto").lark()
    required = plan("required", parallel_tool_calls=False)
    assert "start: calls" in required.lark() and "calls: call\n" in required.lark()
    named = plan({"type": "function", "function": {"name": "add"}})
    assert [t.name for t in named.tools] == ["add"] and "get_weather" not in named.lark()
    assert plan("none") is None and parse_tools({}) is None


@pytest.mark.parametrize(
    "data",
    [
        {"tool_choice": "required"},
        {"tools": []},
        {"tools": [{"type": "function", "function": {"name": "a b"}}]},
        {"tools": TOOLS * 2},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": TOOLS, "parallel_tool_calls": "yes"},
    ],
)
def test_bad_tool_requests(data):
    with pytest.raises(OpenAIRequestError):
        parse_tools(data)


def test_history_written_in_tags_for_templates_without_tools():
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "cloudy"},
    ]  # fmt: skip
    out = prepare_messages(messages, plan(), native=False)
    assert out[0]["role"] == "system" and "<tools>" in out[0]["content"]
    assert out[2] == {
        "role": "assistant",
        "content": (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        ),
    }
    assert out[3] == {
        "role": "user",
        "content": (
            "<tool_response>\n18C\n</tool_response>\n<tool_response>\ncloudy\n</tool_response>"
        ),
    }
    native = prepare_messages(messages, plan(), native=True)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_a_call_cut_short_keeps_the_finish_reason():
    from textgen.service.openai.chat import tool_finish_reason

    cut = parse_output(plan(), TWO_CALLS[:60])
    assert cut.is_calls and not cut.calls[-1].complete
    assert tool_finish_reason("length", cut) == "length"
    assert tool_finish_reason("stop", cut) == "stop"
    assert tool_finish_reason("stop", parse_output(plan(), TWO_CALLS)) == "tool_calls"
