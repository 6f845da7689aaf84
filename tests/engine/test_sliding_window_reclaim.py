"""Models whose every attention layer slides (EngineConfig.sliding_window): a running
sequence gives back the blocks before its window, leaving placeholders (the pool's scratch
block) in its table, and still generates what transformers' generate does."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from textgen.service.engine.block_manager import BlockManager
from textgen.service.engine.config import EngineConfig, every_layer_window
from textgen.service.engine.paged_core import PagedCore
from textgen.service.engine.sequence import Sequence
from textgen.service.engine.speculation import SpeculationSettings
from textgen.service.engine.types import EngineError
from transformers import Gemma2Config, MistralConfig, MistralForCausalLM, Qwen2Config

from .factories import (
    VOCAB_SIZE,
    assert_idle,
    assert_matches_generate,
    make_core,
    make_seq,
    random_prompt,
    reference_greedy,
)

WINDOW = 8


@pytest.fixture(scope="module")
def tiny_mistral_w8() -> torch.nn.Module:
    """Mistral, every layer sliding over 8 positions: prompts and generations run many
    windows long."""
    torch.manual_seed(7)
    config = MistralConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=WINDOW,
        max_position_embeddings=1024,
        initializer_range=0.2,
        attn_implementation="sdpa",
    )
    model = MistralForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def window_core(
    model,
    *,
    total_tokens=1024,
    prefill_tokens=16,
    batch_size=8,
    block_size=4,
    sliding_window: int | None = -1,
    **options,
) -> PagedCore:
    """A core as the server builds one for `model` (sliding_window from its config; -1),
    or with the window given (None: no reclaim); options: make_core's."""
    if sliding_window == -1:
        sliding_window = every_layer_window(model.config)
    return make_core(
        model,
        total_tokens=total_tokens,
        prefill_tokens=prefill_tokens,
        batch_size=batch_size,
        block_size=block_size,
        sliding_window=sliding_window,
        **options,
    )


def run_tracking_blocks(core: PagedCore, max_steps: int = 10_000) -> int:
    """Run to completion, checking the tables after every step; -> most blocks in use."""
    peak = 0
    for _ in range(max_steps):
        if not core.has_work():
            return peak
        core.step()
        peak = max(peak, core.stats().kv_blocks_used)
        for seq in core.scheduler.running:
            assert_table_consistent(core.block_manager, seq)
    raise AssertionError("core still busy")


def assert_table_consistent(bm: BlockManager, seq: Sequence) -> None:
    """Released entries: exactly the leading blocks before the window of the next query;
    the rest are held blocks of ours."""
    released = bm.num_out_of_window(seq.num_computed_tokens)
    table = seq.block_table
    assert table[:released] == [bm.placeholder] * min(released, len(table))
    assert all(0 <= b < bm.num_blocks for b in table[released:])
    assert all(bm.blocks[b].ref_count > 0 for b in table[released:])


def prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [random_prompt(n, VOCAB_SIZE, g) for n in lengths]


# the window, from the model's config ------------------------------------------------


def test_only_models_whose_every_layer_slides_reclaim():
    assert every_layer_window(MistralConfig(sliding_window=WINDOW)) == WINDOW
    assert every_layer_window(MistralConfig(sliding_window=None)) is None
    # Gemma 2 alternates sliding and full layers: the full ones read every block
    assert every_layer_window(Gemma2Config(sliding_window=WINDOW)) is None
    qwen = {"use_sliding_window": True, "sliding_window": WINDOW, "num_hidden_layers": 2}
    assert every_layer_window(Qwen2Config(**qwen, max_window_layers=0)) == WINDOW
    assert every_layer_window(Qwen2Config(**qwen, max_window_layers=1)) is None
    assert every_layer_window(Qwen2Config(sliding_window=WINDOW)) is None  # not used
    with pytest.raises(ValueError, match="sliding_window"):
        EngineConfig(
            max_batch_total_tokens=64,
            max_batch_prefill_tokens=8,
            max_batch_size=1,
            sliding_window=0,
        )


# the block manager alone ------------------------------------------------------------


