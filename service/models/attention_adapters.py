"""Attention adapters: families whose transformers code computes attention inline instead
of through `AttentionInterface` (Falcon, Bloom, MPT) get, per attention module, a forward
of ours that does the family's own projections and rotary and hands query/key/value to the
registered attention function, as an interface-routed family does. The rest of the model
(embeddings, layers, norms, MLPs, head) stays transformers' code, so the paged engine serves
them like every other family: no second engine. Llama 4 goes through the interface, but its
attention needs what transformers' code doesn't hand it on a flattened batch (below).

What each family's attention needs beyond a Llama's:
- Falcon (RW layout): one fused QKV projection with multi-query (one KV head, Falcon-7B),
  grouped KV heads (`new_decoder_architecture`: Falcon-40B/180B) or full heads; rotary, or
  ALiBi (Falcon-RW-1B/7B, slopes rounded to bfloat16 as transformers does).
- Bloom: fused QKV per head, ALiBi.
- MPT: fused QKV with optional clipping, ALiBi with `alibi_bias_max`, its own softmax scale.
- Llama 4: chunked local attention on its rotary layers (`attention_chunk_size`: a query
  sees its own chunk's keys only), and on its NoPE layers a query temperature that grows
  with the token's position, which transformers computes from `arange(T)` plus the cache's
  length: right for one sequence, wrong for a flattened batch of many. The adapter takes
  each token's position from the model's `position_ids` (a pre-hook on the text model: its
  decoder layers don't pass them to their attention) and tells the attention the chunk.

An adapter keeps the model's weights and module tree as they are (checkpoints, sharding and
quantization see transformers' modules); it only replaces `forward`. The model's own forward
keeps building its ALiBi tensor and (with the model's attention implementation set to ours)
no mask, and both are ignored: positions and masks come with the step's batch layout.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

# the attention classes a family's layers may hold (Falcon's flash-attention subclass too)
_ATTENTION_CLASSES = {
    "falcon": ("FalconAttention", "FalconFlashAttention2"),
    "bloom": ("BloomAttention",),
    "mpt": ("MptAttention",),
    "llama4_text": ("Llama4TextAttention",),
}
# Families whose model forward builds no mask once its attention implementation is ours
# (a `[T, T]` mask a step saved). MPT's calls .to() on the mask and needs one, unused;
# Llama 4 routes through AttentionInterface and is set like any other family.
_SET_IMPLEMENTATION = ("falcon", "bloom")
ADAPTED_FAMILIES = frozenset(_ATTENTION_CLASSES)

# (module, query [1, H, T, D], key, value [1, KVH, T, D], mask, scaling=..., **kwargs)
# -> ([1, T, H, D], weights): transformers' AttentionInterface signature
AttentionFunction = Callable[..., tuple[torch.Tensor, object]]


def is_adapted(model_type: str | None) -> bool:
    return model_type in ADAPTED_FAMILIES


def install(model: torch.nn.Module, attention: AttentionFunction, implementation: str) -> bool:
    """Give an adapted family's attention modules our forward, calling `attention`, and
    point the model's attention implementation at `implementation`; -> whether the model
    is such a family."""
    model_type = getattr(model.config, "model_type", None)
    if not is_adapted(model_type):
        return False
    forward = _FORWARDS[model_type]
    slopes = _alibi_slopes(model_type, model.config)
    if slopes is not None:  # one tensor for all layers: the attention builds its bias once a step
        slopes = slopes.to(next(model.parameters()).device)
    positions = _StepPositions()
    for module in model.modules():
        if type(module).__name__ in _ATTENTION_CLASSES[model_type]:
            module._textgen_attention = attention
            module._textgen_alibi_slopes = slopes
            module._textgen_positions = positions
            module.forward = types.MethodType(forward, module)
        elif type(module).__name__ == "Llama4TextModel":
            module.register_forward_pre_hook(positions.hook, with_kwargs=True)
    if model_type in _SET_IMPLEMENTATION:
        model.config._attn_implementation = implementation
    return True


# Zamba's shared attention: one module (layer_idx None or -1) run by several hybrid layers,
# each passing its own index as an argument; the paged pool is keyed by the module's
SHARED_ATTENTION = {"zamba": "ZambaAttention", "zamba2": "Zamba2Attention"}


def install_shared_attention(model: torch.nn.Module) -> bool:
    """Give a Zamba model's shared attention modules the layer_idx of the layer running
    them, for the call (so each hybrid layer has its own K/V in the pool); -> whether it
    has any."""
    name = SHARED_ATTENTION.get(getattr(model.config, "model_type", None))
    modules = [m for m in model.modules() if name and type(m).__name__ == name]
    for module in modules:
        module.forward = types.MethodType(_indexed_forward(type(module).forward), module)
    return bool(modules)


def _indexed_forward(forward):
    def indexed(self, hidden_states, layer_idx, *args, **kwargs):
        own, self.layer_idx = self.layer_idx, layer_idx
        try:
            return forward(self, hidden_states, layer_idx, *args, **kwargs)
        finally:
            self.layer_idx = own

    return indexed


class _StepPositions:
    """The running step's `position_ids` `[1, T]`, kept by a pre-hook on the text model."""

    def __init__(self) -> None:
        self.position_ids: torch.Tensor | None = None

    def hook(self, module, args, kwargs):
        self.position_ids = kwargs.get("position_ids")


