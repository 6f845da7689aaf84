"""Typed errors -> gRPC status with a google.rpc.ErrorInfo whose reason is TGI's
error_type, its code from the one vocabulary (service/errors.py). Used by every servicer."""

from __future__ import annotations

from urllib.parse import quote

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from ..errors import SERVER_ERROR_TYPES, ErrorType
from ..observability.requests import current_error_type
from ..proto import generate_pb2

DOMAIN = "textgen"
# Trailing-metadata key carrying TGI's error_type, for Envoy's Lua filter: it writes
# the HTTP error body and status from it (google.rpc details are binary there).
ERROR_TYPE_KEY = "x-textgen-error-type"
# The request field to blame, when one is (OpenAI's `param`): trailer and ErrorInfo metadata.
# The trailer is percent-encoded (as grpc-message is): a metadata value holds printable
# ASCII only, and a refused field's name is the client's own text.
ERROR_PARAM_KEY = "x-textgen-error-param"
# gRPC's retry pushback (its client retries after this many ms; Envoy's Lua filter turns
# it into HTTP's Retry-After)
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"

# The gRPC code of each error type the server sends (from the vocabulary).
STATUS_BY_ERROR_TYPE: dict[str, grpc.StatusCode] = {
    t.value: t.grpc_code for t in SERVER_ERROR_TYPES
}


def to_status(
    message: str,
    error_type: ErrorType,
    param: str | None = None,
    retry_after: float | None = None,
) -> grpc.Status:
    info = error_details_pb2.ErrorInfo(reason=error_type.value, domain=DOMAIN)
    trailers = [(ERROR_TYPE_KEY, error_type.value)]
    if retry_after is not None:
        trailers.append((RETRY_PUSHBACK_KEY, str(max(1, round(retry_after * 1000)))))
    if param:
        info.metadata["param"] = param
        trailers.append((ERROR_PARAM_KEY, quote(param, safe="")))
    detail = any_pb2.Any()
    detail.Pack(info)
    status = rpc_status.to_status(
        status_pb2.Status(code=error_type.grpc_code.value[0], message=message, details=[detail])
    )
    return _Status(status.code, status.details, (*status.trailing_metadata, *trailers))


class _Status(grpc.Status):
    def __init__(self, code, details, trailing_metadata) -> None:
        self.code, self.details, self.trailing_metadata = code, details, trailing_metadata


async def abort(
    context: grpc.aio.ServicerContext,
    message: str,
    error_type: ErrorType,
    param: str | None = None,
    retry_after: float | None = None,
):
    """End the RPC with the typed status (raises); `retry_after` (seconds): when to come
    back, for gRPC's retry pushback and HTTP's Retry-After."""
    current_error_type.set(error_type)  # for the request's metrics and log line
    await context.abort_with_status(to_status(message, error_type, param, retry_after))


def in_band_error(message: str, error_type: ErrorType) -> generate_pb2.GenerateStreamResponse:
    """TGI's `{"error", "error_type"}` stream message, for failures after the first token."""
    return generate_pb2.GenerateStreamResponse(error=message, error_type=error_type.value)
