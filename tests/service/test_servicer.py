"""The TGI servicer against a fake engine, over a real in-process gRPC server and
client: how engine events and failures become messages and statuses, with no model.
The fake engine plays a script of TokenEvents (and failures) per request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import grpc
import pytest
from google.api import httpbody_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from support.tiny_model import build_tokenizer
from textgen.service.anthropic.messages import parse_messages_request
from textgen.service.engine.types import (
    EngineError,
    EngineRequest,
    FinishInfo,
    FinishReason,
    TokenEvent,
    TokenInfo,
)
from textgen.service.errors import ErrorType
from textgen.service.grpc.server import build_server
from textgen.service.grpc.servicer import ServedModel, TextGenerationServicer
from textgen.service.intake.admission import Admission
from textgen.service.intake.validation import Validator
from textgen.service.observability.metrics import Metrics
from textgen.service.observability.requests import RequestRecorder
from textgen.service.proto import generate_pb2 as pb
from textgen.service.proto import text_generation_service_pb2 as svc_pb
from textgen.service.proto import text_generation_service_pb2_grpc as svc_grpc

from .limits import LIMITS

pytestmark = pytest.mark.timeout(30)


def events(texts: list[str], logprob: float = -1.0) -> list[TokenEvent]:
    """One event per text; the last one finishes (length)."""
    out = []
    for i, text in enumerate(texts, 1):
        finish = None
        if i == len(texts):
            finish = FinishInfo(FinishReason.LENGTH, "".join(texts), len(texts), 4, 0, 0.0, 0.01)
        out.append(TokenEvent(i, TokenInfo(i, text, logprob, False), text, finish=finish))
    return out


# per request: events to yield, exceptions to raise, asyncio.Events to wait for, in order
Script = Callable[[EngineRequest], list]


class FakeEngine:
    healthy = True

    def __init__(self) -> None:
        self.script: Script = lambda request: events(["Hello", " world"])
        self.requests: list[EngineRequest] = []

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenEvent]:
        """The script of each of the request's choices, one after the other."""
        for choice, choice_request in enumerate(request.choices()):
            self.requests.append(choice_request)
            for item in self.script(choice_request):
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, asyncio.Event):
                    await item.wait()
                    continue
                yield replace(item, choice=choice)


