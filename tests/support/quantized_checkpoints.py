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
- MXFP4 (gpt-oss as OpenAI publishes it): a tiny random gpt-oss whose MoE experts are stored
  as packed FP4 (E2M1) blocks and one E8M0 scale per 32 values, everything else dense.
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
# MXFP4: 32 values share a power-of-two scale (a biased E8M0 exponent byte); each value is a
# 4-bit E2M1 code, two a byte, the even value in the low nibble (transformers' FP4_VALUES:
# code = sign << 3 | magnitude index)
MXFP4_BLOCK = 32
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0_BIAS = 127
# the published gpt-oss config's: attention, router, embeddings and lm_head stay dense
MXFP4_NOT_CONVERTED = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]


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


def build_gpt_oss(path: Path, *, seed: int = 4) -> Path:
    """A tiny random dense gpt-oss (float32; as tests/engine/test_families.py's tiny_gpt_oss:
    attention sinks, sliding and full layers alternating, 4 experts, 2 a token) and
    tiny_model.py's tokenizer, saved as a Hugging Face folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    config = AutoConfig.for_model(
        "gpt_oss",
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=12,
        max_position_embeddings=1024,
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # sinks large enough to take a real share of each row
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def mxfp4_pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[..., n]` -> (blocks `[..., n / 32, 16]` uint8, scales `[..., n / 32]` uint8): each
    32 values scaled by the smallest power of two that brings their largest within E2M1's 6,
    rounded to the nearest E2M1 value."""
    groups = weight.float().unflatten(-1, (-1, MXFP4_BLOCK))
    largest = groups.abs().amax(-1)
    exponent = torch.ceil(torch.log2(largest / E2M1_MAGNITUDES[-1]))
    exponent = torch.where(largest > 0, exponent, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    magnitudes = torch.tensor(E2M1_MAGNITUDES)
    index = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1)
    codes = index | ((scaled < 0) & (index > 0)).long() << 3
    blocks = codes[..., 0::2] | codes[..., 1::2] << 4
    return blocks.to(torch.uint8), (exponent + E8M0_BIAS).to(torch.uint8)


def mxfp4_unpack(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """mxfp4_pack's inverse, float32 `[..., n]` (what the checkpoint holds, exactly)."""
    values = torch.tensor([*E2M1_MAGNITUDES, *(-m for m in E2M1_MAGNITUDES)])
    codes = torch.stack([blocks & 0x0F, blocks >> 4], -1).flatten(-2).long()
    exponent = scales.float() - E8M0_BIAS
    return (values[codes] * torch.exp2(exponent).unsqueeze(-1)).flatten(-2)


def build_mxfp4(source: Path, path: Path) -> Path:
    """gpt-oss's published MXFP4 layout, from a dense gpt-oss folder (build_gpt_oss): each
    layer's `mlp.experts.{gate_up,down}_proj` `[experts, in, out]` become `{name}_blocks`
    `[experts, out, in / 32, 16]` and `{name}_scales` `[experts, out, in / 32]` (blocks of
    32 along the input dimension); their biases and every other tensor stay dense."""
    _copy_folder(source, path)
    state = load_file(source / "model.safetensors")
    for name in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weight = state.pop(name)
        state[f"{name}_blocks"], state[f"{name}_scales"] = mxfp4_pack(weight.transpose(1, 2))
    return _write(
        path,
        state,
        {"quant_method": "mxfp4", "modules_to_not_convert": MXFP4_NOT_CONVERTED},
    )


def mxfp4_experts(path: Path) -> dict[str, torch.Tensor]:
    """The expert weights an MXFP4 folder holds, unpacked to float32 in the dense layout."""
    state = load_file(path / "model.safetensors")
    return {
        name.removesuffix("_blocks"): mxfp4_unpack(
            blocks, state[name.replace("_blocks", "_scales")]
        ).transpose(1, 2)
        for name, blocks in state.items()
        if name.endswith("_blocks")
    }
