"""Admission: how many requests run at once, and what happens to the rest.

TGI's rule by default: `max_concurrent_requests` permits, taken without waiting;
when none is free the request fails at once with `overloaded`. Users who prefer
queueing to rejection set `max_queued_requests` (and optionally a bound on the
prompt tokens those hold): such requests wait, first come first served, and only a
full queue answers `overloaded`. A permit lives as long as its stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass


class Overloaded(Exception):
    pass


@dataclass
class _Waiter:
    future: asyncio.Future
    tokens: int


class Admission:
    def __init__(self, limit: int, max_queued: int = 0, max_queued_tokens: int = 0) -> None:
        self.limit = limit
        self.max_queued = max_queued
        self.max_queued_tokens = max_queued_tokens  # 0: no token bound
        self.in_flight = 0
        self._queue: deque[_Waiter] = deque()
        self._queued_tokens = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing runs or waits; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def acquire(self, tokens: int = 0) -> None:
        """Take a permit, waiting in the bounded queue if there is one; raises
        Overloaded when neither a permit nor a place in the queue is free."""
        if self.in_flight < self.limit and not self._queue:
            self._take()
            return
        if len(self._queue) >= self.max_queued or (
            self.max_queued_tokens and self._queued_tokens + tokens > self.max_queued_tokens
        ):
            raise Overloaded("Model is overloaded")
        waiter = _Waiter(asyncio.get_running_loop().create_future(), tokens)
        self._queue.append(waiter)
        self._queued_tokens += tokens
        self._idle.clear()
        try:
            await waiter.future  # release() hands its permit over
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release()  # the permit arrived as we were cancelled: pass it on
            else:
                self._forget(waiter)
            raise

    def _take(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def release(self) -> None:
        while self._queue:
            waiter = self._queue.popleft()
            self._queued_tokens -= waiter.tokens
            if not waiter.future.done():
                waiter.future.set_result(None)  # the permit changes hands; in_flight stays
                return
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def _forget(self, waiter: _Waiter) -> None:
        with contextlib.suppress(ValueError):
            self._queue.remove(waiter)
            self._queued_tokens -= waiter.tokens
        if self.in_flight == 0 and not self._queue:
            self._idle.set()
