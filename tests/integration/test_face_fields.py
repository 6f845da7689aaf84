"""Every request field a face declares (envoy/openapi.json) is honoured or refused, never
silently ignored: for each one, through the real Envoy and the tiny model, a request
with the field set is answered differently from the same request without it (or is
refused with 422), unless its description says it is accepted for compatibility only.
A field added to the description without a probe here fails the walk."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import requests
from support.servers import ServerThread, tiny_settings
from support.tiers import server_fixture
from transformers import AutoTokenizer

pytestmark = pytest.mark.timeout(60)

OPENAPI = json.loads((Path(__file__).parents[2] / "envoy" / "openapi.json").read_text())
SCHEMAS = OPENAPI["components"]["schemas"]
COMPATIBILITY_ONLY = "Accepted for compatibility only"
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@server_fixture(scope="module")
def server(tiny_model_dir):
    # the tiny model's whole context: tools are described in ~530 of its byte-sized tokens
    srv = ServerThread(tiny_settings(tiny_model_dir, max_total_tokens=1024), http=True).start()
    yield srv
    srv.stop()


def post(server, path: str, body: dict) -> tuple[int, object]:
    resp = requests.post(f"{server.http_url}{path}", json=body, timeout=30)
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        return resp.status_code, [
            line[5:].strip() for line in resp.text.splitlines() if line.startswith("data:")
        ]
    return resp.status_code, resp.json()


VARYING = ("id", "created", "created_at", "completed_at")  # on every call


def refusal(path: str) -> int:
    """The status a refused request gets: 422 (TGI's), 400 on Anthropic's face."""
    return 400 if path.startswith(MESSAGES_PATH) else 422


def answer(server, path: str, body: dict):
    """What a client sees, minus what changes on every call (ids, times)."""
    status, out = post(server, path, body)
    assert status in (200, refusal(path)), (status, out)
    if status == refusal(path):
        return "refused", out
    if isinstance(out, dict):
        out = {k: v for k, v in out.items() if k not in VARYING}
        if out.get("object") == "response":  # its items' ids too
            out["output"] = [
                {k: v for k, v in item.items() if k not in ("id", "call_id")}
                for item in out["output"]
            ]
        if out.get("details"):
            out["details"] = {k: v for k, v in out["details"].items() if k != "timings"}
    return out


# the faces: a base request, and how a field's value is set on it ----------------------


def tgi(**parameters) -> dict:
    return {"inputs": PROMPT, "parameters": {"max_new_tokens": 8, "details": True, **parameters}}


def chat(**fields) -> dict:
    return {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, **fields}


def completion(**fields) -> dict:
    return {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **fields}


MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"


def message(**fields) -> dict:
    return {"model": "tgi", "messages": MESSAGES, "max_tokens": 8, "temperature": 0, **fields}


def counted(**fields) -> dict:
    return {"model": "tgi", "messages": MESSAGES, **fields}


def response(**fields) -> dict:
    return {"input": MESSAGES[0]["content"], "max_output_tokens": 8, "temperature": 0, **fields}


HOT = {"temperature": 5.0, "seed": 3}  # sampled, wide: sampling knobs show
SAMPLED_TGI = {"do_sample": True, **HOT}


def accepted(server, path: str, body: dict):
    out = answer(server, path, body)
    assert not isinstance(out, tuple), (body, out)  # ("refused", error)
    return out


def differs(path: str, base: dict, changed: dict):
    """Both accepted, and answered differently."""

    def probe(server):
        assert accepted(server, path, base) != accepted(server, path, changed)

    return probe


def refused(path: str, body: dict):
    def probe(server):
        status, out = post(server, path, body)
        assert status == refusal(path), (status, out)

    return probe


def base_model(path: str, body: dict):
    """A server without LoRA adapters takes any `model` as its base model and names the
    base in the answer (tests/integration/test_lora.py picks adapters by it)."""

    def probe(server):
        status, out = post(server, path, body)
        info = requests.get(f"{server.http_url}/info", timeout=30).json()
        assert status == 200 and out["model"] == info["model_id"], out

    return probe


def checks(path: str, body: dict, predicate):
    def probe(server):
        status, out = post(server, path, body)
        assert status == 200, out
        assert predicate(out), out

    return probe


def a_stop_sequence(server) -> tuple[str, str]:
    """An 8-token answer and a stop sequence inside it: the text of one of its tokens
    after the first (whole characters)."""
    out = answer(server, "/generate", tgi(ignore_eos=True))
    texts = [t["text"] for t in out["details"]["tokens"]]
    stop = next(t for t in texts[1:] if t.strip() and t.isprintable() and "\ufffd" not in t)
    return out["generated_text"], stop


def tgi_stop(server):
    text, stop = a_stop_sequence(server)
    out = answer(server, "/generate", tgi(ignore_eos=True, stop=[stop]))
    assert out["details"]["finish_reason"] == "stop_sequence"
    assert out["generated_text"].endswith(stop) and len(out["generated_text"]) < len(text)


def openai_stop(path: str, make):
    def probe(server):
        out = accepted(server, path, make(ignore_eos=True))
        choice = out["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        stop = text[len(text) // 2 :][:2]
        choice = accepted(server, path, make(ignore_eos=True, stop=stop))["choices"][0]
        cut = choice["message"]["content"] if "message" in choice else choice["text"]
        assert choice["finish_reason"] == "stop" and len(cut) < len(text)  # stop left out

    return probe


def eos_id(server) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.settings.model_id).eos_token_id


def ignore_eos(path: str, make, key: str = "logit_bias"):
    """Pushed onto EOS at once, the answer stops after one token unless EOS is ignored."""

    def probe(server):
        bias = {key: {str(eos_id(server)): 100}}
        stopped, ignored = make(**bias), make(ignore_eos=True, **bias)
        assert accepted(server, path, stopped) != accepted(server, path, ignored)

    return probe


def counted_by_priority(path: str, make):
    """A request's priority shows in the metrics of requests by priority."""

    def probe(server):
        def count() -> float:
            text = requests.get(f"{server.http_url}/metrics", timeout=10).text
            line = 'textgen_requests_by_priority_total{priority="7"} '
            return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0)

        before = count()
        accepted(server, path, make(priority=7))
        assert count() == before + 1

    return probe


