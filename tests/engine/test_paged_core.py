"""PagedCore end to end on tiny random models: its output must equal `model.generate` on each
prompt alone, token for token, whatever the batch composition, preemption or prefix reuse."""

from __future__ import annotations

import pytest
import torch
from textgen.service.engine.attention import paged as attention
from textgen.service.engine.config import EngineConfig
from textgen.service.engine.paged_core import PagedCore
from textgen.service.engine.types import EngineError, SamplingParams
from transformers import GPTNeoConfig, GPTNeoForCausalLM

from .factories import (
    VOCAB_SIZE,
    assert_idle,
    assert_matches_generate,
    engine_copy,
    make_core,
    make_seq,
    random_prompt,
    reference_greedy,
    run_to_completion,
)


def mixed_requests(count: int, seed: int, max_len: int = 200):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (count,), generator=g).tolist()
    lengths[:3] = [1, max_len, 17]  # the edges: a 1-token prompt, the longest, a block + 1
    return [
        make_seq(
            random_prompt(n, VOCAB_SIZE, g), request_id=f"r{i}", max_new_tokens=2 + (7 * i) % 23
        )
        for i, n in enumerate(lengths)
    ]


def test_greedy_mixed_batch_with_late_arrivals_equals_generate(tiny_llama):
    core = make_core(tiny_llama, prefill_tokens=256)
    seqs = mixed_requests(32, seed=1)
    early, late = seqs[:24], seqs[24:]
    for seq in early:
        core.add(seq)
    outputs = []
    for _ in range(4):  # a few steps in: prefill chunks of late arrivals mix with decodes
        outputs.extend(core.step())
    for seq in late:
        core.add(seq)
    outputs.extend(run_to_completion(core))
    assert_matches_generate(tiny_llama, seqs)
    assert all(seq.is_finished and seq.first_scheduled_time is not None for seq in seqs)
    assert len(outputs) == sum(seq.num_output_tokens for seq in seqs)
    assert_idle(core)


def test_long_prompts_among_short_ones_split_the_attention_and_match_generate(
    tiny_llama, monkeypatch
):
    """Two long prompts among short ones: their prefill chunks, then their decodes, go to
    attention groups of their own (the short ones don't pad up to them), with the same
    greedy output."""
    steps = []  # (query lengths, context lengths, group bounds) of each step
    group_bounds = attention.BatchMetadata._group_bounds

    def recording_group_bounds(meta):
        bounds = group_bounds(meta)
        steps.append((meta.query_lens, meta.context_lens, bounds))
        return bounds

    monkeypatch.setattr(attention.BatchMetadata, "_group_bounds", recording_group_bounds)
    core = make_core(tiny_llama, prefill_tokens=2048)
    g = torch.Generator().manual_seed(7)
    lengths = [20, 900, 30, 18, 800, 25, 28, 17]
    seqs = [
        make_seq(random_prompt(n, VOCAB_SIZE, g), request_id=f"s{i}", max_new_tokens=8)
        for i, n in enumerate(lengths)
    ]
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    assert_matches_generate(tiny_llama, seqs)
    # the first step prefills all eight prompts, the long ones first; then all decode,
    # longest context first
    prompts = [900, 800, 30, 28, 25, 20, 18, 17]
    assert steps[0] == (prompts, prompts, [(0, 2), (2, 8)])
    assert steps[1] == ([1] * 8, [901, 801, 31, 29, 26, 21, 19, 18], [(0, 2), (2, 8)])
    assert_idle(core)


def test_tiny_pool_preempts_and_still_matches_generate(tiny_llama):
    # 12 blocks of 8 tokens: each request fits alone, eight together do not.
    core = make_core(tiny_llama, total_tokens=96, prefill_tokens=64, block_size=8)
    g = torch.Generator().manual_seed(2)
    seqs = [
        make_seq(
            random_prompt(10 + 3 * i, VOCAB_SIZE, g), request_id=f"p{i}", max_new_tokens=20 + i
        )
        for i in range(8)
    ]
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    assert core.stats().preemptions > 0
    assert any(seq.num_preemptions for seq in seqs)
    assert_matches_generate(tiny_llama, seqs)
    assert_idle(core)


