"""The Envoy bootstrap, offline: Envoy itself validates what textgen.envoy.config
renders, and the tables the Lua filter is rendered from agree with the server's."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
from google.api import annotations_pb2
from google.protobuf import descriptor_pb2
from textgen.envoy import config, contract
from textgen.service.grpc.errors import STATUS_BY_ERROR_TYPE
from textgen.service.processes.envoy import envoy_binary
from textgen.service.proto import generate_pb2 as pb

pytestmark = pytest.mark.timeout(60)

# TGI's statuses (TGI's router): the HTTP face must answer these.
TGI_STATUS = {
    "validation": 422,
    "overloaded": 429,
    "generation": 424,
    "incomplete_generation": 500,
    "unauthenticated": 401,
    "healthcheck": 503,
    "unavailable": 503,
    "not_found": 404,  # a stored response (OpenAI's Responses API) the replica doesn't keep
}


def validate(path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.mark.server
def test_rendered_config_validates(tmp_path):
    path = config.write(
        config.render([config.Upstream("127.0.0.1", 50051)]), tmp_path / "envoy.json"
    )
    result = validate(path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout


@pytest.mark.server
def test_several_replicas_and_a_dns_name_validate(tmp_path):
    upstreams = [
        config.Upstream("127.0.0.1", 50051),
        config.Upstream("textgen-replicas.local", 50051),
    ]
    bootstrap = config.render(upstreams, listen_host="0.0.0.0", listen_port=9000, admin_port=9901)
    cluster = bootstrap["static_resources"]["clusters"][0]
    assert cluster["type"] == "STRICT_DNS"
    assert len(cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 2
    assert bootstrap["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    result = validate(config.write(bootstrap, tmp_path / "envoy.json"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_needs_an_upstream():
    with pytest.raises(ValueError):
        config.render([])


def test_status_table_covers_every_server_error_type():
    assert config.HTTP_STATUS_BY_ERROR_TYPE == TGI_STATUS
    assert set(STATUS_BY_ERROR_TYPE) == set(TGI_STATUS)
    # the fallback (no trailer) agrees with the trailer for the codes both know
    for error_type, code in STATUS_BY_ERROR_TYPE.items():
        fallback = config.FALLBACK_BY_GRPC_CODE.get(code.value[0])
        if fallback and fallback[1] == error_type:
            assert fallback[0] == TGI_STATUS[error_type]
    assert config.FALLBACK_BY_GRPC_CODE[grpc.StatusCode.UNIMPLEMENTED.value[0]] == (
        501,
        "unimplemented",
    )


def test_lua_filter_carries_the_tables():
    lua = config.render([config.Upstream("127.0.0.1", 1)])["static_resources"]["listeners"][0]
    source = lua["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"][0][
        "typed_config"
    ]
    code = source["default_source_code"]["inline_string"]
    for error_type, status in TGI_STATUS.items():
        assert f'["{error_type}"] = {status}' in code
    assert "__" not in code  # every placeholder was filled


def lua_code() -> str:
    listener = config.render([config.Upstream("127.0.0.1", 1)])["static_resources"]["listeners"][0]
    lua = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"][0]
    return lua["typed_config"]["default_source_code"]["inline_string"]


def test_tgi_body_fields_are_the_contracts_in_both_spellings():
    """The Lua filter refuses a TGI body's key the transcoder would drop: it knows the
    names from the descriptor set, as the proto's field name and as its JSON name."""
    body, params, grammar = contract.tgi_body_fields(contract.contract())
    for fields, message in (
        (body, pb.GenerateRequest),
        (params, pb.GenerateParameters),
        (grammar, pb.Grammar),
    ):
        spellings = {f.name for f in message.DESCRIPTOR.fields}
        spellings |= {f.json_name for f in message.DESCRIPTOR.fields}
        extras = set(contract.TGI_COMPAT_FIELDS) if message is pb.GenerateRequest else set()
        assert fields.accepted == spellings | extras
    assert "maxNewTokens" in params.accepted and "max_new_tokens" in params.names
    code = lua_code()
    assert '["max_new_tokens"] = true' in code and '["maxNewTokens"] = true' in code
    assert '["stream"] = true' in code


