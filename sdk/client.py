"""Sync and async clients of textgen's gRPC service `textgen.v1.TextGenerationService`.

betterproto2's generated stubs take no timeout or metadata and hide the call object,
so the clients drive grpcio themselves: a multi-callable per RPC on a `grpc.Channel`
(`Client`) or a `grpc.aio.Channel` (`AsyncClient`), with betterproto2 messages
serialized by `bytes(message)` and parsed by `Message.parse`.

Every failure surfaces as a `textgen.sdk.errors.TextGenError` subclass, never as a
raw `grpc.RpcError`. Streams cancel their RPC as soon as the caller stops iterating.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, Self, Unpack

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
    MetricsRequest,
    Model,
    SimpleToken,
    TokenizeRequest,
    TokenizeResponse,
)
from .errors import UnavailableError, from_rpc_error, from_stream_error
from .keepalive import DEFAULT_KEEPALIVE
from .parameters import GenerateOptions, build_generate_request
from .sse import SseDecoder

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


class _ClientSettings:
    """What every call of a client shares: its default timeout and metadata."""

    def __init__(self, *, api_key: str | None, timeout: float | None, metadata: Metadata) -> None:
        self._timeout = timeout
        self._metadata: tuple[tuple[str, str | bytes], ...] = tuple(metadata)
        if api_key is not None:
            self._metadata += (("authorization", f"Bearer {api_key}"),)

    def _call_options(self, timeout: float | None, metadata: Metadata | None) -> dict[str, Any]:
        """A per-call timeout overrides the client's; per-call metadata adds to it."""
        return {
            "timeout": self._timeout if timeout is None else timeout,
            "metadata": self._metadata + tuple(metadata or ()),
        }


