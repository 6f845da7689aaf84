"""textgen's int8 kernel for CPUs with AVX512-BF16 (service/models/int8_avx512.py): the same
products as torch's `_weight_int8pack_mm` on the same per-row integers and scales, through
eager calls and a compiled graph, for `--quantize int8` and the small steps' int8 copies;
where the CPU lacks the instructions or --disable-custom-kernels is set, torch's kernel."""

from __future__ import annotations

import pytest
import torch
from support.tiers import needs_avx512_bf16
from textgen.service.models import avx512_bf16, int8_avx512
from textgen.service.models import quantize as q
from textgen.service.models.int8_avx512 import Int8Avx512Linear
from textgen.service.models.small_steps import (
    AVX512_ROWS,
    SMALL_STEP_ROWS,
    SmallStepLinear,
    add_small_step_weights,
)

CPU = torch.device("cpu")


def one_step(want: torch.Tensor) -> torch.Tensor:
    """One bfloat16 rounding step of each value (2^-7 relative, floored near zero)."""
    return want.abs().clamp_min(2**-10) * 2**-7


@needs_avx512_bf16
@pytest.mark.parametrize("shape", [(192, 576), (80, 96), (48, 64), (40, 34)])  # padded rows
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16, 33])
def test_products_equal_torchs_int8_kernel_to_the_last_bit_of_bfloat16(shape, rows):
    torch.manual_seed(rows)
    n, k = shape
    linear = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
    ints, scale = q.int8_per_row(linear.weight.detach(), torch.bfloat16)
    ours = Int8Avx512Linear.from_linear(linear)
    x = torch.randn(rows, k).to(torch.bfloat16)
    with torch.inference_mode():
        got = ours(x).float()
        # torch's kernel takes K in multiples of 16 only: the float32 product otherwise
        if k % q.INT8_CPU_K_MULTIPLE == 0:
            want = torch.ops.aten._weight_int8pack_mm(x, ints, scale).float()
        else:
            want = x.float() @ (ints.float() * scale.float()[:, None]).T
    assert got.shape == (rows, n)
    # the same float32 sums in another order, each rounded to bfloat16: one step at most
    assert ((got - want).abs() <= one_step(want)).all()
    assert (got - linear(x).float()).abs().max() < 0.05 * want.abs().max()


@needs_avx512_bf16
def test_pack_holds_each_rows_integers_and_scale():
    torch.manual_seed(0)
    ints = torch.randint(-128, 128, (40, 6), dtype=torch.int8)
    scale = torch.rand(40).to(torch.bfloat16)
    weight, scales = int8_avx512.pack(ints, scale)
    assert weight.shape == (2, 3, 2, 16, 2) and scales.shape == (64,)
    # byte (block, pair, vector, i, j) is row 32 block + 16 vector + i, input 2 pair + j
    rows = weight.permute(0, 2, 3, 1, 4).reshape(64, 6).view(torch.int8)
    assert torch.equal(rows[:40], ints) and not rows[40:].any()
    assert torch.equal(scales[:40], scale.float()) and not scales[40:].any()


