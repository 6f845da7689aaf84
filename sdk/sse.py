"""Incremental decoding of server-sent events (`text/event-stream`): TGI's and OpenAI's.

The ChatCompletions and Completions RPCs stream `google.api.HttpBody` messages
whose bytes, joined, are SSE frames: `data: {...json...}\\n\\n` ... `data: [DONE]\\n\\n`;
the Responses RPC's frames also name their event (`event: response.created`) and
end without `[DONE]`. TGI's `/generate_stream` (HTTP, through Envoy) sends one
`data: {...}` frame per token, the last one with `generated_text`, and no end marker.
A message may hold several frames, part of one, or split a UTF-8 character, so the
decoder buffers bytes and only decodes complete lines.

`EventStream` adds what a stream's reader must know: an error event raises its typed
error, and a stream that ends (or breaks) before its last event raises
`IncompleteGenerationError`: over HTTP/1.1 nothing else tells a cut stream from a
finished one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any, Literal

from .errors import IncompleteGenerationError, TextGenError, from_event

__all__ = ["EventStream", "SseDecoder"]

# The Responses API's last events (it sends no `[DONE]`).
RESPONSES_LAST_EVENTS = ("response.completed", "response.incomplete", "response.failed")

DONE_SENTINEL = "[DONE]"


class SseDecoder:
    """Feed it byte chunks; it returns the JSON payload of each complete `data` event.

    Follows the SSE rules that matter here: lines end in LF or CRLF, a blank line
    ends an event, several `data:` lines of one event join with a newline, lines
    starting with `:` are comments, and other fields (`event:`, `id:`) are ignored.
    `data: [DONE]` sets `done`; anything after it is ignored.
    """

    def __init__(self) -> None:
        self._pending = b""  # bytes after the last complete line
        self._data_lines: list[str] = []
        self.done = False

    def feed(self, chunk: bytes) -> list[Any]:
        """The payloads of the events that `chunk` completes."""
        self._pending += chunk
        *lines, self._pending = self._pending.split(b"\n")
        payloads: list[Any] = []
        for line in lines:
            payloads.extend(self._take_line(line.removesuffix(b"\r").decode("utf-8")))
        return payloads

    def close(self) -> list[Any]:
        """The payload of a last event the server ended without its blank line."""
        tail = self._pending.removesuffix(b"\r").decode("utf-8")
        self._pending = b""
        payloads = self._take_line(tail) if tail else []
        return payloads + self._take_line("")

    def _take_line(self, line: str) -> list[Any]:
        if self.done:
            return []
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return []
        field, _, value = line.partition(":")
        if field == "data":
            self._data_lines.append(value.removeprefix(" "))
        return []

    def _dispatch(self) -> list[Any]:
        data, self._data_lines = "\n".join(self._data_lines), []
        if not data:
            return []
        if data.strip() == DONE_SENTINEL:
            self.done = True
            return []
        return [json.loads(data)]


class EventStream:
    """The events of one TGI or OpenAI SSE stream, checked as they are decoded.

    `feed` bytes as they arrive and `close` at the end of the body, or hand `read` the
    body's chunks. An error event raises its TextGenError; a body that ends, or can't
    be read to its end, before the stream's last event raises IncompleteGenerationError.
    Both carry `tokens_received`. The last event: TGI's carries `generated_text`;
    OpenAI's chat and completions streams end with `data: [DONE]`, the Responses API
    with one of RESPONSES_LAST_EVENTS.
    """

    def __init__(self, face: Literal["tgi", "openai"]) -> None:
        self._decoder = SseDecoder()
        self._tgi = face == "tgi"
        self._last_seen = False
        self.tokens_received = 0

    @property
    def finished(self) -> bool:
        return self._last_seen or self._decoder.done

    def feed(self, chunk: bytes) -> Iterator[Any]:
        """The events that `chunk` completes, up to an error event (which raises)."""
        return self._checked(self._decoder.feed(chunk))

    def close(self) -> Iterator[Any]:
        """A last event the body ended without its blank line; raises if the stream
        had not finished."""
        try:
            tail = self._decoder.close()
        except ValueError as exc:  # cut mid-event: half a JSON document
            raise self.broken("the stream ended mid-event") from exc
        yield from self._checked(tail)
        if not self.finished:
            raise self.broken("the stream ended before its last event")

    def read(self, chunks: Iterable[bytes]) -> Iterator[Any]:
        """The events of a body read as `chunks`; a failure to read it (the connection
        closed mid-chunk: http.client's IncompleteRead, requests' ChunkedEncodingError,
        a reset) before the last event raises IncompleteGenerationError."""
        source = iter(chunks)
        try:
            while True:
                try:
                    chunk = next(source)
                except StopIteration:
                    break
                except TextGenError:  # the reader's own typed failure (a refusal)
                    raise
                except Exception as exc:  # any failure of the body's reader
                    if self.finished:  # the generation is whole: how the body ended is moot
                        return
                    raise self.broken(f"the stream broke: {exc!r}") from exc
                yield from self.feed(chunk)
            yield from self.close()
        finally:
            if hasattr(source, "close"):  # a generator: let it close its connection now
                source.close()

    def broken(self, why: str) -> IncompleteGenerationError:
        return IncompleteGenerationError(
            f"{why} ({self.tokens_received} tokens received)",
            tokens_received=self.tokens_received,
        )

    def _checked(self, events: list[Any]) -> Iterator[Any]:
        for event in events:
            if self._last_seen:  # nothing follows a stream's last event
                return
            error = from_event(event, self.tokens_received)
            if error is not None:
                raise error
            self.tokens_received += self._tokens_in(event)
            self._last_seen = self._is_last(event)
            yield event

    def _tokens_in(self, event: Any) -> int:
        if not isinstance(event, dict):
            return 0
        if self._tgi:
            return int("token" in event)
        if event.get("type") in ("response.output_text.delta", "response.refusal.delta"):
            return 1
        choices = event.get("choices") or []
        return int(any(_generated(choice) for choice in choices if isinstance(choice, dict)))

    def _is_last(self, event: Any) -> bool:
        if not isinstance(event, dict):
            return False
        if self._tgi:
            return event.get("generated_text") is not None
        return event.get("type") in RESPONSES_LAST_EVENTS


def _generated(choice: dict) -> bool:
    """A chat or completions choice that carries generated text (or a tool call)."""
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return bool(delta.get("content") or delta.get("tool_calls"))
    return bool(choice.get("text"))
