"""Request priority through the real server (tiny model, engine steps slowed so that the
order of events is the scheduler's, not the machine's): lower values are served sooner,
from the request's field or the `x-textgen-priority` header; a full bounded queue refuses
the lowest priority first; the metrics count requests by priority."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import grpc
import pytest
from support.servers import ServerThread, tiny_settings
from support.tiers import server_fixture
from textgen.service.proto import generate_pb2 as pb
from textgen.service.proto import text_generation_service_pb2 as svc_pb
from textgen.service.proto import text_generation_service_pb2_grpc as svc_grpc

pytestmark = pytest.mark.timeout(120)

STEP_DELAY = 0.01  # seconds added to each engine step
# seconds each background stream's validation takes: the first sent reaches the engine last
VALIDATION_DELAY = {f"bg{i}": 0.05 * (6 - i) for i in range(6)}


def slowed(server: ServerThread) -> ServerThread:
    core = server.engine.core
    step = core.step

    def slow_step():
        time.sleep(STEP_DELAY)
        return step()

    core.step = slow_step
    return server


def request(tokens: int, priority: int | None = None) -> pb.GenerateRequest:
    params = pb.GenerateParameters(max_new_tokens=tokens, ignore_eos=True)
    if priority is not None:
        params.priority = priority
    return pb.GenerateRequest(inputs="The quick brown fox", parameters=params)


def named(name: str, req: pb.GenerateRequest) -> pb.GenerateRequest:
    req.inputs = f"{name}: {req.inputs}"
    return req


def stream(stub, req, first_token_at: dict, name: str, metadata=()) -> None:
    for _ in stub.GenerateStream(req, timeout=60, metadata=metadata):
        first_token_at.setdefault(name, time.monotonic())


@server_fixture(scope="module")
def saturable(tiny_model_dir):
    """Two sequences run at once; the rest wait in the engine's queue."""
    server = slowed(ServerThread(tiny_settings(tiny_model_dir, max_batch_size=2)).start())
    yield server
    server.stop()


def test_a_high_priority_request_starts_before_earlier_low_ones(saturable):
    first_token_at: dict[str, float] = {}
    with grpc.insecure_channel(saturable.target) as channel:
        stub = svc_grpc.TextGenerationServiceStub(channel)
        calls = [("running-1", request(40, 5), ()), ("running-2", request(40, 5), ())]
        calls += [(f"low-{i}", request(5, 5), ()) for i in range(3)]
        # the high one names its priority in the header a mesh would set
        calls += [("high", request(5), (("x-textgen-priority", "-1"),))]
        threads = []
        for name, req, metadata in calls:
            thread = threading.Thread(
                target=stream, args=(stub, req, first_token_at, name, metadata)
            )
            thread.start()
            threads.append(thread)
            time.sleep(0.05)  # arrival order, as listed
        for thread in threads:
            thread.join(60)
    assert set(first_token_at) == {name for name, _, _ in calls}
    waiting_low = [first_token_at[f"low-{i}"] for i in range(3)]
    assert first_token_at["high"] < min(waiting_low), first_token_at
    # among equals, arrival order: none starts a step before an earlier one (two that start in
    # the same step reach their clients in either order, microseconds apart)
    assert all(b > a - STEP_DELAY / 2 for a, b in itertools.pairwise(waiting_low)), waiting_low


@pytest.mark.server
def test_a_full_queue_refuses_the_lowest_priority_first(tiny_model_dir):
    server = slowed(
        ServerThread(
            tiny_settings(tiny_model_dir, max_concurrent_requests=1, max_queued_requests=1)
        ).start()
    )
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = svc_grpc.TextGenerationServiceStub(channel)
            running = stub.Generate.future(request(30), timeout=60)
            time.sleep(0.1)
            queued_low = stub.Generate.future(request(2, priority=3), timeout=60)
            time.sleep(0.1)
            high = stub.Generate.future(request(2, priority=-3), timeout=60)
            with pytest.raises(grpc.RpcError) as refused:
                queued_low.result()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert high.result().generated_text and running.result().generated_text
            # an equal priority to the one waiting is refused itself
            running = stub.Generate.future(request(30), timeout=60)
            time.sleep(0.1)
            waiting = stub.Generate.future(request(2, priority=-3), timeout=60)
            time.sleep(0.1)
            with pytest.raises(grpc.RpcError) as same:
                stub.Generate(request(2, priority=-3), timeout=60)
            assert same.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert waiting.result().generated_text and running.result().generated_text
            metrics = stub.Metrics(svc_pb.MetricsRequest(), timeout=10).data.decode()
    finally:
        server.stop()
    for label in ("-3", "0"):
        assert f'textgen_requests_by_priority_total{{priority="{label}"}}' in metrics
    assert "textgen_requests_waiting" in metrics and "textgen_kv_cache_usage_ratio" in metrics


