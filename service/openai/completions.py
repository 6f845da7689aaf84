"""/v1/completions: OpenAI's legacy completions. `prompt` is a string or a list of
strings (one choice each, up to max_client_batch_size); `echo` puts the prompt in
front of the text; `suffix` (fill-in-the-middle) is refused, as no served template
supports it."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from ..engine.types import FinishInfo, TokenEvent
from ..request import GenerateParameters, GenerateRequest
from .common import (
    SAMPLING_FIELDS,
    OpenAIRequestError,
    finish_reason,
    json_bytes,
    json_object,
    optional_field,
    refuse_unknown_fields,
    sampling_parameters,
    sse_bytes,
    trim_stop,
)


@dataclass(frozen=True)
class CompletionRequest:
    prompts: tuple[str, ...]
    generates: tuple[GenerateRequest, ...]  # one per prompt, same parameters
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None  # top alternatives per token (legacy `logprobs: N`)
    stop: tuple[str, ...]


# What parse_completion_request reads; anything else is refused (refuse_unknown_fields).
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt", "echo", "logprobs", "suffix", "best_of"}


# TGI's fields as completions call them (request.GenerateRequest.names)
COMPLETION_NAMES = {"inputs": "prompt", "max_new_tokens": "max_tokens", "top_n_tokens": "logprobs"}


def parse_completion_request(body: bytes, max_prompts: int) -> CompletionRequest:
    data = json_object(body)
    refuse_unknown_fields(data, COMPLETION_FIELDS)
    prompts = _prompts(data.get("prompt"), max_prompts)
    if optional_field(data, "suffix", str):
        raise OpenAIRequestError("`suffix` is not supported", "suffix")
    best_of = optional_field(data, "best_of", int)
    if best_of is not None and best_of != 1:  # clients such as LangChain's send 1
        raise OpenAIRequestError("only `best_of: 1` is supported", "best_of")
    params, stop = sampling_parameters(data)
    logprobs = optional_field(data, "logprobs", int)
    if logprobs is not None:
        if logprobs < 0:
            raise OpenAIRequestError("`logprobs` must be >= 0", "logprobs")
        params["top_n_tokens"] = logprobs
    options = optional_field(data, "stream_options", dict) or {}
    return CompletionRequest(
        prompts=prompts,
        generates=tuple(
            GenerateRequest(p, GenerateParameters(**params), names=COMPLETION_NAMES)
            for p in prompts
        ),
        stream=bool(optional_field(data, "stream", bool) or False),
        include_usage=bool(options.get("include_usage", False)),
        echo=bool(optional_field(data, "echo", bool) or False),
        logprobs=logprobs,
        stop=stop,
    )


def _prompts(prompt, max_prompts: int) -> tuple[str, ...]:
    if prompt is None:
        raise OpenAIRequestError("`prompt` is required", "prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise OpenAIRequestError(
            "`prompt` must be a string or a non-empty list of strings", "prompt"
        )
    if len(prompts) > max_prompts:
        raise OpenAIRequestError(
            f"`prompt` supports up to {max_prompts} prompts. Given: {len(prompts)}", "prompt"
        )
    return tuple(prompts)


def legacy_logprobs(events: list[TokenEvent], offset: int) -> dict:
    """The completions API's logprobs object for a run of tokens."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for e in events:
        offsets.append(offset)
        offset += len(e.token.text)
        tokens.append(e.token.text)
        token_logprobs.append(e.token.logprob)
        top.append({t.text: t.logprob for t in e.top_tokens})
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


@dataclass
class CompletionRenderer:
    model: str
    fingerprint: str
    request: CompletionRequest
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def completion(self, runs: list[list[TokenEvent]]) -> bytes:
        choices = []
        for index, events in enumerate(runs):
            finish = events[-1].finish
            prefix = self.request.prompts[index] if self.request.echo else ""
            choices.append(
                {
                    "index": index,
                    "text": prefix + trim_stop(finish.generated_text, self.request.stop),
                    "logprobs": self._logprobs(events, len(prefix)),
                    "finish_reason": finish_reason(finish),
                }
            )
        body = self._envelope(choices)
        body["usage"] = total_usage([events[-1].finish for events in runs])
        return json_bytes(body)

    def chunk(
        self, index: int, text: str, event: TokenEvent | None = None, reason: str | None = None
    ) -> bytes:
        logprobs = self._logprobs([event], 0) if event is not None else None
        body = self._envelope(
            [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}]
        )
        if self.request.include_usage:
            body["usage"] = None
        return sse_bytes(body)

    def usage_chunk(self, finishes: list[FinishInfo]) -> bytes:
        body = self._envelope([])
        body["usage"] = total_usage(finishes)
        return sse_bytes(body)

    def _envelope(self, choices: list) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }

    def _logprobs(self, events: list[TokenEvent], offset: int):
        if self.request.logprobs is None:
            return None
        return legacy_logprobs([e for e in events if not e.token.special], offset)


def total_usage(finishes: list[FinishInfo]) -> dict:
    prompt = sum(f.input_length for f in finishes)
    completion = sum(f.generated_tokens for f in finishes)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