def kv_heads(config) -> int | None:
    """The KV heads an adapted family's cache holds per layer (None: not adapted, or the
    config's `num_key_value_heads` says it): Falcon's multi-query keeps one, whatever
    `num_kv_heads` (which defaults to the query heads) says."""
    if getattr(config, "model_type", None) != "falcon":
        return None
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else config.num_attention_heads


def uses_alibi(config) -> bool:
    model_type = getattr(config, "model_type", None)
    return model_type in ("bloom", "mpt") or (model_type == "falcon" and bool(config.alibi))


# the families' forwards: `self` is transformers' attention module ----------------------


def _falcon_forward(
    self, hidden_states, alibi=None, attention_mask=None, position_embeddings=None, **_
):
    """FalconAttention.forward's projections, the attention ours. The fused projection's
    layout: per KV group its query heads then one key and one value head (new decoder
    architecture), all query heads then one key and one value (multi-query), or each head's
    query, key and value together."""
    fused = self.query_key_value(hidden_states)  # [1, T, ...]
    batch, length, _ = fused.shape
    head_dim = self.head_dim
    if self.new_decoder_architecture:
        qkv = fused.view(batch, length, self.num_kv_heads, -1, head_dim)
        query, key, value = qkv[:, :, :, :-2].flatten(2, 3), qkv[:, :, :, -2], qkv[:, :, :, -1]
    elif self.multi_query:
        qkv = fused.view(batch, length, self.num_heads + 2, head_dim)
        query, key, value = qkv[:, :, :-2], qkv[:, :, -2:-1], qkv[:, :, -1:]
    else:
        qkv = fused.view(batch, length, self.num_heads, 3, head_dim)
        query, key, value = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    query, key, value = (x.transpose(1, 2) for x in (query, key, value))
    extra = {}
    if self._textgen_alibi_slopes is None:
        from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
    else:  # transformers adds alibi / sqrt(head_dim) to the scaled scores
        extra = {"alibi_slopes": self._textgen_alibi_slopes, "alibi_scale": self.inv_norm_factor}
    out, _ = self._textgen_attention(
        self, query, key, value, None, scaling=self.inv_norm_factor, **extra
    )
    return self.dense(out.reshape(batch, length, -1)), None


def _bloom_forward(self, hidden_states, residual, alibi=None, attention_mask=None, **_):
    """BloomAttention.forward: fused per-head QKV, ALiBi added unscaled to the scaled scores,
    the output projection (in `pretraining_tp` slices when `slow_but_exact`), the residual."""
    batch, length, _ = hidden_states.shape
    qkv = self.query_key_value(hidden_states).view(batch, length, self.num_heads, 3, -1)
    query, key, value = (qkv[..., i, :].transpose(1, 2) for i in range(3))
    out, _ = self._textgen_attention(
        self,
        query,
        key,
        value,
        None,
        scaling=self.inv_norm_factor,
        alibi_slopes=self._textgen_alibi_slopes,
    )
    out = out.reshape(batch, length, -1)
    if self.pretraining_tp > 1 and self.slow_but_exact:
        width = self.hidden_size / self.pretraining_tp
        projected = torch.zeros_like(out)
        for i in range(self.pretraining_tp):
            cut = slice(int(i * width), int((i + 1) * width))
            projected = projected + F.linear(out[:, :, cut], self.dense.weight[:, cut])
        out = projected + self.dense.bias
    else:
        out = self.dense(out)
    return residual + F.dropout(out, self.hidden_dropout, self.training), None


