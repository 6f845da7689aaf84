"""What OpenAI clients call beyond one answer, through a real Envoy with the unmodified
`openai` SDK: `n` choices (streamed and not; the prompt computed once), completions'
`best_of`, `cached_tokens` in usage on a repeated long prompt (and in TGI's details),
and OpenAI's bounds on `top_p` and `top_logprobs`."""

from __future__ import annotations

import uuid
from collections import defaultdict

import openai
import pytest
import requests

pytestmark = pytest.mark.timeout(60)

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
SAMPLED = {"temperature": 1.0, "seed": 7}


@pytest.fixture(scope="module")
def client(http_server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{http_server.http_url}/v1", api_key="unused", max_retries=0, timeout=30
    )


def long_prompt(words: int = 60) -> str:
    """A prompt no other test sends (nothing of it is in the prefix cache yet)."""
    return f"{uuid.uuid4().hex} " + " ".join(f"word{i}" for i in range(words))


# n choices ----------------------------------------------------------------------------


def test_chat_n_choices_are_seeded_and_prefill_the_prompt_once(client, http_server):
    def chat(n: int, content: str):
        return client.chat.completions.create(
            model="tgi",
            messages=[{"role": "user", "content": content}],
            max_tokens=6,
            n=n,
            extra_body={"ignore_eos": True},
            **SAMPLED,
        )

    stats = http_server.engine.stats
    before = stats().prefill_tokens
    out = chat(3, prompt := long_prompt(20))
    prefilled = stats().prefill_tokens - before
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in out.choices)
    texts = [c.message.content for c in out.choices]
    assert len(set(texts)) > 1  # each choice samples with its own seed
    # one prompt: counted once, computed once; completion tokens of all three
    assert prefilled == out.usage.prompt_tokens
    assert (out.usage.completion_tokens, out.usage.total_tokens) == (
        18,
        out.usage.prompt_tokens + 18,
    )
    # the same seeded request, the same choices; the first is the n=1 answer of that seed
    again = chat(3, prompt)
    assert [c.message.content for c in again.choices] == texts
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # its prompt was cached
    assert chat(1, prompt).choices[0].message.content == texts[0]


