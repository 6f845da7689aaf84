"""Int8 copies of the Linear weights for small steps (service/models/small_steps.py): what
--dtype auto adds to the float32 (a CPU without native bf16) or bfloat16 model. Their
arithmetic against the int8 weights widened by hand, steps over the threshold bit for bit
the dtype's own, who gets them (not --dtype float32/bfloat16, --quantize, LoRA,
--deterministic, --compile), and the embedded model's perplexity through them within 1 % of
the dtype's own."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from support.tiny_model import build_tiny_model
from textgen.service.models import int8_avx512, load_model, small_steps
from textgen.service.models.loader import LoadOptions, LoraSetup, auto_dtype_reason
from textgen.service.models.quantize import int8_per_row
from textgen.service.models.small_steps import (
    AVX512_ROWS,
    SMALL_STEP_ROWS,
    SmallStepLinear,
    add_small_step_weights,
)
from textgen.service.replica.assembly import small_step_int8
from textgen.service.settings.table import Settings

FLOAT32_ROWS = SMALL_STEP_ROWS[torch.float32]
# bfloat16 copies: read by textgen's int8 kernel where this CPU has it (test_int8_avx512.py)
BFLOAT16_ROWS = AVX512_ROWS if int8_avx512.available() else SMALL_STEP_ROWS[torch.bfloat16]

TEXT = Path(__file__).parent.parent / "data" / "pride-and-prejudice-ch1.txt"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("small-steps"))


@pytest.fixture
def no_native_bf16(monkeypatch):
    """This CPU as one without native bf16, whatever it has (auto: float32)."""
    monkeypatch.setattr("textgen.service.models.loader.cpu_has_native_bf16", lambda: False)


def linear_pair(
    seed: int = 0, bias: bool = True, dtype: torch.dtype = torch.float32
) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    torch.manual_seed(seed)
    plain = torch.nn.Linear(96, 48, bias=bias, dtype=dtype)
    model = torch.nn.Sequential(torch.nn.Linear(96, 48, bias=bias, dtype=dtype))
    model[0].load_state_dict(plain.state_dict())
    assert add_small_step_weights(model) == 1
    return plain, model[0]


def widened(layer: SmallStepLinear) -> torch.Tensor:
    """The int8 copy's weights in float32 (the copy may be packed for a kernel: the same
    integers and scales, int8_per_row's)."""
    ints, scale = int8_per_row(layer.weight.detach(), torch.bfloat16)
    return ints.float() * scale.float().unsqueeze(1)


@pytest.mark.parametrize("rows", [1, 4, FLOAT32_ROWS])
def test_small_steps_compute_with_the_int8_weights(rows):
    plain, layer = linear_pair()
    x = torch.randn(1, rows, 96)
    with torch.inference_mode():
        y = layer(x)
        expected = torch.nn.functional.linear(x.bfloat16().float(), widened(layer), layer.bias)
        exact = plain(x)
    assert y.dtype == torch.float32 and y.shape == (1, rows, 48)
    # the kernel's bfloat16 output is the only rounding left
    torch.testing.assert_close(y, expected, rtol=1e-2, atol=1e-2)
    assert not torch.equal(y, exact)  # it did read the int8 copy
    # per-row int8: within a percent or so of the float32 product
    assert (y - exact).norm() / exact.norm() < 0.02


@pytest.mark.parametrize("rows", [1, BFLOAT16_ROWS])
def test_bfloat16_small_steps_read_the_int8_weights_without_widening(rows):
    plain, layer = linear_pair(dtype=torch.bfloat16)
    assert layer.max_rows == BFLOAT16_ROWS
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        y = layer(x)
        expected = torch.nn.functional.linear(x.float(), widened(layer), layer.bias.float())
        exact = plain(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 48)
    torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=2e-2)
    assert not torch.equal(y, exact)
    assert (y.float() - exact.float()).norm() / exact.float().norm() < 0.03


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_larger_steps_read_the_dtypes_weights_bit_for_bit(dtype):
    plain, layer = linear_pair(bias=False, dtype=dtype)
    x = torch.randn(layer.max_rows + 1, 96, dtype=dtype)
    with torch.inference_mode():
        assert torch.equal(layer(x), plain(x))
    assert isinstance(layer, torch.nn.Linear) and layer.weight is not None


def test_weights_are_shared_not_copied_and_memory_bounds_them(monkeypatch):
    _, layer = linear_pair()  # float32: torch's layout
    assert layer.int8_weight.dtype == torch.int8 and layer.int8_weight.shape == (48, 96)
    assert "int8_weight" not in layer.state_dict()  # never saved with the model
    model = torch.nn.Sequential(torch.nn.Linear(96, 48))
    monkeypatch.setattr(small_steps, "available_memory", lambda: 96 * 48)  # under twice
    assert add_small_step_weights(model) == 0
    assert type(model[0]) is torch.nn.Linear