def test_tgi_clients_send_only_accepted_fields():
    """Every field TGI's Python client and huggingface_hub's InferenceClient put in a
    text-generation body is accepted (a field the contract lacks must be in
    TGI_COMPAT_FIELDS)."""
    import dataclasses

    import text_generation.types as tgi
    from huggingface_hub.inference._generated.types import text_generation as hub

    body, params, grammar = (f.accepted for f in contract.tgi_body_fields(contract.contract()))
    assert set(tgi.Request.model_fields) <= body
    assert set(tgi.Parameters.model_fields) <= params
    assert set(tgi.Grammar.model_fields) <= grammar
    assert {f.name for f in dataclasses.fields(hub.TextGenerationInput)} <= body
    assert {f.name for f in dataclasses.fields(hub.TextGenerationInputGenerateParameters)} <= params
    assert {f.name for f in dataclasses.fields(hub.TextGenerationInputGrammarType)} <= grammar


def test_contract_refuses_response_body_envoy_rejects(tmp_path):
    """Envoy 1.40 refuses the whole descriptor set for one `response_body` on a
    non-HttpBody message: none of ours has one, and rendering refuses one by name."""
    api = contract.contract()
    files = descriptor_pb2.FileDescriptorSet.FromString(api.descriptor_set)
    rules = {
        m.name: m.options.Extensions[annotations_pb2.http]
        for f in files.file
        for s in f.service
        for m in s.method
    }
    assert not any(r.response_body for r in rules.values())
    assert {r.post or r.get for r in rules.values()} >= {
        "/generate",
        "/generate_stream",
        "/tokenize",
        "/info",
    }
    for f in files.file:
        for s in f.service:
            for m in s.method:
                if m.name == "Info":
                    m.options.Extensions[annotations_pb2.http].response_body = "model_id"
    (tmp_path / "bad.binpb").write_bytes(files.SerializeToString())
    with pytest.raises(ValueError, match="Info"):
        contract.contract(tmp_path / "bad.binpb")


def test_streaming_routes_disable_the_route_timeout():
    routes = config.render([config.Upstream("127.0.0.1", 1)])["static_resources"]["listeners"][0]
    hcm = routes["filter_chains"][0]["filters"][0]["typed_config"]
    by_path = {
        r["match"].get("path"): r
        for r in hcm["route_config"]["virtual_hosts"][0]["routes"]
        if "route" in r
    }
    stream = by_path["/generate_stream"]
    assert stream["route"]["timeout"] == "0s"
    headers = {h["header"]["key"]: h["header"]["value"] for h in stream["response_headers_to_add"]}
    assert headers == {"x-accel-buffering": "no", "cache-control": "no-cache"}
    assert by_path["/generate"]["route"]["timeout"] == "0s"
    assert by_path["/info"]["route"]["timeout"] == config.QUICK_ROUTE_TIMEOUT


# the front proxy of several replicas (textgen proxy) ----------------------------------


def _path(match: dict) -> str:
    """A route's path, its regex for a templated one, "grpc" for native gRPC's."""
    return match.get("path") or match.get("safe_regex", {}).get("regex") or "grpc"


def _routes(bootstrap: dict) -> list[dict]:
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    return [
        r for r in hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"] if "route" in r
    ]


