"""/v1/messages' answer: engine events -> Anthropic's `message` object, or its stream of
server-sent events (`event: <type>` then `data: {...}`), in Anthropic's order:

    message_start (the message, no content yet),
    per content block: content_block_start, content_block_delta..., content_block_stop
        (a `ping` after the first block's start),
    message_delta (stop_reason, stop_sequence, usage), message_stop;
    `error` (Anthropic's error body) for a failure after message_start.

The blocks are a reasoning model's thinking first (`thinking`, with an empty `signature`:
thinking_delta, then a signature_delta), then the answer: one `text` block
(text_delta), or with tools, `tool_use` blocks (their input as input_json_delta pieces,
as the grammar writes them). The shapes are those of the `anthropic` SDK's types
(anthropic.types: Message, RawMessageStreamEvent).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..engine.types import FinishInfo, TokenEvent
from ..errors import ErrorType, anthropic_error
from ..openai.chat import read_answer
from ..openai.common import StopHoldback, json_bytes
from ..openai.reasoning import CONTENT, event_piece, parser_for
from ..openai.response_store import new_id
from ..openai.tools import ToolCallParser
from .messages import MessagesRequest

STOP_REASONS = {"eos_token": "end_turn", "length": "max_tokens", "stop_sequence": "stop_sequence"}


def usage(finish: FinishInfo | None, input_tokens: int) -> dict:
    """Anthropic's usage: the prompt's tokens the prefix cache served apart from those
    computed (their sum is the prompt's length); nothing is written to a cache at a price
    (0). Before the end (`finish` None): the whole prompt, nothing generated yet."""
    cached = finish.cached_tokens if finish is not None else 0
    return {
        "input_tokens": input_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": finish.generated_tokens if finish is not None else 0,
    }


def tool_use_id(call_id: str) -> str:
    """A call's id as Anthropic writes them (`toolu_...`), from the tool parser's."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_use(call) -> dict:
    """A parsed call (tools.ToolCallParser's) as a tool_use block; a call cut short (by
    max_tokens or a stop sequence inside its input) has the input `{}`."""
    arguments = json.loads(call.arguments) if call.complete else {}
    return {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": arguments}


def thinking_block(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": ""}


def text_block(text: str) -> dict:
    return {"type": "text", "text": text}


@dataclass
class MessageRenderer:
    """One request's message; its id is fixed at creation."""

    model: str
    request: MessagesRequest
    input_tokens: int  # the prompt's length (validation's count)
    id: str = field(default_factory=lambda: new_id("msg"))

    def message(self, events: list[TokenEvent]) -> bytes:
        """The whole answer (stream: false)."""
        finish = events[-1].finish
        request = self.request
        thinking, text, calls = read_answer(events, request.stop, request.reasoning, request.tools)
        content = [thinking_block(thinking)] if thinking else []
        reason = self.stop_reason(finish)
        if calls is not None:
            content += [tool_use(call) for call in calls.calls]
            reason = tool_stop_reason(reason, calls)
        else:
            content.append(text_block(text))
        return json_bytes(self.envelope(content, reason, finish))

    def envelope(self, content: list[dict], reason: str | None, finish: FinishInfo | None) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": self.stop_sequence(finish) if reason == "stop_sequence" else None,
            "usage": usage(finish, self.input_tokens),
        }

    def stop_reason(self, finish: FinishInfo) -> str:
        return STOP_REASONS.get(finish.reason.value, "end_turn")

    def stop_sequence(self, finish: FinishInfo | None) -> str | None:
        """The stop sequence the output ends at: the one found first in it."""
        if finish is None:
            return None
        text = finish.generated_text
        found = [(text.find(s), s) for s in self.request.stop if s in text]
        return min(found)[1] if found else None


def tool_stop_reason(reason: str, parsed: ToolCallParser) -> str:
    """An answer whose calls are all complete stops for "tool_use"; one cut short keeps
    its own reason."""
    return "tool_use" if parsed.calls[-1].complete else reason


@dataclass
class MessageStream:
    """Engine events -> Anthropic's events. Stop sequences are held back; with tools,
    text is told apart from calls (tools.ToolCallParser) before a block opens; a reasoning
    model's thinking is a block of its own before them."""

    renderer: MessageRenderer
    holdback: StopHoldback = field(init=False)
    parser: ToolCallParser | None = field(init=False)
    thinking: object | None = field(init=False)  # reasoning.parser_for's parser
    started: bool = False  # message_start was sent
    pinged: bool = False
    index: int = -1  # the open block's index (-1: none yet)
    block: str | None = None  # the open block's type; None: none is open
    answered: bool = False  # a text or tool_use block was opened

    def __post_init__(self) -> None:
        request = self.renderer.request
        self.holdback = StopHoldback(request.stop)
        self.parser = ToolCallParser(request.tools) if request.tools is not None else None
        state = request.reasoning
        self.thinking = parser_for(state) if state not in (None, CONTENT) else None

    def events(self, event: TokenEvent) -> list[bytes]:
        final = event.finish is not None
        out = [] if self.started else self._start()
        piece = event_piece(self.thinking, event) if self.thinking is not None else event.text
        text = self.holdback.feed(piece, final)
        if self.thinking is not None:  # (it also trims the answer's leading whitespace)
            reasoning, text = self.thinking.feed(text, final)
            if reasoning:
                if self.block != "thinking":
                    out += self._open(thinking_block(""))
                out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
            if self.thinking.state != CONTENT and not final:
                return out  # still thinking
            if self.block == "thinking":
                out += self._close()
        if self.parser is None:
            deltas = [{"content": text}] if text else []
        else:
            deltas = self.parser.feed(text) + (self.parser.flush() if final else [])
        for delta in deltas:
            out += self._answer(delta)
        if final:
            out += self._finish(event.finish)
        return out

    def error(self, message: str, error_type: ErrorType) -> bytes:
        """Anthropic's `error` event, for a failure after the stream started."""
        return _event("error", anthropic_error(message, error_type))

    # blocks ------------------------------------------------------------------------

    def _start(self) -> list[bytes]:
        self.started = True
        message = self.renderer.envelope([], None, None)
        return [_event("message_start", {"type": "message_start", "message": message})]

    def _answer(self, delta: dict) -> list[bytes]:
        """A ToolCallParser delta (chat's shapes) as Anthropic's events."""
        if "content" in delta:
            out = [] if self.block == "text" else self._open(text_block(""))
            return out + [self._delta({"type": "text_delta", "text": delta["content"]})]
        out = []
        for call in delta["tool_calls"]:
            if "id" in call:  # a call's head: the block before it is complete
                head = {
                    "type": "tool_use",
                    "id": tool_use_id(call["id"]),
                    "name": call["function"]["name"],
                    "input": {},
                }
                out += self._open(head)
            else:
                piece = call["function"]["arguments"]
                out.append(self._delta({"type": "input_json_delta", "partial_json": piece}))
        return out

    def _open(self, block: dict) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.block = block["type"]
        self.answered |= self.block != "thinking"
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        out.append(_event("content_block_start", start))
        if not self.pinged:
            self.pinged = True
            out.append(_event("ping", {"type": "ping"}))
        return out

    def _delta(self, delta: dict) -> bytes:
        body = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return _event("content_block_delta", body)

    def _close(self) -> list[bytes]:
        if self.block is None:
            return []
        out = []
        if self.block == "thinking":  # Anthropic signs a thinking block before it ends
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        out.append(
            _event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        )
        self.block = None
        return out

    def _finish(self, finish: FinishInfo) -> list[bytes]:
        out = [] if self.answered else self._open(text_block(""))  # an empty answer: text
        out += self._close()
        renderer = self.renderer
        reason = renderer.stop_reason(finish)
        if self.parser is not None and self.parser.is_calls and self.parser.calls:
            reason = tool_stop_reason(reason, self.parser)
        sequence = renderer.stop_sequence(finish) if reason == "stop_sequence" else None
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage(finish, renderer.input_tokens),
        }
        return out + [
            _event("message_delta", delta),
            _event("message_stop", {"type": "message_stop"}),
        ]


def _event(kind: str, data: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + json_bytes(data) + b"\n\n"
