"""A rank of a sharded model that dies fails rank 0's step in a collective, with the
transport's words; rank 0 names the rank (its parent's view of the shard processes) and
every request in flight ends with textgen's `incomplete_generation` saying so. The real
kill, through the server: tests/integration/test_shards.py."""

from __future__ import annotations

import asyncio

import pytest
import torch
from support.tiny_model import build_tokenizer
from textgen.service.engine.loop import EngineLoop
from textgen.service.engine.runners.sharded import ShardedRunner, ShardGroup, ShardLost
from textgen.service.engine.types import (
    EngineError,
    EngineRequest,
    SamplingParams,
    StoppingParams,
)
from textgen.service.errors import ErrorType

from .factories import VOCAB_SIZE, make_core

pytestmark = pytest.mark.timeout(60)

# what gloo raises on rank 0 when a peer's process is gone (a bare RuntimeError)
GLOO = RuntimeError(
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:62137: Connection reset by peer. This is typically caused by a remote "
    "worker hanging or bugs in the application. GLHF!"
)
KILLED = "shard 1 (pid 4242) exited with code -9"


def group(exited=None) -> ShardGroup:
    return ShardGroup(0, 2, None, None, VOCAB_SIZE, VOCAB_SIZE // 2, torch.device("cpu"), exited)


def failing_step(monkeypatch, error: BaseException, exited=None) -> ShardedRunner:
    """Rank 0's runner whose step fails with `error` as it sends the inputs."""

    def send(self, op, inputs=None):
        raise error

    monkeypatch.setattr(ShardGroup, "send", send)
    return ShardedRunner(inner=None, group=group(exited))


def test_a_failed_collective_names_the_shard_that_exited(monkeypatch):
    waited = []

    def exited(wait: float) -> str:
        waited.append(wait)
        return KILLED

    with pytest.raises(ShardLost) as lost:
        failing_step(monkeypatch, GLOO, exited).run(inputs=None)
    assert lost.value.error_type is ErrorType.INCOMPLETE_GENERATION
    assert lost.value.message == f"{KILLED}: generation can't go on"
    assert lost.value.__cause__ is GLOO  # the transport's words stay in the log
    assert waited and waited[0] > 0  # the exit may show a moment after the socket closed


def test_a_transport_failure_with_no_local_shard_exited_is_still_a_lost_shard(monkeypatch):
    """A rank of another host (or one that stopped answering): named as well as can be."""
    with pytest.raises(ShardLost) as lost:
        failing_step(monkeypatch, GLOO, lambda wait: None).run(inputs=None)
    assert lost.value.message.startswith("a shard is gone ([/pytorch/third_party/gloo/")
    assert lost.value.error_type is ErrorType.INCOMPLETE_GENERATION


@pytest.mark.parametrize(
    "error", [RuntimeError("shape mismatch"), torch.OutOfMemoryError("out of memory")]
)
def test_a_steps_own_failure_is_raised_as_it_is(monkeypatch, error):
    with pytest.raises(type(error)) as raised:
        failing_step(monkeypatch, error, lambda wait: None).run(inputs=None)
    assert raised.value is error


def test_the_engine_ends_every_request_with_the_lost_shard(tiny_llama):
    """The engine loop passes a step's typed error on as it is (others: `generation`)."""
    engine = EngineLoop(make_core(tiny_llama), build_tokenizer(VOCAB_SIZE), frozenset())
    engine.start(timeout=30)
    request = EngineRequest(
        request_id="r0",
        prompt_ids=tuple(range(3, 12)),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=500, ignore_eos=True),
    )

    async def stream() -> tuple[int, EngineError]:
        received = 0
        try:
            async for _ in engine.generate(request):
                received += 1
                if received == 2:
                    engine.inject_fault(ShardLost(KILLED))
        except EngineError as exc:
            return received, exc
        raise AssertionError("the stream ended without the error")

    try:
        received, error = asyncio.run(stream())
    finally:
        engine.shutdown()
    assert received >= 2
    assert (error.error_type, error.message) == (
        ErrorType.INCOMPLETE_GENERATION,
        f"{KILLED}: generation can't go on",
    )
    assert not engine.healthy
