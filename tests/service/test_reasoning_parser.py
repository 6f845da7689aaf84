"""The think-tag reasoning parser (service/openai/reasoning.py) on what the families
really write: Qwen3 (its generation prompt leaves `<think>` to the model), QwQ, Qwen3.5
and the DeepSeek-R1 distills (their prompt opens `<think>\\n`), SmolLM3, and thinking
turned off (`enable_thinking: false`: the prompt closes an empty block). Whole, and
streamed in every chunking tried: tags split across chunks, one character at a time."""

from __future__ import annotations

import random

import pytest
from textgen.service.openai.reasoning import (
    CONTENT,
    OPENED,
    START,
    ReasoningParser,
    resolve_parser,
    split_reasoning,
    start_state,
)

QWEN3_PROMPT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
QWEN3_NO_THINK_PROMPT = QWEN3_PROMPT + "<think>\n\n</think>\n\n"
QWQ_PROMPT = QWEN3_PROMPT + "<think>\n"  # QwQ-32B, Qwen3.5, Qwen3-*-Thinking-2507
R1_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜><think>\n"
R1_OLD_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜>"
SMOLLM3_NO_THINK_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n"
# a conversation whose earlier turn kept its thinking: only the prompt's end counts
HISTORY_PROMPT = (
    "<|im_start|>assistant\n<think>\nold\n</think>\n\nOld answer.<|im_end|>\n"
    "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n"
)

