"""Reasoning models through the real server, Envoy and the unmodified openai SDK (and
anthropic's, for the Messages API's thinking blocks): a tiny random model whose chat
template writes Qwen3.5's thinking prompt (the generation prompt opens `<think>\\n`;
`enable_thinking: false` closes an empty block instead), with `<think>` and `</think>` as
tokens of its own, and `</think>`'s output row made a little longer than the row of the
token its greedy output writes a few steps in: the greedy output thinks for those steps,
closes the thinking once, and answers. What chat completions, the Responses API and the
Messages API answer (the reasoning, the content, reasoning_tokens; streamed and not) is
checked against the same greedy output taken raw through /v1/completions and split by
hand."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from support.servers import ServerThread, tiny_settings
from support.tiers import server_fixture
from support.tiny_model import build_tiny_model

pytestmark = pytest.mark.timeout(120)

THINKING_TEMPLATE = (
    "{% if reasoning_effort is defined %}<|im_start|>system\nReasoning: {{ reasoning_effort }}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
QUESTION = "What is the capital of France?"
MESSAGES = [{"role": "user", "content": QUESTION}]
MAX_TOKENS = 40


def prompt_of(tokenizer, **kwargs) -> str:
    return tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs
    )


@pytest.fixture(scope="module")
def thinking_model_dir(tmp_path_factory):
    """The tiny Llama with `<think>`/`</think>` added as tokens, the thinking template,
    and an lm_head under which greedy decoding closes the thinking once, a few tokens in."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(tmp_path_factory.mktemp("thinking") / "model", seed=1)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = THINKING_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(path)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    ids = tokenizer(prompt_of(tokenizer), add_special_tokens=False, return_tensors="pt").input_ids

    def greedy() -> list[int]:
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=tokenizer.pad_token_id,
        )
        return out[0, ids.shape[1] :].tolist()

    plain, close = greedy(), tokenizer.convert_tokens_to_ids("</think>")
    rows = model.get_output_embeddings().weight
    with torch.no_grad():
        for step in range(4, 12):  # `</think>` a little above the token written at `step`
            rows[close] = rows[plain[step]] * 1.05
            out = greedy()
            if out.count(close) == 1 and 3 <= out.index(close) < MAX_TOKENS - 8:
                break
        else:
            pytest.fail("no lm_head row closes the thinking once")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@server_fixture(scope="module")
def server(thinking_model_dir):
    # --reasoning-parser auto: the template writes <think>
    # the whole context: tools are described in ~500 of its byte-sized tokens
    srv = ServerThread(tiny_settings(thinking_model_dir, max_total_tokens=1024), http=True).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=30
    )


