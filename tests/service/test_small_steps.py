"""Int8 copies of the Linear weights for small steps (service/models/small_steps.py): what
--dtype auto adds where a CPU without native bf16 computes in float32. Their arithmetic
against the int8 weights widened by hand, steps over the threshold bit for bit float32's,
who gets them (not --dtype float32, --quantize, LoRA, --deterministic, --compile), and the
embedded model's perplexity through them within 1 % of float32's."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from support.tiny_model import build_tiny_model
from textgen.service.models import load_model, small_steps
from textgen.service.models.loader import LoadOptions, LoraSetup, auto_dtype_reason
from textgen.service.models.small_steps import (
    SMALL_STEP_ROWS,
    SmallStepLinear,
    add_small_step_weights,
)
from textgen.service.replica.assembly import small_step_int8
from textgen.service.settings.table import Settings

TEXT = Path(__file__).parent.parent / "data" / "pride-and-prejudice-ch1.txt"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("small-steps"))


@pytest.fixture
def no_native_bf16(monkeypatch):
    """This CPU as one without native bf16, whatever it has (auto: float32)."""
    monkeypatch.setattr("textgen.service.models.loader.cpu_has_native_bf16", lambda: False)


def linear_pair(seed: int = 0, bias: bool = True) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    torch.manual_seed(seed)
    plain = torch.nn.Linear(96, 48, bias=bias)
    model = torch.nn.Sequential(torch.nn.Linear(96, 48, bias=bias))
    model[0].load_state_dict(plain.state_dict())
    assert add_small_step_weights(model) == 1
    return plain, model[0]


def widened(layer: SmallStepLinear) -> torch.Tensor:
    return layer.int8_weight.float() * layer.int8_scale.float().unsqueeze(1)


@pytest.mark.parametrize("rows", [1, 4, SMALL_STEP_ROWS])
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


def test_larger_steps_read_the_float32_weights_bit_for_bit():
    plain, layer = linear_pair(bias=False)
    x = torch.randn(SMALL_STEP_ROWS + 1, 96)
    with torch.inference_mode():
        assert torch.equal(layer(x), plain(x))
    assert isinstance(layer, torch.nn.Linear) and layer.weight is not None


def test_weights_are_shared_not_copied_and_memory_bounds_them(monkeypatch):
    _, layer = linear_pair()
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


def test_only_dense_float32_linears_get_copies():
    model = torch.nn.Sequential(
        torch.nn.Linear(96, 48), torch.nn.Linear(40, 8), torch.nn.Linear(96, 8).bfloat16()
    )
    assert add_small_step_weights(model) == 1
    assert [type(m) for m in model] == [SmallStepLinear, torch.nn.Linear, torch.nn.Linear]


def test_the_assembly_asks_only_where_auto_and_nothing_needs_the_float32_path():
    base = Settings(model_id="m")
    assert small_step_int8(base)
    assert not small_step_int8(replace(base, dtype="float32"))
    assert not small_step_int8(replace(base, deterministic=True))
    assert not small_step_int8(replace(base, compile=True))


def test_loader_adds_them_on_a_cpu_without_native_bf16(tiny_dir, no_native_bf16):
    loaded = load_model(str(tiny_dir), dtype="auto", options=LoadOptions(small_step_int8=True))
    assert loaded.dtype == torch.float32 and loaded.small_step_rows == SMALL_STEP_ROWS
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


def test_no_copies_where_bfloat16_is_native(tiny_dir, monkeypatch):
    monkeypatch.setattr("textgen.service.models.loader.cpu_has_native_bf16", lambda: True)
    loaded = load_model(str(tiny_dir), dtype="auto", options=LoadOptions(small_step_int8=True))
    assert loaded.dtype == torch.bfloat16 and loaded.small_step_rows == 0
    assert auto_dtype_reason(loaded).startswith("bfloat16: this CPU computes bf16 natively")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_embedded_perplexity_through_small_steps_within_one_percent(monkeypatch):
    """The test chapter in one forward, every row through the int8 copies (each row is
    computed alone, so a long forward is what as many decode steps compute), against float32."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see test_quantize_quality.py: a shared 2-core machine
    try:
        loaded = load_model(None, dtype="float32", device="cpu")
        ids = loaded.tokenizer(TEXT.read_text(encoding="utf-8"), return_tensors="pt")["input_ids"]
        assert ids.shape[1] > 1000
        with torch.inference_mode():
            exact = math.exp(loaded.model(input_ids=ids, labels=ids).loss.item())
            monkeypatch.setattr(small_steps, "SMALL_STEP_ROWS", ids.shape[1])
            assert add_small_step_weights(loaded.model) > 200
            ppl = math.exp(loaded.model(input_ids=ids, labels=ids).loss.item())
    finally:
        torch.set_num_threads(threads)
    print(f"perplexity float32 {exact:.3f}, int8 small steps {ppl:.3f}")
    assert 15 < exact < 25
    assert ppl != exact  # the rows did read the copies
    assert ppl <= exact * 1.01, (ppl, exact)