def logit_bias(path: str, make):
    def probe(server):
        assert accepted(server, path, make()) != accepted(
            server, path, make(logit_bias={"65": 100})
        )

    return probe


def tgi_logit_bias(server):
    out = answer(server, "/generate", tgi(ignore_eos=True, logit_bias={"65": 100}))
    assert [t["id"] for t in out["details"]["tokens"]] == [65] * 8


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


def json_answer(out) -> bool:
    return json.loads(out["choices"][0]["message"]["content"])["answer"] in ("yes", "no")


# /v1/responses ------------------------------------------------------------------------

RESPONSES = "/v1/responses"
RESPONSE_TOOL = {"type": "function", **TOOL["function"]}  # the Responses' flat shape
LOGPROBS = ["message.output_text.logprobs"]
# Greedy answers of the tiny model that end at EOS, found by trying prompts (it rarely
# stops): the probe takes the first that does.
EOS_PROMPTS = ["HTTP emoji the large models naïve", "over emoji serves", "Hi"]


def output_text(out: dict) -> str:
    return "".join(c["text"] for item in out["output"] for c in item.get("content", []))


def responses_ignore_eos(server):
    """An answer that ends at EOS runs to max_output_tokens with ignore_eos."""
    for prompt in EOS_PROMPTS:
        stopped = accepted(server, RESPONSES, response(input=prompt, max_output_tokens=40))
        if stopped["status"] == "completed":
            break
    else:
        pytest.fail(f"none of {EOS_PROMPTS} ends at EOS on this model: add one that does")
    assert stopped["usage"]["output_tokens"] < 40
    ignored = accepted(
        server, RESPONSES, response(input=prompt, max_output_tokens=40, ignore_eos=True)
    )
    assert ignored["status"] == "incomplete" and ignored["usage"]["output_tokens"] == 40


