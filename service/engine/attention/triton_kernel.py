"""Paged attention in Triton: one kernel for decodes and prefill chunks, reading the KV pool in
place through the block tables (no gather).

The design is vLLM's unified Triton attention (`kernel_unified_attention_2d`): one program per
(query block, KV head). A query block is up to `BLOCK_Q` consecutive new tokens of one sequence
times the `G` query heads that share the KV head (GQA without copying K/V), so its score tile
has `BLOCK_M = BLOCK_Q * G` rows. The program walks that sequence's keys in tiles of `TILE`
positions, looks each key's block up in the block table (any block size), and keeps an online
softmax over the tiles. Decodes are query blocks of one token; a batch of decodes and chunks
is one launch whose grid depends only on the token and sequence counts.

Beside causal attention it has the per-layer terms of paged.py's SDPA path: a sliding
window, logit soft-capping (Gemma 2), attention sinks (gpt-oss: a logit per query head in the
softmax's denominator, with no value), ALiBi (Bloom, MPT, Falcon-RW: per head `slope x key
position`, times a scale, added to the scaled scores) and chunked local attention (Llama 4: a
query sees the keys of its own chunk of positions). A window or a chunk also moves the key
loop's start, so a long context costs such a layer only the keys it sees.

The pools are `[num_blocks, block_size, KVH, D]` (kv_pool.py) and the step's new K/V are
already in them. This module imports triton at the top: paged.py imports it lazily, so a
machine without triton never loads it. Under `TRITON_INTERPRET=1` the kernel runs on CPU
tensors, which is how tests/engine/test_triton_attention.py checks it against the SDPA path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# 8-bit pools (--kv-cache-dtype): each tile is widened to the query's dtype as it loads
KV_8BIT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Triton converts float8_e4m3fn on compute capability 8.9+ only (compiling the kernel for
# sm_80 fails; e5m2 compiles there): older GPUs take the SDPA path for such pools
E4M3_MIN_CAPABILITY = (8, 9)
MAX_HEAD_DIM = 256  # the tiles of a larger head would not fit in shared memory
# keys per inner-loop tile: a multiple of 16 (tl.dot's minimum) and independent of the block
# size, since every key looks its block up itself
KEY_TILE = 32
MIN_TILE_ROWS = 16  # tl.dot needs at least 16 rows


def supports(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor) -> bool:
    """Whether `paged_attention` takes these (same layouts as there; otherwise: another path)."""
    num_heads, num_kv_heads = query.shape[1], key_pool.shape[2]
    return (
        query.dtype in SUPPORTED_DTYPES
        and key_pool.dtype == value_pool.dtype
        and key_pool.dtype in (query.dtype, *KV_8BIT_DTYPES)
        and (key_pool.dtype != torch.float8_e4m3fn or _converts_e4m3(key_pool.device))
        and num_heads % num_kv_heads == 0
        and max(query.shape[-1], value_pool.shape[-1]) <= MAX_HEAD_DIM
        and key_pool.shape[-1] == query.shape[-1]
    )


def _converts_e4m3(device: torch.device) -> bool:
    """Whether the kernel can widen float8_e4m3fn on `device` (the interpreter can)."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= E4M3_MIN_CAPABILITY


