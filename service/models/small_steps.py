"""Int8 copies of the Linear weights for small steps: what `--dtype auto` adds on a CPU,
to the float32 model (a CPU without native bfloat16) or the bfloat16 one (avx512_bf16,
amx_bf16, Arm bf16).

A step of a few rows (one stream's decode, a verification of 1 + N proposals, a handful of
streams) waits on reading every weight once: 4 bytes a weight in float32, 2 in bfloat16.
Such steps read an int8 copy of each Linear layer's weight (one scale per output row)
through a fused int8 kernel that takes bfloat16 activations: textgen's own for bfloat16
models on CPUs with AVX512-BF16 (int8_avx512.py, unless --disable-custom-kernels), else
torch's `_weight_int8pack_mm`. float32 rows are rounded to bfloat16 on the way in and the
output widened back, so everything else (norms, attention, the residual stream, the KV
cache) stays in the model's dtype. Steps of more rows (prefill chunks, large batches) are
compute-bound, where the dtype's own GEMM is faster, and read the model's weight as before:
the copies cost a quarter (float32) or half (bfloat16) of the weights' memory on top.

Measured (docs/performance.md, "`--dtype auto` on a CPU without native bf16" and "... with
native bf16", 2 threads), the decode step against the dtype's own: float32 on a 2-core AMD
EPYC without avx512 1.69x faster at 1 stream, 2.18x at 4, 1.55x at 8, 1.19x at 16, 0.98x at
32 (hence 16 rows at most); bfloat16 on a 2-core AMD EPYC with avx512_bf16 1.66x at 1,
1.49x at 2, 1.32x at 4, 1.07x at 8, 0.96x at 16 (hence 8); textgen's int8 kernel there
reads them at ~27 GB/s against torch's ~14: the products alone 4.1x bfloat16's at 1 row,
2.3x at 8, 1.6x at 16, 1.07x at 32 (hence 16). Perplexity on the test chapter:
float32 18.906, through the copies 18.890; bfloat16 18.921, through the copies 18.924
(tests/service/test_small_steps.py asserts each within 1 %). `--dtype float32` or
`--dtype bfloat16` named keeps that dtype's exact path; so do the settings that need every
step's arithmetic alike (--deterministic) or their own weights (--quantize, a quantized
checkpoint, LoRA slots, shards): the loader is told by the replica's assembly. --compile's
decode graphs read the copies too (a graph's rows are fixed, so it traces one path).
"""

from __future__ import annotations

import logging

import torch

from . import int8_avx512
from .quantize import INT8_CPU_K_MULTIPLE, int8_per_row

logger = logging.getLogger("textgen.models")

# the most rows (tokens of a step) a Linear reads its int8 copy for, by the model's dtype:
# above, the dtype's own GEMM wins (measured: see the docstring)
SMALL_STEP_ROWS = {torch.float32: 16, torch.bfloat16: 8}
# ... for bfloat16 layers read by textgen's int8 kernel (int8_avx512.py)
AVX512_ROWS = 16
# where torch's int8 kernel is vectorised (x86's AVX2 and AVX-512 builds of it; elsewhere
# its scalar loop is slower than float32's GEMM)
VECTOR_CAPABILITIES = ("AVX2", "AVX512")
# the copies are made only when the machine has this many times their size available
MEMORY_MARGIN = 2


class SmallStepLinear(torch.nn.Linear):
    """A float32 or bfloat16 Linear that also holds its weight in int8 per row, read by
    steps of at most `max_rows` rows. Still an nn.Linear (same weight and bias parameters):
    code that reads `.weight` (tied embeddings, transformers' dtype probes) sees what it saw.
    `packed`: the copy is in textgen's kernel's layout (int8_avx512.pack), else torch's.

    The copy and what the small step reads are plain attributes, not buffers: every layer
    reads them on every step, where nn.Module's lookup of a buffer or parameter costs more
    than a small product's other work (a step's 211 layers spent ~1.5 ms of a 16 ms step on
    the forward's Python). Never saved with the model; CPU only, never moved."""

    int8_weight: torch.Tensor
    int8_scale: torch.Tensor
    max_rows: int
    packed: bool
    max_numel: int  # max_rows x in_features: the most input elements read by the copy
    copy_dtype: torch.dtype  # the weight's dtype: the inputs the copy takes
    has_bias: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() > self.max_numel or x.dtype is not self.copy_dtype:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if self.packed:  # bfloat16 [..., K] in, [..., N] out, in one call
            y = int8_avx512.product(
                x.contiguous(), self.int8_weight, self.int8_scale, self.out_features
            )
        else:
            # torch's kernel takes [M, K] bfloat16 rows: float32's are rounded on the way in
            rows = x.numel() // self.in_features
            flat = x.reshape(rows, self.in_features).to(torch.bfloat16).contiguous()
            y = torch.ops.aten._weight_int8pack_mm(flat, self.int8_weight, self.int8_scale)
            y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y + self.bias if self.has_bias else y


def add_small_step_weights(
    model: torch.nn.Module, max_rows: int | None = None, custom_kernels: bool = True
) -> int:
    """Give `model`'s float32 and bfloat16 Linear layers int8 copies for steps of up to
    `max_rows` rows (by default SMALL_STEP_ROWS for their dtype, AVX512_ROWS where textgen's
    kernel reads them), in place (each becomes a SmallStepLinear); -> how many. 0 where
    torch's int8 kernel has no vector path on this CPU, or when the machine's available
    memory is under MEMORY_MARGIN times the copies' size (then it says so and the model
    stays as is). `custom_kernels` False (--disable-custom-kernels): torch's kernel only."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in VECTOR_CAPABILITIES:
        logger.info(
            "no int8 copies for small steps: torch's int8 kernel is scalar on %s", capability
        )
        return 0
    linears = [m for m in model.modules() if _eligible(m)]
    size = sum(m.weight.numel() for m in linears)
    available = available_memory()
    if available is not None and available < MEMORY_MARGIN * size:
        logger.info(
            "no int8 copies for small steps: they need %.0f MiB, %.0f MiB is available",
            size / 2**20,
            available / 2**20,
        )
        return 0
    ours = custom_kernels and any(m.weight.dtype == torch.bfloat16 for m in linears)
    ours = ours and int8_avx512.available()
    for linear in linears:
        q, scale = int8_per_row(linear.weight.detach(), torch.bfloat16)
        linear.packed = ours and linear.weight.dtype == torch.bfloat16
        if linear.packed:
            q, scale = int8_avx512.pack(q, scale)
        linear.int8_weight, linear.int8_scale = q, scale
        linear.max_rows = max_rows or (
            AVX512_ROWS if linear.packed else SMALL_STEP_ROWS[linear.weight.dtype]
        )
        linear.max_numel = linear.max_rows * linear.in_features
        linear.copy_dtype = linear.weight.dtype
        linear.has_bias = linear.bias is not None
        linear.__class__ = SmallStepLinear
    return len(linears)


def small_step_rows(model: torch.nn.Module) -> int:
    """The most rows any of `model`'s layers reads its int8 copy for (0: none has one)."""
    return max((m.max_rows for m in model.modules() if isinstance(m, SmallStepLinear)), default=0)


def _eligible(module: torch.nn.Module) -> bool:
    return (
        type(module) is torch.nn.Linear
        and module.weight.dtype in SMALL_STEP_ROWS
        and module.weight.device.type == "cpu"
        and module.in_features % INT8_CPU_K_MULTIPLE == 0
    )


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is none: not Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
