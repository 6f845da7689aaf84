"""The error vocabulary: every `error_type` a face may answer, with its HTTP status and
gRPC code, in one table.

The server's statuses (grpc/errors.py), Envoy's Lua filter and local replies
(textgen.envoy), the OpenAPI description (scripts/make_openapi.py) are built from it;
the SDK's exception map (textgen.sdk.errors, which imports nothing of the server) and
the contract's comment (api/textgen/v1/generate.proto) are checked against it in tests.
"""

from __future__ import annotations

import enum
from typing import Self

import grpc


class ErrorType(str, enum.Enum):
    """TGI's error types (the first eight are the server's), and Envoy's own."""

    http_status: int
    grpc_code: grpc.StatusCode

    def __new__(cls, value: str, http_status: int, grpc_code: grpc.StatusCode) -> Self:
        member = str.__new__(cls, value)
        member._value_ = value
        member.http_status = http_status
        member.grpc_code = grpc_code
        return member

    # the server's
    VALIDATION = "validation", 422, grpc.StatusCode.INVALID_ARGUMENT
    OVERLOADED = "overloaded", 429, grpc.StatusCode.RESOURCE_EXHAUSTED
    GENERATION = "generation", 424, grpc.StatusCode.INTERNAL
    # a generation that failed after it had streamed tokens
    INCOMPLETE_GENERATION = "incomplete_generation", 500, grpc.StatusCode.ABORTED
    UNAUTHENTICATED = "unauthenticated", 401, grpc.StatusCode.UNAUTHENTICATED
    HEALTHCHECK = "healthcheck", 503, grpc.StatusCode.UNAVAILABLE  # the Health RPC's "no"
    UNAVAILABLE = "unavailable", 503, grpc.StatusCode.UNAVAILABLE  # draining, engine down
    # no such thing: a stored response the replica doesn't keep (and Envoy's unknown route)
    NOT_FOUND = "not_found", 404, grpc.StatusCode.NOT_FOUND
    # Envoy's own answers (local replies, or an upstream failure without our trailer)
    METHOD_NOT_ALLOWED = "method_not_allowed", 405, grpc.StatusCode.UNIMPLEMENTED
    TIMEOUT = "timeout", 504, grpc.StatusCode.DEADLINE_EXCEEDED
    UNIMPLEMENTED = "unimplemented", 501, grpc.StatusCode.UNIMPLEMENTED
    INTERNAL = "internal", 500, grpc.StatusCode.INTERNAL  # a failure nobody typed: a bug
    PROXY = "proxy", 502, grpc.StatusCode.UNAVAILABLE  # any other reply of Envoy's own

    def __str__(self) -> str:
        return self.value

    # equal to its string, and hashed as it: a member and "validation" are one dict key
    __hash__ = str.__hash__

    @property
    def in_contract(self) -> bool:
        """Part of the published contract (envoy/openapi.json); `unimplemented`,
        `internal` and `proxy` only ever mean a bug or a misconfiguration."""
        return self not in (ErrorType.UNIMPLEMENTED, ErrorType.INTERNAL, ErrorType.PROXY)


# What a gRPC failure that carries no error type (a crash, an unknown method, an
# upstream Envoy couldn't reach) is reported as; other codes are INTERNAL.
TYPE_BY_GRPC_CODE: dict[grpc.StatusCode, ErrorType] = {
    grpc.StatusCode.INVALID_ARGUMENT: ErrorType.VALIDATION,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorType.TIMEOUT,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorType.OVERLOADED,
    grpc.StatusCode.UNIMPLEMENTED: ErrorType.UNIMPLEMENTED,
    grpc.StatusCode.UNAVAILABLE: ErrorType.UNAVAILABLE,
    grpc.StatusCode.UNAUTHENTICATED: ErrorType.UNAUTHENTICATED,
}
FALLBACK_ERROR_TYPE = ErrorType.INTERNAL

# The types the server itself answers with (the rest are Envoy's).
SERVER_ERROR_TYPES = tuple(ErrorType)[:8]


def incomplete(error_type: ErrorType) -> ErrorType:
    """A generation error after tokens were sent is an incomplete generation (TGI)."""
    return ErrorType.INCOMPLETE_GENERATION if error_type is ErrorType.GENERATION else error_type


# Anthropic's Messages API (/v1/messages) answers every error in Anthropic's shape,
# `{"type": "error", "error": {"type", "message"}}`, with Anthropic's status and type
# for each error_type: a refused request is Anthropic's 400, the admission's refusal
# (which says when to come back: `retry-after`) its 429, a server that can take nothing
# now (draining, no replica ready) its 529, which Anthropic's clients retry.
ANTHROPIC_ERRORS: dict[ErrorType, tuple[int, str]] = {
    ErrorType.VALIDATION: (400, "invalid_request_error"),
    ErrorType.OVERLOADED: (429, "rate_limit_error"),
    ErrorType.GENERATION: (500, "api_error"),
    ErrorType.INCOMPLETE_GENERATION: (500, "api_error"),
    ErrorType.UNAUTHENTICATED: (401, "authentication_error"),
    ErrorType.HEALTHCHECK: (529, "overloaded_error"),
    ErrorType.UNAVAILABLE: (529, "overloaded_error"),
    ErrorType.NOT_FOUND: (404, "not_found_error"),
    ErrorType.METHOD_NOT_ALLOWED: (405, "invalid_request_error"),
    ErrorType.TIMEOUT: (504, "timeout_error"),
    ErrorType.UNIMPLEMENTED: (501, "api_error"),
    ErrorType.INTERNAL: (500, "api_error"),
    ErrorType.PROXY: (502, "api_error"),
}
# Envoy's payload limit (its own 413, typed `validation` on the other faces)
ANTHROPIC_TOO_LARGE = (413, "request_too_large")


def anthropic_error(message: str, error_type: ErrorType) -> dict:
    """Anthropic's error body for an error of `error_type`."""
    return {"type": "error", "error": {"type": ANTHROPIC_ERRORS[error_type][1], "message": message}}
