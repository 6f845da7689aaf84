"""Quantized Linear layers (--quantize, service/models/quantize.py) inside the paged engine's
flattened ragged batch: a mixed batch with late arrivals must equal `model.generate` on the
same quantized model, prompt by prompt. float32, so no bfloat16 near-tie flips with the
batch's shape (the CPU kernels are slow in float32, fine at this size)."""

from __future__ import annotations

import pytest
import torch
from textgen.service.models.quantize import Int8Linear, quantize_model

from .factories import (
    VOCAB_SIZE,
    assert_idle,
    assert_matches_generate,
    engine_copy,
    make_core,
    make_seq,
    random_prompt,
    run_to_completion,
)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_model_in_a_mixed_batch_equals_generate(tiny_llama, method):
    model = engine_copy(tiny_llama)
    counts = quantize_model(model, method, torch.device("cpu"))
    assert counts.get(method) and not counts.get("dense")
    assert isinstance(model.lm_head, Int8Linear)  # vocab 300: int8 whatever the method
    core = make_core(model, prefill_tokens=64)
    g = torch.Generator().manual_seed(5)
    seqs = [
        make_seq(random_prompt(n, VOCAB_SIZE, g), request_id=f"q{i}", max_new_tokens=6 + i)
        for i, n in enumerate((1, 17, 90, 40, 3, 64))
    ]
    for seq in seqs[:4]:
        core.add(seq)
    core.step()  # a prefill chunk of the long prompt is then batched with decodes
    for seq in seqs[4:]:
        core.add(seq)
    run_to_completion(core)
    assert_matches_generate(model, seqs)
    assert_idle(core)
