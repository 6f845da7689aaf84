"""gpt-oss's harmony channels (service/openai/reasoning.py HarmonyParser) on what gpt-oss
writes (the outputs of OpenAI's harmony guide): the analysis channel is the reasoning, the
final channel (and a commentary preamble) the content, headers and markers in neither;
whole, streamed in any chunking, and through the chat and Responses renderers from token
events made as the engine makes them (the markers are added tokens flagged special, which
the tokenizer leaves out of all_special_ids)."""

from __future__ import annotations

import json
import random

import pytest
from support.tiny_model import build_tokenizer
from textgen.service.engine.loop import special_ids
from textgen.service.engine.types import FinishInfo, FinishReason, TokenEvent, TokenInfo
from textgen.service.openai.reasoning import (
    CONTENT,
    HARMONY,
    HARMONY_MARKERS,
    HarmonyParser,
    resolve_parser,
    split_reasoning,
    start_state,
)

PROMPT = (
    "<|start|>system<|message|>You are ChatGPT.\nReasoning: low\n<|end|>"
    "<|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant"
)
SIMPLE = (
    '<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide '
    "answer.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"
)
PREAMBLE = (
    "<|channel|>analysis<|message|>Plan the files first.<|end|><|start|>assistant"
    "<|channel|>commentary<|message|>**Action plan**: 1. Generate an HTML file<|end|>"
)
BUILTIN_CALL = (
    "<|channel|>analysis<|message|>Need to search.<|end|><|start|>assistant<|channel|>"
    'analysis to=browser.search <|constrain|>json<|message|>{"query": "weather"}<|call|>'
)
CUT = "<|channel|>analysis<|message|>The user wants a long proof, so I"
CASES = {
    # name: (output, reasoning, content)
    "analysis then final": (
        SIMPLE,
        'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.',
        "2 + 2 = 4.",
    ),
    "a commentary preamble is the answer": (
        PREAMBLE,
        "Plan the files first.",
        "**Action plan**: 1. Generate an HTML file",
    ),
    "a built-in tool's call is not the answer": (
        BUILTIN_CALL,
        'Need to search.{"query": "weather"}',
        "",
    ),
    "cut by max_tokens while thinking": (CUT, "The user wants a long proof, so I", ""),
    "no header (a grammar's answer)": ('{"answer": 4}', None, '{"answer": 4}'),
}


def test_auto_picks_harmony_from_the_template():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<|start|>{{ m.role }}<|channel|>{% endfor %}"
    assert resolve_parser("auto", tokenizer) == HARMONY
    assert resolve_parser("openai_gptoss", build_tokenizer()) == HARMONY
    assert start_state(HARMONY, PROMPT) == HARMONY


@pytest.mark.parametrize("name", list(CASES))
def test_whole_output(name):
    output, reasoning, content = CASES[name]
    assert split_reasoning(HARMONY, output) == (reasoning, content)


def chunkings(text: str):
    yield [text]
    yield list(text)  # every marker split
    for seed in range(20):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("name", list(CASES))