@pytest.mark.server
@pytest.mark.parametrize(
    "upstreams",
    [
        [config.Upstream("127.0.0.1", p) for p in (50051, 50052, 50053)],
        [config.Upstream("textgen-replicas", 50051)],
    ],
    ids=["static-3", "dns"],
)
def test_front_proxy_validates(tmp_path, upstreams):
    bootstrap = config.render(upstreams, listen_host="0.0.0.0", admin_port=9901, front=True)
    result = validate(config.write(bootstrap, tmp_path / "front.json"))
    assert result.returncode == 0, result.stdout + result.stderr
    cluster = bootstrap["static_resources"]["clusters"][0]
    assert cluster["type"] == ("STATIC" if upstreams[0].is_ip else "STRICT_DNS")
    # prefix affinity: a ring of replicas, each bounded to 1.25x the mean load
    assert cluster["lb_policy"] == "RING_HASH"
    hashing = cluster["common_lb_config"]["consistent_hashing_lb_config"]
    assert hashing["hash_balance_factor"] == 125
    assert cluster["common_lb_config"]["healthy_panic_threshold"]["value"] == 0
    (check,) = cluster["health_checks"]
    assert check["grpc_health_check"] == {"service_name": ""}
    assert (check["interval"], check["unhealthy_threshold"]) == ("1s", 2)  # out in ~2 s
    outlier = cluster["outlier_detection"]
    assert outlier["successful_active_health_check_uneject_host"] is False
    assert outlier["split_external_local_origin_errors"] is True
    (limits,) = cluster["circuit_breakers"]["thresholds"]
    assert limits["retry_budget"]["min_retry_concurrency"] >= 16


