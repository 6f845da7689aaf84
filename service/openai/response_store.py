"""The Responses API's `store` / `previous_response_id`: the conversations of recent
responses, kept in this replica's memory so that a later request can continue one.

Bounded two ways: an entry lives `ttl` seconds, and all entries together hold at most
`max_bytes` (their JSON size); the oldest go first. A replica restart, or a request that
lands on another replica behind the front proxy, does not find them: the caller gets a
422 naming `previous_response_id`, as for an expired one. Used from the event loop only.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

# Defaults of `textgen serve --responses-store-mb / --responses-store-ttl`.
DEFAULT_MAX_BYTES = 64 * 2**20
DEFAULT_TTL = 3600.0
# What an entry costs besides its JSON (ids, the dict slot): a floor for tiny entries.
ENTRY_OVERHEAD = 256


@dataclass(frozen=True)
class _Entry:
    messages: tuple[dict, ...]
    size: int
    expires: float


class ResponseStore:
    """Response id -> the conversation it ended (chat messages, its own answer last)."""

    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_BYTES,
        ttl: float = DEFAULT_TTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # oldest first
        self.bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 and self.ttl > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, messages: list[dict]) -> bool:
        """Keep a conversation; False when it alone is over the size cap (not kept)."""
        self._expire()
        size = len(json.dumps(messages, ensure_ascii=False)) + ENTRY_OVERHEAD
        if not self.enabled or size > self.max_bytes:
            return False
        self._drop(response_id)
        while self._entries and self.bytes + size > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[response_id] = _Entry(tuple(messages), size, self._clock() + self.ttl)
        self.bytes += size
        return True

    def get(self, response_id: str) -> list[dict] | None:
        """The conversation, or None (never stored, expired or evicted)."""
        self._expire()
        entry = self._entries.get(response_id)
        return list(entry.messages) if entry is not None else None

    def _expire(self) -> None:
        now = self._clock()
        # entries are in insertion order, and every entry lives `ttl`: expired ones lead
        while self._entries:
            oldest = next(iter(self._entries))
            if self._entries[oldest].expires > now:
                return
            self._drop(oldest)

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
