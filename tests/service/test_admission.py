"""Admission, without a server: TGI's immediate `overloaded`, and the optional
bounded queue (first come, first served; bounded in requests and tokens)."""

from __future__ import annotations

import asyncio

import pytest
from textgen.service.intake.admission import Admission, Overloaded

pytestmark = pytest.mark.timeout(10)


async def test_full_means_overloaded_at_once():
    adm = Admission(limit=2)
    await adm.acquire()
    await adm.acquire()
    with pytest.raises(Overloaded):
        await adm.acquire()
    adm.release()
    await adm.acquire()  # a freed permit is reusable
    assert adm.in_flight == 2


async def test_queue_waits_in_order_and_is_bounded():
    adm = Admission(limit=1, max_queued=2)
    await adm.acquire()
    order = []

    async def waiter(name):
        await adm.acquire()
        order.append(name)

    first = asyncio.create_task(waiter("first"))
    await asyncio.sleep(0)
    second = asyncio.create_task(waiter("second"))
    await asyncio.sleep(0)
    assert adm.queued == 2
    with pytest.raises(Overloaded):
        await adm.acquire()  # the queue is full
    adm.release()
    await first
    adm.release()
    await second
    assert order == ["first", "second"] and adm.in_flight == 1 and adm.queued == 0


async def test_token_bound_and_cancelled_waiters():
    adm = Admission(limit=1, max_queued=10, max_queued_tokens=100)
    await adm.acquire()
    big = asyncio.create_task(adm.acquire(tokens=80))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded):
        await adm.acquire(tokens=30)  # 80 + 30 tokens would wait
    big.cancel()
    with pytest.raises(asyncio.CancelledError):
        await big
    assert adm.queued == 0
    small = asyncio.create_task(adm.acquire(tokens=30))
    await asyncio.sleep(0)
    adm.release()
    await small
    assert adm.in_flight == 1


async def test_wait_idle():
    adm = Admission(limit=2)
    await adm.acquire()
    assert not await adm.wait_idle(0.05)
    asyncio.get_running_loop().call_later(0.05, adm.release)
    assert await adm.wait_idle(2)


async def test_the_queue_serves_priority_first_and_refuses_the_lowest_first():
    adm = Admission(limit=1, max_queued=2)
    await adm.acquire()  # the running request
    low_1 = asyncio.ensure_future(adm.acquire(priority=5))
    low_2 = asyncio.ensure_future(adm.acquire(priority=5))
    await asyncio.sleep(0)
    assert adm.queued == 2
    # full: a higher priority takes the place of the last low one, which is refused
    high = asyncio.ensure_future(adm.acquire(priority=-1))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded):
        await low_2
    # an equal or lower priority is refused itself
    with pytest.raises(Overloaded):
        await adm.acquire(priority=5)
    adm.release()  # the permit goes to the highest priority, not the oldest
    await high
    assert not low_1.done()
    adm.release()
    await low_1
    adm.release()
    assert adm.in_flight == 0 and adm.queued == 0


async def test_a_request_too_big_for_the_token_bound_evicts_nobody():
    adm = Admission(limit=1, max_queued=4, max_queued_tokens=100)
    await adm.acquire()
    low = asyncio.ensure_future(adm.acquire(tokens=60, priority=5))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded):
        await adm.acquire(tokens=200, priority=-5)  # would not fit even alone
    assert adm.queued == 1 and not low.done()
    adm.release()
    await low
    adm.release()