def test_shared_prefix_hits_the_cache_with_unchanged_output(tiny_llama):
    core = make_core(tiny_llama)
    g = torch.Generator().manual_seed(3)
    system = random_prompt(100, VOCAB_SIZE, g)
    first = make_seq(system + random_prompt(5, VOCAB_SIZE, g), request_id="first", max_new_tokens=6)
    core.add(first)
    run_to_completion(core)  # first is finished; its blocks stay cached while free
    followers = [
        make_seq(system + random_prompt(3 + i, VOCAB_SIZE, g), request_id=f"f{i}", max_new_tokens=6)
        for i in range(3)
    ]
    for seq in followers:
        core.add(seq)
    run_to_completion(core)
    stats = core.stats()
    assert all(seq.num_cached_prompt_tokens == 96 for seq in followers)  # 6 full blocks of 16
    assert stats.prefix_cache_hit_tokens == 3 * 96
    assert stats.prefix_cache_queried_tokens == sum(
        s.num_prompt_tokens for s in [first, *followers]
    )
    assert_matches_generate(tiny_llama, [first, *followers])
    assert_idle(core)


def test_abort_mid_generation_returns_every_block(tiny_llama):
    core = make_core(tiny_llama, prefill_tokens=32)
    g = torch.Generator().manual_seed(4)
    seqs = [
        make_seq(random_prompt(40 + i, VOCAB_SIZE, g), request_id=f"a{i}", max_new_tokens=50)
        for i in range(4)
    ]
    for seq in seqs:
        core.add(seq)
    for _ in range(5):  # a0 decoding, others mid-prefill or waiting
        core.step()
    assert core.stats().kv_blocks_used > 0
    for seq in seqs:
        core.abort(seq)
    assert not core.has_work()
    assert all(seq.is_finished for seq in seqs)
    assert_idle(core)
    core.abort(seqs[0])  # aborting twice is harmless
    assert_idle(core)


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(tiny_llama):
    sampling = SamplingParams(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, seed=1234)
    g = torch.Generator().manual_seed(5)
    prompt = random_prompt(30, VOCAB_SIZE, g)

    alone = make_seq(prompt, request_id="alone", max_new_tokens=16, sampling=sampling)
    core = make_core(tiny_llama)
    core.add(alone)
    run_to_completion(core)

    busy = make_seq(prompt, request_id="busy", max_new_tokens=16, sampling=sampling)
    others = mixed_requests(12, seed=6, max_len=80)
    core = make_core(tiny_llama, prefill_tokens=64)
    for seq in others[:6]:
        core.add(seq)
    core.step()
    core.add(busy)
    for seq in others[6:]:
        core.add(seq)
    run_to_completion(core)
    assert busy.output_ids == alone.output_ids


def test_decoder_input_details_prompt_logprobs_match_a_plain_forward(tiny_llama):
    g = torch.Generator().manual_seed(7)
    prompt = random_prompt(45, VOCAB_SIZE, g)
    with torch.inference_mode():
        logits = tiny_llama(torch.tensor([prompt])).logits[0].float()
    expected = (
        torch.log_softmax(logits[:-1], -1)
        .gather(1, torch.tensor(prompt[1:]).unsqueeze(1))
        .squeeze(1)
    )

    # a small prefill budget splits the prompt into chunks beside another request's decodes
    core = make_core(tiny_llama, prefill_tokens=16)
    core.add(make_seq(random_prompt(5, VOCAB_SIZE, g), request_id="other", max_new_tokens=10))
    detailed = make_seq(prompt, request_id="detailed", max_new_tokens=3, decoder_input_details=True)
    core.add(detailed)
    outputs = [o for o in run_to_completion(core) if o.seq is detailed]
    first, rest = outputs[0], outputs[1:]
    assert first.prefill_logprobs[0] is None and len(first.prefill_logprobs) == len(prompt)
    torch.testing.assert_close(
        torch.tensor(first.prefill_logprobs[1:]), expected, atol=1e-4, rtol=0
    )
    assert all(o.prefill_logprobs is None for o in rest)
    assert detailed.output_ids == reference_greedy(tiny_llama, prompt, 3)


