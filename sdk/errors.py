"""Typed exceptions of the textgen SDK, built from gRPC failures.

The server puts a `google.rpc.ErrorInfo` (domain "textgen") in every failed RPC's
`grpc-status-details-bin` trailer; its `reason` is TGI's `error_type` and picks the
exception class. Failures that carry no ErrorInfo (a deadline, a refused connection,
a proxy's answer) are classified by their status code instead. A stream that fails
after it started sends TGI's in-band error message first; `from_stream_error` maps
that message to the same classes. A stream that breaks with no word from the server
(its replica died: Envoy resets the stream, a gRPC client sees INTERNAL or UNAVAILABLE
from the transport) is an `IncompleteGenerationError` (`from_broken_stream`). Errors
raised by a stream say how many tokens had arrived (`tokens_received`).

The status details are parsed with googleapis-common-protos alone, so the SDK does
not need grpcio-status.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

__all__ = [
    "DeadlineExceededError",
    "GenerationError",
    "IncompleteGenerationError",
    "NotFoundError",
    "OverloadedError",
    "TextGenError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnknownError",
    "ValidationError",
    "from_broken_stream",
    "from_event",
    "from_rpc_error",
    "from_stream_error",
]

STATUS_DETAILS_KEY = "grpc-status-details-bin"


class TextGenError(Exception):
    """Base of every error the SDK raises for a failed request.

    `message` is the server's text, `error_type` TGI's error type (the ErrorInfo
    reason when the server sent one), `code` the gRPC status code. `tokens_received`
    is set when a stream failed: how many tokens had arrived before (TGI's token
    messages or events; for OpenAI's streams, the chunks that carried generated text).
    """

    default_error_type: ClassVar[str] = "unknown"
    default_code: ClassVar[grpc.StatusCode] = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        message: str,
        *,
        error_type: str | None = None,
        code: grpc.StatusCode | None = None,
        tokens_received: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.error_type = error_type or self.default_error_type
        self.code = code or self.default_code
        self.tokens_received = tokens_received

    def __repr__(self) -> str:
        received = (
            "" if self.tokens_received is None else f", tokens_received={self.tokens_received}"
        )
        return (
            f"{type(self).__name__}({self.message!r}, error_type={self.error_type!r}, "
            f"code={self.code.name}{received})"
        )


class ValidationError(TextGenError):
    """The request was refused as invalid (HTTP 422)."""

    default_error_type = "validation"
    default_code = grpc.StatusCode.INVALID_ARGUMENT


class OverloadedError(TextGenError):
    """The server is at its concurrency limit; retry later (HTTP 429). The Client already
    retried it (textgen.sdk.retry) unless told not to; `retry_after` is the server's
    estimate, in seconds, of when a permit frees up (None when it gave none)."""

    retry_after: float | None = None

    default_error_type = "overloaded"
    default_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class GenerationError(TextGenError):
    """The model failed while generating (HTTP 424)."""

    default_error_type = "generation"
    default_code = grpc.StatusCode.INTERNAL


class IncompleteGenerationError(TextGenError):
    """The generation stopped before it finished (HTTP 500)."""

    default_error_type = "incomplete_generation"
    default_code = grpc.StatusCode.ABORTED


class UnauthenticatedError(TextGenError):
    """The API key is missing or wrong (HTTP 401)."""

    default_error_type = "unauthenticated"
    default_code = grpc.StatusCode.UNAUTHENTICATED


class UnavailableError(TextGenError):
    """The server is unhealthy, draining, not ready, or unreachable (HTTP 503)."""

    default_error_type = "unavailable"
    default_code = grpc.StatusCode.UNAVAILABLE


class NotFoundError(TextGenError):
    """No such thing: a response id the replica does not keep (HTTP 404)."""

    default_error_type = "not_found"
    default_code = grpc.StatusCode.NOT_FOUND


class DeadlineExceededError(TextGenError):
    """The call's timeout ran out before the server answered."""

    default_error_type = "deadline_exceeded"
    default_code = grpc.StatusCode.DEADLINE_EXCEEDED


class UnknownError(TextGenError):
    """Any other failure: an unknown reason or a status code with no class of its own."""


_CLASS_BY_REASON: dict[str, type[TextGenError]] = {
    "validation": ValidationError,
    "overloaded": OverloadedError,
    "generation": GenerationError,
    "incomplete_generation": IncompleteGenerationError,
    "unauthenticated": UnauthenticatedError,
    "healthcheck": UnavailableError,
    "unavailable": UnavailableError,
    "not_found": NotFoundError,
    "deadline_exceeded": DeadlineExceededError,
}

_CLASS_BY_CODE: dict[grpc.StatusCode, type[TextGenError]] = {
    cls.default_code: cls for cls in set(_CLASS_BY_REASON.values())
}


def _class_for(reason: str | None, code: grpc.StatusCode | None) -> type[TextGenError]:
    """The reason decides; an unknown or missing reason falls back to the code."""
    if reason in _CLASS_BY_REASON:
        return _CLASS_BY_REASON[reason]
    return _CLASS_BY_CODE.get(code, UnknownError) if code is not None else UnknownError


def _status_details(
    trailing_metadata: Iterable[tuple[str, str | bytes]] | None,
) -> status_pb2.Status | None:
    """The google.rpc.Status of the trailer, or None when absent or unreadable."""
    for key, value in trailing_metadata or ():
        if key == STATUS_DETAILS_KEY and isinstance(value, bytes):
            try:
                return status_pb2.Status.FromString(value)
            except DecodeError:  # a corrupt trailer must not hide the real failure
                return None
    return None


def _error_info(status: status_pb2.Status) -> error_details_pb2.ErrorInfo | None:
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info
    return None


RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


def from_rpc_error(error: grpc.RpcError) -> TextGenError:
    """The typed exception for a failed call (`grpc.RpcError` or `grpc.aio.AioRpcError`);
    an overloaded server's pushback becomes the error's `retry_after` (seconds)."""
    code, message, reason = _failure(error)
    exception = _class_for(reason, code)(message, error_type=reason, code=code)
    for key, value in _call_attribute(error, "trailing_metadata") or ():
        if key == RETRY_PUSHBACK_KEY and str(value).isdigit():
            exception.retry_after = int(value) / 1000
    return exception


def from_broken_stream(error: grpc.RpcError, tokens_received: int) -> TextGenError:
    """The typed exception for a stream whose RPC failed after `tokens_received` tokens.

    A failure the server typed (its ErrorInfo), and the caller's own deadline, keep
    their class. One without a word from the server, once tokens have arrived, is an
    IncompleteGenerationError with the status as received: its replica died, and the
    proxy could only reset the stream (gRPC INTERNAL "Stream removed" through Envoy,
    UNAVAILABLE straight from a closed connection). A retry generates from scratch.
    """
    code, message, reason = _failure(error)
    if reason is None and tokens_received and code != grpc.StatusCode.DEADLINE_EXCEEDED:
        return IncompleteGenerationError(
            f"the stream broke after {tokens_received} tokens: {message}",
            code=code,
            tokens_received=tokens_received,
        )
    return _class_for(reason, code)(
        message, error_type=reason, code=code, tokens_received=tokens_received
    )


def _failure(error: grpc.RpcError) -> tuple[grpc.StatusCode | None, str, str | None]:
    """A failed call's status code, message, and ErrorInfo reason (None without one)."""
    code = _call_attribute(error, "code")
    message = _call_attribute(error, "details") or str(code.name if code else error)
    status = _status_details(_call_attribute(error, "trailing_metadata"))
    info = _error_info(status) if status is not None else None
    if status is not None and status.message:
        message = status.message
    return code, message, info.reason if info is not None else None


def from_stream_error(
    message: str, error_type: str | None, tokens_received: int | None = None
) -> TextGenError:
    """The typed exception for TGI's in-band stream error (`error`, `error_type`)."""
    cls = _class_for(error_type, None)
    return cls(message, error_type=error_type, tokens_received=tokens_received)


def from_event(event: Any, tokens_received: int | None = None) -> TextGenError | None:
    """The typed exception of an SSE error event, or None for any other event: TGI's
    `{"error": str, "error_type": str}`, OpenAI's `{"error": {"message": str, "type":
    str}}`, the Responses API's `{"type": "error", "code": str, "message": str}` (a
    response object's `"error": null` is no error)."""
    if not isinstance(event, dict):
        return None
    if event.get("type") == "error":
        return from_stream_error(str(event.get("message", "")), event.get("code"), tokens_received)
    error = event.get("error")
    if error is None:
        return None
    if isinstance(error, dict):
        message, error_type = str(error.get("message", error)), error.get("type")
    else:
        message, error_type = str(error), event.get("error_type")
    return from_stream_error(message, error_type, tokens_received)


def _call_attribute(error: grpc.RpcError, name: str) -> Any:
    """A `grpc.Call` accessor of the error, or None: a bare RpcError has none."""
    accessor = getattr(error, name, None)
    return accessor() if callable(accessor) else None
