"""Render Envoy's bootstrap for textgen's HTTP faces: TGI's and OpenAI's routes
transcoded from the gRPC contract, native gRPC passed through, on one port.

`render()` is pure: it returns the bootstrap as a dict; `write()` puts it in a file
(JSON, which Envoy reads by the `.json` extension). Reading order, as in Envoy's
own transcoder example: listener -> http_connection_manager -> lua (TGI error
bodies, the `POST /` switch; envoy/lua.py) -> buffer (TGI's 2 MB limit) ->
grpc_json_transcoder -> router -> HTTP/2 cluster with gRPC health checks.

Traps, measured on Envoy 1.40 (shared/envoy-facts.md) and commented where they bite:
- the transcoder rewrites :path to the gRPC path and routes are matched again on it,
  unless `match_incoming_request_route` (set: our routes name TGI's HTTP paths);
- a route's default timeout (15 s) covers a whole stream and cuts long generations;
- `content-type` in `response_headers_to_add` breaks transcoding (raw gRPC frames
  reach the client): the transcoder sets text/event-stream itself;
- route-level `response_headers_to_remove` runs in the router, *before* the
  transcoder reads grpc-status: leaked grpc-* headers are removed by the Lua filter;
- Envoy refuses the whole descriptor set if an HttpRule has `response_body` on a
  non-HttpBody message ("not supported yet"): contract.py strips it and the Lua
  filter unwraps the field instead, so the contract's annotation still holds.
"""

from __future__ import annotations

import argparse
import base64
import ipaddress
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .contract import DESCRIPTOR, Contract, contract
from .lua import lua_source

SERVICE = "textgen.v1.TextGenerationService"
CLUSTER = "textgen_grpc"

# TGI's --payload-limit default: larger JSON bodies are refused with 413.
REQUEST_BODY_LIMIT = 2_000_000
# A unary answer is buffered whole to transcode it (and the Lua filter buffers the
# non-streamed `POST /` answer to wrap it in [ ]). The server sends at most 4 MiB of
# protobuf; its JSON (details, top_tokens) can be a few times larger.
RESPONSE_BODY_LIMIT = 16 * 1024 * 1024
# Per-stream buffer: must hold the largest body a filter buffers (see above).
STREAM_BUFFER_LIMIT = RESPONSE_BODY_LIMIT

# Open client connections; each holds at most one stream's buffers at a time.
MAX_CONNECTIONS = 10_000

# A generation route may be silent this long: the whole of a non-streamed answer,
# or the queue and prefill before a stream's first token. Streams reset it per token.
GENERATION_IDLE_TIMEOUT = "1800s"
# Metadata routes (info, health, tokenize, ...) answer fast.
QUICK_ROUTE_TIMEOUT = "15s"

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


@dataclass(frozen=True)
class Upstream:
    """One gRPC endpoint: an IP literal, or a DNS name whose every address is a
    replica (e.g. a Kubernetes headless service)."""

    host: str
    port: int

    @property
    def is_ip(self) -> bool:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return False
        return True


@dataclass(frozen=True)
class Route:
    """One HTTP route of the TGI/OpenAI faces."""

    method: str
    path: str
    generation: bool = False  # long-running: no whole-request timeout
    streaming: bool = False  # SSE: tell buffering proxies and caches to stay away


# Every HTTP path the faces serve. `POST /` is TGI's compat route: the Lua filter
# rewrites it to /generate or /generate_stream after reading `stream` in the body.
ROUTES: tuple[Route, ...] = (
    Route("POST", "/generate", generation=True),
    Route("POST", "/generate_stream", generation=True, streaming=True),
    Route("POST", "/", generation=True),
    Route("GET", "/info"),
    Route("POST", "/tokenize"),
    Route("GET", "/health"),
    Route("GET", "/metrics"),
    Route("GET", "/v1/models"),
    # OpenAI's routes stream or not depending on the body: both get the stream headers.
    Route("POST", "/v1/chat/completions", generation=True, streaming=True),
    Route("POST", "/v1/completions", generation=True, streaming=True),
)


