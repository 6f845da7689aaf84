"""The Triton paged-attention kernel, run on CPU by Triton's interpreter, against the SDPA path.

Each case attends one mixed batch (decodes, a whole prompt, prefill chunks after cached tokens)
over a pool whose blocks are shuffled, once through `_sdpa_attention` (the reference) and once
through the kernel. The interpreter is slow, so shapes are tiny; the engine test at the end
runs the kernel inside a tiny model's greedy generation. CI installs triton (the `test` extra):
without it this module fails to import, on purpose.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from textgen.service.engine.attention import paged as attention
from textgen.service.engine.attention import triton_kernel as triton_attention
from textgen.service.engine.kv_pool import KVCachePool, LayerCache
from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

from .factories import (
    VOCAB_SIZE,
    Batch,
    assert_idle,
    assert_matches_generate,
    make_batch,
    make_core,
    make_seq,
    random_prompt,
    run_to_completion,
)

CPU = torch.device("cpu")
# (new tokens, tokens in the cache after the step), decodes first as the runner lays them out:
# decodes at contexts 1, 37 and 70, a whole 5-token prompt, chunks of 9 and 24 after 41 and 36
# cached tokens (the 24-token chunk spans several query blocks at every GQA group size)
MIXED_BATCH = [(1, 1), (1, 37), (1, 70), (5, 5), (9, 50), (24, 60)]
# (atol, rtol) of the kernel against SDPA in float32 on the same (rounded) inputs. In half
# precision the kernel rounds the probabilities to the value dtype before p @ v, as GPU
# kernels do: 1-2 bf16 ulps at the outputs' magnitude (~2).
TOLERANCE = {
    torch.float32: (2e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
# against SDPA in the half dtype itself, which has its own rounding (its soft-capped scores
# are float16 products: 3e-3 off in float16 where the kernel is 1e-3 off)
SAME_DTYPE_TOLERANCE = {dtype: (2 * atol, 2 * rtol) for dtype, (atol, rtol) in TOLERANCE.items()}


@pytest.fixture(autouse=True, scope="module")
def interpreted_kernel():
    # tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton
    kernel = triton_attention._paged_attention_kernel
    assert type(kernel).__name__ == "InterpretedFunction", (
        "triton was imported before TRITON_INTERPRET=1 was set: its kernels would need a GPU"
    )


def attend_both(
    batch: Batch, *, window=None, softcap=None, sinks=None, alibi=None, chunk=None
) -> tuple[torch.Tensor, torch.Tensor]:
    cache = batch.pool.layer(0, batch.key, batch.value)
    scale = batch.query.shape[-1] ** -0.5
    args = (batch.query, cache, batch.meta, scale, window, softcap, sinks, alibi, chunk)
    return attention._triton_attention(*args), attention._sdpa_attention(*args)


def sdpa_in_float32(
    batch: Batch, *, window=None, softcap=None, sinks=None, alibi=None, chunk=None
) -> torch.Tensor:
    """The SDPA path on float32 copies of the inputs. ALiBi's slopes keep their dtype: the
    product slope x position is taken in it on both paths."""
    cache = batch.pool.layer(0, batch.key, batch.value)
    keys, values = cache.keys.float(), cache.values.float()
    cache32 = LayerCache.over(keys, values)
    scale = batch.query.shape[-1] ** -0.5
    sinks = None if sinks is None else sinks.float()
    return attention._sdpa_attention(
        batch.query.float(), cache32, batch.meta, scale, window, softcap, sinks, alibi, chunk
    )


def assert_close(out: torch.Tensor, ref: torch.Tensor, tolerance=TOLERANCE) -> None:
    atol, rtol = tolerance[out.dtype]
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref.to(out.dtype), atol=atol, rtol=rtol)


# Every block size x head dim x GQA group in float32, each window/softcap combination three
# times over them; then the half-precision dtypes on a spread of the same.
FLOAT32_CASES = [
    (block_size, head_dim, group, *[(None, None), (20, None), (None, 30.0), (20, 30.0)][i % 4])
    for i, (block_size, head_dim, group) in enumerate(
        (b, d, g) for b in (16, 32) for d in (64, 128) for g in (1, 4, 8)
    )
]
HALF_CASES = [
    (dtype, *case)
    for dtype in (torch.bfloat16, torch.float16)
    for case in [(16, 64, 1, None, None), (32, 128, 4, 20, None), (16, 128, 8, 20, 30.0)]
]


def heads_for(group: int) -> tuple[int, int]:
    """(query heads, KV heads): two KV heads where the group leaves room, to test the map."""
    return (2, 2) if group == 1 else (8, 8 // group)


@pytest.mark.parametrize("block_size, head_dim, group, window, softcap", FLOAT32_CASES)
def test_float32_matches_sdpa(block_size, head_dim, group, window, softcap):
    num_heads, num_kv_heads = heads_for(group)
    batch = make_batch(
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=torch.float32,
        seqs=MIXED_BATCH,
    )
    assert_close(*attend_both(batch, window=window, softcap=softcap))


@pytest.mark.parametrize("dtype, block_size, head_dim, group, window, softcap", HALF_CASES)
def test_half_precision_matches_sdpa(dtype, block_size, head_dim, group, window, softcap):
    num_heads, num_kv_heads = heads_for(group)
    batch = make_batch(
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        seqs=MIXED_BATCH,
    )
    out, ref = attend_both(batch, window=window, softcap=softcap)
    assert out.dtype == dtype
    assert_close(out, ref, SAME_DTYPE_TOLERANCE)
    assert_close(out, sdpa_in_float32(batch, window=window, softcap=softcap))


@pytest.mark.parametrize(
    "head_dim, value_dim, num_heads, num_kv_heads",
    [(48, 48, 3, 1), (64, 32, 4, 2)],
    ids=["padded-dim-group-3", "value-dim-differs"],
)
def test_padded_head_dims_and_odd_groups(head_dim, value_dim, num_heads, num_kv_heads):
    """A head dim that isn't a power of 2 (masked padding lanes), 3 query heads per KV head
    (the score tile's last row belongs to no query), K and V dims that differ (MLA)."""
    batch = make_batch(
        block_size=16,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        value_dim=value_dim,
        dtype=torch.float32,
        seqs=MIXED_BATCH,
    )
    assert_close(*attend_both(batch, window=16, softcap=5.0))


def test_decodes_only_and_a_window_wider_than_the_context():
    batch = make_batch(
        block_size=16,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float32,
        seqs=[(1, 1), (1, 16), (1, 17), (1, 90)],
    )
    assert_close(*attend_both(batch, window=200))


def test_reads_nothing_outside_each_sequences_positions():
    """Poison every pool slot that holds no live position with NaN: one read of it (an unmasked
    load, a padded table entry, a slot past a context) would turn the output NaN."""
    batch = make_batch(
        block_size=16,
        num_heads=4,
        num_kv_heads=1,
        head_dim=64,
        dtype=torch.float32,
        seqs=MIXED_BATCH,
    )
    out_clean, ref = attend_both(batch, window=20)
    live = torch.zeros(batch.pool.num_blocks * batch.pool.block_size, dtype=torch.bool)
    for context, table in zip(batch.meta.context_lens, batch.meta.block_tables):
        pos = torch.arange(context)
        live[torch.tensor(table)[pos // 16] * 16 + pos % 16] = True
    cache = batch.pool.layer(0, batch.key, batch.value)
    cache.key_slots[~live] = float("nan")
    cache.value_slots[~live] = float("nan")
    out_poisoned, _ = attend_both(batch, window=20)
    assert_close(out_poisoned, ref)
    assert torch.equal(out_poisoned, out_clean)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_8bit_pools_are_widened_as_sdpa_widens_them(dtype, kv_dtype):
    """--kv-cache-dtype: the kernel reads the 8-bit pool and widens each tile to the query's
    dtype; the SDPA path widens the gathered blocks: the same values either way."""
    batch = make_batch(
        block_size=16,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        dtype=dtype,
        seqs=MIXED_BATCH,
        kv_dtype=kv_dtype,
    )
    assert batch.pool.layer(0, batch.key, batch.value).keys.dtype == kv_dtype
    out, ref = attend_both(batch, window=20)
    assert out.dtype == dtype
    assert_close(out, ref, SAME_DTYPE_TOLERANCE)


# attention sinks (gpt-oss), ALiBi (Bloom, MPT, Falcon-RW), chunked local attention (Llama 4)


def sinks_for(num_heads: int, dtype=torch.float32) -> torch.Tensor:
    """A sink logit per query head, large enough to take a real share of each row (scores
    here are ~N(0, 1)): some above every score, some far below."""
    g = torch.Generator().manual_seed(7)
    return (torch.randn(num_heads, generator=g) * 3).to(dtype)


def falcon_alibi(num_heads: int, head_dim: int) -> attention.Alibi:
    """Falcon-RW's ALiBi as its adapter passes it: Bloom's slopes rounded to bfloat16, the
    bias times 1 / sqrt(head_dim). 12 heads: slopes that aren't powers of 2 (their products
    with positions round in bfloat16)."""
    slopes = _get_alibi_slopes(num_heads, CPU).bfloat16()
    return attention.Alibi(slopes, head_dim**-0.5)


def bloom_alibi(num_heads: int) -> attention.Alibi:
    return attention.Alibi(_get_alibi_slopes(num_heads, CPU))


# (block size, query heads, KV heads, head dim, terms): each term alone, then with GQA, a
# window, the softcap and each other. MIXED_BATCH's prompts cross chunk boundaries (its
# 24-token chunk spans positions 36-59, its 9-token one 41-49) inside a query block, and its
# decodes (contexts 37, 70) see part of a chunk; with chunks of 64 the decode at position 69
# starts its key loop at the chunk's first tile (and a wrong start there empties its row).
SINKS_ALIBI_CHUNK = {"sinks": True, "alibi": "bloom", "chunk": 16}
EXTRA_TERM_CASES = {
    "sinks-gqa4": (16, 8, 2, 32, {"sinks": True}),
    "sinks-window-softcap-mqa": (32, 8, 1, 64, {"sinks": True, "window": 20, "softcap": 30.0}),
    "alibi-gqa4-window": (16, 8, 2, 32, {"alibi": "bloom", "window": 20}),
    "alibi-bf16-slopes-scaled-group3": (16, 12, 4, 32, {"alibi": "falcon"}),
    "chunk16-gqa2": (16, 8, 4, 32, {"chunk": 16}),
    "chunk8-sinks-mqa": (32, 8, 1, 32, {"chunk": 8, "sinks": True}),
    "chunk64-window-mha": (16, 2, 2, 32, {"chunk": 64, "window": 20}),
    "all-gqa4-softcap": (16, 8, 2, 32, {**SINKS_ALIBI_CHUNK, "softcap": 5.0}),
}


def extra_terms(spec: dict, num_heads: int, head_dim: int, dtype=torch.float32) -> dict:
    terms = {key: spec[key] for key in ("window", "softcap", "chunk") if key in spec}
    if spec.get("sinks"):
        terms["sinks"] = sinks_for(num_heads, dtype)
    if spec.get("alibi") == "bloom":
        terms["alibi"] = bloom_alibi(num_heads)
    elif spec.get("alibi") == "falcon":
        terms["alibi"] = falcon_alibi(num_heads, head_dim)
    return terms


@pytest.mark.parametrize(
    "block_size, num_heads, num_kv_heads, head_dim, spec",
    list(EXTRA_TERM_CASES.values()),
    ids=list(EXTRA_TERM_CASES),
)
def test_sinks_alibi_and_chunks_match_sdpa(block_size, num_heads, num_kv_heads, head_dim, spec):
    """float32: the kernel's bias equals the SDPA path's (Falcon's bfloat16 products included),
    so the two agree as closely as without these terms."""
    batch = make_batch(
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=torch.float32,
        seqs=MIXED_BATCH,
    )
    assert_close(*attend_both(batch, **extra_terms(spec, num_heads, head_dim)))


@pytest.mark.parametrize(
    "dtype, spec",
    [
        (torch.bfloat16, {"sinks": True, "chunk": 16, "window": 20}),
        (torch.bfloat16, {"alibi": "falcon"}),
        (torch.float16, {"alibi": "bloom", "sinks": True, "chunk": 8}),
    ],
    ids=["bf16-sinks-chunk", "bf16-falcon-alibi", "fp16-all"],
)
def test_half_precision_sinks_alibi_and_chunks_match_sdpa(dtype, spec):
    """Against SDPA in float32 within the usual tolerance. The SDPA path in the half dtype
    rounds its ALiBi bias (a mask in the query's dtype) and, with sinks (its eager formula),
    its scores to that dtype, where the kernel keeps both in float32: in float16 with sinks
    that path is itself ~9e-3 off float32 (the kernel 1e-3), so against it the kernel is held
    to that path's own error plus the same-dtype tolerance."""
    batch = make_batch(
        block_size=16, num_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype, seqs=MIXED_BATCH
    )
    terms = extra_terms(spec, 8, 64, dtype)
    out, ref = attend_both(batch, **terms)
    assert out.dtype == dtype
    ref32 = sdpa_in_float32(batch, **terms)
    assert_close(out, ref32)
    sdpa_error = (ref.float() - ref32).abs().max()
    assert (out.float() - ref.float()).abs().max() <= sdpa_error + SAME_DTYPE_TOLERANCE[dtype][0]


def test_bfloat16_alibi_products_round_as_falcons_do_past_256():
    """Falcon multiplies its bfloat16 slopes by the positions in bfloat16 (a position past 256
    rounds, then the product): the kernel rounds the same, bit for bit in the bias. Taken in
    float32 instead, the bias would be up to 1/512 of slope x position off: at these
    contexts a visible change in the outputs."""
    batch = make_batch(
        block_size=16,
        num_heads=12,
        num_kv_heads=1,
        head_dim=32,
        dtype=torch.float32,
        seqs=[(1, 300), (1, 517), (3, 290)],
    )
    alibi = falcon_alibi(12, 32)
    out, ref = attend_both(batch, alibi=alibi)
    assert_close(out, ref)
    in_float32 = attention.Alibi(alibi.slopes.float(), alibi.scale)
    _, ref_float32_product = attend_both(batch, alibi=in_float32)
    assert (out - ref_float32_product).abs().max() > 100 * TOLERANCE[torch.float32][0]


def test_refuses_what_it_does_not_handle():
    query = torch.zeros(5, 4, 64)  # [T, H, D]
    pool = torch.zeros(2, 16, 2, 64)
    assert triton_attention.supports(query, pool, pool)
    assert triton_attention.supports(query, pool, torch.zeros(2, 16, 2, 32))  # Dv differs
    assert not triton_attention.supports(query.double(), pool.double(), pool.double())
    assert not triton_attention.supports(query, pool.half(), pool.half())  # mixed dtypes
    fp8 = pool.to(torch.float8_e4m3fn)
    assert triton_attention.supports(query, fp8, fp8)  # an 8-bit pool, widened
    assert not triton_attention.supports(query, fp8, pool)
    assert not triton_attention.supports(torch.zeros(5, 3, 64), pool, pool)  # 3 heads over 2
    big = torch.zeros(2, 16, 2, 512)
    assert not triton_attention.supports(torch.zeros(5, 4, 512), big, big)


def test_e4m3_pools_go_to_sdpa_on_gpus_before_ada(monkeypatch):
    """Triton widens float8_e4m3fn on compute capability 8.9+ only (sm_80 fails to compile)."""
    capability = {"value": (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability["value"])
    cuda = torch.device("cuda")
    assert not triton_attention._converts_e4m3(cuda)
    capability["value"] = (8, 9)
    assert triton_attention._converts_e4m3(cuda)
    assert triton_attention._converts_e4m3(CPU)  # the interpreter


# the CUDA dispatch ---------------------------------------------------------------


def test_triton_is_available_on_cuda_devices_only():
    assert attention.triton_available(torch.device("cuda"))
    assert not attention.triton_available(CPU)


@pytest.mark.parametrize(
    "use_flash, use_triton, block_size, dtype, expected",
    [
        (True, True, 16, torch.bfloat16, "_triton_attention"),  # flash would gather
        (True, True, 256, torch.bfloat16, "_flash_attention"),  # flash reads in place
        (True, True, 16, torch.float32, "_triton_attention"),  # flash-attn refuses float32
        (True, False, 16, torch.bfloat16, "_flash_attention"),
        (False, True, 256, torch.bfloat16, "_triton_attention"),
        (False, False, 16, torch.bfloat16, "_sdpa_attention"),
        (True, False, 16, torch.float32, "_sdpa_attention"),
    ],
)
def test_kernel_order(use_flash, use_triton, block_size, dtype, expected):
    pool = KVCachePool(num_blocks=2, block_size=block_size)
    meta = attention.BatchMetadata.build(pool, [1], [1], [[1]], CPU)
    meta.use_flash, meta.use_triton = use_flash, use_triton
    states = torch.zeros(1, 2, 1, 64, dtype=dtype)
    cache = pool.layer(0, states, states)
    query = torch.zeros(1, 4, 1, 64, dtype=dtype)
    assert attention._pick_kernel(meta, query, cache).__name__ == expected


@pytest.mark.parametrize(
    "use_flash, use_triton, block_size, expected",
    [
        (True, True, 256, "_triton_attention"),  # flash-attn would read in place: no sinks
        (True, True, 16, "_triton_attention"),
        (True, False, 256, "_sdpa_attention"),
        (True, False, 16, "_sdpa_attention"),
        (False, False, 16, "_sdpa_attention"),
    ],
)
def test_kernel_order_for_sinks_alibi_and_chunks(use_flash, use_triton, block_size, expected):
    """Layers with attention sinks, ALiBi or chunks: Triton or SDPA, never flash-attn."""
    pool = KVCachePool(num_blocks=2, block_size=block_size)
    meta = attention.BatchMetadata.build(pool, [1], [1], [[1]], CPU)
    meta.use_flash, meta.use_triton = use_flash, use_triton
    states = torch.zeros(1, 2, 1, 64, dtype=torch.bfloat16)
    cache = pool.layer(0, states, states)
    query = torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16)
    picked = attention._pick_kernel(meta, query, cache, extra_terms=True)
    assert picked.__name__ == expected


@pytest.mark.parametrize("use_triton", [True, False])
def test_layers_with_sinks_alibi_and_chunks_reach_the_triton_kernel(use_triton, monkeypatch):
    """_paged_attention hands the three terms to the kernel it picks (the SDPA path where
    triton isn't in use): the same outputs either way."""
    batch = make_batch(
        block_size=16,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.float32,
        seqs=[(1, 20), (6, 30)],
    )
    terms = (sinks_for(4), bloom_alibi(4), 16)
    scale = 16**-0.5
    _, ref = attend_both(batch, window=24, softcap=20.0, sinks=terms[0], alibi=terms[1], chunk=16)
    calls = []
    kernels = {name: getattr(attention, name) for name in ("_triton_attention", "_sdpa_attention")}
    for name, kernel in kernels.items():
        monkeypatch.setattr(
            attention, name, lambda *args, _k=kernel, _n=name: calls.append(_n) or _k(*args)
        )
    batch.meta.use_flash, batch.meta.use_triton = True, use_triton
    out = attention._paged_attention(
        batch.meta, 0, batch.query, batch.key, batch.value, scale, 24, 20.0, *terms
    )
    assert calls == ["_triton_attention" if use_triton else "_sdpa_attention"]
    assert_close(out, ref)


@pytest.mark.parametrize(
    "use_triton, expected", [(True, "_triton_attention"), (False, "_sdpa_attention")]
)
def test_flash_attn_never_reads_an_8_bit_pool(use_triton, expected):
    """flash-attn 2 takes K/V of the query's dtype: an 8-bit pool goes to Triton (or SDPA),
    even at the block size flash-attn would read in place."""
    pool = KVCachePool(num_blocks=2, block_size=256, dtype=torch.float8_e4m3fn)
    meta = attention.BatchMetadata.build(pool, [1], [1], [[1]], CPU)
    meta.use_flash, meta.use_triton = True, use_triton
    states = torch.zeros(1, 2, 1, 64, dtype=torch.bfloat16)
    cache = pool.layer(0, states, states)
    query = torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16)
    assert attention._pick_kernel(meta, query, cache).__name__ == expected


def test_kernel_order_falls_back_when_triton_refuses_the_shape():
    pool = KVCachePool(num_blocks=2, block_size=16)
    meta = attention.BatchMetadata.build(pool, [1], [1], [[1]], CPU)
    meta.use_triton = True
    states = torch.zeros(1, 2, 1, 512)
    cache = pool.layer(0, states, states)
    assert attention._pick_kernel(meta, torch.zeros(1, 4, 1, 512), cache).__name__ == (
        "_sdpa_attention"
    )


@pytest.mark.server
def test_kernel_compiles_for_the_gpu():
    """The interpreter accepts code the compiler rejects: compile the kernel for an H100/H200
    (sm_90) ahead of time, as the GPU would on first launch; ptxas ships in the triton wheel."""
    script = textwrap.dedent(
        """
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from textgen.service.engine.attention import triton_kernel as ta

        kernel = ta._paged_attention_kernel
        pointers = {"block_tables_ptr", "query_starts_ptr", "seq_lens_ptr"}
        # attention sinks in the query's dtype; ALiBi slopes float32 or bf16 (Falcon's)
        slopes = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp32"}
        # the launch specializes int arguments equal to 1 as constants (one sequence, tables
        # one block wide): the loops they feed must still compile
        ones = ("num_seqs", "window", "block_tables_stride", "chunk")
        pools = {"key_pool_ptr", "value_pool_ptr"}
        # (query dtype, pool dtype, ...): the 8-bit pools of --kv-cache-dtype too; flags:
        # window, softcap, sinks, ALiBi, chunk
        for dtype, kv_dtype, group, head_dim, flags, specialized in [
            ("bf16", "bf16", 1, 128, (False, False, False, False, False), ()),
            ("fp16", "fp16", 8, 64, (True, True, True, True, True), ones),
            ("fp32", "fp32", 4, 128, (True, False, False, True, False), ()),
            ("bf16", "bf16", 4, 192, (False, True, False, True, True), ()),
            ("bf16", "fp8e4nv", 4, 128, (False, False, True, False, False), ()),
            ("fp16", "fp8e5", 8, 64, (True, False, False, False, True), ()),
            ("bf16", "bf16", 8, 64, (True, False, True, False, False), ()),  # gpt-oss
        ]:
            rows = max(16, triton.next_power_of_2(group))
            pad = max(16, triton.next_power_of_2(head_dim))
            constants = dict(
                GROUP=group, BLOCK_Q=rows // group, BLOCK_M=rows, BLOCK_SIZE=16,
                TILE=ta.KEY_TILE, HEAD_DIM=head_dim, HEAD_DIM_PAD=pad, VALUE_DIM=head_dim,
                VALUE_DIM_PAD=pad, USE_WINDOW=flags[0], USE_SOFTCAP=flags[1],
                USE_SINKS=flags[2], USE_ALIBI=flags[3], USE_CHUNK=flags[4],
                ALIBI_ROUNDING="bf16" if flags[3] and slopes[dtype] == "bf16" else "none",
                KV_8BIT=kv_dtype != dtype, DOT_IN_FP32=False,
                DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
            )
            constants.update(dict.fromkeys(specialized, 1))
            signature = {
                name: "constexpr" if name in constants
                else "*i32" if name in pointers
                else "*" + slopes[dtype] if name == "alibi_slopes_ptr"
                else "*" + (kv_dtype if name in pools else dtype) if name.endswith("_ptr")
                else "fp32" if name in ("scale", "softcap", "alibi_scale")
                else "i32"
                for name in kernel.arg_names
            }
            source = ASTSource(kernel, signature=signature, constexprs=constants)
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
            assert compiled.asm["cubin"], (dtype, kv_dtype, group, head_dim)
        print("compiled")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # triton 3.9 warns when it is unset
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    result = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=Path(__file__).parent,
    )
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]


# in the engine --------------------------------------------------------------------


@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_mistral_sliding", "tiny_gemma2"])
def test_engine_on_the_triton_kernel_matches_generate(model_name, request, monkeypatch):
    """GQA (tiny_llama 4/2, mistral 4/1), a 24-token window, Gemma2's softcap and mixed
    sliding/full layers, with chunked prefill beside decodes: greedy tokens equal generate."""
    model = request.getfixturevalue(model_name)
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
    core = make_core(model, prefill_tokens=48)
    g = torch.Generator().manual_seed(12)
    seqs = [
        make_seq(random_prompt(n, VOCAB_SIZE, g), request_id=f"t{n}", max_new_tokens=6)
        for n in (1, 30, 70)
    ]
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    assert calls
    assert_matches_generate(model, seqs)
    assert_idle(core)


def _kernel_over(batch: Batch, rows: slice, seqs: list[int], query_lens, seq_lens) -> torch.Tensor:
    """The kernel on part of a step, straight from its pool: query rows `rows`, belonging to
    sequences `seqs` with these new-token counts and cached lengths."""
    cache = batch.pool.layer(0, batch.key, batch.value)
    tables = [batch.meta.block_tables[i] for i in seqs]
    width = max(map(len, tables))
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return triton_attention.paged_attention(
        batch.query[0].transpose(0, 1)[rows],
        cache.keys,
        cache.values,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        scale=batch.query.shape[-1] ** -0.5,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_sequences_rows_do_not_depend_on_the_batch_or_the_chunking(dtype):
    """Batch invariance (what --deterministic needs of a kernel): each program walks one
    sequence's keys in fixed tiles from position 0, so a sequence's rows are bitwise the same
    alone or beside others, and a prompt's rows the same prefilled in one chunk or two."""
    batch = make_batch(
        block_size=16, num_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype, seqs=MIXED_BATCH
    )
    news = [n for n, _ in MIXED_BATCH]
    contexts = [c for _, c in MIXED_BATCH]
    together = _kernel_over(batch, slice(None), list(range(len(news))), news, contexts)
    start = 0
    for i, (new, context) in enumerate(MIXED_BATCH):
        alone = _kernel_over(batch, slice(start, start + new), [i], [new], [context])
        assert torch.equal(alone, together[start : start + new]), f"sequence {i}"
        start += new
    # the last sequence's 24-token chunk as 8 tokens, then 16 as the next step. The split is
    # at a query-block boundary (4 tokens: 16 score rows / GQA group 4): a row's place in its
    # score tile is the one thing a chunking changes, and the interpreter's BLAS (numpy) does
    # not promise a row the same sum at another place (float32 differs at a 9/15 split)
    last, (new, context) = len(news) - 1, MIXED_BATCH[-1]
    first = start - new
    head = _kernel_over(batch, slice(first, first + 8), [last], [8], [context - new + 8])
    tail = _kernel_over(batch, slice(first + 8, start), [last], [new - 8], [context])
    assert torch.equal(torch.cat([head, tail]), together[first:start])