def test_a_bad_priority_header_is_a_typed_error(saturable):
    with grpc.insecure_channel(saturable.target) as channel:
        stub = svc_grpc.TextGenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(request(2), timeout=30, metadata=(("x-textgen-priority", "urgent"),))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "`x-textgen-priority` must be an integer" in info.value.details()


def test_equal_priorities_keep_the_engines_order_and_never_preempt(saturable, monkeypatch):
    """Six equal-priority streams sent together reach the engine in the reverse order (the
    first sent is validated last), then an urgent one: the six start in the order the
    engine received them, two at a time, each runs to its end unpreempted, and the urgent
    one goes ahead of those still waiting."""
    servicer, core = saturable.replica.servicer, saturable.engine.core
    validate = servicer.validate
    names: dict[str, str] = {}  # engine request id -> name
    received: list[str] = []  # names in the order the engine took them

    async def slow_validate(req, **kwargs):
        name = req.inputs.split(":")[0]
        await asyncio.sleep(VALIDATION_DELAY.get(name, 0.0))
        valid = await validate(req, **kwargs)
        names[valid.engine_request.request_id] = name
        return valid

    add, step = core.add, core.step
    seqs: dict[str, object] = {}  # name -> the engine's sequence
    first_step: dict[str, int] = {}  # name -> the engine step that gave its first token
    steps = [0]

    def recording_add(seq):
        name = names[seq.request.request_id]
        received.append(name)
        seqs[name] = seq
        add(seq)

    def recording_step():
        out = step()
        steps[0] += 1
        for name, seq in list(seqs.items()):
            if name not in first_step and seq.num_output_tokens:
                first_step[name] = steps[0]
        return out

    monkeypatch.setattr(servicer, "validate", slow_validate)
    monkeypatch.setattr(core, "add", recording_add)
    monkeypatch.setattr(core, "step", recording_step)
    preemptions = core.stats().preemptions
    first_token_at: dict[str, float] = {}
    ended_at: dict[str, float] = {}

    def run(name: str, req) -> None:
        stream(stub, req, first_token_at, name)
        ended_at[name] = time.monotonic()

    background = [f"bg{i}" for i in range(6)]
    with grpc.insecure_channel(saturable.target) as channel:
        stub = svc_grpc.TextGenerationServiceStub(channel)
        threads = [
            threading.Thread(target=run, args=(name, named(name, request(48, 0))))
            for name in background
        ]
        for thread in threads:
            thread.start()
        while len(received) < 6 or len(first_token_at) < 2:  # two stream, four wait
            time.sleep(0.005)
        urgent = threading.Thread(target=run, args=("urgent", named("urgent", request(5, -1))))
        urgent.start()
        for thread in [*threads, urgent]:
            thread.join(60)
    assert received[:6] == background[::-1]  # the validation delays' doing
    assert core.stats().preemptions == preemptions
    # the engine starts them in the order it received them (by its own steps: two that start
    # in the same step reach their clients in either order)
    start_steps = [first_step[name] for name in received[:6]]
    assert start_steps == sorted(start_steps) and len(set(start_steps)) >= 3, start_steps
    for i, name in enumerate(received[2:6]):  # each waits for a slot: one of the earlier ends
        assert first_token_at[name] > sorted(ended_at[n] for n in received[: i + 2])[i]
    waiting = [n for n in background if first_token_at[n] > first_token_at["urgent"]]
    assert waiting and all(n in received[2:6] for n in waiting)
