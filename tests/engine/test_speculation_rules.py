"""Speculative decoding against the rules that end or constrain a run: grammar masks at every
proposed position (a proposal the grammar forbids ends the run), and stop sequences met
inside an accepted run, through the engine loop's token events."""

from __future__ import annotations

import asyncio
import copy
import json

import jsonschema
import pytest
import torch
from support.tiny_model import build_tokenizer
from textgen.service.engine.config import EngineConfig
from textgen.service.engine.detokenizer import decode_output
from textgen.service.engine.grammar import GrammarMasks
from textgen.service.engine.loop import EngineLoop
from textgen.service.engine.paged_core import PagedCore
from textgen.service.engine.speculation import SpeculationSettings
from textgen.service.engine.types import (
    EngineRequest,
    FinishReason,
    SamplingParams,
    StoppingParams,
)
from textgen.service.intake.grammar_compiler import GrammarCompiler
from transformers import LlamaConfig, LlamaForCausalLM

from .factories import VOCAB_SIZE, assert_idle, engine_copy, run_to_completion
from .test_grammar import SAMPLINGS, SCHEMA, seq, text
from .test_speculation import ScriptedProposer

pytestmark = pytest.mark.timeout(120)


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
    return GrammarCompiler(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))


def grammar_core(model, compiler, proposer=None, speculate: bool = True) -> PagedCore:
    return PagedCore(
        copy.deepcopy(model),
        EngineConfig(
            max_batch_total_tokens=8192,
            max_batch_prefill_tokens=512,
            max_batch_size=32,
            speculation=SpeculationSettings(4, 32, adaptive=False) if speculate else None,
        ),
        grammars=GrammarMasks(compiler.ll_tokenizer, compiler.vocab_size),
        proposer=proposer,
    )


def constrained(tokenizer, compiler, prefix: str):
    grammar = compiler.json_schema({**SCHEMA, "x-guidance": {"whitespace_flexible": False}})
    return [
        seq(
            tokenizer,
            "the quick brown fox",
            f"{prefix}{i}",
            grammar=grammar,
            sampling=p,
            max_new_tokens=200,
        )
        for i, p in enumerate(SAMPLINGS)
    ]


def test_grammar_masks_every_proposed_position(model, tokenizer, compiler):
    """Constrained requests in every sampling mode, their known output proposed with every
    third token wrong (often a token the grammar forbids): the same tokens as without
    speculation, valid JSON, and proposals cut where the grammar forbids them."""
    plain = constrained(tokenizer, compiler, "r")
    core = grammar_core(model, compiler, speculate=False)
    for s in plain:
        core.add(s)
    run_to_completion(core)

    spec = constrained(tokenizer, compiler, "r")
    proposer = ScriptedProposer({s.request_id: s.output_ids for s in plain}, wrong_every=3)
    core = grammar_core(model, compiler, proposer)
    admitted = core.grammars.admitted
    cut = []

    def recording_admitted(s, drafts):
        n = admitted(s, drafts)
        cut.append(n < len(drafts))
        return n

    core.grammars.admitted = recording_admitted
    for s in spec:
        core.add(s)
    run_to_completion(core)
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    for s in spec:
        jsonschema.validate(json.loads(text(tokenizer, s)), SCHEMA)
        assert s.finish_reason is FinishReason.EOS_TOKEN
    stats = core.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens
    assert any(cut) and not all(cut)
    assert_idle(core)


def test_a_proposal_the_grammar_forbids_ends_the_run(model, tokenizer, compiler):
    grammar = compiler.regex("[0-9]{3}-(yes|no)")
    s = seq(tokenizer, "hello", "r", grammar=grammar)
    core = grammar_core(model, compiler)
    masks = core.grammars
    core.add(s)
    core.step()  # the first token: the matcher exists from here
    digits = [tokenizer.convert_tokens_to_ids(c) for c in "12"]
    dash, x = tokenizer.convert_tokens_to_ids("-"), tokenizer.convert_tokens_to_ids("x")
    first = s.output_ids[0]
    assert tokenizer.decode([first]).isdigit()  # the grammar let only a digit through
    assert masks.admitted(s, [*digits, dash, x]) == 3  # "x" can't follow "-"
    assert masks.admitted(s, [x, *digits]) == 0
    run_to_completion(core)
    assert s.finish_reason is FinishReason.EOS_TOKEN