@needs_avx512_bf16
def test_a_compiled_graph_calls_the_kernel_with_the_eager_results():
    torch.manual_seed(1)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(96, 64, bias=False)
    )
    mlp = mlp.to(torch.bfloat16)
    assert q.quantize_model(mlp, "int8", CPU) == {"int8": 2}
    assert all(isinstance(mlp[i], Int8Avx512Linear) for i in (0, 1))
    x = torch.randn(3, 64).to(torch.bfloat16)
    compiled = torch.compile(mlp, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        assert torch.equal(compiled(x), mlp(x))


@needs_avx512_bf16
def test_a_long_chunk_multiplies_the_dequantized_weight_densely():
    torch.manual_seed(2)
    linear = torch.nn.Linear(96, 80, bias=False).to(torch.bfloat16)  # N = 80: padded
    layer = Int8Avx512Linear.from_linear(linear)
    ints, scale = q.int8_per_row(linear.weight.detach(), torch.bfloat16)
    weight = (ints.float() * scale.float()[:, None]).to(torch.bfloat16)
    x = torch.randn(avx512_bf16.INT8_DENSE_FROM, 96).to(torch.bfloat16)
    with torch.inference_mode():
        got, want = layer(x).float(), torch.nn.functional.linear(x, weight).float()
        kernel = layer(x[:7]).float()  # fewer rows: the kernel, on the unrounded weights
    assert got.shape == (avx512_bf16.INT8_DENSE_FROM, 80)
    assert ((got - want).abs() <= one_step(want)).all()
    assert (kernel - want[:7]).abs().max() <= 2**-7 * want[:7].abs().max()


@needs_avx512_bf16
@pytest.mark.parametrize("leading", [(1, 1), (2, 3), (2, avx512_bf16.INT8_DENSE_FROM // 2)])
def test_the_op_takes_a_linears_input_as_it_comes(leading):
    """x [..., K]: its leading dimensions are the rows (a decode's [1, 1, K], a chunk's
    [1, T, K]), in the kernel and in the dense path; the same product as its rows flattened."""
    torch.manual_seed(3)
    weight, scales = int8_avx512.pack(*q.int8_per_row(torch.randn(80, 96), torch.bfloat16))
    x = torch.randn(*leading, 96).to(torch.bfloat16)
    with torch.inference_mode():
        got = int8_avx512.product(x, weight, scales, 80)
        flat = int8_avx512.product(x.reshape(-1, 96), weight, scales, 80)
    assert got.shape == (*leading, 80)
    assert torch.equal(got.reshape(-1, 80), flat)
    fake = avx512_bf16._int8_linear_fake(x, weight, scales, 80)  # what compiled graphs see
    assert fake.shape == got.shape


@needs_avx512_bf16
def test_the_int4_models_lm_head_takes_it():
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 96))
    model = model.to(torch.bfloat16)
    model.get_output_embeddings = lambda: model[1]
    assert q.quantize_model(model, "int4", CPU) == {"int4": 1, "int8": 1}
    assert isinstance(model[1], Int8Avx512Linear)


@pytest.mark.parametrize(
    ("dtype", "custom_kernels"), [(torch.bfloat16, False), (torch.float32, True)]
)
def test_disabled_or_float32_keeps_torchs_kernel(dtype, custom_kernels):
    model = torch.nn.Sequential(torch.nn.Linear(64, 128)).to(dtype)
    assert q.quantize_model(model, "int8", CPU, custom_kernels) == {"int8": 1}
    assert type(model[0]) is q.Int8Linear


@needs_avx512_bf16
@pytest.mark.parametrize("rows", [1, 5, AVX512_ROWS])
def test_bfloat16_small_steps_read_their_copies_through_it(rows):
    torch.manual_seed(3)
    ours, theirs = (torch.nn.Sequential(torch.nn.Linear(96, 48)).bfloat16() for _ in range(2))
    theirs.load_state_dict(ours.state_dict())
    assert add_small_step_weights(ours) == 1
    assert add_small_step_weights(theirs, max_rows=AVX512_ROWS, custom_kernels=False) == 1
    assert ours[0].packed and ours[0].max_rows == AVX512_ROWS and not theirs[0].packed
    x = torch.randn(rows, 96).to(torch.bfloat16)
    with torch.inference_mode():
        got, want = ours(x).float(), theirs(x).float()
        wide = ours(torch.randn(AVX512_ROWS + 1, 96).to(torch.bfloat16))  # the weight's own
    assert ((got - want).abs() <= 2 * one_step(want)).all()  # + the bias, rounded again
    assert wide.shape == (AVX512_ROWS + 1, 48)


def test_float32_small_steps_keep_torchs_kernel():
    model = torch.nn.Sequential(torch.nn.Linear(96, 48))
    assert add_small_step_weights(model) == 1
    assert type(model[0]) is SmallStepLinear and not model[0].packed
    assert model[0].max_rows == SMALL_STEP_ROWS[torch.float32]


@needs_avx512_bf16
def test_an_odd_k_is_refused():
    with pytest.raises(ValueError, match="even K"):
        Int8Avx512Linear.from_linear(torch.nn.Linear(33, 32).to(torch.bfloat16))


@needs_avx512_bf16
def test_a_compiled_graph_reads_the_bfloat16_copies_through_it():
    torch.manual_seed(4)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(96, 64, bias=False)
    ).bfloat16()
    assert add_small_step_weights(mlp) == 2 and mlp[0].packed
    compiled = torch.compile(mlp, fullgraph=True, dynamic=False)
    for rows in (1, 4):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        with torch.inference_mode():
            assert torch.equal(compiled(x), mlp(x))