def test_chat_n_choices_streamed_add_up_to_the_answer(client):
    body = {"model": "tgi", "messages": MESSAGES, "max_tokens": 8, "n": 3, **SAMPLED}
    full = client.chat.completions.create(**body)
    chunks = list(
        client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})
    )
    content, roles, reasons = defaultdict(str), defaultdict(int), {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices  # one choice per chunk, with its index
        content[choice.index] += choice.delta.content or ""
        roles[choice.index] += choice.delta.role == "assistant"
        if choice.finish_reason:
            reasons[choice.index] = choice.finish_reason
    assert dict(content) == {c.index: c.message.content for c in full.choices}
    assert dict(roles) == {0: 1, 1: 1, 2: 1}  # each choice opens with the role, once
    assert reasons == {c.index: c.finish_reason for c in full.choices}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_completions_n_choices_per_prompt_streamed_and_not(client):
    body = {
        "model": "tgi",
        "prompt": ["The quick brown fox", "Once upon a time"],
        "max_tokens": 5,
        "n": 3,
        **SAMPLED,
    }
    full = client.completions.create(**body)
    assert [c.index for c in full.choices] == list(range(6))  # prompt p, choice i: 3p + i
    streamed = defaultdict(str)
    for chunk in client.completions.create(**body, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert dict(streamed) == {c.index: c.text for c in full.choices}
    single = client.completions.create(**{**body, "prompt": body["prompt"][0], "n": 1})
    assert single.choices[0].text == full.choices[0].text
    # each prompt counted once
    assert full.usage.prompt_tokens == sum(
        client.completions.create(**{**body, "prompt": p, "n": 1}).usage.prompt_tokens
        for p in body["prompt"]
    )


def test_completions_best_of_answers_the_likeliest_n(client):
    body = {"model": "tgi", "prompt": "The quick brown fox", "max_tokens": 4, **SAMPLED}
    sampled = client.completions.create(**body, n=4, logprobs=0, extra_body={"ignore_eos": True})
    score = {c.text: sum(c.logprobs.token_logprobs) for c in sampled.choices}
    best = client.completions.create(**body, n=2, best_of=4, extra_body={"ignore_eos": True})
    assert [c.index for c in best.choices] == [0, 1]
    ranked = sorted(score, key=score.get, reverse=True)
    assert [c.text for c in best.choices] == ranked[:2]
    assert best.usage.completion_tokens == 4 * 4  # every sampled choice's tokens
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.completions.create(**body, n=2, best_of=4, stream=True)
    assert info.value.body["param"] == "best_of"


def test_n_beyond_the_servers_bounds_is_refused_with_param(client, http_server):
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(model="tgi", messages=MESSAGES, n=17)
    assert info.value.body["param"] == "n" and "<= 16" in info.value.body["message"]
    # 16 choices of up to 512 tokens each can't all be in the 4096-token KV cache at once
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(model="tgi", messages=MESSAGES, n=16)
    assert info.value.body["param"] == "n" and "KV cache" in info.value.body["message"]
    assert http_server.engine.stats().running == 0


# cached tokens -------------------------------------------------------------------------


def test_cached_tokens_count_a_repeated_long_prompt_on_every_route(client, http_server):
    messages = [{"role": "user", "content": long_prompt()}]
    first = client.chat.completions.create(model="tgi", messages=messages, max_tokens=2)
    second = client.chat.completions.create(model="tgi", messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and cached % 16 == 0  # whole blocks

    prompt = long_prompt()
    counts = [
        client.completions.create(model="tgi", prompt=prompt, max_tokens=2).usage for _ in range(2)
    ]
    assert counts[0].prompt_tokens_details.cached_tokens == 0
    assert counts[1].prompt_tokens_details.cached_tokens > 0

    text = long_prompt()
    usages = [
        client.responses.create(model="tgi", input=text, max_output_tokens=2).usage
        for _ in range(2)
    ]
    assert usages[0].input_tokens_details.cached_tokens == 0
    assert usages[1].input_tokens_details.cached_tokens > 0

    inputs = long_prompt()
    details = [
        requests.post(
            f"{http_server.http_url}/generate",
            json={"inputs": inputs, "parameters": {"max_new_tokens": 2, "details": True}},
            timeout=30,
        ).json()["details"]
        for _ in range(2)
    ]
    assert details[0]["cached_tokens"] == 0 and details[1]["cached_tokens"] > 0


# OpenAI's bounds -----------------------------------------------------------------------


def test_top_p_beyond_one_is_refused_with_param(client):
    for top_p in (1.5, 0):
        with pytest.raises(openai.UnprocessableEntityError) as info:
            client.chat.completions.create(
                model="tgi", messages=MESSAGES, max_tokens=2, top_p=top_p
            )
        assert info.value.body["param"] == "top_p"
        with pytest.raises(openai.UnprocessableEntityError) as info:
            client.completions.create(model="tgi", prompt="Hi", max_tokens=2, top_p=top_p)
        assert info.value.body["param"] == "top_p"
        with pytest.raises(openai.UnprocessableEntityError) as info:
            client.responses.create(model="tgi", input="Hi", max_output_tokens=2, top_p=top_p)
        assert info.value.body["param"] == "top_p"
    out = client.chat.completions.create(model="tgi", messages=MESSAGES, max_tokens=2, top_p=1)
    assert out.choices[0].message.content is not None


def test_top_logprobs_up_to_twenty(client):
    out = client.chat.completions.create(
        model="tgi", messages=MESSAGES, max_tokens=2, logprobs=True, top_logprobs=20
    )
    assert all(len(t.top_logprobs) == 20 for t in out.choices[0].logprobs.content)
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(
            model="tgi", messages=MESSAGES, max_tokens=2, logprobs=True, top_logprobs=21
        )
    assert info.value.body["param"] == "top_logprobs"