def test_released_blocks_go_back_cached_and_nothing_is_freed_twice():
    bm = BlockManager(num_blocks=16, block_size=4, sliding_window=WINDOW)
    seq = make_seq(list(range(1, 30)))  # 29 tokens: 8 blocks
    bm.allocate(seq, bm.match_prefix(seq))
    bm.append_slots(seq, 29)
    seq.num_computed_tokens = 29
    bm.cache_full_blocks(seq)
    blocks = list(seq.block_table)
    bm.release_out_of_window(seq)
    # next query 29 reads positions > 21: blocks 0..4 (positions 0..19) are out of reach,
    # block 5 (20..23) still holds 22 and 23
    assert bm.num_out_of_window(29) == 5
    assert seq.block_table == [bm.placeholder] * 5 + blocks[5:]
    assert bm.num_used_blocks == 3 and bm.num_cached_free_blocks == 5
    bm.release_out_of_window(seq)  # idempotent
    assert bm.num_used_blocks == 3
    # a fork shares only what its parent still holds
    child = make_seq(list(range(1, 30)), request_id="child")
    bm.fork(seq, child)
    assert child.block_table == seq.block_table
    assert [bm.blocks[b].ref_count for b in blocks[5:]] == [2, 2, 2]
    # another request with the same prefix finds the released blocks in the cache
    later = make_seq(list(range(1, 30)) + [7], request_id="later")
    hits = bm.match_prefix(later)
    assert hits == blocks[:7]
    assert bm.num_free_among(hits) == 5
    bm.allocate(later, hits)
    bm.release_out_of_window(later)  # 28 cached tokens: the first 5 hits go back at once
    assert later.block_table == [bm.placeholder] * 5 + blocks[5:7]
    assert bm.num_used_blocks == 3
    for s in (seq, child, later):
        bm.free(s)
    assert bm.num_used_blocks == 0
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_no_window_releases_nothing():
    bm = BlockManager(num_blocks=16, block_size=4)
    seq = make_seq(list(range(1, 30)))
    bm.allocate(seq, [])
    bm.append_slots(seq, 29)
    seq.num_computed_tokens = 29
    bm.release_out_of_window(seq)
    assert bm.num_used_blocks == 8 and bm.window_blocks(16) is None


def test_window_blocks_bound_every_alignment():
    for block_size in (1, 3, 4, 8, 16):
        for step in (1, 2, 5, 16):
            bm = BlockManager(num_blocks=64, block_size=block_size, sliding_window=WINDOW)
            most = 0
            for q in range(40):  # what a step at q holds: [q - W + 1, q + step)
                first = bm.num_out_of_window(q)
                last = (q + step - 1) // block_size
                most = max(most, last - first + 1)
            assert bm.window_blocks(step) == most, (block_size, step)


