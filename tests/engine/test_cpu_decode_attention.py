"""cpu_decode.py: CPU decodes attend the paged pool in place (a C++ kernel over the block
table) instead of gathering their K/V for SDPA. It gives the SDPA path's output, one decode
alone or several of different lengths, short or long, in float32 and bfloat16; it is taken
only where it may be, compiles once per kind of layer whatever the lengths, and the engine
with it still decodes as transformers' generate."""

from __future__ import annotations

import pytest
import torch
from support.compilers import without_cpp_compiler
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

SPLIT = cpu_decode.SPLIT  # the tokens of a sequence one work item attends


def attend(batch, *, in_place: bool, monkeypatch, window=None, softcap=None, **terms):
    """The layer's SDPA-path output with the kernel on or off (fresh groups each time);
    terms: sinks, alibi, chunk."""
    monkeypatch.setattr(cpu_decode, "ENABLED", in_place)
    batch.meta._groups = None
    cache = batch.pool.layer(0, batch.key, batch.value)
    scale = batch.query.shape[-1] ** -0.5
    return attention._sdpa_attention(
        batch.query, cache, batch.meta, scale, window, softcap, **terms
    )


@pytest.mark.parametrize(
    "seqs",
    [
        [(1, 1)],  # the first token's decode: one key
        [(1, 37)],  # one decode alone, short (its group has context_slots)
        [(1, 4 * SPLIT + 100)],  # long: five items merged
        [(1, 2 * SPLIT)],  # a context ending on an item's and a block's boundary
        [(1, 2 * SPLIT + 1), (1, SPLIT + 15), (1, SPLIT), (1, 17)],  # several lengths
        [(1, 600), (1, 70), (37, 37), (9, 50)],  # decodes beside chunks
        [(4, 2 * SPLIT + 3)],  # a verification: 1 + 3 query tokens
        [(4, 300), (2, 100), (8, 20)],  # verifications and a short chunk, padded rows
        [(5, 5), (1, 40)],  # a short prompt's first chunk beside a decode
    ],
)
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, value_dim",
    [(9, 3, 64, 64), (4, 4, 32, 32), (6, 2, 16, 16), (8, 2, 40, 24)],  # last: 40 and 24 wide
)
@pytest.mark.parametrize("terms", ["", "window", "softcap", "sinks", "window softcap sinks"])
def test_in_place_decodes_equal_the_sdpa_path(
    seqs, num_heads, num_kv_heads, head_dim, value_dim, terms, monkeypatch
):
    """terms: the layer's sliding window (shorter than some contexts, longer than others),
    Gemma 2's logit soft-capping, gpt-oss's attention sinks."""
    batch = make_batch(
        block_size=16,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        value_dim=value_dim,
        dtype=torch.float32,
        seqs=seqs,
        seed=len(seqs) + head_dim,
    )
    generator = torch.Generator().manual_seed(head_dim)
    layer = {
        "window": 300 if "window" in terms else None,
        "softcap": 2.0 if "softcap" in terms else None,  # low: most scores are capped
        "sinks": torch.randn(num_heads, generator=generator) if "sinks" in terms else None,
    }
    gathered = attend(batch, in_place=False, monkeypatch=monkeypatch, **layer)
    calls = cpu_decode.Stats.calls
    in_place = attend(batch, in_place=True, monkeypatch=monkeypatch, **layer)
    # once a group of up to MAX_QUERY query tokens a sequence (longer chunks gather)
    taken = [g for g in batch.meta.groups() if g.max_query_len <= cpu_decode.MAX_QUERY]
    assert cpu_decode.Stats.calls == calls + len(taken) > calls
    assert in_place.shape == gathered.shape == (1, sum(n for n, _ in seqs), num_heads, value_dim)
    torch.testing.assert_close(in_place, gathered, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seqs", [[(1, 3 * SPLIT + 37)], [(1, 700), (1, 300), (1, 9)]])
@pytest.mark.parametrize("block_size", [16, 32])
def test_bfloat16_decodes_equal_the_sdpa_path(seqs, block_size, monkeypatch):
    """bfloat16 pools are read as they are, on any CPU (the kernel widens each element to
    float32 itself), and the output is rounded back to bfloat16."""
    batch = make_batch(
        block_size=block_size,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        dtype=torch.bfloat16,
        seqs=seqs,
        seed=5,
    )
    gathered = attend(batch, in_place=False, monkeypatch=monkeypatch)
    calls = cpu_decode.Stats.calls
    in_place = attend(batch, in_place=True, monkeypatch=monkeypatch)
    assert cpu_decode.Stats.calls == calls + 1
    assert in_place.dtype == gathered.dtype == torch.bfloat16
    torch.testing.assert_close(in_place, gathered, atol=2e-2, rtol=2e-2)


def test_the_kernel_is_not_taken_where_it_must_not_be(monkeypatch):
    """Layers with ALiBi or chunked local attention, float16 and 8-bit pools, the
    batch-invariant path, --disable-custom-kernels and the switch off all keep the gathered
    path."""
    seqs = [(1, 600), (1, 515)]
    shape = {"block_size": 16, "num_heads": 6, "num_kv_heads": 2, "head_dim": 32, "seqs": seqs}

    def calls_for(batch, **terms) -> int:
        calls = cpu_decode.Stats.calls
        attend(batch, in_place=True, monkeypatch=monkeypatch, **terms)
        return cpu_decode.Stats.calls - calls

    float32 = make_batch(dtype=torch.float32, **shape)
    assert calls_for(float32) == 1
    assert calls_for(float32, window=64, softcap=30.0) == 1
    alibi = attention.Alibi(torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.03, 0.01]), 1.0)
    assert calls_for(float32, alibi=alibi) == 0
    assert calls_for(float32, chunk=256) == 0
    assert calls_for(make_batch(dtype=torch.float16, **shape)) == 0
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


