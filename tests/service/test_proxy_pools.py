"""`textgen proxy --pool/--pool-dns`, offline: the flags' forms and refusals, one model's
flags merged into one pool, and the bootstrap --print-config renders for them."""

from __future__ import annotations

import argparse
import json

import pytest
from textgen.envoy.config import Pool, Upstream
from textgen.service.front_proxy.command import add_proxy_arguments, run
from textgen.service.front_proxy.pools import merged

pytestmark = pytest.mark.timeout(60)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="textgen proxy", exit_on_error=False)
    add_proxy_arguments(parser)
    return parser.parse_args(argv)


def test_a_pool_is_a_model_and_its_replicas():
    args = parse(
        "--pool", "org/llama=127.0.0.1:1,localhost:2",
        "--pool-dns", "qwen=qwen-replicas:3",
        "--pool", "org/llama=[::1]:4",
    )  # fmt: skip
    pools = merged(args.pools)
    assert [p.name for p in pools] == ["org/llama", "qwen"]  # the order first named
    assert pools[0].upstreams[0] == Upstream("127.0.0.1", 1)
    assert pools[0].upstreams[1].is_ip and pools[0].upstreams[2] == Upstream("::1", 4)
    assert pools[1] == Pool("qwen", (Upstream("qwen-replicas", 3),))  # Envoy resolves it


@pytest.mark.parametrize(
    "value", ["llama", "=127.0.0.1:1", "llama=", "llama=127.0.0.1", "llama=127.0.0.1:1,"]
)
def test_a_malformed_pool_is_refused_naming_the_form(value):
    with pytest.raises(argparse.ArgumentError, match=r"expected MODEL=HOST:PORT\[,HOST:PORT"):
        parse("--pool", value)


def test_pools_replace_upstreams():
    with pytest.raises(SystemExit, match="--pool replaces --upstream and --dns"):
        run(parse("--pool", "a=127.0.0.1:1", "--upstream", "127.0.0.1:2"))


def test_print_config_renders_a_cluster_per_pool(capsys):
    """--print-config doesn't ask the replicas: each pool routes its own name."""
    assert run(parse("--pool", "a=127.0.0.1:1", "--pool-dns", "b=svc:2", "--print-config")) == 0
    bootstrap = json.loads(capsys.readouterr().out)
    clusters = bootstrap["static_resources"]["clusters"]
    assert [(c["name"], c["type"]) for c in clusters] == [
        ("textgen_grpc", "STATIC"),
        ("textgen_grpc_1", "STRICT_DNS"),
    ]
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    lua = manager["typed_config"]["http_filters"][0]["typed_config"]["default_source_code"]
    assert '["a"] = 0, ["b"] = 1' in lua["inline_string"]