def render(
    upstreams: Sequence[Upstream],
    *,
    listen_host: str = "127.0.0.1",
    listen_port: int = 8080,
    admin_port: int = 0,
    descriptor: Path | str | None = None,
) -> dict:
    """The Envoy bootstrap serving `upstreams` on `listen_host:listen_port`.

    Args:
        upstreams: gRPC replicas, load-balanced by least requests and health checked.
        listen_host: IP literal to listen on (HTTP/1.1, h2 and native gRPC).
        listen_port: the HTTP port.
        admin_port: Envoy's admin port on 127.0.0.1; 0 picks a free one (read it
            back with `envoy --admin-address-path`).
        descriptor: the contract's descriptor set; default: the packaged textgen.binpb.
    """
    if not upstreams:
        raise ValueError("at least one upstream is needed")
    return {
        # Admin stays on loopback: it can stop the server and dump its config.
        "admin": {"address": _socket_address("127.0.0.1", admin_port)},
        "static_resources": {
            "listeners": [_listener(listen_host, listen_port, contract(descriptor or DESCRIPTOR))],
            "clusters": [_cluster(upstreams)],
        },
        "overload_manager": _overload_manager(),
    }


def _overload_manager() -> dict:
    """A bound on open client connections (Envoy warns at start without one)."""
    return {
        "resource_monitors": [
            {
                "name": "envoy.resource_monitors.global_downstream_max_connections",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.resource_monitors."
                    "downstream_connections.v3.DownstreamConnectionsConfig",
                    "max_active_downstream_connections": MAX_CONNECTIONS,
                },
            }
        ]
    }


def write(config: dict, path: Path | str) -> Path:
    """Write `config` as JSON; the file name should end in .json."""
    path = Path(path)
    path.write_text(json.dumps(config, indent=1))
    return path


# listener ---------------------------------------------------------------------------


def _socket_address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _listener(host: str, port: int, api: Contract) -> dict:
    return {
        "name": "textgen_http",
        "address": _socket_address(host, port),
        "per_connection_buffer_limit_bytes": STREAM_BUFFER_LIMIT,
        "filter_chains": [{"filters": [_http_connection_manager(api)]}],
    }


def _http_connection_manager(api: Contract) -> dict:
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network."
            "http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "textgen_http",
            # AUTO: HTTP/1.1 (transcoded JSON, SSE) and h2 (native gRPC) on one port.
            "codec_type": "AUTO",
            "route_config": _route_config(),
            "local_reply_config": _local_reply_config(),
            # Order matters: decoding runs top-down, encoding bottom-up, so the Lua
            # filter sees requests before the transcoder and responses after it,
            # and marks the request before the body limit can reject it.
            "http_filters": [_lua_filter(api), _body_limit(), _transcoder(api), _router()],
        },
    }


def _lua_filter(api: Contract) -> dict:
    return {
        "name": "envoy.filters.http.lua",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {
                "inline_string": lua_source(
                    HTTP_STATUS_BY_ERROR_TYPE,
                    FALLBACK_BY_GRPC_CODE,
                    FALLBACK_ERROR,
                    api.unwrap,
                    FACE_HEADER,
                )
            },
        },
    }


def _body_limit() -> dict:
    """TGI's payload limit on HTTP requests (off for native gRPC, see _grpc_route).

    TRAP: the transcoder's max_request_body_size alone does not bound a JSON body
    it converts as it streams in; the buffer filter holds the whole request (the
    transcoder needs all of it for the one gRPC message anyway) and answers 413.
    """
    return {
        "name": "envoy.filters.http.buffer",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
            "max_request_bytes": REQUEST_BODY_LIMIT,
        },
    }


def _transcoder(api: Contract) -> dict:
    return {
        "name": "envoy.filters.http.grpc_json_transcoder",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http."
            "grpc_json_transcoder.v3.GrpcJsonTranscoder",
            # inline: the file is self-contained, and carries the stripped rules
            "proto_descriptor_bin": base64.b64encode(api.descriptor_set).decode(),
            "services": [SERVICE],
            "print_options": {
                "preserve_proto_field_names": True,  # TGI's snake_case
                "always_print_primitive_fields": True,  # `"special": false`, `0` counts
                "stream_sse_style_delimited": True,  # `data: {...}\n\n` per message
            },
            # TRAP: without it routes are matched again on the rewritten gRPC path
            # (/textgen.v1.TextGenerationService/Generate), not on /generate.
            "match_incoming_request_route": True,
            # An unknown query parameter otherwise makes the transcoder pass the request
            # through untranscoded, and the client gets a 503.
            "ignore_unknown_query_parameters": True,
            "max_request_body_size": REQUEST_BODY_LIMIT,
            "max_response_body_size": RESPONSE_BODY_LIMIT,
        },
    }


def _router() -> dict:
    return {
        "name": "envoy.filters.http.router",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
        },
    }


# routes -----------------------------------------------------------------------------


