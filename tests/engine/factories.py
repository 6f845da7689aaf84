"""Builders shared by the engine tests: requests, sequences, tiny models, reference outputs."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from textgen.service.engine.attention import paged as attention
from textgen.service.engine.config import EngineConfig
from textgen.service.engine.kv_pool import KVCachePool
from textgen.service.engine.paged_core import PagedCore
from textgen.service.engine.sequence import Sequence
from textgen.service.engine.types import EngineRequest, SamplingParams, StoppingParams

VOCAB_SIZE = 300  # of the tiny test models


def make_seq(
    prompt: list[int] | tuple[int, ...],
    *,
    request_id: str = "r",
    max_new_tokens: int = 8,
    sampling: SamplingParams | None = None,
    decoder_input_details: bool = False,
    eos_token_ids: frozenset[int] = frozenset(),
    priority: int = 0,
) -> Sequence:
    request = EngineRequest(
        request_id=request_id,
        prompt_ids=tuple(prompt),
        sampling=sampling or SamplingParams(),
        stopping=StoppingParams(max_new_tokens=max_new_tokens, ignore_eos=not eos_token_ids),
        decoder_input_details=decoder_input_details,
        priority=priority,
    )
    return Sequence(request, eos_token_ids)


def random_prompt(length: int, vocab_size: int, generator: torch.Generator) -> list[int]:
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def engine_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A private copy for a core: PagedCore switches its model's attention implementation."""
    return copy.deepcopy(model)


@torch.inference_mode()
def reference_greedy(
    model: torch.nn.Module, prompt: list[int], max_new_tokens: int, eos_token_id: int | None = None
) -> list[int]:
    """`model.generate(do_sample=False)` on the prompt alone.

    The attention mask is explicit: generate would otherwise mask every prompt token equal
    to pad_token_id, and the random prompts contain them.
    """
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def run_to_completion(core, max_steps: int = 10_000) -> list:
    outputs = []
    for _ in range(max_steps):
        if not core.has_work():
            return outputs
        outputs.extend(core.step())
    raise AssertionError(f"core still busy after {max_steps} steps")


def make_core(
    model,
    *,
    total_tokens=8192,
    prefill_tokens=512,
    batch_size=32,
    block_size=16,
    batch_invariant=False,
    speculation=None,
    **options,
) -> PagedCore:
    """options: more EngineConfig fields."""
    core = PagedCore(
        engine_copy(model),
        EngineConfig(
            max_batch_total_tokens=total_tokens,
            max_batch_prefill_tokens=prefill_tokens,
            max_batch_size=batch_size,
            block_size=block_size,
            batch_invariant=batch_invariant,
            speculation=speculation,
            **options,
        ),
    )
    if batch_invariant:  # as served: the matmuls' smallest products probed at warm-up
        core.warm_up()
    return core


def assert_matches_generate(model, seqs):
    for seq in seqs:
        expected = reference_greedy(
            model, list(seq.request.prompt_ids), seq.request.stopping.max_new_tokens
        )
        assert seq.output_ids == expected, (
            f"{seq.request_id} (prompt {seq.num_prompt_tokens} tokens)"
        )


def assert_idle(core: PagedCore):
    stats = core.stats()
    assert (stats.waiting, stats.running, stats.kv_blocks_used) == (0, 0, 0)
    assert all(b.ref_count == 0 for b in core.block_manager.blocks)


# one attention layer's step -------------------------------------------------------


@dataclass
class Batch:
    pool: KVCachePool
    meta: attention.BatchMetadata
    query: torch.Tensor  # [1, H, T, Dk], a transposed view as transformers passes it
    key: torch.Tensor  # [1, KVH, T, Dk]: the step's new keys
    value: torch.Tensor  # [1, KVH, T, Dv]


def make_batch(
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    value_dim: int | None = None,
    seqs: list[tuple[int, int]],
    seed: int = 0,
    kv_dtype: torch.dtype | None = None,
) -> Batch:
    """One attention layer's step over a pool whose cached positions hold random K/V, in
    shuffled blocks (block 0 is left to SDPA's table padding). seqs: (new tokens, tokens
    in the cache after the step) per sequence, decodes first as the runner lays them out;
    kv_dtype: the pool's storage dtype (None: `dtype`)."""
    g = torch.Generator().manual_seed(seed)
    value_dim = value_dim or head_dim
    query_lens = [n for n, _ in seqs]
    context_lens = [c for _, c in seqs]
    needed = [-(-c // block_size) for c in context_lens]
    pool = KVCachePool(num_blocks=sum(needed) + 2, block_size=block_size, dtype=kv_dtype)
    order = (torch.randperm(sum(needed) + 1, generator=g) + 1).tolist()
    tables = []
    for n in needed:
        tables.append(order[:n])
        order = order[n:]

    def states(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    num_tokens = sum(query_lens)
    key = states(1, num_kv_heads, num_tokens, head_dim)
    value = states(1, num_kv_heads, num_tokens, value_dim)
    layer = pool.layer(0, key, value)
    layer.keys.copy_(states(*layer.keys.shape))  # the cached tokens
    layer.values.copy_(states(*layer.values.shape))
    layer.keys[0] = layer.values[0] = 0  # as allocated: finite where SDPA reads padding
    meta = attention.BatchMetadata.build(
        pool, query_lens, context_lens, tables, torch.device("cpu")
    )
    pool.write(0, key, value, meta.slot_mapping)  # the step's own tokens, as the layer does
    query = states(1, num_tokens, num_heads, head_dim).transpose(1, 2)
    return Batch(pool, meta, query, key, value)
