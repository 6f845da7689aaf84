"""`text-generation-launcher` as a TGI deployment runs it, driven by TGI's own client
(`text_generation.Client`): once with TGI-style flags, once with TGI-style environment
only. Each flag given is checked by its effect: /info, a request it allows or refuses,
the 413, Envoy's CORS answers, the metrics' own port, the chat template, JSON logs."""

from __future__ import annotations

import json
import os
import socket
import threading

import pytest
import requests
from support.serve_process import LAUNCHER, textgen_serve
from support.tiers import server_fixture
from text_generation import Client
from text_generation.errors import ValidationError
from textgen.service.settings.tgi_launcher import FLAGS

pytestmark = pytest.mark.timeout(300)

API_KEY = "tgi-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TEMPLATE = "{% for m in messages %}[[{{ m['role'] }}: {{ m['content'] }}]]{% endfor %}"
ALLOWED, OTHER = "http://a.example", "http://b.example"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_environment(**variables: str) -> dict[str, str]:
    """This process's environment without any of TGI's variables, plus `variables`."""
    tgi = {f.variable for f in FLAGS if f.variable} | {"LOG_LEVEL", "HF_API_TOKEN"}
    return {k: v for k, v in os.environ.items() if k not in tgi} | variables


class Launched:
    """A running launcher: its HTTP URL, its metrics URL and every log line it wrote."""

    def __init__(self, served, metrics_port: int) -> None:
        self.url = served.http_url.replace("0.0.0.0", "127.0.0.1")
        self.metrics_url = f"http://127.0.0.1:{metrics_port}"
        self.served = served
        self.lines = served.log.splitlines()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.served.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def stop(self) -> int:
        """SIGTERM, as docker stop does: the launcher drains and exits 0."""
        self.served.proc.terminate()
        status = self.served.proc.wait(60)
        self._reader.join(10)
        return status


@server_fixture(scope="module")
def flags_server(tiny_model_dir, tmp_path_factory):
    config = tmp_path_factory.mktemp("tokenizer") / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": TEMPLATE}))
    port, metrics_port = free_port(), free_port()
    args = [
        "--model-id", str(tiny_model_dir), "--hostname", "127.0.0.1", "-p", str(port),
        "--prometheus-port", str(metrics_port), "--json-output", "--dtype", "float32",
        "--cors-allow-origin", ALLOWED, "--payload-limit", "8192",
        "--max-input-length", "100", "--max-total-tokens", "200",
        "--max-batch-total-tokens", "4096", "--max-batch-prefill-tokens", "64",
        "--max-batch-size", "16", "--max-concurrent-requests", "7", "--max-best-of", "3",
        "--max-stop-sequences", "5", "--max-top-n-tokens", "6", "--validation-workers", "3",
        "--max-client-batch-size", "5", "--enable-prefill-logprobs",
        "--disable-grammar-support", "--tokenizer-config-path", str(config),
        "--api-key", API_KEY, "--rope-factor", "2", "--max-waiting-tokens", "10",
        "--waiting-served-ratio", "1.2", "--usage-stats", "off", "--env",
        "--graceful-termination-timeout", "5",
    ]  # fmt: skip
    with textgen_serve(*args, command=(LAUNCHER,), env=clean_environment()) as served:
        assert served.http_url, served.log
        launched = Launched(served, metrics_port)
        yield launched
        launched.stop()


@server_fixture(scope="module")
def env_server(tiny_model_dir):
    port, metrics_port = free_port(), free_port()
    env = clean_environment(
        MODEL_ID=str(tiny_model_dir),
        PORT=str(port),
        HOSTNAME="tgi-container-1",  # a container's name, not an address: 0.0.0.0, as TGI
        PROMETHEUS_PORT=str(metrics_port),
        DTYPE="float32",
        MAX_BATCH_TOTAL_TOKENS="768",
        MAX_BEST_OF="4",
        MAX_CONCURRENT_REQUESTS="9",
        TRUST_REMOTE_CODE="false",
        USAGE_STATS="on",
    )
    with textgen_serve(command=(LAUNCHER,), env=env) as served:
        assert served.http_url, served.log
        launched = Launched(served, metrics_port)
        yield launched
        launched.stop()


