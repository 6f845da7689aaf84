"""Constrained decoding in the paged engine, on a tiny random Llama with a real byte-level
BPE tokenizer: outputs follow their grammar in every sampling mode, and the sequences
beside a constrained one decode exactly as they would beside an unconstrained one."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import jsonschema
import pytest
import torch
from support.tiny_model import build_tokenizer
from textgen.service.engine.config import EngineConfig
from textgen.service.engine.grammar import GrammarMasks
from textgen.service.engine.paged_core import PagedCore
from textgen.service.engine.sequence import Sequence
from textgen.service.engine.types import EngineRequest, FinishReason, SamplingParams, StoppingParams
from textgen.service.intake.grammar_compiler import GrammarCompiler, GrammarError
from transformers import LlamaConfig, LlamaForCausalLM

from .factories import assert_idle, run_to_completion

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        initializer_range=0.2,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    eos = frozenset({tokenizer.eos_token_id})
    return GrammarCompiler(tokenizer, len(tokenizer), eos)


def core_for(model, compiler) -> PagedCore:
    import copy

    return PagedCore(
        copy.deepcopy(model),
        EngineConfig(max_batch_total_tokens=8192, max_batch_prefill_tokens=512, max_batch_size=32),
        grammars=GrammarMasks(compiler.ll_tokenizer, compiler.vocab_size),
    )


def seq(
    tokenizer, prompt: str, rid: str, *, grammar=None, sampling=None, max_new_tokens=48
) -> Sequence:
    request = EngineRequest(
        request_id=rid,
        prompt_ids=tuple(tokenizer(prompt)["input_ids"]),
        sampling=sampling or SamplingParams(),
        stopping=StoppingParams(max_new_tokens=max_new_tokens),
        grammar=grammar,
    )
    return Sequence(request, frozenset({tokenizer.eos_token_id}))


def text(tokenizer, s: Sequence) -> str:
    return tokenizer.decode([t for t in s.output_ids if t != tokenizer.eos_token_id])


SAMPLINGS = [
    SamplingParams(),
    SamplingParams(do_sample=True, temperature=1.3, seed=1),
    SamplingParams(do_sample=True, top_k=5, top_p=0.9, seed=2),
    SamplingParams(
        do_sample=True, typical_p=0.5, repetition_penalty=1.3, frequency_penalty=0.5, seed=3
    ),
    SamplingParams(
        logit_bias=((5, 100.0),), presence_penalty=1.0
    ),  # bias can't push a banned token
]


def test_every_sampling_mode_follows_the_schema(model, tokenizer, compiler):
    core = core_for(model, compiler)
    # compact JSON: a random model spends its tokens on whatever whitespace is allowed
    grammar = compiler.json_schema({**SCHEMA, "x-guidance": {"whitespace_flexible": False}})
    seqs = [
        seq(
            tokenizer,
            "the quick brown fox",
            f"r{i}",
            grammar=grammar,
            sampling=p,
            max_new_tokens=200,
        )
        for i, p in enumerate(SAMPLINGS)
    ]
    for s in seqs:
        core.add(s)
    run_to_completion(core)
    for s in seqs:
        jsonschema.validate(json.loads(text(tokenizer, s)), SCHEMA)
        assert s.finish_reason is FinishReason.EOS_TOKEN
    assert_idle(core)


def test_regex_grammar_ends_the_sequence_when_complete(model, tokenizer, compiler):
    core = core_for(model, compiler)
    s = seq(tokenizer, "hello", "r", grammar=compiler.regex("[0-9]{3}-(yes|no)"))
    core.add(s)
    run_to_completion(core)
    assert re.fullmatch("[0-9]{3}-(yes|no)", text(tokenizer, s))
    assert s.finish_reason is FinishReason.EOS_TOKEN and s.num_output_tokens < 48


def test_neighbours_of_a_constrained_sequence_decode_unchanged(model, tokenizer, compiler):
    """Same batch shapes step for step (a regex that never ends early, fixed lengths): the
    unconstrained rows must come out token for token the same."""
    prompts = ["the quick brown fox", "jumps over", "the lazy dog and the cat"]

    def run(constrained: bool) -> list[list[int]]:
        core = core_for(model, compiler)
        grammar = compiler.regex("[a-z ]*") if constrained else None
        free = [seq(tokenizer, p, f"f{i}", max_new_tokens=24) for i, p in enumerate(prompts)]
        bound = [
            seq(tokenizer, p, f"g{i}", grammar=grammar, max_new_tokens=24)
            for i, p in enumerate(prompts)
        ]
        for s in [x for pair in zip(free, bound) for x in pair]:
            core.add(s)
        run_to_completion(core)
        if constrained:
            assert all(re.fullmatch("[a-z ]*", text(tokenizer, s)) for s in bound)
        return [s.output_ids for s in free]

    assert run(constrained=True) == run(constrained=False)


def test_each_choice_of_a_request_follows_the_grammar_from_its_own_state(
    model, tokenizer, compiler
):
    """n choices share the prompt's prefill; each fork gets its own copy of the grammar's
    state before the first token, so every choice parses, whatever the others drew."""
    core = core_for(model, compiler)
    pattern = "[0-9]{3}-(yes|no)"
    hot = SamplingParams(do_sample=True, temperature=3.0, seed=4)
    first = seq(tokenizer, "hello", "r", grammar=compiler.regex(pattern), sampling=hot)
    request = replace(first.request, n=4)
    seqs = [Sequence(r, first.eos_token_ids, choice=i) for i, r in enumerate(request.choices())]
    seqs[0].forks = seqs[1:]
    core.add(seqs[0])
    run_to_completion(core)
    texts = [text(tokenizer, s) for s in seqs]
    assert all(re.fullmatch(pattern, t) for t in texts), texts
    assert len(set(texts)) > 1
    assert_idle(core)


@pytest.mark.parametrize(
    ("build", "needle"),
    [
        (lambda c: c.regex("(a|b"), "regex"),
        (lambda c: c.json_schema({"type": "florp"}), "florp"),
        (lambda c: c.json_schema([1, 2]), "object or a boolean"),
        (lambda c: c.lark("start: foo"), "foo"),
    ],
)
def test_bad_grammars_raise_grammar_error(compiler, build, needle):
    with pytest.raises(GrammarError, match=needle):
        build(compiler)


def test_compiled_grammars_are_cached(compiler):
    schema = {"type": "object", "properties": {"cached": {"type": "boolean"}}}
    before = compiler._check.cache_info().hits
    assert compiler.json_schema(schema) == compiler.json_schema(dict(schema))
    assert compiler._check.cache_info().hits == before + 1
