"""The draft-model proposer (engine/draft_model.py): a small model with its own paged KV cache
proposes, the target verifies; the output is the target's own whatever the draft says."""

from __future__ import annotations

import copy

import pytest
import torch
from support.tiny_model import build_tokenizer
from textgen.service.engine.config import EngineConfig
from textgen.service.engine.draft_model import (
    DraftModelProposer,
    TokenizerMismatch,
    check_same_tokenizer,
)
from textgen.service.engine.paged_core import PagedCore
from textgen.service.engine.speculation import SpeculationSettings
from transformers import LlamaConfig, LlamaForCausalLM

from .factories import (
    VOCAB_SIZE,
    assert_idle,
    assert_matches_generate,
    engine_copy,
    make_seq,
    random_prompt,
    run_to_completion,
)


@pytest.fixture(scope="module")
def tiny_draft(tiny_llama) -> torch.nn.Module:
    """tiny_llama with noise on every weight: it agrees with it now and then."""
    draft = copy.deepcopy(tiny_llama)
    g = torch.Generator().manual_seed(30)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.6)
    return draft


def test_a_draft_of_another_shape_proposes_too(tiny_llama):
    torch.manual_seed(31)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE + 20, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
    )  # fmt: skip
    seqs = requests(3, seed=5)
    core = draft_core(tiny_llama, LlamaForCausalLM(config).eval())
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    assert_matches_generate(tiny_llama, seqs)
    assert core.stats().spec_proposed_tokens > 0
    assert_idle(core)


def draft_core(target, draft, *, draft_blocks=512, total_tokens=8192, block_size=16,
               prefill_tokens=256, max_batch=32, catch_up=2048) -> PagedCore:  # fmt: skip
    proposer = DraftModelProposer(
        copy.deepcopy(draft),
        num_blocks=draft_blocks,
        block_size=block_size,
        vocab_size=VOCAB_SIZE,
        catch_up_tokens=catch_up,
    )
    return PagedCore(
        engine_copy(target),
        EngineConfig(
            max_batch_total_tokens=total_tokens,
            max_batch_prefill_tokens=prefill_tokens,
            max_batch_size=32,
            block_size=block_size,
            speculation=SpeculationSettings(3, max_batch, adaptive=False),
        ),
        proposer=proposer,
    )


def requests(count: int, seed: int, max_new_tokens: int = 24):
    g = torch.Generator().manual_seed(seed)
    return [
        make_seq(
            random_prompt(5 + (37 * i) % 150, VOCAB_SIZE, g),
            request_id=f"r{i}",
            max_new_tokens=max_new_tokens - i % 5,
        )
        for i in range(count)
    ]


def test_the_model_as_its_own_draft_is_almost_always_right(tiny_llama):
    seqs = requests(6, seed=1)
    core = draft_core(tiny_llama, tiny_llama)
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    assert_matches_generate(tiny_llama, seqs)
    stats = core.stats()
    assert stats.spec_accepted_tokens >= 0.9 * stats.spec_proposed_tokens > 0
    assert core.proposer.block_manager.num_used_blocks == 0  # every shadow forgotten
    assert_idle(core)


def test_a_weaker_draft_changes_nothing_but_the_speed(tiny_llama, tiny_draft):
    seqs = requests(10, seed=2)
    core = draft_core(tiny_llama, tiny_draft, prefill_tokens=64)  # prefills in chunks
    for seq in seqs[:6]:
        core.add(seq)
    for _ in range(5):
        core.step()
    for seq in seqs[6:]:
        core.add(seq)
    run_to_completion(core)
    assert_matches_generate(tiny_llama, seqs)
    stats = core.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens
    assert core.proposer.block_manager.num_used_blocks == 0
    assert_idle(core)


def test_target_preemption_and_a_small_draft_pool(tiny_llama):
    """The target preempts (tiny pool); the draft's own pool holds few shadows at once, so
    some sequences get no proposal, shadows of idle ones give their blocks back, and long
    prompts catch up over several calls."""
    seqs = requests(8, seed=3, max_new_tokens=30)
    core = draft_core(tiny_llama, tiny_llama, draft_blocks=24, total_tokens=320, block_size=8,
                      prefill_tokens=64, catch_up=40)  # fmt: skip
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    assert core.stats().preemptions > 0
    assert core.stats().spec_accepted_tokens > 0
    assert_matches_generate(tiny_llama, seqs)
    assert core.proposer.block_manager.num_used_blocks == 0
    assert_idle(core)


def test_abort_forgets_the_shadow(tiny_llama):
    seqs = requests(3, seed=4)
    core = draft_core(tiny_llama, tiny_llama)
    for seq in seqs:
        core.add(seq)
    for _ in range(4):
        core.step()
    assert core.proposer.block_manager.num_used_blocks > 0
    for seq in seqs:
        core.abort(seq)
    assert core.proposer.block_manager.num_used_blocks == 0
    assert_idle(core)


def test_tokenizers_must_match():
    check_same_tokenizer(build_tokenizer(), build_tokenizer())
    with pytest.raises(TokenizerMismatch, match="tokenizer differs"):
        check_same_tokenizer(build_tokenizer(400), build_tokenizer(300))
