"""int4 weights multiplied by textgen's own kernel on CPUs with AVX512-BF16
(`avx512_bf16.cpp`, the CPU kernel of the `textgen::int4_linear` op): `--quantize int4`'s
layers there are `Int4Avx512Linear`s, elsewhere quantize.py's `Int4Linear` (torch's
`_weight_int4pack_mm_for_cpu`).

The weights are torchao's int4 quantization, the same integers, scales and zeros as
`Int4Linear`'s (groups of 32, w = (q - 8) * scale + zero), packed for the kernel instead
(`pack`). torch's kernel widens each weight to float32 for float32 FMAs; this one turns
each into an exact bfloat16 integer by a table lookup and multiplies 32 of them an
instruction (`vdpbf16ps`): the embedded model's products 1.3x torch's for one token, 2x
for 32 (docs/performance.md). The sums differ from torch's only in their float32 order.
From avx512_bf16.INT4_DENSE_FROM input rows on (long prefill chunks) the weight is
dequantized to bfloat16 by the same lookup and multiplied by torch's dense matmul (prefill
as fast as bfloat16's).

`TEXTGEN_INT4_KERNEL=0` or `--disable-custom-kernels` keeps torch's kernel, as does a CPU
without AVX512-BF16 or a failed compile (avx512_bf16.py).
"""

from __future__ import annotations

import os

import torch

from . import avx512_bf16
from .avx512_bf16 import ROWS
from .quantize import QuantizedLinear

ENABLED = os.environ.get("TEXTGEN_INT4_KERNEL", "1") != "0"
GROUP = 32  # inputs one scale and zero cover (avx512_bf16.cpp's GROUP)


def available() -> bool:
    """Whether int4 layers take this kernel: enabled (TEXTGEN_INT4_KERNEL) and the CPU's
    AVX512-BF16 kernels available (avx512_bf16.available)."""
    return ENABLED and avx512_bf16.available()


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchao's int4 quantization of a [N, K] weight, as its CPU int4 tensor does it
    (Int4OpaqueTensor.from_hp, tinygemm's parameters): integers [N, K] in 0 .. 15, scales
    and zeros [N, K / GROUP] in the weight's dtype."""
    from torchao.quantization.quant_primitives import (
        MappingType,
        _choose_qparams_affine_tinygemm,
        _quantize_affine_tinygemm,
    )

    block = [1, GROUP]
    scale, zero = _choose_qparams_affine_tinygemm(
        weight, MappingType.ASYMMETRIC, block, torch.int32, 0, 15, 1e-6, None, weight.dtype
    )
    q = _quantize_affine_tinygemm(weight, block, scale, zero, torch.int32, 0, 15)
    rows = weight.shape[0]
    return q, scale.reshape(rows, -1), zero.reshape(rows, -1)


def pack(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's layout (avx512_bf16.cpp) of integers q [N, K] and their groups' scales
    and zeros [N, K / GROUP]: bytes [blocks, K / 4, 2, 16, 2] (a block's 32 rows as 2
    vectors of 16, per quad of inputs), scales and zeros [blocks, K / GROUP, 32] bfloat16.
    Padding rows are zero."""
    n, k = q.shape
    padded = avx512_bf16.padded_rows(n)
    wide = torch.zeros(padded, k, dtype=torch.uint8)
    wide[:n] = q.to(torch.uint8)
    quads = wide.view(padded // ROWS, 2, 16, k // 4, 4)
    low = quads[..., 0] | (quads[..., 2] << 4)  # inputs k, k + 2 of each quad
    high = quads[..., 1] | (quads[..., 3] << 4)  # k + 1, k + 3
    weight = torch.stack([low, high], -1).permute(0, 3, 1, 2, 4).contiguous()

    def by_block(values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(padded, k // GROUP, dtype=torch.bfloat16)
        out[:n] = values
        return out.view(padded // ROWS, ROWS, -1).transpose(1, 2).contiguous()

    return weight, by_block(scales), by_block(zeros)


class Int4Avx512Linear(QuantizedLinear):
    """A Linear whose weight is int4 in groups of GROUP (torchao's quantization), multiplied
    by `textgen::int4_linear` (available() must be true: its CPU kernel is registered)."""

    def __init__(
        self,
        weight: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None,
    ):
        super().__init__(in_features, out_features, bias)
        self.register_buffer("weight_packed", weight)  # avx512_bf16.cpp's int4 layout
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> Int4Avx512Linear:
        """`linear` (bfloat16, K a multiple of GROUP) quantized and packed."""
        if not available():
            raise ValueError("the int4 AVX512-BF16 kernel is not available on this host")
        weight = linear.weight.detach()
        n, k = weight.shape
        if weight.dtype != torch.bfloat16 or k % GROUP:
            raise ValueError(f"expected a bfloat16 weight with K a multiple of {GROUP}")
        return cls(*pack(*quantize(weight)), n, k, linear.bias)

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.textgen.int4_linear(
            flat, self.weight_packed, self.scales, self.zeros, self.out_features
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 in groups of {GROUP}, AVX512-BF16 kernel"
        )
