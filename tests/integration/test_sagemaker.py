"""SageMaker's contract, as TGI's SageMaker image serves it (issue 48): `GET /ping` and
`POST /invocations` through the real Envoy of the session's server (TGI's body, OpenAI
chat's and completions', each answered as the route it names answers), then
text-generation-launcher started by SageMaker's environment alone, as SageMaker starts
TGI's image (`docker run IMAGE serve`, no flags)."""

from __future__ import annotations

import json
import os

import pytest
import requests
from support.http_client import PROMPT, Http, sse_events
from support.replica_processes import free_port
from support.serve_process import LAUNCHER, textgen_serve
from support.tiers import server_fixture
from textgen.service.settings.tgi_launcher import FLAGS, SAGEMAKER_VARIABLES

pytestmark = [pytest.mark.timeout(120)]

PARAMS = {"max_new_tokens": 6, "details": True}
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def web(http_server) -> Http:
    return Http(http_server.http_url)


def post(web: Http, path: str, body) -> tuple[int, object]:
    status, _, raw = web.call("POST", path, body)
    return status, json.loads(raw)


def same_generation(answer: dict) -> dict:
    """A TGI answer without what differs between two runs of one request (its timings,
    and what the prefix cache served)."""
    details = {k: v for k, v in answer["details"].items() if k not in ("timings", "cached_tokens")}
    return {**answer, "details": details}


def same_openai(answer: dict) -> dict:
    return {k: v for k, v in answer.items() if k not in ("id", "created", "usage")} | {
        "usage": {k: v for k, v in answer["usage"].items() if k != "prompt_tokens_details"}
    }


# the routes, on the session's server ------------------------------------------------------


def test_ping_is_health(web):
    status, headers, raw = web.call("GET", "/ping")
    assert (status, raw) == (200, web.call("GET", "/health")[2])
    assert headers["content-type"] == "application/json"
    assert web.call("POST", "/ping", {})[0] == 405


def test_invocations_with_tgis_body_answers_as_generate_in_an_array(web):
    body = {"inputs": PROMPT, "parameters": PARAMS}
    status, generated = post(web, "/generate", body)
    assert status == 200, generated
    status, invoked = post(web, "/invocations", body)
    assert status == 200, invoked
    # TGI's compat_generate (which /invocations calls) wraps the answer in an array
    assert isinstance(invoked, list) and len(invoked) == 1
    assert same_generation(invoked[0]) == same_generation(generated)
    status, query = post(web, "/invocations?x=1", {**body, "stream": False})
    assert status == 200 and same_generation(query[0]) == same_generation(generated)


def test_invocations_with_tgis_body_and_stream_answers_as_generate_stream(web):
    body = {"inputs": PROMPT, "parameters": PARAMS}
    with web.open("POST", "/generate_stream", body) as resp:
        expected = [e for _, e in sse_events(resp)]
    with web.open("POST", "/invocations", {**body, "stream": True}) as resp:
        assert resp.status == 200
        assert resp.getheader("content-type") == "text/event-stream"
        events = [e for _, e in sse_events(resp)]
    assert [e["token"] for e in events] == [e["token"] for e in expected]
    assert events[-1]["generated_text"] == expected[-1]["generated_text"]
    assert same_generation(events[-1])["details"] == same_generation(expected[-1])["details"]


def test_invocations_with_messages_answers_as_chat_completions(web):
    body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    status, chat = post(web, "/v1/chat/completions", body)
    assert status == 200, chat
    status, invoked = post(web, "/invocations", body)
    assert status == 200, invoked
    assert invoked["object"] == "chat.completion"
    assert same_openai(invoked) == same_openai(chat)
    with web.open("POST", "/invocations", {**body, "stream": True}) as resp:
        assert resp.getheader("content-type") == "text/event-stream"
        frames = [line[5:].strip() for line in resp.read().splitlines() if line[:5] == b"data:"]
    assert frames[-1] == b"[DONE]"
    text = "".join(
        c["delta"].get("content") or "" for f in frames[:-1] for c in json.loads(f)["choices"]
    )
    assert text == chat["choices"][0]["message"]["content"]