def test_one_compile_per_kind_whatever_the_lengths_and_batch(monkeypatch):
    """A kind of layer (head shapes, block size, dtype) compiles once: other context
    lengths, batch sizes and pools reuse its kernel; another kind compiles its own."""
    monkeypatch.setattr(cpu_decode, "_kernels", {})
    generator = torch.Generator().manual_seed(0)

    def call(lengths: list[int], pool_blocks: int = 300, block_size: int = 16) -> None:
        keys = torch.randn(pool_blocks, block_size, 2, 32, generator=generator)
        values = torch.randn(pool_blocks, block_size, 2, 32, generator=generator)
        shape = (len(lengths), -(-max(lengths) // block_size))
        tables = torch.randint(0, pool_blocks, shape, generator=generator)
        rows = torch.randn(len(lengths), 2, 3, 32, generator=generator)
        out = cpu_decode.attend(rows, keys, values, tables, torch.tensor(lengths), 0.2)
        reference = cpu_decode._reference(rows, keys, values, tables, torch.tensor(lengths), 0.2)
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)

    call([SPLIT + 1])
    assert len(cpu_decode._kernels) == 1
    compiled = cpu_decode.Stats.compile_seconds
    for lengths in ([3 * SPLIT], [99], [SPLIT, 2 * SPLIT, 7], [4 * SPLIT] * 5):
        call(lengths)
    call([SPLIT, SPLIT + 1], pool_blocks=500)  # another pool's size
    assert len(cpu_decode._kernels) == 1 and cpu_decode.Stats.compile_seconds == compiled
    call([SPLIT], block_size=32)
    assert len(cpu_decode._kernels) == 2


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
    """--compile's graphs call the paged attention as an opaque op: its C++ kernel
    (cpu_decode_op.cpp) attends those steps' layers with the kernel, no Python on the way
    (the layers were registered by the warm-up's padding step), padding rows included
    (they attend the scratch block)."""
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
    calls, python_calls = cpu_decode.kernel_calls(), cpu_decode.Stats.calls
    run_to_completion(core)
    assert core.runner.stats.compiled_steps == 3
    assert cpu_decode.kernel_calls() - calls == 2 * 3
    assert cpu_decode.Stats.calls == python_calls  # all through the op's C++ kernel
    assert_matches_generate(tiny_llama, seqs)


def test_the_ops_cpp_kernel_leaves_what_it_does_not_take_to_python(monkeypatch):
    """cpu_decode_op.cpp attends a compiled decode step's layer only once Python has
    registered it (the first step's call, through `textgen::paged_attention_general`),
    and only for a step begun as decodes: a step of chunks, a layer with ALiBi and
    `--disable-custom-kernels` go to the Python implementation, with its results."""
    monkeypatch.setattr(cpu_decode, "ENABLED", True)
    assert cpu_decode.load_op()

    def run(batch, **terms):
        batch.meta._groups = None
        scale = batch.query.shape[-1] ** -0.5
        args = (batch.query, batch.key, batch.value, 0, scale, 0, 0.0, None)
        rest = (terms.get("alibi"), 1.0, 0)
        with attention.bound_metadata(batch.meta), attention.in_place_decode_step(batch.meta):
            return torch.ops.textgen.paged_attention(*args, *rest)

    def batch_of(seqs, custom_kernels=True):
        batch = make_batch(
            block_size=16, num_heads=6, num_kv_heads=2, head_dim=32, dtype=torch.float32,
            seqs=seqs, seed=7,
        )  # fmt: skip
        batch.meta.use_cpu_kernel = custom_kernels
        return batch

    def expected(seqs, **terms):
        """The SDPA path's output on a fresh batch of these sequences."""
        copy = batch_of(seqs)
        monkeypatch.setattr(cpu_decode, "ENABLED", False)
        try:
            return run(copy, **terms)
        finally:
            monkeypatch.setattr(cpu_decode, "ENABLED", True)

    decodes = batch_of([(1, 600), (1, 70)])
    python_calls, calls = cpu_decode.Stats.calls, cpu_decode.kernel_calls()
    first = run(decodes)  # through Python, which registers layer 0
    assert cpu_decode.Stats.calls == python_calls + 1
    again = batch_of([(1, 600), (1, 70)])  # the same step over a fresh pool: Python again
    torch.testing.assert_close(run(again), first)
    assert cpu_decode.Stats.calls == python_calls + 2
    second = run(again)  # that pool's layer is registered: C++ now
    assert cpu_decode.Stats.calls == python_calls + 2
    assert cpu_decode.kernel_calls() == calls + 3
    torch.testing.assert_close(second, first, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(first, expected([(1, 600), (1, 70)]), atol=1e-5, rtol=1e-5)

    slopes = torch.linspace(0.5, 0.01, 6)
    cases = [
        ([(1, 600), (37, 37)], True, {}, 1),  # not all decodes: its decode group in Python
        ([(1, 600), (1, 70)], True, {"alibi": slopes}, 0),  # ALiBi: the SDPA path
        ([(1, 90)], False, {}, 0),  # --disable-custom-kernels: the SDPA path
    ]
    for seqs, custom_kernels, terms, taken in cases:
        calls = cpu_decode.kernel_calls()
        out = run(batch_of(seqs, custom_kernels), **terms)
        assert cpu_decode.kernel_calls() == calls + taken
        torch.testing.assert_close(out, expected(seqs, **terms), atol=1e-5, rtol=1e-5)


def test_speculation_verifies_through_the_kernel_and_equals_generate(tiny_llama):
    """A verification (1 + N query tokens a sequence) attends each row as a decode of its
    own: the speculating core's tokens stay those of transformers' generate."""
    from .test_speculation import SPECULATE, ScriptedProposer, expected_outputs, requests, spec_core

    seqs = requests(4, seed=3, max_len=40)
    core = spec_core(tiny_llama, ScriptedProposer(expected_outputs(tiny_llama, seqs)))
    for seq in seqs:
        core.add(seq)
    taken = []
    kernel = cpu_decode.attend

    def counting(rows, *args, **kwargs):
        taken.append(rows.shape[0])
        return kernel(rows, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_decode, "attend", counting)
        run_to_completion(core)
    assert core.stats().spec_accepted_tokens > 0
    assert max(taken) >= len(seqs) * (1 + SPECULATE)  # a step of four verifications
    assert_matches_generate(tiny_llama, seqs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_start_up_forward_compiles_the_kernel_before_any_request(
    tiny_llama, dtype, monkeypatch
):
    """warm_up() compiles the model's kind (its layers share one); the decodes after it,
    short and long, alone and together, compile nothing."""
    monkeypatch.setattr(cpu_decode, "_kernels", {})
    model = engine_copy(tiny_llama).to(dtype)
    core = make_core(model, prefill_tokens=2048)
    before = cpu_decode.Stats.compile_seconds
    core.warm_up()
    assert len(cpu_decode._kernels) == 1 and cpu_decode.Stats.compile_seconds > before
    compiled = cpu_decode.Stats.compile_seconds
    generator = torch.Generator().manual_seed(11)
    seqs = [
        make_seq(random_prompt(n, 300, generator), request_id=str(n), max_new_tokens=3)
        for n in (1012, 600, 30)
    ]
    core.add(seqs[0])
    calls = cpu_decode.Stats.calls
    run_to_completion(core)  # one stream
    for seq in seqs[1:]:
        core.add(seq)
    run_to_completion(core)  # two
    assert cpu_decode.Stats.calls - calls == 2 * 2 * 2
    assert cpu_decode.Stats.compile_seconds == compiled and len(cpu_decode._kernels) == 1
    if dtype == torch.float32:
        assert_matches_generate(tiny_llama, seqs)


def test_a_failed_compile_turns_the_kernel_off(monkeypatch, caplog):
    """Inductor's C++ toolchain needs a compiler (the Docker image has none): the first
    call's failure leaves decodes to the gathered path, this call's result computed by
    torch's ops."""
    monkeypatch.setattr(cpu_decode, "ENABLED", True)
    monkeypatch.setattr(cpu_decode, "_kernels", {})
    without_cpp_compiler(monkeypatch)
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


def test_an_op_kernel_that_fails_to_compile_leaves_the_op_to_python(monkeypatch, caplog):
    """Without cpu_decode_op.cpp (no compiler), a compiled step begins no C++ step and its
    layers attend through the op's Python implementation, with the kernel still."""
    batch = make_batch(
        block_size=16, num_heads=6, num_kv_heads=2, head_dim=32, dtype=torch.float32,
        seqs=[(1, 300), (1, 40)],
    )  # fmt: skip
    scale = batch.query.shape[-1] ** -0.5
    cache = batch.pool.layer(0, batch.key, batch.value)
    rows = batch.query[0].transpose(0, 1).reshape(2, 2, 3, 32)
    cpu_decode._kernel(rows, cache.keys, cache.values)  # the attention kernel itself compiles
    monkeypatch.setattr(cpu_decode, "ENABLED", True)
    monkeypatch.setattr(cpu_decode, "_op_tried", False)
    monkeypatch.setattr(cpu_decode, "_op_library", None)
    without_cpp_compiler(monkeypatch)
    with caplog.at_level("WARNING"):
        assert not cpu_decode.load_op()
    assert "attention op did not compile" in caplog.text
    args = (batch.query, batch.key, batch.value, 0, scale, 0, 0.0, None, None, 1.0, 0)
    python_calls = cpu_decode.Stats.calls
    with attention.bound_metadata(batch.meta), attention.in_place_decode_step(batch.meta):
        assert not cpu_decode.step_active()
        out = torch.ops.textgen.paged_attention(*args)
    assert cpu_decode.Stats.calls == python_calls + 1  # the kernel, through Python
    batch.meta._groups = None
    monkeypatch.setattr(cpu_decode, "ENABLED", False)
    gathered = attention._sdpa_attention(batch.query, cache, batch.meta, scale, None, None)
    torch.testing.assert_close(out, gathered, atol=1e-5, rtol=1e-5)