# the engine --------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [4, 8])
def test_long_prompts_and_generations_match_generate(tiny_mistral_w8, block_size):
    """A mixed batch: prompts from shorter than the window to several windows long, chunked,
    generating many windows past them; decodes beside prefill chunks."""
    core = window_core(tiny_mistral_w8, block_size=block_size)
    seqs = [
        make_seq(p, request_id=f"r{i}", max_new_tokens=24 + 4 * i)
        for i, p in enumerate(prompts([3, 13, 30, 47, 21], seed=1))
    ]
    for seq in seqs:
        core.add(seq)
    peak = run_tracking_blocks(core)
    assert_matches_generate(tiny_mistral_w8, seqs)
    # each holds at most its window and one step's tokens
    assert peak <= len(seqs) * core.block_manager.window_blocks(16)
    assert peak < sum(-(-s.num_tokens // block_size) for s in seqs)
    assert_idle(core)


def test_a_lone_decode_reads_only_its_window(tiny_mistral_w8):
    """One stream decoding alone (the single-stream attention path gathers its context
    slots, placeholders included, then cuts to the window)."""
    prompt = prompts([19], seed=2)[0]
    core = window_core(tiny_mistral_w8, block_size=4)
    seq = make_seq(prompt, max_new_tokens=40)
    core.add(seq)
    assert run_tracking_blocks(core) <= core.block_manager.window_blocks(16)
    assert_matches_generate(tiny_mistral_w8, [seq])
    assert_idle(core)


def test_a_pool_too_small_for_the_whole_sequence_holds_its_window(tiny_mistral_w8):
    """8 blocks of 4 tokens: the request needs 25 blocks whole, its window 5 at most. The
    used blocks stay bounded while the sequence grows."""
    prompt = prompts([40], seed=3)[0]
    seq = make_seq(prompt, max_new_tokens=60)
    without = window_core(tiny_mistral_w8, total_tokens=32, prefill_tokens=8, sliding_window=None)
    with pytest.raises(EngineError, match="KV cache"):
        without.add(make_seq(prompt, max_new_tokens=60))
    core = window_core(tiny_mistral_w8, total_tokens=32, prefill_tokens=8)
    bm = core.block_manager
    core.add(seq)
    used = []
    while core.has_work():
        core.step()
        used.append(core.stats().kv_blocks_used)
        if seq.block_table:
            assert_table_consistent(bm, seq)
    assert max(used) <= bm.window_blocks(8) < bm.num_blocks
    assert seq.num_tokens == 100 > bm.num_blocks * bm.block_size
    assert_matches_generate(tiny_mistral_w8, [seq])
    assert_idle(core)


def test_preemption_and_recompute_in_a_small_pool(tiny_mistral_w8):
    """Growing sequences in a 10-block pool preempt each other; a recompute rebuilds its
    table (and releases again) from its tokens."""
    core = window_core(tiny_mistral_w8, total_tokens=40, prefill_tokens=8, batch_size=4)
    seqs = [
        make_seq(p, request_id=f"r{i}", max_new_tokens=20 + 3 * i)
        for i, p in enumerate(prompts([9, 17, 26, 5, 33, 12], seed=4))
    ]
    for seq in seqs:
        core.add(seq)
    run_tracking_blocks(core)
    assert core.stats().preemptions > 0
    assert_matches_generate(tiny_mistral_w8, seqs)
    assert_idle(core)


def test_a_prefix_hit_on_blocks_the_first_sequence_released(tiny_mistral_w8):
    """Two later sequences share a 24-token prefix with a running one, which has released
    its first blocks by then (cached free) and still holds the rest (shared)."""
    g = torch.Generator().manual_seed(5)
    prefix = random_prompt(24, VOCAB_SIZE, g)
    core = window_core(tiny_mistral_w8, block_size=4, prefill_tokens=32)
    first = make_seq(prefix + random_prompt(1, VOCAB_SIZE, g), request_id="a", max_new_tokens=30)
    core.add(first)
    core.step()  # its prompt: 25 tokens, blocks 0..3 (positions 0..15) released at once
    bm = core.block_manager
    assert first.block_table[:4] == [bm.placeholder] * 4
    assert bm.num_cached_free_blocks == 4
    others = [
        make_seq(prefix + random_prompt(n, VOCAB_SIZE, g), request_id=f"b{n}", max_new_tokens=20)
        for n in (3, 11)
    ]
    for seq in others:
        core.add(seq)
    run_tracking_blocks(core)
    # each later one found the 6 full prefix blocks (24 tokens)
    assert [s.num_cached_prompt_tokens for s in others] == [24, 24]
    assert_matches_generate(tiny_mistral_w8, [first, *others])
    assert_idle(core)


def test_ngram_speculation_keeps_the_window(tiny_mistral_w8):
    """Verifying decodes compute several positions at once; rejected proposals roll back."""
    g = torch.Generator().manual_seed(6)
    motif = random_prompt(5, VOCAB_SIZE, g)
    seqs = [
        make_seq(motif * 6 + random_prompt(n, VOCAB_SIZE, g), request_id=f"s{n}", max_new_tokens=40)
        for n in (2, 9)
    ]
    core = window_core(tiny_mistral_w8, speculation=SpeculationSettings(3, 8, adaptive=False))
    for seq in seqs:
        core.add(seq)
    run_tracking_blocks(core)
    stats = core.stats()
    assert stats.spec_proposed_tokens > 0
    assert_matches_generate(tiny_mistral_w8, seqs)
    assert_idle(core)


def test_forked_choices_share_what_their_parent_still_holds(tiny_mistral_w8):
    """n = 3 greedy choices fork from a prompt longer than the window: they share only
    the blocks it still holds, and all equal generate."""
    prompt = prompts([27], seed=7)[0]
    first = make_seq(prompt, request_id="c", max_new_tokens=20)
    request = replace(first.request, n=3)
    seqs = [Sequence(r, first.eos_token_ids, choice=i) for i, r in enumerate(request.choices())]
    seqs[0].forks = seqs[1:]
    core = window_core(tiny_mistral_w8, block_size=4, total_tokens=128)
    core.add(seqs[0])
    run_tracking_blocks(core)
    expected = reference_greedy(tiny_mistral_w8, prompt, 20)
    assert [s.output_ids for s in seqs] == [expected] * 3
    assert_idle(core)


def test_batch_invariant_steps_read_placeholders_masked(tiny_mistral_w8):
    """The batch-invariant path pads steps with rows that write the scratch block, which the
    placeholders point at: masked, it changes nothing."""
    core = window_core(tiny_mistral_w8, batch_invariant=True)
    seqs = [
        make_seq(p, request_id=f"r{i}", max_new_tokens=20)
        for i, p in enumerate(prompts([6, 23, 35], seed=8))
    ]
    for seq in seqs:
        core.add(seq)
    run_tracking_blocks(core)
    assert_matches_generate(tiny_mistral_w8, seqs)
    assert_idle(core)


def test_a_mixed_model_keeps_every_block(tiny_gemma2):
    """Gemma 2's full layers read the whole context: no reclaim."""
    core = window_core(tiny_gemma2, block_size=4)
    assert core.block_manager.sliding_window is None
    seq = make_seq(prompts([30], seed=9)[0], max_new_tokens=30)
    core.add(seq)
    used = []
    while core.has_work():
        core.step()
        used.append(core.stats().kv_blocks_used)
    assert max(used) == 15  # 59 computed tokens (the last token is never computed)
    assert_matches_generate(tiny_gemma2, [seq])
    assert_idle(core)


def test_the_triton_kernel_reads_placeholders_masked(tiny_mistral_w8, monkeypatch):
    """Every layer through triton_kernel.py (interpreted on CPU: tests/conftest.py), which
    reads the pool in place through the tables and starts its key loop at the window."""
    from textgen.service.engine.attention import paged as attention

    calls = []
    kernel = attention._triton_attention

    def counted(*args):
        calls.append(1)
        return kernel(*args)

    def sdpa(*args):
        raise AssertionError("a layer took the SDPA path")

    monkeypatch.setattr(attention, "triton_available", lambda device: True)
    monkeypatch.setattr(attention, "_triton_attention", counted)
    monkeypatch.setattr(attention, "_sdpa_attention", sdpa)
    core = window_core(tiny_mistral_w8, block_size=4, prefill_tokens=12)
    seqs = [
        make_seq(p, request_id=f"t{i}", max_new_tokens=14)
        for i, p in enumerate(prompts([5, 29], seed=10))
    ]
    for seq in seqs:
        core.add(seq)
    run_tracking_blocks(core)
    assert calls
    assert_matches_generate(tiny_mistral_w8, seqs)
    assert_idle(core)


def test_graph_decode_steps_read_placeholders_masked(tiny_mistral_w8):
    """Decodes through the CUDA-graph runner's static buffers (not captured: any device),
    whose tables are the sequences' own, placeholders included."""
    from textgen.service.engine.runners.cuda_graphs import GraphSettings

    core = window_core(
        tiny_mistral_w8, block_size=4, cuda_graphs=GraphSettings((1, 2, 4), 32, capture=False)
    )
    core.warm_up()  # builds the graphs' static buffers
    seqs = [
        make_seq(p, request_id=f"g{i}", max_new_tokens=40)
        for i, p in enumerate(prompts([7, 26, 15], seed=11))
    ]
    for seq in seqs:
        core.add(seq)
    run_tracking_blocks(core)
    assert core.runner.stats.graph_steps > 0
    assert_matches_generate(tiny_mistral_w8, seqs)
    assert_idle(core)
