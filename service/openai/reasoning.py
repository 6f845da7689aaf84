"""Reasoning models' thinking told apart from their answer (vLLM's reasoning parsers):
the think-tag families (Qwen3, Qwen3.5, QwQ, DeepSeek-R1 and its distills, SmolLM3)
write `<think>` ... `</think>` before the answer. What is between the tags is the
reasoning (`reasoning_content` / `reasoning`), what follows the closing tag is the
content; the tags themselves are in neither.

Where the output starts is read from the rendered prompt: a prompt that ends inside an
open `<think>` (DeepSeek-R1's, Qwen3.5's and Qwen3-Thinking's generation prompts) starts
the output inside the thinking; one that ends with a closed, empty `<think></think>`
(Qwen3's `enable_thinking: false`) makes the output all content; otherwise the output
is thinking only if it opens with `<think>` (after whitespace). `deepseek_r1` also takes
an output that says nothing as thinking until `</think>` (vLLM's deepseek_r1 parser: R1
opens the tag in its template, and older templates don't write it).

The parser is streaming: text arrives in arbitrary pieces (a tag may be split across
them); a tail that could still become a tag is held back until it can't. The whitespace
around the thinking is in neither part.

With a grammar (tools, a JSON format), with_thought lets the thinking come first and
holds only the answer to the grammar.

gpt-oss writes OpenAI's harmony format instead: messages `<|channel|>analysis<|message|>
...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>`, whose markers are
special tokens. HarmonyParser reads them from the tokens (event_piece gives it a special
token's own string, which the answer's text leaves out): the `analysis` channel is the
reasoning, `final` (and `commentary` without a recipient, a preamble) the content, the
headers and markers in neither. An output that does not open with a message header (one a
grammar holds from its first token) is all content."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.types import TokenEvent

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PARSERS = ("auto", "none", "deepseek_r1", "qwen3", "openai_gptoss")  # vLLM's names
HARMONY = "harmony"  # the parser kind, and the state its output starts in


def template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates
        return "\n".join(str(t) for t in template.values())
    return str(template)


def resolve_parser(name: str, tokenizer) -> str | None:
    """--reasoning-parser for this model: "think" (the tags; R1's rule with
    deepseek_r1: "think_r1"), "harmony" (gpt-oss's channels) or None (no parsing)."""
    if name == "none":
        return None
    if name == "deepseek_r1":
        return "think_r1"
    if name == "qwen3":
        return "think"
    if name == "openai_gptoss":
        return HARMONY
    if name == "auto":
        template = template_text(tokenizer)
        if HARMONY_CHANNEL in template:
            return HARMONY
        return "think" if THINK_OPEN in template else None
    raise ValueError(f"unknown reasoning parser {name!r}: use one of {', '.join(PARSERS)}")


# where the output is: before a possible `<think>` (then content, or thinking with
# OPENED: an opening tag the prompt or the parser takes for granted is dropped), inside
# the thinking, in the answer
START, OPENED, THINKING, CONTENT = "start", "opened", "thinking", "content"


def start_state(kind: str | None, prompt: str) -> str | None:
    """The state the output starts in, from the rendered prompt; None: no parsing."""
    if kind is None:
        return None
    if kind == HARMONY:  # gpt-oss's generation prompt ends with `<|start|>assistant`
        return HARMONY
    opened, closed = prompt.rfind(THINK_OPEN), prompt.rfind(THINK_CLOSE)
    if opened > closed and not prompt[opened + len(THINK_OPEN) :].strip():
        return OPENED
    if closed > opened and not prompt[closed + len(THINK_CLOSE) :].strip():
        return CONTENT  # thinking turned off: an empty thinking block ends the prompt
    return OPENED if kind == "think_r1" else START


def _held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ReasoningParser:
    """One choice's output -> (reasoning, content) pieces, fed in arbitrary chunks. The
    whitespace around the thinking (`<think>\\n...\\n</think>\\n\\n`, as the templates
    write it) is in neither. `tokens`: how many fed pieces (one per token) arrived while
    the thinking was open, the closing tag's included."""

    state: str
    buffer: str = ""
    tokens: int = 0
    trim: bool = field(init=False)  # drop whitespace before the next text

    def __post_init__(self) -> None:
        self.trim = self.state == THINKING

    def feed(self, text: str, final: bool = False, *, count: bool = True) -> tuple[str, str]:
        """The reasoning and the content this text completes (either may be "")."""
        if count and self.state != CONTENT:
            self.tokens += 1
        self.buffer += text
        if self.trim:
            self.buffer = self.buffer.lstrip()
            self.trim = not self.buffer
        reasoning = content = ""
        if self.state in (START, OPENED):
            stripped = self.buffer.lstrip()
            if stripped.startswith(THINK_OPEN):
                self.buffer = stripped[len(THINK_OPEN) :].lstrip()
                self.state, self.trim = THINKING, not self.buffer
            elif THINK_OPEN.startswith(stripped) and not final:
                return "", ""  # may still open the thinking
            elif self.state == OPENED:
                self.buffer = stripped
                self.state, self.trim = THINKING, not self.buffer
            else:
                self.state = CONTENT
                if count:
                    self.tokens = 0  # no thinking after all
        if self.state == THINKING:
            end = self.buffer.find(THINK_CLOSE)
            if end >= 0:
                reasoning = self.buffer[:end].rstrip()
                self.buffer = self.buffer[end + len(THINK_CLOSE) :].lstrip()
                self.state, self.trim = CONTENT, not self.buffer
            else:
                keep = 0 if final else _held_tail(self.buffer)
                reasoning = self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return reasoning, ""
        if self.state == CONTENT:
            content, self.buffer = self.buffer, ""
        return reasoning, content


def _held_tail(text: str) -> int:
    """What a thinking's text holds back: a tail that may begin `</think>`, and the
    whitespace before it (left out if the tag follows)."""
    keep = _held_prefix(text, THINK_CLOSE)
    body = text[: len(text) - keep]
    return keep + len(body) - len(body.rstrip())


def split_reasoning(state: str, text: str) -> tuple[str | None, str]:
    """A whole output -> (the reasoning, None if there was none; the content)."""
    parser = parser_for(state)
    reasoning, content = parser.feed(text, final=True, count=False)
    return (reasoning or None), content


def read_output(state: str, events: list[TokenEvent], text: str) -> tuple[object, str, str]:
    """A whole output -> (its parser, at the end; the reasoning; the content): read from
    its text, or for harmony, whose markers are tokens, from its events."""
    parser = parser_for(state)
    if state != HARMONY:
        reasoning, content = parser.feed(text, final=True, count=False)
        return parser, reasoning, content
    pieces = [
        parser.feed(event_piece(parser, e), e.finish is not None, count=False) for e in events
    ]
    return parser, "".join(r for r, _ in pieces), "".join(c for _, c in pieces)


def parser_for(state: str):
    """The parser for an output that starts in `state` (start_state)."""
    return HarmonyParser() if state == HARMONY else ReasoningParser(state)


def event_piece(parser, event: TokenEvent) -> str:
    """What `parser` reads of a token: its text, and for harmony's, until the answer
    starts, a special token's own string (the markers)."""
    if event.token.special and isinstance(parser, HarmonyParser) and parser.state != CONTENT:
        return event.token.text
    return event.text


# harmony (gpt-oss) -------------------------------------------------------------------

HARMONY_CHANNEL = "<|channel|>"
HARMONY_START, HARMONY_MESSAGE = "<|start|>", "<|message|>"
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
HARMONY_MARKERS = (HARMONY_START, HARMONY_CHANNEL, HARMONY_MESSAGE, "<|constrain|>", *HARMONY_ENDS)
# where a harmony output is besides THINKING and CONTENT: in a message's header (role,
# channel, recipient), or between messages
HEADER, BETWEEN = "header", "between"


@dataclass
class HarmonyParser:
    """One choice's harmony output -> (reasoning, content) pieces, as ReasoningParser:
    `analysis` messages are the reasoning until a `final` or `commentary` message opens
    the answer, which is the content from then on (parsed once, at the output's start, as
    the think tags are). `tokens`: the pieces fed before the answer opened."""

    state: str = HARMONY
    buffer: str = ""
    header: str = ""
    tokens: int = 0

    def feed(self, text: str, final: bool = False, *, count: bool = True) -> tuple[str, str]:
        if count and self.state != CONTENT:
            self.tokens += 1
        self.buffer += text
        reasoning = content = ""
        while self.buffer and self.state != CONTENT:
            at, marker = _first_marker(self.buffer)
            if marker is None:
                cut = len(self.buffer) - (0 if final else _held_marker(self.buffer))
                text, self.buffer = self.buffer[:cut], self.buffer[cut:]
                if not text:
                    break
                r, c = self._text(text)
                reasoning, content = reasoning + r, content + c
                continue
            r, c = self._text(self.buffer[:at])
            reasoning, content = reasoning + r, content + c
            self.buffer = self.buffer[at + len(marker) :]
            self._marker(marker)
        if self.state == CONTENT:  # markers in the answer's text are left out
            text = _unmarked(self.buffer)
            cut = len(text) - (0 if final else _held_marker(text))
            content, self.buffer = content + text[:cut], text[cut:]
        return reasoning, content

    def _text(self, text: str) -> tuple[str, str]:
        """Text outside the markers: a header's, the reasoning's, or (an output that opens
        with no header) the content's."""
        if not text:
            return "", ""
        if self.state == HEADER:
            self.header += text
        elif self.state == THINKING:
            return text, ""
        elif self.state == HARMONY or text.strip():  # text with no header: the answer
            self.state = CONTENT
            if self.tokens <= 1:  # nothing before it: no thinking after all
                self.tokens = 0
            return "", text
        return "", ""

    def _marker(self, marker: str) -> None:
        if marker in (HARMONY_START, HARMONY_CHANNEL) and self.state != HEADER:
            self.state, self.header = HEADER, ""
        if marker in (HARMONY_CHANNEL, "<|constrain|>"):
            self.header += f" {marker} "
        elif marker == HARMONY_MESSAGE:
            # a message to a recipient (` to=browser.search`) calls one of gpt-oss's
            # built-in tools, which no request declared: not the answer
            answer = _channel(self.header) in ("final", "commentary")
            self.state = CONTENT if answer and " to=" not in self.header else THINKING
        elif marker in HARMONY_ENDS:
            self.state = BETWEEN


def _unmarked(text: str) -> str:
    """The answer's text without markers (a whole output's text holds its `<|return|>`;
    a stream's answer tokens come without their special strings)."""
    for marker in HARMONY_MARKERS:
        text = text.replace(marker, "")
    return text


def _channel(header: str) -> str:
    """The channel a header names (`assistant <|channel|> analysis`), "" if none."""
    _, _, rest = header.partition(HARMONY_CHANNEL)
    words = rest.split()
    return words[0] if words else ""


def _first_marker(text: str) -> tuple[int, str | None]:
    found = [(text.find(m), m) for m in HARMONY_MARKERS]
    found = [(at, m) for at, m in found if at >= 0]
    return min(found) if found else (-1, None)


def _held_marker(text: str) -> int:
    """How many characters at the end of `text` could begin a marker."""
    return max(_held_prefix(text, marker) for marker in HARMONY_MARKERS)


# a grammar's answer after the thinking ------------------------------------------------


def thinks(state: str | None) -> bool:
    """Whether the output may start with thinking."""
    return state in (START, OPENED)


def tag_tokens(tokenizer) -> tuple[int, int] | None:
    """`<think>` and `</think>` as single tokens of the vocabulary (Qwen3's, R1's): their
    ids, which a grammar names (llguidance takes added tokens for special ones, which
    no text of a grammar spells), or None when they are text."""
    ids = []
    for tag in (THINK_OPEN, THINK_CLOSE):
        try:
            token = tokenizer.convert_tokens_to_ids(tag)
        except Exception:  # noqa: BLE001 - a tokenizer without the lookup
            return None
        if not isinstance(token, int) or tokenizer.convert_ids_to_tokens(token) != tag:
            return None
        ids.append(token)
    return ids[0], ids[1]


def with_thought(
    lark: str, state: str, tags: tuple[int, int] | None, budget: int | None = None
) -> str:
    """An llguidance Lark grammar (its first line `start: ...`) with the thinking first:
    any text without `</think>`, the closing tag, whitespace, then the answer's grammar.
    Opened by `<think>` unless the prompt opened it (OPENED), and optional when the output
    may not think at all (START). `tags`: the tags' token ids (tag_tokens), None: text.
    `budget`: the most tokens the thinking's text may take (Anthropic's
    `thinking.budget_tokens`); at that count the closing tag is forced. It needs the tags
    as tokens: a budget cuts the thinking lexeme wherever it stands, and only a tag that is
    a token of its own can follow any cut."""
    first, _, rest = lark.partition("\n")
    assert first.startswith("start:"), first
    body = first[len("start:") :].strip()
    thinking = "THOUGHT"
    if budget is not None:
        if tags is None:
            raise ValueError("a thinking budget needs the think tags as tokens")
        thinking = "thought"  # the rule the budget bounds (llguidance's max_tokens)
        rest += f"thought[max_tokens={budget}]: THOUGHT\n"
    if tags is not None:  # the tags are tokens: the thinking, a text without them, between
        opening, closing = (f"<[{t}]>" for t in tags)
        thought = f"{thinking}? {closing} THOUGHT_WS?"
        if state == START:
            thought = f"(THOUGHT_WS? {opening} THOUGHT_WS? {thought})?"
        text = "/(?s:.*)/ & ~/(?s:.*)<\\/think>(?s:.*)/"
    else:  # one lexeme up to the first `</think>` (a lexeme ends where it can't go on)
        opened = "" if state == OPENED else "[ \\t\\n]*<think>"
        text = f"/{opened}(?s:.*)<\\/think>/ & ~/(?s:.*)<\\/think>(?s:.+)/"
        thought = "THOUGHT THOUGHT_WS?" if state == OPENED else "(THOUGHT THOUGHT_WS?)?"
    return (
        f"start: {thought} ({body})\n{rest}"
        f"THOUGHT: {text}\n"
        "THOUGHT_WS: /[ \\t\\n]{1,4}/\n"  # bounded: no idling in whitespace
    )