# TGI-style flags ----------------------------------------------------------------------------


def test_tgis_client_generates_and_streams_with_flags(flags_server):
    client = Client(flags_server.url, headers=AUTH, timeout=60)
    reply = client.generate("The quick brown", max_new_tokens=6, decoder_input_details=True)
    assert reply.details.generated_tokens == 6
    # --enable-prefill-logprobs: the prompt's tokens come back, with logprobs after the first
    prefill = reply.details.prefill
    assert len(prefill) > 1 and all(t.logprob is not None for t in prefill[1:])
    streamed = list(client.generate_stream("The quick brown", max_new_tokens=6))
    assert [t.token.id for t in streamed] == [t.id for t in reply.details.tokens]
    assert streamed[-1].generated_text == reply.generated_text


def test_the_flags_reach_info(flags_server):
    info = requests.get(f"{flags_server.url}/info", headers=AUTH, timeout=30).json()
    assert {k: info[k] for k in EXPECTED_INFO} == EXPECTED_INFO
    assert info["max_position_embeddings"] == 2048  # --rope-factor 2 stretched 1024


EXPECTED_INFO = {
    "max_concurrent_requests": 7,
    "max_best_of": 3,
    "max_stop_sequences": 5,
    "max_input_tokens": 100,  # --max-input-length
    "max_total_tokens": 200,
    "validation_workers": 3,
    "max_client_batch_size": 5,
    "max_batch_prefill_tokens": 64,
    "max_batch_total_tokens": 4096,
    "max_batch_size": 16,
    "model_dtype": "float32",
}


def test_the_flags_bound_requests(flags_server):
    client = Client(flags_server.url, headers=AUTH, timeout=60)
    client.generate("hi", max_new_tokens=2, top_n_tokens=6)
    with pytest.raises(ValidationError, match="top_n_tokens"):
        client.generate("hi", max_new_tokens=2, top_n_tokens=7)
    with pytest.raises(ValidationError, match="grammar is not supported"):  # --disable-grammar
        client.generate("hi", max_new_tokens=2, grammar={"type": "regex", "value": "[0-9]+"})
    refused = requests.post(f"{flags_server.url}/generate", json={"inputs": "hi"}, timeout=30)
    assert refused.status_code == 401  # --api-key
    big = {"inputs": "x" * 9000, "parameters": {"max_new_tokens": 1}}
    too_large = requests.post(f"{flags_server.url}/generate", json=big, headers=AUTH, timeout=30)
    assert too_large.status_code == 413  # --payload-limit 8192, typed
    assert too_large.json() == {
        "error": "Payload too large: the request body is limited to 8192 bytes",
        "error_type": "validation",
    }


def test_envoy_answers_the_cors_preflight_of_the_allowed_origin(flags_server):
    def preflight(origin: str) -> requests.Response:
        return requests.options(
            f"{flags_server.url}/generate",
            headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "content-type"},
            timeout=30,
        )  # fmt: skip

    allowed = preflight(ALLOWED)
    assert allowed.status_code == 200 and allowed.headers["server"] == "envoy"
    assert allowed.headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert "content-type" in allowed.headers["access-control-allow-headers"]
    assert "access-control-allow-origin" not in preflight(OTHER).headers
    answer = requests.post(
        f"{flags_server.url}/generate",
        json={"inputs": "hi", "parameters": {"max_new_tokens": 1}},
        headers={**AUTH, "Origin": ALLOWED},
        timeout=30,
    )
    assert answer.status_code == 200
    assert answer.headers["access-control-allow-origin"] == ALLOWED