# stop sequences, through the loop ---------------------------------------------------


def loop_request(prompt: list[int], stop: tuple[str, ...], max_new_tokens: int) -> EngineRequest:
    return EngineRequest(
        request_id="stop",
        prompt_ids=tuple(prompt),
        sampling=SamplingParams(top_n_tokens=2),
        stopping=StoppingParams(
            max_new_tokens=max_new_tokens, stop_sequences=stop, ignore_eos=True
        ),
    )


def stream(core, request: EngineRequest) -> list:
    engine = EngineLoop(core, build_tokenizer(VOCAB_SIZE), frozenset())
    engine.start(timeout=30)

    async def collect():
        return [event async for event in engine.generate(request)]

    try:
        return asyncio.run(collect())
    finally:
        engine.shutdown()


def test_a_stop_sequence_inside_an_accepted_run_ends_the_stream_there(tiny_llama):
    tokenizer = build_tokenizer(VOCAB_SIZE)
    g = torch.Generator().manual_seed(12)
    prompt = torch.randint(3, VOCAB_SIZE, (12,), generator=g).tolist()
    plain_core = PagedCore(
        engine_copy(tiny_llama),
        EngineConfig(max_batch_total_tokens=4096, max_batch_prefill_tokens=256, max_batch_size=8),
    )
    free = stream(plain_core, loop_request(prompt, (), 30))
    ids = [e.token.id for e in free]
    # a stop string that first completes with output token 9 (its text's last 3 characters)
    cut = next(
        n for n in range(9, 30)
        if len(decode_output(tokenizer, prompt + ids[:n], len(prompt))) >= 3
        and decode_output(tokenizer, prompt + ids[:n], len(prompt))[-3:]
        not in decode_output(tokenizer, prompt + ids[: n - 1], len(prompt))
    )  # fmt: skip
    stop = decode_output(tokenizer, prompt + ids[:cut], len(prompt))[-3:]
    plain = stream(
        PagedCore(
            engine_copy(tiny_llama),
            EngineConfig(
                max_batch_total_tokens=4096, max_batch_prefill_tokens=256, max_batch_size=8
            ),
        ),
        loop_request(prompt, (stop,), 30),
    )
    proposer = ScriptedProposer({"stop": ids}, wrong_every=1000)  # every proposal right
    spec_core = PagedCore(
        engine_copy(tiny_llama),
        EngineConfig(
            max_batch_total_tokens=4096,
            max_batch_prefill_tokens=256,
            max_batch_size=8,
            speculation=SpeculationSettings(5, 8, adaptive=False),
        ),
        proposer=proposer,
    )
    spec = stream(spec_core, loop_request(prompt, (stop,), 30))
    assert plain[-1].finish.reason is FinishReason.STOP_SEQUENCE
    assert [e.index for e in spec] == list(range(1, len(plain) + 1)) == [e.index for e in plain]

    def tokens(events):  # logprobs: a verification chunk rounds otherwise than a decode
        return [(e.token.id, e.token.text, e.text, [t.id for t in e.top_tokens]) for e in events]

    assert tokens(spec) == tokens(plain)
    for mine, theirs in zip(spec, plain):
        assert mine.token.logprob == pytest.approx(theirs.token.logprob, abs=1e-4)
    assert spec[-1].finish.reason is FinishReason.STOP_SEQUENCE
    assert spec[-1].finish.generated_text == plain[-1].finish.generated_text
    assert spec[-1].finish.generated_tokens == len(plain)
    assert spec_core.stats().spec_accepted_tokens >= len(plain) - 3  # it went in runs
    assert max(n for _, n in proposer.proposed) == 5
    assert_idle(spec_core)
