"""Load the resolved model: pick device and dtype, then model and tokenizer.

dtype "auto": bfloat16 where the hardware computes it natively (CUDA with bf16
support, x86 CPUs with AVX512_BF16 or AMX_BF16, Arm CPUs with the BF16 extension),
float16 on older CUDA GPUs, float32 otherwise: emulated bf16 on a CPU is slower
than float32 and halves nothing but memory.

float16 on a CPU falls back to float32 with a warning rather than failing: CPUs
have no native fp16 matmul, and fp16's narrow range overflows in some models'
activations, while the user's intent (a working server) is still met.
"""

from __future__ import annotations

import functools
import logging
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .architectures import is_image_family
from .attention_adapters import plain_linears
from .checkpoint_quant import LibraryQuantization, finish_loading
from .cpuinfo import cpuinfo_flags
from .errors import ModelError
from .fused_norms import fuse_rms_norms
from .hub import NO_CONTEXT, ResolvedModel, config_json, resolve_model, stated_context
from .processors import load_processor
from .quantize import QuantizationError, quantize_model, resolve_quantization
from .shard_layout import ShardLayout, shard_layout
from .sharding import (
    VocabSlice,
    install_collectives,
    language_model,
    localize,
    lora_slices,
    tp_plan_overrides,
)
from .small_steps import SMALL_STEP_ROWS, add_small_step_weights, small_step_rows

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from .lora_layers import LoraLayers

logger = logging.getLogger("textgen.models")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def select_device(device: str = "auto") -> torch.device:
    """ "auto": cuda when available, else cpu. Anything else is parsed by torch and
    checked to exist, so a typo fails at startup rather than at the first request."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelError(f"unknown device {device!r}: {exc}") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelError(f"device {device!r} requested but CUDA is not available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ModelError(f"device {device!r} does not exist ({torch.cuda.device_count()} GPUs)")
    elif dev.type not in ("cpu", "mps", "xpu"):
        raise ModelError(f"unsupported device {device!r}")
    return dev


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 in hardware (read once from /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            info = f.read()
    except OSError:
        return False  # not Linux (or no procfs): be conservative
    return cpuinfo_has_bf16(info, platform.machine())


def cpuinfo_has_bf16(cpuinfo: str, machine: str) -> bool:
    """x86: the `avx512_bf16` or `amx_bf16` flag; Arm: the `bf16` feature."""
    machine = machine.lower()
    if machine in ("x86_64", "amd64", "i686", "i386"):
        return bool(cpuinfo_flags(cpuinfo) & {"avx512_bf16", "amx_bf16"})
    if machine in ("aarch64", "arm64"):
        return "bf16" in cpuinfo_flags(cpuinfo, "features")
    return False


def select_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """Map the --dtype flag to a torch dtype for `device` (see module docstring)."""
    if isinstance(dtype, torch.dtype):  # tolerated: callers holding a dtype already
        name = str(dtype).removeprefix("torch.")
    else:
        name = dtype.strip().lower()
    if name == "auto":
        if device.type == "cuda":
            # native only (Ampere+): pre-Ampere GPUs emulate bf16, slower than fp16
            native = torch.cuda.is_bf16_supported(including_emulation=False)
            return torch.bfloat16 if native else torch.float16
        if device.type == "cpu":
            return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        return torch.float16 if device.type == "mps" else torch.float32
    if name not in _DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    chosen = _DTYPES[name]
    if chosen is torch.float16 and device.type == "cpu":
        logger.warning("dtype float16 is not supported on CPU; using float32 instead")
        return torch.float32
    if chosen is torch.bfloat16 and device.type == "cpu" and not cpu_has_native_bf16():
        logger.info("bfloat16 requested on a CPU without native bf16: it works, but emulated")
    return chosen


def auto_dtype_reason(loaded: LoadedModel) -> str:
    """Why --dtype auto gave `loaded` its dtype, in a phrase (/info, the startup line)."""
    name = str(loaded.dtype).removeprefix("torch.")
    if loaded.quantize:
        return f"{name}: what --quantize {loaded.quantize} computes in on {loaded.device.type}"
    if loaded.device.type == "cuda":
        return f"{name}: " + ("native on this GPU" if name == "bfloat16" else "no native bf16")
    if loaded.device.type != "cpu":
        return f"{name}: the default on {loaded.device.type}"
    if name == "bfloat16":
        reason = "bfloat16: this CPU computes bf16 natively (avx512_bf16, amx_bf16 or Arm bf16)"
    else:
        reason = "float32: this CPU has no native bf16 (emulated bfloat16 is slower)"
    if loaded.small_step_rows:
        reason += f"; steps of up to {loaded.small_step_rows} tokens read int8 weight copies"
    return reason


@dataclass(frozen=True)
class ModelShard:
    """Load one rank's slice of the model (sharding.py); the process group is up."""

    rank: int
    world_size: int
    group: object  # torch.distributed.ProcessGroup of the model's collectives


