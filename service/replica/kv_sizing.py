"""How many tokens the KV pool holds: --max-batch-total-tokens, or a share of the memory
free once the weights are loaded, in the pool's dtype; never less than one request of
--max-total-tokens. A hybrid model's state pool (a slot per sequence of --max-batch-size:
engine/state_pool.py) comes out of the same share first, and its KV pool holds only its
attention layers."""

from __future__ import annotations

import torch

from ..engine.kv_pool import KV_CACHE_DTYPES
from ..models import LoadedModel, attention_adapters
from ..models.state_layers import (
    attention_layer_count,
    has_state_layers,
    probe_states,
    state_bytes_per_sequence,
)
from ..settings.preflight import check_kv_capacity
from ..settings.table import DEFAULT_MAX_TOTAL_TOKENS, SettingError, Settings

# Share of free memory the KV cache takes when --max-batch-total-tokens is unset: most
# of what a GPU has left after the weights; on CPU a tenth of free RAM, since the pool
# is zero-filled up front and shares the machine with everything else.
KV_MEMORY_FRACTION = {"cuda": 0.85, "cpu": 0.1}
KV_BLOCK_SIZE = 16


def kv_bytes_per_token(
    model: torch.nn.Module, dtype: torch.dtype, kv_heads: int | None = None
) -> int:
    """KV-cache bytes one token takes in this process's pool (`kv_heads`: a shard's own),
    summed over the layers: a heterogeneous config (Gemma 4's) gives each layer its own
    head size."""
    cfg = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    if getattr(cfg, "is_heterogeneous", False):
        layers = list(cfg.per_layer_config)
    elif has_state_layers(model):  # a hybrid: only its attention layers hold K/V
        layers = [cfg] * attention_layer_count(model)
    else:
        layers = [cfg] * cfg.num_hidden_layers
    values = sum(_kv_values(layer, kv_heads) for layer in layers)  # K and V
    return values * torch.finfo(dtype).bits // 8


def _kv_values(cfg, kv_heads: int | None) -> int:
    """The K and V values one token takes in one layer: KV heads x (key + value head
    size). MLA (DeepSeek V2/V3, `kv_lora_rank`) caches each head's K of `qk_nope_head_dim
    + qk_rope_head_dim` and V of `v_head_dim` (its config's `head_dim` is the rotary part
    alone), for every attention head."""
    if getattr(cfg, "kv_lora_rank", None):
        heads = kv_heads or cfg.num_attention_heads
        key = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        return heads * (key + cfg.v_head_dim)
    heads = (
        kv_heads
        or attention_adapters.kv_heads(cfg)  # Falcon's multi-query: one, whatever it states
        or getattr(cfg, "num_key_value_heads", None)
        or cfg.num_attention_heads
    )
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * heads * head_dim


def free_memory_bytes(device: torch.device, cuda_memory_fraction: float = 1.0) -> int:
    """Memory still free for the KV cache; on CUDA within --cuda-memory-fraction of the
    device's total, less what torch holds already (the weights)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if cuda_memory_fraction < 1.0:
            allowed = int(total * cuda_memory_fraction) - torch.cuda.memory_reserved(device)
            free = max(0, min(free, allowed))
        return free
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def kv_floor(settings: Settings, context: int) -> int:
    """The fewest tokens the KV pool holds: one request of --max-total-tokens. With
    --full-context, which the pool then bounds, one of serve's default length (or just
    past --max-input-tokens), or --max-batch-total-tokens when that is given."""
    if settings.max_total_tokens or not settings.full_context:
        return settings.resolved_limits(context)[1]
    if settings.max_batch_total_tokens:
        return min(context, settings.max_batch_total_tokens)
    return min(context, max(DEFAULT_MAX_TOTAL_TOKENS, (settings.max_input_tokens or 0) + 1))


def kv_cache_dtype(settings: Settings, loaded: LoadedModel) -> torch.dtype:
    """The KV pool's storage dtype: --kv-cache-dtype, else the model's."""
    return KV_CACHE_DTYPES[settings.kv_cache_dtype] if settings.kv_cache_dtype else loaded.dtype


def kv_capacity_tokens(settings: Settings, loaded: LoadedModel, max_total_tokens: int) -> int:
    """--max-batch-total-tokens, or what a share of free memory holds in the pool's dtype
    (--kv-cache-dtype): at least one full-length request either way (a smaller pool is
    refused at startup, so that validation's bound, max_total_tokens, is the only one a
    request meets)."""
    if settings.max_batch_total_tokens:
        check_kv_capacity(settings, max_total_tokens)
        return settings.max_batch_total_tokens
    layout = loaded.shard_layout
    per_token = kv_bytes_per_token(
        loaded.model, kv_cache_dtype(settings, loaded), layout.kv_heads_per_rank if layout else None
    )
    fraction = KV_MEMORY_FRACTION.get(loaded.device.type, 0.1)
    free = free_memory_bytes(loaded.device, settings.cuda_memory_fraction)
    share = int(free * fraction)
    state = state_pool_bytes(settings, loaded)
    if state and state + max_total_tokens * per_token > share:
        raise SettingError(
            "--max-batch-size",
            settings.max_batch_size,
            f"a state slot per sequence takes {state / 2**30:.1f} GiB, and with one request "
            f"of {max_total_tokens} tokens that is more than the {share / 2**30:.1f} GiB the "
            f"cache may use: lower --max-batch-size (at most "
            f"{max(share - max_total_tokens * per_token, 0) * settings.max_batch_size // state})",
        )
    if per_token == 0:  # a pure state-space model (Mamba): blocks only count tokens
        return MAX_POOL_TOKENS
    fits = max(share - state, 0) // per_token
    return max(max_total_tokens, min(fits, MAX_POOL_TOKENS))


MAX_POOL_TOKENS = 1 << 20


def state_pool_bytes(settings: Settings, loaded: LoadedModel) -> int:
    """The state pool's memory: a slot per sequence of --max-batch-size (0: no state)."""
    if not has_state_layers(loaded.model):
        return 0
    return settings.max_batch_size * state_bytes_per_sequence(probe_states(loaded.model))
