"""The validator on its own (no server, no model): TGI's rules on the plain request
type, the names each face gives a refused field, TGI's defaults, and the grammar paths.
tests/integration/test_validation.py checks the same rules end to end over gRPC."""

from __future__ import annotations

from dataclasses import replace

import pytest
from support.tiny_model import build_tokenizer
from textgen.service.engine.block_manager import num_blocks_for_choices
from textgen.service.intake.grammar_compiler import GrammarCompiler
from textgen.service.intake.request import GenerateParameters, GenerateRequest, Grammar
from textgen.service.intake.validation import ValidationError, Validator
from textgen.service.openai.chat import parse_chat_request
from textgen.service.openai.common import OpenAIRequestError
from textgen.service.openai.completions import parse_completion_request

from .limits import LIMITS

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def validator(tokenizer) -> Validator:
    eos = frozenset({tokenizer.eos_token_id})
    return Validator(tokenizer, LIMITS, GrammarCompiler(tokenizer, LIMITS.vocab_size, eos))


def refused(validator: Validator, request: GenerateRequest, *, stream=False) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        validator.validate(request, stream=stream)
    return info.value


def tgi(**parameters) -> GenerateRequest:
    return GenerateRequest("The quick brown fox", GenerateParameters(**parameters))


@pytest.mark.parametrize(
    ("parameters", "message", "param"),
    [
        ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive", "max_new_tokens"),
        ({"temperature": 0.0}, "`temperature` must be strictly positive", "temperature"),
        ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0", "top_p"),
        ({"top_k": 0}, "`top_k` must be strictly positive", "top_k"),
        ({"stop": ("",)}, "`stop` sequences must not be empty", "stop"),
        ({"best_of": 2}, "you must use sampling when `best_of` is > 1", "best_of"),
        ({"logit_bias": {400: 1.0}}, "`logit_bias` token id 400 is outside", "logit_bias"),
        ({"adapter_id": "lora"}, "`adapter_id`: LoRA adapters are not served here", "adapter_id"),
        ({"max_time": 0.0}, "`max_time` must be strictly positive", "max_time"),
        ({"truncate": 64}, "`truncate` must be strictly positive and less than 63", "truncate"),
        (
            {"grammar": Grammar("regex", 5)},
            "grammar is not valid: a `regex` grammar's value must be a string",
            "grammar",
        ),
    ],
)
def test_tgi_rules_name_tgi_fields(validator, parameters, message, param):
    error = refused(validator, tgi(**parameters))
    assert error.message.startswith(message) and error.param == param
    assert error.error_type == "validation"


def test_too_long_for_max_total_tokens(validator):
    error = refused(validator, tgi(max_new_tokens=64))
    assert error.message.startswith("`inputs` tokens + `max_new_tokens` must be <= 64. Given: ")


def test_streaming_refuses_best_of_and_prompt_details(validator):
    assert refused(validator, tgi(best_of=2, do_sample=True), stream=True).param == "best_of"
    error = refused(validator, tgi(decoder_input_details=True), stream=True)
    assert error.message == "`decoder_input_details` == true is not supported when streaming tokens"


def test_defaults_are_tgis(validator):
    valid = validator.validate(tgi(), stream=False)
    request = valid.engine_request
    # greedy, and max_new_tokens fills max_total_tokens after the prompt
    assert request.sampling.do_sample is False
    assert request.stopping.max_new_tokens == LIMITS.max_total_tokens - len(request.prompt_ids)
    # any sampling parameter turns sampling on (TGI); a seed is drawn when unset
    sampled = validator.validate(tgi(temperature=0.5), stream=False).engine_request.sampling
    assert sampled.do_sample and sampled.temperature == 0.5 and sampled.seed >= 0


def test_lark_grammar_replaces_the_tgi_grammar(validator):
    lark = 'start: "yes" | "no"\n'
    request = GenerateRequest(
        "Q?", GenerateParameters(grammar=Grammar("regex", "[0-9]+")), lark=lark
    )
    compiled = validator.validate(request, stream=False).engine_request.grammar
    assert compiled == validator.grammars.lark(lark)
    assert validator.validate(
        tgi(grammar=Grammar("regex", "[0-9]+")), stream=False
    ).engine_request.grammar


def test_openai_requests_name_openai_fields(validator, tokenizer):
    """The same rules, reached through OpenAI's JSON: the error speaks the client's names."""
    chat = parse_chat_request(
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}', tokenizer
    )
    error = refused(validator, chat.generate)
    assert error.param == "max_tokens"
    assert "`messages` tokens + `max_tokens` must be <= 64" in error.message
    chat = parse_chat_request(
        b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 100}',
        tokenizer,
    )
    assert refused(validator, chat.generate).param == "max_completion_tokens"
    # OpenAI's bound on top_logprobs, 20, not the server's --max-top-n-tokens (5 here)
    chat = parse_chat_request(
        b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 9}',
        tokenizer,
    )
    assert validator.validate(chat.generate, stream=False).engine_request.sampling.top_n_tokens == 9
    with pytest.raises(OpenAIRequestError) as info:
        parse_chat_request(
            b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true,'
            b' "top_logprobs": 21}',
            tokenizer,
        )
    assert (info.value.param, info.value.message) == (
        "top_logprobs",
        "`top_logprobs` must be >= 0 and <= 20. Given: 21",
    )
    completion = parse_completion_request(b'{"prompt": "hi", "logprobs": 7}', 4)
    assert refused(validator, completion.generates[0]).param == "logprobs"
    completion = parse_completion_request(b'{"prompt": "hi", "temperature": 0.00001}', 4)
    assert refused(validator, completion.generates[0]).param == "temperature"