def test_invocations_with_a_prompt_answers_as_completions(web):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    status, completion = post(web, "/v1/completions", body)
    assert status == 200, completion
    status, invoked = post(web, "/invocations", body)
    assert status == 200 and invoked["object"] == "text_completion", invoked
    assert same_openai(invoked) == same_openai(completion)


def test_invocations_errors_take_the_face_of_the_body(web):
    # OpenAI's error shape for an OpenAI body
    status, refused = post(web, "/invocations", {"messages": MESSAGES, "max_tokens": -1})
    assert status == 422 and set(refused["error"]) == {"message", "type", "param", "code"}
    assert refused == post(web, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": -1})[1]
    # TGI's for TGI's body: its unknown keys are refused as POST /'s are
    status, refused = post(web, "/invocations", {"inputs": PROMPT, "messages": MESSAGES})
    assert status == 422 and refused["error_type"] == "validation"
    assert refused["error"].startswith("unknown field `messages`")
    # a body that is none of the three (TGI: serde's "did not match any variant")
    for body in ({"stream": True}, [], "x"):
        status, refused = post(web, "/invocations", body)
        assert (status, refused["error_type"]) == (422, "validation"), refused
        assert "`inputs`" in refused["error"] and "`messages`" in refused["error"]
    assert web.call("GET", "/invocations")[0] == 405


# text-generation-launcher by SageMaker's environment alone ----------------------------------


def sagemaker_environment(**variables: str) -> dict[str, str]:
    """This process's environment without TGI's or SageMaker's variables, plus `variables`."""
    drop = {f.variable for f in FLAGS if f.variable} | set(SAGEMAKER_VARIABLES)
    drop |= {"LOG_LEVEL", "HF_API_TOKEN", "SAGEMAKER_BIND_TO_PORT"}
    return {k: v for k, v in os.environ.items() if k not in drop} | variables


@server_fixture(scope="module")
def sagemaker_server(tiny_model_dir):
    port = free_port()
    env = sagemaker_environment(
        HF_MODEL_ID=str(tiny_model_dir),  # what SageMaker's model data unpacks to
        HF_MODEL_REVISION="main",
        SM_NUM_GPUS="1",
        HF_MODEL_TRUST_REMOTE_CODE="false",
        NUM_SHARD="2",  # overwritten by SM_NUM_GPUS, as the entrypoint's export does
        PORT="80",  # the image's: the entrypoint's --port wins over it
        # 8080 but where SageMaker says otherwise (a free port here)
        SAGEMAKER_BIND_TO_PORT=str(port),
        HOSTNAME="127.0.0.1",
        PROMETHEUS_PORT=str(free_port()),
        DTYPE="float32",
        MAX_BATCH_TOTAL_TOKENS="768",
    )
    with textgen_serve("serve", command=(LAUNCHER,), env=env) as served:
        assert served.http_url == f"http://127.0.0.1:{port}", served.log
        served.drain_log()
        yield served
        served.proc.terminate()  # SageMaker stops a container with SIGTERM
        assert served.proc.wait(60) == 0


@pytest.mark.timeout(300)
def test_the_launcher_serves_sagemakers_environment_as_tgis_image(sagemaker_server, tiny_model_dir):
    log = sagemaker_server.log
    assert "SM_NUM_GPUS='1' overwrites NUM_SHARD='2'" in log
    assert f"--revision main ignored for the local folder {tiny_model_dir}" in log
    serving = next(line for line in log.splitlines() if "serving as: textgen serve" in line)
    assert f"--model-id {tiny_model_dir}" in serving and "--num-shard 1" in serving
    url = sagemaker_server.http_url
    assert requests.get(f"{url}/ping", timeout=30).status_code == 200
    info = requests.get(f"{url}/info", timeout=30).json()
    assert info["model_id"] == str(tiny_model_dir)
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}}
    generated = requests.post(f"{url}/generate", json=body, timeout=60).json()
    invoked = requests.post(f"{url}/invocations", json=body, timeout=60)
    assert invoked.status_code == 200 and invoked.json() == [generated]
