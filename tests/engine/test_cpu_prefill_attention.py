"""cpu_prefill.py: bfloat16 prefill chunks on a CPU with AVX512-BF16 attend through a C++
kernel (vdpbf16ps) instead of SDPA. It gives SDPA's output (a float32 reference, to
bfloat16's rounding) for chunks that start their sequence and later ones, alone or several
of different lengths beside decodes; it is taken only where it may be; and the engine with
it still decodes as transformers' generate."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from support.compilers import without_cpp_compiler
from support.tiers import needs_avx512_bf16
from textgen.service.engine.attention import cpu_decode, cpu_prefill
from textgen.service.engine.attention import paged as attention
from textgen.service.models import avx512_bf16

from .factories import (
    VOCAB_SIZE,
    assert_idle,
    assert_matches_generate,
    make_batch,
    make_core,
    make_seq,
    random_prompt,
    run_to_completion,
)


@pytest.fixture
def calls(monkeypatch) -> list[int]:
    """The kernel's calls (one a group of a layer), counted."""
    counted, attend = [], cpu_prefill.attend

    def counting(*args, **kwargs):
        counted.append(1)
        return attend(*args, **kwargs)

    monkeypatch.setattr(cpu_prefill, "attend", counting)
    return counted


def reference(query, keys, values, positions) -> torch.Tensor:
    """SDPA in float32 with each row's causal mask: `[b, q, H, Dv]`."""
    seen = torch.arange(keys.shape[2]) <= positions.clamp(max=keys.shape[2] - 1)[..., None]
    out = F.scaled_dot_product_attention(
        query.float(), keys.float(), values.float(), attn_mask=seen[:, None], enable_gqa=True
    )
    return out.transpose(1, 2)


@needs_avx512_bf16
@pytest.mark.parametrize(
    ("b", "heads", "kv_heads", "rows", "keys", "dim", "value_dim", "first"),
    [
        (1, 9, 3, 7, 7, 64, 64, 0),  # fewer rows than a walk's, fewer keys than a tile's
        (1, 9, 3, 130, 130, 64, 64, 0),  # a fresh chunk over three tiles
        (2, 4, 2, 70, 75, 32, 32, 0),  # two sequences, keys past the rows (block padding)
        (1, 4, 4, 40, 300, 128, 128, 250),  # a later chunk: rows at positions 250 ..
        (3, 6, 2, 33, 160, 80, 96, 100),  # Dv != D, sequences at different positions
    ],
)
def test_rows_equal_sdpa_to_bfloat16s_rounding(
    b, heads, kv_heads, rows, keys, dim, value_dim, first
):
    g = torch.Generator().manual_seed(rows)
    query = torch.randn(b, heads, rows, dim, generator=g).to(torch.bfloat16)
    k = torch.randn(b, kv_heads, keys, dim, generator=g).to(torch.bfloat16)
    v = torch.randn(b, kv_heads, keys, value_dim, generator=g).to(torch.bfloat16)
    positions = first + torch.arange(rows).repeat(b, 1)
    if b == 3:  # one sequence further back, one whose last rows lie past the keys (padding)
        positions[1] -= 60
        positions[2] += 40
    assert cpu_prefill.takes(query, value_dim)
    got = cpu_prefill.attend(query, k, v, positions, dim**-0.5)
    assert got.shape == (b, rows, heads, value_dim) and got.dtype == torch.bfloat16
    want = reference(query, k, v, positions)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def attend(batch, *, kernel: bool, monkeypatch) -> torch.Tensor:
    """The layer's SDPA-path output with the prefill kernel on or off (fresh groups)."""
    monkeypatch.setattr(cpu_prefill, "ENABLED", kernel)
    batch.meta._groups = None
    cache = batch.pool.layer(0, batch.key, batch.value)
    return attention._sdpa_attention(batch.query, cache, batch.meta, 64**-0.5, None, None)


