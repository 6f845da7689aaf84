"""TGI's and OpenAI's streaming HTTP routes from the standard library, with typed ends.

    from textgen.sdk import http_streams
    for event in http_streams.generate_stream(
        "http://127.0.0.1:8080", "Once upon a time", max_new_tokens=20
    ):
        print(event["token"]["text"], end="", flush=True)

Each function yields the stream's JSON events and raises the SDK's typed errors: a
refusal (422, 429, 503, ...) and an error event the server sent raise their class
(ValidationError, OverloadedError, ...), and a stream that ends before its last event
raises IncompleteGenerationError with `tokens_received`. An HTTP/1.1 response can't
carry a status once it started: when the replica behind Envoy dies mid-stream, Envoy
can only cut the chunked body short (docs/failures.md), and this is how a client tells
that from a finished stream. An unreachable server raises UnavailableError.

`tgi_events` and `openai_events` do the same for a body that another HTTP client reads
(`requests`' `iter_content(None)`, `httpx`'s `iter_bytes()`).
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from .errors import (
    OverloadedError,
    TextGenError,
    UnauthenticatedError,
    UnavailableError,
    UnknownError,
    ValidationError,
    from_event,
)
from .sse import EventStream

__all__ = [
    "chat_completions_stream",
    "completions_stream",
    "generate_stream",
    "openai_events",
    "responses_stream",
    "tgi_events",
]

READ_SIZE = 64 * 1024  # at most this many bytes per read; a read returns what has arrived

# A refusal without a typed JSON body (a proxy of another make in between): by status.
_CLASS_BY_STATUS: dict[int, type[TextGenError]] = {
    401: UnauthenticatedError,
    413: ValidationError,
    422: ValidationError,
    429: OverloadedError,
    502: UnavailableError,
    503: UnavailableError,
}


def tgi_events(chunks: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The events of a TGI `/generate_stream` body read as `chunks`, up to the last one
    (the one with `generated_text`)."""
    return EventStream("tgi").read(chunks)


def openai_events(chunks: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The events of an OpenAI streaming body (chat, completions, responses) read as
    `chunks`, up to `data: [DONE]` (the Responses API: its last event)."""
    return EventStream("openai").read(chunks)


def generate_stream(
    base_url: str,
    inputs: str,
    *,
    api_key: str | None = None,
    timeout: float | None = None,
    headers: Mapping[str, str] | None = None,
    **parameters: Any,
) -> Iterator[dict[str, Any]]:
    """POST `{"inputs", "parameters"}` to `base_url`/generate_stream: TGI's events.

    `parameters` are TGI's, as its JSON names them (max_new_tokens=20, top_n_tokens=5,
    ...). `api_key` is sent as `Authorization: Bearer`; `timeout` (seconds) bounds the
    connection and each read. The request is sent on the first iteration.
    """
    body = {"inputs": inputs, "parameters": parameters}
    request = _Request(base_url, "/generate_stream", body, api_key, timeout, headers)
    return EventStream("tgi").read(request.chunks())


def chat_completions_stream(
    base_url: str,
    body: Mapping[str, Any],
    *,
    api_key: str | None = None,
    timeout: float | None = None,
    headers: Mapping[str, str] | None = None,
) -> Iterator[dict[str, Any]]:
    """OpenAI's chat completion chunks from `base_url`/v1/chat/completions (sent with
    stream=true), up to `data: [DONE]`."""
    return _openai(base_url, "/v1/chat/completions", body, api_key, timeout, headers)


def completions_stream(
    base_url: str,
    body: Mapping[str, Any],
    *,
    api_key: str | None = None,
    timeout: float | None = None,
    headers: Mapping[str, str] | None = None,
) -> Iterator[dict[str, Any]]:
    """OpenAI's (legacy) completion chunks from `base_url`/v1/completions."""
    return _openai(base_url, "/v1/completions", body, api_key, timeout, headers)


def responses_stream(
    base_url: str,
    body: Mapping[str, Any],
    *,
    api_key: str | None = None,
    timeout: float | None = None,
    headers: Mapping[str, str] | None = None,
) -> Iterator[dict[str, Any]]:
    """OpenAI's Responses API events from `base_url`/v1/responses, `response.created`
    to `response.completed` (or `.incomplete`, `.failed`)."""
    return _openai(base_url, "/v1/responses", body, api_key, timeout, headers)


def _openai(
    base_url: str,
    path: str,
    body: Mapping[str, Any],
    api_key: str | None,
    timeout: float | None,
    headers: Mapping[str, str] | None,
) -> Iterator[dict[str, Any]]:
    request = _Request(base_url, path, {**body, "stream": True}, api_key, timeout, headers)
    return EventStream("openai").read(request.chunks())


class _Request:
    """One streaming POST with http.client; `chunks()` sends it and yields the body."""

    def __init__(
        self,
        base_url: str,
        path: str,
        body: Mapping[str, Any],
        api_key: str | None,
        timeout: float | None,
        headers: Mapping[str, str] | None,
    ) -> None:
        self.url = urllib.parse.urlsplit(base_url)
        self.path = self.url.path.rstrip("/") + path
        self.body = json.dumps(body).encode()
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if api_key is not None:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.headers.update(headers or {})

    def chunks(self) -> Iterator[bytes]:
        """The body's bytes as they arrive. Failures before the body raise their
        TextGenError here; a failure while reading it is the caller's (EventStream)."""
        https = self.url.scheme == "https"
        connection = (http.client.HTTPSConnection if https else http.client.HTTPConnection)(
            self.url.hostname or "localhost", self.url.port, timeout=self.timeout
        )
        try:
            try:
                connection.request("POST", self.path, self.body, self.headers)
                response = connection.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                raise UnavailableError(f"{self.url.geturl()}: {exc!r}") from exc
            if response.status != 200:
                raise _refusal(response.status, response.read())
            while chunk := response.read1(READ_SIZE):
                yield chunk
        finally:
            connection.close()


def _refusal(status: int, body: bytes) -> TextGenError:
    """The typed error of a non-200 answer: from its TGI or OpenAI JSON body, else by status."""
    try:
        error = from_event(json.loads(body))
    except ValueError:  # not JSON (UnicodeDecodeError is one)
        error = None
    if error is not None:
        return error
    cls = _CLASS_BY_STATUS.get(status, UnknownError)
    return cls(f"HTTP {status}: {body[:200].decode(errors='replace')}")
