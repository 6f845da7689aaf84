"""Weight-only quantization at load time (`--quantize int8|int4|fp8`): the weights of the
model's Linear layers are stored in fewer bits and multiplied by fused kernels that read them
as they are, so a decode step, which reads every weight once per token, moves fewer bytes.
TGI's other values (gptq, awq, compressed-tensors, bitsandbytes*, eetq, marlin, exl2) and
checkpoints that arrive quantized go through transformers' quantizers: checkpoint_quant.py;
`resolve_quantization` picks between the two.

| value | CPU | CUDA |
| --- | --- | --- |
| int8 | per row: int8_avx512.py (AVX512-BF16), else Int8Linear | torchao int8 weight-only |
| int4 | torchao int4 (groups of 32): int4_avx512.py (AVX512-BF16), else Int4Linear | tinygemm |
| fp8 | refused | torchao fp8 weights and activations, per row (sm 8.9+) |

Choices measured on the embedded SmolLM2-135M (docs/performance.md, "Quantization"):
- int4 groups of 32: the embedded weights come from a Q4_1 GGUF, whose blocks are 32 wide,
  so int4 in groups of 32 holds them almost exactly (perplexity +0.05 %); groups of 64 cost
  +21 %. Layers whose shape the int4 kernels can't take (N not a multiple of 16, K not a
  multiple of 32) get int8 instead, and those the CPU int8 kernel can't take (K not a
  multiple of 16) stay as they are.
- lm_head is quantized too, to int8 with either value: it is a fifth of this model's weights
  and the largest single read of a decode step. int4 there cost +7 % perplexity, int8 +0.4 %.
  When the input embedding is tied to it, the embedding keeps its own wide copy (a lookup
  reads a few rows, not the table).
- On CPU the kernels take bfloat16 activations; with float32 they fall back to scalar loops
  20-100x slower than a dense float32 matmul, so float32 is refused and `--dtype auto` means
  bfloat16. torchao's own int8 weight-only linear converts the whole weight to the
  activation dtype on every call in eager mode (meant for torch.compile), slower than no
  quantization here; torch's fused `_weight_int8pack_mm` is the CPU kernel used instead.
"""

from __future__ import annotations

import ctypes
import logging
import warnings
from collections import Counter

import torch

from .checkpoint_quant import (
    LIBRARY_METHODS,
    CheckpointQuantizationError,
    LibraryQuantization,
    checkpoint_method,
    plan,
)
from .errors import ModelError

logger = logging.getLogger("textgen.models")

# what this module quantizes with torchao (or torch's CPU int8 kernel) as the model loads
TORCHAO_METHODS = ("int8", "int4", "fp8")
# the --quantize values (textgen.service.settings.table.QUANTIZE_METHODS, which the flag's parser
# checks, names the same: config stays free of torch, models free of config)
QUANTIZE_METHODS = (*TORCHAO_METHODS, *(m for m in LIBRARY_METHODS if m not in TORCHAO_METHODS))
INT4_GROUP_SIZE = 32
# what the int4 kernels take: N a multiple of 16 (CPU packing), K of the group size
INT4_N_MULTIPLE = 16
# torch's CPU int8 kernel reads K in 16-wide vectors with no tail: other K read past the row
# (garbage or a crash), so such layers stay wide
INT8_CPU_K_MULTIPLE = 16
FP8_MULTIPLE = 16  # torch._scaled_mm: both dims of the weight multiples of 16
FP8_MIN_CAPABILITY = (8, 9)  # Ada, Hopper and later have fp8 tensor cores
INT4_CUDA_MIN_CAPABILITY = (8, 0)  # tinygemm's tensor-core kernel


class QuantizationError(ModelError):
    """--quantize names a value this device or dtype can't run."""


