"""cpu_decode.py: CPU decodes at long contexts attend the paged pool in place (a compiled
kernel over the block table) instead of gathering their K/V for SDPA. It gives the SDPA
path's output, one decode alone or several of different lengths, is taken only where it
may be, compiles once per kind (one sequence, several) whatever the lengths, and the engine
with it still decodes as transformers' generate."""

from __future__ import annotations

import pytest
import torch
from textgen.service.engine.attention import cpu_decode
from textgen.service.engine.attention import paged as attention
from textgen.service.engine.config import EngineConfig
from textgen.service.engine.paged_core import PagedCore
from textgen.service.engine.runners.compiled import CompileSettings

from .factories import (
    assert_matches_generate,
    engine_copy,
    make_batch,
    make_core,
    make_seq,
    random_prompt,
    run_to_completion,
)

LONG = cpu_decode.MIN_KEYS  # a decode alone takes the kernel from this context (in blocks)


def attend(batch, *, in_place: bool, monkeypatch, window=None, softcap=None) -> torch.Tensor:
    """The layer's SDPA-path output with the kernel on or off (fresh groups each time)."""
    monkeypatch.setattr(cpu_decode, "ENABLED", in_place)
    batch.meta._groups = None
    cache = batch.pool.layer(0, batch.key, batch.value)
    scale = batch.query.shape[-1] ** -0.5
    return attention._sdpa_attention(batch.query, cache, batch.meta, scale, window, softcap)