def _channel_options(options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The caller's channel options, over the keepalive policy the server expects
    (textgen.sdk.keepalive): a long unary call or an idle channel finds a dead server."""
    given = {key for key, _ in options}
    return [o for o in DEFAULT_KEEPALIVE.channel_options() if o[0] not in given] + list(options)


def _raise_in_band_error(message: Any) -> None:
    """Raise TGI's in-band stream error, sent before the RPC's failing status."""
    if isinstance(message, GenerateStreamResponse) and (
        message.error is not None or message.error_type is not None
    ):
        raise from_stream_error(message.error or "", message.error_type)


def _raise_error_event(event: Any) -> None:
    """Raise an SSE error event: TGI's `{"error": str, "error_type": str}` or
    OpenAI's `{"error": {"message": str, "type": str}}`."""
    if not isinstance(event, dict) or "error" not in event:
        return
    error = event["error"]
    if isinstance(error, dict):
        raise from_stream_error(str(error.get("message", error)), error.get("type"))
    raise from_stream_error(str(error), event.get("error_type"))


def _json_body(body: Mapping[str, Any], *, stream: bool) -> HttpBody:
    """The request HttpBody; `stream` is set from the method the caller chose."""
    payload = {**body, "stream": stream}
    return HttpBody(content_type="application/json", data=json.dumps(payload).encode())


def _tokenize_request(text: str, truncate: int | None) -> TokenizeRequest:
    parameters = GenerateParameters(truncate=truncate) if truncate is not None else None
    return TokenizeRequest(inputs=text, parameters=parameters)


class Client(_ClientSettings):
    """Blocking client. Use as a context manager, or call `close()`.

    `api_key` is sent as `authorization: Bearer <key>` on every call; `timeout`
    (seconds) is the default deadline of each call; `credentials` (from
    `grpc.ssl_channel_credentials()`) makes the channel TLS; `options` are grpc
    channel options (over the keepalive policy of textgen.sdk.keepalive).
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        timeout: float | None = None,
        metadata: Metadata = (),
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        super().__init__(api_key=api_key, timeout=timeout, metadata=metadata)
        if credentials is None:
            self._channel = grpc.insecure_channel(target, options=_channel_options(options))
        else:
            self._channel = grpc.secure_channel(
                target, credentials, options=_channel_options(options)
            )
        self._stubs = _Stubs(self._channel)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        self._channel.close()

    def generate(
        self,
        prompt: str,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **options: Unpack[GenerateOptions],
    ) -> GenerateResponse:
        """Generate text for `prompt` and return it whole (TGI's `/generate`)."""
        request = build_generate_request(prompt, options)
        return self._unary(self._stubs.generate, request, timeout, metadata)

    def generate_stream(
        self,
        prompt: str,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Iterator[GenerateStreamResponse]:
        """Generate text one token per message. The RPC starts on the first `next()`
        and is cancelled when the iterator is closed (a `break` out of a `for` loop
        drops it; keep no other reference, or call its `close()`)."""
        request = build_generate_request(prompt, options)
        return self._stream(self._stubs.generate_stream, request, timeout, metadata)

    def info(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> InfoResponse:
        """The served model and the server's limits."""
        return self._unary(self._stubs.info, InfoRequest(), timeout, metadata)

    def tokenize(
        self,
        text: str,
        truncate: int | None = None,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> list[SimpleToken]:
        """The tokens of `text` (its last `truncate` tokens when given)."""
        response = self._unary(
            self._stubs.tokenize, _tokenize_request(text, truncate), timeout, metadata
        )
        return response.tokens

    def health(self, *, timeout: float | None = None, metadata: Metadata | None = None) -> bool:
        """True when the engine is healthy; False when it (or the server) is unavailable."""
        try:
            self._unary(self._stubs.health, HealthRequest(), timeout, metadata)
        except UnavailableError:
            return False
        return True

    def metrics(self, *, timeout: float | None = None, metadata: Metadata | None = None) -> str:
        """Prometheus metrics in the text exposition format."""
        body = self._unary(self._stubs.metrics, MetricsRequest(), timeout, metadata)
        return body.data.decode("utf-8")

    def list_models(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> list[Model]:
        """The served models (OpenAI's `/v1/models` data)."""
        return self._unary(self._stubs.list_models, ListModelsRequest(), timeout, metadata).data

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

    def _unary(
        self, method: Any, request: Any, timeout: float | None, metadata: Metadata | None
    ) -> Any:
        try:
            return method(request, **self._call_options(timeout, metadata))
        except grpc.RpcError as error:
            raise from_rpc_error(error) from error

    def _stream(
        self, method: Any, request: Any, timeout: float | None, metadata: Metadata | None
    ) -> Iterator[Any]:
        call = method(request, **self._call_options(timeout, metadata))
        try:
            for message in call:
                # Raising here ends the RPC: its failing status is never read, so
                # the in-band error is not reported a second time.
                _raise_in_band_error(message)
                yield message
        except grpc.RpcError as error:
            raise from_rpc_error(error) from error
        finally:
            call.cancel()  # a no-op once the RPC has ended

    def _json(
        self, method: Any, body: Mapping[str, Any], timeout: float | None, metadata: Metadata | None
    ) -> dict[str, Any]:
        request = _json_body(body, stream=False)
        with contextlib.closing(self._stream(method, request, timeout, metadata)) as bodies:
            result = json.loads(b"".join(part.data for part in bodies))
        _raise_error_event(result)
        return result

    def _events(
        self, method: Any, body: Mapping[str, Any], timeout: float | None, metadata: Metadata | None
    ) -> Iterator[dict[str, Any]]:
        decoder = SseDecoder()
        request = _json_body(body, stream=True)
        with contextlib.closing(self._stream(method, request, timeout, metadata)) as bodies:
            for part in bodies:
                for event in decoder.feed(part.data):
                    _raise_error_event(event)
                    yield event
        for event in decoder.close():
            _raise_error_event(event)
            yield event


class AsyncClient(_ClientSettings):
    """asyncio client on `grpc.aio`; the same methods as `Client`, awaited.

    Streams are async iterators; wrap one in `contextlib.aclosing` to cancel its RPC
    at once on `break` (otherwise the event loop closes it when it is collected).
    Cancelling the task that iterates cancels the RPC too.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        timeout: float | None = None,
        metadata: Metadata = (),
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        super().__init__(api_key=api_key, timeout=timeout, metadata=metadata)
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(target, options=_channel_options(options))
        else:
            self._channel = grpc.aio.secure_channel(
                target, credentials, options=_channel_options(options)
            )
        self._stubs = _Stubs(self._channel)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        await self._channel.close()

    async def generate(
        self,
        prompt: str,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **options: Unpack[GenerateOptions],
    ) -> GenerateResponse:
        """Generate text for `prompt` and return it whole (TGI's `/generate`)."""
        request = build_generate_request(prompt, options)
        return await self._unary(self._stubs.generate, request, timeout, metadata)

    def generate_stream(
        self,
        prompt: str,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **options: Unpack[GenerateOptions],
    ) -> AsyncIterator[GenerateStreamResponse]:
        """Generate text one token per message (`async for`); the RPC starts on the
        first iteration and is cancelled on `aclose()` or task cancellation."""
        request = build_generate_request(prompt, options)
        return self._stream(self._stubs.generate_stream, request, timeout, metadata)

    async def info(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> InfoResponse:
        """The served model and the server's limits."""
        return await self._unary(self._stubs.info, InfoRequest(), timeout, metadata)

    async def tokenize(
        self,
        text: str,
        truncate: int | None = None,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> list[SimpleToken]:
        """The tokens of `text` (its last `truncate` tokens when given)."""
        response = await self._unary(
            self._stubs.tokenize, _tokenize_request(text, truncate), timeout, metadata
        )
        return response.tokens

    async def health(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> bool:
        """True when the engine is healthy; False when it (or the server) is unavailable."""
        try:
            await self._unary(self._stubs.health, HealthRequest(), timeout, metadata)
        except UnavailableError:
            return False
        return True

    async def metrics(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> str:
        """Prometheus metrics in the text exposition format."""
        body = await self._unary(self._stubs.metrics, MetricsRequest(), timeout, metadata)
        return body.data.decode("utf-8")

    async def list_models(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> list[Model]:
        """The served models (OpenAI's `/v1/models` data)."""
        response = await self._unary(
            self._stubs.list_models, ListModelsRequest(), timeout, metadata
        )
        return response.data

    async def chat_completions(
        self,
        body: Mapping[str, Any],
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> dict[str, Any]:
        """OpenAI chat completion: `body` is OpenAI's request (sent with stream=false)."""
        return await self._json(self._stubs.chat_completions, body, timeout, metadata)

    def chat_completions_stream(
        self,
        body: Mapping[str, Any],
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """OpenAI chat completion chunks (sent with stream=true), up to `data: [DONE]`."""
        return self._events(self._stubs.chat_completions, body, timeout, metadata)

    async def completions(
        self,
        body: Mapping[str, Any],
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> dict[str, Any]:
        """OpenAI (legacy) completion, sent with stream=false."""
        return await self._json(self._stubs.completions, body, timeout, metadata)

    def completions_stream(
        self,
        body: Mapping[str, Any],
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """OpenAI (legacy) completion chunks, sent with stream=true."""
        return self._events(self._stubs.completions, body, timeout, metadata)

    async def _unary(
        self, method: Any, request: Any, timeout: float | None, metadata: Metadata | None
    ) -> Any:
        try:
            return await method(request, **self._call_options(timeout, metadata))
        except grpc.RpcError as error:  # grpc.aio.AioRpcError derives from it
            raise from_rpc_error(error) from error

    async def _stream(
        self, method: Any, request: Any, timeout: float | None, metadata: Metadata | None
    ) -> AsyncIterator[Any]:
        call = method(request, **self._call_options(timeout, metadata))
        try:
            async for message in call:
                # Raising here ends the RPC: its failing status is never read.
                _raise_in_band_error(message)
                yield message
        except grpc.RpcError as error:
            raise from_rpc_error(error) from error
        finally:
            call.cancel()  # on aclose() or CancelledError; a no-op once the RPC ended

    async def _json(
        self, method: Any, body: Mapping[str, Any], timeout: float | None, metadata: Metadata | None
    ) -> dict[str, Any]:
        request = _json_body(body, stream=False)
        parts: list[bytes] = []
        async with contextlib.aclosing(self._stream(method, request, timeout, metadata)) as bodies:
            async for part in bodies:
                parts.append(part.data)
        result = json.loads(b"".join(parts))
        _raise_error_event(result)
        return result

    async def _events(
        self, method: Any, body: Mapping[str, Any], timeout: float | None, metadata: Metadata | None
    ) -> AsyncIterator[dict[str, Any]]:
        decoder = SseDecoder()
        request = _json_body(body, stream=True)
        async with contextlib.aclosing(self._stream(method, request, timeout, metadata)) as bodies:
            async for part in bodies:
                for event in decoder.feed(part.data):
                    _raise_error_event(event)
                    yield event
        for event in decoder.close():
            _raise_error_event(event)
            yield event
