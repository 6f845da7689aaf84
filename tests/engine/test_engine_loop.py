"""The engine thread's wake-up policy: a burst of requests reaching an idle engine starts in
one prefill step (`arrival_gap`), the wait is bounded, and with no gap it steps at once."""

from __future__ import annotations

import asyncio

import pytest
from support.tiny_model import build_tokenizer
from textgen.service.engine import loop as engine_loop
from textgen.service.engine.loop import EngineLoop
from textgen.service.engine.types import EngineRequest, SamplingParams, StoppingParams

from .factories import VOCAB_SIZE, make_core

pytestmark = pytest.mark.timeout(60)


def request(index: int) -> EngineRequest:
    return EngineRequest(
        request_id=f"r{index}",
        prompt_ids=tuple(range(3 + index, 12 + index)),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=4, ignore_eos=True),
    )


def run_arrivals(model, *, arrival_gap: float, count: int, spacing: float) -> list[set[str]]:
    """`count` requests reach an idle engine `spacing` seconds apart; each runs to its end.
    Returns the request ids each engine step gave a token to, in step order."""
    core = make_core(model)
    steps: list[set[str]] = []
    step = core.step

    def recorded_step():
        outputs = step()
        steps.append({out.seq.request_id for out in outputs})
        return outputs

    core.step = recorded_step
    engine = EngineLoop(core, build_tokenizer(VOCAB_SIZE), frozenset(), arrival_gap=arrival_gap)
    engine.start(timeout=30)

    async def one(index: int) -> int:
        await asyncio.sleep(index * spacing)
        return len([event async for event in engine.generate(request(index))])

    async def all_requests() -> list[int]:
        return await asyncio.gather(*(one(i) for i in range(count)))

    try:
        assert asyncio.run(all_requests()) == [4] * count  # every request ran to its end
    finally:
        engine.shutdown()
    return steps


def test_a_burst_reaching_an_idle_engine_starts_in_one_prefill_step(tiny_llama, monkeypatch):
    # requests 20 ms apart, a 200-ms gap (the bound out of the way): the engine waits for
    # the last one
    monkeypatch.setattr(engine_loop, "MAX_ARRIVAL_WAIT", 10.0)
    steps = run_arrivals(tiny_llama, arrival_gap=0.2, count=6, spacing=0.02)
    assert steps[0] == {f"r{i}" for i in range(6)}
    assert len(steps) == 4  # all of them decode together to the end


def test_the_wait_for_a_burst_is_bounded(tiny_llama, monkeypatch):
    # requests keep arriving 20 ms apart for 300 ms, each within the gap: the engine
    # starts after at most 100 ms
    monkeypatch.setattr(engine_loop, "MAX_ARRIVAL_WAIT", 0.1)
    steps = run_arrivals(tiny_llama, arrival_gap=0.2, count=16, spacing=0.02)
    assert "r0" in steps[0]
    assert len(steps[0]) < 16


def test_without_a_gap_the_first_request_starts_alone(tiny_llama):
    steps = run_arrivals(tiny_llama, arrival_gap=0.0, count=2, spacing=0.5)
    assert steps[0] == {"r0"}


def test_a_request_of_n_choices_streams_each_to_its_end_then_closes(tiny_llama):
    """One stream carries every choice's tokens (TokenEvent.choice), each choice's texts
    adding up to its generated_text; it ends when the last choice has."""
    core = make_core(tiny_llama)
    engine = EngineLoop(core, build_tokenizer(VOCAB_SIZE), frozenset())
    engine.start(timeout=30)
    sampled = EngineRequest(
        request_id="n",
        prompt_ids=tuple(range(3, 30)),
        sampling=SamplingParams(do_sample=True, temperature=5.0, seed=1),
        stopping=StoppingParams(max_new_tokens=6, ignore_eos=True),
        n=3,
    )

    async def collect() -> dict[int, list]:
        runs: dict[int, list] = {}
        async for event in engine.generate(sampled):
            runs.setdefault(event.choice, []).append(event)
        return runs

    async def leave_early() -> None:
        async for _ in engine.generate(sampled):
            break  # the other choices too are aborted: nothing stays in the engine

    try:
        runs = asyncio.run(collect())
        asyncio.run(leave_early())
        for _ in range(100):  # the abort reaches the engine thread within a step
            if core.stats().running == 0 and core.stats().waiting == 0:
                break
            asyncio.run(asyncio.sleep(0.01))
        stats = core.stats()
    finally:
        engine.shutdown()
    assert sorted(runs) == [0, 1, 2]
    for choice, events in runs.items():
        assert [e.index for e in events] == list(range(1, 7))
        finish = events[-1].finish
        assert finish is not None and all(e.finish is None for e in events[:-1])
        assert "".join(e.text for e in events) == finish.generated_text
        assert finish.seed == 1 + choice
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)