def test_front_proxy_hashes_generations_on_the_routing_key():
    """Every generating route (and native gRPC) hashes the affinity filter's header, set
    after the transcoder; metadata routes are spread at random; one replica's Envoy
    has neither."""
    from textgen.envoy.affinity import AFFINITY_HEADER

    front = config.render([config.Upstream("127.0.0.1", 1)], front=True)
    hashed = {_path(r["match"]): r["route"].get("hash_policy") for r in _routes(front)}
    expected = [{"header": {"header_name": AFFINITY_HEADER}}]
    assert hashed["grpc"] == expected
    for route in config.ROUTES:
        path = _path(route.path_match)
        assert hashed[path] == (expected if route.generation else None), route.path
    manager = front["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    names = [f["name"] for f in manager["typed_config"]["http_filters"]]
    transcoder = names.index("envoy.filters.http.grpc_json_transcoder")
    assert names[transcoder + 1] == "textgen.affinity" and names[-1] == "envoy.filters.http.router"
    single = config.render([config.Upstream("127.0.0.1", 1)])
    assert not any("hash_policy" in r["route"] for r in _routes(single))
    assert single["static_resources"]["clusters"][0]["lb_policy"] == "LEAST_REQUEST"


def test_front_proxy_retries_before_the_first_byte_only():
    routes = _routes(config.render([config.Upstream("127.0.0.1", 1)], front=True))
    assert len(routes) == len(config.ROUTES) + 1  # every HTTP route and native gRPC
    for route in routes:
        policy = route["route"]["retry_policy"]
        conditions = set(policy["retry_on"].split(","))
        # gRPC statuses: the router sees the upstream's grpc-status, before the
        # transcoder makes a 429 of it; HTTP status codes would never match
        assert {"resource-exhausted", "unavailable", "connect-failure", "reset"} <= conditions
        assert "retriable-status-codes" not in conditions
        assert (
            policy["retry_host_predicate"][0]["name"]
            == "envoy.retry_host_predicates.previous_hosts"
        )
        assert policy["host_selection_retry_max_attempts"] >= 3
        generation = route["route"]["timeout"] == "0s"
        # a per-try timeout would cut a long unary generation and run it again
        assert ("per_try_timeout" in policy) is not generation


def test_single_replica_envoy_resends_only_what_never_started():
    """`textgen serve`'s own Envoy has no other replica: it resends only a request the
    replica refused unstarted (GOAWAY) or a closing connection never sent, and ejects
    nothing."""
    bootstrap = config.render([config.Upstream("127.0.0.1", 1)])
    for route in _routes(bootstrap):
        policy = route["route"]["retry_policy"]
        assert set(policy["retry_on"].split(",")) == {"refused-stream", "reset-before-request"}
    cluster = bootstrap["static_resources"]["clusters"][0]
    assert "outlier_detection" not in cluster and "circuit_breakers" not in cluster


def test_keepalive_is_one_policy_on_both_sides():
    """Envoy pings the replicas no more often than they accept, on both configs, and
    the SDK's channels ping as Envoy does (textgen.sdk.keepalive)."""
    from textgen.sdk.keepalive import DEFAULT_KEEPALIVE, Keepalive

    for policy in (DEFAULT_KEEPALIVE, Keepalive(interval=1.0, timeout=0.5)):
        server = dict(policy.server_options())
        client = dict(policy.channel_options())
        assert server["grpc.keepalive_permit_without_calls"] == 1  # idle pooled connections
        assert (
            server["grpc.http2.min_ping_interval_without_data_ms"]
            <= client["grpc.keepalive_time_ms"]
        )
        for front in (False, True):
            bootstrap = config.render(
                [config.Upstream("127.0.0.1", 1)], front=front, keepalive=policy
            )
            cluster = bootstrap["static_resources"]["clusters"][0]
            options = cluster["typed_extension_protocol_options"]
            http2 = next(iter(options.values()))["explicit_http_config"]["http2_protocol_options"]
            interval = float(http2["connection_keepalive"]["interval"].removesuffix("s"))
            assert interval * 1000 == client["grpc.keepalive_time_ms"]
    # the documented floor for other clients
    assert (
        dict(DEFAULT_KEEPALIVE.server_options())["grpc.http2.min_ping_interval_without_data_ms"]
        == 10_000
    )


@pytest.mark.server
def test_textgen_proxy_prints_the_front_config():
    out = subprocess.run(
        [sys.executable, "-m", "textgen.service.cli", "proxy", "--upstream", "localhost:50051",
         "--dns", "textgen-replicas:50051", "--print-config"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    cluster = json.loads(out)["static_resources"]["clusters"][0]
    hosts = [
        e["endpoint"]["address"]["socket_address"]["address"]
        for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    assert hosts[1] == "textgen-replicas" and hosts[0] in ("127.0.0.1", "::1")
    assert cluster["type"] == "STRICT_DNS" and "outlier_detection" in cluster


@pytest.mark.server
def test_payload_limit_and_cors_origins_render_and_validate(tmp_path):
    """--payload-limit bounds the body (the buffer filter and the transcoder, the 413's
    message says it); --cors-allow-origin adds Envoy's CORS filter first, its policy on
    the virtual host, and one preflight route per allowed origin (the filter answers only
    on a forwarding route)."""
    http = config.HttpOptions(payload_limit=4096, cors_allow_origin=("http://a.example",))
    bootstrap = config.render([config.Upstream("127.0.0.1", 50051)], http=http)
    assert validate(config.write(bootstrap, tmp_path / "envoy.json")).returncode == 0
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    typed = manager["typed_config"]
    filters = {f["name"]: f["typed_config"] for f in typed["http_filters"]}
    assert typed["http_filters"][0]["name"] == "envoy.filters.http.cors"
    assert filters["envoy.filters.http.buffer"]["max_request_bytes"] == 4096
    assert filters["envoy.filters.http.grpc_json_transcoder"]["max_request_body_size"] == 4096
    assert "limited to 4096 bytes" in json.dumps(typed["local_reply_config"])
    host = typed["route_config"]["virtual_hosts"][0]
    policy = host["typed_per_filter_config"]["envoy.filters.http.cors"]
    assert policy["allow_origin_string_match"] == [{"exact": "http://a.example"}]
    preflights = [r for r in host["routes"] if {"name": "origin", "string_match": {
        "exact": "http://a.example"}} in r["match"].get("headers", [])]  # fmt: skip
    assert len(preflights) == 1 and "route" in preflights[0]
    plain = config.render([config.Upstream("127.0.0.1", 50051)])
    plain_typed = plain["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]
    assert "envoy.filters.http.cors" not in json.dumps(plain_typed)  # no CORS unless asked
    any_origin = config.render(
        [config.Upstream("127.0.0.1", 50051)], http=config.HttpOptions(cors_allow_origin=("*",))
    )
    assert validate(config.write(any_origin, tmp_path / "any.json")).returncode == 0