def greedy_at_any_temperature(field: str, value):
    """Sampling hot, `field` leaves only the most probable token: the greedy answer."""

    def probe(server):
        greedy = output_text(accepted(server, RESPONSES, response()))
        hot = response(temperature=5.0, **{field: value})
        assert output_text(accepted(server, RESPONSES, hot)) == greedy

    return probe


def previous_response_id(server):
    """A stored response's conversation comes before the new input."""
    status, first = post(server, RESPONSES, response())
    assert status == 200 and first["store"] is True, first
    followed = response(input="Hi", previous_response_id=first["id"])
    assert accepted(server, RESPONSES, response(input="Hi")) != accepted(
        server, RESPONSES, followed
    )


def store(server):
    status, out = post(server, RESPONSES, response(store=False))
    assert status == 200 and out["store"] is False, out
    status, refusal = post(server, RESPONSES, response(previous_response_id=out["id"]))
    assert status == 422 and refusal["error"]["param"] == "previous_response_id", refusal


# Anthropic's /v1/messages

MESSAGES_TOOL = {"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}


def message_text(out: dict) -> str:
    return "".join(block.get("text", "") for block in out["content"])


def anthropic_stop(server):
    text = message_text(accepted(server, MESSAGES_PATH, message(max_tokens=16)))
    stop = text[len(text) // 2 :][:2]
    out = accepted(server, MESSAGES_PATH, message(max_tokens=16, stop_sequences=[stop]))
    assert (out["stop_reason"], out["stop_sequence"]) == ("stop_sequence", stop), out
    assert message_text(out) == text[: text.find(stop)]


def message_greedy_at_any_temperature(field: str, value):
    """Sampling hot, `field` leaves only the most probable token: the greedy answer."""

    def probe(server):
        greedy = message_text(accepted(server, MESSAGES_PATH, message()))
        hot = message(temperature=1.0, **{field: value})
        assert message_text(accepted(server, MESSAGES_PATH, hot)) == greedy

    return probe


# vLLM's /tokenize and /detokenize


def vllm_prompt(**fields) -> dict:
    return {"prompt": PROMPT, **fields}


def vllm_chat(**fields) -> dict:
    return {"messages": MESSAGES, **fields}


def special_tokens_as_the_tokenizer_adds_them(make, default: bool):
    """The ids are the model tokenizer's with and without its special tokens (the tiny
    tokenizer adds none, so an answer can't differ; it must still be the tokenizer's)."""

    def probe(server):
        tokenizer = AutoTokenizer.from_pretrained(server.settings.model_id)
        for flag in (True, False):
            status, out = post(server, "/tokenize", make(add_special_tokens=flag))
            assert status == 200, out
            text = (
                PROMPT
                if "prompt" in make()
                else tokenizer.apply_chat_template(
                    MESSAGES, tokenize=False, add_generation_prompt=True
                )
            )
            assert out["tokens"] == tokenizer(text, add_special_tokens=flag)["input_ids"]
        assert (
            post(server, "/tokenize", make())[1]
            == post(server, "/tokenize", make(add_special_tokens=default))[1]
        )

    return probe


def token_strs(make):
    return checks(
        "/tokenize", make(return_token_strs=True), lambda o: len(o["token_strs"]) == o["count"]
    )


PROBES = {
    "GenerateParameters": {
        "adapter_id": refused("/generate", tgi(adapter_id="my-lora")),
        "best_of": checks(
            "/generate",
            tgi(best_of=2, do_sample=True),
            lambda o: len(o["details"]["best_of_sequences"]) == 1,
        ),
        "decoder_input_details": checks(
            "/generate", tgi(decoder_input_details=True), lambda o: o["details"]["prefill"]
        ),
        "details": checks("/generate", tgi(details=False), lambda o: o.get("details") is None),
        "do_sample": differs("/generate", tgi(seed=3), tgi(do_sample=True, seed=3)),
        "frequency_penalty": differs(
            "/generate",
            tgi(ignore_eos=True, max_new_tokens=32),
            tgi(ignore_eos=True, max_new_tokens=32, frequency_penalty=2.0),
        ),
        "grammar": checks(
            "/generate",
            tgi(grammar={"type": "regex", "value": "[0-9]{3}"}),
            lambda o: re.fullmatch("[0-9]{3}", o["generated_text"]),
        ),
        "ignore_eos": ignore_eos("/generate", tgi),
        "logit_bias": tgi_logit_bias,
        "max_new_tokens": checks(
            "/generate",
            tgi(ignore_eos=True, max_new_tokens=3),
            lambda o: o["details"]["generated_tokens"] == 3,
        ),
        "max_time": checks(
            "/generate",
            tgi(ignore_eos=True, max_new_tokens=200, max_time=0.001),
            lambda o: o["details"]["finish_reason"] == "time_limit",
        ),
        "priority": counted_by_priority("/generate", tgi),
        "presence_penalty": differs(
            "/generate",
            tgi(ignore_eos=True, max_new_tokens=32),
            tgi(ignore_eos=True, max_new_tokens=32, presence_penalty=2.0),
        ),
        "repetition_penalty": differs(
            "/generate",
            tgi(ignore_eos=True, max_new_tokens=32),
            tgi(ignore_eos=True, max_new_tokens=32, repetition_penalty=5.0),
        ),
        "return_full_text": checks(
            "/generate",
            tgi(return_full_text=True),
            lambda o: o["generated_text"].startswith(PROMPT),
        ),
        "seed": differs("/generate", tgi(**SAMPLED_TGI), tgi(**{**SAMPLED_TGI, "seed": 4})),
        "stop": tgi_stop,
        "temperature": differs(
            "/generate", tgi(do_sample=True, seed=3, temperature=0.1), tgi(**SAMPLED_TGI)
        ),
        "top_k": differs("/generate", tgi(**SAMPLED_TGI), tgi(**SAMPLED_TGI, top_k=1)),
        "top_n_tokens": checks(
            "/generate", tgi(top_n_tokens=3), lambda o: len(o["details"]["top_tokens"][0]) == 3
        ),
        "top_p": differs("/generate", tgi(**SAMPLED_TGI), tgi(**SAMPLED_TGI, top_p=0.01)),
        "truncate": checks(
            "/generate", tgi(truncate=2), lambda o: o["details"]["input_length"] == 2
        ),
        "typical_p": differs("/generate", tgi(**SAMPLED_TGI), tgi(**SAMPLED_TGI, typical_p=0.01)),
        "watermark": differs(
            "/generate", tgi(**SAMPLED_TGI), tgi(**SAMPLED_TGI, watermark=True, max_new_tokens=8)
        ),
    },
    "ChatRequest": {
        "model": base_model("/v1/chat/completions", chat(model="gpt-4o")),
        "frequency_penalty": differs(
            "/v1/chat/completions",
            chat(ignore_eos=True, max_tokens=32),
            chat(ignore_eos=True, max_tokens=32, frequency_penalty=2.0),
        ),
        "ignore_eos": ignore_eos("/v1/chat/completions", chat),
        "logit_bias": logit_bias("/v1/chat/completions", chat),
        "logprobs": checks(
            "/v1/chat/completions",
            chat(logprobs=True),
            lambda o: o["choices"][0]["logprobs"]["content"],
        ),
        "max_completion_tokens": checks(
            "/v1/chat/completions",
            chat(ignore_eos=True, max_completion_tokens=3),
            lambda o: o["usage"]["completion_tokens"] == 3,
        ),
        "max_tokens": checks(
            "/v1/chat/completions",
            chat(ignore_eos=True, max_tokens=3),
            lambda o: o["usage"]["completion_tokens"] == 3,
        ),
        "messages": differs(
            "/v1/chat/completions", chat(), chat(messages=[{"role": "user", "content": "Hi"}])
        ),
        "n": checks(
            "/v1/chat/completions",
            chat(n=2),
            lambda o: [c["index"] for c in o["choices"]] == [0, 1],
        ),
        "parallel_tool_calls": refused(
            "/v1/chat/completions", chat(tools=[TOOL], parallel_tool_calls="yes")
        ),
        "priority": counted_by_priority("/v1/chat/completions", chat),
        "presence_penalty": differs(
            "/v1/chat/completions",
            chat(ignore_eos=True, max_tokens=32),
            chat(ignore_eos=True, max_tokens=32, presence_penalty=2.0),
        ),
        "repetition_penalty": differs(
            "/v1/chat/completions",
            chat(ignore_eos=True, max_tokens=32),
            chat(ignore_eos=True, max_tokens=32, repetition_penalty=5.0),
        ),
        "response_format": checks(
            "/v1/chat/completions",
            chat(max_tokens=60, response_format={"type": "json_object", "value": ANSWER_SCHEMA}),
            json_answer,
        ),
        "seed": differs("/v1/chat/completions", chat(**HOT), chat(**{**HOT, "seed": 4})),
        "stop": openai_stop("/v1/chat/completions", chat),
        "stream": checks("/v1/chat/completions", chat(stream=True), lambda o: o[-1] == "[DONE]"),
        "stream_options": checks(
            "/v1/chat/completions",
            chat(stream=True, stream_options={"include_usage": True}),
            lambda o: json.loads(o[-2])["usage"]["completion_tokens"] > 0,
        ),
        "temperature": differs("/v1/chat/completions", chat(), chat(**HOT)),
        "tool_choice": checks(
            "/v1/chat/completions",
            chat(max_tokens=100, tools=[TOOL], tool_choice="required"),
            lambda o: (
                o["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
            ),
        ),
        "tool_prompt": differs(
            "/v1/chat/completions", chat(tools=[TOOL]), chat(tools=[TOOL], tool_prompt="Be brief.")
        ),
        # the tiny model's template reads neither: a thinking template's do
        # (tests/integration/test_reasoning.py)
        "chat_template_kwargs": refused(
            "/v1/chat/completions", chat(chat_template_kwargs={"add_generation_prompt": False})
        ),
        "reasoning_effort": refused("/v1/chat/completions", chat(reasoning_effort="max")),
        "tools": differs(
            "/v1/chat/completions", chat(), chat(max_tokens=8, tools=[TOOL], tool_choice="required")
        ),
        "top_k": differs("/v1/chat/completions", chat(**HOT), chat(**HOT, top_k=1)),
        "top_logprobs": checks(
            "/v1/chat/completions",
            chat(logprobs=True, top_logprobs=2),
            lambda o: len(o["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2,
        ),
        "top_p": differs("/v1/chat/completions", chat(**HOT), chat(**HOT, top_p=0.01)),
    },
    "ResponsesRequest": {
        "model": base_model(RESPONSES, response(model="gpt-4o")),
        "ignore_eos": responses_ignore_eos,
        "include": checks(
            RESPONSES,
            response(include=LOGPROBS),
            lambda o: o["output"][0]["content"][0]["logprobs"],
        ),
        "input": differs(RESPONSES, response(), response(input="Hi")),
        "instructions": differs(RESPONSES, response(), response(instructions="Be brief.")),
        "max_output_tokens": checks(
            RESPONSES,
            response(ignore_eos=True, max_output_tokens=3),
            lambda o: o["usage"]["output_tokens"] == 3 and o["status"] == "incomplete",
        ),
        "metadata": checks(
            RESPONSES, response(metadata={"k": "v"}), lambda o: o["metadata"] == {"k": "v"}
        ),
        "parallel_tool_calls": refused(
            RESPONSES, response(tools=[RESPONSE_TOOL], parallel_tool_calls="yes")
        ),
        "previous_response_id": previous_response_id,
        "priority": counted_by_priority(RESPONSES, response),
        "repetition_penalty": differs(
            RESPONSES,
            response(ignore_eos=True, max_output_tokens=32),
            response(ignore_eos=True, max_output_tokens=32, repetition_penalty=5.0),
        ),
        "store": store,
        "stream": checks(
            RESPONSES,
            response(stream=True),
            lambda o: json.loads(o[-1])["type"] in ("response.completed", "response.incomplete"),
        ),
        "temperature": differs(RESPONSES, response(), response(temperature=5.0)),
        "text": checks(
            RESPONSES,
            response(
                max_output_tokens=60,
                text={"format": {"type": "json_schema", "name": "a", "schema": ANSWER_SCHEMA}},
            ),
            lambda o: json.loads(output_text(o))["answer"] in ("yes", "no"),
        ),
        "tool_choice": checks(
            RESPONSES,
            response(max_output_tokens=150, tools=[RESPONSE_TOOL], tool_choice="required"),
            lambda o: o["output"][0]["name"] == "get_weather",
        ),
        "tools": differs(
            RESPONSES,
            response(),
            response(tools=[RESPONSE_TOOL], tool_choice="required"),
        ),
        "top_k": greedy_at_any_temperature("top_k", 1),
        "top_logprobs": checks(
            RESPONSES,
            response(include=LOGPROBS, top_logprobs=2),
            lambda o: len(o["output"][0]["content"][0]["logprobs"][0]["top_logprobs"]) == 2,
        ),
        "top_p": greedy_at_any_temperature("top_p", 1e-6),
        "truncation": refused(RESPONSES, response(truncation="auto")),
        # the effort reaches the template (tests/integration/test_reasoning.py); summaries
        # are refused
        "reasoning": refused(RESPONSES, response(reasoning={"summary": "auto"})),
    },
    "MessagesRequest": {
        "model": base_model(MESSAGES_PATH, message(model="claude-sonnet-4-5")),
        "max_tokens": checks(
            MESSAGES_PATH, message(max_tokens=3), lambda o: o["usage"]["output_tokens"] <= 3
        ),
        "messages": differs(
            MESSAGES_PATH, message(), message(messages=[{"role": "user", "content": "Hi"}])
        ),
        # user_id is accepted for compatibility; anything else is refused
        "metadata": refused(MESSAGES_PATH, message(metadata={"user_id": "u", "tier": "gold"})),
        "stop_sequences": anthropic_stop,
        "stream": checks(
            MESSAGES_PATH,
            message(stream=True),
            lambda o: json.loads(o[-1])["type"] == "message_stop",
        ),
        "system": differs(MESSAGES_PATH, message(), message(system="Be brief.")),
        "temperature": differs(MESSAGES_PATH, message(), message(temperature=1.0)),
        # the tiny model does not think (tests/integration/test_reasoning.py: one that does)
        "thinking": refused(
            MESSAGES_PATH, message(thinking={"type": "enabled", "budget_tokens": 4})
        ),
        "tool_choice": checks(
            MESSAGES_PATH,
            message(max_tokens=100, tools=[MESSAGES_TOOL], tool_choice={"type": "any"}),
            lambda o: o["content"][0]["name"] == "get_weather",
        ),
        "tools": differs(
            MESSAGES_PATH,
            message(),
            message(tools=[MESSAGES_TOOL], tool_choice={"type": "any"}),
        ),
        "top_k": message_greedy_at_any_temperature("top_k", 1),
        "top_p": message_greedy_at_any_temperature("top_p", 1e-6),
    },
    "CountTokensRequest": {
        "messages": differs(
            COUNT_TOKENS, counted(), counted(messages=[{"role": "user", "content": "Hi"}])
        ),
        "system": differs(COUNT_TOKENS, counted(), counted(system="Be brief.")),
        "thinking": refused(
            COUNT_TOKENS, counted(thinking={"type": "enabled", "budget_tokens": 4})
        ),
        "tool_choice": differs(
            COUNT_TOKENS,
            counted(tools=[MESSAGES_TOOL]),
            counted(tools=[MESSAGES_TOOL], tool_choice={"type": "none"}),
        ),
        "tools": differs(COUNT_TOKENS, counted(), counted(tools=[MESSAGES_TOOL])),
    },
    "CompletionRequest": {
        "model": base_model("/v1/completions", completion(model="gpt-4o")),
        "best_of": checks(  # three sampled, the likeliest answered
            "/v1/completions",
            completion(**HOT, best_of=3, ignore_eos=True),
            lambda o: len(o["choices"]) == 1 and o["usage"]["completion_tokens"] == 3 * 8,
        ),
        "echo": checks(
            "/v1/completions",
            completion(echo=True),
            lambda o: o["choices"][0]["text"].startswith(PROMPT),
        ),
        "frequency_penalty": differs(
            "/v1/completions",
            completion(ignore_eos=True, max_tokens=32),
            completion(ignore_eos=True, max_tokens=32, frequency_penalty=2.0),
        ),
        "ignore_eos": ignore_eos("/v1/completions", completion),
        "logit_bias": logit_bias("/v1/completions", completion),
        "logprobs": checks(
            "/v1/completions",
            completion(logprobs=2),
            lambda o: len(o["choices"][0]["logprobs"]["top_logprobs"][0]) == 2,
        ),
        "max_tokens": checks(
            "/v1/completions",
            completion(ignore_eos=True, max_tokens=3),
            lambda o: o["usage"]["completion_tokens"] == 3,
        ),
        "n": checks(
            "/v1/completions",
            completion(n=2),
            lambda o: [c["index"] for c in o["choices"]] == [0, 1],
        ),
        "priority": counted_by_priority("/v1/completions", completion),
        "presence_penalty": differs(
            "/v1/completions",
            completion(ignore_eos=True, max_tokens=32),
            completion(ignore_eos=True, max_tokens=32, presence_penalty=2.0),
        ),
        "prompt": differs("/v1/completions", completion(), completion(prompt="Hello")),
        "repetition_penalty": differs(
            "/v1/completions",
            completion(ignore_eos=True, max_tokens=32),
            completion(ignore_eos=True, max_tokens=32, repetition_penalty=5.0),
        ),
        "seed": differs("/v1/completions", completion(**HOT), completion(**{**HOT, "seed": 4})),
        "stop": openai_stop("/v1/completions", completion),
        "stream": checks("/v1/completions", completion(stream=True), lambda o: o[-1] == "[DONE]"),
        "stream_options": checks(
            "/v1/completions",
            completion(stream=True, stream_options={"include_usage": True}),
            lambda o: json.loads(o[-2])["usage"]["completion_tokens"] > 0,
        ),
        "suffix": refused("/v1/completions", completion(suffix="end")),
        "temperature": differs("/v1/completions", completion(), completion(**HOT)),
        "top_k": differs("/v1/completions", completion(**HOT), completion(**HOT, top_k=1)),
        "top_p": differs("/v1/completions", completion(**HOT), completion(**HOT, top_p=0.01)),
    },
    "VllmTokenizeRequest": {
        "prompt": differs("/tokenize", vllm_prompt(), vllm_prompt(prompt="Hello")),
        "add_special_tokens": special_tokens_as_the_tokenizer_adds_them(vllm_prompt, True),
        "return_token_strs": token_strs(vllm_prompt),
    },
    "VllmTokenizeChatRequest": {
        "messages": differs(
            "/tokenize", vllm_chat(), vllm_chat(messages=[{"role": "user", "content": "Hi"}])
        ),
        "add_generation_prompt": differs(
            "/tokenize", vllm_chat(), vllm_chat(add_generation_prompt=False)
        ),
        "continue_final_message": differs(
            "/tokenize",
            vllm_chat(add_generation_prompt=False),
            vllm_chat(add_generation_prompt=False, continue_final_message=True),
        ),
        "add_special_tokens": special_tokens_as_the_tokenizer_adds_them(vllm_chat, False),
        "return_token_strs": token_strs(vllm_chat),
        "tools": differs(
            "/tokenize",
            vllm_chat(),
            vllm_chat(tools=[{"type": "function", "function": {"name": "get_time"}}]),
        ),
    },
    "DetokenizeRequest": {
        "tokens": differs("/detokenize", {"tokens": [70, 71]}, {"tokens": [72]}),
    },
}


def declared(schema: str) -> list[tuple[str, str]]:
    return [(schema, name) for name in sorted(SCHEMAS[schema]["properties"])]


FIELDS = [f for schema in PROBES for f in declared(schema)]


def is_compatibility_only(schema: str, name: str) -> bool:
    return COMPATIBILITY_ONLY in SCHEMAS[schema]["properties"][name].get("description", "")


def test_every_declared_field_has_a_probe_or_says_it_does_nothing():
    missing = [
        f"{schema}.{name}"
        for schema, name in FIELDS
        if name not in PROBES[schema] and not is_compatibility_only(schema, name)
    ]
    assert not missing, f"declared fields with no probe here: {missing}"
    stale = [f"{s}.{n}" for s, probes in PROBES.items() for n in probes if (s, n) not in FIELDS]
    assert not stale, f"probes of fields the description no longer declares: {stale}"


@pytest.mark.parametrize(
    ("schema", "name"),
    [f for f in FIELDS if f[1] in PROBES[f[0]]],
    ids=[f"{s}.{n}" for s, n in FIELDS if n in PROBES[s]],
)
def test_field_is_honoured_or_refused(server, schema, name):
    PROBES[schema][name](server)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat(functions=[{"name": "f"}])),
        ("/v1/chat/completions", chat(verbosity="high")),
        ("/v1/completions", completion(min_p=0.1)),
        (RESPONSES, response(service_tier="auto")),
        (RESPONSES, response(background=False)),
        (RESPONSES, response(stop=["."])),
        (MESSAGES_PATH, message(service_tier="auto")),
        (MESSAGES_PATH, message(frequency_penalty=1.0)),
        (COUNT_TOKENS, counted(max_tokens=8)),
    ],
)
def test_undeclared_openai_fields_are_refused_by_name(server, path, body):
    status, out = post(server, path, body)
    assert status == refusal(path)
    field = list(body)[-1]  # the one each case adds to its base request
    assert f"`{field}`" in out["error"]["message"]


@pytest.mark.parametrize("field", ["\u001f", "naïve", 'a"b\\c\nd%41'])
def test_a_refused_field_is_named_as_sent(server, field):
    """The blamed field reaches Envoy in a trailer, which holds printable ASCII only: any
    name (a control character, non-ASCII; the fuzzer's `{"\\u001f": []}` was a 500)
    comes back intact as OpenAI's `param`."""
    status, out = post(server, "/v1/completions", completion(**{field: []}))
    assert status == 422
    assert out["error"]["param"] == field


def test_compatibility_only_fields_change_nothing(server):
    base = accepted(server, "/v1/chat/completions", chat())
    assert accepted(server, "/v1/chat/completions", chat(model="x", user="u1")) == base
    base = accepted(server, RESPONSES, response())
    assert accepted(server, RESPONSES, response(model="x", user="u1", prompt_cache_key="k")) == base