def test_the_metrics_have_their_own_port(flags_server):
    Client(flags_server.url, headers=AUTH, timeout=60).generate("hi", max_new_tokens=1)
    own = requests.get(f"{flags_server.metrics_url}/metrics", timeout=30)
    assert own.status_code == 200 and "tgi_request_success" in own.text
    success = [line for line in own.text.splitlines() if line.startswith("tgi_request_success ")]
    assert float(success[0].split()[1]) >= 1


def test_the_tokenizer_configs_chat_template_renders_the_chat(flags_server):
    messages = [{"role": "user", "content": "hi"}]
    tokens = requests.post(
        f"{flags_server.url}/tokenize", json={"messages": messages}, headers=AUTH, timeout=30
    ).json()["tokens"]
    prompt = requests.post(
        f"{flags_server.url}/detokenize", json={"tokens": tokens}, headers=AUTH, timeout=30
    ).json()["prompt"]
    assert prompt == "[[user: hi]]"


def test_every_log_line_is_json_and_says_what_was_accepted(flags_server):
    Client(flags_server.url, headers=AUTH, timeout=60).generate("hi", max_new_tokens=1)
    records = [json.loads(line) for line in flags_server.lines if line.strip()]
    assert len(records) > 10
    for record in records:
        assert {"timestamp", "level", "fields", "target"} <= record.keys(), record
    messages = [r["fields"]["message"] for r in records]
    assert any(m.startswith("Runtime environment:") for m in messages)  # --env
    assert any(m.startswith("--max-waiting-tokens '10' accepted: ") for m in messages)
    assert any(m.startswith("--usage-stats 'off' accepted: ") for m in messages)
    requests_logged = [r["fields"] for r in records if r["target"] == "textgen.requests"]
    assert requests_logged and requests_logged[0]["message"] == "request"
    assert not any(API_KEY in line for line in flags_server.lines)  # the key is never logged


# TGI-style environment only -----------------------------------------------------------------


def test_tgis_client_generates_and_streams_with_environment_only(env_server):
    client = Client(env_server.url, timeout=60)
    reply = client.generate("The quick brown", max_new_tokens=6)
    streamed = list(client.generate_stream("The quick brown", max_new_tokens=6))
    assert [t.token.id for t in streamed] == [t.id for t in reply.details.tokens]
    best = client.generate("The quick", max_new_tokens=3, best_of=4, do_sample=True)
    assert len(best.details.best_of_sequences) == 3  # MAX_BEST_OF=4 allows 4


def test_the_environment_reaches_info_with_tgis_defaults(env_server):
    info = requests.get(f"{env_server.url}/info", timeout=30).json()
    assert info["max_concurrent_requests"] == 9 and info["max_best_of"] == 4
    # TGI's default: max-total-tokens is the model's context (1024), at most what the
    # KV cache holds (MAX_BATCH_TOTAL_TOKENS=768); max-input-tokens one less
    assert (info["max_total_tokens"], info["max_input_tokens"]) == (768, 767)
    assert info["model_dtype"] == "float32"


def test_without_enable_prefill_logprobs_decoder_input_details_is_refused(env_server):
    client = Client(env_server.url, timeout=60)
    with pytest.raises(ValidationError, match="decoder_input_details.*--enable-prefill-logprobs"):
        client.generate("hi", max_new_tokens=2, decoder_input_details=True)


def test_tgis_defaults_any_origin_and_metrics_port(env_server):
    answer = requests.options(
        f"{env_server.url}/v1/chat/completions",
        headers={"Origin": OTHER, "Access-Control-Request-Method": "POST"},
        timeout=30,
    )
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == OTHER
    assert "tgi_request_count" in requests.get(env_server.metrics_url, timeout=30).text


def test_docker_stop_drains_and_exits_0(env_server):
    """Last in the module: SIGTERM (docker stop) drains, and the launcher exits 0."""
    assert env_server.stop() == 0
    assert any("draining" in line for line in env_server.lines)
