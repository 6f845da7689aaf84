"""RMSNorm in one op call for bfloat16 models on CPUs with AVX512-BF16: what `--dtype auto`
adds there beside the small steps' int8 copies (small_steps.py), and `--quantize` beside its
weights (a named `--dtype bfloat16` keeps transformers' forward).

A decode step of one stream calls a Llama-style model's RMSNorm twice a layer (61 times in
the embedded model), each ~10 small tensor ops in transformers' forward (widen, square,
mean, add, rsqrt, multiply, round, multiply by the weight): ~19 us a call of Python and
dispatch for 576 numbers. `textgen::rms_norm` (avx512_bf16.cpp) computes the same thing in
one call: the mean of the squares in float32, x * rsqrt(mean + eps) rounded to bfloat16,
times the weight, rounded again; only the order of the float32 sum differs from torch's.

A norm is fused only where its own forward, run on a probe at load, gives the op's bits
and its forward takes its input alone: Llama's, Mistral's, Qwen's kind; Gemma's
`(1 + weight)`, norms rounding once and gated norms keep their forward. Graphs being
compiled (`--compile`) trace the module's own forward, which inductor fuses with its
neighbours. Measured on the embedded model (`scripts/measure_small_step_call.py --compare
norms`): one bfloat16 stream's step 1.17x faster, the same tokens (docs/performance.md).
`TEXTGEN_FUSED_NORMS=0` or `--disable-custom-kernels` keeps transformers' forward.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch

from . import avx512_bf16

RMS_NORM = torch.ops.textgen.rms_norm.default
ENABLED = os.environ.get("TEXTGEN_FUSED_NORMS", "1") != "0"


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Give `model`'s bfloat16 RMSNorm modules the op's forward where it computes what
    theirs does (see the module's docstring), in place; -> how many. 0 where the CPU's
    AVX512-BF16 kernels aren't available or TEXTGEN_FUSED_NORMS=0."""
    if not (ENABLED and avx512_bf16.available()):
        return 0
    fused = 0
    for module in model.modules():
        eps = _epsilon(module)
        if eps is not None and _agrees(module, eps):
            module.rms_eps = eps
            module.__class__ = _fused_class(type(module))
            fused += 1
    return fused


def _epsilon(module: torch.nn.Module) -> float | None:
    """The epsilon of a module that looks like an RMSNorm over its last dimension: its
    class named so, a bfloat16 vector weight on the CPU and nothing else to learn."""
    norm_class = type(module)
    if not norm_class.__name__.endswith("RMSNorm") or norm_class.forward is _fused_forward:
        return None
    weight = getattr(module, "weight", None)
    params = list(module.parameters(recurse=True))
    if not isinstance(weight, torch.Tensor) or len(params) != 1 or params[0] is not weight:
        return None
    if weight.dim() != 1 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    if not _takes_one_input(norm_class):  # a gate or other inputs beside (Mamba 2's)
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


@functools.cache
def _takes_one_input(norm_class: type) -> bool:
    """Whether the class's forward takes its input and nothing else."""
    try:
        parameters = list(inspect.signature(norm_class.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(parameters) == 2 and all(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters
    )


@torch.inference_mode()
def _agrees(module: torch.nn.Module, eps: float) -> bool:
    """Whether the module's forward and the op give the same bits on a probe (rows of
    several magnitudes): a norm rounding otherwise (its product with the weight in float32,
    rounded once) keeps its forward."""
    probe = _probe(module.weight.shape[0])
    try:
        want = module(probe)
    except (TypeError, ValueError, RuntimeError):  # another signature (a gate to take, ...)
        return False
    if not isinstance(want, torch.Tensor) or want.shape != probe.shape:
        return False
    return torch.equal(RMS_NORM(probe, module.weight, eps), want)


@functools.cache
def _probe(width: int) -> torch.Tensor:
    """Rows of four magnitudes, `width` wide, bfloat16 (one per width: a model's norms share it)."""
    rows = torch.randn(4, width, generator=torch.Generator().manual_seed(0))
    return (rows * torch.tensor([[0.01], [1.0], [4.0], [300.0]])).to(torch.bfloat16)


def _fused_forward(self, x: torch.Tensor) -> torch.Tensor:
    if x.dtype is not torch.bfloat16 or torch.compiler.is_compiling():
        return super(type(self), self).forward(x)
    return RMS_NORM(x.contiguous(), self.weight, self.rms_eps)


@functools.cache
def _fused_class(norm_class: type) -> type:
    """`norm_class` with the op's forward (same name prefixed: repr and checks show it)."""
    return type(f"Fused{norm_class.__name__}", (norm_class,), {"forward": _fused_forward})
