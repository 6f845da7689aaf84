"""What OpenAI's routes share: their error, the sampling fields (protocol.py) as TGI
parameters, usage, stop handling and the JSON/SSE byte writers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..engine.types import FinishInfo
from ..intake.validation import ValidationError

if TYPE_CHECKING:
    from .protocol import CommonFields, SamplingFields


class OpenAIRequestError(ValidationError):
    """A malformed OpenAI request: a validation error, reported in OpenAI's shape with
    the offending field as `param`."""


def common_parameters(request: CommonFields) -> dict:
    """What every route's sampling fields mean, as keyword arguments of
    request.GenerateParameters."""
    params = sampler_parameters(request.temperature, request.top_p, request.top_k)
    params["repetition_penalty"] = request.repetition_penalty
    params["ignore_eos"] = bool(request.ignore_eos)
    params["priority"] = request.priority  # vLLM's: lower is sooner
    params["model"] = request.model  # the base or a LoRA adapter
    return params


def sampler_parameters(temperature: float | None, top_p: float | None, top_k: int | None) -> dict:
    """OpenAI's (and Anthropic's) sampler: sampled unless temperature is 0 (unset: 1.0),
    with nucleus and top-k when they cut anything; keyword arguments of
    request.GenerateParameters."""
    if temperature is not None and temperature <= 0:
        return {}
    params: dict = {"do_sample": True, "temperature": temperature}
    if top_p is not None and top_p < 1.0:
        params["top_p"] = top_p
    if top_k is not None and top_k > 0:
        params["top_k"] = top_k
    return params


def sampling_parameters(request: SamplingFields) -> dict:
    """Chat's and completions' sampling fields, as keyword arguments of
    request.GenerateParameters; `stop` is a tuple of strings."""
    params = common_parameters(request)
    params["n"] = request.n  # its upper bound is the server's (intake/validation.py: --max-n)
    if request.max_tokens is not None:
        params["max_new_tokens"] = request.max_tokens
    params["frequency_penalty"] = request.frequency_penalty
    params["presence_penalty"] = request.presence_penalty
    params["seed"] = request.seed
    stop = request.stop
    params["stop"] = (stop,) if isinstance(stop, str) else tuple(stop or ())
    params["logit_bias"] = {int(token): bias for token, bias in (request.logit_bias or {}).items()}
    return params


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
