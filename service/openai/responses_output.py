"""/v1/responses' answer: engine events -> OpenAI's `response` object, or the stream of
its semantic events (`event: <type>` then `data: {...}`, every one with its
`sequence_number`, and no `[DONE]`), in OpenAI's order:

    response.created, response.in_progress,
    per output item: response.output_item.added,
        a reasoning model's thinking (first): response.content_part.added,
            response.reasoning_text.delta..., response.reasoning_text.done,
            response.content_part.done
        a message: response.content_part.added, response.output_text.delta...,
            response.output_text.done, response.content_part.done
        a function call: response.function_call_arguments.delta...,
            response.function_call_arguments.done
        response.output_item.done,
    response.completed (response.incomplete when max_output_tokens cut it short).

The shapes are those of the `openai` SDK's types (openai.types.responses).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..engine.types import FinishInfo, TokenEvent
from .chat import logprob_entry, reasoning_tokens
from .common import finish_reason, json_bytes
from .reasoning import CONTENT, HarmonyParser, ReasoningParser, event_piece, parser_for, read_output
from .response_store import new_id, new_response_id
from .responses import ResponsesRequest
from .tools import ToolCallParser, parse_output


def is_cut(finish: FinishInfo) -> bool:
    """Stopped by the token budget (max_output_tokens, or the context's end)."""
    return finish_reason(finish) == "length"


def usage(finish: FinishInfo, reasoning: int = 0) -> dict:
    """`cached_tokens`: prompt tokens served from the prefix cache; `reasoning`: the
    thinking's tokens among the output's."""
    return {
        "input_tokens": finish.input_length,
        "input_tokens_details": {"cached_tokens": finish.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": finish.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": finish.input_length + finish.generated_tokens,
    }


def output_text(text: str, logprobs: list[dict]) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def message_item(item_id: str, status: str, content: list[dict]) -> dict:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def reasoning_text(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def reasoning_item(item_id: str, status: str, text: str | None) -> dict:
    """The thinking, as vLLM answers it: no summary, the text as its content."""
    content = [reasoning_text(text)] if text is not None else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def call_item(item_id: str, status: str, call_id: str, name: str, arguments: str) -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def delta_logprob(event: TokenEvent) -> dict:
    """A token's logprob as output_text.delta events carry it (no bytes)."""
    return {
        "token": event.token.text,
        "logprob": event.token.logprob,
        "top_logprobs": [{"token": t.text, "logprob": t.logprob} for t in event.top_tokens],
    }


@dataclass
class ResponseRenderer:
    """One request's response object; its id and time are fixed at creation, its output
    once generation ends (the conversation kept for previous_response_id ends with it).
    Behind the front proxy the id names this replica (response_store.new_response_id)."""

    model: str
    request: ResponsesRequest
    id: str = field(default_factory=new_response_id)
    created: int = field(default_factory=lambda: int(time.time()))
    output: list[dict] = field(default_factory=list)
    completed: dict | None = None  # the final response object, once generation ended
    reasoning_tokens: int = 0  # the thinking's, once generation ended

    def response(self, events: list[TokenEvent]) -> bytes:
        """The whole answer (stream: false)."""
        self.reasoning_tokens = reasoning_tokens(self.request.reasoning, events)
        self.output = self._output(events)
        return json_bytes(self.final(events[-1].finish))

    def final(self, finish: FinishInfo) -> dict:
        self.completed = self.snapshot("incomplete" if is_cut(finish) else "completed", finish)
        return self.completed

    def snapshot(self, status: str, finish: FinishInfo | None = None) -> dict:
        echo = self.request.echo
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": echo["instructions"],
            "max_output_tokens": echo["max_output_tokens"],
            "max_tool_calls": None,
            "model": self.model,
            "output": list(self.output) if finish is not None else [],
            "parallel_tool_calls": echo["parallel_tool_calls"],
            "previous_response_id": echo["previous_response_id"],
            "reasoning": echo["reasoning"],
            "store": self.request.store,
            "temperature": echo["temperature"],
            "text": echo["text"],
            "tool_choice": echo["tool_choice"],
            "tools": echo["tools"],
            "top_logprobs": echo["top_logprobs"],
            "top_p": echo["top_p"],
            "truncation": "disabled",
            "usage": usage(finish, self.reasoning_tokens) if finish is not None else None,
            "user": None,
            "metadata": echo["metadata"],
        }

    def _output(self, events: list[TokenEvent]) -> list[dict]:
        finish = events[-1].finish
        text = finish.generated_text
        status = "incomplete" if is_cut(finish) else "completed"
        thought = []  # the reasoning item
        if self.request.reasoning not in (None, CONTENT):
            parser, thinking, text = read_output(self.request.reasoning, events, text)
            if thinking:
                closed = "completed" if parser.state == CONTENT else status
                thought = [reasoning_item(new_id("rs"), closed, thinking)]
            events = events[self.reasoning_tokens :]  # the message's logprobs: the answer's
        plan = self.request.tools
        parsed = parse_output(plan, text) if plan is not None else None
        if parsed is not None and parsed.is_calls and parsed.calls:
            return thought + [
                call_item(
                    new_id("fc"),
                    "completed" if call.complete else status,
                    call.id,
                    call.name,
                    call.arguments,
                )
                for call in parsed.calls
            ]
        logprobs = (
            [logprob_entry(e) for e in events if not e.token.special]
            if self.request.logprobs
            else []
        )
        return thought + [message_item(new_id("msg"), status, [output_text(text, logprobs)])]


@dataclass
class ResponseStream:
    """Engine events -> the semantic events; with tools, text is told apart from calls
    (tools.ToolCallParser) before an output item opens."""

    renderer: ResponseRenderer
    parser: ToolCallParser | None = field(init=False)
    sequence: int = 0
    item: dict | None = None  # the output item being written
    text: str = ""  # the open message's text so far
    tokens: list[TokenEvent] = field(default_factory=list)  # ... and its tokens (logprobs)
    held: list[TokenEvent] = field(default_factory=list)  # tokens whose text isn't sent yet
    thinking: ReasoningParser | HarmonyParser | None = field(init=False)  # the thinking
    thought: str = ""  # the open reasoning item's text so far
    unsure: list[TokenEvent] = field(default_factory=list)  # before `<think>` may open

    def __post_init__(self) -> None:
        plan = self.renderer.request.tools
        self.parser = ToolCallParser(plan) if plan is not None else None
        state = self.renderer.request.reasoning
        self.thinking = parser_for(state) if state not in (None, CONTENT) else None

    def start(self) -> list[bytes]:
        snapshot = self.renderer.snapshot("in_progress")
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def events(self, event: TokenEvent) -> list[bytes]:
        final = event.finish is not None
        text, out = event.text, []
        if self.thinking is not None and self.thinking.state != CONTENT:
            if self.renderer.request.logprobs and not event.token.special:
                self.unsure.append(event)
            # this token is thinking's (harmony's markers are tokens: their own strings)
            reasoning, text = self.thinking.feed(event_piece(self.thinking, event), final)
            if reasoning:
                out.extend(self._reasoning(reasoning))
            if self.thinking.state == CONTENT:
                if self.thinking.tokens == 0:  # no thinking after all: the answer's tokens
                    self.held.extend(self.unsure)
                self.unsure = []
                out.extend(self._close("completed"))
        elif self.renderer.request.logprobs and not event.token.special:
            self.held.append(event)
        if self.parser is None:
            deltas = [{"content": text}] if text else []
        else:
            deltas = self.parser.feed(text) + (self.parser.flush() if final else [])
        out.extend(data for delta in deltas for data in self._delta(delta))
        if final:
            out.extend(self._finish(event.finish))
        return out

    def error(self, message: str, error_type: str) -> bytes:
        """OpenAI's `error` event, for a failure after the stream started."""
        return self._event("error", code=error_type, message=message, param=None)

    # output items --------------------------------------------------------------------

    def _delta(self, delta: dict) -> list[bytes]:
        """A ToolCallParser delta (chat's shapes) as the Responses' events."""
        if "content" in delta:
            return self._text(delta["content"])
        out = []
        for call in delta["tool_calls"]:
            if "id" in call:  # a call's head: the one before it is complete
                out.extend(self._close("completed"))
                out.extend(self._open_call(call["id"], call["function"]["name"]))
            else:
                piece = call["function"]["arguments"]
                self.item["arguments"] += piece
                out.append(self._item_event("response.function_call_arguments.delta", delta=piece))
        return out

    def _reasoning(self, text: str) -> list[bytes]:
        out = []
        if self.item is None:
            self.item = reasoning_item(new_id("rs"), "in_progress", None)
            out.append(
                self._event("response.output_item.added", output_index=self._index, item=self.item)
            )
            out.append(
                self._item_event(
                    "response.content_part.added", content_index=0, part=reasoning_text("")
                )
            )
        self.thought += text
        out.append(self._item_event("response.reasoning_text.delta", content_index=0, delta=text))
        return out

    def _text(self, text: str) -> list[bytes]:
        out = self._open_message() if self.item is None else []
        self.text += text
        logprobs = [delta_logprob(e) for e in self.held]
        self.tokens.extend(self.held)
        self.held = []
        out.append(
            self._item_event(
                "response.output_text.delta", content_index=0, delta=text, logprobs=logprobs
            )
        )
        return out

    def _open_message(self) -> list[bytes]:
        self.item = message_item(new_id("msg"), "in_progress", [])
        return [
            self._event("response.output_item.added", output_index=self._index, item=self.item),
            self._item_event(
                "response.content_part.added", content_index=0, part=output_text("", [])
            ),
        ]

    def _open_call(self, call_id: str, name: str) -> list[bytes]:
        self.item = call_item(new_id("fc"), "in_progress", call_id, name, "")
        return [self._event("response.output_item.added", output_index=self._index, item=self.item)]

    def _close(self, status: str) -> list[bytes]:
        """The open item's closing events; it joins the response's output."""
        if self.item is None:
            return []
        if self.item["type"] == "reasoning":
            part = reasoning_text(self.thought)
            done = [
                self._item_event(
                    "response.reasoning_text.done", content_index=0, text=self.thought
                ),
                self._item_event("response.content_part.done", content_index=0, part=part),
            ]
            item = {**self.item, "status": status, "content": [part]}
        elif self.item["type"] == "message":
            part = output_text(self.text, [logprob_entry(e) for e in self.tokens])
            done = [
                self._item_event(
                    "response.output_text.done",
                    content_index=0,
                    text=self.text,
                    logprobs=[delta_logprob(e) for e in self.tokens],
                ),
                self._item_event("response.content_part.done", content_index=0, part=part),
            ]
            item = {**self.item, "status": status, "content": [part]}
        else:
            arguments = self.item["arguments"]
            done = [self._item_event("response.function_call_arguments.done", arguments=arguments)]
            item = {**self.item, "status": status}
        done.append(self._event("response.output_item.done", output_index=self._index, item=item))
        self.renderer.output.append(item)
        self.item = None
        return done

    def _finish(self, finish: FinishInfo) -> list[bytes]:
        status = "incomplete" if is_cut(finish) else "completed"
        out = []
        if self.item is not None and self.item["type"] == "reasoning":  # cut while thinking
            out.extend(self._close(status))
        self.renderer.reasoning_tokens = self.thinking.tokens if self.thinking is not None else 0
        answered = any(item["type"] != "reasoning" for item in self.renderer.output)
        if self.item is None and not answered:  # an empty answer is a message
            out.extend(self._open_message())
        if self.item is not None and self.item["type"] == "message":
            self.tokens.extend(self.held)  # tokens that added no text of their own
        elif self.item is not None and self.parser.calls[-1].complete:
            status = "completed"
        self.held = []
        out.extend(self._close(status))
        kind = "response.incomplete" if is_cut(finish) else "response.completed"
        out.append(self._event(kind, response=self.renderer.final(finish)))
        return out

    # bytes ---------------------------------------------------------------------------

    @property
    def _index(self) -> int:
        """The open item's output_index: the items before it are all done."""
        return len(self.renderer.output)

    def _item_event(self, kind: str, **fields) -> bytes:
        return self._event(kind, item_id=self.item["id"], output_index=self._index, **fields)

    def _event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + json_bytes(data) + b"\n\n"
