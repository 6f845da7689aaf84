"""What OpenAI's chat and completions routes share: request-field parsing with
OpenAI's types, the sampling fields as TGI parameters, usage, stop handling and the
JSON/SSE byte writers."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from ..engine.types import FinishInfo
from ..validation import ValidationError


class OpenAIRequestError(ValidationError):
    """A malformed OpenAI request: a validation error, reported in OpenAI's shape with
    the offending field as `param`."""


# The request fields both routes read in sampling_parameters(); beside OpenAI's own,
# the extensions vLLM and TGI users send (`top_k`, `repetition_penalty`, `ignore_eos`,
# `priority`).
SAMPLING_FIELDS = frozenset(
    {
        "max_tokens", "n", "temperature", "top_p", "top_k", "frequency_penalty",
        "presence_penalty", "repetition_penalty", "seed", "stop", "logit_bias", "ignore_eos",
        "priority", "stream", "stream_options",
    }
)  # fmt: skip
# Accepted so that clients which always send them work, with no effect on the answer
# (envoy/openapi.json says so): no end-user id is kept, and `prompt_cache_key` is read by
# the front proxy (envoy/affinity.py) to route a conversation to the replica that cached it.
# `model` picks a LoRA adapter when the server serves some (sampling_parameters).
COMPATIBLE_FIELDS = frozenset({"model", "user", "prompt_cache_key"})


def refuse_unknown_fields(data: dict, known: frozenset[str]) -> None:
    """A field the route doesn't read is refused, naming it (as OpenAI does), rather than
    accepted and silently ignored. A null value is as good as absent."""
    for key, value in data.items():
        if value is not None and key not in known and key not in COMPATIBLE_FIELDS:
            raise OpenAIRequestError(f"`{key}` is not supported", key)


def sampling_parameters(data: dict) -> tuple[dict, tuple[str, ...]]:
    """The OpenAI sampling fields shared by chat and completions (SAMPLING_FIELDS but
    `stream`), as keyword arguments of request.GenerateParameters, and the stop strings."""
    params: dict = {}
    n = optional_field(data, "n", int)
    if n is not None and n < 1:
        raise OpenAIRequestError("`n` must be at least 1", "n")
    params["n"] = n  # its upper bound is the server's (validation.py: --max-n)
    max_tokens = optional_field(data, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = optional_field(data, "max_tokens", int)
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    temperature = optional_field(data, "temperature", float)
    if temperature is not None and temperature < 0:
        raise OpenAIRequestError("`temperature` must be >= 0", "temperature")
    sampling = temperature is None or temperature > 0  # OpenAI samples unless temperature is 0
    top_p = checked_top_p(data)
    top_k = optional_field(data, "top_k", int)
    if top_k is not None and top_k < -1:
        raise OpenAIRequestError("`top_k` must be -1 or 0 (off) or a positive integer", "top_k")
    if sampling:
        params["do_sample"] = True
        params["temperature"] = temperature
        if top_p is not None and top_p < 1.0:
            params["top_p"] = top_p
        if top_k is not None and top_k > 0:
            params["top_k"] = top_k
    params["repetition_penalty"] = optional_field(data, "repetition_penalty", float)
    params["ignore_eos"] = bool(optional_field(data, "ignore_eos", bool))
    params["priority"] = optional_field(data, "priority", int)  # vLLM's: lower is sooner
    for name in ("frequency_penalty", "presence_penalty"):
        params[name] = optional_field(data, name, float)
    params["seed"] = optional_field(data, "seed", int, bounds=(0, 2**64 - 1))
    stop = _stop(data)
    params["stop"] = stop
    logit_bias = {}
    for token, bias in (optional_field(data, "logit_bias", dict) or {}).items():
        token = str(token)
        number = isinstance(bias, (int, float)) and not isinstance(bias, bool)
        if not (
            token.isascii()
            and token.isdigit()
            and int(token) < 2**32
            and number
            and math.isfinite(bias)
        ):
            raise OpenAIRequestError("`logit_bias` maps token ids to finite numbers", "logit_bias")
        logit_bias[int(token)] = float(bias)
    params["logit_bias"] = logit_bias
    params["model"] = optional_field(data, "model", str)  # the base or a LoRA adapter
    return params, stop


def checked_top_p(data: dict) -> float | None:
    """`top_p` within OpenAI's bounds, (0, 1]."""
    top_p = optional_field(data, "top_p", float)
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise OpenAIRequestError(f"`top_p` must be > 0 and <= 1. Given: {top_p}", "top_p")
    return top_p


# OpenAI's bound on top_logprobs (TGI's routes keep the server's --max-top-n-tokens)
MAX_TOP_LOGPROBS = 20


def checked_top_logprobs(data: dict) -> int:
    """`top_logprobs` within OpenAI's bounds, 0 to 20 (0 when absent)."""
    top_logprobs = optional_field(data, "top_logprobs", int) or 0
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise OpenAIRequestError(
            f"`top_logprobs` must be >= 0 and <= {MAX_TOP_LOGPROBS}. Given: {top_logprobs}",
            "top_logprobs",
        )
    return top_logprobs


def _stop(data: dict) -> tuple[str, ...]:
    stop = data.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise OpenAIRequestError("`stop` must be a string or a list of strings", "stop")


def json_object(body: bytes) -> dict:
    try:
        data = json.loads(body or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        raise OpenAIRequestError(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise OpenAIRequestError("the body must be a JSON object")
    return data


_TYPE_NAMES = {
    list: "an array",
    dict: "an object",
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    str: "a string",
}


# Integers land in int32 proto fields unless a field says otherwise.
INT32 = (-(2**31), 2**31 - 1)


def optional_field(data: dict, key: str, kind: type, bounds: tuple[int, int] = INT32):
    """data[key] checked against OpenAI's type (None when absent); integers must fit
    `bounds` and numbers must be finite, so nothing overflows a proto field."""
    value = data.get(key)
    if value is None:
        return None
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise OpenAIRequestError(f"`{key}` must be {_TYPE_NAMES[kind]}", key)
    if kind is int and not bounds[0] <= value <= bounds[1]:
        raise OpenAIRequestError(f"`{key}` must be between {bounds[0]} and {bounds[1]}", key)
    if kind is float and not math.isfinite(value):
        raise OpenAIRequestError(f"`{key}` must be a finite number", key)
    return value


def required_field(data: dict, key: str, kind: type):
    if data.get(key) is None:
        raise OpenAIRequestError(f"`{key}` is required", key)
    return optional_field(data, key, kind)


def finish_reason(finish: FinishInfo) -> str:
    return "length" if finish.reason.value == "length" else "stop"


def trim_stop(text: str, stop: tuple[str, ...]) -> str:
    """OpenAI leaves the stop sequence out of the content."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


def usage(*prompts: list[FinishInfo]) -> dict:
    """OpenAI's usage of one or more prompts, each given as its choices' finishes: a
    prompt counts once (its choices share it), completions add up over every choice.
    `cached_tokens`: prompt tokens served from the prefix cache."""
    prompt = sum(choices[0].input_length for choices in prompts)
    completion = sum(f.generated_tokens for choices in prompts for f in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(c[0].cached_tokens for c in prompts)},
    }


DONE = b"data: [DONE]\n\n"


def json_bytes(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def sse_bytes(obj) -> bytes:
    return b"data: " + json_bytes(obj) + b"\n\n"


def error_body(message: str, error_type: str, param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": None}}


def sse_error(message: str, error_type: str) -> bytes:
    return sse_bytes(error_body(message, error_type))


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
