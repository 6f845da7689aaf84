"""LoRA adapters, read as peft writes them: `adapter_config.json` and
`adapter_model.safetensors`, from a local folder or a Hub repo (huggingface_hub, cached,
HF_HUB_OFFLINE honoured), and checked against the served model before they are served.

An adapter here is plain LoRA: each target layer's output gains `scaling * B @ A @ x`
(scaling = alpha / r, or alpha / sqrt(r) with rsLoRA; per layer with rank_pattern or
alpha_pattern). Variants that change the forward beyond that (DoRA, trained biases,
modules_to_save, ...) are refused by name, as are targets the served model lacks (or
has in other shapes) and ranks above `--max-lora-rank`. A vision-language model's adapter
adapts its language model's layers (named as transformers 5 names them, or as 4 did:
`current_name`); one on its vision tower or projector is refused by name.

`check_adapter_config` needs only the JSON (settings/preflight.py runs it before anything loads);
`read_adapter` then reads the weights with peft's config, casts them to the model's dtype,
folds the scaling into B and slices them as a shard's layers are sliced (lora_layers.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ModelError

if TYPE_CHECKING:
    import torch

    from .lora_layers import LoraLayers

logger = logging.getLogger("textgen.models")

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
# peft's config fields whose non-default values change the forward beyond B @ A: refused
UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "a trained LoRA bias (lora_bias)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "fan_in_fan_out": "Conv1D layers (fan_in_fan_out)",
    "layer_replication": "layer replication",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "target_parameters": "target_parameters",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
}
PEFT_PREFIX = "base_model.model."
# transformers 4's vision-language layout -> 5's (`current_name`): the language model's
# decoder, then the parts its vision side had at the top
LEGACY_PREFIXES = (
    ("language_model.model.", "model.language_model."),
    ("vision_tower.", "model.vision_tower."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
)


class AdapterError(ModelError):
    """An adapter that can't be served: what is wrong with it, naming it."""


@dataclass(eq=False)
class LoraAdapter:
    """One adapter's weights, ready for a slot of the served model's layers (lora_layers.py)."""

    name: str  # what requests call it
    source: str  # as given: a folder or a Hub id
    path: Path  # the local folder it was read from
    rank: int  # the largest rank among its layers
    base_model: str | None  # adapter_config.json's base_model_name_or_path
    # layer name (the served model's) -> (A [r, in], scaling * B transposed [r, out]), in the
    # model's dtype on its device, already sliced to this shard's part of the layer
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    uid: int = 0  # set by the registry (engine/adapters.py): unique for the process's life

    @property
    def target_modules(self) -> list[str]:
        """The short names of the layers it adapts (q_proj, down_proj, ...)."""
        return sorted({name.rsplit(".", 1)[-1] for name in self.layers})


def resolve_adapter(source: str) -> Path:
    """The local folder holding `source`'s adapter: a folder, or a Hub repo's snapshot of
    the two files (downloaded once, then cached)."""
    local = Path(source).expanduser()
    if local.is_dir():
        return local.resolve()
    if local.exists() or source.startswith(("/", "./", "../", "~")) or source.count("/") > 1:
        raise AdapterError("is neither an adapter folder nor a Hub repo id")
    return _hub_snapshot(source)


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    from .hub import hub_cache_dir, hub_offline

    offline = hub_offline()
    try:
        folder = snapshot_download(
            repo_id,
            cache_dir=hub_cache_dir(),
            local_files_only=offline,
            allow_patterns=[CONFIG_NAME, WEIGHTS_NAME],
            token=os.environ.get("HF_TOKEN") or None,
        )
    except HFValidationError as exc:
        raise AdapterError(f"is not a valid Hub repo id: {exc}") from None
    except LocalEntryNotFoundError:
        where = "offline (HF_HUB_OFFLINE=1)" if offline else "the Hub is unreachable"
        raise AdapterError(f"is not in the Hub cache {hub_cache_dir()} and {where}") from None
    except HfHubHTTPError as exc:
        raise AdapterError(f"could not be fetched from the Hub: {exc}") from None
    return Path(folder)


def read_adapter_config(folder: Path) -> dict:
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise AdapterError(f"{folder} has no {CONFIG_NAME}: not a peft adapter")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{path} cannot be read as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path} is not a JSON object")
    return config


def check_adapter_config(config: dict, *, max_rank: int, base_names: tuple[str, ...]) -> int:
    """Refuse what this server can't serve as the adapter's config states it (no weights
    read); -> its largest rank. `base_names`: what the served model is called (its id,
    its folder); empty: not checked."""
    kind = config.get("peft_type")
    if kind != "LORA":
        raise AdapterError(f"is a {kind or 'untyped'} adapter; only LoRA adapters are served")
    unsupported = [what for key, what in UNSUPPORTED_OPTIONS.items() if config.get(key)]
    if config.get("bias", "none") != "none":
        unsupported.append(f"trained biases (bias={config['bias']!r})")
    if unsupported:
        raise AdapterError(f"uses {', '.join(unsupported)}, which textgen doesn't serve")
    ranks = [config.get("r"), *(config.get("rank_pattern") or {}).values()]
    if not all(isinstance(r, int) and r > 0 for r in ranks):
        raise AdapterError(f"states no valid rank (r={config.get('r')!r})")
    rank = max(ranks)
    if rank > max_rank:
        raise AdapterError(f"has rank {rank}, above --max-lora-rank {max_rank}")
    base = config.get("base_model_name_or_path")
    if base and base_names and not same_model(base, base_names):
        raise AdapterError(f"was trained on {base!r}, and this server serves {base_names[0]!r}")
    return rank