def test_streamed_in_any_chunking_equals_the_whole(name):
    output, reasoning, content = CASES[name]
    for pieces in chunkings(output):
        parser = HarmonyParser()
        got = [parser.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        assert ("".join(r for r, _ in got) or None, "".join(c for _, c in got)) == (
            reasoning,
            content,
        ), pieces
        for r, c in got:
            assert not any(m in r or m in c for m in HARMONY_MARKERS)


def test_the_thinking_tokens_are_counted_until_the_answer_opens():
    parser = HarmonyParser()
    pieces = ["<|channel|>", "analysis", "<|message|>", "Hmm", ".", "<|end|>", "<|start|>"]
    pieces += ["assistant", "<|channel|>", "final", "<|message|>", "4", "<|return|>"]
    for piece in pieces:
        parser.feed(piece)
    assert parser.state == CONTENT and parser.tokens == 11


# through the renderers, from token events as the engine makes them ---------------------


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(list(HARMONY_MARKERS), special_tokens=True)
    return tokenizer


def events_of(tokenizer, output: str) -> list[TokenEvent]:
    """The engine's events (engine/loop.py): a special token's text is its own string,
    left out of the event's visible text and of generated_text."""
    ids = tokenizer.encode(output, add_special_tokens=False)
    special = special_ids(tokenizer)
    assert {tokenizer.convert_tokens_to_ids(m) for m in HARMONY_MARKERS} <= special
    generated = tokenizer.decode(ids, skip_special_tokens=True)
    finish = FinishInfo(FinishReason.EOS_TOKEN, generated, len(ids), 10, 0, 0.0, 0.0)
    events = []
    for i, token in enumerate(ids):
        text = tokenizer.decode([token])
        visible = "" if token in special else text
        info = TokenInfo(token, text, -0.5, token in special)
        last = finish if i == len(ids) - 1 else None
        events.append(TokenEvent(index=i + 1, token=info, text=visible, finish=last))
    assert "".join(e.text for e in events) == generated
    return events


def chat_renderer(stream: bool):
    from textgen.service.openai.chat import ChatRenderer, ChatRequest

    request = ChatRequest(
        generate=None,
        stream=stream,
        include_usage=True,
        logprobs=False,
        top_logprobs=0,
        stop=(),
        tools=None,
        reasoning=HARMONY,
    )
    return ChatRenderer("gpt-oss", "fp", request)


@pytest.mark.parametrize("name", ["analysis then final", "a commentary preamble is the answer"])
def test_chat_completions_split_the_channels(tokenizer, name):
    from textgen.service.openai.chat import ChatStream

    output, reasoning, content = CASES[name]
    events = events_of(tokenizer, output)
    whole = json.loads(chat_renderer(False).completion([events]))
    message = whole["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)
    assert message["reasoning"] == reasoning
    thinking_tokens = whole["usage"]["completion_tokens_details"]["reasoning_tokens"]
    answer_tokens = tokenizer.encode(content, add_special_tokens=False)
    assert 0 < thinking_tokens < len(events) - len(answer_tokens)

    stream = ChatStream(chat_renderer(True))
    chunks = [json.loads(d[len(b"data: ") :]) for e in events for d in stream.chunks(e)]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.get("content") or "" for d in deltas) == content
    assert stream.reasoning_tokens == thinking_tokens
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_responses_give_a_reasoning_item_and_the_message(tokenizer):
    from textgen.service.openai.responses import ResponsesRequest
    from textgen.service.openai.responses_output import ResponseRenderer, ResponseStream

    output, reasoning, content = CASES["analysis then final"]
    events = events_of(tokenizer, output)
    echo = dict.fromkeys(
        (
            "instructions", "max_output_tokens", "parallel_tool_calls", "previous_response_id",
            "reasoning", "temperature", "text", "tool_choice", "tools", "top_logprobs", "top_p",
            "metadata",
        )
    )  # fmt: skip
    request = ResponsesRequest(
        generate=None,
        stream=False,
        store=False,
        conversation=(),
        items=(),
        tools=None,
        logprobs=False,
        echo=echo,
        reasoning=HARMONY,
    )
    body = json.loads(ResponseRenderer("gpt-oss", request).response(events))
    thought, message = body["output"]
    assert thought["type"] == "reasoning" and thought["content"][0]["text"] == reasoning
    assert message["content"][0]["text"] == content
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] > 0

    stream = ResponseStream(ResponseRenderer("gpt-oss", request))
    sent = [json.loads(d.split(b"data: ", 1)[1]) for e in events for d in stream.events(e)]
    thinking = "".join(e["delta"] for e in sent if e["type"] == "response.reasoning_text.delta")
    answer = "".join(e["delta"] for e in sent if e["type"] == "response.output_text.delta")
    assert (thinking, answer) == (reasoning, content)
