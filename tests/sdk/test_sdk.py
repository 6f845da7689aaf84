"""Tests of the Python SDK (`textgen.sdk`) against a scripted in-process fake server.

The fake is a sync `grpc.server` on 127.0.0.1 (its own threads, so the blocking
`Client` and the asyncio `AsyncClient` can both talk to it) built on the protobuf
servicer base the real server uses. Each test scripts it: how many tokens to stream
and how fast, a status to abort with, an in-band stream error, SSE chunks to send.
It records what reached it: requests, metadata, and whether a stream was cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
from google.api import httpbody_pb2
from google.protobuf import any_pb2, json_format
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from textgen.sdk import (
    AsyncClient,
    Client,
    DeadlineExceededError,
    GenerateResponse,
    GenerateStreamResponse,
    GenerationError,
    IncompleteGenerationError,
    InfoResponse,
    NotFoundError,
    OverloadedError,
    RetryPolicy,
    SimpleToken,
    TextGenError,
    Token,
    UnauthenticatedError,
    UnavailableError,
    UnknownError,
    ValidationError,
)
from textgen.sdk.sse import SseDecoder
from textgen.service.proto import generate_pb2
from textgen.service.proto import text_generation_service_pb2 as service_pb2
from textgen.service.proto.text_generation_service_pb2_grpc import (
    TextGenerationServiceServicer,
    add_TextGenerationServiceServicer_to_server,
)

pytestmark = pytest.mark.timeout(30)

API_KEY = "sk-test"
CANCEL_WAIT_S = 5.0  # upper bound for a cancellation to reach the server


@dataclass
class Failure:
    """A status the fake aborts with; `reason` None sends no ErrorInfo."""

    code: grpc.StatusCode
    message: str
    reason: str | None = None


@dataclass
class InBandError:
    """TGI's in-band stream error, then the failing status the server ends with."""

    error_type: str
    message: str
    status: Failure


def abort(context: grpc.ServicerContext, failure: Failure) -> None:
    if failure.reason is None:
        context.abort(failure.code, failure.message)
    status = status_pb2.Status(code=failure.code.value[0], message=failure.message)
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason=failure.reason, domain="textgen"))
    status.details.append(detail)
    context.abort_with_status(rpc_status.to_status(status))


def wait_while_active(context: grpc.ServicerContext, seconds: float) -> bool:
    """Sleep `seconds` unless the RPC ends first; True when it is still active."""
    deadline = time.monotonic() + seconds
    while context.is_active() and time.monotonic() < deadline:
        time.sleep(min(0.005, seconds))
    return context.is_active()