def resolve_quantization(
    method: str | None, config: dict, device: torch.device, dtype_flag: str, dtype: torch.dtype
) -> tuple[torch.dtype, LibraryQuantization | None]:
    """(the compute dtype, the library quantization to load with or None) for --quantize
    `method` on a checkpoint whose config.json is `config`; raises QuantizationError with
    the reason when it can't run here (at startup, before any weight is read)."""
    try:
        library = plan(method, checkpoint_method(config), device, dtype, dtype_flag)
    except CheckpointQuantizationError as exc:
        raise QuantizationError(str(exc)) from None
    if library is not None:
        return library.dtype, library
    return check_quantize(method, device, dtype_flag, dtype), None


def check_quantize(
    method: str | None, device: torch.device, dtype_flag: str, dtype: torch.dtype
) -> torch.dtype:
    """Refuse what can't run here (at startup, before any loading); -> the compute dtype.

    `dtype` is what --dtype resolved to without quantization; `dtype_flag` says whether the
    user chose it ("auto" may be changed to what the kernels need, a named dtype may not)."""
    if method is None:
        return dtype
    if method not in TORCHAO_METHODS:
        raise QuantizationError(
            f"unknown --quantize value {method!r}; use one of {', '.join(QUANTIZE_METHODS)}"
        )
    auto = isinstance(dtype_flag, str) and dtype_flag.strip().lower() == "auto"
    if device.type == "cpu":
        return _check_cpu(method, dtype, auto)
    if device.type == "cuda":
        return _check_cuda(method, device, dtype, auto)
    raise QuantizationError(f"--quantize runs on cpu and cuda devices, not {device.type}")


def _check_cpu(method: str, dtype: torch.dtype, auto: bool) -> torch.dtype:
    if method == "fp8":
        raise QuantizationError(
            "--quantize fp8 needs a CUDA GPU with fp8 tensor cores (compute capability 8.9+: "
            "Ada, Hopper); on CPU use --quantize int8 or int4"
        )
    if auto or dtype is torch.bfloat16:
        return torch.bfloat16
    raise QuantizationError(
        f"--quantize {method} on CPU computes in bfloat16 (torch's int8/int4 CPU kernels have "
        f"no fast {str(dtype).removeprefix('torch.')} path); use --dtype bfloat16 or auto"
    )


def _check_cuda(method: str, device: torch.device, dtype: torch.dtype, auto: bool) -> torch.dtype:
    capability = torch.cuda.get_device_capability(device)
    if method == "int8":
        return dtype
    need = FP8_MIN_CAPABILITY if method == "fp8" else INT4_CUDA_MIN_CAPABILITY
    if capability < need:
        raise QuantizationError(
            f"--quantize {method} needs a GPU of compute capability {need[0]}.{need[1]}+; "
            f"{device} is {capability[0]}.{capability[1]}; use --quantize int8"
        )
    if auto or dtype is torch.bfloat16:
        return torch.bfloat16
    raise QuantizationError(
        f"--quantize {method} on CUDA computes in bfloat16; use --dtype bfloat16 or auto"
    )


