"""Sync and async clients of textgen's gRPC service `textgen.v1.TextGenerationService`.

betterproto2's generated stubs take no timeout or metadata and hide the call object,
so the clients drive grpcio themselves: a multi-callable per RPC on a `grpc.Channel`
(`Client`) or a `grpc.aio.Channel` (`AsyncClient`), with betterproto2 messages
serialized by `bytes(message)` and parsed by `Message.parse`.

`_BaseClient` builds every request and shapes every result once. It does no I/O: it
calls three primitives that `Client` (blocking) and `AsyncClient` (asyncio) implement,
`_unary` (one response, handed to `then`), `_stream` (the messages, or what a decoder
makes of them) and `_collect` (a whole stream, handed to `then`), and returns what they
return: a value or an iterator for `Client`, a coroutine or an async iterator for
`AsyncClient`.

Every failure surfaces as a `textgen.sdk.errors.TextGenError` subclass, never as a
raw `grpc.RpcError`; a stream's says how many tokens had arrived, and a stream that
breaks midway with no word from the server is an IncompleteGenerationError
(`errors.from_broken_stream`). Streams cancel their RPC as soon as the caller stops
iterating.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Generator,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self, Unpack

import grpc
import grpc.aio

from ._generated.google.api import HttpBody
from ._generated.textgen.v1 import (
    GenerateParameters,
    GenerateResponse,
    GenerateStreamResponse,
    HealthRequest,
    HealthResponse,
    InfoRequest,
    InfoResponse,
    ListModelsRequest,
    ListModelsResponse,
    LoadLoraAdapterRequest,
    LoraAdapterResponse,
    MetricsRequest,
    Model,
    SimpleToken,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoraAdapterRequest,
)
from .errors import (
    TextGenError,
    UnavailableError,
    from_broken_stream,
    from_event,
    from_rpc_error,
    from_stream_error,
)
from .images import ImageLike
from .keepalive import DEFAULT_KEEPALIVE
from .parameters import GenerateOptions, build_generate_request
from .retry import DEFAULT_RETRY, RetryPolicy, retry_policy
from .sse import EventStream

__all__ = ["DEFAULT_TARGET", "AsyncClient", "Client"]

DEFAULT_TARGET = "127.0.0.1:50051"
SERVICE_PATH = "/textgen.v1.TextGenerationService/"

Metadata = Sequence[tuple[str, str | bytes]]


class _Stubs:
    """One multi-callable per RPC. `grpc.Channel` and `grpc.aio.Channel` share the
    `unary_unary`/`unary_stream` shape, so one binding serves both clients; the
    attributes are grpc's (untyped) multi-callables of either flavour."""

    def __init__(self, channel: grpc.Channel | grpc.aio.Channel) -> None:
        def unary(name: str, response: type) -> Any:
            return channel.unary_unary(
                SERVICE_PATH + name, request_serializer=bytes, response_deserializer=response.parse
            )

        def stream(name: str, response: type) -> Any:
            return channel.unary_stream(
                SERVICE_PATH + name, request_serializer=bytes, response_deserializer=response.parse
            )

        self.generate = unary("Generate", GenerateResponse)
        self.generate_stream = stream("GenerateStream", GenerateStreamResponse)
        self.info = unary("Info", InfoResponse)
        self.tokenize = unary("Tokenize", TokenizeResponse)
        self.health = unary("Health", HealthResponse)
        self.metrics = unary("Metrics", HttpBody)
        self.list_models = unary("ListModels", ListModelsResponse)
        self.chat_completions = stream("ChatCompletions", HttpBody)
        self.completions = stream("Completions", HttpBody)
        self.responses = stream("Responses", HttpBody)
        self.load_lora_adapter = unary("LoadLoraAdapter", LoraAdapterResponse)
        self.unload_lora_adapter = unary("UnloadLoraAdapter", LoraAdapterResponse)