class FakeTextGeneration(TextGenerationServiceServicer):
    """A scripted TextGenerationService; set the attributes, then call it."""

    def __init__(self) -> None:
        self.target = ""
        self.requests: list[object] = []
        self.metadata: list[dict[str, str]] = []
        self.failure: Failure | None = None
        self.expected_api_key: str | None = None
        self.stream_tokens = 3
        self.token_delay = 0.0
        self.unary_delay = 0.0
        self.in_band_error: InBandError | None = None
        self.broken_after: Failure | None = None  # a status after the tokens, no in-band error
        self.healthy = True
        self.http_chunks: list[bytes] = []
        self.stream_cancelled = threading.Event()

    def _begin(self, request: object, context: grpc.ServicerContext) -> None:
        """Record the call, then fail it when the script says so."""
        self.requests.append(request)
        metadata = dict(context.invocation_metadata())
        self.metadata.append(metadata)
        if (
            self.expected_api_key
            and metadata.get("authorization") != f"Bearer {self.expected_api_key}"
        ):
            abort(context, Failure(grpc.StatusCode.UNAUTHENTICATED, "bad key", "unauthenticated"))
        if self.failure is not None:
            abort(context, self.failure)
        wait_while_active(context, self.unary_delay)

    def _watch_stream(self, context: grpc.ServicerContext) -> dict[str, bool]:
        """Flag `stream_cancelled` when the RPC ends before the script finished it."""
        outcome = {"scripted_end": False}

        def on_rpc_end() -> None:
            if not outcome["scripted_end"]:
                self.stream_cancelled.set()

        context.add_callback(on_rpc_end)
        return outcome

    def GenerateStream(self, request, context):
        self._begin(request, context)
        outcome = self._watch_stream(context)
        for index in range(1, self.stream_tokens + 1):
            if not wait_while_active(context, self.token_delay):
                return
            token = generate_pb2.Token(id=index, text=f" t{index}", logprob=-0.5)
            yield generate_pb2.GenerateStreamResponse(index=index, token=token)
        if self.broken_after is not None:
            outcome["scripted_end"] = True
            abort(context, self.broken_after)
        if self.in_band_error is not None:
            error = self.in_band_error
            outcome["scripted_end"] = True
            yield generate_pb2.GenerateStreamResponse(
                error=error.message, error_type=error.error_type
            )
            abort(context, error.status)
        outcome["scripted_end"] = True
        yield generate_pb2.GenerateStreamResponse(
            index=self.stream_tokens + 1,
            token=generate_pb2.Token(id=0, text="</s>", special=True),
            generated_text="".join(f" t{i}" for i in range(1, self.stream_tokens + 1)),
            details=generate_pb2.StreamDetails(
                finish_reason="eos_token", generated_tokens=self.stream_tokens + 1, seed=7
            ),
        )

    def Generate(self, request, context):
        self._begin(request, context)
        tokens = [generate_pb2.Token(id=1, text="hello"), generate_pb2.Token(id=2, text=" world")]
        details = generate_pb2.Details(finish_reason="length", generated_tokens=2, tokens=tokens)
        return generate_pb2.GenerateResponse(generated_text="hello world", details=details)

    def Info(self, request, context):
        self._begin(request, context)
        return service_pb2.InfoResponse(
            model_id="fake/model", max_input_tokens=1024, max_total_tokens=2048, router="textgen"
        )

    def Tokenize(self, request, context):
        self._begin(request, context)
        tokens, start = [], 0
        for number, word in enumerate(request.inputs.split(" "), start=1):
            tokens.append(
                service_pb2.SimpleToken(id=number, text=word, start=start, stop=start + len(word))
            )
            start += len(word) + 1
        if request.parameters.HasField("truncate"):
            tokens = tokens[-request.parameters.truncate :]
        return service_pb2.TokenizeResponse(tokens=tokens)

    def Health(self, request, context):
        self._begin(request, context)
        if not self.healthy:
            abort(context, Failure(grpc.StatusCode.UNAVAILABLE, "engine down", "healthcheck"))
        return service_pb2.HealthResponse()

    def Metrics(self, request, context):
        self._begin(request, context)
        return httpbody_pb2.HttpBody(content_type="text/plain", data=b"textgen_requests_total 3\n")

    def ListModels(self, request, context):
        self._begin(request, context)
        model = service_pb2.Model(id="fake/model", object="model", created=1, owned_by="textgen")
        return service_pb2.ListModelsResponse(object="list", data=[model])

    def ChatCompletions(self, request, context):
        self._begin(request, context)
        for chunk in self.http_chunks:
            yield httpbody_pb2.HttpBody(content_type="text/event-stream", data=chunk)

    Responses = ChatCompletions  # the same HttpBody pass-through


@pytest.fixture
def fake() -> Iterator[FakeTextGeneration]:
    servicer = FakeTextGeneration()
    executor = ThreadPoolExecutor(max_workers=8)
    server = grpc.server(executor)
    add_TextGenerationServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.target = f"127.0.0.1:{port}"
    yield servicer
    server.stop(None).wait()
    executor.shutdown(wait=True)


# the default retry policy's codes and attempts, with backoffs of milliseconds: a refusal
# the fake repeats is retried as by default, then raised
FAST_RETRY = RetryPolicy(initial_backoff=0.01, max_backoff=0.02)


@pytest.fixture
def client(fake: FakeTextGeneration) -> Iterator[Client]:
    with Client(fake.target, timeout=10, retries=FAST_RETRY) as sync_client:
        yield sync_client


@pytest.fixture
async def aclient(fake: FakeTextGeneration):
    async with AsyncClient(fake.target, timeout=10, retries=FAST_RETRY) as async_client:
        yield async_client


async def wait_for(event: threading.Event, seconds: float = CANCEL_WAIT_S) -> bool:
    """Poll a thread event without blocking the event loop."""
    deadline = time.monotonic() + seconds
    while not event.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    return event.is_set()


