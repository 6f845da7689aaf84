"""Batch-invariant attention for the CPU path: a query row's result depends on its own
sequence's keys and values only, never on the padding or the other sequences of the step,
nor on how its prompt was split into prefill chunks.

Why the plain SDPA-over-gather path is not (measured on an avx512_bf16 CPU, torch 2.13):
- CPU flash attention reduces each row over the keys it is given, padding included: in one
  kernel block up to 512 keys, then in blocks of 512. Padding a sequence to a neighbour's
  longer context changes the matmuls' reduction length and, past 512 keys, where the blocks
  fall; 1 in 25 rows then differs in bf16 and most rows in float32.
- Its matmuls treat rows differently in a tail of fewer than 4 (a query block of 33 rows
  computes row 32 otherwise than a block of 32 computes row 31): the result of a decode, a
  1-token chunk or a 48-token chunk's row depended on its neighbours' row counts.

What is done instead:
- Keys are cut into fixed chunks of `chunk_tokens` positions (0..C-1, C..2C-1, ...), the
  same for every sequence and step. One flash-attention call covers every (sequence, chunk)
  pair, each with exactly C keys, so every row meets the same kernel shapes; keys a row may
  not see are masked, and masked keys' values never matter (measured: no effect).
- Query rows are padded to a multiple of `ROW_MULTIPLE` so no row is in a short tail.
- The per-chunk results are merged by their log-sum-exp, summed in chunk order. Chunks past
  a row's last visible key get weight 0, and adding 0 at the end of the sum changes
  nothing, so a longer padded neighbour leaves the result bit for bit. The merge uses exp,
  multiply, add and divide only, whose CPU kernels give the same bits in their vectorized
  loops and scalar tails (measured; torch.sum's order depends on the reduced length).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# NOTE measured (torch 2.13 CPU flash attention and matmuls, bf16 and fp32): rows in a block
# of a multiple of 4 rows agree bit for bit whatever the block's size and the row's place;
# rows of a 1-3 row tail don't.
ROW_MULTIPLE = 4
# Keys per chunk: at most 512 (one block of the CPU flash kernel). Contexts up to it need no
# merge; longer ones merge ceil(context / C) partial results.
KV_CHUNK_TOKENS = 128

# aten's CPU flash attention, which also returns the log-sum-exp of each row
_flash_attention_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def chunk_tokens_for(block_size: int) -> int:
    """Keys per chunk for a pool of `block_size`-token blocks: whole blocks, ~KV_CHUNK_TOKENS."""
    return max(1, KV_CHUNK_TOKENS // block_size) * block_size


def padded_rows(num_rows: int) -> int:
    return -(-num_rows // ROW_MULTIPLE) * ROW_MULTIPLE


@dataclass(eq=False)
class ChunkedMask:
    """A group's mask cut into key chunks, built once per step and shared by the layers."""

    additive: torch.Tensor  # [b * nc, 1, rows, C]: 0 = attend, -inf = not
    visible: torch.Tensor  # [b, nc, 1, rows] bool: the chunk has a key the row may see
    num_chunks: int

    @classmethod
    def build(cls, allowed: torch.Tensor, chunk_tokens: int, dtype: torch.dtype) -> ChunkedMask:
        """allowed: `[b, 1, rows, nc * C]` bool (rows: padded to ROW_MULTIPLE, or 1 to
        broadcast over the rows)."""
        b, _, rows, num_keys = allowed.shape
        nc = num_keys // chunk_tokens
        chunks = allowed.view(b, rows, nc, chunk_tokens).transpose(1, 2)  # [b, nc, rows, C]
        additive = torch.zeros(chunks.shape, dtype=dtype, device=allowed.device)
        additive.masked_fill_(~chunks, float("-inf"))
        return cls(
            additive=additive.view(b * nc, 1, rows, chunk_tokens),
            visible=chunks.any(-1).unsqueeze(2),
            num_chunks=nc,
        )


def attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: ChunkedMask,
    scaling: float,
    softcap: float | None,
) -> torch.Tensor:
    """query `[b, KVH, R, D]` (R: any row count), keys/values `[b * nc, KVH, C, D]` (chunk j
    of sequence i at i * nc + j) -> `[b, KVH, R, Dv]`."""
    b, num_rows, nc = query.shape[0], query.shape[2], mask.num_chunks
    rows = _rows_per_chunk(query, nc)
    if softcap:
        out, lse = _softcapped_chunks(rows, keys, values, mask.additive, scaling, softcap)
    else:
        out, lse = _flash_attention_cpu(rows, keys, values, attn_mask=mask.additive, scale=scaling)
    if nc > 1:
        out = _merge_chunks(out, lse, mask.visible, b, nc)
    return out[:, :, :num_rows]


def _rows_per_chunk(query: torch.Tensor, nc: int) -> torch.Tensor:
    """`[b, KVH, R, D]` -> `[b * nc, KVH, R', D]`: the rows, padded to R' (a multiple of
    ROW_MULTIPLE), once per key chunk."""
    b, num_kv_heads, num_rows, head_dim = query.shape
    extra = padded_rows(num_rows) - num_rows
    if b == 1:  # one sequence (a long prompt's chunk): a stride-0 view, no copy per chunk
        rows = F.pad(query, (0, 0, 0, extra)) if extra else query
        return rows.expand(nc, -1, -1, -1)
    rows = query.new_zeros(b, nc, num_kv_heads, num_rows + extra, head_dim)
    rows[:, :, :, :num_rows] = query.unsqueeze(1)
    return rows.view(b * nc, num_kv_heads, -1, head_dim)


def _softcapped_chunks(
    rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA has no logit soft-capping (Gemma2): the eager formula per chunk, softmax in
    float32, and each row's log-sum-exp for the merge."""
    scores = torch.matmul(rows, keys.transpose(-1, -2)) * scaling
    scores = (torch.tanh(scores / softcap) * softcap + mask).float()
    lse = torch.logsumexp(scores, dim=-1)  # -inf where the chunk hides every key
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0)
    return torch.matmul(probs.to(values.dtype), values), lse


def _merge_chunks(
    out: torch.Tensor, lse: torch.Tensor, visible: torch.Tensor, b: int, nc: int
) -> torch.Tensor:
    """Per-chunk results `[b * nc, KVH, R, Dv]` (each normalised over its chunk) and their
    log-sum-exp `[b * nc, KVH, R]` -> `[b, KVH, R, Dv]` over all the chunks."""
    lse = lse.view(b, nc, *lse.shape[1:]).masked_fill(~visible, float("-inf"))
    # every row sees the chunk of its own position (padding rows see all): the max is finite
    weight = torch.exp(lse - lse.amax(dim=1, keepdim=True))  # 0 for hidden chunks
    out = out.view(b, nc, *out.shape[1:])
    # NOTE measured: a loop over the chunks, each [b, KVH, R, Dv], is ~15x faster than one
    # broadcast over [b, nc, KVH, R, Dv] for a 2000-token chunk (flash's output layout)
    num = out[:, 0].float().mul_(weight[:, 0].unsqueeze(-1))
    den = weight[:, 0].clone()
    for j in range(1, nc):
        num.add_(out[:, j].float().mul_(weight[:, j].unsqueeze(-1)))
        den.add_(weight[:, j])
    return num.div_(den.unsqueeze(-1)).to(out.dtype)
