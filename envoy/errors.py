"""Typed error answers of the HTTP faces: the Lua filter's status tables, Envoy's local replies."""

from __future__ import annotations

from dataclasses import dataclass

from textgen.service.errors import (
    ANTHROPIC_ERRORS,
    ANTHROPIC_TOO_LARGE,
    FALLBACK_ERROR_TYPE,
    SERVER_ERROR_TYPES,
    TYPE_BY_GRPC_CODE,
    ErrorType,
)

from .limits import REQUEST_BODY_LIMIT
from .pools import MODEL_ERROR_HEADER, MODEL_NOT_FOUND

# All built from the error vocabulary (textgen.service.errors, the one module of the
# server's that envoy/ imports: it imports nothing else of textgen).

# TGI's HTTP status of each error_type (the server's ErrorInfo reason and its
# `x-textgen-error-type` trailer, service/grpc/errors.py). The Lua filter is
# rendered from this table.
HTTP_STATUS_BY_ERROR_TYPE: dict[str, int] = {t.value: t.http_status for t in SERVER_ERROR_TYPES}
# gRPC failures without our trailer (a crash, an unimplemented RPC): (status, type), by
# the code's number (grpc-status).
FALLBACK_BY_GRPC_CODE: dict[int, tuple[int, str]] = {
    code.value[0]: (t.http_status, t.value) for code, t in TYPE_BY_GRPC_CODE.items()
}
FALLBACK_ERROR = (FALLBACK_ERROR_TYPE.http_status, FALLBACK_ERROR_TYPE.value)
# Anthropic's status and type of each error_type, for the Messages API's face.
ANTHROPIC_BY_ERROR_TYPE: dict[str, tuple[int, str]] = {
    t.value: answer for t, answer in ANTHROPIC_ERRORS.items()
}


# Envoy's own rejections -------------------------------------------------------------

# The Lua filter marks every HTTP request with its face before the transcoder runs:
# local-reply mappers can't use :path or content-type, which the transcoder has
# already rewritten to the gRPC method's when it rejects a body. Native gRPC
# requests carry no mark, so their local replies stay gRPC statuses.
FACE_HEADER = "x-textgen-face"


@dataclass(frozen=True)
class LocalReply:
    """How one status Envoy answers on its own is typed."""

    envoy_status: int  # the status Envoy chose
    error_type: ErrorType
    message: str | None = None  # None: Envoy's own text
    status: int | None = None  # the status sent; None: the error type's


def _local_replies(payload_limit: int) -> tuple[LocalReply, ...]:
    return (
        # the transcoder's JSON parse errors: malformed JSON, a wrong field type
        LocalReply(400, ErrorType.VALIDATION),
        LocalReply(404, ErrorType.NOT_FOUND, "Route not found: %REQ(:METHOD)% %REQ(:PATH)%"),
        LocalReply(
            405, ErrorType.METHOD_NOT_ALLOWED, "Method %REQ(:METHOD)% not allowed on %REQ(:PATH)%"
        ),
        # TGI answers a body over its payload limit 413, not validation's 422
        LocalReply(
            413,
            ErrorType.VALIDATION,
            f"Payload too large: the request body is limited to {payload_limit} bytes",
            status=413,
        ),
        LocalReply(503, ErrorType.UNAVAILABLE),
        LocalReply(504, ErrorType.TIMEOUT),
    )


