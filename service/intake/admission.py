"""Admission: how many requests run at once, and what happens to the rest.

TGI's rule by default: `max_concurrent_requests` permits, taken without waiting;
when none is free the request fails at once with `overloaded`. Users who prefer
queueing to rejection set `max_queued_requests` (and optionally a bound on the
prompt tokens those hold): such requests wait by priority (lower is sooner), then
first come first served, and only a full queue answers `overloaded`, to the lowest
priority first: a request that outranks the last waiter takes its place. A permit
lives as long as its stream.

A refusal says when to come back (`retry_after`, sent as gRPC's `grpc-retry-pushback-ms`
and HTTP's Retry-After): a permit frees every `hold / limit` seconds on average (`hold`,
how long recent requests held theirs), and the requests refused meanwhile are told to come
back one such interval apart, in the order they were refused, so that their retries don't
all meet the same full server again.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import time
from dataclasses import dataclass, field

# the estimate of how long a request holds its permit until one has finished
INITIAL_HOLD_S = 1.0
HOLD_SMOOTHING = 0.2  # weight of the latest request in the running estimate
# retries are spaced a little more than the estimate apart: a request that takes longer
# than the mean would otherwise meet the next one, which then has to wait a whole turn
RETRY_MARGIN = 1.25
MAX_RETRY_AFTER_S = 60.0


class Overloaded(Exception):
    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after  # seconds until a permit is likely free


@dataclass
class _Waiter:
    future: asyncio.Future
    tokens: int
    rank: tuple[int, int] = field(default=(0, 0))  # (priority, arrival): first is served first


class Admission:
    def __init__(self, limit: int, max_queued: int = 0, max_queued_tokens: int = 0) -> None:
        self.limit = limit
        self.max_queued = max_queued
        self.max_queued_tokens = max_queued_tokens  # 0: no token bound
        self.in_flight = 0
        self._queue: list[_Waiter] = []  # in rank order
        self._queued_tokens = 0
        self._arrivals = itertools.count()
        self._idle = asyncio.Event()
        self._idle.set()
        self.hold = INITIAL_HOLD_S  # running estimate of a permit's lifetime, seconds
        self._held_any = False
        self._told: list[float] = []  # monotonic times refused requests were told to return

    def retry_after(self) -> float:
        """When a request refused now should come back: after the ones refused before it
        still waiting for their turn, one permit interval apart (module docstring)."""
        now = time.monotonic()
        self._told = [t for t in self._told if t > now]
        interval = RETRY_MARGIN * self.hold / self.limit
        delay = min(interval * (len(self._told) + 1), MAX_RETRY_AFTER_S)
        self._told.append(now + delay)
        return delay

    def observe_hold(self, seconds: float) -> None:
        """A permit was held this long: the estimate behind retry_after()."""
        if not self._held_any:  # the first one replaces the guess
            self.hold, self._held_any = seconds, True
        self.hold += HOLD_SMOOTHING * (seconds - self.hold)

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

    async def acquire(self, tokens: int = 0, priority: int = 0) -> None:
        """Take a permit, waiting in the bounded queue if there is one; raises
        Overloaded when neither a permit nor a place in the queue is free (a waiter of
        a lower priority gives up its place, and gets Overloaded, if that makes room)."""
        if self.in_flight < self.limit and not self._queue:
            self._take()
            return
        waiter = _Waiter(
            asyncio.get_running_loop().create_future(), tokens, (priority, next(self._arrivals))
        )
        self._make_room(waiter)
        bisect.insort(self._queue, waiter, key=lambda w: w.rank)
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

    def _make_room(self, waiter: _Waiter) -> None:
        """Refuse `waiter`, or else the last-ranked waiters of a lower priority, as many as
        it takes to fit it (none is refused if even that would not do)."""
        count, tokens = len(self._queue), self._queued_tokens
        victims = []
        for last in reversed(self._queue):
            if not self._full(count, tokens + waiter.tokens) or last.rank[0] <= waiter.rank[0]:
                break
            victims.append(last)
            count, tokens = count - 1, tokens - last.tokens
        if self._full(count, tokens + waiter.tokens):
            raise Overloaded("Model is overloaded", self.retry_after())
        for victim in victims:
            self._queue.remove(victim)
            self._queued_tokens -= victim.tokens
            if not victim.future.done():
                victim.future.set_exception(Overloaded("Model is overloaded", self.retry_after()))

    def _full(self, count: int, tokens: int) -> bool:
        """Whether `count` waiters holding `tokens` prompt tokens exceed a bound."""
        return count + 1 > self.max_queued or bool(
            self.max_queued_tokens and tokens > self.max_queued_tokens
        )

    def _take(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def release(self) -> None:
        while self._queue:
            waiter = self._queue.pop(0)
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
