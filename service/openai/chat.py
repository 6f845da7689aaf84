"""/v1/chat/completions: OpenAI JSON -> a templated GenerateRequest, and engine
events -> OpenAI's `chat.completion` / `chat.completion.chunk` bytes."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from ..engine.types import FinishInfo, TokenEvent
from ..proto import generate_pb2 as pb
from .common import (
    OpenAIRequestError,
    finish_reason,
    json_bytes,
    json_object,
    optional_field,
    required_field,
    sampling_parameters,
    sse_bytes,
    trim_stop,
    usage,
)


@dataclass(frozen=True)
class ChatRequest:
    generate: pb.GenerateRequest  # the templated prompt and TGI parameters
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    stop: tuple[str, ...]


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def parse_chat_request(body: bytes, tokenizer) -> ChatRequest:
    data = json_object(body)
    messages = [_message(m, i) for i, m in enumerate(required_field(data, "messages", list))]
    if not messages:
        raise OpenAIRequestError("`messages` must not be empty", "messages")
    try:
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:
        raise OpenAIRequestError(f"cannot apply the chat template: {exc}", "messages") from exc
    params, stop = sampling_parameters(data)
    logprobs = bool(optional_field(data, "logprobs", bool) or False)
    top_logprobs = optional_field(data, "top_logprobs", int) or 0
    if top_logprobs and not logprobs:
        raise OpenAIRequestError("`top_logprobs` requires `logprobs: true`", "top_logprobs")
    if top_logprobs:
        params.top_n_tokens = top_logprobs
    stream = bool(optional_field(data, "stream", bool) or False)
    options = optional_field(data, "stream_options", dict) or {}
    include_usage = bool(options.get("include_usage", False))
    return ChatRequest(
        generate=pb.GenerateRequest(inputs=prompt, parameters=params),
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        stop=stop,
    )


def _message(m, index: int) -> dict:
    if not isinstance(m, dict):
        raise OpenAIRequestError(f"`messages[{index}]` must be an object", "messages")
    role = m.get("role")
    if role not in _ROLES:
        raise OpenAIRequestError(f"`messages[{index}].role` must be one of {sorted(_ROLES)}", "messages")
    out = {"role": "system" if role == "developer" else role, "content": _content(m.get("content"), index)}
    for key in ("name", "tool_call_id", "tool_calls"):
        if key in m:
            out[key] = m[key]
    return out


def _content(content, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIRequestError(
                    f"`messages[{index}].content` parts must be text parts ({{\"type\": \"text\", \"text\": ...}})",
                    "messages",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise OpenAIRequestError(f"`messages[{index}].content` must be a string or a list of parts", "messages")


# responses ------------------------------------------------------------------------


def logprob_entry(event: TokenEvent) -> dict:
    token = event.token
    return {
        "token": token.text,
        "logprob": token.logprob,
        "bytes": list(token.text.encode()),
        "top_logprobs": [
            {"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())} for t in event.top_tokens
        ],
    }


@dataclass
class ChatRenderer:
    """Renders one request's answer; ids and timestamps are fixed at creation."""

    model: str
    fingerprint: str
    request: ChatRequest
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def completion(self, events: list[TokenEvent]) -> bytes:
        finish = events[-1].finish
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": trim_stop(finish.generated_text, self.request.stop)},
            "logprobs": self._logprobs(events),
            "finish_reason": finish_reason(finish),
        }
        body = self._envelope("chat.completion", [choice])
        body["usage"] = usage(finish)
        return json_bytes(body)

    def first_chunk(self) -> bytes:
        return self._chunk({"role": "assistant", "content": ""}, None, None)

    def content_chunk(self, text: str, event: TokenEvent | None) -> bytes:
        logprobs = self._logprobs([event]) if event is not None else None
        return self._chunk({"content": text}, None, logprobs)

    def final_chunk(self, finish: FinishInfo) -> bytes:
        return self._chunk({}, finish_reason(finish), None)

    def usage_chunk(self, finish: FinishInfo) -> bytes:
        body = self._envelope("chat.completion.chunk", [])
        body["usage"] = usage(finish)
        return sse_bytes(body)

    def _chunk(self, delta: dict, reason: str | None, logprobs) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        body = self._envelope("chat.completion.chunk", [choice])
        if self.request.include_usage:
            body["usage"] = None
        return sse_bytes(body)

    def _envelope(self, obj: str, choices: list) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }

    def _logprobs(self, events: list[TokenEvent]):
        if not self.request.logprobs:
            return None
        return {"content": [logprob_entry(e) for e in events if not e.token.special]}




