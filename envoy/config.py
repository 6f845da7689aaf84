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

`render(..., front=True)` is the front proxy of several replicas (DESIGN.md §8,
`textgen proxy`): on top of the above, a retry before the first response byte onto
another replica, faster health checks, outlier detection and a retry budget. The
traps of retrying through a transcoder are commented at `_retry_policy`.
"""

from __future__ import annotations

import argparse
import base64
import ipaddress
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from textgen.sdk.keepalive import DEFAULT_KEEPALIVE, Keepalive

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

# Upstream concurrency bounds of the front proxy (Envoy's circuit breakers). Envoy's
# defaults (1024 requests, 3 concurrent retries) would answer 503 (overflow) or skip
# retries long before a few replicas are full: the replicas' own admission
# (--max-concurrent-requests -> 429 overloaded) is the real limit.
MAX_UPSTREAM_CONNECTIONS = 1024
MAX_UPSTREAM_REQUESTS = MAX_CONNECTIONS
MAX_PENDING_REQUESTS = 1024

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
    front: bool = False,
    keepalive: Keepalive = DEFAULT_KEEPALIVE,
) -> dict:
    """The Envoy bootstrap serving `upstreams` on `listen_host:listen_port`.

    Args:
        upstreams: gRPC replicas, load-balanced by least requests and health checked.
        listen_host: IP literal to listen on (HTTP/1.1, h2 and native gRPC).
        listen_port: the HTTP port.
        admin_port: Envoy's admin port on 127.0.0.1; 0 picks a free one (read it
            back with `envoy --admin-address-path`).
        descriptor: the contract's descriptor set; default: the packaged textgen.binpb.
        front: the front proxy of several replicas (`textgen proxy`): retries before
            the first byte onto another replica, outlier detection, health checks
            that drop a dead or draining replica within ~2 s. False: the Envoy of
            one replica (`textgen serve`), which has no other replica to retry on.
        keepalive: how Envoy pings the replicas on connections without data (the
            replicas must accept it: textgen.sdk.keepalive).
    """
    if not upstreams:
        raise ValueError("at least one upstream is needed")
    return {
        # Admin stays on loopback: it can stop the server and dump its config.
        "admin": {"address": _socket_address("127.0.0.1", admin_port)},
        "static_resources": {
            "listeners": [
                _listener(listen_host, listen_port, contract(descriptor or DESCRIPTOR), front)
            ],
            "clusters": [
                _front_cluster(upstreams, keepalive) if front else _cluster(upstreams, keepalive)
            ],
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


def _listener(host: str, port: int, api: Contract, front: bool = False) -> dict:
    return {
        "name": "textgen_http",
        "address": _socket_address(host, port),
        # Also the router's retry buffer: a request body is kept for a retry only up
        # to this (see _retry_policy).
        "per_connection_buffer_limit_bytes": STREAM_BUFFER_LIMIT,
        "filter_chains": [{"filters": [_http_connection_manager(api, front)]}],
    }


def _http_connection_manager(api: Contract, front: bool = False) -> dict:
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network."
            "http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "textgen_http",
            # AUTO: HTTP/1.1 (transcoded JSON, SSE) and h2 (native gRPC) on one port.
            "codec_type": "AUTO",
            "route_config": _route_config(front),
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


def _route_config(front: bool = False) -> dict:
    routes = [_grpc_route(front), *(_http_route(r, front) for r in ROUTES)]
    # A known path with the wrong method: 405 (a local reply, typed below), not 404.
    routes += [
        {"match": {"path": path}, "direct_response": {"status": 405}}
        for path in dict.fromkeys(r.path for r in ROUTES)
    ]
    virtual_host: dict = {"name": "textgen", "domains": ["*"], "routes": routes}
    if front:
        # `x-envoy-attempt-count: 2` on an answer says it was retried (tests, operators).
        virtual_host["include_attempt_count_in_response"] = True
    return {"name": "textgen", "virtual_hosts": [virtual_host]}


def _grpc_route(front: bool = False) -> dict:
    """Native gRPC (content-type application/grpc*) passes through untouched."""
    out = {
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
    out["route"]["retry_policy"] = _retry_policy(generation=True) if front else _resend_policy()
    return out


def _http_route(route: Route, front: bool = False) -> dict:
    action: dict = {"cluster": CLUSTER}
    if route.generation:
        # TRAP: a route's default timeout (15 s) covers a whole stream and cuts it.
        action["timeout"] = "0s"
        action["idle_timeout"] = GENERATION_IDLE_TIMEOUT
    else:
        action["timeout"] = QUICK_ROUTE_TIMEOUT
    action["retry_policy"] = (
        _retry_policy(generation=route.generation) if front else _resend_policy()
    )
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


def _cluster(
    upstreams: Sequence[Upstream], keepalive: Keepalive, health_check: dict | None = None
) -> dict:
    ips = all(u.is_ip for u in upstreams)
    cluster = {
        "name": CLUSTER,
        # IP literals need no resolver; a DNS name stands for all its addresses.
        "type": "STATIC" if ips else "STRICT_DNS",
        "lb_policy": "LEAST_REQUEST",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {
                    "http2_protocol_options": {
                        # finds a dead replica on a connection without data (a long
                        # unary generate, an idle pooled connection); the replica
                        # accepts these pings (textgen.sdk.keepalive)
                        "connection_keepalive": keepalive.envoy_connection_keepalive()
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
            health_check
            or {
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
    if not ips:
        # A Kubernetes headless service (or compose service) name: one host per
        # address, re-resolved every few seconds. A replica that leaves DNS (pod
        # deleted) stays until it fails its health check, so its streams finish.
        cluster["dns_refresh_rate"] = "5s"
        cluster["dns_lookup_family"] = "V4_PREFERRED"
    return cluster


# front proxy: several replicas --------------------------------------------------------

# Health checks of the front proxy (grpc.health.v1, service ""), every second. A
# draining replica answers NOT_SERVING, an explicit failure that Envoy acts on at
# once (threshold or not): out of the rotation at the next check, within 1 s. A dead
# one (kill -9: its port refuses) is a network failure, which counts against
# HEALTH_UNHEALTHY_THRESHOLD: out after two checks, 1-2 s (measured 1.6-1.9 s in
# tests/test_replicas.py). A replica merely busy must miss two whole
# HEALTH_CHECK_TIMEOUTs in a row to be dropped. What Envoy sends a dead or draining
# replica before then fails with connect-failure or UNAVAILABLE and is retried.
HEALTH_CHECK_INTERVAL = "1s"
HEALTH_CHECK_TIMEOUT = "2s"
HEALTH_UNHEALTHY_THRESHOLD = 2
# A replica that comes back (restarted, or SERVING again) takes two passes (~2 s);
# a host Envoy has just learnt of (start, DNS) needs only one.
HEALTH_HEALTHY_THRESHOLD = 2

# Retried (onto another replica) only while no byte of the response has gone out.
RETRY_ON = (
    "connect-failure",  # the replica's port refuses: dead, not yet out of the rotation
    "refused-stream",  # h2 REFUSED_STREAM / GOAWAY: a replica closing its connections
    "reset",  # the connection died before the response began (killed mid-prefill)
    "resource-exhausted",  # gRPC 8 = TGI's 429 `overloaded`: that replica is full
    "unavailable",  # gRPC 14: a draining replica refusing new work
)
# At most three replicas per request; previous_hosts keeps a retry off the replicas
# already tried. TRAP: the predicate only makes the balancer draw again, up to
# HOST_SELECTION_ATTEMPTS more times, after which Envoy takes its last draw, tried or
# not. And least-request favours the replica that just failed: a dead one has no
# stream left (0 active: it wins every power-of-two draw it is in, 3 in 4 with two
# replicas); a full one may look no busier than the rest (its load needn't come
# through this Envoy: 1 in 2). With 5 attempts, 0.75**6 = 18 % of the retries off a
# dead replica went back to it, and 0.18**2 = 3 % of the requests first sent there
# failed after all three tries (off a full one, 0.5**6 = 1.6 % went back and were
# refused again). With 100: 0.75**101 < 1e-12 per retry (three replicas, two tried:
# (8/9)**101 < 1e-5). A draw costs well under a microsecond; only retries repeat it.
NUM_RETRIES = 2
HOST_SELECTION_ATTEMPTS = 100
# A metadata call (info, tokenize, health) stuck this long on one replica is tried on
# another; generation routes have none (see _retry_policy).
QUICK_PER_TRY_TIMEOUT = "5s"
# Concurrent retries allowed, as a share of the requests in flight (at least
# MIN_RETRY_CONCURRENCY): when every replica is full, retries must not multiply the load.
RETRY_BUDGET_PERCENT = 25.0
MIN_RETRY_CONCURRENCY = 16


def _retry_policy(generation: bool) -> dict:
    """Resend a request that a replica refused, or could not take, to another one.

    TRAPS, measured on Envoy 1.40 (tests/test_replicas.py):
    - Envoy retries only until the response starts: once response headers are sent
      downstream, a failure is the client's. A replica that refuses (overloaded,
      draining) must answer trailers-only, before any initial metadata: the servicer
      aborts before it yields or sends metadata. A stream is never retried after
      its first frame.
    - The router sees the upstream gRPC answer *before* the transcoder turns it into
      HTTP: for a transcoded HTTP/1.1 request as for native gRPC, the refusal is an
      HTTP 200 whose grpc-status header says 8 or 14. So the gRPC conditions
      (`resource-exhausted`, `unavailable`) retry both faces, and
      `retriable-status-codes: [429, 503]` retries neither: the 429 only exists
      after the transcoder and the Lua filter, downstream of the router.
    - A request is resent from the router's copy of its body, which it keeps only up
      to the listener's per_connection_buffer_limit_bytes (16 MiB): past that the
      retry is silently abandoned (`retry_or_shadow_abandoned`). Every body we accept
      fits: 2 MB of JSON (buffer filter) or 4 MiB of gRPC (the server's limit).
    - `per_try_timeout` runs until the response *starts* (Envoy ignores it after).
      A unary Generate's response starts when the whole generation is done, and a
      stream's first token may wait in a long queue: a per-try timeout there would
      cut healthy work and run it again elsewhere. Generation routes have none.
    - Envoy's default circuit breaker allows only 3 concurrent retries for the whole
      cluster, so a burst of 429s would mostly reach clients: the retry budget in
      _front_cluster replaces it.
    """
    policy: dict = {
        "retry_on": ",".join(RETRY_ON),
        "num_retries": NUM_RETRIES,
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.retry.host."
                    "previous_hosts.v3.PreviousHostsPredicate"
                },
            }
        ],
        "host_selection_retry_max_attempts": HOST_SELECTION_ATTEMPTS,
        # a refusal is immediate: go to the next replica at once, not after 25 ms+
        "retry_back_off": {"base_interval": "0.005s", "max_interval": "0.05s"},
    }
    if not generation:
        policy["per_try_timeout"] = QUICK_PER_TRY_TIMEOUT
    return policy


# A replica that closes a connection (GOAWAY: it restarts, or drops a connection it
# finds abusive) refuses the streams it never started; a request caught that way, or
# by a connection that closed before the request went out, is sent again on a fresh
# connection instead of reaching the client as a 503. Nothing of it ran: safe to resend.
RESEND_ON = "refused-stream,reset-before-request"
RESEND_RETRIES = 2


def _resend_policy() -> dict:
    """The one replica's Envoy: resend only what the replica never started."""
    return {"retry_on": RESEND_ON, "num_retries": RESEND_RETRIES}


def _front_cluster(upstreams: Sequence[Upstream], keepalive: Keepalive) -> dict:
    cluster = _cluster(
        upstreams,
        keepalive,
        health_check={
            "timeout": HEALTH_CHECK_TIMEOUT,
            "interval": HEALTH_CHECK_INTERVAL,
            "no_traffic_interval": HEALTH_CHECK_INTERVAL,
            "unhealthy_threshold": HEALTH_UNHEALTHY_THRESHOLD,
            "healthy_threshold": HEALTH_HEALTHY_THRESHOLD,
            "grpc_health_check": {"service_name": ""},
        },
    )
    cluster["circuit_breakers"] = {
        "thresholds": [
            {
                "priority": "DEFAULT",
                "max_connections": MAX_UPSTREAM_CONNECTIONS,
                "max_pending_requests": MAX_PENDING_REQUESTS,
                "max_requests": MAX_UPSTREAM_REQUESTS,
                # replaces max_retries, whose default (3 for the whole cluster)
                # would let most of a burst of 429s through to clients
                "retry_budget": {
                    "budget_percent": {"value": RETRY_BUDGET_PERCENT},
                    "min_retry_concurrency": MIN_RETRY_CONCURRENCY,
                },
                "track_remaining": True,  # circuit_breakers.default.remaining_* in /stats
            }
        ]
    }
    # TRAP: Envoy hands health changes (a health-check transition, an outlier
    # ejection) to its worker threads at most once per update_merge_window, 1 s by
    # default: a change less than 1 s after the previous one is held back up to 1 s,
    # while admin's /clusters (the main thread's view) already shows it. A replica
    # shown healthy got no request for that long (16 streams all went to the other
    # one), and a dead or ejected one kept being picked. Merging is meant for clusters
    # of thousands of hosts; a few replicas need every change at once.
    cluster["common_lb_config"]["update_merge_window"] = "0s"
    cluster["outlier_detection"] = _outlier_detection()
    return cluster


def _outlier_detection() -> dict:
    """Eject a replica that keeps failing requests while its health checks pass.

    Envoy counts a gRPC answer by the HTTP status of its grpc-status: UNAVAILABLE
    503 and DEADLINE_EXCEEDED 504 are gateway errors, INTERNAL 500 a 5xx,
    RESOURCE_EXHAUSTED 429 neither: a full replica is not ejected (retries handle
    it; ejecting it would only shrink the cluster under load).
    """
    return {
        # Connection failures and resets (local origin) count apart from the
        # replica's answers: two in a row and the replica is gone for now.
        "split_external_local_origin_errors": True,
        "consecutive_local_origin_failure": 2,
        "enforcing_consecutive_local_origin_failure": 100,
        # 503/504 in a row: a draining replica (UNAVAILABLE) leaves before its health
        # check says so. Five, because clients' own deadlines end as 504 too.
        "consecutive_gateway_failure": 5,
        "enforcing_consecutive_gateway_failure": 100,
        # Any 5xx in a row (INTERNAL: a broken device, say).
        "consecutive_5xx": 10,
        "enforcing_consecutive_5xx": 100,
        # Success-rate ejection needs 5+ hosts with 100+ requests each: off.
        "enforcing_success_rate": 0,
        "enforcing_local_origin_success_rate": 0,
        "interval": "5s",  # ejections are lifted at these sweeps
        "base_ejection_time": "10s",
        "max_ejection_time": "120s",
        # At least one host is always ejectable; never more than half the cluster.
        "max_ejection_percent": 50,
        # TRAP: by default a passing health check lifts an ejection at once, and the
        # replicas this is for pass theirs.
        "successful_active_health_check_uneject_host": False,
    }


def main(argv: list[str] | None = None) -> None:
    """Print the bootstrap, e.g. for a compose file: python -m textgen.envoy.config."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="0.0.0.0:8080", help="HOST:PORT to serve HTTP on")
    parser.add_argument("--admin-port", type=int, default=9901)
    parser.add_argument("--descriptor", default=None, help="descriptor set (default: packaged)")
    parser.add_argument("--front", action="store_true", help="front proxy of several replicas")
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
        front=args.front,
    )
    print(json.dumps(config, indent=1))


if __name__ == "__main__":
    main()
