"""The keepalive policy (textgen.sdk.keepalive) through the real Envoy and the real
server, provoked in seconds: Envoy and the SDK ping every second, and a unary call
that sends nothing for several intervals, or a connection idle as long, must survive.
With grpc-core's defaults the server answered such pings with GOAWAY too_many_pings
after two strikes, and the client got a 503 (HTTP) or UNAVAILABLE (gRPC)."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
import requests
from support.servers import ServerThread, tiny_settings
from support.tiers import server_fixture
from textgen.sdk import Client
from textgen.sdk.keepalive import Keepalive

pytestmark = pytest.mark.timeout(120)

INTERVAL = 1.0  # seconds between pings: Envoy's to the server, the SDK's in the test below
HOLD = 6.0  # a call with no data this long sees ~6 pings; the old policy broke at the third
STEP_DELAY = 0.1  # seconds added to each engine step, so that a call lasts HOLD
TOKENS = int(HOLD / STEP_DELAY)
# upstream connections the replica closed with a GOAWAY (Envoy's cluster stats)
GOAWAYS = "cluster.textgen_grpc.upstream_cx_close_notify"


@server_fixture(scope="module")
def server(tiny_model_dir):
    srv = ServerThread(
        tiny_settings(tiny_model_dir, keepalive_interval=INTERVAL), http=True
    ).start()
    core = srv.engine.core
    step = core.step

    def slow_step():  # the engine is slow, not the transport: nothing flows meanwhile
        time.sleep(STEP_DELAY)
        return step()

    core.step = slow_step
    yield srv
    srv.stop()


def generate_body() -> dict:
    return {"inputs": "The quick", "parameters": {"max_new_tokens": TOKENS, "ignore_eos": True}}


def envoy_counter(server, name: str) -> int:
    with urllib.request.urlopen(f"{server.envoy.admin_url}/stats?format=json", timeout=5) as r:
        stats = json.load(r)["stats"]
    return next((s["value"] for s in stats if s.get("name") == name), 0)


def test_envoy_renders_the_servers_policy(server):
    with urllib.request.urlopen(f"{server.envoy.admin_url}/config_dump", timeout=5) as r:
        dump = r.read().decode()
    assert '"interval": "1s"' in dump


def test_long_unary_generate_through_envoy_survives_the_pings(server):
    started = time.monotonic()
    resp = requests.post(f"{server.http_url}/generate", json=generate_body(), timeout=60)
    assert resp.status_code == 200, resp.text
    assert time.monotonic() - started >= HOLD * 0.8  # it really was held that long
    assert resp.json()["generated_text"]
    # the replica never told Envoy to go away
    assert envoy_counter(server, GOAWAYS) == 0


def test_idle_pooled_connection_then_a_request(server):
    # a first request opens (or reuses) the pooled connection
    quick = {"inputs": "The quick", "parameters": {"max_new_tokens": 2}}
    assert requests.post(f"{server.http_url}/generate", json=quick, timeout=30).status_code == 200
    time.sleep(HOLD)  # idle: only Envoy's pings cross it
    for path, body in (
        ("/generate", quick),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        ),
    ):
        resp = requests.post(f"{server.http_url}{path}", json=body, timeout=30)
        assert resp.status_code == 200, resp.text
    assert envoy_counter(server, GOAWAYS) == 0


def test_sdk_pinging_every_second_holds_a_long_unary_call(server):
    options = Keepalive(interval=INTERVAL).channel_options()
    with Client(server.target, timeout=60, options=options) as client:
        out = client.generate("The quick", max_new_tokens=TOKENS, ignore_eos=True)
    assert out.generated_text
