"""--kv-cache-dtype fp8_e4m3fn | fp8_e5m2: the KV pool stored in 8 bits, saturated on write,
widened on read; a model over it computes what it would over a full-width pool holding the
rounded values, through every CPU runner strategy.
The Triton kernel's reading of 8-bit pools is tested in test_triton_attention.py, the
perplexity of the embedded model in tests/service/test_kv_cache_quality.py."""

from __future__ import annotations

import pytest
import torch
from textgen.service.engine import kv_pool
from textgen.service.engine.config import EngineConfig
from textgen.service.engine.kv_pool import KVCachePool
from textgen.service.engine.paged_core import PagedCore
from textgen.service.engine.runners.compiled import CompileSettings
from textgen.service.engine.runners.model_runner import ModelRunner, StepInputs

from .factories import (
    VOCAB_SIZE,
    assert_idle,
    engine_copy,
    make_seq,
    random_prompt,
    run_to_completion,
)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def test_the_flag_names_are_the_pools_dtypes():
    from textgen.service.settings.table import KV_CACHE_DTYPES

    assert tuple(kv_pool.KV_CACHE_DTYPES) == KV_CACHE_DTYPES
    assert kv_pool.KV_CACHE_DTYPES["fp8_e4m3fn"] is torch.float8_e4m3fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", FP8)
def test_writes_round_to_8_bits_saturate_and_read_back_widened(kv_dtype, dtype):
    pool = KVCachePool(num_blocks=4, block_size=4, dtype=kv_dtype)
    key = (torch.randn(1, 2, 3, 8) * 4).to(dtype)  # [1, KVH, T, D]
    key[0, 0, 0, 0] = 1e6  # past both types' largest finite value
    value = torch.randn(1, 2, 3, 8).to(dtype)
    cache = pool.write(0, key, value, torch.tensor([5, 6, 13]))
    assert cache.keys.dtype == cache.values.dtype == kv_dtype
    assert cache.keys.element_size() == 1
    blocks = kv_pool.read_blocks(cache.keys, torch.tensor([1, 3]), dtype)  # slots 4-7, 12-15
    assert blocks.dtype == dtype
    got = torch.stack([blocks[0, 1], blocks[0, 2], blocks[1, 1]], dim=1)  # [KVH, T, D]
    largest = torch.finfo(kv_dtype).max
    expected = key[0].float().clamp(-largest, largest).to(kv_dtype).to(dtype)
    assert got[0, 0, 0] == largest  # saturated, not NaN or inf
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert bool(blocks.isfinite().all())


def test_copy_blocks_copies_8_bit_blocks():
    pool = KVCachePool(num_blocks=4, block_size=2, dtype=torch.float8_e4m3fn)
    states = torch.randn(1, 1, 2, 4)
    cache = pool.write(0, states, -states, torch.tensor([2, 3]))  # block 1
    pool.copy_blocks([(1, 3)])
    assert torch.equal(cache.keys[3].view(torch.uint8), cache.keys[1].view(torch.uint8))
    assert torch.equal(cache.values[3].view(torch.uint8), cache.values[1].view(torch.uint8))


