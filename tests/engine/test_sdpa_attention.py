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


def test_chunks_after_cached_tokens_or_batch_invariant_are_not_fresh():
    cached = make_batch(
        block_size=16, num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32,
        seqs=[(5, 5), (9, 50)],
    )  # fmt: skip
    assert not cached.meta.groups()[0].fresh
    decodes = make_batch(
        block_size=16, num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32,
        seqs=[(1, 1), (1, 30)],
    )  # fmt: skip
    assert not decodes.meta.groups()[0].fresh
    fresh = make_batch(
        block_size=16, num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32, seqs=FRESH
    )
    meta = fresh.meta
    invariant = attention.BatchMetadata.build(
        meta.pool, meta.query_lens, meta.context_lens, meta.block_tables, meta.device,
        batch_invariant=True,
    )  # fmt: skip
    assert not invariant.groups()[0].fresh
