"""Server interceptors, one concern each: API keys, and requests that don't decode.
`build_server` lists them in order."""

from __future__ import annotations

import hmac
import inspect
from collections.abc import Iterable

import grpc

from ..errors import ErrorType
from .errors import to_status

# Anthropic's header for the API key (its SDK sends it; `authorization: Bearer` works too)
API_KEY_HEADER = "x-api-key"


def _replace_behavior(handler: grpc.RpcMethodHandler, wrap) -> grpc.RpcMethodHandler:
    """The same handler with its behavior function wrapped (whatever its arity)."""
    for field in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        behavior = getattr(handler, field)
        if behavior is not None:
            return handler._replace(**{field: wrap(behavior, field.endswith("stream"))})
    return handler


def _aborting(
    handler: grpc.RpcMethodHandler, message: str, error_type: ErrorType
) -> grpc.RpcMethodHandler:
    """A handler of the same shape whose every call ends with a typed status."""

    def wrap(_behavior, streaming: bool):
        if streaming:

            async def stream_abort(request, context):
                await context.abort_with_status(to_status(message, error_type))
                yield  # pragma: no cover - makes this an async generator

            return stream_abort

        async def abort(request, context):
            await context.abort_with_status(to_status(message, error_type))

        return abort

    return _replace_behavior(handler, wrap)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Every call needs `authorization: Bearer <key>` (HTTP clients send the same
    header through Envoy), or Anthropic's `x-api-key: <key>`, with one of the keys;
    `open_methods` (health, metrics) are exempt. Keys are compared in constant time and
    never logged."""

    def __init__(
        self, keys: Iterable[str], open_methods: Iterable[str] = (), on_reject=None
    ) -> None:
        self._keys = [k.encode() for k in keys if k]
        if not self._keys:
            raise ValueError("ApiKeyInterceptor needs at least one key")
        self._open = frozenset(open_methods)
        self._on_reject = on_reject

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if (
            handler is None
            or details.method in self._open
            or self._authorized(details.invocation_metadata)
        ):
            return handler
        if self._on_reject is not None:
            self._on_reject()
        return _aborting(
            handler, "Unauthorized: a valid API key is required", ErrorType.UNAUTHENTICATED
        )

    def _authorized(self, metadata) -> bool:
        tokens = []  # each credential the call carries
        for key, value in metadata or ():
            text = value if isinstance(value, str) else value.decode()
            if key == "authorization":
                scheme, _, credential = text.partition(" ")
                if scheme.lower() == "bearer":
                    tokens.append(credential.strip().encode())
            elif key == API_KEY_HEADER:
                tokens.append(text.strip().encode())
        ok = False
        for token in tokens or [b""]:
            for key in self._keys:  # no early exit: the time taken doesn't depend on which key
                ok |= hmac.compare_digest(token, key)
        return ok


class MalformedRequest:
    """What the lenient deserializer hands over when the bytes don't decode."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class DecodingInterceptor(grpc.aio.ServerInterceptor):
    """A request that fails to decode (invalid UTF-8 in a string, garbage bytes) gets
    a typed validation error instead of grpc's generic INTERNAL."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler
        decode = handler.request_deserializer

        def lenient(data: bytes):
            try:
                return decode(data)
            except Exception as exc:  # noqa: BLE001 - any decoding failure is the caller's
                return MalformedRequest(exc)

        def wrap(behavior, streaming: bool):
            if streaming:

                async def stream_guard(request, context):
                    if isinstance(request, MalformedRequest):
                        await _reject_malformed(context, request)
                    result = behavior(request, context)
                    if inspect.isasyncgen(result):
                        async for message in result:
                            yield message
                    else:
                        await result

                return stream_guard

            async def guard(request, context):
                if isinstance(request, MalformedRequest):
                    await _reject_malformed(context, request)
                return await behavior(request, context)

            return guard

        return _replace_behavior(handler._replace(request_deserializer=lenient), wrap)


async def _reject_malformed(context, request: MalformedRequest) -> None:
    message = f"the request is not a valid message (strings must be valid UTF-8): {request.error}"
    await context.abort_with_status(to_status(message, ErrorType.VALIDATION))
