"""Tiny pre-quantized checkpoints, made offline from tiny_model.py's model in a second: the
folder a user downloads, with config.json's `quantization_config` naming the format.

- GPTQ (v1, symmetric, 4 bits) and AWQ (GEMM, 4 bits): round-to-nearest codes packed in each
  format's published layout (the GPTQ algorithm only chooses better codes, in the same
  layout), every decoder Linear layer; lm_head and the embeddings stay dense, as usual.
- bitsandbytes (8-bit, nf4, fp4): bitsandbytes quantizes at load (transformers'
  BitsAndBytesConfig) and the model is saved with save_pretrained.
- compressed-tensors (int8 per channel, int4 packed in groups, fp8 per channel): the
  library's own quantization config, scales and compressor, saved as llm-compressor saves.
- fp8 (transformers' FineGrainedFP8 layout): float8_e4m3fn weights with an inverse scale
  per block.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

GROUP_SIZE = 32
BITS = 4
LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# AWQ's GEMM layout packs the 8 columns of a word in this order
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FP8_BLOCK = 32


def _copy_folder(source: Path, path: Path) -> None:
    shutil.copytree(source, path, ignore=shutil.ignore_patterns("*.safetensors"))


def _write(path: Path, tensors: dict, quantization_config: dict) -> Path:
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _quantized_layers(state: dict) -> list[str]:
    return [k.removesuffix(".weight") for k in state if k.rsplit(".", 2)[-2] in LAYERS]


def _codes(weight: torch.Tensor, zero: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit codes `[out, in]` around `zero` and their scales
    `[out, in / GROUP_SIZE]` (fp16, as both formats store them)."""
    out_features, in_features = weight.shape
    groups = weight.float().view(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    scale = (groups.abs().amax(-1) / (2 ** (BITS - 1) - 1)).clamp(min=1e-8).half()
    codes = torch.round(groups / scale.float().unsqueeze(-1)) + zero
    return codes.clamp(0, 2**BITS - 1).to(torch.int64).view(out_features, in_features), scale


def _pack_rows(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """`[rows, n]` 4-bit values -> `[rows, n / 8]` int32 words, value `order[i]` of each 8
    at bits 4i."""
    groups = values.view(values.shape[0], -1, 8)
    words = torch.zeros(groups.shape[:2], dtype=torch.int64)
    for i, column in enumerate(order):
        words |= groups[..., column] << (BITS * i)
    return words.to(torch.int32)  # wraps the top bit into the sign, as the formats store it


def build_gptq(source: Path, path: Path) -> Path:
    """GPTQ v1: qweight `[in / 8, out]` (8 input rows a word), qzeros `[groups, out / 8]`
    holding zero - 1, scales `[groups, out]`, g_idx `[in]`."""
    _copy_folder(source, path)
    state = load_file(source / "model.safetensors")
    zero = 2 ** (BITS - 1)
    for name in _quantized_layers(state):
        weight = state.pop(f"{name}.weight")
        codes, scale = _codes(weight, zero)
        out_features, in_features = weight.shape
        state[f"{name}.qweight"] = _pack_rows(codes).t().contiguous()
        zeros = torch.full((in_features // GROUP_SIZE, out_features), zero - 1, dtype=torch.int64)
        state[f"{name}.qzeros"] = _pack_rows(zeros)
        state[f"{name}.scales"] = scale.t().contiguous()
        state[f"{name}.g_idx"] = torch.arange(in_features, dtype=torch.int32) // GROUP_SIZE
    return _write(
        path,
        state,
        {
            "quant_method": "gptq",
            "bits": BITS,
            "group_size": GROUP_SIZE,
            "desc_act": False,
            "sym": True,
            "checkpoint_format": "gptq",
        },
    )


def build_awq(source: Path, path: Path) -> Path:
    """AWQ GEMM: qweight `[in, out / 8]` (8 output columns a word, AWQ_ORDER), qzeros
    `[groups, out / 8]` likewise, scales `[groups, out]`."""
    _copy_folder(source, path)
    state = load_file(source / "model.safetensors")
    zero = 2 ** (BITS - 1)
    for name in _quantized_layers(state):
        weight = state.pop(f"{name}.weight")
        codes, scale = _codes(weight, zero)
        out_features, in_features = weight.shape
        state[f"{name}.qweight"] = _pack_rows(codes.t().contiguous(), AWQ_ORDER)
        zeros = torch.full((in_features // GROUP_SIZE, out_features), zero, dtype=torch.int64)
        state[f"{name}.qzeros"] = _pack_rows(zeros, AWQ_ORDER)
        state[f"{name}.scales"] = scale.t().contiguous()
    return _write(
        path,
        state,
        {
            "quant_method": "awq",
            "bits": BITS,
            "group_size": GROUP_SIZE,
            "zero_point": True,
            "version": "gemm",
        },
    )


def build_bitsandbytes(source: Path, path: Path, kind: str) -> Path:
    """kind: "8bit", "nf4" or "fp4"."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    if kind == "8bit":
        config = BitsAndBytesConfig(load_in_8bit=True)
    else:
        config = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_compute_dtype=torch.float32
        )
    model = AutoModelForCausalLM.from_pretrained(
        source, quantization_config=config, dtype=torch.float32
    )
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)
    return path


def build_compressed_tensors(source: Path, path: Path, scheme: str) -> Path:
    """scheme: "int8" (int-quantized, per channel), "int4" (pack-quantized, groups of 32)
    or "fp8" (float-quantized, per channel); weights only, lm_head left out."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bits, kind, fmt, strategy = {
        "int8": (8, "int", "int-quantized", "channel"),
        "int4": (4, "int", "pack-quantized", "group"),
        "fp8": (8, "float", "float-quantized", "channel"),
    }[scheme]
    args = QuantizationArgs(
        num_bits=bits,
        type=kind,
        symmetric=True,
        strategy=strategy,
        group_size=GROUP_SIZE if strategy == "group" else None,
    )
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    apply_quantization_config(
        model,
        QuantizationConfig(
            config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
            ignore=["lm_head"],
            quantization_status=QuantizationStatus.CALIBRATION,
        ),
    )
    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        weight = module.weight.detach()
        if strategy == "group":
            weight = weight.view(weight.shape[0], -1, GROUP_SIZE)
            low, high = weight.amin(-1), weight.amax(-1)
        else:
            low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
        scale, zero = calculate_qparams(low, high, args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)
    return path


def build_fp8(source: Path, path: Path) -> Path:
    """transformers' FineGrainedFP8 layout: `weight` float8_e4m3fn, `weight_scale_inv` one
    float32 per FP8_BLOCK x FP8_BLOCK block (the weight is weight_fp8 * weight_scale_inv)."""
    _copy_folder(source, path)
    state = load_file(source / "model.safetensors")
    largest = torch.finfo(torch.float8_e4m3fn).max
    for name in _quantized_layers(state):
        weight = state[f"{name}.weight"].float()
        out_features, in_features = weight.shape
        blocks = weight.view(
            out_features // FP8_BLOCK, FP8_BLOCK, in_features // FP8_BLOCK, FP8_BLOCK
        )
        scale = (blocks.abs().amax(dim=(1, 3)) / largest).clamp(min=1e-12)
        quantized = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        state[f"{name}.weight"] = quantized.view(out_features, in_features)
        state[f"{name}.weight_scale_inv"] = scale
    return _write(
        path,
        state,
        {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        },
    )