def quantize_model(
    model: torch.nn.Module, method: str, device: torch.device, custom_kernels: bool = True
) -> dict[str, int]:
    """Quantize `model`'s Linear layers in place (see the module docstring); -> how many
    layers got each format ("dense" for those left as they were). `custom_kernels` False
    (--disable-custom-kernels) keeps CPU int4 and int8 layers on torch's kernels."""
    linears = [(n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    formats = {
        name: _format_for("int8" if module is head and method == "int4" else method, module, device)
        for name, module in linears
    }
    del linears, head  # the wide layers must be free to go once replaced
    import_torchao_quietly()
    for fmt in ("int4", "int8", "fp8"):
        names = {n for n, f in formats.items() if f == fmt}
        if names:
            _apply(model, fmt, names, device, custom_kernels)
    if device.type == "cpu":
        _return_freed_memory()
    counts = Counter(formats.values())
    logger.info(
        "quantized %d Linear layers (%s)",
        sum(n for f, n in counts.items() if f != "dense"),
        ", ".join(f"{f}: {n}" for f, n in sorted(counts.items())),
    )
    return dict(counts)


def _format_for(method: str, linear: torch.nn.Linear, device: torch.device) -> str:
    n, k = linear.out_features, linear.in_features
    if method == "fp8":
        return "fp8" if n % FP8_MULTIPLE == 0 and k % FP8_MULTIPLE == 0 else "dense"
    int8 = "int8" if device.type != "cpu" or k % INT8_CPU_K_MULTIPLE == 0 else "dense"
    if method == "int4":
        return "int4" if n % INT4_N_MULTIPLE == 0 and k % INT4_GROUP_SIZE == 0 else int8
    return int8


def _apply(
    model: torch.nn.Module, fmt: str, names: set[str], device: torch.device, custom_kernels: bool
) -> None:
    ours = device.type == "cpu" and custom_kernels and _all_bfloat16(model, names)
    if fmt == "int8" and device.type == "cpu":
        from . import int8_avx512

        if ours and int8_avx512.available():
            _replace(model, names, int8_avx512.Int8Avx512Linear.from_linear)
            logger.info("int8 layers: textgen's AVX512-BF16 kernel (models/int8_avx512.py)")
        else:
            _replace(model, names, Int8Linear.from_linear)
            logger.info("int8 layers: torch's kernel (_weight_int8pack_mm)")
        return
    if fmt == "int4" and ours:
        from . import int4_avx512

        if int4_avx512.available():
            _replace(model, names, int4_avx512.Int4Avx512Linear.from_linear)
            logger.info("int4 layers: textgen's AVX512-BF16 kernel (models/int4_avx512.py)")
            return
    from torchao.quantization import quantize_

    quantize_(model, _torchao_config(fmt, device), filter_fn=lambda _m, fqn: fqn in names)
    if fmt == "int4" and device.type == "cpu":
        _replace(model, names, Int4Linear.from_quantized)
        logger.info("int4 layers: torch's kernel (_weight_int4pack_mm_for_cpu)")


def _all_bfloat16(model: torch.nn.Module, names: set[str]) -> bool:
    return {model.get_submodule(n).weight.dtype for n in names} == {torch.bfloat16}


def _replace(model: torch.nn.Module, names: set[str], convert) -> None:
    """Each named layer replaced by convert(layer), one at a time (each wide weight free to
    go as soon as its layer is converted)."""
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, convert(getattr(owner, child)))


def _torchao_config(fmt: str, device: torch.device):
    """torchao's config for `fmt` on `device` (CPU int8 is Int8Linear, not torchao)."""
    # set_inductor_config=False: quantizing must not change torch.compile's global settings
    if fmt == "int8":
        from torchao.quantization import Int8WeightOnlyConfig

        return Int8WeightOnlyConfig(set_inductor_config=False)
    if fmt == "int4" and device.type == "cpu":
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        return PrototypeInt4WeightOnlyConfig(group_size=INT4_GROUP_SIZE, set_inductor_config=False)
    if fmt == "int4":
        from torchao.quantization import Int4WeightOnlyConfig

        return Int4WeightOnlyConfig(
            group_size=INT4_GROUP_SIZE,
            int4_packing_format="tile_packed_to_4d",
            set_inductor_config=False,
        )
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

    return Float8DynamicActivationFloat8WeightConfig(
        granularity=PerRow(), set_inductor_config=False
    )


def int8_per_row(
    weight: torch.Tensor, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, one scale per output row in `scale_dtype`), symmetric. The scale is
    rounded to `scale_dtype` first and the weight divided by that rounded scale, so the
    kernel's scale is the one quantized against (a bfloat16 scale alone would be off by up
    to 0.4 % per row)."""
    wide = weight.float()
    absmax = wide.abs().amax(dim=1).clamp(min=1e-12)
    scale = (absmax / 127).to(scale_dtype)
    q = torch.round(wide / scale.float().unsqueeze(1)).clamp(-128, 127).to(torch.int8)
    return q.contiguous(), scale


class QuantizedLinear(torch.nn.Module):
    """A Linear whose weight a quantized format holds: subclasses multiply a contiguous
    `[rows, in_features]` input by it (`product`); forward flattens the input, adds the
    bias and restores the leading dims. LoRA wraps any of them (lora_layers.py)."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        bias = None if bias is None else bias.detach()
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        y = self.product(flat).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int8Linear(QuantizedLinear):
    """A Linear whose weight is int8 with one scale per output row, multiplied by torch's
    fused CPU kernel (the int8 weight is read once, never widened in memory)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(qweight.shape[1], qweight.shape[0], bias)
        self.register_buffer("qweight", qweight)  # [out, in] int8
        self.register_buffer("scale", scale)  # [out], the activations' dtype

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> Int8Linear:
        """Symmetric per-row int8 (int8_per_row), scales in the weight's dtype."""
        if linear.in_features % INT8_CPU_K_MULTIPLE:
            raise ValueError(f"in_features must be a multiple of {INT8_CPU_K_MULTIPLE}")
        weight = linear.weight.detach()
        q, scale = int8_per_row(weight, weight.dtype)
        return cls(q, scale, linear.bias)

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per row"


