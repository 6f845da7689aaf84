"""The tokenizer's HTTP routes through a real Envoy and server (the tiny model): POST
/tokenize answers TGI's body with TGI's bare array, byte for byte as the transcoded route
printed it, and vLLM's body (`prompt`, or `messages` through the chat template) with
vLLM's answer; POST /detokenize turns the ids back into the prompt; GET /version."""

from __future__ import annotations

import pytest
import requests
from textgen.service.grpc.tokenize_rpcs import proto_json_string
from textgen.service.processes.build_info import source_commit
from transformers import AutoTokenizer

pytestmark = pytest.mark.timeout(60)

# What the transcoded /tokenize (Envoy printing TokenizeResponse, its Lua filter cutting
# the array out) answered for this text on the tiny model, before /tokenize became an
# HttpBody RPC: `<`, `>` and U+2028/9 as \\u escapes, `&` and `/` as they are.
TRICKY = "<b>&amp;</b> \u2028\u2029"
TRANSCODED = (
    b'[{"id":30,"text":"\\u003c","start":0,"stop":1},{"id":68,"text":"b","start":1,"stop":2},'
    b'{"id":32,"text":"\\u003e","start":2,"stop":3},{"id":8,"text":"&","start":3,"stop":4},'
    b'{"id":67,"text":"a","start":4,"stop":5},{"id":330,"text":"mp","start":5,"stop":7},'
    b'{"id":29,"text":";","start":7,"stop":8},{"id":30,"text":"\\u003c","start":8,"stop":9},'
    b'{"id":17,"text":"/","start":9,"stop":10},{"id":68,"text":"b","start":10,"stop":11},'
    b'{"id":32,"text":"\\u003e","start":11,"stop":12},{"id":223,"text":" ","start":12,"stop":13},'
    b'{"id":161,"text":"\\u2028","start":13,"stop":14},{"id":225,"text":"\\u2028","start":13,'
    b'"stop":14},{"id":104,"text":"\\u2028","start":13,"stop":14},{"id":161,"text":"\\u2029",'
    b'"start":14,"stop":15},{"id":225,"text":"\\u2029","start":14,"stop":15},{"id":105,'
    b'"text":"\\u2029","start":14,"stop":15}]'
)
PROMPT = "The capital of France is Paris. 日本語 🎉 café"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def post(http_server, path: str, body) -> requests.Response:
    return requests.post(f"{http_server.http_url}{path}", json=body, timeout=30)


def test_tgi_body_gets_the_transcoded_bytes(http_server, tokenizer):
    resp = post(http_server, "/tokenize", {"inputs": TRICKY})
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    assert resp.content == TRANSCODED
    truncated = post(http_server, "/tokenize", {"inputs": PROMPT, "parameters": {"truncate": 2}})
    assert [t["id"] for t in truncated.json()] == tokenizer(PROMPT)["input_ids"][-2:]
    refused = post(http_server, "/tokenize", {"inputs": ""})
    assert refused.status_code == 422 and refused.json() == {
        "error": "`inputs` cannot be empty",
        "error_type": "validation",
    }
    wrong = post(http_server, "/tokenize", {"inputs": "x", "parameters": {"truncate": "x"}})
    assert wrong.status_code == 422 and wrong.json()["error_type"] == "validation"


def test_proto_json_escapes_as_protobufs_printer():
    # protobuf's JSON printer (json/internal/writer.cc): JSON's escapes, then \\u escapes for
    # `<`, `>`, controls, DEL..U+009F and some invisible code points; the rest raw
    assert (
        proto_json_string('a"\\\n\t\x01\x7f<>&é')
        == '"a\\"\\\\\\n\\t\\u0001\\u007f\\u003c\\u003e&é"'
    )
    assert proto_json_string("\ufeff\u200b\u00ad🎉") == '"\\ufeff\\u200b\\u00ad🎉"'
    assert proto_json_string("\U0001d173\U000e0041") == '"\\ud834\\udd73\\udb40\\udc41"'


def test_vllm_prompt_round_trips(http_server, tokenizer):
    resp = post(http_server, "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert resp.status_code == 200, resp.text
    out = resp.json()
    ids = tokenizer(PROMPT)["input_ids"]
    assert out == {
        "count": len(ids),
        "max_model_len": http_server.settings.max_total_tokens,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids),
    }
    back = post(http_server, "/detokenize", {"tokens": out["tokens"], "model": "tgi"})
    assert back.status_code == 200 and back.json() == {"prompt": PROMPT}
    plain = post(http_server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert plain.json()["token_strs"] is None
    assert plain.json()["tokens"] == tokenizer(PROMPT, add_special_tokens=False)["input_ids"]


def test_vllm_messages_go_through_the_chat_template(http_server, tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]},
    ]
    plain = [messages[0], {"role": "user", "content": "What is the capital of France?"}]
    for options in ({}, {"add_generation_prompt": False}):
        resp = post(http_server, "/tokenize", {"messages": messages, **options})
        assert resp.status_code == 200, resp.text
        text = tokenizer.apply_chat_template(
            plain, tokenize=False, add_generation_prompt=options.get("add_generation_prompt", True)
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert resp.json()["tokens"] == ids and resp.json()["count"] == len(ids)
        back = post(http_server, "/detokenize", {"tokens": ids})
        assert back.json()["prompt"] == text


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "hi", "chat_template": "{{ x }}"}, "chat_template"),
        ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {}},
         "chat_template_kwargs"),
        ({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
         "continue_final_message"),
        ({"messages": []}, "messages"),
        ({"prompt": 3}, "prompt"),
        ({"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
    ],
)  # fmt: skip
def test_what_vllm_tokenize_cannot_honour_is_refused(http_server, body, field):
    resp = post(http_server, "/tokenize", body)
    assert resp.status_code == 422 and resp.json()["error_type"] == "validation"
    assert f"`{field}`" in resp.json()["error"]


def test_detokenize_refuses_ids_outside_the_vocabulary(http_server, tokenizer):
    for tokens in ([len(tokenizer)], [-1], [2**63 - 1]):
        resp = post(http_server, "/detokenize", {"tokens": tokens})
        assert resp.status_code == 422 and "`tokens[0]`" in resp.json()["error"]
    assert post(http_server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_version_names_the_commit(http_server):
    resp = requests.get(f"{http_server.http_url}/version", timeout=30)
    assert resp.status_code == 200
    info = requests.get(f"{http_server.http_url}/info", timeout=30).json()
    assert resp.json()["version"] == info["version"]
    commit = source_commit()  # this checkout's HEAD, or TEXTGEN_COMMIT
    assert commit and resp.json()["commit"] == commit == info["sha"]
