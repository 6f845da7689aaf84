"""int8 weights multiplied by textgen's own kernel on CPUs with AVX512-BF16
(`avx512_bf16.cpp`, the CPU kernel of the `textgen::int8_linear` op): there, the int8
layers of `--quantize int8` (and `--quantize int4`'s lm_head) are `Int8Avx512Linear`s and
the default dtype's int8 copies for small steps (small_steps.py) are read by it; elsewhere
torch's `_weight_int8pack_mm` (quantize.Int8Linear).

The same integers and scales as torch's kernel gets (quantize.int8_per_row: symmetric, one
scale per output row), packed for this one (`pack`). torch's kernel widens each weight to
float32 for float32 FMAs; this one splits each int8 into two 4-bit halves, each an exact
bfloat16 integer by a table lookup, and multiplies 32 of them an instruction
(`vdpbf16ps`): the sums differ from torch's only in their float32 order.

`TEXTGEN_INT8_KERNEL=0` or `--disable-custom-kernels` keeps torch's kernel, as does a CPU
without AVX512-BF16 or a failed compile (avx512_bf16.py).
"""

from __future__ import annotations

import os

import torch

from . import avx512_bf16
from .avx512_bf16 import ROWS
from .quantize import QuantizedLinear, int8_per_row

ENABLED = os.environ.get("TEXTGEN_INT8_KERNEL", "1") != "0"


def available() -> bool:
    """Whether int8 layers take this kernel: enabled (TEXTGEN_INT8_KERNEL) and the CPU's
    AVX512-BF16 kernels available (avx512_bf16.available)."""
    return ENABLED and avx512_bf16.available()


def pack(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout (avx512_bf16.cpp) of int8 integers q [N, K] (K even) and their
    rows' scales [N]: bytes [blocks, K / 2, 2, 16, 2] (a block's 32 rows as 2 vectors of 16,
    per pair of inputs), scales [padded N] float32. Padding rows are zero."""
    n, k = q.shape
    padded = avx512_bf16.padded_rows(n)
    wide = torch.zeros(padded, k, dtype=torch.int8)
    wide[:n] = q
    pairs = wide.view(torch.uint8).view(padded // ROWS, 2, 16, k // 2, 2)
    weight = pairs.permute(0, 3, 1, 2, 4).contiguous()
    scales = torch.zeros(padded, dtype=torch.float32)
    scales[:n] = scale.float()
    return weight, scales


# the op's overload, looked up once: a small step calls it for every layer
INT8_LINEAR = torch.ops.textgen.int8_linear.default


def product(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., K] bfloat16 (contiguous) times the packed weight's transpose -> [..., n]
    bfloat16."""
    return INT8_LINEAR(x, weight, scales, n)


class Int8Avx512Linear(QuantizedLinear):
    """A Linear whose weight is int8 with one scale per output row (quantize.int8_per_row),
    multiplied by `textgen::int8_linear` (available() must be true: its CPU kernel is
    registered)."""

    def __init__(
        self,
        weight: torch.Tensor,
        scales: torch.Tensor,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None,
    ):
        super().__init__(in_features, out_features, bias)
        self.register_buffer("weight_packed", weight)  # avx512_bf16.cpp's int8 layout
        self.register_buffer("scales", scales)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> Int8Avx512Linear:
        """`linear` (bfloat16, K even) quantized and packed."""
        if not available():
            raise ValueError("the int8 AVX512-BF16 kernel is not available on this host")
        weight = linear.weight.detach()
        n, k = weight.shape
        if weight.dtype != torch.bfloat16 or k % 2:
            raise ValueError("expected a bfloat16 weight with an even K")
        return cls(*pack(*int8_per_row(weight, torch.bfloat16)), n, k, linear.bias)

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        return product(flat, self.weight_packed, self.scales, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            "int8 per row, AVX512-BF16 kernel"
        )