@pytest.fixture(scope="module")
def tokenizer(thinking_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(thinking_model_dir)


def raw(client, prompt: str) -> tuple[str, list[str]]:
    """The greedy output of the templated prompt, unparsed, and its tokens."""
    out = client.completions.create(
        model="tgi",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    return out.choices[0].text, out.choices[0].logprobs.tokens


def closing(tokens: list[str]) -> int:
    """The index of the token that closes the thinking (-1: none)."""
    return next((i for i, t in enumerate(tokens) if "</think>" in t), -1)


@pytest.fixture(scope="module")
def thought(client, tokenizer) -> tuple[str, list[str]]:
    """The raw greedy output (it thinks, closes the thinking, answers) and its tokens."""
    text, tokens = raw(client, prompt_of(tokenizer))
    assert closing(tokens) >= 3 and text.count("</think>") == 1, tokens
    return text, tokens


def split(text: str) -> tuple[str, str]:
    """The thinking and the answer, as the parser should tell them apart."""
    reasoning, _, content = text.partition("</think>")
    return reasoning.strip(), content.lstrip()


def chat(client, **fields):
    defaults = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
    return client.chat.completions.create(model="tgi", messages=MESSAGES, **{**defaults, **fields})


def test_reasoning_and_content_apart(client, thought):
    text, tokens = thought
    out = chat(client)
    message = out.choices[0].message
    reasoning, content = split(text)
    assert reasoning and content
    assert message.reasoning_content == reasoning
    assert message.reasoning == reasoning
    assert message.content == content
    assert out.usage.completion_tokens == MAX_TOKENS
    assert out.usage.completion_tokens_details.reasoning_tokens == closing(tokens) + 1


def test_streamed_equals_whole(client, thought):
    text, tokens = thought
    stream = chat(client, stream=True, stream_options={"include_usage": True})
    kinds, reasoning, content, usage = [], [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            piece = getattr(delta, "reasoning_content", None)
            if piece:
                assert delta.reasoning == piece
                reasoning.append(piece)
                kinds.append("reasoning")
            if delta.content:
                content.append(delta.content)
                kinds.append("content")
    assert ("".join(reasoning), "".join(content)) == split(text)
    assert kinds == sorted(kinds, key=["reasoning", "content"].index)  # thinking first
    assert not any("think>" in piece for piece in reasoning + content)  # the tags in neither
    assert usage.completion_tokens_details.reasoning_tokens == closing(tokens) + 1


def test_thinking_off_is_all_content(client, tokenizer):
    off = prompt_of(tokenizer, enable_thinking=False)
    text, _ = raw(client, off)
    out = chat(
        client,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
    )
    message = out.choices[0].message
    assert message.reasoning_content is None and message.reasoning is None
    assert message.content == text
    assert out.usage.completion_tokens_details.reasoning_tokens == 0
    assert out.usage.prompt_tokens == len(tokenizer(off, add_special_tokens=False).input_ids)


def test_reasoning_effort_reaches_the_template(client, tokenizer):
    effort = prompt_of(tokenizer, reasoning_effort="high")
    with_effort = len(tokenizer(effort, add_special_tokens=False).input_ids)
    out = chat(client, max_tokens=1, reasoning_effort="high")
    assert out.usage.prompt_tokens == with_effort
    assert chat(client, max_tokens=1).usage.prompt_tokens < with_effort
    out = client.responses.create(
        model="tgi", input=QUESTION, max_output_tokens=1, reasoning={"effort": "high"}
    )
    assert out.usage.input_tokens == with_effort
    assert out.reasoning.effort == "high"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"extra_body": {"chat_template_kwargs": {"add_generation_prompt": False}}}, None),
        ({"extra_body": {"chat_template_kwargs": {"messages": []}}}, None),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ],
)
def test_refused_with_422(client, fields, param):
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(model="tgi", messages=MESSAGES, max_tokens=1, **fields)
    assert info.value.body["param"] == (param or "chat_template_kwargs")


# the Responses API ------------------------------------------------------------------


def respond(client, **fields):
    defaults = {
        "input": QUESTION,
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    return client.responses.create(model="tgi", **{**defaults, **fields})


def test_response_reasoning_item_before_the_message(client, thought):
    text, tokens = thought
    out = respond(client)
    reasoning, content = split(text)
    assert [item.type for item in out.output] == ["reasoning", "message"]
    item = out.output[0]
    assert item.summary == [] and item.status == "completed"
    assert [(c.type, c.text) for c in item.content] == [("reasoning_text", reasoning)]
    assert out.output_text == content
    assert out.usage.output_tokens_details.reasoning_tokens == closing(tokens) + 1


def test_response_stream_equals_whole(client, thought):
    text, _ = thought
    whole = respond(client)
    events = list(respond(client, stream=True))
    kinds = [e.type for e in events]
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    content = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, content) == split(text)
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    done = [e.text for e in events if e.type == "response.reasoning_text.done"]
    assert done == [reasoning]
    final = events[-1].response
    assert final.usage == whole.usage
    strip = [item.model_dump(exclude={"id"}) for item in final.output]
    assert strip == [item.model_dump(exclude={"id"}) for item in whole.output]


def test_response_output_goes_back_as_input(client):
    """A client that sends the output back (reasoning item included) continues the
    conversation; so does previous_response_id. The thinking stays out of the prompt."""
    first = respond(client, max_output_tokens=MAX_TOKENS)
    again = [{"role": "user", "content": QUESTION}, *[i.model_dump() for i in first.output]]
    again.append({"role": "user", "content": "And of Spain?"})
    by_items = respond(client, input=again, max_output_tokens=4)
    chained = respond(
        client, input="And of Spain?", previous_response_id=first.id, max_output_tokens=4
    )
    assert by_items.usage.input_tokens == chained.usage.input_tokens
    assert by_items.output_text == chained.output_text