@pytest.fixture
async def served():
    engine = FakeEngine()
    tokenizer = build_tokenizer()
    servicer = TextGenerationServicer(
        engine,
        Validator(tokenizer, LIMITS),
        ServedModel(svc_pb.InfoResponse(model_id="fake"), created=0),
        Admission(limit=1),
        RequestRecorder(Metrics()),
    )
    server, _, port = build_server(servicer, "127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield engine, servicer, svc_grpc.TextGenerationServiceStub(channel)
    await channel.close()
    await server.stop(0)


def request(**parameters) -> pb.GenerateRequest:
    return pb.GenerateRequest(inputs="The quick", parameters=pb.GenerateParameters(**parameters))


def error_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    status = rpc_status.from_call(error)
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return info


async def test_stream_messages_follow_the_engine_events(served):
    engine, _, stub = served
    messages = [m async for m in stub.GenerateStream(request(return_full_text=True))]
    assert [(m.index, m.token.text) for m in messages] == [(1, "Hello"), (2, " world")]
    last = messages[-1]
    assert last.generated_text == "The quickHello world"  # return_full_text
    assert last.details.finish_reason == "length" and last.details.generated_tokens == 2
    assert not messages[0].HasField("details")
    assert engine.requests[0].stopping.max_new_tokens > 0


async def test_failure_after_the_first_token_is_in_band_then_aborted(served):
    engine, _, stub = served
    engine.script = lambda r: [*events(["a", "b"])[:1], EngineError("boom")]
    call = stub.GenerateStream(request())
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for message in call:
            received.append(message)
    assert received[0].token.text == "a"
    assert (received[-1].error, received[-1].error_type) == ("boom", "incomplete_generation")
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert error_info(info.value).reason == "incomplete_generation"


async def test_failure_before_any_token_is_a_typed_status(served):
    engine, _, stub = served
    engine.script = lambda r: [EngineError("engine down", ErrorType.UNAVAILABLE)]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Generate(request())
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error_info(info.value).reason == "unavailable"


async def test_validation_error_names_the_field(served):
    engine, _, stub = served
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Generate(request(top_k=0))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "`top_k` must be strictly positive"
    detail = error_info(info.value)
    assert detail.reason == "validation" and detail.metadata["param"] == "top_k"
    assert engine.requests == []  # nothing reached the engine


async def test_draining_refuses_new_work(served):
    _, servicer, stub = served
    servicer.draining = True
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Generate(request())
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_full_server_answers_overloaded_at_once(served):
    engine, _, stub = served
    release = asyncio.Event()
    first, last = events(["x", "y"])
    engine.script = lambda r: [first, release, last]
    # one stream holds the one permit, mid-generation
    held = stub.GenerateStream(request())
    assert (await held.read()).token.text == "x"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Generate(request())
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_info(info.value).reason == "overloaded"
    release.set()
    assert (await held.read()).token.text == "y"
    # the permit is back once the stream ended
    assert (await stub.Generate(request())).generated_text == "xy"


async def test_best_of_returns_the_likeliest_run(served):
    engine, _, stub = served
    engine.script = lambda r: events(
        ["x", "y"], logprob=-0.1 if r.request_id.endswith("-1") else -3.0
    )
    out = await stub.Generate(request(best_of=2, do_sample=True, details=True))
    seeds = {r.sampling.seed for r in engine.requests}
    assert len(engine.requests) == 2 and len(seeds) == 2  # each run its own seed
    assert out.details.tokens[0].logprob == pytest.approx(-0.1)
    assert len(out.details.best_of_sequences) == 1


# a shard gone -------------------------------------------------------------------------

LOST = "shard 1 (pid 4242) exited with code -9: generation can't go on"


def lost_shard() -> EngineError:
    from textgen.service.engine.runners.sharded import ShardLost

    return ShardLost("shard 1 (pid 4242) exited with code -9")


def chat_body() -> httpbody_pb2.HttpBody:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    return httpbody_pb2.HttpBody(content_type="application/json", data=json.dumps(body).encode())


async def test_a_lost_shard_is_an_incomplete_generation_naming_it_on_every_face(served):
    """The engine's ShardLost (engine/runners/sharded.py) reaches TGI's stream and unary
    call and OpenAI's stream as it is, before any token too: its type, with the rank's
    name (Envoy's HTTP faces translate the same type and message)."""
    engine, _, stub = served
    engine.script = lambda r: [*events(["a", "b"])[:1], lost_shard()]
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for message in stub.GenerateStream(request()):
            received.append(message)
    assert (received[-1].error, received[-1].error_type) == (LOST, "incomplete_generation")
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.ABORTED, LOST)
    assert error_info(info.value).reason == "incomplete_generation"

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Generate(request())
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.ABORTED, LOST)
    assert error_info(info.value).reason == "incomplete_generation"

    bodies = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for body in stub.ChatCompletions(chat_body()):
            bodies.append(body)
    frames = b"".join(b.data for b in bodies).split(b"\n\n")
    last = json.loads(frames[-2].removeprefix(b"data: "))
    assert last["error"]["type"] == "incomplete_generation" and last["error"]["message"] == LOST
    assert error_info(info.value).reason == "incomplete_generation"


# /v1/responses ------------------------------------------------------------------------


def responses_body(**fields) -> httpbody_pb2.HttpBody:
    body = {"input": "The quick", "max_output_tokens": 4, "temperature": 0, **fields}
    return httpbody_pb2.HttpBody(content_type="application/json", data=json.dumps(body).encode())


