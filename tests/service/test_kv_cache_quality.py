"""Quality of --kv-cache-dtype, measured: perplexity of the embedded SmolLM2-135M on the test
chapter (tests/data/pride-and-prejudice-ch1.txt, as test_quantize_quality.py) through the
engine's runner, the chapter fed as prefill chunks so that every chunk attends the earlier
ones from the KV pool, with the pool in the model's dtype and in each 8-bit dtype. The
figures are in docs/quantization.md."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from textgen.service.engine.kv_pool import KV_CACHE_DTYPES, KVCachePool
from textgen.service.engine.runners.model_runner import ModelRunner, StepInputs
from textgen.service.models import load_model
from textgen.service.models.loader import select_dtype

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TEXT = Path(__file__).parent.parent / "data" / "pride-and-prejudice-ch1.txt"
CHUNK = 256  # prefill tokens per step, as --max-batch-prefill-tokens would cut the chapter
BLOCK_SIZE = 16
# relative perplexity increase allowed over the pool in the model's dtype: issue 40's bar for
# e4m3fn (3 mantissa bits; measured +0.8-0.9 %); e5m2 keeps 2 mantissa bits for its wider
# range (measured +1.5 % in bfloat16, +2.8 % in float32)
TOLERANCE = {"fp8_e4m3fn": 0.02, "fp8_e5m2": 0.04}


def perplexity(model, ids: list[int], kv_dtype: torch.dtype | None) -> float:
    """exp(mean NLL) of ids[1:], the chapter run in CHUNK-token steps over a paged pool."""
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    runner = ModelRunner(model, KVCachePool(num_blocks, BLOCK_SIZE, dtype=kv_dtype))
    table = list(range(num_blocks))
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, CHUNK):
        end = min(start + CHUNK, len(ids) - 1)  # the last token is only a target
        chunk = ids[start:end]
        step = StepInputs(
            chunk, list(range(start, end)), [len(chunk)], [end], [table], list(range(len(chunk)))
        )
        logprobs = torch.log_softmax(runner.run(step).float(), dim=-1)
        targets = torch.tensor(ids[start + 1 : end + 1])
        nll -= logprobs.gather(1, targets.unsqueeze(1)).sum().item()
        count += len(chunk)
    return math.exp(nll / count)


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    """One thread: two spinning OpenMP threads on a shared 2-core machine slow it 5-10x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# the dtype `textgen serve` runs in here (bfloat16 on a CPU with native bf16, else float32:
# bfloat16 emulated costs 3x the time and is not what is served there)
@pytest.fixture(scope="module", params=[str(select_dtype("auto", torch.device("cpu")))[6:]])
def model_and_ids(request):
    loaded = load_model(None, dtype=request.param, device="cpu")
    ids = loaded.tokenizer(TEXT.read_text(encoding="utf-8"))["input_ids"]
    assert len(ids) > 1000  # the whole chapter
    return loaded.model, ids, request.param


@pytest.fixture(scope="module")
def full_width(model_and_ids) -> float:
    model, ids, _ = model_and_ids
    return perplexity(model, ids, None)


@pytest.mark.parametrize("kv_cache_dtype", sorted(KV_CACHE_DTYPES))
def test_perplexity_close_to_the_models_dtype(model_and_ids, full_width, kv_cache_dtype):
    model, ids, dtype = model_and_ids
    ppl = perplexity(model, ids, KV_CACHE_DTYPES[kv_cache_dtype])
    change = ppl / full_width - 1
    print(f"perplexity {dtype} KV {full_width:.4f}, {kv_cache_dtype} {ppl:.4f} ({change:+.2%})")
    assert 15 < full_width < 25  # the model reads English: a broken load would be far off
    assert change <= TOLERANCE[kv_cache_dtype], (kv_cache_dtype, ppl, full_width)
