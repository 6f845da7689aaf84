"""The green-list watermark (engine/watermark.py) against transformers' own: the same green
lists as `WatermarkLogitsProcessor`, the same biased logits, and an engine's watermarked
greedy tokens equal to `generate(watermarking_config=...)`'s. The detection through a real
server is tests/integration/test_watermark.py."""

from __future__ import annotations

import pytest
import torch
from textgen.service.engine.sampler import Sampler
from textgen.service.engine.types import SamplingParams
from textgen.service.engine.watermark import HASH_KEY, Watermark
from transformers import WatermarkingConfig
from transformers.generation.logits_process import WatermarkLogitsProcessor

from .factories import (
    VOCAB_SIZE,
    assert_idle,
    make_core,
    make_seq,
    random_prompt,
    run_to_completion,
)


def processor(gamma: float, delta: float, vocab_size: int) -> WatermarkLogitsProcessor:
    return WatermarkLogitsProcessor(
        vocab_size, "cpu", greenlist_ratio=gamma, bias=delta, hashing_key=HASH_KEY
    )


@pytest.mark.parametrize("gamma", [0.25, 0.5, 0.7])
@pytest.mark.parametrize("vocab_size", [400, 49152])
def test_green_lists_are_transformers(gamma, vocab_size):
    theirs = processor(gamma, 2.0, vocab_size)
    ours = Watermark(gamma, 2.0)
    for token in (0, 1, 17, vocab_size - 1):
        expected = theirs._get_greenlist_ids(torch.tensor([5, token]))
        assert torch.equal(ours.green_list(token, vocab_size), expected)


def test_biased_logits_are_the_processors_on_the_watermarked_rows_only():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB_SIZE, generator=g)
    history = torch.tensor([[3, 9, 44], [7, 7, 7], [1, 2, 250]])
    ours = logits.clone()
    Watermark(0.5, 1.5).apply(ours, [0, 2], [44, 250])
    expected = processor(0.5, 1.5, VOCAB_SIZE)(history, logits.clone())
    assert torch.equal(ours[[0, 2]], expected[[0, 2]])
    assert torch.equal(ours[1], logits[1])


def test_the_sampler_biases_rows_that_ask_for_it():
    logits = torch.zeros(2, VOCAB_SIZE)
    seqs = [
        make_seq([1, 2, 3], request_id="marked", sampling=SamplingParams(watermark=True)),
        make_seq([1, 2, 3], request_id="plain"),
    ]
    picked = Sampler(Watermark(0.5, 5.0)).sample(logits, seqs)
    green = Watermark(0.5, 5.0).green_list(3, VOCAB_SIZE)
    assert picked.token_ids[0] in green.tolist()  # the first green id: argmax of ties
    assert picked.token_ids[1] == 0  # unbiased: argmax of ties
    assert picked.logprobs[0] > picked.logprobs[1]  # the bias shows in the logprob


def test_watermarked_greedy_equals_generate_with_a_watermarking_config(tiny_llama):
    """A large delta, so the watermark decides most picks: same hashing, same tokens."""
    gamma, delta = 0.5, 6.0
    core = make_core(tiny_llama)
    core.sampler = Sampler(Watermark(gamma, delta))
    g = torch.Generator().manual_seed(4)
    prompts = [random_prompt(5 + 4 * i, VOCAB_SIZE, g) for i in range(3)]
    seqs = []
    for i, prompt in enumerate(prompts):
        marked = SamplingParams(watermark=True)
        seq = make_seq(prompt, request_id=f"w{i}", max_new_tokens=12, sampling=marked)
        seqs.append(seq)
        core.add(seq)
    run_to_completion(core)
    config = WatermarkingConfig(greenlist_ratio=gamma, bias=delta)
    for seq, prompt in zip(seqs, prompts, strict=True):
        ids = torch.tensor([prompt])
        common = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 12, "do_sample": False}
        out = tiny_llama.generate(ids, watermarking_config=config, **common)
        plain = tiny_llama.generate(ids, **common)
        assert seq.output_ids == out[0, len(prompt) :].tolist()
        assert seq.output_ids != plain[0, len(prompt) :].tolist()  # the watermark decided
    assert_idle(core)