@dataclass(frozen=True)
class LoadOptions:
    """Where the model's files come from and what is changed in them as they load."""

    hub_cache: str | None = None  # --huggingface-hub-cache
    folder: str | None = None  # --weights-cache-override: the files are read from there
    trust_remote_code: bool = False  # run the code the config's auto_map names
    rope: tuple[str, float] | None = None  # (linear | dynamic, factor): RoPE rescaled
    chat_template: str | dict | None = None  # replaces the tokenizer's (--tokenizer-config-path)
    # the context of a model whose config states none (Bloom, Mamba): the one the settings
    # chose (Settings.context_length: --max-total-tokens); a config's own always wins
    context: int | None = None
    # where --dtype auto chose float32 or bfloat16 on a CPU, give small steps int8 weight
    # copies (small_steps.py); the assembly says no where a setting needs the weights as
    # loaded
    small_step_int8: bool = False
    # False (--disable-custom-kernels): CPU int4 and int8 layers (and the small steps' int8
    # copies) keep torch's kernels (avx512_bf16.py)
    custom_kernels: bool = True


@dataclass(frozen=True)
class LoraSetup:
    """LoRA slots to give the model's layers (lora_layers.py)."""

    num_slots: int  # --max-loras
    max_rank: int  # --max-lora-rank


@dataclass
class LoadedModel:
    resolved: ResolvedModel
    model: PreTrainedModel  # eval mode, on device, in dtype
    tokenizer: PreTrainedTokenizerBase
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: frozenset[int]  # every EOS id the generation_config (and tokenizer) names
    max_position_embeddings: int
    quantize: str | None = None  # --quantize applied to the weights; None: as loaded
    shard: ModelShard | None = None  # this process holds one rank's slice of the model
    shard_layout: ShardLayout | None = None  # how its attention splits (sharded only)
    vocab: VocabSlice | None = None  # the vocabulary rows its lm_head projects (sharded)
    lora: LoraLayers | None = None  # its layers' LoRA slots (--max-loras > 0)
    # a vision-language model's processor (its image processor and placeholder tokens);
    # None: a text model
    processor: object | None = None
    # steps of up to this many rows read int8 copies of the Linear weights (small_steps.py);
    # 0: every step reads the weights as loaded
    small_step_rows: int = 0


