"""The SDPA path's chunks that start their sequences (a fresh prompt, nothing cached before
it): SDPA's is_causal instead of a mask, against the masked path on the same step."""

from __future__ import annotations

import pytest
import torch
from textgen.service.engine import attention

from .factories import Batch, make_batch

# whole prompts of different lengths in one group: the short ones' padded rows see keys past
# their end (block 0's and the next blocks'), which only padding may
FRESH = [(37, 37), (5, 5), (64, 64)]


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