def _route_config() -> dict:
    routes = [_grpc_route(), *(_http_route(r) for r in ROUTES)]
    # A known path with the wrong method: 405 (a local reply, typed below), not 404.
    routes += [
        {"match": {"path": path}, "direct_response": {"status": 405}}
        for path in dict.fromkeys(r.path for r in ROUTES)
    ]
    return {
        "name": "textgen",
        "virtual_hosts": [{"name": "textgen", "domains": ["*"], "routes": routes}],
    }


def _grpc_route() -> dict:
    """Native gRPC (content-type application/grpc*) passes through untouched."""
    return {
        "match": {"prefix": "/", "grpc": {}},
        # the server's own message limit (4 MiB) applies, not TGI's HTTP one
        "typed_per_filter_config": {
            "envoy.filters.http.buffer": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.BufferPerRoute",
                "disabled": True,
            }
        },
        "route": {
            "cluster": CLUSTER,
            # TRAP: the 15 s default would cut long streams; the client's
            # grpc-timeout header is the deadline instead.
            "timeout": "0s",
            "max_stream_duration": {"grpc_timeout_header_max": "0s"},
            "idle_timeout": GENERATION_IDLE_TIMEOUT,
        },
    }


def _http_route(route: Route) -> dict:
    action: dict = {"cluster": CLUSTER}
    if route.generation:
        # TRAP: a route's default timeout (15 s) covers a whole stream and cuts it.
        action["timeout"] = "0s"
        action["idle_timeout"] = GENERATION_IDLE_TIMEOUT
    else:
        action["timeout"] = QUICK_ROUTE_TIMEOUT
    out = {
        "match": {
            "path": route.path,
            "headers": [{"name": ":method", "string_match": {"exact": route.method}}],
        },
        "route": action,
    }
    if route.streaming:
        # TRAP: never content-type here: it breaks transcoding (raw gRPC frames reach
        # the client). The transcoder sets text/event-stream itself.
        out["response_headers_to_add"] = [
            _header("x-accel-buffering", "no"),
            _header("cache-control", "no-cache"),
        ]
    return out


def _header(name: str, value: str) -> dict:
    return {"header": {"key": name, "value": value}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}


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


def _local_reply_config() -> dict:
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


# cluster ----------------------------------------------------------------------------


def _cluster(upstreams: Sequence[Upstream]) -> dict:
    return {
        "name": CLUSTER,
        # IP literals need no resolver; a DNS name stands for all its addresses.
        "type": "STATIC" if all(u.is_ip for u in upstreams) else "STRICT_DNS",
        "lb_policy": "LEAST_REQUEST",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {
                    "http2_protocol_options": {
                        # finds a dead replica on an idle connection (a long unary generate)
                        "connection_keepalive": {"interval": "30s", "timeout": "10s"}
                    }
                },
            }
        },
        "load_assignment": {
            "cluster_name": CLUSTER,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": _socket_address(u.host, u.port)}}
                        for u in upstreams
                    ]
                }
            ],
        },
        # grpc.health.v1 on the server: NOT_SERVING (draining) takes a replica out.
        "health_checks": [
            {
                # Tolerant of a replica whose event loop is busy for a few seconds (a
                # huge prompt): with one replica an ejection means 503s for everyone.
                "timeout": "5s",
                "interval": "2s",
                # Envoy checks idle clusters only every 60 s unless told otherwise.
                "no_traffic_interval": "2s",
                "unhealthy_threshold": 3,
                "healthy_threshold": 1,
                "grpc_health_check": {"service_name": ""},
            }
        ],
        # Without this, a cluster whose hosts all fail health checks still routes to
        # them ("panic mode"); we'd rather answer 503 at once.
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
    }


def main(argv: list[str] | None = None) -> None:
    """Print the bootstrap, e.g. for a compose file: python -m textgen.envoy.config."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="0.0.0.0:8080", help="HOST:PORT to serve HTTP on")
    parser.add_argument("--admin-port", type=int, default=9901)
    parser.add_argument("--descriptor", default=None, help="descriptor set (default: packaged)")
    parser.add_argument("upstreams", nargs="+", help="gRPC replicas as HOST:PORT")
    args = parser.parse_args(argv)
    host, port = args.listen.rsplit(":", 1)
    upstreams = [Upstream(h, int(p)) for h, p in (u.rsplit(":", 1) for u in args.upstreams)]
    config = render(
        upstreams,
        listen_host=host,
        listen_port=int(port),
        admin_port=args.admin_port,
        descriptor=args.descriptor,
    )
    print(json.dumps(config, indent=1))


if __name__ == "__main__":
    main()