# a grammar holds the answer, after the thinking ------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
        },
    },
}


def test_a_call_after_the_thinking(client, tokenizer):
    """tool_choice required: the model thinks freely, closes the thinking (a logit_bias
    on `</think>` makes it close within a few tokens under the tools' longer prompt),
    then the grammar holds it to a call."""
    close = str(tokenizer.convert_tokens_to_ids("</think>"))
    for tenths in range(20, 80, 5):
        out = chat(
            client,
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=150,
            logit_bias={close: tenths / 10},
        )
        choice = out.choices[0]
        if choice.message.reasoning_content and choice.finish_reason != "length":
            break
    else:
        pytest.fail("the model never thought, then called")
    assert "think>" not in choice.message.reasoning_content
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert "city" in json.loads(choice.message.tool_calls[0].function.arguments)
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None


def test_json_after_the_thinking(client, thought):
    text, _ = thought
    schema = {
        "type": "object",
        "properties": {"a": {"enum": [1, 2, 3]}},
        "required": ["a"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},  # a random model idles in whitespace
    }
    out = chat(
        client,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        extra_body={},
    )
    message = out.choices[0].message
    assert message.reasoning_content == split(text)[0]
    assert out.choices[0].finish_reason == "stop", message.content
    assert json.loads(message.content)["a"] in (1, 2, 3)


# Anthropic's Messages API -----------------------------------------------------------------


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.http_url, api_key="unused", max_retries=0)


def message(claude, **fields):
    body = {"model": "tgi", "max_tokens": MAX_TOKENS, "messages": MESSAGES, **fields}
    return claude.messages.create(**body, extra_body={"temperature": 0})


def test_message_thinking_block_before_the_text(claude, client):
    """The thinking is a `thinking` block (its signature empty), the answer a text block,
    as chat's reasoning_content and content of the same greedy output."""
    out = message(claude)
    reference = chat(client, extra_body={}).choices[0].message
    assert [block.type for block in out.content] == ["thinking", "text"]
    thinking, text = out.content
    assert (thinking.thinking, thinking.signature) == (reference.reasoning_content, "")
    assert text.text == reference.content
    assert "think>" not in thinking.thinking + text.text


def test_message_thinking_streamed(claude):
    whole = message(claude)
    with claude.messages.stream(
        model="tgi", max_tokens=MAX_TOKENS, messages=MESSAGES, extra_body={"temperature": 0}
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas == sorted(deltas, key=["thinking_delta", "signature_delta", "text_delta"].index)
    assert "thinking_delta" in deltas and "signature_delta" in deltas
    assert [(b.type, b.model_dump(exclude={"parsed_output"})) for b in final.content] == [
        (b.type, b.model_dump()) for b in whole.content
    ]


def test_message_thinking_on_and_off(claude, client, tokenizer):
    """`disabled` reaches the template as enable_thinking: false (an empty thinking block
    ends the prompt: no thinking); `enabled` holds the thinking to budget_tokens, then the
    closing tag is forced."""
    off = message(claude, thinking={"type": "disabled"})
    reference = (
        chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        .choices[0]
        .message
    )
    assert [(b.type, b.text) for b in off.content] == [("text", reference.content)]
    counted = claude.messages.count_tokens(
        model="tgi", messages=MESSAGES, thinking={"type": "disabled"}
    )
    off_prompt = prompt_of(tokenizer, enable_thinking=False)
    assert counted.input_tokens == len(tokenizer(off_prompt).input_ids)

    _, tokens = raw(client, prompt_of(tokenizer))  # the free thinking's first tokens
    budget = closing(tokens) - 1
    held = message(claude, thinking={"type": "enabled", "budget_tokens": budget})
    assert [block.type for block in held.content] == ["thinking", "text"]
    assert held.content[0].thinking == "".join(tokens[:budget]).strip()
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        message(claude, max_tokens=4, thinking={"type": "enabled", "budget_tokens": 4})
