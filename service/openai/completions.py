"""/v1/completions: OpenAI's legacy completions. `prompt` is a string or a list of
strings (up to max_client_batch_size), each answered with `n` choices (choice
`prompt_index * n + i`); `best_of` > n samples that many and keeps the n most likely
(by summed token logprob; not streamable, as OpenAI's); `echo` puts the prompt in front
of the text; `suffix` (fill-in-the-middle) is refused, as no served template supports
it."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from ..engine.types import FinishInfo, TokenEvent
from ..intake.request import GenerateParameters, GenerateRequest
from .common import (
    OpenAIRequestError,
    finish_reason,
    json_bytes,
    sampling_parameters,
    sse_bytes,
    trim_stop,
    usage,
)
from .parse import parse_body
from .protocol import CompletionBody


@dataclass(frozen=True)
class CompletionRequest:
    prompts: tuple[str, ...]
    generates: tuple[GenerateRequest, ...]  # one per prompt, same parameters
    n: int  # choices answered per prompt
    best_of: int  # choices sampled per prompt (>= n): the n most likely are answered
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None  # top alternatives per token (legacy `logprobs: N`)
    stop: tuple[str, ...]


# TGI's fields as completions call them (request.GenerateRequest.names)
COMPLETION_NAMES = {"inputs": "prompt", "max_new_tokens": "max_tokens", "top_n_tokens": "logprobs"}


def parse_completion_request(body: bytes, max_prompts: int) -> CompletionRequest:
    request = parse_body(CompletionBody, body)
    prompts = _prompts(request.prompt, max_prompts)
    params = sampling_parameters(request)
    n = request.n or 1
    best_of = request.best_of or n
    params["n"] = best_of  # sampled; validation bounds it by --max-n
    if request.logprobs is not None:
        params["top_n_tokens"] = request.logprobs
    names = {**COMPLETION_NAMES, "n": "best_of" if best_of > n else "n"}
    return CompletionRequest(
        prompts=prompts,
        generates=tuple(
            GenerateRequest(p, GenerateParameters(**params), names=names) for p in prompts
        ),
        n=n,
        best_of=best_of,
        stream=bool(request.stream),
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        echo=bool(request.echo),
        logprobs=request.logprobs,
        stop=params["stop"],
    )


def _prompts(prompt: str | list[str], max_prompts: int) -> tuple[str, ...]:
    prompts = (prompt,) if isinstance(prompt, str) else tuple(prompt)
    if len(prompts) > max_prompts:
        raise OpenAIRequestError(
            f"`prompt` supports up to {max_prompts} prompts. Given: {len(prompts)}", "prompt"
        )
    return prompts


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

    def completion(self, runs: list[list[list[TokenEvent]]]) -> bytes:
        """The answer: per prompt, each sampled choice's events, in choice order."""
        choices = []
        n = self.request.n
        for p, sampled in enumerate(runs):
            prefix = self.request.prompts[p] if self.request.echo else ""
            for i, events in enumerate(best(sampled, n)):
                finish = events[-1].finish
                choices.append(
                    {
                        "index": p * n + i,
                        "text": prefix + trim_stop(finish.generated_text, self.request.stop),
                        "logprobs": self._logprobs(events, len(prefix)),
                        "finish_reason": finish_reason(finish),
                    }
                )
        body = self._envelope(choices)
        body["usage"] = usage(*([events[-1].finish for events in sampled] for sampled in runs))
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

    def usage_chunk(self, finishes: list[list[FinishInfo]]) -> bytes:
        """The totals: per prompt, its choices' finishes."""
        body = self._envelope([])
        body["usage"] = usage(*finishes)
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


def best(sampled: list[list[TokenEvent]], n: int) -> list[list[TokenEvent]]:
    """The n most likely of the sampled choices (by summed token logprob), or all of
    them, in order, when n were sampled."""
    if len(sampled) == n:
        return sampled
    return sorted(sampled, key=lambda events: -sum(e.token.logprob for e in events))[:n]
