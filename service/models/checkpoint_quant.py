"""TGI's --quantize names for the formats that quantization libraries own, loaded through
transformers' quantizers: checkpoints that arrive quantized (config.json's
`quantization_config`) and bitsandbytes/EETQ quantizing a dense checkpoint as it loads.
quantize.py keeps torchao's load-time int8/int4/fp8.

Where each runs, as found here (transformers 5.24, torch 2.13; docs/quantization.md):

| --quantize | checkpoint | CPU | CUDA | library |
| --- | --- | --- | --- | --- |
| gptq | GPTQ | gptqmodel's torch kernel (bf16) | yes | gptqmodel, optimum |
| awq | AWQ | gptqmodel's torch kernel (bf16) | yes | gptqmodel |
| marlin | GPTQ or AWQ | refused: a CUDA kernel | capability 8.0+ | gptqmodel |
| bitsandbytes(-nf4, -fp4) | any, or bitsandbytes | yes | yes | bitsandbytes |
| compressed-tensors | compressed-tensors | loads decompressed | fp8 on 8.9+ | compressed-tensors |
| fp8 | FP8 (block scales) | loads dequantized | capability 8.9+ | transformers |
| (none) | MXFP4 (gpt-oss) | loads dequantized | kernels*, else dequantized | transformers |
| eetq | any | refused: a CUDA kernel | yes | eetq |
| exl2 | EXL2 | refused: transformers has no EXL2 loader | refused | |

*transformers' Triton MXFP4 kernels (fetched from the Hub by the `kernels` package) when
transformers finds what they need (capability 7.5+, triton 3.4+, a `kernels` version it
takes) and the model computes in bfloat16; otherwise dequantized, the log saying why.

"Loads decompressed": the library has no CPU kernel for the format, so transformers widens
the weights to the compute dtype at load: the model computes with the checkpoint's rounded
weights (the same outputs), but in a dense model's memory. The startup log says so.

A checkpoint's format decides: --quantize may name it (or `marlin`, a GPTQ/AWQ kernel), and
any other value is refused. TGI's --quantize has no name for MXFP4 (gpt-oss as published),
so with such a checkpoint it is left out. Sharding a quantized checkpoint is refused (the
tensor-parallel plan slices dense weights, not packed ones).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

from .errors import ModelError

logger = logging.getLogger("textgen.models")

BITSANDBYTES = ("bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4")
# checkpoints that arrive quantized (by TGI's --quantize name, where it has one), and the
# --quantize values of libraries that quantize at load
CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors", "fp8", "mxfp4", *BITSANDBYTES, "exl2")
# formats --quantize has no value for (TGI's names none): the checkpoint alone says them
UNNAMED_METHODS = ("mxfp4",)
LOAD_TIME_METHODS = (*BITSANDBYTES, "eetq")
LIBRARY_METHODS = ("gptq", "awq", "compressed-tensors", *BITSANDBYTES, "eetq", "marlin", "exl2")
# the packages each format needs (import name, pip name)
PACKAGES = {
    "gptq": (("gptqmodel", "gptqmodel"), ("optimum", "optimum")),
    "awq": (("gptqmodel", "gptqmodel"),),
    "marlin": (("gptqmodel", "gptqmodel"),),
    "compressed-tensors": (("compressed_tensors", "compressed-tensors"),),
    "eetq": (("eetq", "eetq"),),
    **{name: (("bitsandbytes", "bitsandbytes"),) for name in BITSANDBYTES},
}
MARLIN_MIN_CAPABILITY = (8, 0)
FP8_MIN_CAPABILITY = (8, 9)
# what transformers' MXFP4 (Triton) kernels take on CUDA (quantizer_mxfp4.validate_environment)
MXFP4_MIN_CAPABILITY = (7, 5)
MXFP4_MIN_TRITON = "3.4.0"
EXL2_REASON = (
    "EXL2 checkpoints run on exllamav2's own runtime, and transformers has no loader for "
    "them: convert the model to GPTQ or AWQ"
)


class CheckpointQuantizationError(ModelError):
    """The checkpoint's format, or --quantize against it or this device, can't run here."""


@dataclass(frozen=True)
class LibraryQuantization:
    """How to load a model with a library's quantization."""

    method: str  # TGI's name of what runs (reported in /info as `quantize`)
    prequantized: bool  # the checkpoint arrived quantized (else the library quantizes at load)
    dtype: torch.dtype  # the compute dtype
    # what from_pretrained takes as quantization_config: a load-time quantizer's config,
    # or overrides of a checkpoint's (the Marlin backend, MXFP4's dequantize); None: the
    # checkpoint's own
    load_config: object | None = None
    # why the checkpoint's weights are widened at load where a kernel exists elsewhere
    widened: str | None = None


