"""The HTTP routes of the TGI/OpenAI faces and native gRPC, with their timeouts, and
the documents Envoy serves itself (docs.py)."""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass

from .affinity import REPLICA_HEADER, hash_policy
from .clusters import CLUSTER, resend_policy, retry_policy
from .docs import DIRECT_RESPONSE_LIMIT, SwaggerUI, direct_get, doc_routes
from .pools import POOL_HEADER, Pool, cluster_name, models_body

# A generation route may be silent this long: the whole of a non-streamed answer,
# or the queue and prefill before a stream's first token. Streams reset it per token.
GENERATION_IDLE_TIMEOUT = "1800s"
# Metadata routes (info, health, tokenize, ...) answer fast.
QUICK_ROUTE_TIMEOUT = "15s"


@dataclass(frozen=True)
class Route:
    """One HTTP route of the TGI/OpenAI faces."""

    method: str
    path: str  # as the contract's HttpRule and envoy/openapi.json write it: {param} a segment
    generation: bool = False  # long-running: no whole-request timeout
    streaming: bool = False  # SSE: tell buffering proxies and caches to stay away

    @property
    def path_match(self) -> dict:
        """Envoy's route match of the path: exact, or a regex for a templated one."""
        if "{" not in self.path:
            return {"path": self.path}
        pattern = re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(self.path))
        return {"safe_regex": {"regex": pattern}}


# Every HTTP path the faces serve. `POST /` is TGI's compat route: the Lua filter
# rewrites it to /generate or /generate_stream after reading `stream` in the body;
# SageMaker's `GET /ping` and `POST /invocations` are rewritten by it too.
ROUTES: tuple[Route, ...] = (
    Route("POST", "/generate", generation=True),
    Route("POST", "/generate_stream", generation=True, streaming=True),
    Route("POST", "/", generation=True),
    Route("GET", "/info"),
    Route("POST", "/tokenize"),
    Route("POST", "/detokenize"),
    Route("GET", "/version"),
    Route("GET", "/health"),
    Route("GET", "/metrics"),
    # SageMaker's (TGI's router serves both): the Lua filter rewrites /ping to /health, and
    # /invocations to / (TGI's body), /v1/chat/completions or /v1/completions (OpenAI's)
    Route("GET", "/ping"),
    Route("POST", "/invocations", generation=True, streaming=True),
    Route("GET", "/v1/models"),
    # OpenAI's routes stream or not depending on the body: both get the stream headers.
    Route("POST", "/v1/chat/completions", generation=True, streaming=True),
    Route("POST", "/v1/completions", generation=True, streaming=True),
    Route("POST", "/v1/responses", generation=True, streaming=True),
    # Anthropic's Messages API (its errors in Anthropic's shape: lua.py)
    Route("POST", "/v1/messages", generation=True, streaming=True),
    Route("POST", "/v1/messages/count_tokens"),
    # the store of the replica that made the response (the front proxy routes there by
    # the id: affinity.py)
    Route("GET", "/v1/responses/{response_id}"),
    Route("DELETE", "/v1/responses/{response_id}"),
    Route("GET", "/v1/responses/{response_id}/input_items"),
    # run-time LoRA management (vLLM's routes): a Hub download may outlast a quick route
    Route("POST", "/v1/load_lora_adapter", generation=True),
    Route("POST", "/v1/unload_lora_adapter"),
)


