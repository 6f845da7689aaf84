"""Block manager (allocation, ref counts, prefix cache, eviction) and the per-layer pool."""

from __future__ import annotations

import pytest
import torch
from textgen.service.engine.block_manager import BlockManager
from textgen.service.engine.kv_pool import KVCachePool

from .factories import make_seq

BS = 4  # small blocks keep the token arithmetic readable


def computed(bm: BlockManager, prompt: list[int], request_id: str = "a"):
    """A sequence admitted and fully computed, its full blocks registered in the prefix cache."""
    seq = make_seq(prompt, request_id=request_id)
    bm.allocate(seq, bm.match_prefix(seq))
    bm.append_slots(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return seq


def test_allocate_append_free_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(list(range(10)))
    bm.allocate(seq)
    assert bm.blocks_needed(seq, 10) == 3
    bm.append_slots(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_used_blocks == 3
    seq.num_computed_tokens = 10
    assert bm.blocks_needed(seq, 2) == 0  # slots 10, 11 are in the last block
    assert bm.blocks_needed(seq, 3) == 1
    assert bm.can_append(seq, 5 * BS + 2) and not bm.can_append(seq, 5 * BS + 3)
    bm.free(seq)
    assert seq.block_table == [] and bm.num_used_blocks == 0
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_append_beyond_pool_raises():
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq = make_seq([1])
    bm.allocate(seq)
    with pytest.raises(RuntimeError):
        bm.append_slots(seq, 3 * BS)


def test_num_fitting_tokens_counts_last_block_and_free_blocks():
    bm = BlockManager(num_blocks=3, block_size=BS)
    seq = make_seq(list(range(20)))
    bm.allocate(seq)
    bm.append_slots(seq, 5)  # 2 blocks, 3 free slots in the second
    seq.num_computed_tokens = 5
    assert bm.num_fitting_tokens(seq, 100) == 3 + BS
    assert bm.num_fitting_tokens(seq, 2) == 2


def test_prefix_hit_shares_full_blocks_and_leaves_last_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    a = computed(bm, prompt)
    b = make_seq(prompt + [7, 8], request_id="b")
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:2]
    assert bm.allocate(b, hits) == 2 * BS
    assert b.num_computed_tokens == b.num_cached_prompt_tokens == 2 * BS
    assert [bm.blocks[i].ref_count for i in hits] == [2, 2]
    assert bm.prefix_hit_tokens == 2 * BS and bm.prefix_queried_tokens == 10 + 12


def test_prompt_of_whole_cached_blocks_recomputes_its_last_block():
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(2 * BS))
    computed(bm, prompt)
    again = make_seq(prompt, request_id="again")
    # the last token must be computed for logits, and never inside a shared block
    assert len(bm.match_prefix(again)) == 1


def test_diverging_prompt_hits_only_the_common_blocks():
    bm = BlockManager(num_blocks=16, block_size=BS)
    computed(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    other = make_seq([1, 2, 3, 4, 5, 6, 0, 8, 9], request_id="b")
    assert len(bm.match_prefix(other)) == 1
    # the chain hash: the same second block after a different first block is a miss
    shifted = make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9], request_id="c")
    assert bm.match_prefix(shifted) == []


def test_freed_blocks_stay_cached_until_evicted_tail_first():
    bm = BlockManager(num_blocks=4, block_size=BS)
    prompt = list(range(3 * BS + 1))
    a = computed(bm, prompt)
    head, middle, tail = a.block_table[:3]
    bm.free(a)
    assert bm.num_used_blocks == 0 and bm.num_cached_free_blocks == 3
    probe = make_seq(prompt, request_id="probe")
    assert bm.match_prefix(probe) == [head, middle, tail]

    # The never-hashed block goes first, then cached ones from the tail of the prompt.
    filler = make_seq(list(range(50, 50 + 2 * BS)), request_id="filler")
    bm.allocate(filler)
    bm.append_slots(filler, 2 * BS)
    assert tail in filler.block_table and head not in filler.block_table
    assert bm.match_prefix(probe) == [head, middle]


def test_hit_on_a_free_cached_block_takes_it_off_the_free_list():
    bm = BlockManager(num_blocks=4, block_size=BS)
    prompt = list(range(2 * BS + 1))
    a = computed(bm, prompt)
    bm.free(a)
    b = make_seq(prompt, request_id="b")
    hits = bm.match_prefix(b)
    assert bm.num_free_among(hits) == 2
    bm.allocate(b, hits)
    assert bm.num_used_blocks == 2
    bm.free(b)
    assert bm.num_used_blocks == 0


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(3 * BS))
    computed(bm, prompt)
    assert bm.match_prefix(make_seq(prompt, request_id="b")) == []


def test_pool_writes_new_states_at_their_slots_with_distinct_k_and_v_dims():
    pool = KVCachePool(num_blocks=3, block_size=BS)
    key = torch.randn(1, 2, 5, 8)  # [1, KVH, T, Dk]
    value = torch.randn(1, 2, 5, 6)  # Dv differs (MLA)
    slots = torch.tensor([0, 1, 9, 10, 11])
    layer = pool.write(0, key, value, slots)
    assert layer.keys.shape == (3, BS, 2, 8) and layer.values.shape == (3, BS, 2, 6)
    flat_k = layer.keys.view(-1, 2, 8)
    torch.testing.assert_close(flat_k[slots], key[0].transpose(0, 1))
    torch.testing.assert_close(layer.values.view(-1, 2, 6)[slots], value[0].transpose(0, 1))
    assert flat_k[2:9].abs().sum() == 0  # untouched slots stay zero (finite when gathered)
    assert pool.layer(0, key, value) is layer
