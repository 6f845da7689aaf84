"""textgen's CPU kernels for int4 and int8 weights on CPUs with AVX512-BF16
(`avx512_bf16.cpp`): the ops `textgen::int4_linear` and `textgen::int8_linear`, their CPU
kernels registered by compiling and loading that file (once a process, ~15 s the first
time, then from the textgen cache, with inductor's C++ toolchain), so compiled graphs call
them from C++. int4_avx512.py and int8_avx512.py pack weights for them and hold the layers.

Where the CPU lacks the instructions, the compile fails (a host without a C++ compiler) or
`--disable-custom-kernels` is set, the layers keep torch's kernels.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .compile_cache import kernel_cache_dir, load_cpp_kernel
from .cpuinfo import cpuinfo_flags

SOURCE = Path(__file__).with_name("avx512_bf16.cpp")
ROWS = 32  # rows the kernels pack together (the source's ROWS); N is padded to them
# input rows from which the weight is dequantized for a dense matmul (the source's ditto)
INT4_DENSE_FROM = 512
INT8_DENSE_FROM = 128
# the instruction sets the kernels are compiled for (/proc/cpuinfo's names)
CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})

_library = torch.library.Library("textgen", "FRAGMENT")
_library.define(
    "int4_linear(Tensor x, Tensor weight, Tensor scales, Tensor zeros, int out_features) -> Tensor"
)
# int8_linear's x: [..., K], its leading dimensions the rows (int4_linear's: [M, K])
_library.define("int8_linear(Tensor x, Tensor weight, Tensor scales, int out_features) -> Tensor")
# bfloat16 x [..., H], weight [H] -> transformers' Llama-style RMSNorm of x (fused_norms.py)
_library.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")


@torch.library.register_fake("textgen::int4_linear")
def _int4_linear_fake(x, weight, scales, zeros, out_features):
    return x.new_empty(x.shape[0], out_features)


@torch.library.register_fake("textgen::rms_norm")
def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x)


@torch.library.register_fake("textgen::int8_linear")
def _int8_linear_fake(x, weight, scales, out_features):
    return x.new_empty(*x.shape[:-1], out_features)  # x [..., K]


_loaded: bool | None = None  # None: not tried yet


def cpu_supports(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU runs the kernels' instructions: every flag of CPU_FLAGS."""
    try:
        with open(cpuinfo_path, encoding="utf-8", errors="replace") as f:
            return CPU_FLAGS <= cpuinfo_flags(f.read())
    except OSError:
        return False  # not Linux: torch's kernels


def available() -> bool:
    """Whether the kernels run here: the CPU supports them and they compiled (or loaded from
    the cache), registering the ops' CPU kernels; tried once (/proc/cpuinfo read once)."""
    global _loaded
    if _loaded is None:
        _loaded = cpu_supports() and _load()
    return _loaded


def _load() -> bool:
    try:
        cache = kernel_cache_dir("avx512-bf16")
    except OSError:
        cache = None  # torch's default, the temp dir
    fallback = "int4 and int8 layers use torch's"
    return load_cpp_kernel(SOURCE, cache, "textgen's AVX512-BF16 kernels", fallback)


def padded_rows(n: int) -> int:
    """N rounded up to the kernels' blocks of ROWS."""
    return -(-n // ROWS) * ROWS