def test_prompt_logprobs_survive_a_preemption_mid_prefill(tiny_llama):
    # 6 blocks of 8 and 2 prompt tokens per step: "long" is still prefilling when "old",
    # decoding, needs its fourth block, so "long" is preempted and later recomputed.
    g = torch.Generator().manual_seed(10)
    core = make_core(tiny_llama, total_tokens=48, prefill_tokens=2, block_size=8)
    old = make_seq(random_prompt(15, VOCAB_SIZE, g), request_id="old", max_new_tokens=30)
    prompt = random_prompt(30, VOCAB_SIZE, g)
    long = make_seq(prompt, request_id="long", max_new_tokens=3, decoder_input_details=True)
    core.add(old)
    core.add(long)
    outputs = run_to_completion(core)
    assert long.num_preemptions == 1
    with torch.inference_mode():
        logits = tiny_llama(torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(prompt[1:])[:, None])
    first = next(o for o in outputs if o.seq is long)
    assert len(first.prefill_logprobs) == len(prompt)
    torch.testing.assert_close(
        torch.tensor(first.prefill_logprobs[1:]), expected.squeeze(1), atol=1e-4, rtol=0
    )
    assert_matches_generate(tiny_llama, [old, long])
    assert_idle(core)


def test_single_token_prompt_details_has_only_the_first_none(tiny_llama):
    core = make_core(tiny_llama)
    seq = make_seq([5], decoder_input_details=True, max_new_tokens=1)
    core.add(seq)
    (out,) = run_to_completion(core)
    assert out.prefill_logprobs == [None]


def test_eos_stops_a_sequence_like_generate(tiny_llama):
    g = torch.Generator().manual_seed(8)
    prompt = random_prompt(20, VOCAB_SIZE, g)
    eos = reference_greedy(tiny_llama, prompt, 6)[3]
    core = make_core(tiny_llama)
    seq = make_seq(prompt, max_new_tokens=6, eos_token_ids=frozenset({eos}))
    core.add(seq)
    run_to_completion(core)
    assert seq.output_ids == reference_greedy(tiny_llama, prompt, 6, eos_token_id=eos)
    assert seq.finish_reason.value == "eos_token"
    assert_idle(core)


@pytest.mark.parametrize("model_name", ["tiny_mistral_sliding", "tiny_gemma2"])
def test_sliding_window_model_matches_generate(model_name, request):
    model = request.getfixturevalue(model_name)
    core = make_core(model, prefill_tokens=40)
    g = torch.Generator().manual_seed(9)
    seqs = [
        make_seq(random_prompt(n, VOCAB_SIZE, g), request_id=f"w{n}", max_new_tokens=30)
        for n in (3, 20, 60, 130)  # shorter and (much) longer than the 24-token window
    ]
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    assert_matches_generate(model, seqs)


@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_mistral_sliding", "tiny_gemma2"])
def test_a_sequence_decoding_alone_matches_generate(model_name, request):
    """One decoding sequence attends its own keys with no mask (a slice of the gathered
    blocks: the last `window` of its context on sliding-window layers); past the window,
    across block boundaries and with Gemma2's soft-capping it must give generate's tokens."""
    model = request.getfixturevalue(model_name)
    core = make_core(model, prefill_tokens=40)
    g = torch.Generator().manual_seed(11)
    for n in (1, 15, 70):  # its context then crosses 16-token blocks and the 24-token window
        seq = make_seq(random_prompt(n, VOCAB_SIZE, g), request_id=f"alone{n}", max_new_tokens=20)
        core.add(seq)
        run_to_completion(core)
        assert_matches_generate(model, [seq])
    assert_idle(core)


def test_request_larger_than_the_pool_is_refused(tiny_llama):
    core = make_core(tiny_llama, total_tokens=64)
    with pytest.raises(EngineError):
        core.add(make_seq(list(range(60)), max_new_tokens=8))


def test_models_the_paged_path_cannot_serve_are_refused(tiny_llama):
    gpt_neo = GPTNeoForCausalLM(
        GPTNeoConfig(
            vocab_size=64,
            hidden_size=32,
            num_layers=1,
            num_heads=4,
            attention_types=[[["global"], 1]],
        )
    )
    with pytest.raises(ValueError, match="AttentionInterface"):
        PagedCore(
            gpt_neo,
            EngineConfig(max_batch_total_tokens=64, max_batch_prefill_tokens=64, max_batch_size=2),
        )

    # attention sinks are served (tests/engine/test_families.py), but not batch-invariant
    with_sinks = engine_copy(tiny_llama)
    with_sinks.model.layers[1].self_attn.sinks = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="sinks"):
        PagedCore(
            with_sinks,
            EngineConfig(
                max_batch_total_tokens=64,
                max_batch_prefill_tokens=64,
                max_batch_size=2,
                batch_invariant=True,
            ),
        )
