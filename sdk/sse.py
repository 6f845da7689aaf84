"""Incremental decoding of OpenAI-style server-sent events (`text/event-stream`).

The ChatCompletions and Completions RPCs stream `google.api.HttpBody` messages
whose bytes, joined, are SSE frames: `data: {...json...}\\n\\n` ... `data: [DONE]\\n\\n`;
the Responses RPC's frames also name their event (`event: response.created`) and
end without `[DONE]`.
A message may hold several frames, part of one, or split a UTF-8 character, so the
decoder buffers bytes and only decodes complete lines.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["SseDecoder"]

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