QWEN3_OUT = (
    "<think>\nOkay, the user is asking what 2+2 is. That's basic arithmetic: 2 plus 2"
    " equals 4. I should answer directly.\n</think>\n\nThe answer is **4**."
)
R1_OUT = (
    "Okay, so I need to figure out what 2 plus 2 is. Let me think. If I have two apples"
    " and get two more, I have four.\n\nSo the answer is 4.\n</think>\n\n"
    "The sum of 2 and 2 is \\(\\boxed{4}\\)."
)
SMOLLM3_OUT = "<think>\nSimple addition: 2 + 2 = 4.\n</think>\nThe answer is 4."
TOOL_OUT = (
    "<think>\nThe user wants the weather in Paris; I have get_weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)

QWEN3_THOUGHT = (
    "Okay, the user is asking what 2+2 is. That's basic arithmetic: 2 plus 2 equals 4."
    " I should answer directly."
)
R1_THOUGHT = (
    "Okay, so I need to figure out what 2 plus 2 is. Let me think. If I have two apples"
    " and get two more, I have four.\n\nSo the answer is 4."
)

CASES = {
    # name: (parser kind, prompt, output, reasoning, content)
    "qwen3": (
        "think",
        QWEN3_PROMPT,
        QWEN3_OUT,
        QWEN3_THOUGHT,
        "The answer is **4**.",
    ),
    "qwen3 thinking off": (
        "think",
        QWEN3_NO_THINK_PROMPT,
        "The answer is 4.",
        None,
        "The answer is 4.",
    ),
    "qwen3 no thinking written": ("think", QWEN3_PROMPT, "Just 4.", None, "Just 4."),
    "qwen3 earlier thinking in the prompt": (
        "think",
        HISTORY_PROMPT,
        QWEN3_OUT,
        QWEN3_THOUGHT,
        "The answer is **4**.",
    ),
    "qwq / qwen3.5": (
        "think",
        QWQ_PROMPT,
        R1_OUT,
        R1_THOUGHT,
        "The sum of 2 and 2 is \\(\\boxed{4}\\).",
    ),
    "deepseek-r1 distill": (
        "think_r1",
        R1_PROMPT,
        R1_OUT,
        R1_THOUGHT,
        "The sum of 2 and 2 is \\(\\boxed{4}\\).",
    ),
    "deepseek-r1, old template: no opening tag anywhere": (
        "think_r1",
        R1_OLD_PROMPT,
        R1_OUT,
        R1_THOUGHT,
        "The sum of 2 and 2 is \\(\\boxed{4}\\).",
    ),
    "deepseek-r1, old template: the model opens the tag": (
        "think_r1",
        R1_OLD_PROMPT,
        "<think>\n" + R1_OUT,
        R1_THOUGHT,
        "The sum of 2 and 2 is \\(\\boxed{4}\\).",
    ),
    "cut by max_tokens inside the thinking": (
        "think",
        QWQ_PROMPT,
        "Okay, so I need to figure out what 2 plus",
        "Okay, so I need to figure out what 2 plus",
        "",
    ),
    "smollm3": (
        "think",
        QWEN3_PROMPT,
        SMOLLM3_OUT,
        "Simple addition: 2 + 2 = 4.",
        "The answer is 4.",
    ),
    "smollm3 /no_think": ("think", SMOLLM3_NO_THINK_PROMPT, "4.", None, "4."),
    "a call after the thinking": (
        "think",
        QWEN3_PROMPT,
        TOOL_OUT,
        "The user wants the weather in Paris; I have get_weather.",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    ),
    "the tag only, nothing after": ("think", QWQ_PROMPT, "Hmm.\n</think>", "Hmm.", ""),
    "a lone '<' that is no tag": ("think", QWEN3_PROMPT, "<b>4</b>", None, "<b>4</b>"),
}


def stream(state: str, pieces: list[str]) -> tuple[list[str], list[str]]:
    parser = ReasoningParser(state)
    reasoning, content = [], []
    for i, piece in enumerate(pieces):
        r, c = parser.feed(piece, final=i == len(pieces) - 1)
        reasoning += [r] if r else []
        content += [c] if c else []
    return reasoning, content


def chunkings(text: str):
    yield [text]
    yield list(text)  # a character at a time: every tag split
    for seed in range(30):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("name", list(CASES))
def test_whole_output(name):
    kind, prompt, output, reasoning, content = CASES[name]
    state = start_state(kind, prompt)
    assert split_reasoning(state, output) == (reasoning, content)


@pytest.mark.parametrize("name", list(CASES))
def test_streamed_in_any_chunking_equals_the_whole(name):
    kind, prompt, output, reasoning, content = CASES[name]
    state = start_state(kind, prompt)
    for pieces in chunkings(output):
        r, c = stream(state, pieces)
        assert ("".join(r) or None, "".join(c)) == (reasoning, content), pieces
        for piece in r + c:
            assert "<think>" not in piece and "</think>" not in piece


def test_reasoning_comes_before_content_as_it_arrives():
    parser = ReasoningParser(start_state("think", QWEN3_PROMPT))
    assert parser.feed("<thi") == ("", "")  # may be the tag: held
    assert parser.feed("nk>\nLet me") == ("Let me", "")
    assert parser.feed(" see.\n</th") == (" see.", "")  # the tag's start and the newline held
    assert parser.feed("ink>\n\nFour") == ("", "Four")
    assert parser.feed("</think> stays") == ("", "</think> stays")  # thinking only once


def test_tokens_count_the_thinking_and_its_closing_tag():
    parser = ReasoningParser(OPENED)
    for token in ["Two", " and", " two", "\n", "</think>", "\n\n", "Four", "."]:
        parser.feed(token)
    assert parser.tokens == 5
    plain = ReasoningParser(START)
    for token in ["Four", "."]:
        plain.feed(token)
    assert plain.tokens == 0


def test_start_states():
    assert start_state(None, QWQ_PROMPT) is None
    assert start_state("think", QWQ_PROMPT) == OPENED
    assert start_state("think", QWEN3_PROMPT) == START
    assert start_state("think_r1", R1_OLD_PROMPT) == OPENED
    assert start_state("think_r1", QWEN3_NO_THINK_PROMPT) == CONTENT
    assert start_state("think", SMOLLM3_NO_THINK_PROMPT) == CONTENT


class _Tokenizer:
    def __init__(self, template):
        self.chat_template = template


def test_parser_choice():
    assert resolve_parser("auto", _Tokenizer("{{ '<think>\\n' }}")) == "think"
    assert resolve_parser("auto", _Tokenizer({"default": "x", "think": "<think>"})) == "think"
    assert resolve_parser("auto", _Tokenizer("{{ messages }}")) is None
    assert resolve_parser("auto", _Tokenizer(None)) is None
    assert resolve_parser("none", _Tokenizer("<think>")) is None
    assert resolve_parser("qwen3", _Tokenizer(None)) == "think"
    assert resolve_parser("deepseek_r1", _Tokenizer(None)) == "think_r1"


# through chat's renderer: calls come from the answer, never from the thinking ----------

WEATHER = {"name": "get_weather", "parameters": {"type": "object"}}
TOOLS = [{"type": "function", "function": WEATHER}]
# the thinking drafts a call: it stays thinking
DRAFTING = (
    'I could write <tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call> but let me'
    " think.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def _events(text: str, step: int) -> list:
    from textgen.service.engine.types import FinishInfo, FinishReason, TokenEvent, TokenInfo

    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    finish = FinishInfo(FinishReason.EOS_TOKEN, text, len(pieces), 10, 0, 0.0, 0.0)
    return [
        TokenEvent(
            index=i + 1,
            token=TokenInfo(i, piece, -0.5, False),
            text=piece,
            finish=finish if i == len(pieces) - 1 else None,
        )
        for i, piece in enumerate(pieces)
    ]


def _renderer(tools, state):
    from textgen.service.openai.chat import ChatRenderer, ChatRequest
    from textgen.service.openai.tools import parse_tools

    plan = parse_tools({"tools": tools, "tool_choice": "auto"}) if tools else None
    request = ChatRequest(
        generate=None,
        stream=True,
        include_usage=True,
        logprobs=True,
        top_logprobs=0,
        stop=(),
        tools=plan,
        reasoning=state,
    )
    return ChatRenderer("m", "fp", request)


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_calls_are_parsed_from_the_answer_only(step):
    import json

    from textgen.service.openai.chat import ChatStream

    renderer = _renderer(TOOLS, OPENED)
    events = _events(DRAFTING, step)
    whole = json.loads(renderer.completion([events]))
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"].startswith("I could write <tool_call>")
    assert message["reasoning"] == message["reasoning_content"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    assert len(whole["choices"][0]["logprobs"]["content"]) == len(events)

    stream = ChatStream(renderer)
    chunks = [
        json.loads(data[len(b"data: ") :]) for event in events for data in stream.chunks(event)
    ]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    thinking = "".join(d.get("reasoning_content") or "" for d in deltas)
    assert thinking == message["reasoning_content"]
    names = [t["function"]["name"] for d in deltas for t in d.get("tool_calls") or [] if "id" in t]
    assert names == ["get_weather"]
    last_thinking = max(i for i, d in enumerate(deltas) if d.get("reasoning_content"))
    first_call = min(i for i, d in enumerate(deltas) if d.get("tool_calls"))
    assert last_thinking < first_call
    logprobs = [
        entry
        for chunk in chunks
        for entry in (chunk["choices"][0]["logprobs"] or {}).get("content") or []
    ]
    # the thinking's tokens carry their logprobs (a call's never did, streamed)
    assert 0 < len(logprobs) <= stream.reasoning_tokens
    usage = json.loads(renderer.usage_chunk([events[-1].finish], stream.reasoning_tokens)[6:])
    reasoning_tokens = usage["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert reasoning_tokens == whole["usage"]["completion_tokens_details"]["reasoning_tokens"]


def test_no_parser_leaves_the_answer_alone():
    import json

    renderer = _renderer(None, None)
    whole = json.loads(renderer.completion([_events(QWEN3_OUT, 3)]))
    message = whole["choices"][0]["message"]
    assert message == {"role": "assistant", "content": QWEN3_OUT}
    assert "completion_tokens_details" not in whole["usage"]


# the grammar of a thinking model's answer: free thinking first ---------------------------


@pytest.mark.parametrize("tags_as_tokens", [True, False])
@pytest.mark.parametrize("state", [OPENED, START])
def test_a_grammar_lets_the_thinking_come_first(tags_as_tokens, state):
    """llguidance takes added tokens for special ones: `</think>` as a token is named by
    id; as text, the thinking is one lexeme up to it."""
    import llguidance
    import llguidance.hf
    from support.tiny_model import build_tokenizer
    from textgen.service.openai.reasoning import tag_tokens, with_thought

    tokenizer = build_tokenizer()
    if tags_as_tokens:
        tokenizer.add_tokens(["<think>", "</think>"])
    tags = tag_tokens(tokenizer)
    assert (tags is not None) == tags_as_tokens
    ll = llguidance.hf.from_tokenizer(tokenizer)
    grammar = with_thought(
        'start: answer\nanswer: "<tool_call>" ANSWER\nANSWER: /[a-z]+/\n', state, tags
    )

    def follows(text: str) -> bool:
        matcher = llguidance.LLMatcher(ll, llguidance.grammar_from("lark", grammar))
        ids = tokenizer(text, add_special_tokens=False).input_ids
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    opening = "<think>" if state == START else ""
    assert follows(opening + "I could write <tool_call> or </thin but\n</think>\n\n<tool_call>abc")
    assert follows(opening + "</think><tool_call>abc")  # an empty thinking
    assert not follows(opening + "a</think>\n\n<tool_call>abc</think>")  # one thinking only
    assert not follows(opening + "a</think>\n\n\n\n\n\n<tool_call>abc")  # no idling in whitespace
    assert follows("<tool_call>abc") == (state == START)  # a Qwen3 prompt may not think
