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


def attend_both(batch: Batch, *, window=None, softcap=None) -> tuple[torch.Tensor, torch.Tensor]:
    cache = batch.pool.layer(0, batch.key, batch.value)
    scale = batch.query.shape[-1] ** -0.5
    args = (batch.query, cache, batch.meta, scale, window, softcap)
    return attention._triton_attention(*args), attention._sdpa_attention(*args)


def sdpa_in_float32(batch: Batch, *, window=None, softcap=None) -> torch.Tensor:
    cache = batch.pool.layer(0, batch.key, batch.value)
    keys, values = cache.keys.float(), cache.values.float()
    cache32 = LayerCache.over(keys, values)
    scale = batch.query.shape[-1] ** -0.5
    return attention._sdpa_attention(
        batch.query.float(), cache32, batch.meta, scale, window, softcap
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
        # the launch specializes int arguments equal to 1 as constants (one sequence, tables
        # one block wide): the loops they feed must still compile
        ones = ("num_seqs", "window", "block_tables_stride")
        pools = {"key_pool_ptr", "value_pool_ptr"}
        # (query dtype, pool dtype, ...): the 8-bit pools of --kv-cache-dtype too
        for dtype, kv_dtype, group, head_dim, flags, specialized in [
            ("bf16", "bf16", 1, 128, (False, False), ()),
            ("fp16", "fp16", 8, 64, (True, True), ones),
            ("fp32", "fp32", 4, 128, (True, False), ()),
            ("bf16", "bf16", 4, 192, (False, True), ()),
            ("bf16", "fp8e4nv", 4, 128, (False, False), ()),
            ("fp16", "fp8e5", 8, 64, (True, False), ()),
        ]:
            rows = max(16, triton.next_power_of_2(group))
            pad = max(16, triton.next_power_of_2(head_dim))
            constants = dict(
                GROUP=group, BLOCK_Q=rows // group, BLOCK_M=rows, BLOCK_SIZE=16,
                TILE=ta.KEY_TILE, HEAD_DIM=head_dim, HEAD_DIM_PAD=pad, VALUE_DIM=head_dim,
                VALUE_DIM_PAD=pad, USE_WINDOW=flags[0], USE_SOFTCAP=flags[1],
                KV_8BIT=kv_dtype != dtype, DOT_IN_FP32=False,
                DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
            )
            constants.update(dict.fromkeys(specialized, 1))
            signature = {
                name: "constexpr" if name in constants
                else "*i32" if name in pointers
                else "*" + (kv_dtype if name in pools else dtype) if name.endswith("_ptr")
                else "fp32" if name in ("scale", "softcap")
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