def _channel_options(
    options: Sequence[tuple[str, Any]], retries: RetryPolicy
) -> list[tuple[str, Any]]:
    """The caller's channel options, over the keepalive policy the server expects
    (textgen.sdk.keepalive: a long unary call or an idle channel finds a dead server)
    and the retry policy (textgen.sdk.retry: a refused call is sent again)."""
    given = {key for key, _ in options}
    defaults = [*DEFAULT_KEEPALIVE.channel_options(), *retries.channel_options()]
    return [o for o in defaults if o[0] not in given] + list(options)


def _json_body(body: Mapping[str, Any], *, stream: bool) -> HttpBody:
    """The request HttpBody; `stream` is set from the method the caller chose."""
    payload = {**body, "stream": stream}
    return HttpBody(content_type="application/json", data=json.dumps(payload).encode())


def _json_result(bodies: Iterable[HttpBody]) -> dict[str, Any]:
    """The one JSON answer that a non-streaming OpenAI call's bodies make up."""
    result = json.loads(b"".join(body.data for body in bodies))
    error = from_event(result)
    if error is not None:
        raise error
    return result


def _tokenize_request(text: str, truncate: int | None) -> TokenizeRequest:
    parameters = GenerateParameters(truncate=truncate) if truncate is not None else None
    return TokenizeRequest(inputs=text, parameters=parameters)


def _same(response: Any) -> Any:
    return response


# One RPC bound to its request and call options; calling it starts the RPC.
_Rpc = Callable[[], Any]


# `on_unavailable`'s default: an UnavailableError raises like any other failure.
_RAISE: Any = object()


def _unary_failure(error: grpc.RpcError, on_unavailable: Any) -> Any:
    """Raise a failed unary call's TextGenError, or return `on_unavailable` (when one
    was given) for an UnavailableError."""
    exception = from_rpc_error(error)
    if on_unavailable is _RAISE or not isinstance(exception, UnavailableError):
        raise exception from error
    return on_unavailable


class _Decoder(Protocol):
    """What a stream yields: each message is `feed`, then `close` at the stream's end;
    both return the items to yield (an iterator may raise after yielding some).
    `failure` is the exception for the RPC failing midway."""

    def feed(self, message: Any) -> Iterable[Any]: ...

    def close(self) -> Iterable[Any]: ...

    def failure(self, error: grpc.RpcError) -> TextGenError: ...


class _Messages:
    """The messages themselves; TGI's in-band error raises."""

    def __init__(self) -> None:
        self.tokens_received = 0

    def feed(self, message: Any) -> Iterable[Any]:
        # Raising here ends the RPC: its failing status is never read, so the
        # in-band error is not reported a second time.
        if isinstance(message, GenerateStreamResponse):
            if message.error is not None or message.error_type is not None:
                raise from_stream_error(
                    message.error or "", message.error_type, self.tokens_received
                )
            self.tokens_received += message.token is not None
        return (message,)

    def close(self) -> Iterable[Any]:
        return ()

    def failure(self, error: grpc.RpcError) -> TextGenError:
        return from_broken_stream(error, self.tokens_received)


class _Events:
    """The JSON payloads of the SSE frames that the HttpBody messages carry, up to
    their last event (sse.EventStream); an error event raises."""

    def __init__(self) -> None:
        self._events = EventStream("openai")

    def feed(self, message: Any) -> Iterable[Any]:
        return self._events.feed(message.data)

    def close(self) -> Iterable[Any]:
        return self._events.close()

    def failure(self, error: grpc.RpcError) -> TextGenError:
        return from_broken_stream(error, self._events.tokens_received)


