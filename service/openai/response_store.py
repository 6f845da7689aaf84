"""The Responses API's store: recent responses, kept in this replica's memory so that a
later request can continue one (`previous_response_id`), retrieve it, list its input
items or delete it; and their ids.

Bounded two ways: an entry lives `ttl` seconds, and all entries together hold at most
`max_bytes` (their JSON size); the oldest go first. A replica restart does not find them.
Used from the event loop only.

Ids: `resp_` and 32 random hex digits. Behind the front proxy (`textgen proxy`) the id
also carries, hex-encoded, the replica's address as the proxy reaches it (the proxy
tells each replica in a header, envoy/affinity.py), so that the proxy sends a retrieval,
a deletion or a `previous_response_id` to the replica that stored it.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

# Defaults of `textgen serve --responses-store-mb / --responses-store-ttl`.
DEFAULT_MAX_BYTES = 64 * 2**20
DEFAULT_TTL = 3600.0
# What an entry costs besides its JSON (ids, the dict slot): a floor for tiny entries.
ENTRY_OVERHEAD = 256

ID_PREFIX = "resp_"
RANDOM_HEX = 32  # 128 random bits
# An address the front proxy may name (Envoy's %UPSTREAM_HOST%: `ip:port`, `[ip6]:port`).
_ADDRESS = re.compile(r"[0-9A-Za-z.:\[\]-]{1,64}:[0-9]{1,5}")


@dataclass(frozen=True)
class StoredResponse:
    """What the store keeps of one response."""

    response: dict  # the response object as it completed (GET /v1/responses/{id})
    items: tuple[dict, ...]  # the input items it was made from, with their ids
    conversation: tuple[dict, ...]  # the same as chat messages, its own answer last


@dataclass(frozen=True)
class _Entry:
    stored: StoredResponse
    size: int
    expires: float


def new_id(prefix: str) -> str:
    """An output or input item's id (`msg_...`, `fc_...`)."""
    return f"{prefix}_{secrets.token_hex(16)}"


def new_response_id(replica: str | None = None) -> str:
    """A fresh id; `replica` (the address the front proxy reached this replica at) is
    appended hex-encoded when it is a plausible address."""
    rid = ID_PREFIX + secrets.token_hex(RANDOM_HEX // 2)
    if replica is not None and _ADDRESS.fullmatch(replica):
        rid += replica.encode().hex()
    return rid


def replica_of(response_id: str) -> str | None:
    """The replica address an id carries (None: made without the front proxy, or not
    one of our ids). envoy/affinity.py decodes it the same way, in Lua."""
    tail = response_id.removeprefix(ID_PREFIX)[RANDOM_HEX:]
    if not response_id.startswith(ID_PREFIX) or not tail:
        return None
    try:
        address = bytes.fromhex(tail).decode()
    except ValueError:  # UnicodeDecodeError included
        return None
    return address if _ADDRESS.fullmatch(address) else None


class ResponseStore:
    """Response id -> StoredResponse."""

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

    def put(self, response_id: str, stored: StoredResponse) -> bool:
        """Keep a response; False when it alone is over the size cap (not kept)."""
        self._expire()
        size = len(json.dumps(stored.__dict__, ensure_ascii=False)) + ENTRY_OVERHEAD
        if not self.enabled or size > self.max_bytes:
            return False
        self._drop(response_id)
        while self._entries and self.bytes + size > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[response_id] = _Entry(stored, size, self._clock() + self.ttl)
        self.bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The response, or None (never stored, expired, evicted or deleted)."""
        self._expire()
        entry = self._entries.get(response_id)
        return entry.stored if entry is not None else None

    def delete(self, response_id: str) -> bool:
        """Forget a response; False when it was not kept."""
        self._expire()
        return self._drop(response_id)

    def _expire(self) -> None:
        now = self._clock()
        # entries are in insertion order, and every entry lives `ttl`: expired ones lead
        while self._entries:
            oldest = next(iter(self._entries))
            if self._entries[oldest].expires > now:
                return
            self._drop(oldest)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True
