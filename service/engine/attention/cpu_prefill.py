"""Causal attention of prefill chunks in bfloat16 on CPUs with AVX512-BF16: the op
`textgen::causal_prefill`, its CPU kernel in `cpu_prefill.cpp`.

A long prompt's prefill on CPU spends most of its time in attention: torch's CPU flash
attention computes bfloat16 inputs in float32 (a 2,300-token prefill of the embedded model:
1.9 of 3.45 s, where the Linear layers' bfloat16 GEMMs take 1.3). The kernel takes both
products with `vdpbf16ps` (flash attention's online softmax, float32 statistics and
output); paged.py hands it the chunks of a step (`_attend_chunks`: those that start their
sequence, and later ones with no window; no soft-capping, sinks, ALiBi, chunked local
attention, bidirectional spans or batch-invariant mode), in bfloat16, where the CPU has
AVX512-BF16. Its outputs equal SDPA's to bfloat16's rounding of the probabilities
(tests/engine/test_cpu_prefill_attention.py).

Compiled once (~10 s the first time, ~2 s from the cache: `CACHE_DIR`, which a replica
sets to the textgen cache as for cpu_decode.py) by inductor's C++ toolchain, at a bfloat16
replica's start (replica/assembly.py), else on first use.
`--disable-custom-kernels` or `TEXTGEN_CPU_PREFILL_KERNEL=0` (or `ENABLED = False`) keeps
SDPA, and so does a failed compile (a host without a C++ compiler), with a warning.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ...models import avx512_bf16
from ...models.compile_cache import load_cpp_kernel

ENABLED = os.environ.get("TEXTGEN_CPU_PREFILL_KERNEL", "1") != "0"
# where the compile keeps its library (set by the replica: replica/assembly.py); None:
# torch's default
CACHE_DIR: Path | None = None
SOURCE = Path(__file__).with_name("cpu_prefill.cpp")
MAX_DIM = 256  # the largest head dimension the kernel takes (its MAX_DIM)

_library = torch.library.Library("textgen", "FRAGMENT")
_library.define(
    "causal_prefill(Tensor q, Tensor k, Tensor v, Tensor positions, float scale) -> Tensor"
)


@torch.library.register_fake("textgen::causal_prefill")
def _causal_prefill_fake(q, k, v, positions, scale):
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], v.shape[3])


_loaded: bool | None = None  # None: not tried yet


def takes(query: torch.Tensor, value_dim: int) -> bool:
    """Whether the kernel attends these queries (`[..., D]`; their keys and values in the
    same dtype, values `value_dim` wide): enabled, CPU, bfloat16, head sizes it takes, and
    compiled (tried once, on the first call that could take it)."""
    head_dim = query.shape[-1]
    shapes = head_dim % 2 == 0 and head_dim <= MAX_DIM and value_dim % 16 == 0
    return (
        query.device.type == "cpu"
        and query.dtype == torch.bfloat16
        and shapes
        and value_dim <= MAX_DIM
        and available()
    )


def attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Query rows `[b, H, q, D]` over their sequence's keys `[b, KVH, n, D]` (values
    `[b, KVH, n, Dv]`), row (i, r) over keys 0 .. positions[i, r] (`[b, q]` long; clamped to
    n - 1) -> `[b, q, H, Dv]`; takes(query, Dv) must hold."""
    return torch.ops.textgen.causal_prefill(query, keys, values, positions, scale)


def may_run() -> bool:
    """Enabled, and the CPU has the kernel's instructions (nothing compiled yet)."""
    return ENABLED and avx512_bf16.cpu_supports()


def available() -> bool:
    """Whether the kernel runs here: may_run(), and it compiled (or loaded from the cache),
    registering the op's CPU kernel; tried once (/proc/cpuinfo read once)."""
    global _loaded
    if not ENABLED:
        return False
    if _loaded is None:
        _loaded = may_run() and _load()
    return _loaded


def _load() -> bool:
    fallback = "prefill attends through SDPA"
    return load_cpp_kernel(SOURCE, CACHE_DIR, "the CPU prefill attention kernel", fallback)
