"""Builders shared by the engine tests: requests, sequences, tiny models, reference outputs."""

from __future__ import annotations

import copy

import torch
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
) -> PagedCore:
    core = PagedCore(
        engine_copy(model),
        max_batch_total_tokens=total_tokens,
        max_batch_prefill_tokens=prefill_tokens,
        max_batch_size=batch_size,
        block_size=block_size,
        batch_invariant=batch_invariant,
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