class Int4Linear(QuantizedLinear):
    """A Linear whose weight torchao quantized to int4 for the CPU (groups of
    INT4_GROUP_SIZE, packed for torch's kernel), multiplied by that kernel,
    `_weight_int4pack_mm_for_cpu`, called directly: torchao's int4 tensor reaches the same
    call through its tensor-subclass dispatch, ~13 us a layer in an eager step (2.6 ms of a
    one-stream step of the embedded model's 210 layers), and in a compiled step it is
    unwrapped into the graph's inputs on every call. Same products, bit for bit."""

    def __init__(
        self,
        qdata: torch.Tensor,
        scale_and_zero: torch.Tensor,
        group_size: int,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None,
    ):
        super().__init__(in_features, out_features, bias)
        self.group_size = group_size
        self.register_buffer("qdata", qdata)  # packed int4, torch's CPU layout
        self.register_buffer("scale_and_zero", scale_and_zero)  # [K / group, N, 2]

    @classmethod
    def from_quantized(cls, linear: torch.nn.Linear) -> Int4Linear:
        """The layer torchao's PrototypeInt4WeightOnlyConfig left (its weight an
        Int4OpaqueTensor of plain int4 weights: no activation pre-scale)."""
        weight = linear.weight
        if getattr(weight, "act_pre_scale", None) is not None or weight.block_size[0] != 1:
            raise ValueError("expected torchao's groupwise int4 weight, without pre-scale")
        out_features, in_features = weight.shape
        return cls(
            weight.qdata,
            weight.scale_and_zero,
            weight.block_size[1],
            out_features,
            in_features,
            linear.bias,
        )

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, self.qdata, self.group_size, self.scale_and_zero
        )
        return y[:, : self.out_features]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 in groups of {self.group_size}"
        )


def _return_freed_memory() -> None:
    """Hand the wide weights' freed memory back to the system. Quantizing frees the bfloat16
    weights and float32 temporaries, but glibc keeps them in its heap (its mmap threshold
    rises after large frees): measured on the embedded model, RSS stayed 400 MiB above the
    unquantized server's until `malloc_trim`, then fell below it. Other C libraries: no-op."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


def import_torchao_quietly() -> None:
    """Import torchao (if installed) with its import-time noise silenced: it warns about
    optional kernels this machine can't load (its CUDA and mxfp8 libraries on a CPU build of
    torch) and about deprecated pytree registrations, nothing a user can act on.
    transformers' model code imports torchao (and more of its modules) as soon as it is
    installed, so the server calls this before anything else imports either; later imports
    are then silent no-ops."""
    noisy = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in noisy]
    for log in noisy:
        log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao  # noqa: F401
            import transformers.modeling_utils  # noqa: F401 - imports torchao's prototypes
    except ImportError:
        pass  # --quantize then says it is missing
    finally:
        for log, level in zip(noisy, levels, strict=True):
            log.setLevel(level)
