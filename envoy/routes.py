"""The HTTP routes of the TGI/OpenAI faces and native gRPC, with their timeouts."""

from __future__ import annotations

from dataclasses import dataclass

from .affinity import hash_policy
from .clusters import CLUSTER, resend_policy, retry_policy

# A generation route may be silent this long: the whole of a non-streamed answer,
# or the queue and prefill before a stream's first token. Streams reset it per token.
GENERATION_IDLE_TIMEOUT = "1800s"
# Metadata routes (info, health, tokenize, ...) answer fast.
QUICK_ROUTE_TIMEOUT = "15s"


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
    Route("POST", "/v1/responses", generation=True, streaming=True),
    # run-time LoRA management (vLLM's routes): a Hub download may outlast a quick route
    Route("POST", "/v1/load_lora_adapter", generation=True),
    Route("POST", "/v1/unload_lora_adapter"),
)


def route_config(front: bool = False) -> dict:
    routes = [_grpc_route(front), *(_http_route(r, front) for r in ROUTES)]
    # A known path with the wrong method: 405 (a local reply, typed in errors.py), not 404.
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
