"""Render Envoy's bootstrap for textgen's HTTP faces: TGI's and OpenAI's routes
transcoded from the gRPC contract, native gRPC passed through, on one port.

`render()` is pure: it returns the bootstrap as a dict; `write()` puts it in a file
(JSON, which Envoy reads by the `.json` extension). Reading order, as in Envoy's
own transcoder example: listener -> http_connection_manager -> lua (TGI error
bodies, the `POST /` switch, TGI bodies' unknown fields; envoy/lua.py) -> buffer (TGI's
2 MB limit) -> grpc_json_transcoder -> router -> HTTP/2 cluster with gRPC health checks.

Traps, measured on Envoy 1.40 and commented where they bite:
- the transcoder rewrites :path to the gRPC path and routes are matched again on it,
  unless `match_incoming_request_route` (set: our routes name TGI's HTTP paths);
- a route's default timeout (15 s) covers a whole stream and cuts long generations;
- `content-type` in `response_headers_to_add` breaks transcoding (raw gRPC frames
  reach the client): the transcoder sets text/event-stream itself;
- route-level `response_headers_to_remove` runs in the router, *before* the
  transcoder reads grpc-status: leaked grpc-* headers are removed by the Lua filter;
- Envoy refuses the whole descriptor set if an HttpRule has `response_body` on a
  non-HttpBody message ("not supported yet"): contract.py refuses one at render time.

`render(..., front=True)` is the front proxy of several replicas (`textgen proxy`,
README "Several replicas"): on top of the above, prefix affinity (a routing key hashed onto a
ring of replicas with a bounded load: affinity.py), a retry before the first response
byte onto another replica, faster health checks, outlier detection and a retry budget.
The traps of retrying through a transcoder are commented at `clusters.retry_policy`.

The OpenAPI document (/api-doc/openapi.json) and Swagger UI (/docs) are Envoy's own
direct responses (docs.py).

Modules: routes.py (the routes, their timeouts), docs.py, clusters.py (the replicas' cluster;
the front proxy's retries, outlier detection, circuit breakers), errors.py (the Lua
filter's status tables, Envoy's local replies), limits.py (body and connection
bounds), lua.py, contract.py; cli.py prints a bootstrap.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from textgen.sdk.keepalive import DEFAULT_KEEPALIVE, Keepalive

from .affinity import affinity_filter
from .clusters import Upstream, front_cluster, replica_cluster, socket_address
from .contract import DESCRIPTOR, Contract, contract, tgi_body_fields
from .docs import SwaggerUI
from .errors import (
    ANTHROPIC_BY_ERROR_TYPE,
    FACE_HEADER,
    FALLBACK_BY_GRPC_CODE,
    FALLBACK_ERROR,
    HTTP_STATUS_BY_ERROR_TYPE,
    local_reply_config,
)
from .limits import MAX_CONNECTIONS, REQUEST_BODY_LIMIT, RESPONSE_BODY_LIMIT, STREAM_BUFFER_LIMIT
from .lua import lua_source, with_body_fields, with_pools
from .pools import ModelCard, Pool, cluster_name, pool_lua
from .routes import QUICK_ROUTE_TIMEOUT, ROUTES, route_config

# What other code imports from here (service/, deploy/, tests/); most are defined in
# the modules named above.
__all__ = [
    "DEFAULT_HTTP",
    "FALLBACK_BY_GRPC_CODE",
    "FALLBACK_ERROR",
    "HTTP_STATUS_BY_ERROR_TYPE",
    "QUICK_ROUTE_TIMEOUT",
    "ROUTES",
    "SERVICE",
    "HttpOptions",
    "ModelCard",
    "Pool",
    "Upstream",
    "render",
    "write",
]

SERVICE = "textgen.v1.TextGenerationService"
# What browsers may send cross-origin (TGI's CORS layer allows GET and POST with a
# content-type; the API key's headers, Anthropic's version headers and the stored
# responses' DELETE are textgen's).
CORS_METHODS = "GET, POST, DELETE"
CORS_HEADERS = "content-type, authorization, x-api-key, anthropic-version, anthropic-beta"


@dataclass(frozen=True)
class HttpOptions:
    """What an operator sets on the HTTP face (TGI's --payload-limit, --cors-allow-origin)."""

    payload_limit: int = REQUEST_BODY_LIMIT  # bytes of request body; larger: 413
    cors_allow_origin: tuple[str, ...] = ()  # origins answered with CORS headers; "*": any


DEFAULT_HTTP = HttpOptions()  # TGI's defaults: a 2 MB body, no CORS


def render(
    upstreams: Sequence[Upstream],
    *,
    listen_host: str = "127.0.0.1",
    listen_port: int = 8080,
    admin_port: int = 0,
    descriptor: Path | str | None = None,
    front: bool = False,
    keepalive: Keepalive = DEFAULT_KEEPALIVE,
    swagger_ui: SwaggerUI | None = None,
    http: HttpOptions = HttpOptions(),
    pools: Sequence[Pool] = (),
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
        swagger_ui: Swagger UI's files for /docs (docs.installed_swagger_ui(); None:
            no /docs). /api-doc/openapi.json is always served.
        http: the payload limit and the CORS origins.
        pools: several models (front only, pools.py): one cluster per pool, chosen by
            the request's model, in place of `upstreams` (then ignored).
    """
    if not upstreams and not pools:
        raise ValueError("at least one upstream is needed")
    if pools and not front:
        raise ValueError("pools of several models are the front proxy's")
    if pools:
        clusters = [
            front_cluster(p.upstreams, keepalive, cluster_name(i)) for i, p in enumerate(pools)
        ]
    elif front:
        clusters = [front_cluster(upstreams, keepalive)]
    else:
        clusters = [replica_cluster(upstreams, keepalive)]
    return {
        # Admin stays on loopback: it can stop the server and dump its config.
        "admin": {"address": socket_address("127.0.0.1", admin_port)},
        "static_resources": {
            "listeners": [
                _listener(
                    listen_host,
                    listen_port,
                    contract(descriptor or DESCRIPTOR),
                    front,
                    swagger_ui,
                    http,
                    pools,
                )
            ],
            "clusters": clusters,
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


def _listener(
    host: str,
    port: int,
    api: Contract,
    front: bool = False,
    swagger_ui: SwaggerUI | None = None,
    http: HttpOptions = HttpOptions(),
    pools: Sequence[Pool] = (),
) -> dict:
    return {
        "name": "textgen_http",
        "address": socket_address(host, port),
        # Also the router's retry buffer: a request body is kept for a retry only up
        # to this (see clusters.retry_policy).
        "per_connection_buffer_limit_bytes": STREAM_BUFFER_LIMIT,
        "filter_chains": [
            {"filters": [_http_connection_manager(api, front, swagger_ui, http, pools)]}
        ],
    }


def _http_connection_manager(
    api: Contract,
    front: bool = False,
    swagger_ui: SwaggerUI | None = None,
    http: HttpOptions = HttpOptions(),
    pools: Sequence[Pool] = (),
) -> dict:
    origins = _origin_matchers(http.cors_allow_origin)
    routes = route_config(front, swagger_ui, origins, pools)
    if origins:
        routes["virtual_hosts"][0]["typed_per_filter_config"] = {
            "envoy.filters.http.cors": _cors_policy(origins)
        }
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network."
            "http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "textgen_http",
            # AUTO: HTTP/1.1 (transcoded JSON, SSE) and h2 (native gRPC) on one port.
            "codec_type": "AUTO",
            "route_config": routes,
            "local_reply_config": local_reply_config(http.payload_limit),
            # Order matters: decoding runs top-down, encoding bottom-up, so the Lua
            # filter sees requests before the transcoder and responses after it,
            # and marks the request before the body limit can reject it. CORS comes
            # first: it answers a preflight itself and adds its headers to every answer.
            "http_filters": [
                *([_cors_filter()] if http.cors_allow_origin else []),
                _lua_filter(api, pools),
                _body_limit(http.payload_limit),
                _transcoder(api, http.payload_limit),
                # the front's routing key, read from the transcoded (gRPC) request
                *([affinity_filter(pool_lua(pools), FACE_HEADER)] if front else []),
                _router(),
            ],
        },
    }


def _lua_filter(api: Contract, pools: Sequence[Pool] = ()) -> dict:
    return {
        "name": "envoy.filters.http.lua",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {
                "inline_string": with_pools(
                    with_body_fields(
                        lua_source(
                            HTTP_STATUS_BY_ERROR_TYPE,
                            FALLBACK_BY_GRPC_CODE,
                            FALLBACK_ERROR,
                            FACE_HEADER,
                            ANTHROPIC_BY_ERROR_TYPE,
                        ),
                        tgi_body_fields(api),
                    ),
                    pools,
                )
            },
        },
    }


def _cors_filter() -> dict:
    return {
        "name": "envoy.filters.http.cors",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors"},
    }


def _origin_matchers(origins: Sequence[str]) -> list[dict]:
    """TGI's CORS layer (--cors-allow-origin): the listed origins, or any for `*`."""
    if "*" in origins:
        return [{"safe_regex": {"regex": ".+"}}]
    return [{"exact": origin} for origin in origins]


def _cors_policy(matchers: list[dict]) -> dict:
    return {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.cors.v3.CorsPolicy",
        "allow_origin_string_match": matchers,
        "allow_methods": CORS_METHODS,
        "allow_headers": CORS_HEADERS,
        "max_age": "3600",
    }


def _body_limit(payload_limit: int = REQUEST_BODY_LIMIT) -> dict:
    """TGI's payload limit on HTTP requests (off for native gRPC, see routes._grpc_route).

    TRAP: the transcoder's max_request_body_size alone does not bound a JSON body
    it converts as it streams in; the buffer filter holds the whole request (the
    transcoder needs all of it for the one gRPC message anyway) and answers 413.
    """
    return {
        "name": "envoy.filters.http.buffer",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
            "max_request_bytes": payload_limit,
        },
    }


def _transcoder(api: Contract, payload_limit: int = REQUEST_BODY_LIMIT) -> dict:
    return {
        "name": "envoy.filters.http.grpc_json_transcoder",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http."
            "grpc_json_transcoder.v3.GrpcJsonTranscoder",
            # inline: the file is self-contained
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
            "max_request_body_size": payload_limit,
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


if __name__ == "__main__":  # the former entry point: python -m textgen.envoy.cli
    from .cli import main

    main()
