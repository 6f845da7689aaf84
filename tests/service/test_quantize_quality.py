"""Quality of --quantize, measured: perplexity of the embedded SmolLM2-135M on a fixed
public-domain text (tests/data/pride-and-prejudice-ch1.txt: the opening chapter of Jane
Austen's *Pride and Prejudice*, 1813) per value, against the same model unquantized in
bfloat16 (what the quantized kernels compute in on CPU). The figures are in
docs/performance.md, "Quantization"."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from textgen.service.models import load_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TEXT = Path(__file__).parent.parent / "data" / "pride-and-prejudice-ch1.txt"
# relative perplexity increase allowed over unquantized bfloat16
TOLERANCE = {"int8": 0.01, "int4": 0.10}


def perplexity(method: str | None) -> float:
    loaded = load_model(None, dtype="bfloat16", device="cpu", quantize=method)
    ids = loaded.tokenizer(TEXT.read_text(encoding="utf-8"), return_tensors="pt")["input_ids"]
    assert ids.shape[1] > 1000  # the whole chapter, not a truncated prefix
    with torch.inference_mode():
        loss = loaded.model(input_ids=ids, labels=ids).loss
    return math.exp(loss.float().item())


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    """One thread: on a shared 2-core machine, two of torch's spinning OpenMP threads made
    the three loads and forwards 5-10x slower (13 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def unquantized() -> float:
    return perplexity(None)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_perplexity_within_tolerance(unquantized, method):
    ppl = perplexity(method)
    print(f"perplexity bfloat16 {unquantized:.3f}, {method} {ppl:.3f}")
    assert 15 < unquantized < 25  # the model reads English: a broken load would be far off
    assert ppl <= unquantized * (1 + TOLERANCE[method]), (method, ppl, unquantized)