@pytest.mark.parametrize(
    "seqs",
    [
        [(1, LONG + 100)],  # one decode alone (its group has context_slots)
        [(1, 2 * LONG)],  # a context ending on a block boundary
        [(1, 2 * LONG + 1), (1, LONG + 15), (1, LONG + 16), (1, LONG + 17)],  # several lengths
        [(1, 600), (1, 700), (37, 37), (9, 50)],  # decodes beside chunks
    ],
)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (4, 4, 32), (6, 2, 16)])
def test_in_place_decodes_equal_the_sdpa_path(seqs, num_heads, num_kv_heads, head_dim, monkeypatch):
    batch = make_batch(
        block_size=16,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=torch.float32,
        seqs=seqs,
        seed=len(seqs) + head_dim,
    )
    gathered = attend(batch, in_place=False, monkeypatch=monkeypatch)
    calls = cpu_decode.Stats.calls
    in_place = attend(batch, in_place=True, monkeypatch=monkeypatch)
    assert cpu_decode.Stats.calls == calls + 1  # the decodes' group, once
    assert in_place.shape == gathered.shape == (1, sum(n for n, _ in seqs), num_heads, head_dim)
    torch.testing.assert_close(in_place, gathered, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("native_bf16", [True, False])
def test_bfloat16_decodes_take_the_kernel_where_the_cpu_has_native_bf16(native_bf16, monkeypatch):
    """One bfloat16 sequence at a long context, and several at BF16_SEVERAL_MIN_TOKENS: the
    kernel (computing in float32) gives the SDPA path's output to bfloat16's precision where
    the CPU has native bf16; elsewhere, and for several at shorter contexts, bfloat16 keeps
    the gathered path."""
    monkeypatch.setattr(cpu_decode, "NATIVE_BF16", native_bf16)
    shape = {"block_size": 16, "num_heads": 9, "num_kv_heads": 3, "head_dim": 64}
    alone = make_batch(dtype=torch.bfloat16, seqs=[(1, 2 * LONG + 37)], seed=5, **shape)
    gathered = attend(alone, in_place=False, monkeypatch=monkeypatch)
    calls = cpu_decode.Stats.calls
    in_place = attend(alone, in_place=True, monkeypatch=monkeypatch)
    assert cpu_decode.Stats.calls - calls == int(native_bf16)
    assert in_place.dtype == gathered.dtype == torch.bfloat16
    torch.testing.assert_close(in_place, gathered, atol=2e-2, rtol=2e-2)
    several = make_batch(dtype=torch.bfloat16, seqs=[(1, LONG + 5), (1, LONG)], seed=6, **shape)
    calls = cpu_decode.Stats.calls
    attend(several, in_place=True, monkeypatch=monkeypatch)
    assert cpu_decode.Stats.calls == calls
    longer = cpu_decode.BF16_SEVERAL_MIN_TOKENS  # several sequences from this context on
    several = make_batch(dtype=torch.bfloat16, seqs=[(1, longer + 9), (1, longer)], seed=7, **shape)
    gathered = attend(several, in_place=False, monkeypatch=monkeypatch)
    calls = cpu_decode.Stats.calls
    in_place = attend(several, in_place=True, monkeypatch=monkeypatch)
    assert cpu_decode.Stats.calls - calls == int(native_bf16)
    torch.testing.assert_close(in_place, gathered, atol=2e-2, rtol=2e-2)


def test_the_kernel_is_not_taken_where_it_must_not_be(monkeypatch):
    """Too few keys, layers with a window or soft-capping, bfloat16 for several sequences
    and 8-bit pools, the batch-invariant path, --disable-custom-kernels and the switch off
    all keep the gathered path."""
    monkeypatch.setattr(cpu_decode, "NATIVE_BF16", True)
    seqs = [(1, 600), (1, 515)]
    shape = {"block_size": 16, "num_heads": 6, "num_kv_heads": 2, "head_dim": 32, "seqs": seqs}

    def calls_for(batch, **terms) -> int:
        calls = cpu_decode.Stats.calls
        attend(batch, in_place=True, monkeypatch=monkeypatch, **terms)
        return cpu_decode.Stats.calls - calls

    float32 = make_batch(dtype=torch.float32, **shape)
    assert calls_for(float32) == 1
    assert calls_for(float32, window=64) == 0
    assert calls_for(float32, softcap=30.0) == 0
    for short in ([(1, LONG - 16)], [(1, 400), (1, 40)]):  # 1008 and 2 x 400 keys
        assert calls_for(make_batch(dtype=torch.float32, **{**shape, "seqs": short})) == 0
    assert calls_for(make_batch(dtype=torch.bfloat16, **shape)) == 0
    fp8 = make_batch(dtype=torch.float32, kv_dtype=torch.float8_e4m3fn, **shape)
    assert calls_for(fp8) == 0
    invariant = attention.BatchMetadata.build(
        float32.pool,
        float32.meta.query_lens,
        float32.meta.context_lens,
        float32.meta.block_tables,
        torch.device("cpu"),
        batch_invariant=True,
    )
    assert calls_for(float32.__class__(**{**vars(float32), "meta": invariant})) == 0
    no_custom = attention.BatchMetadata.build(  # --disable-custom-kernels
        float32.pool,
        float32.meta.query_lens,
        float32.meta.context_lens,
        float32.meta.block_tables,
        torch.device("cpu"),
        custom_kernels=False,
    )
    assert calls_for(float32.__class__(**{**vars(float32), "meta": no_custom})) == 0
    monkeypatch.setattr(cpu_decode, "ENABLED", False)
    cache = float32.pool.layer(0, float32.key, float32.value)
    calls = cpu_decode.Stats.calls
    attention._sdpa_attention(float32.query, cache, float32.meta, 0.1, None, None)
    assert cpu_decode.Stats.calls == calls


def test_one_compile_per_kind_whatever_the_lengths_and_batch():
    """After one call with one sequence and one with several, other context lengths and
    batch size or pools run the compiled code as it is: dynamo would raise on a recompile."""
    generator = torch.Generator().manual_seed(0)

    def call(lengths: list[int], pool_blocks: int = 300) -> None:
        keys = torch.randn(pool_blocks, 16, 2, 32, generator=generator)
        values = torch.randn(pool_blocks, 16, 2, 32, generator=generator)
        shape = (len(lengths), -(-max(lengths) // 16))
        tables = torch.randint(0, pool_blocks, shape, generator=generator)
        rows = torch.randn(len(lengths), 2, 3, 32, generator=generator)
        cpu_decode.attend(rows, keys, values, tables, torch.tensor(lengths), 0.2)

    call([LONG + 1])
    call([LONG + 5, LONG])
    with torch._dynamo.config.patch(error_on_recompile=True):
        for lengths in ([3 * LONG], [LONG + 99], [LONG, 2 * LONG, LONG + 7], [4 * LONG] * 5):
            call(lengths)
        call([LONG, LONG + 1], pool_blocks=500)  # another pool's size


@pytest.mark.parametrize("batched", [False, True])
def test_greedy_decoding_at_a_long_context_matches_generate(tiny_llama, batched):
    """Long prompts decoded alone (one stream) or together, through the kernel (the tiny
    model has 1024 positions: one prompt of 1012 tokens is 64 blocks, two of 600 and 700 are
    2 x 44)."""
    generator = torch.Generator().manual_seed(7)
    lengths = [600, 700] if batched else [1012]
    seqs = [
        make_seq(random_prompt(n, 300, generator), request_id=str(i), max_new_tokens=6)
        for i, n in enumerate(lengths)
    ]
    core = make_core(tiny_llama, prefill_tokens=2048)
    for seq in seqs:
        core.add(seq)
    calls = cpu_decode.Stats.calls
    run_to_completion(core)
    # the decode steps after the prefill (one step), each of the model's 2 layers
    assert cpu_decode.Stats.calls - calls == 2 * 5
    assert_matches_generate(tiny_llama, seqs)


def test_the_compiled_decode_step_takes_the_kernel_inside_its_opaque_attention(tiny_llama):
    """--compile's graphs call the paged attention as an opaque op, run eagerly: the kernel
    serves those steps too, padding rows included (they attend the scratch block)."""
    core = PagedCore(
        engine_copy(tiny_llama),
        EngineConfig(
            max_batch_total_tokens=2048,
            max_batch_prefill_tokens=2048,
            max_batch_size=2,
            compile=CompileSettings((2,)),
        ),
    )
    core.warm_up()
    generator = torch.Generator().manual_seed(3)
    seqs = [
        make_seq(random_prompt(n, 300, generator), request_id=str(n), max_new_tokens=4)
        for n in (560, 650)
    ]
    for seq in seqs:
        core.add(seq)
    calls = cpu_decode.Stats.calls
    run_to_completion(core)
    assert core.runner.stats.compiled_steps == 3
    assert cpu_decode.Stats.calls - calls == 2 * 3
    assert_matches_generate(tiny_llama, seqs)


def test_the_start_up_forward_compiles_the_kernel_before_any_request(tiny_llama, monkeypatch):
    """warm_up() compiles both kinds (one sequence, several) for the model's shapes; the
    long decodes after it compile nothing."""
    monkeypatch.setattr(cpu_decode, "_compiled", {})
    monkeypatch.setattr(cpu_decode, "_seen", set())
    core = make_core(tiny_llama, prefill_tokens=2048)
    before = cpu_decode.Stats.compile_seconds
    core.warm_up()
    assert len(cpu_decode._seen) == 2 and cpu_decode.Stats.compile_seconds > before
    compiled = cpu_decode.Stats.compile_seconds
    generator = torch.Generator().manual_seed(11)
    seqs = [
        make_seq(random_prompt(n, 300, generator), request_id=str(n), max_new_tokens=3)
        for n in (1012, 600, 700)
    ]
    core.add(seqs[0])
    calls = cpu_decode.Stats.calls
    with torch._dynamo.config.patch(error_on_recompile=True):
        run_to_completion(core)  # one stream
        for seq in seqs[1:]:
            core.add(seq)
        run_to_completion(core)  # two
    assert cpu_decode.Stats.calls - calls == 2 * 2 * 2
    assert cpu_decode.Stats.compile_seconds == compiled and len(cpu_decode._seen) == 2
    assert_matches_generate(tiny_llama, seqs)


@pytest.mark.parametrize("native_bf16", [True, False])
def test_a_bfloat16_model_compiles_the_kinds_taken_there(tiny_llama, native_bf16, monkeypatch):
    """In bfloat16 the start-up forward compiles the kinds the kernel takes there (one
    sequence, several), and nothing on a CPU without native bf16."""
    monkeypatch.setattr(cpu_decode, "NATIVE_BF16", native_bf16)
    monkeypatch.setattr(cpu_decode, "_compiled", {})
    monkeypatch.setattr(cpu_decode, "_seen", set())
    core = make_core(engine_copy(tiny_llama).to(torch.bfloat16), prefill_tokens=2048)
    core.warm_up()
    assert sorted(kind[0] for kind in cpu_decode._seen) == ([False, True] if native_bf16 else [])


def test_a_failed_compile_turns_the_kernel_off(monkeypatch, caplog):
    """Inductor needs a C++ compiler (the Docker image has none): the first call's failure
    leaves decodes to the gathered path, this call's result computed eagerly."""

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpu_decode, "ENABLED", True)
    monkeypatch.setattr(cpu_decode, "_compiled", {})
    monkeypatch.setattr(cpu_decode, "_seen", set())
    monkeypatch.setattr(torch, "compile", lambda function, **options: broken)
    batch = make_batch(
        block_size=16, num_heads=6, num_kv_heads=2, head_dim=32, dtype=torch.float32,
        seqs=[(1, 600), (1, 700)],
    )  # fmt: skip
    cache = batch.pool.layer(0, batch.key, batch.value)
    scale = batch.query.shape[-1] ** -0.5
    with caplog.at_level("WARNING"):
        out = attention._sdpa_attention(batch.query, cache, batch.meta, scale, None, None)
    assert not cpu_decode.ENABLED and "did not compile" in caplog.text
    calls = cpu_decode.Stats.calls
    again = attention._sdpa_attention(batch.query, cache, batch.meta, scale, None, None)
    assert cpu_decode.Stats.calls == calls  # the gathered path from now on
    torch.testing.assert_close(out, again, atol=1e-5, rtol=1e-5)