def closed_port_target() -> str:
    """A local address nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


# --- generate and generate_stream -------------------------------------------------


def test_generate_returns_typed_response(client: Client) -> None:
    response = client.generate("Hello", max_new_tokens=2)
    assert isinstance(response, GenerateResponse)
    assert response.generated_text == "hello world"
    assert response.details.finish_reason == "length"
    assert [token.text for token in response.details.tokens] == ["hello", " world"]
    assert isinstance(response.details.tokens[0], Token)


def test_generate_stream_yields_tokens_then_final_message(client: Client) -> None:
    messages = list(client.generate_stream("Hello"))
    assert all(isinstance(message, GenerateStreamResponse) for message in messages)
    assert [message.token.text for message in messages[:-1]] == [" t1", " t2", " t3"]
    assert all(message.generated_text is None for message in messages[:-1])
    final = messages[-1]
    assert final.generated_text == " t1 t2 t3"
    assert final.details.finish_reason == "eos_token"
    assert final.details.seed == 7


async def test_async_generate_and_stream(aclient: AsyncClient) -> None:
    response = await aclient.generate("Hello")
    assert response.generated_text == "hello world"
    messages = [message async for message in aclient.generate_stream("Hello")]
    assert [message.index for message in messages] == [1, 2, 3, 4]
    assert messages[-1].generated_text == " t1 t2 t3"


def test_parameters_reach_server_with_presence(client: Client, fake: FakeTextGeneration) -> None:
    client.generate(
        "Hello",
        max_new_tokens=0,
        do_sample=True,
        seed=0,
        return_full_text=False,
        frequency_penalty=0.0,
        top_n_tokens=0,
        top_p=0.9,
        stop=["\n", "</s>"],
        logit_bias={7: -100.0},
        grammar={"type": "json", "value": {"type": "object"}},
        decoder_input_details=True,
    )
    parameters = fake.requests[-1].parameters
    for field, value in [
        ("max_new_tokens", 0),
        ("seed", 0),
        ("return_full_text", False),
        ("frequency_penalty", 0.0),
        ("top_n_tokens", 0),
    ]:
        assert parameters.HasField(field), field
        assert getattr(parameters, field) == value
    assert parameters.top_p == pytest.approx(0.9)
    for field in [
        "temperature",
        "top_k",
        "typical_p",
        "repetition_penalty",
        "presence_penalty",
        "best_of",
        "truncate",
    ]:
        assert not parameters.HasField(field), field
    assert parameters.do_sample and parameters.details and parameters.decoder_input_details
    assert list(parameters.stop) == ["\n", "</s>"]
    assert dict(parameters.logit_bias) == {7: -100.0}
    assert parameters.grammar.type == "json"
    assert json_format.MessageToDict(parameters.grammar.value) == {"type": "object"}


def test_unset_parameters_stay_unset(client: Client, fake: FakeTextGeneration) -> None:
    list(client.generate_stream("Hello"))
    request = fake.requests[-1]
    assert request.inputs == "Hello"
    optional_fields = [
        field.name for field in request.parameters.DESCRIPTOR.fields if field.has_presence
    ]
    assert [name for name in optional_fields if request.parameters.HasField(name)] == []
    assert request.parameters.details is True  # TGI's client always asks for details
    assert not request.parameters.do_sample


def test_unknown_keyword_is_a_type_error(client: Client) -> None:
    with pytest.raises(TypeError):
        client.generate("Hello", max_tokens=5)  # type: ignore[call-arg]


# --- metadata and timeouts --------------------------------------------------------


def test_api_key_and_metadata_reach_server(fake: FakeTextGeneration) -> None:
    fake.expected_api_key = API_KEY
    with Client(fake.target, api_key=API_KEY, metadata=[("x-tenant", "a")]) as keyed:
        keyed.generate("Hello", metadata=[("x-request-id", "42")])
        list(keyed.generate_stream("Hello"))
    for metadata in fake.metadata:
        assert metadata["authorization"] == f"Bearer {API_KEY}"
        assert metadata["x-tenant"] == "a"
    assert fake.metadata[0]["x-request-id"] == "42"


async def test_async_api_key_reaches_server(fake: FakeTextGeneration) -> None:
    fake.expected_api_key = API_KEY
    async with AsyncClient(fake.target, api_key=API_KEY) as keyed:
        assert await keyed.health()
    assert fake.metadata[-1]["authorization"] == f"Bearer {API_KEY}"


def test_wrong_api_key_raises_unauthenticated(fake: FakeTextGeneration) -> None:
    fake.expected_api_key = API_KEY
    with Client(fake.target, api_key="wrong") as keyed, pytest.raises(UnauthenticatedError):
        keyed.generate("Hello")


def test_per_call_timeout_raises_deadline_exceeded(
    client: Client, fake: FakeTextGeneration
) -> None:
    fake.unary_delay = 5.0
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError) as raised:
        client.generate("Hello", timeout=0.2)
    assert time.monotonic() - started < 3
    assert raised.value.code is grpc.StatusCode.DEADLINE_EXCEEDED


def test_stream_timeout_raises_deadline_exceeded(client: Client, fake: FakeTextGeneration) -> None:
    fake.stream_tokens, fake.token_delay = 1000, 0.02
    stream = client.generate_stream("Hello", timeout=0.3)
    assert next(stream).index == 1  # the deadline strikes mid-stream
    with pytest.raises(DeadlineExceededError):
        list(stream)


def test_per_call_timeout_overrides_client_default(fake: FakeTextGeneration) -> None:
    fake.unary_delay = 0.3
    with Client(fake.target, timeout=0.05) as hasty:
        with pytest.raises(DeadlineExceededError):
            hasty.generate("Hello")
        assert hasty.generate("Hello", timeout=5).generated_text == "hello world"


async def test_async_timeout_raises_deadline_exceeded(
    aclient: AsyncClient, fake: FakeTextGeneration
) -> None:
    fake.unary_delay = 5.0
    with pytest.raises(DeadlineExceededError):
        await aclient.generate("Hello", timeout=0.2)


# --- error mapping ----------------------------------------------------------------

REASONS = [
    ("validation", grpc.StatusCode.INVALID_ARGUMENT, ValidationError),
    ("overloaded", grpc.StatusCode.RESOURCE_EXHAUSTED, OverloadedError),
    ("generation", grpc.StatusCode.INTERNAL, GenerationError),
    ("incomplete_generation", grpc.StatusCode.ABORTED, IncompleteGenerationError),
    ("unauthenticated", grpc.StatusCode.UNAUTHENTICATED, UnauthenticatedError),
    ("healthcheck", grpc.StatusCode.UNAVAILABLE, UnavailableError),
    ("unavailable", grpc.StatusCode.UNAVAILABLE, UnavailableError),
]


@pytest.mark.parametrize(("reason", "code", "error_class"), REASONS)
def test_error_reason_maps_to_class(
    client: Client, fake: FakeTextGeneration, reason, code, error_class
) -> None:
    fake.failure = Failure(code, f"{reason} happened", reason)
    with pytest.raises(error_class) as unary:
        client.generate("Hello")
    with pytest.raises(error_class) as stream:
        next(iter(client.generate_stream("Hello")))
    for raised in (unary.value, stream.value):
        assert (raised.error_type, raised.code, raised.message) == (
            reason,
            code,
            f"{reason} happened",
        )
        assert isinstance(raised.__cause__, grpc.RpcError)


@pytest.mark.parametrize(("reason", "code", "error_class"), REASONS)
async def test_async_error_reason_maps_to_class(
    aclient: AsyncClient, fake: FakeTextGeneration, reason, code, error_class
) -> None:
    fake.failure = Failure(code, "nope", reason)
    with pytest.raises(error_class):
        await aclient.generate("Hello")
    with pytest.raises(error_class) as raised:
        async for _ in aclient.generate_stream("Hello"):
            pass
    assert raised.value.error_type == reason


@pytest.mark.parametrize(
    ("code", "error_class", "error_type"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, ValidationError, "validation"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, OverloadedError, "overloaded"),
        (grpc.StatusCode.UNAVAILABLE, UnavailableError, "unavailable"),
        (grpc.StatusCode.NOT_FOUND, NotFoundError, "not_found"),
        (grpc.StatusCode.DATA_LOSS, UnknownError, "unknown"),
    ],
)
def test_status_code_without_error_info_maps_to_class(
    client: Client, fake: FakeTextGeneration, code, error_class, error_type
) -> None:
    fake.failure = Failure(code, "plain status")
    with pytest.raises(error_class) as raised:
        client.generate("Hello")
    assert (raised.value.error_type, raised.value.code, raised.value.message) == (
        error_type,
        code,
        "plain status",
    )


def test_unknown_reason_falls_back_to_code(client: Client, fake: FakeTextGeneration) -> None:
    fake.failure = Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "slow down", "quota")
    with pytest.raises(OverloadedError) as raised:
        client.generate("Hello")
    assert raised.value.error_type == "quota"


def test_errors_share_base_class() -> None:
    assert all(issubclass(error_class, TextGenError) for _, _, error_class in REASONS)
    assert issubclass(DeadlineExceededError, TextGenError) and issubclass(
        UnknownError, TextGenError
    )


IN_BAND = InBandError(
    error_type="incomplete_generation",
    message="in-band: request dropped",
    status=Failure(grpc.StatusCode.ABORTED, "status: request dropped", "incomplete_generation"),
)


def test_in_band_error_raises_its_class_once(client: Client, fake: FakeTextGeneration) -> None:
    fake.in_band_error = IN_BAND
    tokens = []
    with pytest.raises(IncompleteGenerationError) as raised:
        for message in client.generate_stream("Hello"):
            tokens.append(message.token.text)
    assert tokens == [" t1", " t2", " t3"]
    # The in-band message is the error; the status that follows is not wrapped again.
    assert raised.value.message == "in-band: request dropped"
    assert raised.value.__cause__ is None
    assert raised.value.tokens_received == 3


# A stream cut with no word from the server (its replica died behind Envoy): the
# status the transport made up. Through Envoy a gRPC client sees INTERNAL "Stream
# removed" (RST_STREAM); straight from a closed connection, UNAVAILABLE.
BROKEN = [
    Failure(grpc.StatusCode.INTERNAL, "Stream removed"),
    Failure(grpc.StatusCode.UNAVAILABLE, "Socket closed"),
    Failure(grpc.StatusCode.UNKNOWN, "reset"),
]


@pytest.mark.parametrize("failure", BROKEN, ids=lambda f: f.code.name)
def test_broken_stream_is_incomplete_with_tokens_received(
    client: Client, fake: FakeTextGeneration, failure: Failure
) -> None:
    fake.broken_after = failure
    tokens = []
    with pytest.raises(IncompleteGenerationError) as raised:
        for message in client.generate_stream("Hello"):
            tokens.append(message.token.text)
    assert tokens == [" t1", " t2", " t3"]
    error = raised.value
    assert (error.tokens_received, error.code, error.error_type) == (
        3,
        failure.code,
        "incomplete_generation",
    )
    assert "after 3 tokens" in error.message and failure.message in error.message


async def test_async_broken_stream_is_incomplete(
    aclient: AsyncClient, fake: FakeTextGeneration
) -> None:
    fake.broken_after = BROKEN[0]
    with pytest.raises(IncompleteGenerationError) as raised:
        async for _ in aclient.generate_stream("Hello"):
            pass
    assert (raised.value.tokens_received, raised.value.code) == (3, grpc.StatusCode.INTERNAL)


def test_stream_failures_keep_their_class_with_tokens_received(
    client: Client, fake: FakeTextGeneration
) -> None:
    # typed by the server (ErrorInfo), or before any token: the class of its reason/code
    fake.broken_after = Failure(grpc.StatusCode.INTERNAL, "device lost", "generation")
    with pytest.raises(GenerationError) as raised:
        list(client.generate_stream("Hello"))
    assert raised.value.tokens_received == 3
    fake.broken_after, fake.stream_tokens = Failure(grpc.StatusCode.UNAVAILABLE, "gone"), 0
    with pytest.raises(UnavailableError) as raised:
        list(client.generate_stream("Hello"))
    assert raised.value.tokens_received == 0


async def test_async_in_band_error_raises_its_class(
    aclient: AsyncClient, fake: FakeTextGeneration
) -> None:
    fake.in_band_error = InBandError(
        "generation",
        "CUDA out of memory",
        Failure(grpc.StatusCode.INTERNAL, "status", "generation"),
    )
    with pytest.raises(GenerationError) as raised:
        async for _ in aclient.generate_stream("Hello"):
            pass
    assert raised.value.message == "CUDA out of memory"
    assert raised.value.__cause__ is None


# --- cancellation -----------------------------------------------------------------


def test_break_cancels_stream(client: Client, fake: FakeTextGeneration) -> None:
    fake.stream_tokens, fake.token_delay = 10_000, 0.01
    for message in client.generate_stream("Hello"):
        if message.index == 2:
            break
    assert fake.stream_cancelled.wait(CANCEL_WAIT_S)


def test_closing_a_held_stream_cancels_it(client: Client, fake: FakeTextGeneration) -> None:
    fake.stream_tokens, fake.token_delay = 10_000, 0.01
    stream = client.generate_stream("Hello")
    next(stream)
    assert not fake.stream_cancelled.is_set()
    stream.close()  # type: ignore[attr-defined]
    assert fake.stream_cancelled.wait(CANCEL_WAIT_S)


def test_finished_stream_is_not_cancelled(client: Client, fake: FakeTextGeneration) -> None:
    list(client.generate_stream("Hello"))
    assert not fake.stream_cancelled.wait(0.1)


async def test_async_break_cancels_stream(aclient: AsyncClient, fake: FakeTextGeneration) -> None:
    fake.stream_tokens, fake.token_delay = 10_000, 0.01
    async for message in aclient.generate_stream("Hello"):
        if message.index == 2:
            break  # the dropped generator is closed by the event loop's finalizer
    assert await wait_for(fake.stream_cancelled)


async def test_async_aclose_cancels_stream(aclient: AsyncClient, fake: FakeTextGeneration) -> None:
    fake.stream_tokens, fake.token_delay = 10_000, 0.01
    async with contextlib.aclosing(aclient.generate_stream("Hello")) as stream:
        async for _ in stream:
            break
    assert await wait_for(fake.stream_cancelled)


async def test_async_task_cancel_cancels_stream(
    aclient: AsyncClient, fake: FakeTextGeneration
) -> None:
    fake.stream_tokens, fake.token_delay = 10_000, 0.01
    first_token = asyncio.Event()

    async def consume() -> None:
        async for _ in aclient.generate_stream("Hello"):
            first_token.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first_token.wait(), CANCEL_WAIT_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await wait_for(fake.stream_cancelled)


# --- the other RPCs ---------------------------------------------------------------


def test_info_tokenize_list_models_metrics(client: Client, fake: FakeTextGeneration) -> None:
    info = client.info()
    assert isinstance(info, InfoResponse)
    assert (info.model_id, info.max_total_tokens, info.model_sha) == ("fake/model", 2048, None)
    tokens = client.tokenize("a bb ccc")
    assert all(isinstance(token, SimpleToken) for token in tokens)
    assert [(t.text, t.start, t.stop) for t in tokens] == [("a", 0, 1), ("bb", 2, 4), ("ccc", 5, 8)]
    assert [t.text for t in client.tokenize("a bb ccc", truncate=1)] == ["ccc"]
    assert not fake.requests[-2].HasField("parameters")
    assert [model.id for model in client.list_models()] == ["fake/model"]
    assert "textgen_requests_total 3" in client.metrics()


async def test_async_info_tokenize_list_models_metrics(aclient: AsyncClient) -> None:
    assert (await aclient.info()).model_id == "fake/model"
    assert [t.text for t in await aclient.tokenize("a bb", truncate=1)] == ["bb"]
    assert [model.owned_by for model in await aclient.list_models()] == ["textgen"]
    assert (await aclient.metrics()).startswith("textgen_requests_total")


def test_health(client: Client, fake: FakeTextGeneration) -> None:
    assert client.health() is True
    fake.healthy = False
    assert client.health() is False
    fake.failure = Failure(grpc.StatusCode.UNAUTHENTICATED, "no key", "unauthenticated")
    with pytest.raises(UnauthenticatedError):
        client.health()


async def test_async_health(aclient: AsyncClient, fake: FakeTextGeneration) -> None:
    assert await aclient.health() is True
    fake.healthy = False
    assert await aclient.health() is False


def test_health_is_false_when_nothing_listens() -> None:
    with Client(closed_port_target(), timeout=5, retries=FAST_RETRY) as nowhere:
        assert nowhere.health() is False
        with pytest.raises(UnavailableError):
            nowhere.generate("Hello")


async def test_async_health_is_false_when_nothing_listens() -> None:
    async with AsyncClient(closed_port_target(), timeout=5, retries=FAST_RETRY) as nowhere:
        assert await nowhere.health() is False
        with pytest.raises(UnavailableError):
            await nowhere.generate("Hello")


# --- OpenAI HttpBody routes and SSE -----------------------------------------------

CHAT_SSE = (
    'data: {"id":"1","choices":[{"delta":{"content":"Hé"}}]}\n\n'
    ": keep-alive comment\n\n"
    'data: {"id":"1","choices":[{"delta":{"content":"llo"}}]}\r\n\r\n'
    "data: [DONE]\n\n"
).encode()
CHAT_EVENTS = [
    {"id": "1", "choices": [{"delta": {"content": "Hé"}}]},
    {"id": "1", "choices": [{"delta": {"content": "llo"}}]},
]


def decode_in_chunks(data: bytes, size: int) -> tuple[list[object], bool]:
    decoder = SseDecoder()
    events = []
    for start in range(0, len(data), size):
        events.extend(decoder.feed(data[start : start + size]))
    events.extend(decoder.close())
    return events, decoder.done


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 7, 64, 10_000])
def test_sse_decoder_survives_any_split(chunk_size: int) -> None:
    # One-byte chunks split the two bytes of "é" and every CRLF.
    assert decode_in_chunks(CHAT_SSE, chunk_size) == (CHAT_EVENTS, True)


def test_sse_decoder_joins_data_lines_and_ignores_other_fields() -> None:
    data = b'event: message\nid: 3\ndata: {"a":\ndata: 1}\n\ndata: [DONE]\n\ndata: {"late": 1}\n\n'
    assert decode_in_chunks(data, 5) == ([{"a": 1}], True)


def test_sse_decoder_flushes_last_event_without_blank_line() -> None:
    assert decode_in_chunks(b'data: {"a": 1}\n\ndata: {"b": 2}', 4) == ([{"a": 1}, {"b": 2}], False)


def test_chat_completions_stream_over_grpc(client: Client, fake: FakeTextGeneration) -> None:
    fake.http_chunks = [CHAT_SSE[:10], CHAT_SSE[10:31], CHAT_SSE[31:]]
    events = list(
        client.chat_completions_stream(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        )
    )
    assert events == CHAT_EVENTS
    request = fake.requests[-1]
    assert request.content_type == "application/json"
    assert json.loads(request.data) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
    }


def test_chat_completions_stream_raises_error_event(
    client: Client, fake: FakeTextGeneration
) -> None:
    fake.http_chunks = [
        b'data: {"error": "Input validation error", "error_type": "validation"}\n\n'
    ]
    with pytest.raises(ValidationError, match="Input validation error"):
        list(client.chat_completions_stream({"messages": []}))


def test_chat_completions_returns_one_json_body(client: Client, fake: FakeTextGeneration) -> None:
    fake.http_chunks = [b'{"id": "1", "choices": [{"message": ', b'{"content": "hi"}}]}']
    assert client.chat_completions({"messages": [], "stream": True}) == {
        "id": "1",
        "choices": [{"message": {"content": "hi"}}],
    }
    assert json.loads(fake.requests[-1].data)["stream"] is False


async def test_async_chat_completions(aclient: AsyncClient, fake: FakeTextGeneration) -> None:
    fake.http_chunks = [CHAT_SSE[:5], CHAT_SSE[5:]]
    assert [
        event async for event in aclient.chat_completions_stream({"messages": []})
    ] == CHAT_EVENTS
    fake.http_chunks = [b'{"object": "chat.completion"}']
    assert await aclient.chat_completions({"messages": []}) == {"object": "chat.completion"}


ERROR_AFTER_EVENT_SSE = (
    b'data: {"id": "1"}\n\n'
    b'data: {"error": {"message": "busy", "type": "overloaded"}}\n\n'
    b'data: {"id": "2"}\n\n'
)


def test_chat_completions_stream_yields_events_before_error_event(
    client: Client, fake: FakeTextGeneration
) -> None:
    fake.http_chunks = [ERROR_AFTER_EVENT_SSE]
    stream = client.chat_completions_stream({"messages": []})
    assert next(stream) == {"id": "1"}
    with pytest.raises(OverloadedError, match="busy"):
        next(stream)


async def test_async_chat_completions_errors(
    aclient: AsyncClient, fake: FakeTextGeneration
) -> None:
    fake.http_chunks = [ERROR_AFTER_EVENT_SSE]
    stream = aclient.chat_completions_stream({"messages": []})
    assert await anext(stream) == {"id": "1"}
    with pytest.raises(OverloadedError, match="busy"):
        await anext(stream)
    fake.http_chunks = [b'{"error": "Input validation error", "error_type": "validation"}']
    with pytest.raises(ValidationError, match="Input validation error"):
        await aclient.chat_completions({"messages": []})


RESPONSE = {"id": "resp_1", "error": None}
RESPONSE_EVENTS = [
    {"type": "response.created", "response": RESPONSE, "sequence_number": 0},
    {"type": "response.output_text.delta", "delta": "Pa", "sequence_number": 1},
    {"type": "response.output_text.delta", "delta": "ris", "sequence_number": 2},
    {"type": "response.completed", "response": RESPONSE, "sequence_number": 3},
]
# OpenAI's Responses framing: each event named, no `[DONE]` at the end
RESPONSES_SSE = b"".join(
    b"event: " + e["type"].encode() + b"\ndata: " + json.dumps(e).encode() + b"\n\n"
    for e in RESPONSE_EVENTS
)


def test_responses_stream_over_grpc(client: Client, fake: FakeTextGeneration) -> None:
    fake.http_chunks = [RESPONSES_SSE[:17], RESPONSES_SSE[17:90], RESPONSES_SSE[90:]]
    assert list(client.responses_stream({"model": "m", "input": "hi"})) == RESPONSE_EVENTS
    assert json.loads(fake.requests[-1].data) == {"model": "m", "input": "hi", "stream": True}


def test_responses_returns_the_response_object(client: Client, fake: FakeTextGeneration) -> None:
    # `"error": null` is a response object's field, not an error
    body = {"id": "resp_1", "object": "response", "status": "completed", "error": None}
    fake.http_chunks = [json.dumps(body).encode()]
    assert client.responses({"input": "hi", "stream": True}) == body
    assert json.loads(fake.requests[-1].data)["stream"] is False


def test_responses_error_event_raises_its_class(client: Client, fake: FakeTextGeneration) -> None:
    error = {"type": "error", "code": "incomplete_generation", "message": "boom", "param": None}
    fake.http_chunks = [
        RESPONSES_SSE.split(b"\n\n")[0] + b"\n\n",
        b"event: error\ndata: " + json.dumps({**error, "sequence_number": 1}).encode() + b"\n\n",
    ]
    stream = client.responses_stream({"input": "hi"})
    assert next(stream) == RESPONSE_EVENTS[0]
    with pytest.raises(IncompleteGenerationError, match="boom"):
        next(stream)


async def test_async_responses(aclient: AsyncClient, fake: FakeTextGeneration) -> None:
    fake.http_chunks = [RESPONSES_SSE]
    events = [event async for event in aclient.responses_stream({"input": "hi"})]
    assert events == RESPONSE_EVENTS
    fake.http_chunks = [b'{"object": "response", "error": null}']
    assert await aclient.responses({"input": "hi"}) == {"object": "response", "error": None}


# --- one API, two clients -----------------------------------------------------------

AWAITABLE_METHODS = [
    "generate",
    "info",
    "tokenize",
    "health",
    "metrics",
    "list_models",
    "chat_completions",
    "completions",
    "responses",
]
STREAM_METHODS = [
    "generate_stream",
    "chat_completions_stream",
    "completions_stream",
    "responses_stream",
]


@pytest.mark.parametrize("name", AWAITABLE_METHODS + STREAM_METHODS + ["__init__"])
def test_async_client_has_the_client_signatures(name: str) -> None:
    sync_method, async_method = getattr(Client, name), getattr(AsyncClient, name)
    assert inspect.signature(async_method) == inspect.signature(sync_method)
    assert async_method.__doc__ == sync_method.__doc__


@pytest.mark.parametrize("name", AWAITABLE_METHODS)
def test_async_client_calls_are_coroutine_functions(name: str) -> None:
    # What asyncio frameworks check before they await a callable.
    assert inspect.iscoroutinefunction(getattr(AsyncClient, name))
    assert not inspect.iscoroutinefunction(getattr(Client, name))


async def test_async_bad_argument_raises_when_awaited(aclient: AsyncClient) -> None:
    call = aclient.generate("Hello", no_such_option=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="no_such_option"):
        await call


async def test_async_streams_are_async_iterators(aclient: AsyncClient) -> None:
    for stream in (
        aclient.generate_stream("Hello"),
        aclient.chat_completions_stream({"messages": []}),
        aclient.completions_stream({"prompt": "Hello"}),
        aclient.responses_stream({"input": "Hello"}),
    ):
        assert inspect.isasyncgen(stream)
        await stream.aclose()  # never started: no RPC was made


# --- packaging ----------------------------------------------------------------------


@pytest.mark.server
def test_sdk_imports_without_server_dependencies() -> None:
    """The SDK install has no torch, transformers, grpcio-status or health checking."""
    script = (
        "import sys\n"
        "for name in ('torch', 'transformers', 'grpc_status', 'grpc_health'):\n"
        "    sys.modules[name] = None  # any import of them now raises ImportError\n"
        "import textgen.sdk\n"
        "from textgen.sdk import Client, AsyncClient, ValidationError\n"
        "assert not any(name.startswith('textgen.service') for name in sys.modules)\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=25
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