def _mpt_forward(self, hidden_states, position_bias=None, attention_mask=None, **_):
    """MptAttention.forward: fused QKV (clipped when `clip_qkv`), ALiBi unscaled."""
    batch, length, _ = hidden_states.shape
    qkv = self.Wqkv(hidden_states)
    if self.clip_qkv:
        qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    query, key, value = (
        x.reshape(batch, length, self.n_heads, self.head_dim).transpose(1, 2)
        for x in qkv.chunk(3, dim=2)
    )
    out, _ = self._textgen_attention(
        self,
        query,
        key,
        value,
        None,
        scaling=self.softmax_scale,
        alibi_slopes=self._textgen_alibi_slopes,
    )
    return self.out_proj(out.reshape(batch, length, -1)), None


def _llama4_forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
    """Llama4TextAttention.forward with each token's own position in the NoPE layers'
    temperature, and the chunk size for the chunked layers."""
    from transformers.models.llama4.modeling_llama4 import apply_rotary_emb

    kwargs.pop("cache", None)
    kwargs.pop("use_cache", None)
    shape = hidden_states.shape[:-1]  # [1, T]
    query = self.q_proj(hidden_states).view(*shape, -1, self.head_dim)
    key = self.k_proj(hidden_states).view(*shape, -1, self.head_dim)
    value = self.v_proj(hidden_states).view(*shape, -1, self.head_dim).transpose(1, 2)
    if self.use_rope:
        query, key = apply_rotary_emb(query, key, position_embeddings.to(query.device))
    if hasattr(self, "qk_norm"):
        query, key = self.qk_norm(query), self.qk_norm(key)
    if self.attn_temperature_tuning and not self.use_rope:
        positions = self._textgen_positions.position_ids.float()
        scales = torch.log1p(torch.floor((positions + 1.0) / self.floor_scale)) * self.attn_scale
        query = (query * (scales + 1.0).view(*shape, 1, 1)).to(query.dtype)
    chunked = self.config.layer_types[self.layer_idx] == "chunked_attention"
    out, _ = self._textgen_attention(
        self,
        query.transpose(1, 2),
        key.transpose(1, 2),
        value,
        None,
        scaling=self.scaling,
        attention_chunk_size=self.config.attention_chunk_size if chunked else None,
        **kwargs,
    )
    return self.o_proj(out.reshape(*shape, -1).contiguous()), None


_FORWARDS = {
    "falcon": _falcon_forward,
    "bloom": _bloom_forward,
    "mpt": _mpt_forward,
    "llama4_text": _llama4_forward,
}


def _alibi_slopes(model_type: str, config) -> torch.Tensor | None:
    """Each head's ALiBi slope as the family's own code computes it, or None (rotary)."""
    if not uses_alibi(config):
        return None
    heads = config.num_attention_heads
    if model_type == "mpt":
        from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

        # [H, 1, 2]: slope x (-1, 0) over two positions
        return -build_mpt_alibi_tensor(heads, 2, config.attn_config.alibi_bias_max)[:, 0, 0]
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    slopes = _get_alibi_slopes(heads, torch.device("cpu"))
    # Falcon's build_alibi_tensor rounds the slopes, and their products, to bfloat16
    return slopes.bfloat16() if model_type == "falcon" else slopes


@contextlib.contextmanager
def plain_linears(model_type: str | None, wanted: bool) -> Iterator[None]:
    """Inside the block, Falcon's models are built with `nn.Linear` layers where its code
    has `FalconLinear` (the same product, written as a matmul): the quantizers
    (bitsandbytes, EETQ, ours) and the LoRA slots take only exact `nn.Linear` layers, and
    would leave Falcon's silently dense. `wanted`: a quantizer or LoRA is in play (else
    Falcon keeps its own, the layers its `generate` runs)."""
    if model_type != "falcon" or not wanted:
        yield
        return
    from transformers.models.falcon import modeling_falcon

    own = modeling_falcon.FalconLinear
    modeling_falcon.FalconLinear = torch.nn.Linear
    try:
        yield
    finally:
        modeling_falcon.FalconLinear = own