def checkpoint_method(config: dict) -> str | None:
    """TGI's name for config.json's `quantization_config` (None: a dense checkpoint)."""
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get(
        "quantization_config"
    )
    if not quant:
        return None
    kind = str(quant.get("quant_method", "")).lower()
    if kind == "bitsandbytes":
        if quant.get("load_in_8bit"):
            return "bitsandbytes"
        return f"bitsandbytes-{quant.get('bnb_4bit_quant_type', 'fp4')}"
    if kind in ("gptq", "awq", "compressed-tensors", "fp8", "mxfp4", "exl2"):
        return kind
    raise CheckpointQuantizationError(
        f"the checkpoint is quantized with {kind or 'an unnamed method'!r} (config.json's "
        f"quantization_config), which textgen does not load; it loads "
        f"{', '.join(CHECKPOINT_METHODS[:-1])}"
    )


def plan(
    method: str | None,
    checkpoint: str | None,
    device: torch.device,
    dtype: torch.dtype,
    dtype_flag: str,
) -> LibraryQuantization | None:
    """What to load for --quantize `method` on a checkpoint of format `checkpoint` (None:
    dense), or None when no library quantization applies (a dense checkpoint with no
    --quantize, or one of quantize.py's torchao methods). Raises the reason it can't run."""
    if "exl2" in (method, checkpoint):
        raise CheckpointQuantizationError(EXL2_REASON)
    if checkpoint is not None:
        return _prequantized(method, checkpoint, device, dtype, dtype_flag)
    if method not in LIBRARY_METHODS:
        return None
    if method not in LOAD_TIME_METHODS:
        raise CheckpointQuantizationError(
            f"--quantize {method} loads checkpoints quantized in that format, and this one's "
            "config.json has no quantization_config; the libraries that quantize a dense "
            f"checkpoint as it loads are {', '.join(LOAD_TIME_METHODS)} (and int8, int4, fp8)"
        )
    _check_device(method, device)
    _check_packages(method)
    return LibraryQuantization(method, False, dtype, _load_time_config(method, dtype))


def _prequantized(
    method: str | None, checkpoint: str, device: torch.device, dtype: torch.dtype, flag: str
) -> LibraryQuantization:
    kernel = checkpoint
    if method == "marlin" and checkpoint in ("gptq", "awq"):
        kernel = "marlin"
    elif method == "bitsandbytes" and checkpoint in BITSANDBYTES:
        pass  # TGI's bitsandbytes names the library; the checkpoint says which of its types
    elif method not in (None, checkpoint):
        fix = (
            f"leave it out (its format applies; --quantize has no {checkpoint} value)"
            if checkpoint in UNNAMED_METHODS
            else f"pass --quantize {checkpoint} or leave it out"
        )
        raise CheckpointQuantizationError(
            f"the checkpoint is already quantized ({checkpoint}: config.json's "
            f"quantization_config), so --quantize {method} can't apply; {fix}"
        )
    _check_device(kernel, device)
    _check_packages(kernel)
    compute = _compute_dtype(kernel, device, dtype, flag)
    if kernel == "mxfp4":
        # dequantize said either way: transformers' own fallback reads the current
        # accelerator, not the device this loads on, and says "bf16" whatever the dtype
        widened = _mxfp4_not_kernels(device, compute)
        return LibraryQuantization(kernel, True, compute, {"dequantize": bool(widened)}, widened)
    load_config = {"backend": "marlin"} if kernel == "marlin" else None
    return LibraryQuantization(kernel, True, compute, load_config)