def route_config(
    front: bool = False,
    swagger_ui: SwaggerUI | None = None,
    cors_origins: Sequence[dict] = (),
    pools: Sequence[Pool] = (),
) -> dict:
    """The routes; `swagger_ui`: the Swagger UI assets /docs serves (None: no /docs);
    `cors_origins`: string matchers of the origins whose CORS preflights are answered
    (by the CORS filter, config.py); `pools`: the front proxy's pools of several models
    (pools.py; empty: one cluster)."""
    routes = [_grpc_route(front), *(_http_route(r, front) for r in ROUTES)]
    if pools:
        routes = _pool_routes(routes, pools)
    routes[1:1] = [_preflight_route(origin) for origin in cors_origins]
    routes += doc_routes(swagger_ui)
    # A known path with the wrong method: 405 (a local reply, typed in errors.py), not 404.
    routes += [
        {"match": r.path_match, "direct_response": {"status": 405}}
        for r in {r.path: r for r in ROUTES}.values()
    ]
    virtual_host: dict = {
        "name": "textgen",
        "domains": ["*"],
        "routes": routes,
        # only the front proxy names the replica it reached (clusters.py), never a client
        "request_headers_to_remove": [REPLICA_HEADER],
    }
    if front:
        # `x-envoy-attempt-count: 2` on an answer says it was retried (tests, operators).
        virtual_host["include_attempt_count_in_response"] = True
    return {
        "name": "textgen",
        "virtual_hosts": [virtual_host],
        # the OpenAPI document and Swagger UI's script are direct responses (docs.py)
        "max_direct_response_body_size_bytes": DIRECT_RESPONSE_LIMIT,
    }


def _pool_routes(routes: list[dict], pools: Sequence[Pool]) -> list[dict]:
    """Each route once per pool after the first, matched on the pool's index (POOL_HEADER,
    set by the Lua filter), then as it was: the first pool's, and that of requests naming
    no model. `GET /v1/models` lists every pool's models itself (Envoy can't merge answers)."""
    out = []
    for route in routes:
        if route["match"].get("path") == "/v1/models":
            out.append(direct_get({"path": "/v1/models"}, "application/json", models_body(pools)))
            continue
        for index in range(1, len(pools)):
            variant = copy.deepcopy(route)
            variant["match"].setdefault("headers", []).append(
                {"name": POOL_HEADER, "string_match": {"exact": str(index)}}
            )
            variant["route"]["cluster"] = cluster_name(index)
            out.append(variant)
        out.append(route)
    return out


def _grpc_route(front: bool = False) -> dict:
    """Native gRPC (content-type application/grpc*) passes through untouched."""
    out = {
        "match": {"prefix": "/", "grpc": {}},
        # the server's own message limit (4 MiB) applies, not TGI's HTTP one
        "typed_per_filter_config": {
            "envoy.filters.http.buffer": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http."
                "buffer.v3.BufferPerRoute",
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
    out["route"]["retry_policy"] = retry_policy(generation=True) if front else resend_policy()
    if front:
        out["route"]["hash_policy"] = hash_policy()
    return out


def _preflight_route(origin: dict) -> dict:
    """A browser's CORS preflight (OPTIONS with Access-Control-Request-Method) from an
    allowed origin, on any path. TRAP: Envoy's CORS filter answers only on a route that
    forwards: on a direct response (the 405 routes below) it lets the 405 through. The
    filter answers these preflights itself (their origin is allowed), so none reaches the
    cluster; other origins' get the 405, without CORS headers."""
    return {
        "match": {
            "prefix": "/",
            "headers": [
                {"name": ":method", "string_match": {"exact": "OPTIONS"}},
                {"name": "origin", "string_match": origin},
                {"name": "access-control-request-method", "present_match": True},
            ],
        },
        "route": {"cluster": CLUSTER, "timeout": QUICK_ROUTE_TIMEOUT},
    }


def _http_route(route: Route, front: bool = False) -> dict:
    action: dict = {"cluster": CLUSTER}
    if route.generation:
        # TRAP: a route's default timeout (15 s) covers a whole stream and cuts it.
        action["timeout"] = "0s"
        action["idle_timeout"] = GENERATION_IDLE_TIMEOUT
    else:
        action["timeout"] = QUICK_ROUTE_TIMEOUT
    action["retry_policy"] = retry_policy(generation=route.generation) if front else resend_policy()
    if front and route.generation:
        action["hash_policy"] = hash_policy()
    out = {
        "match": {
            **route.path_match,
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