def load_model(
    model_id: str | None,
    revision: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    cache_dir: Path | None = None,
    quantize: str | None = None,
    shard: ModelShard | None = None,
    options: LoadOptions = LoadOptions(),
    lora: LoraSetup | None = None,
) -> LoadedModel:
    """Resolve, then load model and tokenizer ready for inference; `quantize` (int8, int4,
    fp8) converts the Linear layers' weights after loading (quantize.py), or names a
    library's format (checkpoint_quant.py: a checkpoint that arrives quantized loads in its
    format either way); `shard` loads one rank's slice of a tensor-parallel model
    (sharding.py); `options` says where the files come from and what changes as they load;
    `lora` wraps its decoder's linear layers in LoRA slots (lora_layers.py), inside the
    shards' all-reduces (a vision-language model's language model's only)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    dev = select_device(device)  # validate flags before any download or conversion
    # config.json alone: its quantization_config
    _, own_config = config_json(
        model_id, revision, hub_cache=options.hub_cache, folder=options.folder
    )
    dt, library = resolve_quantization(quantize, own_config, dev, dtype, select_dtype(dtype, dev))
    images = is_image_family(own_config)
    if library is not None and shard is not None:
        raise QuantizationError(
            f"{library.method} weights can't be sharded: the tensor-parallel plan slices dense "
            "weights, not a quantization library's packed ones; serve it with --num-shard 1"
        )
    resolved = resolve_model(
        model_id,
        revision=revision,
        cache_dir=cache_dir,
        hub_cache=options.hub_cache,
        folder=options.folder,
        remote_code=options.trust_remote_code,
    )

    started = time.monotonic()
    # local_files_only: the folder is already complete; nothing may reach the network here.
    tokenizer = AutoTokenizer.from_pretrained(
        resolved.path, local_files_only=True, trust_remote_code=options.trust_remote_code
    )
    processor = _processor(resolved.path, options, own_config.get("model_type")) if images else None
    if options.chat_template is not None:
        tokenizer.chat_template = options.chat_template
    elif processor is not None and tokenizer.chat_template is None:
        tokenizer.chat_template = getattr(processor, "chat_template", None)
    config = _config(resolved, options)
    layout = None
    linears = plain_linears(config.model_type, bool(library or quantize or lora))
    if shard is None:
        with linears:
            model_class = AutoModelForImageTextToText if images else AutoModelForCausalLM
            model = model_class.from_pretrained(
                resolved.path,
                config=config,
                dtype=dt,
                use_safetensors=True,  # never unpickle
                local_files_only=True,
                trust_remote_code=options.trust_remote_code,
                # load straight onto the device (no CPU copy first on a GPU)
                device_map=dev if dev.type != "cpu" else None,
                **_quantization_kwargs(library, resolved.path),
            )
    else:
        with linears:
            model, layout = _load_slice(resolved.path, config, dt, dev, shard, images)
    if dev.type == "cpu" and library is None:  # (quantized models refuse .to())
        model.to(dev)
    model.eval()
    params = sum(p.numel() for p in model.parameters())  # before quantizing repacks them
    if library is not None:
        finish_loading(model, library)
        quantize = library.method
    elif quantize is not None:
        quantize_model(model, quantize, dev, options.custom_kernels)
    if options.small_step_int8 and not (quantize or lora or shard) and _small_step_cpu(dev, dt):
        add_small_step_weights(model, custom_kernels=options.custom_kernels)
    copied_rows = small_step_rows(model)
    # bfloat16 RMSNorm in one call (where the CPU has AVX512-BF16) beside auto's int8
    # copies or quantized weights; a named --dtype bfloat16 keeps transformers' forward
    bf16_cpu = dev.type == "cpu" and dt == torch.bfloat16
    if options.custom_kernels and bf16_cpu and (copied_rows or quantize):
        fuse_rms_norms(model)
    lora_layers = None
    if lora is not None:
        from .lora_layers import LoraLayers

        slices = lora_slices(model, shard.rank, shard.world_size, layout) if shard else None
        scope = language_model(model) if images else None
        lora_layers = LoraLayers(model, lora.num_slots, lora.max_rank, dt, dev, slices, scope)
    vocab = None
    if shard is not None:
        vocab = install_collectives(model, shard.group, shard.rank, shard.world_size)
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token  # batching pads; some tokenizers name no pad

    eos = eos_token_ids(model, tokenizer)
    if not eos:
        raise ModelError(f"{resolved.model_id} names no EOS token (generation_config or tokenizer)")
    max_pos = served_context(model.config.get_text_config().to_dict(), options)
    logger.info(
        "loaded %s (%s) on %s as %s%s%s in %.1f s: %.0fM params, context %d, eos %s",
        resolved.model_id,
        resolved.sha or resolved.path,
        dev,
        str(dt).removeprefix("torch."),
        f", weights {quantize}" if quantize else "",
        f", int8 copies for steps of <= {copied_rows} rows" if copied_rows else "",
        time.monotonic() - started,
        params / 1e6,
        max_pos,
        sorted(eos),
    )
    return LoadedModel(
        resolved=resolved,
        model=model,
        tokenizer=tokenizer,
        dtype=dt,
        device=dev,
        eos_token_ids=eos,
        max_position_embeddings=max_pos,
        quantize=quantize,
        shard=shard,
        shard_layout=layout,
        vocab=vocab,
        lora=lora_layers,
        processor=processor,
        small_step_rows=copied_rows,
    )


def _small_step_cpu(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in SMALL_STEP_ROWS


def _processor(path: Path, options: LoadOptions, model_type: str | None = None):
    """A vision-language model's processor, from the folder's own files; the family's
    class without its video processor where that needs torchvision (processors.py)."""
    kwargs = {"local_files_only": True, "trust_remote_code": options.trust_remote_code}
    try:
        return load_processor(path, model_type, **kwargs)
    except (OSError, ValueError, ImportError) as exc:
        raise ModelError(f"cannot load the image processor of {path}: {exc}") from exc


def served_context(config: dict, options: LoadOptions) -> int:
    """The context the loaded model serves: its config's, stretched by the RoPE factor
    (what the rescaled positions reach), else the one `options` was given (the settings',
    where the config states none); ModelError where neither says one."""
    stated = stated_context(config)
    if stated is None:
        if options.context is None:
            raise ModelError(NO_CONTEXT)
        return options.context
    if options.rope is not None and options.rope[1] > 1:
        return int(stated * options.rope[1])
    return stated


def _config(resolved: ResolvedModel, options: LoadOptions):
    """The model's config, its RoPE rescaled as `options.rope` says (TGI's --rope-scaling
    and --rope-factor: the type and factor replace the model's own scaling)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(
        resolved.path, local_files_only=True, trust_remote_code=options.trust_remote_code
    )
    if options.rope is None:
        return config
    text = config.get_text_config()
    current = getattr(text, "rope_parameters", None)
    if not isinstance(current, dict) or "rope_theta" not in current:
        raise ModelError(
            f"--rope-scaling: {resolved.model_id} has no rotary position embeddings to rescale"
        )
    kind, factor = options.rope
    text.rope_parameters = {
        "rope_theta": current["rope_theta"],
        "rope_type": kind,
        "factor": factor,
    }
    return config