def sse_events(bodies) -> list[dict]:
    frames = b"".join(body.data for body in bodies).split(b"\n\n")
    return [json.loads(f.split(b"\ndata: ", 1)[1]) for f in frames if f.strip()]


async def test_responses_failure_mid_stream_is_an_error_event_then_aborted(served):
    engine, servicer, stub = served
    engine.script = lambda r: [*events(["a", "b"])[:1], EngineError("boom")]
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for body in stub.Responses(responses_body(stream=True)):
            received.append(body)
    sent = sse_events(received)
    assert [e["type"] for e in sent] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "error",
    ]  # fmt: skip
    assert sent[-1]["code"] == "incomplete_generation" and sent[-1]["message"] == "boom"
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert error_info(info.value).reason == "incomplete_generation"
    assert len(servicer.responses_store) == 0  # a failed response is not kept


async def test_responses_are_kept_for_previous_response_id(served):
    engine, servicer, stub = served
    (body,) = [b async for b in stub.Responses(responses_body())]
    first = json.loads(body.data)
    assert first["output"][0]["content"][0]["text"] == "Hello world"
    stored = servicer.responses_store.get(first["id"])
    assert stored.conversation[-1] == {"role": "assistant", "content": "Hello world"}
    assert stored.response == first  # kept as answered (GET /v1/responses/{id})
    assert [i["role"] for i in stored.items] == ["user"]
    [b async for b in stub.Responses(responses_body(previous_response_id=first["id"]))]
    prompt_ids = engine.requests[-1].prompt_ids
    assert len(prompt_ids) > len(engine.requests[0].prompt_ids)  # the first turn, then this
    (body,) = [b async for b in stub.Responses(responses_body(store=False))]
    assert servicer.responses_store.get(json.loads(body.data)["id"]) is None


async def test_responses_refusals_name_the_field(served):
    engine, _, stub = served
    with pytest.raises(grpc.aio.AioRpcError) as info:
        [b async for b in stub.Responses(responses_body(tools=[{"type": "web_search"}]))]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(info.value).metadata["param"] == "tools"
    assert engine.requests == []


# /v1/messages -----------------------------------------------------------------------


def messages_body(**fields) -> httpbody_pb2.HttpBody:
    body = {
        "model": "m",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        **fields,
    }
    return httpbody_pb2.HttpBody(content_type="application/json", data=json.dumps(body).encode())


async def test_messages_failure_mid_stream_is_an_error_event_then_aborted(served):
    engine, _, stub = served
    engine.script = lambda r: [*events(["a", "b"])[:1], EngineError("boom")]
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for body in stub.Messages(messages_body()):
            received.append(body)
    sent = sse_events(received)
    assert [e["type"] for e in sent] == [
        "message_start", "content_block_start", "ping", "content_block_delta", "error",
    ]  # fmt: skip
    assert sent[-1]["error"] == {"type": "api_error", "message": "boom"}
    assert error_info(info.value).reason == "incomplete_generation"


async def test_messages_failure_before_any_token_is_the_status_alone(served):
    """Nothing was sent: the status is the answer (Envoy's Lua filter makes it Anthropic's
    529 overloaded_error here), not an event after a 200."""
    engine, _, stub = served
    engine.script = lambda r: [EngineError("engine down", ErrorType.UNAVAILABLE)]
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for body in stub.Messages(messages_body()):
            received.append(body)
    assert received == []
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error_info(info.value).reason == "unavailable"


async def test_count_tokens_is_validations_count(served):
    _, servicer, stub = served
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    answer = await stub.CountMessageTokens(
        httpbody_pb2.HttpBody(content_type="application/json", data=json.dumps(body).encode())
    )
    created = parse_messages_request(messages_body().data, servicer.validator.tokenizer)
    valid = servicer.validator.validate(created.generate, stream=True)
    assert json.loads(answer.data) == {"input_tokens": len(valid.engine_request.prompt_ids)}