def test_no_copies_where_the_int8_kernel_is_scalar(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    model = torch.nn.Sequential(torch.nn.Linear(96, 48))
    assert add_small_step_weights(model) == 0
    assert type(model[0]) is torch.nn.Linear


def test_only_dense_float32_and_bfloat16_linears_get_copies():
    model = torch.nn.Sequential(
        torch.nn.Linear(96, 48),
        torch.nn.Linear(40, 8),  # in_features not a multiple the kernel takes
        torch.nn.Linear(96, 8).bfloat16(),
        torch.nn.Linear(96, 8).half(),
    )
    assert add_small_step_weights(model) == 2
    kinds = [SmallStepLinear, torch.nn.Linear, SmallStepLinear, torch.nn.Linear]
    assert [type(m) for m in model] == kinds
    assert (model[0].max_rows, model[2].max_rows) == (FLOAT32_ROWS, BFLOAT16_ROWS)


def test_the_assembly_asks_only_where_auto_and_steps_need_not_compute_alike():
    base = Settings(model_id="m")
    assert small_step_int8(base)
    assert not small_step_int8(replace(base, dtype="float32"))
    assert not small_step_int8(replace(base, deterministic=True))
    # compiled decode graphs read them too (tests/engine/test_compiled_decode.py)
    assert small_step_int8(replace(base, compile=True))


def test_loader_adds_them_on_a_cpu_without_native_bf16(tiny_dir, no_native_bf16):
    loaded = load_model(str(tiny_dir), dtype="auto", options=LoadOptions(small_step_int8=True))
    assert loaded.dtype == torch.float32 and loaded.small_step_rows == FLOAT32_ROWS
    layers = [m for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    assert layers and all(type(m) is SmallStepLinear for m in layers)
    assert "int8 weight copies" in auto_dtype_reason(loaded)
    assert auto_dtype_reason(loaded).startswith("float32: this CPU has no native bf16")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"quantize": "int8"},  # its own int8 weights (in bfloat16)
        {"lora": LoraSetup(num_slots=2, max_rank=8)},  # LoRA slots wrap the float32 layers
    ],
    ids=["quantize", "lora"],
)
def test_loader_leaves_weights_that_another_setting_owns(tiny_dir, no_native_bf16, kwargs):
    loaded = load_model(
        str(tiny_dir), dtype="auto", options=LoadOptions(small_step_int8=True), **kwargs
    )
    assert loaded.small_step_rows == 0
    assert not any(isinstance(m, SmallStepLinear) for m in loaded.model.modules())


def test_loader_adds_them_to_bfloat16_where_it_is_native(tiny_dir, monkeypatch):
    monkeypatch.setattr("textgen.service.models.loader.cpu_has_native_bf16", lambda: True)
    loaded = load_model(str(tiny_dir), dtype="auto", options=LoadOptions(small_step_int8=True))
    rows = BFLOAT16_ROWS
    assert loaded.dtype == torch.bfloat16 and loaded.small_step_rows == rows
    layers = [m for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    assert layers and all(type(m) is SmallStepLinear for m in layers)
    reason = auto_dtype_reason(loaded)
    assert reason.startswith("bfloat16: this CPU computes bf16 natively")
    assert f"steps of up to {rows} tokens read int8 weight copies" in reason


def test_an_explicit_dtype_keeps_its_own_weights(tiny_dir):
    """--dtype bfloat16 or float32 asks for that arithmetic: the assembly asks for no copies."""
    settings = Settings(model_id="m", dtype="bfloat16")
    assert not small_step_int8(settings)
    loaded = load_model(str(tiny_dir), dtype="bfloat16", options=LoadOptions())
    assert not any(isinstance(m, SmallStepLinear) for m in loaded.model.modules())


def chunked_perplexity(model: torch.nn.Module, ids: torch.Tensor, chunk: int) -> float:
    """The perplexity of `ids` read `chunk` tokens a forward, with transformers' cache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = [
        model(input_ids=ids[:, at : at + chunk], past_key_values=cache, use_cache=True).logits
        for at in range(0, ids.shape[1], chunk)
    ]
    logits = torch.cat(logits, dim=1)[0, :-1].float()
    return math.exp(torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item())


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_embedded_perplexity_through_small_steps_within_one_percent(dtype):
    """The test chapter in forwards of 64 tokens, every row through the int8 copies (each
    row is computed alone, so a chunk is what as many decode steps compute; under the int8
    kernel's dense threshold), against the dtype's own weights."""
    chunk = 64
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see test_quantize_quality.py: a shared 2-core machine
    try:
        loaded = load_model(None, dtype=dtype, device="cpu")
        ids = loaded.tokenizer(TEXT.read_text(encoding="utf-8"), return_tensors="pt")["input_ids"]
        assert ids.shape[1] > 1000
        with torch.inference_mode():
            exact = chunked_perplexity(loaded.model, ids, chunk)
            assert add_small_step_weights(loaded.model, max_rows=chunk) > 200
            ppl = chunked_perplexity(loaded.model, ids, chunk)
    finally:
        torch.set_num_threads(threads)
    print(f"perplexity {dtype} {exact:.3f}, int8 small steps {ppl:.3f}")
    assert 15 < exact < 25
    assert ppl != exact  # the rows did read the copies
    assert ppl <= exact * 1.01, (ppl, exact)