def _quantization_kwargs(library: LibraryQuantization | None, path: Path) -> dict:
    """from_pretrained's quantization_config: a load-time quantizer's, or the checkpoint's
    own with our overrides (the Marlin backend); none when the checkpoint's applies as is."""
    if library is None or library.load_config is None:
        return {}
    if not isinstance(library.load_config, dict):
        return {"quantization_config": library.load_config}
    from transformers import AutoConfig
    from transformers.quantizers import AutoQuantizationConfig

    own = AutoConfig.from_pretrained(path, local_files_only=True).quantization_config
    merged = {**(own if isinstance(own, dict) else own.to_dict()), **library.load_config}
    return {"quantization_config": AutoQuantizationConfig.from_dict(merged)}


def _load_slice(
    path: Path, config, dtype: torch.dtype, device: torch.device, shard: ModelShard, images: bool
):
    """One rank's slice, read by transformers' tensor-parallel loader, made plain
    (sharding.py); the plan is checked before any weight is read. A vision-language
    model's plan splits its language model only: the vision tower and projector load
    whole on every rank, which encodes its steps' images itself."""
    import json

    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.distributed import DistributedConfig

    layout = shard_layout(json.loads((path / "config.json").read_text()), shard.world_size)
    auto = AutoModelForImageTextToText if images else AutoModelForCausalLM
    model_class = auto._model_mapping[type(config)]
    overrides = tp_plan_overrides(model_class, config, layout)
    model = auto.from_pretrained(
        path,
        config=config,
        dtype=dtype,
        use_safetensors=True,
        local_files_only=True,
        distributed_config=DistributedConfig(tp_size=shard.world_size, tp_plan=overrides or None),
    )
    localize(model, shard.rank, layout)
    model.to(device)
    return model, layout


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    """Union of the EOS ids in generation_config, model config and tokenizer.

    Chat models often stop on a turn-end token that only generation_config lists
    (Llama 3: <|eot_id|> next to <|end_of_text|>), so one source is not enough.
    """
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config.get_text_config()):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value if v is not None)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