# n choices ---------------------------------------------------------------------------

CHAT = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8'


def chat_body(extra: str = "") -> bytes:
    return CHAT + extra.encode() + b"}"


def test_n_is_bounded_by_max_n_and_sampled_by_the_engine(tokenizer):
    validator = Validator(tokenizer, replace(LIMITS, max_n=4))
    chat = parse_chat_request(chat_body(', "n": 3'), tokenizer)
    assert chat.generate.parameters.n == 3
    assert validator.validate(chat.generate, stream=True).engine_request.n == 3
    error = refused(validator, parse_chat_request(chat_body(', "n": 5'), tokenizer).generate)
    assert (error.param, error.message) == ("n", "`n` must be >= 1 and <= 4. Given: 5")
    with pytest.raises(OpenAIRequestError) as info:
        parse_chat_request(chat_body(', "n": 0'), tokenizer)
    assert info.value.param == "n"
    # TGI's best_of is the engine's n as well
    assert validator.validate(tgi(best_of=2, do_sample=True), stream=False).engine_request.n == 2


def test_choices_that_cant_fit_the_kv_cache_at_once_are_refused(tokenizer):
    ok = parse_chat_request(chat_body(', "n": 4'), tokenizer)
    unbounded = Validator(tokenizer, replace(LIMITS, max_n=8))
    prompt = len(unbounded.validate(ok.generate, stream=False).engine_request.prompt_ids)
    # a pool that holds 4 choices of this prompt + 8 new tokens at once, not 5
    blocks = num_blocks_for_choices(prompt, 8, 4, 16)
    assert num_blocks_for_choices(prompt, 8, 5, 16) > blocks
    validator = Validator(tokenizer, replace(LIMITS, max_n=8, kv_cache_blocks=blocks))
    assert validator.validate(ok.generate, stream=False).engine_request.n == 4
    error = refused(validator, parse_chat_request(chat_body(', "n": 5'), tokenizer).generate)
    assert error.param == "n" and "5 choices (`n`)" in error.message
    assert f"holds {blocks * 16}" in error.message and "`max_tokens`" in error.message
    # completions: best_of samples (and is named), n answers
    completion = parse_completion_request(b'{"prompt": "hi", "n": 2, "best_of": 6}', 4)
    assert (completion.n, completion.best_of) == (2, 6)
    error = refused(validator, completion.generates[0])
    assert error.param == "best_of" and "6 choices (`best_of`)" in error.message


def test_completions_best_of_follows_openai_rules():
    with pytest.raises(OpenAIRequestError) as info:
        parse_completion_request(b'{"prompt": "hi", "n": 3, "best_of": 2}', 4)
    assert info.value.param == "best_of" and "`best_of` must be >= `n`" in info.value.message
    with pytest.raises(OpenAIRequestError) as info:
        parse_completion_request(b'{"prompt": "hi", "best_of": 2, "stream": true}', 4)
    assert info.value.param == "best_of"
    streamed = parse_completion_request(
        b'{"prompt": "hi", "n": 2, "best_of": 2, "stream": true}', 4
    )
    assert (streamed.n, streamed.best_of) == (2, 2)


@pytest.mark.parametrize("top_p", ["0", "-0.5", "1.5", "1.0000001"])
def test_openai_top_p_is_within_zero_and_one(tokenizer, top_p):
    for parse in (
        lambda body: parse_chat_request(body, tokenizer),
        lambda body: parse_completion_request(
            body.replace(b'"messages": [{"role": "user", "content": "hi"}]', b'"prompt": "hi"'), 4
        ),
    ):
        with pytest.raises(OpenAIRequestError) as info:
            parse(chat_body(f', "top_p": {top_p}'))
        assert info.value.param == "top_p"
    assert (
        parse_chat_request(chat_body(', "top_p": 1'), tokenizer).generate.parameters.top_p is None
    )


def test_adapter_id_and_model_pick_a_served_adapter_or_the_base(tokenizer):
    """TGI's `adapter_id` and OpenAI's `model` name a served adapter (its uid goes to the
    engine), the base model by its id (or "tgi" and nothing, for `model`); another name is
    refused naming the field. Without adapters, `model` is any name (the base)."""
    from pathlib import Path

    from textgen.service.engine.adapters import AdapterRegistry
    from textgen.service.models.lora import LoraAdapter

    registry = AdapterRegistry(max_loras=2, max_rank=8)
    sql = registry.add(LoraAdapter("sql", "/a/sql", Path("/a/sql"), 8, None, {}))
    with_lora = Validator(tokenizer, LIMITS, adapters=registry, base_names=("org/base", "/m"))
    plain = Validator(tokenizer, LIMITS, base_names=("org/base",))

    def adapter(v, **parameters):
        request = v.validate(tgi(**parameters), stream=False).engine_request
        return request.adapter_id, request.adapter_uid

    assert adapter(with_lora, adapter_id="sql") == ("sql", sql.uid)
    assert adapter(with_lora, model="sql") == ("sql", sql.uid)
    for base in ({}, {"adapter_id": ""}, {"adapter_id": "org/base"}, {"model": "tgi"}):
        assert adapter(with_lora, **base) == (None, 0)
    assert adapter(plain, model="gpt-4o") == (None, 0)
    for field in ("adapter_id", "model"):
        error = refused(with_lora, tgi(**{field: "sqll"}))
        assert error.param == field
        assert error.message == (
            f"`{field}`: unknown LoRA adapter 'sqll' (served: 'org/base', 'sql')"
        )
    registry.unload("sql")
    assert refused(with_lora, tgi(model="sql")).param == "model"
