"""The front proxy of several models, offline: one cluster per pool with the single
cluster's policies, each route once per pool on the Lua filter's pool header, and the
model list Envoy answers itself; Envoy validates the result."""

from __future__ import annotations

import json

import pytest
from textgen.envoy import config
from textgen.envoy.pools import POOL_HEADER, cluster_name, pool_by_model

from .test_envoy_config import validate

pytestmark = pytest.mark.timeout(60)

U = config.Upstream
POOLS = (
    config.Pool("llama", (U("127.0.0.1", 50051), U("127.0.0.1", 50052))),
    config.Pool(
        "qwen",
        (U("qwen-replicas", 50051),),
        (
            config.ModelCard("qwen", created=7, owned_by="textgen"),
            config.ModelCard("qwen-sql", created=7, root="/adapters/sql", parent="qwen"),
        ),
    ),
)


def render(**kwargs) -> dict:
    return config.render(POOLS[0].upstreams, front=True, pools=POOLS, **kwargs)


def routes(bootstrap: dict) -> list[dict]:
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    return manager["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]


@pytest.mark.server
def test_pools_render_and_validate(tmp_path):
    result = validate(config.write(render(listen_host="0.0.0.0"), tmp_path / "pools.json"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_each_pool_is_a_front_cluster():
    """Same health checks, outlier detection, ring and retry budget as the one cluster."""
    single = config.render(POOLS[0].upstreams, front=True)["static_resources"]["clusters"][0]
    clusters = render()["static_resources"]["clusters"]
    assert [c["name"] for c in clusters] == ["textgen_grpc", "textgen_grpc_1"]
    assert clusters[0] == single
    second = clusters[1]
    assert second["type"] == "STRICT_DNS" and second["load_assignment"]["cluster_name"] == (
        "textgen_grpc_1"
    )
    for key in ("health_checks", "outlier_detection", "circuit_breakers", "lb_policy"):
        assert second[key] == single[key], key


def test_every_route_has_a_copy_per_pool():
    """A route of the second pool matches its index in POOL_HEADER, before the first
    pool's, which has no such condition (requests that name no model go there)."""
    table = routes(render())
    forwarding = [r for r in table if "route" in r and "cors" not in json.dumps(r)]
    single = [r for r in routes(config.render(POOLS[0].upstreams, front=True)) if "route" in r]
    # /v1/models is Envoy's own answer now
    assert len(forwarding) == 2 * (len(single) - 1)
    for second, first in zip(forwarding[::2], forwarding[1::2], strict=True):
        pool = {"name": POOL_HEADER, "string_match": {"exact": "1"}}
        assert second["match"]["headers"][-1] == pool
        assert second["route"]["cluster"] == cluster_name(1)
        assert first["route"]["cluster"] == cluster_name(0)
        assert POOL_HEADER not in json.dumps(first["match"])
        # the same timeouts, retries and affinity hash
        assert {k: v for k, v in second["route"].items() if k != "cluster"} == {
            k: v for k, v in first["route"].items() if k != "cluster"
        }


def test_models_lists_every_pool():
    (models,) = [r for r in routes(render()) if r["match"].get("path") == "/v1/models"][:1]
    body = json.loads(models["direct_response"]["body"]["inline_string"])
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["llama", "qwen", "qwen-sql"]
    assert body["data"][2] == {
        "id": "qwen-sql",
        "object": "model",
        "created": 7,
        "owned_by": "textgen",
        "root": "/adapters/sql",
        "parent": "qwen",
    }


def test_lua_names_every_model_of_every_pool():
    assert pool_by_model(POOLS) == {"llama": 0, "qwen": 1, "qwen-sql": 1}
    manager = render()["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    lua = manager["typed_config"]["http_filters"][0]["typed_config"]["default_source_code"]
    source = lua["inline_string"]
    assert '["qwen-sql"] = 1' in source and "__" not in source.replace("__index", "")
    # a stored response's replica (by IP) picks its pool; DNS names aren't known here
    assert '["127.0.0.1:50052"] = 0' in source and "qwen-replicas" not in source
    # one replica's Envoy and the one-pool proxy route nothing by model
    single = config.render(POOLS[0].upstreams)
    manager = single["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    lua = manager["typed_config"]["http_filters"][0]["typed_config"]["default_source_code"]
    assert "local POOL_BY_MODEL = {}" in lua["inline_string"]


def test_a_name_two_pools_claim_is_refused():
    twice = (POOLS[0], config.Pool("other", (U("127.0.0.1", 1),), (config.ModelCard("llama"),)))
    with pytest.raises(ValueError, match="'llama' is served by pools 0 and 1"):
        config.render(POOLS[0].upstreams, front=True, pools=twice)
    with pytest.raises(ValueError, match="front proxy"):
        config.render(POOLS[0].upstreams, pools=POOLS)