def paged_attention(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    query_starts: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    alibi_scale: float = 1.0,
    chunk: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached K/V.

    query `[T, H, Dk]` (the batch's new tokens, sequence after sequence; any strides with a
    contiguous last dim), pools `[num_blocks, block_size, KVH, Dk or Dv]`, query_starts
    `[B + 1]` int32 (sequence i's tokens are rows query_starts[i]:query_starts[i + 1]),
    seq_lens `[B]` int32 (tokens in the cache, the new ones included), block_tables
    `[B, max_blocks]` int32 -> `[T, H, Dv]`.

    sinks `[H]`: each query head's sink logit, rounded to the query's dtype as the SDPA path
    rounds it. alibi_slopes `[H]` (float32, or Falcon's bfloat16): each head adds
    `slope x key position x alibi_scale` to its scaled (and soft-capped) scores; the product
    slope x position is rounded to the slopes' dtype, as the families' code and the SDPA path
    take it (float32; Falcon's bfloat16 rounding, bit for bit), and the rest is float32: for a
    float32 model the bias equals the SDPA path's. That path's mask is in the query's dtype, so
    in half precision it rounds the bias, and its product with alibi_scale, once more (as
    Bloom's own bfloat16 code does): by up to 2^-9 of the bias in bfloat16, several logits at
    positions in the thousands, where the kernel keeps ALiBi's bias to float32 precision: in
    half precision at long contexts the two paths differ by more than their scores' rounding.
    chunk: a query at position p sees the keys at positions p // chunk * chunk .. p.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, value_dim = value_pool.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty(num_tokens, num_heads, value_dim, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    if sinks is not None:  # rounded as the SDPA path rounds them (no copy when already so)
        sinks = sinks.to(query.dtype).contiguous()
    if alibi_slopes is not None:
        if alibi_slopes.dtype not in SUPPORTED_DTYPES:  # float64: the float32 product
            alibi_slopes = alibi_slopes.float()
        alibi_slopes = alibi_slopes.contiguous()
    rows = max(MIN_TILE_ROWS, triton.next_power_of_2(group))
    block_q = rows // group
    # Sequence i's query blocks start at global index query_starts[i] // block_q + i: an upper
    # bound on the blocks before it, so the grid needs no per-step host computation.
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        query,
        key_pool,
        value_pool,
        block_tables,
        query_starts,
        seq_lens,
        sinks,  # None where unused: the USE_ flags keep the kernel from reading them
        alibi_slopes,
        scale,
        float(softcap or 1.0),
        float(alibi_scale),
        int(window or 0),
        int(chunk or 0),
        num_seqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_pool.stride(0),
        key_pool.stride(1),
        key_pool.stride(2),
        value_pool.stride(0),
        value_pool.stride(1),
        value_pool.stride(2),
        block_tables.stride(0),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=rows,
        BLOCK_SIZE=block_size,
        TILE=KEY_TILE,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        VALUE_DIM=value_dim,
        VALUE_DIM_PAD=max(16, triton.next_power_of_2(value_dim)),
        USE_WINDOW=window is not None,
        USE_SOFTCAP=bool(softcap),
        USE_SINKS=sinks is not None,
        USE_ALIBI=alibi_slopes is not None,
        ALIBI_ROUNDING=_ALIBI_ROUNDING[None if alibi_slopes is None else alibi_slopes.dtype],
        USE_CHUNK=bool(chunk),
        KV_8BIT=key_pool.dtype in KV_8BIT_DTYPES,
        # The interpreter (CPU tensors) holds bfloat16 as raw uint16 and tl.dot multiplies
        # the bits: give it float32 operands, which is what a tensor core computes exactly
        # (products of the bf16 values, summed in float32).
        DOT_IN_FP32=query.device.type == "cpu",
        # float32 models stay float32 (no TF32 rounding of the scores): the reference is exact
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return out


# how the kernel rounds slope x position to the slopes' dtype
_ALIBI_ROUNDING = {
    None: "none",
    torch.float32: "none",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
}


@triton.jit
def _round_to_bfloat16(x):
    """float32 `x` rounded to the nearest bfloat16 (ties to even), as float32: the result of
    a bfloat16 op, as torch rounds it. In bits, since the interpreter's float32 -> bfloat16
    cast truncates (the GPU's rounds to nearest even: the same result either way)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return ((bits >> 16) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _round_to(x, ROUNDING: tl.constexpr):
    """float32 `x` rounded to the dtype named by ROUNDING ("none": float32 itself), as float32."""
    if ROUNDING == "bf16":
        x = _round_to_bfloat16(x)
    elif ROUNDING == "fp16":
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _sequence_of_block(query_starts_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence that owns global query block `q_block`: the last i whose first block,
    query_starts[i] // BLOCK_Q + i, is <= q_block (binary search over the sorted starts)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_starts_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    # tanh(|x|) = (1 - e^(-2|x|)) / (1 + e^(-2|x|)): e^(-2|x|) is in (0, 1], so nothing
    # overflows for large scores (tl has no tanh common to all triton 3.x versions)
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


# The per-step integers stay runtime values: specializing them (triton treats ints equal to 1 or
# divisible by 16 as constants by default) would compile new variants as batches change shape.
@triton.jit(do_not_specialize=["num_seqs", "block_tables_stride"])
def _paged_attention_kernel(
    out_ptr,
    query_ptr,
    key_pool_ptr,
    value_pool_ptr,
    block_tables_ptr,
    query_starts_ptr,
    seq_lens_ptr,
    sinks_ptr,  # [H]: each query head's sink logit (USE_SINKS)
    alibi_slopes_ptr,  # [H]: each query head's ALiBi slope (USE_ALIBI)
    scale,
    softcap,
    alibi_scale,
    window,
    chunk,
    num_seqs,
    query_stride_token,
    query_stride_head,
    out_stride_token,
    out_stride_head,
    key_stride_block,
    key_stride_slot,
    key_stride_head,
    value_stride_block,
    value_stride_slot,
    value_stride_head,
    block_tables_stride,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # score-tile rows: BLOCK_Q * GROUP rounded up to a power of 2
    BLOCK_SIZE: tl.constexpr,  # positions per pool block
    TILE: tl.constexpr,  # keys per inner-loop iteration
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # power of 2 >= 16; the padding lanes load 0
    VALUE_DIM: tl.constexpr,
    VALUE_DIM_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    ALIBI_ROUNDING: tl.constexpr,  # "none", "bf16", "fp16": the slopes' dtype (_ALIBI_ROUNDING)
    USE_CHUNK: tl.constexpr,  # chunked local attention: a query sees its own chunk of keys
    KV_8BIT: tl.constexpr,  # the pools hold 8-bit floats: widen each tile to the query's dtype
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _sequence_of_block(query_starts_ptr, q_block, num_seqs, BLOCK_Q)
    query_start = tl.load(query_starts_ptr + seq)
    query_len = tl.load(query_starts_ptr + seq + 1) - query_start
    local_block = q_block - (query_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= query_len:  # the grid's slack past this sequence's blocks
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_query_pos = seq_len - query_len  # the new tokens are the sequence's last ones

    # Row r is query token local_block * BLOCK_Q + r // GROUP of the sequence, query head
    # kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    query_index = local_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    # (when GROUP isn't a power of 2, the rows past BLOCK_Q * GROUP would redo the next
    # block's first query: left out)
    row_is_real = (rows < BLOCK_Q * GROUP) & (query_index < query_len)
    query_pos = first_query_pos + query_index  # causal, aligned bottom-right

    dims = tl.arange(0, HEAD_DIM_PAD)
    value_dims = tl.arange(0, VALUE_DIM_PAD)
    token = (query_start + query_index).to(tl.int64)
    q = tl.load(
        query_ptr
        + token[:, None] * query_stride_token
        + head[:, None] * query_stride_head
        + dims[None, :],
        mask=row_is_real[:, None] & (dims < HEAD_DIM)[None, :],
        other=0.0,
    )
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    # Keys this block can see: up to its last query's position, and from its first query's
    # window start and chunk start (tiles wholly before them are skipped, not just masked).
    block_first_pos = first_query_pos + local_block * BLOCK_Q
    last_query_pos = first_query_pos + tl.minimum((local_block + 1) * BLOCK_Q, query_len) - 1
    key_end = last_query_pos + 1
    lowest_key = 0
    if USE_WINDOW:
        lowest_key = tl.maximum(block_first_pos - window + 1, 0)
    if USE_CHUNK:
        lowest_key = tl.maximum(lowest_key, (block_first_pos // chunk) * chunk)
    key_start = (lowest_key // TILE) * TILE
    if USE_CHUNK:  # each row's own chunk start
        query_chunk_start = (query_pos // chunk) * chunk
    if USE_ALIBI:
        slope = tl.load(alibi_slopes_ptr + head, mask=row_is_real, other=0.0)

    # Online softmax over key tiles: per row, the running max m (row_max) of the scores s,
    # row_sum = sum exp(s - m) and acc = sum exp(s - m) v. A tile that raises the max to m'
    # rescales both by alpha = exp(m - m'); at the end out = acc / row_sum.
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_SINKS:
        # The sink is one more logit in the denominator, with no value: start the online
        # softmax from it, m = sink and row_sum = exp(sink - m) = 1 (0 for a sink of -inf,
        # and on padding rows), acc = 0. (The sinks come rounded to the query's dtype.)
        row_max = tl.load(sinks_ptr + head, mask=row_is_real, other=float("-inf"))
        row_max = row_max.to(tl.float32)
        row_sum = tl.where(row_max > float("-inf"), 1.0, 0.0)
    acc = tl.zeros([BLOCK_M, VALUE_DIM_PAD], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * block_tables_stride
    for tile_start in range(key_start, key_end, TILE):
        key_pos = tile_start + tl.arange(0, TILE)
        key_is_real = key_pos < key_end
        block = tl.load(table + key_pos // BLOCK_SIZE, mask=key_is_real, other=0).to(tl.int64)
        slot = key_pos % BLOCK_SIZE
        k = tl.load(  # [HEAD_DIM_PAD, TILE]: transposed for q @ k
            key_pool_ptr
            + block[None, :] * key_stride_block
            + slot[None, :] * key_stride_slot
            + kv_head * key_stride_head
            + dims[:, None],
            mask=key_is_real[None, :] & (dims < HEAD_DIM)[:, None],
            other=0.0,
        )
        v = tl.load(  # [TILE, VALUE_DIM_PAD]
            value_pool_ptr
            + block[:, None] * value_stride_block
            + slot[:, None] * value_stride_slot
            + kv_head * value_stride_head
            + value_dims[None, :],
            mask=key_is_real[:, None] & (value_dims < VALUE_DIM)[None, :],
            other=0.0,
        )
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif KV_8BIT:
            k = k.to(query_ptr.dtype.element_ty)
            v = v.to(query_ptr.dtype.element_ty)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [BLOCK_M, TILE], float32
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)  # Gemma2's logit soft-capping, before softmax
        if USE_ALIBI:
            # slope x key position in the slopes' dtype (the position converted to it first,
            # as torch's bfloat16 x int64 product does: exact up to 256), then times the
            # scale and added in float32
            key_pos_f = _round_to(key_pos.to(tl.float32), ALIBI_ROUNDING)
            bias = slope.to(tl.float32)[:, None] * key_pos_f[None, :]
            s = s + _round_to(bias, ALIBI_ROUNDING) * alibi_scale
        # causal: k_pos <= q_pos (this also hides keys past the sequence); window: a query
        # sees its last `window` positions, k_pos > q_pos - window; chunk: from its chunk's
        # first position
        allowed = row_is_real[:, None] & (key_pos[None, :] <= query_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (key_pos[None, :] > query_pos[:, None] - window)
        if USE_CHUNK:
            allowed = allowed & (key_pos[None, :] >= query_chunk_start[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(row_max, tl.max(s, axis=1))
        # A row with nothing allowed yet keeps max -inf, and exp(-inf - -inf) is NaN: use 0,
        # so its p and alpha are exp(-inf) = 0 and row_sum, acc stay 0.
        m_new = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(row_max - m_new)
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        # p is rounded to the query's (V's) dtype for the second product, as SDPA's kernels do
        p = p.to(query_ptr.dtype.element_ty)
        if DOT_IN_FP32:
            p = p.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        row_max = m_new

    # Every real row sees at least its own key, so row_sum > 0 there; padding rows aren't stored.
    # (A sink adds to row_sum and nothing to acc: it takes its share of each row's weight.)
    acc = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    tl.store(
        out_ptr
        + token[:, None] * out_stride_token
        + head[:, None] * out_stride_head
        + value_dims[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_is_real[:, None] & (value_dims < VALUE_DIM)[None, :],
    )
