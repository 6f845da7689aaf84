"""Typed errors -> gRPC status with a google.rpc.ErrorInfo whose reason is TGI's
error_type. One table, used by every servicer."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from ..observability.requests import current_error_type
from ..proto import generate_pb2

DOMAIN = "textgen"
# Trailing-metadata key carrying TGI's error_type, for Envoy's Lua filter: it writes
# the HTTP error body and status from it (google.rpc details are binary there).
ERROR_TYPE_KEY = "x-textgen-error-type"

STATUS_BY_ERROR_TYPE: dict[str, grpc.StatusCode] = {
    "validation": grpc.StatusCode.INVALID_ARGUMENT,
    "overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "generation": grpc.StatusCode.INTERNAL,
    "incomplete_generation": grpc.StatusCode.ABORTED,
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "healthcheck": grpc.StatusCode.UNAVAILABLE,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
}


def to_status(message: str, error_type: str) -> grpc.Status:
    code = STATUS_BY_ERROR_TYPE.get(error_type, grpc.StatusCode.INTERNAL)
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason=error_type, domain=DOMAIN))
    status = rpc_status.to_status(
        status_pb2.Status(code=code.value[0], message=message, details=[detail])
    )
    return _Status(status.code, status.details, (*status.trailing_metadata, (ERROR_TYPE_KEY, error_type)))


class _Status(grpc.Status):
    def __init__(self, code, details, trailing_metadata) -> None:
        self.code, self.details, self.trailing_metadata = code, details, trailing_metadata


async def abort(context: grpc.aio.ServicerContext, message: str, error_type: str):
    """End the RPC with the typed status (raises)."""
    current_error_type.set(error_type)  # for the request's metrics and log line
    await context.abort_with_status(to_status(message, error_type))


def in_band_error(message: str, error_type: str) -> generate_pb2.GenerateStreamResponse:
    """TGI's `{"error", "error_type"}` stream message, for failures after the first token."""
    return generate_pb2.GenerateStreamResponse(error=message, error_type=error_type)
