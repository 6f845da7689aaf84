"""Typed error answers of the HTTP faces: the Lua filter's status tables, Envoy's local replies."""

from __future__ import annotations

from .limits import REQUEST_BODY_LIMIT

# TGI's HTTP status of each error_type (the server's ErrorInfo reason and its
# `x-textgen-error-type` trailer, service/grpc/errors.py). The Lua filter is
# rendered from this table.
HTTP_STATUS_BY_ERROR_TYPE: dict[str, int] = {
    "validation": 422,
    "overloaded": 429,
    "generation": 424,
    "incomplete_generation": 500,
    "unauthenticated": 401,
    "healthcheck": 503,
    "unavailable": 503,
}
# gRPC failures without our trailer (a crash, an unimplemented RPC): (status, type).
FALLBACK_BY_GRPC_CODE: dict[int, tuple[int, str]] = {
    3: (422, "validation"),  # INVALID_ARGUMENT
    4: (504, "timeout"),  # DEADLINE_EXCEEDED
    8: (429, "overloaded"),  # RESOURCE_EXHAUSTED
    12: (501, "unimplemented"),  # UNIMPLEMENTED
    14: (503, "unavailable"),  # UNAVAILABLE
    16: (401, "unauthenticated"),  # UNAUTHENTICATED
}
FALLBACK_ERROR = (500, "internal")


# Envoy's own rejections -------------------------------------------------------------

# The Lua filter marks every HTTP request with its face before the transcoder runs:
# local-reply mappers can't use :path or content-type, which the transcoder has
# already rewritten to the gRPC method's when it rejects a body. Native gRPC
# requests carry no mark, so their local replies stay gRPC statuses.
FACE_HEADER = "x-textgen-face"

# (status Envoy chose, status sent, error_type, message; None: Envoy's own text)
_LOCAL_REPLIES: tuple[tuple[int, int, str, str | None], ...] = (
    # the transcoder's JSON parse errors: malformed JSON, a wrong field type
    (400, 422, "validation", None),
    (404, 404, "not_found", "Route not found: %REQ(:METHOD)% %REQ(:PATH)%"),
    (405, 405, "method_not_allowed", "Method %REQ(:METHOD)% not allowed on %REQ(:PATH)%"),
    (
        413,
        413,
        "validation",
        f"Payload too large: the request body is limited to {REQUEST_BODY_LIMIT} bytes",
    ),
    (503, 503, "unavailable", None),
    (504, 504, "timeout", None),
)


def local_reply_config() -> dict:
    """Typed JSON bodies for Envoy's local replies: TGI's shape, OpenAI's under /v1/."""
    # No healthy replica: /health answers as TGI does when the model is down.
    mappers = [
        {
            "filter": _and(_face("health"), _status(503)),
            "body_format_override": _error_body("unhealthy", "healthcheck", openai=False),
        }
    ]
    for envoy_status, status, error_type, message in _LOCAL_REPLIES:
        for openai in (True, False):  # the first mapper that matches wins
            mapper = {
                "filter": _and(_face("openai" if openai else None), _status(envoy_status)),
                "body_format_override": _error_body(
                    message or "%LOCAL_REPLY_BODY%", error_type, openai
                ),
            }
            if status != envoy_status:
                mapper["status_code"] = status
            mappers.append(mapper)
    # Anything else Envoy says on its own (a 500, a 408) is typed too.
    for openai in (True, False):
        mappers.append(
            {
                "filter": _and(_face("openai" if openai else None), _status(400, op="GE")),
                "body_format_override": _error_body("%LOCAL_REPLY_BODY%", "proxy", openai),
            }
        )
    return {"mappers": mappers}


def _error_body(message: str, error_type: str, openai: bool) -> dict:
    if openai:
        body = {"error": {"message": message, "type": error_type, "param": None, "code": None}}
    else:
        body = {"error": message, "error_type": error_type}
    return {"json_format": body, "content_type": "application/json"}


def _and(*filters: dict) -> dict:
    return {"and_filter": {"filters": list(filters)}}


def _face(face: str | None) -> dict:
    """Requests of that face; None: any HTTP request (not native gRPC)."""
    match = {"present_match": True} if face is None else {"string_match": {"exact": face}}
    return {"header_filter": {"header": {"name": FACE_HEADER, **match}}}


def _status(status: int, op: str = "EQ") -> dict:
    comparison = {"op": op, "value": {"default_value": status, "runtime_key": "_"}}
    return {"status_code_filter": {"comparison": comparison}}