class _BaseClient:
    """What `Client` and `AsyncClient` share: every call but its I/O.

    The public methods are typed as `Client` returns them; `AsyncClient` declares its
    own types for type checkers.
    """

    _grpc: ClassVar[Any]  # the module that opens the channel: grpc or grpc.aio

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        timeout: float | None = None,
        metadata: Metadata = (),
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
        retries: int | RetryPolicy = DEFAULT_RETRY,
    ) -> None:
        """`retries`: how often a call the server refused before answering (overloaded,
        draining) is sent again, by grpc after the server's pushback or a jittered
        exponential backoff (textgen.sdk.retry); 0: never, the error is raised at once."""
        self._timeout = timeout
        options = _channel_options(options, retry_policy(retries))
        self._metadata: tuple[tuple[str, str | bytes], ...] = tuple(metadata)
        if api_key is not None:
            self._metadata += (("authorization", f"Bearer {api_key}"),)
        if credentials is None:
            self._channel = self._grpc.insecure_channel(target, options=options)
        else:
            self._channel = self._grpc.secure_channel(target, credentials, options=options)
        self._stubs = _Stubs(self._channel)

    def generate(
        self,
        prompt: str,
        *,
        images: Sequence[ImageLike] | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **options: Unpack[GenerateOptions],
    ) -> GenerateResponse:
        """Generate text for `prompt` and return it whole (TGI's `/generate`). `images`
        (a vision-language model's): paths, bytes, PIL images or URLs (images.py), one
        per image placeholder of `prompt` (Info's `image_token`), in order."""
        request = build_generate_request(prompt, options, images)
        return self._unary(self._rpc(self._stubs.generate, request, timeout, metadata))

    def generate_stream(
        self,
        prompt: str,
        *,
        images: Sequence[ImageLike] | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Iterator[GenerateStreamResponse]:
        """Generate text one token per message: an iterator (`Client`) or an async
        iterator (`AsyncClient`). The RPC starts on the first iteration and is cancelled
        when the iterator is closed: a `break` out of a `for` loop drops it (keep no
        other reference, or call its `close()`); an async one on `aclose()` or when the
        task that iterates is cancelled. `images` as generate's."""
        request = build_generate_request(prompt, options, images)
        return self._stream(self._rpc(self._stubs.generate_stream, request, timeout, metadata))

    def info(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> InfoResponse:
        """The served model and the server's limits."""
        return self._unary(self._rpc(self._stubs.info, InfoRequest(), timeout, metadata))

    def tokenize(
        self,
        text: str,
        truncate: int | None = None,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> list[SimpleToken]:
        """The tokens of `text` (its last `truncate` tokens when given)."""
        request = _tokenize_request(text, truncate)
        rpc = self._rpc(self._stubs.tokenize, request, timeout, metadata)
        return self._unary(rpc, then=lambda response: response.tokens)

    def health(self, *, timeout: float | None = None, metadata: Metadata | None = None) -> bool:
        """True when the engine is healthy; False when it (or the server) is unavailable."""
        rpc = self._rpc(self._stubs.health, HealthRequest(), timeout, metadata)
        return self._unary(rpc, then=lambda _: True, on_unavailable=False)

    def metrics(self, *, timeout: float | None = None, metadata: Metadata | None = None) -> str:
        """Prometheus metrics in the text exposition format."""
        rpc = self._rpc(self._stubs.metrics, MetricsRequest(), timeout, metadata)
        return self._unary(rpc, then=lambda body: body.data.decode("utf-8"))

    def list_models(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> list[Model]:
        """The served models (OpenAI's `/v1/models` data)."""
        rpc = self._rpc(self._stubs.list_models, ListModelsRequest(), timeout, metadata)
        return self._unary(rpc, then=lambda response: response.data)

    def load_lora_adapter(
        self,
        name: str,
        path: str,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> list[str]:
        """Serve the LoRA adapter at `path` (a peft folder or a Hub id) as `name`; -> the
        adapters served now."""
        request = LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        rpc = self._rpc(self._stubs.load_lora_adapter, request, timeout, metadata)
        return self._unary(rpc, then=lambda response: response.lora_adapters)

    def unload_lora_adapter(
        self, name: str, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> list[str]:
        """Stop serving the LoRA adapter `name` (its running requests finish with it);
        -> the adapters served now."""
        request = UnloadLoraAdapterRequest(lora_name=name)
        rpc = self._rpc(self._stubs.unload_lora_adapter, request, timeout, metadata)
        return self._unary(rpc, then=lambda response: response.lora_adapters)

    def chat_completions(
        self,
        body: Mapping[str, Any],
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> dict[str, Any]:
        """OpenAI chat completion: `body` is OpenAI's request (sent with stream=false)."""
        return self._json(self._stubs.chat_completions, body, timeout, metadata)

    def chat_completions_stream(
        self,
        body: Mapping[str, Any],
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> Iterator[dict[str, Any]]:
        """OpenAI chat completion chunks (sent with stream=true), up to `data: [DONE]`."""
        return self._events(self._stubs.chat_completions, body, timeout, metadata)

    def completions(
        self,
        body: Mapping[str, Any],
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> dict[str, Any]:
        """OpenAI (legacy) completion, sent with stream=false."""
        return self._json(self._stubs.completions, body, timeout, metadata)

    def completions_stream(
        self,
        body: Mapping[str, Any],
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> Iterator[dict[str, Any]]:
        """OpenAI (legacy) completion chunks, sent with stream=true."""
        return self._events(self._stubs.completions, body, timeout, metadata)

    def responses(
        self,
        body: Mapping[str, Any],
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> dict[str, Any]:
        """OpenAI Responses API: `body` is OpenAI's request (sent with stream=false); the
        `response` object."""
        return self._json(self._stubs.responses, body, timeout, metadata)

    def responses_stream(
        self,
        body: Mapping[str, Any],
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> Iterator[dict[str, Any]]:
        """OpenAI Responses API events (sent with stream=true), `response.created` to
        `response.completed` (or `response.incomplete`); an `error` event raises."""
        return self._events(self._stubs.responses, body, timeout, metadata)

    def _rpc(
        self, method: Any, request: Any, timeout: float | None, metadata: Metadata | None
    ) -> _Rpc:
        """`method` bound to `request`; a per-call timeout overrides the client's,
        per-call metadata adds to it."""
        return functools.partial(
            method,
            request,
            timeout=self._timeout if timeout is None else timeout,
            metadata=self._metadata + tuple(metadata or ()),
        )

    def _json(
        self, method: Any, body: Mapping[str, Any], timeout: float | None, metadata: Metadata | None
    ) -> Any:
        """An OpenAI call with stream=false: its one JSON answer."""
        request = _json_body(body, stream=False)
        return self._collect(self._rpc(method, request, timeout, metadata), then=_json_result)

    def _events(
        self, method: Any, body: Mapping[str, Any], timeout: float | None, metadata: Metadata | None
    ) -> Any:
        """An OpenAI call with stream=true: its SSE events' JSON payloads."""
        request = _json_body(body, stream=True)
        return self._stream(self._rpc(method, request, timeout, metadata), decode=_Events)

    # The I/O primitives, implemented by Client and AsyncClient.

    def _unary(
        self, rpc: _Rpc, *, then: Callable[[Any], Any] = _same, on_unavailable: Any = _RAISE
    ) -> Any:
        """Call a unary RPC: `then(response)`, or `on_unavailable` (when given) if the
        call fails with UnavailableError (a value, or a coroutine of it)."""
        raise NotImplementedError

    def _stream(self, rpc: _Rpc, *, decode: Callable[[], _Decoder] = _Messages) -> Any:
        """Call a server-streaming RPC: the items `decode()` makes of its messages (an
        iterator, or an async iterator). The RPC starts on the first iteration and is
        cancelled when the iterator is closed."""
        raise NotImplementedError

    def _collect(self, rpc: _Rpc, *, then: Callable[[list[Any]], Any]) -> Any:
        """Call a server-streaming RPC: `then(all its messages)` (a value, or a
        coroutine of it)."""
        raise NotImplementedError


class Client(_BaseClient):
    """Blocking client. Use as a context manager, or call `close()`.

    `api_key` is sent as `authorization: Bearer <key>` on every call; `timeout`
    (seconds) is the default deadline of each call; `credentials` (from
    `grpc.ssl_channel_credentials()`) makes the channel TLS; `options` are grpc
    channel options (over the keepalive policy of textgen.sdk.keepalive).
    """

    _grpc = grpc
    _channel: grpc.Channel

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        self._channel.close()

    def _unary(
        self, rpc: _Rpc, *, then: Callable[[Any], Any] = _same, on_unavailable: Any = _RAISE
    ) -> Any:
        try:
            response = rpc()
        except grpc.RpcError as error:
            return _unary_failure(error, on_unavailable)
        return then(response)

    def _stream(
        self, rpc: _Rpc, *, decode: Callable[[], _Decoder] = _Messages
    ) -> Generator[Any, None, None]:
        decoder = decode()
        call = rpc()
        try:
            for message in call:
                yield from decoder.feed(message)
            yield from decoder.close()
        except grpc.RpcError as error:
            raise decoder.failure(error) from error
        finally:
            call.cancel()  # a no-op once the RPC has ended

    def _collect(self, rpc: _Rpc, *, then: Callable[[list[Any]], Any]) -> Any:
        with contextlib.closing(self._stream(rpc)) as messages:
            collected = list(messages)
        return then(collected)


def _coroutine_function(method: Callable[..., Any]) -> Callable[..., Any]:
    """A shared method, whose primitive returns a coroutine, as an `async def` that
    awaits it: `inspect.iscoroutinefunction` holds as for any asyncio API, and a bad
    argument raises when the call is awaited, not when it is made."""

    @functools.wraps(method)
    async def awaited(self: AsyncClient, *args: Any, **kwargs: Any) -> Any:
        return await method(self, *args, **kwargs)

    awaited.__qualname__ = f"AsyncClient.{method.__name__}"
    return awaited


class AsyncClient(_BaseClient):
    """asyncio client on `grpc.aio`; the same methods as `Client`, awaited.

    Streams are async iterators; wrap one in `contextlib.aclosing` to cancel its RPC
    at once on `break` (otherwise the event loop closes it when it is collected).
    Cancelling the task that iterates cancels the RPC too.
    """

    _grpc = grpc.aio
    _channel: grpc.aio.Channel

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        await self._channel.close()

    if TYPE_CHECKING:
        # The shared methods as an asyncio caller gets them, for type checkers only:
        # _BaseClient's implementations return what AsyncClient's primitives return.

        async def generate(  # type: ignore[override]
            self,
            prompt: str,
            *,
            images: Sequence[ImageLike] | None = None,
            timeout: float | None = None,
            metadata: Metadata | None = None,
            **options: Unpack[GenerateOptions],
        ) -> GenerateResponse: ...

        def generate_stream(  # type: ignore[override]
            self,
            prompt: str,
            *,
            images: Sequence[ImageLike] | None = None,
            timeout: float | None = None,
            metadata: Metadata | None = None,
            **options: Unpack[GenerateOptions],
        ) -> AsyncIterator[GenerateStreamResponse]: ...

        async def info(  # type: ignore[override]
            self, *, timeout: float | None = None, metadata: Metadata | None = None
        ) -> InfoResponse: ...

        async def tokenize(  # type: ignore[override]
            self,
            text: str,
            truncate: int | None = None,
            *,
            timeout: float | None = None,
            metadata: Metadata | None = None,
        ) -> list[SimpleToken]: ...

        async def health(  # type: ignore[override]
            self, *, timeout: float | None = None, metadata: Metadata | None = None
        ) -> bool: ...

        async def metrics(  # type: ignore[override]
            self, *, timeout: float | None = None, metadata: Metadata | None = None
        ) -> str: ...

        async def list_models(  # type: ignore[override]
            self, *, timeout: float | None = None, metadata: Metadata | None = None
        ) -> list[Model]: ...

        async def chat_completions(  # type: ignore[override]
            self,
            body: Mapping[str, Any],
            *,
            timeout: float | None = None,
            metadata: Metadata | None = None,
        ) -> dict[str, Any]: ...

        def chat_completions_stream(  # type: ignore[override]
            self,
            body: Mapping[str, Any],
            *,
            timeout: float | None = None,
            metadata: Metadata | None = None,
        ) -> AsyncIterator[dict[str, Any]]: ...

        async def completions(  # type: ignore[override]
            self,
            body: Mapping[str, Any],
            *,
            timeout: float | None = None,
            metadata: Metadata | None = None,
        ) -> dict[str, Any]: ...

        def completions_stream(  # type: ignore[override]
            self,
            body: Mapping[str, Any],
            *,
            timeout: float | None = None,
            metadata: Metadata | None = None,
        ) -> AsyncIterator[dict[str, Any]]: ...

        async def responses(  # type: ignore[override]
            self,
            body: Mapping[str, Any],
            *,
            timeout: float | None = None,
            metadata: Metadata | None = None,
        ) -> dict[str, Any]: ...

        async def load_lora_adapter(  # type: ignore[override]
            self,
            name: str,
            path: str,
            *,
            timeout: float | None = None,
            metadata: Metadata | None = None,
        ) -> list[str]: ...

        async def unload_lora_adapter(  # type: ignore[override]
            self, name: str, *, timeout: float | None = None, metadata: Metadata | None = None
        ) -> list[str]: ...

        def responses_stream(  # type: ignore[override]
            self,
            body: Mapping[str, Any],
            *,
            timeout: float | None = None,
            metadata: Metadata | None = None,
        ) -> AsyncIterator[dict[str, Any]]: ...

    else:
        # The streams are _BaseClient's as they are; the other calls are awaited.
        generate = _coroutine_function(_BaseClient.generate)
        info = _coroutine_function(_BaseClient.info)
        tokenize = _coroutine_function(_BaseClient.tokenize)
        health = _coroutine_function(_BaseClient.health)
        metrics = _coroutine_function(_BaseClient.metrics)
        list_models = _coroutine_function(_BaseClient.list_models)
        chat_completions = _coroutine_function(_BaseClient.chat_completions)
        completions = _coroutine_function(_BaseClient.completions)
        responses = _coroutine_function(_BaseClient.responses)
        load_lora_adapter = _coroutine_function(_BaseClient.load_lora_adapter)
        unload_lora_adapter = _coroutine_function(_BaseClient.unload_lora_adapter)

    async def _unary(
        self, rpc: _Rpc, *, then: Callable[[Any], Any] = _same, on_unavailable: Any = _RAISE
    ) -> Any:
        try:
            response = await rpc()
        except grpc.RpcError as error:  # grpc.aio.AioRpcError derives from it
            return _unary_failure(error, on_unavailable)
        return then(response)

    async def _stream(
        self, rpc: _Rpc, *, decode: Callable[[], _Decoder] = _Messages
    ) -> AsyncGenerator[Any, None]:
        decoder = decode()
        call = rpc()
        try:
            async for message in call:
                for item in decoder.feed(message):
                    yield item
            for item in decoder.close():
                yield item
        except grpc.RpcError as error:
            raise decoder.failure(error) from error
        finally:
            call.cancel()  # on aclose() or CancelledError; a no-op once the RPC ended

    async def _collect(self, rpc: _Rpc, *, then: Callable[[list[Any]], Any]) -> Any:
        async with contextlib.aclosing(self._stream(rpc)) as messages:
            collected = [message async for message in messages]
        return then(collected)