def local_reply_config(payload_limit: int = REQUEST_BODY_LIMIT) -> dict:
    """Typed JSON bodies for Envoy's local replies: TGI's shape, OpenAI's under /v1/,
    Anthropic's (and its statuses) under /v1/messages."""
    # No healthy replica: /health answers as TGI does when the model is down.
    mappers = [
        {
            "filter": _and(_face("health"), _status(503)),
            "body_format_override": _error_body("unhealthy", ErrorType.HEALTHCHECK, openai=False),
        }
    ]
    # A model no pool of the front proxy serves (the Lua filter's 404: pools.py): OpenAI's
    # code `model_not_found`, the refused field `model`; Anthropic's not_found_error.
    mappers.append(
        {
            "filter": _and(_face("anthropic"), _model_not_found(), _status(404)),
            "body_format_override": _anthropic_body("%LOCAL_REPLY_BODY%", ErrorType.NOT_FOUND),
        }
    )
    for openai in (True, False):
        mappers.append(
            {
                "filter": _and(
                    _face("openai" if openai else None), _model_not_found(), _status(404)
                ),
                "body_format_override": _error_body(
                    "%LOCAL_REPLY_BODY%", ErrorType.NOT_FOUND, openai, MODEL_NOT_FOUND
                ),
            }
        )
    for reply in _local_replies(payload_limit):
        mappers.append(_anthropic_mapper(reply))
        status = reply.status or reply.error_type.http_status
        for openai in (True, False):  # the first mapper that matches wins
            mapper = {
                "filter": _and(_face("openai" if openai else None), _status(reply.envoy_status)),
                "body_format_override": _error_body(
                    reply.message or "%LOCAL_REPLY_BODY%", reply.error_type, openai
                ),
            }
            if status != reply.envoy_status:
                mapper["status_code"] = status
            mappers.append(mapper)
    # Anything else Envoy says on its own (a 500, a 408) is typed too.
    mappers.append(
        {
            "filter": _and(_face("anthropic"), _status(400, op="GE")),
            "body_format_override": _anthropic_body("%LOCAL_REPLY_BODY%", ErrorType.PROXY),
        }
    )
    for openai in (True, False):
        mappers.append(
            {
                "filter": _and(_face("openai" if openai else None), _status(400, op="GE")),
                "body_format_override": _error_body("%LOCAL_REPLY_BODY%", ErrorType.PROXY, openai),
            }
        )
    return {"mappers": mappers}


def _anthropic_mapper(reply: LocalReply) -> dict:
    """A local reply on Anthropic's face: its status and type (the payload limit's 413 is
    Anthropic's request_too_large)."""
    status = ANTHROPIC_TOO_LARGE[0] if reply.envoy_status == 413 else None
    status = status or ANTHROPIC_ERRORS[reply.error_type][0]
    kind = ANTHROPIC_TOO_LARGE[1] if reply.envoy_status == 413 else None
    mapper = {
        "filter": _and(_face("anthropic"), _status(reply.envoy_status)),
        "body_format_override": _anthropic_body(
            reply.message or "%LOCAL_REPLY_BODY%", reply.error_type, kind
        ),
    }
    if status != reply.envoy_status:
        mapper["status_code"] = status
    return mapper


def _anthropic_body(message: str, error_type: ErrorType, kind: str | None = None) -> dict:
    body = {
        "type": "error",
        "error": {"type": kind or ANTHROPIC_ERRORS[error_type][1], "message": message},
    }
    return {"json_format": body, "content_type": "application/json"}


def _error_body(message: str, error_type: ErrorType, openai: bool, code: str | None = None) -> dict:
    name = error_type.value  # a plain str in the JSON
    if openai:
        param = "model" if code == MODEL_NOT_FOUND else None
        body = {"error": {"message": message, "type": name, "param": param, "code": code}}
    else:
        body = {"error": message, "error_type": name}
    return {"json_format": body, "content_type": "application/json"}


def _and(*filters: dict) -> dict:
    return {"and_filter": {"filters": list(filters)}}


def _face(face: str | None) -> dict:
    """Requests of that face; None: any HTTP request (not native gRPC)."""
    match = {"present_match": True} if face is None else {"string_match": {"exact": face}}
    return {"header_filter": {"header": {"name": FACE_HEADER, **match}}}


def _model_not_found() -> dict:
    header = {"name": MODEL_ERROR_HEADER, "string_match": {"exact": MODEL_NOT_FOUND}}
    return {"header_filter": {"header": header}}


def _status(status: int, op: str = "EQ") -> dict:
    comparison = {"op": op, "value": {"default_value": status, "runtime_key": "_"}}
    return {"status_code_filter": {"comparison": comparison}}