class RoundingPool(KVCachePool):
    """A full-width pool that stores K/V rounded to `rounding` (saturated) and back: what
    an 8-bit pool's reads must give."""

    def __init__(self, *args, rounding: torch.dtype, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rounding = rounding

    def write(self, layer_idx, key, value, slots):
        largest = torch.finfo(self.rounding).max

        def rounded(states):
            return states.clamp(-largest, largest).to(self.rounding).to(states.dtype)

        return super().write(layer_idx, rounded(key), rounded(value), slots)


@pytest.mark.parametrize("kv_dtype", FP8)
def test_a_models_logits_are_those_of_the_rounded_states(tiny_llama, kv_dtype):
    """A prompt in three chunks, the later ones reading the earlier ones from the pool: the
    logits over an 8-bit pool are, bit for bit, those over a full-width pool holding the
    same values rounded, and differ from the unrounded ones."""
    prompt = random_prompt(48, VOCAB_SIZE, torch.Generator().manual_seed(3))
    pools = {
        "8-bit": KVCachePool(8, 8, dtype=kv_dtype),
        "rounded": RoundingPool(8, 8, rounding=kv_dtype),
        "full": KVCachePool(8, 8),
    }
    logits = {}
    for name, pool in pools.items():
        runner = ModelRunner(engine_copy(tiny_llama), pool)
        rows = []
        for start in (0, 16, 32):
            end = start + 16
            step = StepInputs(
                prompt[start:end], list(range(start, end)), [16], [end], [list(range(6))], []
            )
            step.keep = list(range(16))
            rows.append(runner.run(step))
        logits[name] = torch.cat(rows)
    assert torch.equal(logits["8-bit"], logits["rounded"])
    assert not torch.equal(logits["8-bit"], logits["full"])


def greedy_outputs(core: PagedCore, prompts: list[list[int]]) -> list[list[int]]:
    seqs = [make_seq(p, request_id=f"s{i}", max_new_tokens=9) for i, p in enumerate(prompts)]
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    assert core.stats().preemptions > 0
    assert_idle(core)
    return [seq.output_ids for seq in seqs]


def small_core(model, **options) -> PagedCore:
    # 12 blocks of 8 tokens: the workload below preempts
    core = PagedCore(
        engine_copy(model),
        EngineConfig(
            max_batch_total_tokens=96,
            max_batch_prefill_tokens=64,
            max_batch_size=4,
            block_size=8,
            **options,
        ),
    )
    core.warm_up()
    return core


@pytest.mark.parametrize(
    "kv_dtype, strategy",
    [
        (torch.float8_e4m3fn, "eager"),
        (torch.float8_e5m2, "eager"),
        (torch.float8_e4m3fn, "compiled"),
        (torch.float8_e4m3fn, "batch_invariant"),
    ],
)
def test_greedy_through_an_8_bit_pool(tiny_llama, kv_dtype, strategy):
    """Through a mixed batch, a preemption and each CPU runner strategy's decode steps, the
    greedy tokens over an 8-bit pool are those of the eager runner over a full-width pool
    of the rounded values."""
    g = torch.Generator().manual_seed(2)
    prompts = [random_prompt(10 + 3 * i, VOCAB_SIZE, g) for i in range(5)]
    core = small_core(
        tiny_llama,
        kv_cache_dtype=kv_dtype,
        batch_invariant=strategy == "batch_invariant",
        compile=CompileSettings.for_engine(4) if strategy == "compiled" else None,
    )
    assert core.runner.pool.dtype is kv_dtype
    reference = small_core(tiny_llama)
    reference.runner.pool = RoundingPool(12, 8, scratch_blocks=1, rounding=kv_dtype)
    assert greedy_outputs(core, prompts) == greedy_outputs(reference, prompts)


@pytest.mark.parametrize("model_dtype, factor", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_the_same_memory_holds_more_blocks(tiny_llama, monkeypatch, model_dtype, factor):
    """kv_sizing.kv_capacity_tokens sizes the pool in its stored dtype: 8 bits a value."""
    from types import SimpleNamespace

    from textgen.service.replica import kv_sizing
    from textgen.service.settings.table import Settings

    monkeypatch.setattr(kv_sizing, "free_memory_bytes", lambda device, fraction=1.0: 64 * 2**20)
    loaded = SimpleNamespace(
        model=tiny_llama, dtype=model_dtype, device=torch.device("cpu"), shard_layout=None
    )
    wide = kv_sizing.kv_capacity_tokens(Settings(), loaded, 512)
    narrow = kv_sizing.kv_capacity_tokens(Settings(kv_cache_dtype="fp8_e4m3fn"), loaded, 512)
    assert wide < 1 << 20 and narrow == factor * wide