def _mxfp4_not_kernels(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why transformers' MXFP4 kernels can't run the experts here (None: they can)."""
    if device.type != "cuda":
        return "no CPU kernel for MXFP4 here"  # (transformers' needs triton's CPU backend)
    capability = torch.cuda.get_device_capability(device)
    if capability < MXFP4_MIN_CAPABILITY:
        return (
            f"transformers' MXFP4 kernels need compute capability 7.5+, {device} is "
            f"{capability[0]}.{capability[1]}"
        )
    if dtype is not torch.bfloat16:
        return "transformers' MXFP4 kernels compute in bfloat16 (--dtype bfloat16 or auto)"
    from transformers.utils import is_kernels_available, is_triton_available
    from transformers.utils.import_utils import KERNELS_MAX_VERSION, KERNELS_MIN_VERSION

    if not is_triton_available(MXFP4_MIN_TRITON):
        return f"transformers' MXFP4 kernels need triton {MXFP4_MIN_TRITON}+"
    if not is_kernels_available():
        return (
            "transformers' MXFP4 kernels need the kernels package, "
            f"{KERNELS_MIN_VERSION} <= version < {KERNELS_MAX_VERSION}"
        )
    return None


def _check_device(method: str, device: torch.device) -> None:
    if device.type not in ("cpu", "cuda"):
        raise CheckpointQuantizationError(
            f"--quantize {method} runs on cpu and cuda devices, not {device.type}"
        )
    if device.type == "cpu" and method in ("marlin", "eetq"):
        name = {"marlin": "Marlin", "eetq": "EETQ"}[method]
        raise CheckpointQuantizationError(
            f"--quantize {method}: {name}'s kernels run on CUDA GPUs only; on CPU use "
            + ("--quantize gptq or awq (the checkpoint's own format)" if method == "marlin"
               else "--quantize bitsandbytes or int8")
        )  # fmt: skip
    if device.type == "cuda" and method == "marlin":
        capability = torch.cuda.get_device_capability(device)
        if capability < MARLIN_MIN_CAPABILITY:
            raise CheckpointQuantizationError(
                f"--quantize marlin needs a GPU of compute capability 8.0+; {device} is "
                f"{capability[0]}.{capability[1]}"
            )


def _check_packages(method: str) -> None:
    for module, package in PACKAGES.get(method, ()):
        if importlib.util.find_spec(module) is None:
            raise CheckpointQuantizationError(
                f"--quantize {method} needs the {package} package, which is not installed "
                f"(pip install {package})"
            )


def _compute_dtype(method: str, device: torch.device, dtype: torch.dtype, flag: str) -> torch.dtype:
    """gptqmodel's CPU kernels take float16/bfloat16 activations only: bfloat16 there
    ("auto" may change to it, a named float32 may not)."""
    if device.type != "cpu" or method not in ("gptq", "awq") or dtype is not torch.float32:
        return dtype
    if isinstance(flag, str) and flag.strip().lower() == "auto":
        return torch.bfloat16
    raise CheckpointQuantizationError(
        f"--quantize {method} on CPU computes in bfloat16 (gptqmodel's CPU kernels have no "
        "float32 path); use --dtype bfloat16 or auto"
    )


def _load_time_config(method: str, dtype: torch.dtype):
    """transformers' config for a library that quantizes a dense checkpoint as it loads."""
    from transformers import BitsAndBytesConfig, EetqConfig

    if method == "bitsandbytes":
        return BitsAndBytesConfig(load_in_8bit=True)
    if method in BITSANDBYTES:
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=method.removeprefix("bitsandbytes-"),
            bnb_4bit_compute_dtype=dtype,
        )
    return EetqConfig("int8")


def finish_loading(model: torch.nn.Module, quant: LibraryQuantization) -> None:
    """After from_pretrained: widen now what the library would widen at the first forward
    (compressed-tensors' decompression hook), so that the memory the KV pool is sized from
    is the served model's; say what runs."""
    hook = getattr(model, "ct_decompress_hook", None)
    if hook is not None:
        model.hf_quantizer.compressor.decompress_model(model)
    if quant.method == "bitsandbytes":
        # its 8-bit matmul logs a warning at every call whose input isn't float16
        logging.getLogger("bitsandbytes.autograd._functions").addFilter(_Once("will be cast"))
    kinds = sorted({type(m).__name__ for m in model.modules() if _holds_quantized(m)})
    if not kinds:
        device = "CPU" if next(model.parameters()).device.type == "cpu" else "GPU"
        logger.warning(
            "%s checkpoint: %s, its weights were widened to %s at load (same outputs, a "
            "dense model's memory)",
            quant.method,
            quant.widened or f"no {device} kernel for its format here",
            str(quant.dtype).removeprefix("torch."),
        )
    else:
        logger.info(
            "%s %s: layers %s",
            quant.method,
            "checkpoint" if quant.prequantized else "quantized at load",
            ", ".join(kinds),
        )


def stays_quantized(model: torch.nn.Module) -> bool:
    """Whether some layer still holds quantized weights (False: the library widened them)."""
    return any(_holds_quantized(m) for m in model.modules())


# what quantized weights are stored as: packed ints, int8, uint8 (bitsandbytes' 4-bit), fp8
_QUANTIZED_DTYPES = (torch.int32, torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)


def _holds_quantized(module: torch.nn.Module) -> bool:
    """A layer whose own weights are stored quantized (transformers' MXFP4 experts hold
    theirs as Triton tensors, neither parameters nor buffers, with a precision config)."""
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    if any(t.dtype in _QUANTIZED_DTYPES and t.dim() >= 2 for t in tensors):
        return True
    return getattr(module, "gate_up_proj_precision_config", None) is not None


class _Once(logging.Filter):
    """Lets the first record containing `text` through, drops the later ones."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text, self.seen = text, False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.text not in record.getMessage():
            return True
        seen, self.seen = self.seen, True
        return not seen
