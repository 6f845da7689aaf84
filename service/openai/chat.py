"""/v1/chat/completions: OpenAI JSON -> a templated GenerateRequest, and engine
events -> OpenAI's `chat.completion` / `chat.completion.chunk` bytes."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from ..engine.types import FinishInfo, TokenEvent
from ..proto import generate_pb2 as pb


class OpenAIRequestError(Exception):
    """A malformed OpenAI request (a validation error, reported in OpenAI's shape)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


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
    data = _json_object(body)
    messages = [_message(m, i) for i, m in enumerate(_required(data, "messages", list))]
    if not messages:
        raise OpenAIRequestError("`messages` must not be empty", "messages")
    try:
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - a template that can't render this conversation
        raise OpenAIRequestError(f"cannot apply the chat template: {exc}", "messages") from exc
    params, stop = sampling_parameters(data)
    logprobs = bool(_optional(data, "logprobs", bool) or False)
    top_logprobs = _optional(data, "top_logprobs", int) or 0
    if top_logprobs and not logprobs:
        raise OpenAIRequestError("`top_logprobs` requires `logprobs: true`", "top_logprobs")
    if top_logprobs:
        params.top_n_tokens = top_logprobs
    stream = bool(_optional(data, "stream", bool) or False)
    options = _optional(data, "stream_options", dict) or {}
    include_usage = bool(options.get("include_usage", False))
    return ChatRequest(
        generate=pb.GenerateRequest(inputs=prompt, parameters=params),
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        stop=stop,
    )


def sampling_parameters(data: dict) -> tuple[pb.GenerateParameters, tuple[str, ...]]:
    """The OpenAI sampling fields shared by chat and completions, as TGI parameters."""
    params = pb.GenerateParameters()
    n = _optional(data, "n", int)
    if n is not None and n != 1:
        raise OpenAIRequestError("only `n: 1` is supported", "n")
    max_tokens = _optional(data, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _optional(data, "max_tokens", int)
    if max_tokens is not None:
        params.max_new_tokens = max_tokens
    temperature = _optional(data, "temperature", float)
    if temperature is not None and temperature < 0:
        raise OpenAIRequestError("`temperature` must be >= 0", "temperature")
    sampling = temperature is None or temperature > 0  # OpenAI samples unless temperature is 0
    top_p = _optional(data, "top_p", float)
    if sampling:
        params.do_sample = True
        if temperature is not None:
            params.temperature = temperature
        if top_p is not None and top_p < 1.0:
            params.top_p = top_p
    for name in ("frequency_penalty", "presence_penalty"):
        value = _optional(data, name, float)
        if value is not None:
            setattr(params, name, value)
    seed = _optional(data, "seed", int)
    if seed is not None:
        if seed < 0:
            raise OpenAIRequestError("`seed` must be >= 0", "seed")
        params.seed = seed
    stop = _stop(data)
    params.stop.extend(stop)
    for token, bias in (_optional(data, "logit_bias", dict) or {}).items():
        if not str(token).isdigit() or not isinstance(bias, (int, float)) or isinstance(bias, bool):
            raise OpenAIRequestError("`logit_bias` maps token ids to numbers", "logit_bias")
        params.logit_bias[int(token)] = float(bias)
    return params, stop


def _stop(data: dict) -> tuple[str, ...]:
    stop = data.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise OpenAIRequestError("`stop` must be a string or a list of strings", "stop")


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


def _json_object(body: bytes) -> dict:
    try:
        data = json.loads(body or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        raise OpenAIRequestError(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise OpenAIRequestError("the body must be a JSON object")
    return data


_TYPE_NAMES = {list: "an array", dict: "an object", int: "an integer", float: "a number", bool: "a boolean", str: "a string"}


def _optional(data: dict, key: str, kind: type):
    value = data.get(key)
    if value is None:
        return None
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise OpenAIRequestError(f"`{key}` must be {_TYPE_NAMES[kind]}", key)
    return value


def _required(data: dict, key: str, kind: type):
    if data.get(key) is None:
        raise OpenAIRequestError(f"`{key}` is required", key)
    return _optional(data, key, kind)


# responses ------------------------------------------------------------------------


def finish_reason(finish: FinishInfo) -> str:
    return "length" if finish.reason.value == "length" else "stop"


def trim_stop(text: str, stop: tuple[str, ...]) -> str:
    """OpenAI leaves the stop sequence out of the content."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


def usage(finish: FinishInfo) -> dict:
    return {
        "prompt_tokens": finish.input_length,
        "completion_tokens": finish.generated_tokens,
        "total_tokens": finish.input_length + finish.generated_tokens,
    }


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
        return _json(body)

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
        return _sse(body)

    def _chunk(self, delta: dict, reason: str | None, logprobs) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        body = self._envelope("chat.completion.chunk", [choice])
        if self.request.include_usage:
            body["usage"] = None
        return _sse(body)

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


DONE = b"data: [DONE]\n\n"


def _json(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _sse(obj) -> bytes:
    return b"data: " + _json(obj) + b"\n\n"


def error_body(message: str, error_type: str, param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": None}}


def sse_error(message: str, error_type: str) -> bytes:
    return _sse(error_body(message, error_type))


@dataclass
class StopHoldback:
    """Streams content without ever showing a stop sequence: text that could be the
    start of one is held until the next token decides."""

    stop: tuple[str, ...]
    _text: str = ""
    _emitted: int = 0

    def feed(self, text: str, final: bool) -> str:
        self._text += text
        visible = trim_stop(self._text, self.stop)
        if not final and len(visible) == len(self._text):
            visible = visible[: len(visible) - self._partial_stop_suffix(visible)]
        out = visible[self._emitted :]
        self._emitted = max(self._emitted, len(visible))
        return out

    def _partial_stop_suffix(self, text: str) -> int:
        """Length of the longest tail of `text` that begins some stop sequence."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