def same_model(name: str, base_names: tuple[str, ...]) -> bool:
    """Whether `name` (an adapter's base model) names the served model: its id, its folder,
    or the same last path component (a Hub id and a local copy named after it)."""

    def key(text: str) -> str:
        return str(text).rstrip("/").rsplit("/", 1)[-1].lower()

    return any(name == b or key(name) == key(b) for b in base_names)


def read_adapter(
    name: str, source: str, layers: LoraLayers, *, base_names: tuple[str, ...] = ()
) -> LoraAdapter:
    """Read, check and prepare one adapter for `layers` (the served model's LoRA slots)."""
    try:
        return _read(name, source, layers, base_names)
    except AdapterError as exc:
        raise AdapterError(f"LoRA adapter {name!r} ({source}) {exc}") from None


def _read(name: str, source: str, layers: LoraLayers, base_names: tuple[str, ...]) -> LoraAdapter:
    from peft import LoraConfig
    from peft.utils.other import get_pattern_key
    from safetensors.torch import load_file

    folder = resolve_adapter(source)
    raw = read_adapter_config(folder)
    check_adapter_config(raw, max_rank=layers.max_rank, base_names=base_names)
    weights_path = folder / WEIGHTS_NAME
    if not weights_path.is_file():
        others = sorted(p.name for p in folder.glob("adapter_model*"))
        hint = f" (found {', '.join(others)}: convert it to safetensors)" if others else ""
        raise AdapterError(f"has no {WEIGHTS_NAME}{hint}; only safetensors are loaded")
    config = LoraConfig.from_pretrained(str(folder))
    tensors = load_file(str(weights_path), device="cpu")
    pairs = _pairs(tensors)
    prepared = {}
    for layer, (a, b) in sorted(pairs.items()):
        if not layers.in_scope(layer):
            raise AdapterError(
                f"adapts {layer!r}, outside the language model ({layers.scope}): LoRA on a "
                "vision-language model's vision tower or projector is not served"
            )
        if layer not in layers.layers:
            raise AdapterError(
                f"adapts {layer!r}, which is not a linear layer of the served model's "
                "decoder (LoRA on embeddings and lm_head is not served)"
            )
        rank = a.shape[0]
        if b.shape[1] != rank:
            raise AdapterError(f"{layer}: lora_A has rank {rank} and lora_B {b.shape[1]}")
        if rank > layers.max_rank:
            raise AdapterError(f"{layer} has rank {rank}, above --max-lora-rank {layers.max_rank}")
        alpha_key = get_pattern_key(list(config.alpha_pattern or {}), layer)
        alpha = (config.alpha_pattern or {}).get(alpha_key, config.lora_alpha)
        scaling = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
        prepared[layer] = layers.prepare(layer, a, b, scaling)
    if not prepared:
        raise AdapterError(f"{WEIGHTS_NAME} holds no lora_A/lora_B weights")
    adapter = LoraAdapter(
        name=name,
        source=source,
        path=folder,
        rank=max(a.shape[0] for a, _ in prepared.values()),
        base_model=raw.get("base_model_name_or_path"),
        layers=prepared,
    )
    logger.info(
        "LoRA adapter %s from %s: rank %d on %d layers (%s)",
        name,
        source,
        adapter.rank,
        len(prepared),
        ", ".join(adapter.target_modules),
    )
    return adapter


def current_name(layer: str) -> str:
    """A layer's name in the model as transformers 5 builds it: a vision-language model's
    adapter trained on transformers 4's layout (`language_model.model.layers...`,
    `vision_tower...`, `multi_modal_projector...` at the top) renamed as its checkpoint is
    (`model.language_model.layers...`, `model.vision_tower...`)."""
    for old, new in LEGACY_PREFIXES:
        if layer.startswith(old):
            return new + layer.removeprefix(old)
    return layer


def _pairs(tensors: dict) -> dict[str, tuple]:
    """peft's keys (`base_model.model.<layer>.lora_A.weight`, ...) -> {layer: (A, B)}."""
    found: dict[str, dict[str, object]] = {}
    for key, tensor in tensors.items():
        stem = current_name(key.removeprefix(PEFT_PREFIX))
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if stem.endswith(suffix):
                found.setdefault(stem.removesuffix(suffix), {})[part] = tensor
                break
        else:
            raise AdapterError(f"holds {key!r}, which is not a LoRA weight textgen serves")
    pairs = {}
    for layer, parts in found.items():
        if set(parts) != {"lora_A", "lora_B"}:
            raise AdapterError(f"{layer} has only {', '.join(parts)}")
        pairs[layer] = (parts["lora_A"], parts["lora_B"])
    return pairs
