"""The SDPA path's groups: chunks that start their sequences (a fresh prompt, nothing cached
before it) through SDPA's is_causal instead of a mask, against the masked path on the same
step; and runs of sequences of very different sizes cut into several groups."""

from __future__ import annotations

import pytest
import torch
from textgen.service.engine.attention import paged as attention

from .factories import Batch, make_batch

# whole prompts of different lengths in one group: the short ones' padded rows see keys past
# their end (block 0's and the next blocks'), which only padding may
FRESH = [(37, 37), (5, 5), (64, 64)]


@pytest.fixture
def unsplit_runs(monkeypatch):
    """Runs stay whole groups, however far apart their sizes (padding rows are the point)."""
    monkeypatch.setattr(attention, "SPLIT_MIN_PAIRS", float("inf"))


def attend(batch: Batch, *, fresh: bool, window=None, softcap=None) -> torch.Tensor:
    (group,) = batch.meta.groups()
    group.fresh = fresh
    cache = batch.pool.layer(0, batch.key, batch.value)
    scale = batch.query.shape[-1] ** -0.5
    return attention._sdpa_attention(batch.query, cache, batch.meta, scale, window, softcap)


@pytest.mark.parametrize(
    "dtype, num_heads, num_kv_heads, atol",
    [(torch.float32, 6, 2, 1e-5), (torch.float32, 4, 4, 1e-5), (torch.bfloat16, 9, 3, 2e-2)],
)
@pytest.mark.usefixtures("unsplit_runs")
def test_fresh_prompts_attend_causally_as_the_masked_path(dtype, num_heads, num_kv_heads, atol):
    batch = make_batch(
        block_size=16,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=64,
        dtype=dtype,
        seqs=FRESH,
    )
    assert batch.meta.groups()[0].fresh
    causal = attend(batch, fresh=True)
    masked = attend(batch, fresh=False)
    assert causal.shape == masked.shape == (1, sum(n for n, _ in FRESH), num_heads, 64)
    torch.testing.assert_close(causal, masked, atol=atol, rtol=atol)
    # a window no prompt reaches past takes the same path; one that bites takes the mask
    torch.testing.assert_close(attend(batch, fresh=True, window=64), masked, atol=atol, rtol=atol)
    windowed = attend(batch, fresh=False, window=20)
    assert torch.equal(attend(batch, fresh=True, window=20), windowed)
    assert not torch.allclose(windowed, masked, atol=atol)


@pytest.mark.usefixtures("unsplit_runs")
def test_a_step_groups_its_decodes_fresh_chunks_and_later_chunks_apart():
    """Decodes first, then runs of fresh chunks and of chunks after cached tokens: each run
    its own group, so a prompt's first chunk beside another's later one still skips the
    mask. The batch-invariant path keeps all chunks in one group, with no fresh path."""
    seqs = [(1, 1), (1, 30), (37, 37), (12, 12), (9, 50), (5, 5), (24, 60)]
    batch = make_batch(
        block_size=16, num_heads=6, num_kv_heads=2, head_dim=64, dtype=torch.float32, seqs=seqs
    )
    meta = batch.meta
    groups = meta.groups()
    assert [(g.num_seqs, g.max_query_len, g.fresh) for g in groups] == [
        (2, 1, False), (2, 37, True), (1, 9, False), (1, 5, True), (1, 24, False)
    ]  # fmt: skip
    cache = batch.pool.layer(0, batch.key, batch.value)
    scale = batch.query.shape[-1] ** -0.5
    split = attention._sdpa_attention(batch.query, cache, meta, scale, None, None)
    for group in groups:
        group.fresh = False
    masked = attention._sdpa_attention(batch.query, cache, meta, scale, None, None)
    assert split.shape == (1, sum(n for n, _ in seqs), 6, 64)
    torch.testing.assert_close(split, masked, atol=1e-5, rtol=1e-5)
    invariant = attention.BatchMetadata.build(
        meta.pool, meta.query_lens, meta.context_lens, meta.block_tables, meta.device,
        batch_invariant=True,
    )  # fmt: skip
    assert [(g.num_seqs, g.fresh) for g in invariant.groups()] == [(2, False), (5, False)]


def _groups_and_output(seqs, *, batch_invariant=False):
    batch = make_batch(
        block_size=16, num_heads=6, num_kv_heads=2, head_dim=64, dtype=torch.float32, seqs=seqs
    )
    meta = batch.meta
    if batch_invariant:
        meta = attention.BatchMetadata.build(
            meta.pool, meta.query_lens, meta.context_lens, meta.block_tables, meta.device,
            batch_invariant=True,
        )  # fmt: skip
    cache = batch.pool.layer(0, batch.key, batch.value)
    scale = batch.query.shape[-1] ** -0.5
    out = attention._sdpa_attention(batch.query, cache, meta, scale, None, None)
    return [(g.num_seqs, g.max_query_len, g.max_blocks) for g in meta.groups()], out


# decodes longest first, fresh chunks, chunks after cached tokens (as the runner orders them)
MIXED = [(1, 2000), (1, 1990), (1, 100), (1, 90), (1, 20),
         (300, 300), (40, 40), (30, 30), (8, 8),
         (50, 1500), (5, 40)]  # fmt: skip


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["sdpa", "invariant"])
def test_runs_of_far_apart_sizes_split_into_groups_with_the_same_result(
    batch_invariant, monkeypatch
):
    """One long conversation among short ones: the short decodes get a group of their own
    instead of gathering and attending 2000 padded keys each, and so do the small chunks.
    Sizes within 2x, or cuts that would save little, stay together. The output is the
    unsplit one's (bit for bit on the batch-invariant path, whose rows never depend on the
    rest of their call)."""
    groups, split = _groups_and_output(MIXED, batch_invariant=batch_invariant)
    if batch_invariant:  # one run of all chunks, keys padded to whole key chunks
        assert [n for n, _, _ in groups] == [2, 3, 1, 2, 1, 1, 1]
    else:
        assert groups == [
            (2, 1, 125), (3, 1, 7),  # decodes: 96 and 32 keys are 2x apart but save little
            (1, 300, 19), (3, 40, 3),  # fresh chunks
            (1, 50, 94), (1, 5, 3),  # chunks after cached tokens
        ]  # fmt: skip
    monkeypatch.setattr(attention, "SPLIT_MIN_PAIRS", float("inf"))
    whole, unsplit = _groups_and_output(MIXED, batch_invariant=batch_invariant)
    assert len(whole) == (2 if batch_invariant else 3)
    if batch_invariant:
        assert torch.equal(split, unsplit)
    else:
        torch.testing.assert_close(split, unsplit, atol=1e-5, rtol=1e-5)
