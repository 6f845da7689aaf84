"""A server at its concurrency limit says when to come back, and the SDK comes back by
itself: grpc's retry policy on the SDK's channels (RESOURCE_EXHAUSTED, UNAVAILABLE, before
the first message), the server's `grpc-retry-pushback-ms` from its admission state, and
HTTP's Retry-After on the same refusal through Envoy."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import pytest
from support.http_client import Http
from support.servers import ServerThread, tiny_settings
from support.tiers import server_fixture
from textgen.sdk import Client, OverloadedError, RetryPolicy

pytestmark = pytest.mark.timeout(120)

STEP_DELAY = 0.05  # seconds added to each engine step: a 16-token request holds its permit
# for 0.8 s and more, the same length each time (the server spaces retries by it)


@server_fixture(scope="module")
def one_at_a_time(tiny_model_dir):
    server = ServerThread(tiny_settings(tiny_model_dir, max_concurrent_requests=1), http=True)
    server.start()
    core = server.engine.core
    step = core.step

    def slow_step():
        time.sleep(STEP_DELAY)
        return step()

    core.step = slow_step
    with Client(server.target, timeout=60) as client:  # the server learns a request's length
        client.generate("hello", max_new_tokens=16, ignore_eos=True)
    yield server
    server.stop()


def eight_at_once(target: str, **client_options) -> list[str]:
    barrier = threading.Barrier(8)

    def call(i: int) -> str:
        with Client(target, timeout=60, **client_options) as client:
            barrier.wait()
            try:
                client.generate(f"hello {i}", max_new_tokens=16, ignore_eos=True)
            except OverloadedError as exc:
                assert exc.retry_after is not None and exc.retry_after > 0
                return "overloaded"
        return "ok"

    with cf.ThreadPoolExecutor(8) as pool:
        return list(pool.map(call, range(8)))


def test_the_sdk_retries_overload_by_itself(one_at_a_time):
    results = eight_at_once(one_at_a_time.target)
    assert results == ["ok"] * 8, results


def test_without_retries_the_overload_is_raised_at_once(one_at_a_time):
    results = eight_at_once(one_at_a_time.target, retries=0)
    assert sorted(results) == ["ok"] + ["overloaded"] * 7, results
    with pytest.raises(ValueError, match="retries"):
        Client(one_at_a_time.target, retries=RetryPolicy(retries=9))


def test_http_429_carries_retry_after(one_at_a_time):
    held = threading.Event()

    def hold() -> None:
        with Client(one_at_a_time.target, timeout=60) as client:
            for _ in client.generate_stream("hello", max_new_tokens=60, ignore_eos=True):
                held.set()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(30)
        status, headers, body = Http(one_at_a_time.http_url).call(
            "POST", "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}
        )
    finally:
        holder.join(60)
    assert status == 429, body
    assert int(headers["retry-after"]) >= 1
