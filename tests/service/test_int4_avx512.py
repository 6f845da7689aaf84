"""textgen's int4 kernel for CPUs with AVX512-BF16 (service/models/int4_avx512.py): the same
products as torch's int4 kernel on torchao's quantization of the same weights, through
eager calls and a compiled graph; where the CPU lacks the instructions, torch's kernel."""

from __future__ import annotations

import pytest
import torch
from support.tiers import needs_avx512_bf16
from textgen.service.models import avx512_bf16, int4_avx512
from textgen.service.models import quantize as q
from textgen.service.models.int4_avx512 import Int4Avx512Linear

CPU = torch.device("cpu")


def torch_int4(linear: torch.nn.Linear) -> q.Int4Linear:
    """The layer torchao's CPU int4 quantization and torch's kernel make of `linear`."""
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
    from torchao.quantization import quantize_

    holder = torch.nn.Sequential(torch.nn.Linear(linear.in_features, linear.out_features))
    holder = holder.to(torch.bfloat16)
    holder[0].load_state_dict(linear.state_dict())
    quantize_(holder, PrototypeInt4WeightOnlyConfig(group_size=32, set_inductor_config=False))
    return q.Int4Linear.from_quantized(holder[0])


@needs_avx512_bf16
@pytest.mark.parametrize("shape", [(192, 576), (80, 96), (48, 64)])  # N = 80, 48: padded rows
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 33])
def test_products_equal_torchs_int4_kernel_to_the_last_bit_of_bfloat16(shape, rows):
    torch.manual_seed(rows)
    n, k = shape
    linear = torch.nn.Linear(k, n).to(torch.bfloat16)
    ours, theirs = Int4Avx512Linear.from_linear(linear), torch_int4(linear)
    x = torch.randn(rows, k).to(torch.bfloat16)
    with torch.inference_mode():
        got, want = ours(x).float(), theirs(x).float()
    # the same float32 sums in another order, each rounded to bfloat16: one step at most
    step = want.abs().clamp_min(2**-10) * 2**-7
    assert got.shape == (rows, n)
    assert ((got - want).abs() <= step).all()
    # and far closer to the dequantized weights' product than the quantization's own error
    assert (got - linear(x).float()).abs().max() < 0.1 * want.abs().max()


@needs_avx512_bf16
def test_quantize_weights_as_torchao_does():
    torch.manual_seed(0)
    weight = torch.randn(64, 96).to(torch.bfloat16)
    ints, scales, zeros = int4_avx512.quantize(weight)
    assert ints.min() >= 0 and ints.max() <= 15 and scales.shape == zeros.shape == (64, 3)
    # torch's int4 kernel on those integers gives the weight back to within half a step
    dequantized = (ints.float() - 8).view(64, 3, 32) * scales.float()[..., None]
    dequantized = (dequantized + zeros.float()[..., None]).view(64, 96)
    assert ((dequantized - weight.float()).abs() <= scales.float().repeat_interleave(32, 1)).all()


@needs_avx512_bf16
def test_a_compiled_graph_calls_the_kernel_with_the_eager_results():
    torch.manual_seed(1)
    # no bias or activation between: inductor would fuse them in float32, eager rounds each
    mlp = torch.nn.Sequential(
        torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(96, 64, bias=False)
    )
    mlp = mlp.to(torch.bfloat16)
    assert q.quantize_model(mlp, "int4", CPU) == {"int4": 2}
    assert all(isinstance(mlp[i], Int4Avx512Linear) for i in (0, 1))
    x = torch.randn(3, 64).to(torch.bfloat16)
    compiled = torch.compile(mlp, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        assert torch.equal(compiled(x), mlp(x))


def test_disable_custom_kernels_keeps_torchs_kernel():
    model = torch.nn.Sequential(torch.nn.Linear(64, 128)).to(torch.bfloat16)
    assert q.quantize_model(model, "int4", CPU, custom_kernels=False) == {"int4": 1}
    assert type(model[0]) is q.Int4Linear


def test_a_float32_model_keeps_torchs_kernel():
    model = torch.nn.Sequential(torch.nn.Linear(64, 128))
    assert q.quantize_model(model, "int4", CPU) == {"int4": 1}
    assert type(model[0]) is q.Int4Linear


@needs_avx512_bf16
def test_a_long_chunk_multiplies_the_dequantized_weight_densely():
    torch.manual_seed(2)
    linear = torch.nn.Linear(96, 80, bias=False).to(torch.bfloat16)  # N = 80: padded
    layer = Int4Avx512Linear.from_linear(linear)
    ints, scales, zeros = int4_avx512.quantize(linear.weight.detach())
    weight = (ints.float() - 8).view(80, 3, 32) * scales.float()[..., None]
    weight = (weight + zeros.float()[..., None]).view(80, 96).to(torch.bfloat16)
    x = torch.randn(avx512_bf16.INT4_DENSE_FROM, 96).to(torch.bfloat16)
    with torch.inference_mode():
        got, want = layer(x).float(), torch.nn.functional.linear(x, weight).float()
        # fewer rows take the kernel, with the weights unrounded: as close as bfloat16 allows
        kernel = layer(x[:7]).float()
    assert got.shape == (avx512_bf16.INT4_DENSE_FROM, 80)
    assert ((got - want).abs() <= want.abs().clamp_min(2**-10) * 2**-7).all()
    assert (kernel - want[:7]).abs().max() <= 2**-7 * want[:7].abs().max()