@needs_avx512_bf16
@pytest.mark.parametrize(
    "seqs",
    [
        [(300, 300)],  # a prompt's first chunk
        [(1, 40), (37, 37), (90, 90)],  # fresh chunks of two lengths beside a decode
        [(64, 2100), (20, 20)],  # a later chunk, then a fresh one: two groups
        [(12, 100), (50, 80), (7, 7)],  # later chunks of different lengths, padded rows;
        # the short fresh one goes to the decode kernel
    ],
)
def test_chunks_equal_the_sdpa_path(seqs, calls, monkeypatch):
    batch = make_batch(
        block_size=16, num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16, seqs=seqs
    )
    sdpa = attend(batch, kernel=False, monkeypatch=monkeypatch)
    assert not calls
    ours = attend(batch, kernel=True, monkeypatch=monkeypatch)
    # (chunks of up to cpu_decode.MAX_QUERY tokens take the decode kernel, as verifications)
    chunk_groups = [g for g in batch.meta.groups() if g.max_query_len > cpu_decode.MAX_QUERY]
    assert len(calls) == len(chunk_groups) > 0
    assert ours.shape == sdpa.shape and ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours, sdpa, atol=2e-2, rtol=2e-2)


def test_not_taken_where_it_must_not_be(calls, monkeypatch):
    """float32, soft-capping, a window reaching back, the batch-invariant path and
    --disable-custom-kernels keep SDPA."""
    shape = {"block_size": 16, "num_heads": 6, "num_kv_heads": 2, "head_dim": 32}
    chunk = [(40, 200)]  # a later chunk: a window of 64 reaches back past its start

    def cache_of(batch):
        return batch.pool.layer(0, batch.key, batch.value)

    float32 = make_batch(dtype=torch.float32, seqs=chunk, **shape)
    attention._sdpa_attention(float32.query, cache_of(float32), float32.meta, 0.2, None, None)
    bf16 = make_batch(dtype=torch.bfloat16, seqs=chunk, **shape)
    attention._sdpa_attention(bf16.query, cache_of(bf16), bf16.meta, 0.2, 64, None)
    attention._sdpa_attention(bf16.query, cache_of(bf16), bf16.meta, 0.2, None, 30.0)
    monkeypatch.setattr(bf16.meta, "use_cpu_kernel", False)  # --disable-custom-kernels
    attention._sdpa_attention(bf16.query, cache_of(bf16), bf16.meta, 0.2, None, None)
    assert not calls
    if avx512_bf16.cpu_supports():  # and the same chunk is taken where nothing forbids it
        monkeypatch.setattr(bf16.meta, "use_cpu_kernel", True)
        bf16.meta._groups = None
        attention._sdpa_attention(bf16.query, cache_of(bf16), bf16.meta, 0.2, None, None)
        assert len(calls) == 1


def test_a_failed_compile_keeps_sdpa_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(avx512_bf16, "cpu_supports", lambda: True)
    monkeypatch.setattr(cpu_prefill, "_loaded", None)  # tried again, and put back after
    without_cpp_compiler(monkeypatch)
    query = torch.zeros(1, 2, 3, 16, dtype=torch.bfloat16)
    with caplog.at_level("WARNING"):
        assert not cpu_prefill.takes(query, 16)
        assert not cpu_prefill.takes(query, 16)
    assert caplog.text.count("prefill attention kernel did not compile") == 1


@needs_avx512_bf16
def test_the_engine_decodes_as_generate_in_bfloat16(tiny_llama, calls):
    """Prompts longer than a step's prefill budget: first chunks and later ones through the
    kernel, several sequences in a step."""
    model = copy.deepcopy(tiny_llama).to(torch.bfloat16)
    core = make_core(model, prefill_tokens=48, batch_size=4)
    g = torch.Generator().manual_seed(9)
    seqs = [
        make_seq(random_prompt(n, VOCAB_SIZE, g), request_id=f"p{i}", max_new_tokens=6)
        for i, n in enumerate((100, 30, 61, 9))
    ]
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    assert calls
    assert_matches_generate(model, seqs)
    assert_idle(core)
