"""Tensor parallelism of a model (`--num-shard N`): each rank holds a slice of every layer.

The plan is transformers' own, per architecture (`base_model_tp_plan` and the model class's
`_tp_plan`): the attention's q/k/v and the MLP's gate/up projections `colwise` (each rank
computes its heads and its share of the intermediate features), the attention's o and the
MLP's down projections `rowwise` (each rank a partial sum, all-reduced), the embedding
`embedding_rowwise` (vocab-parallel: each rank looks up its rows, the lookups are summed)
and lm_head `colwise_gather_output` (each rank the logits of its share of the vocabulary).

Loading is the library's: `from_pretrained(distributed_config=DistributedConfig(tp_size=N))`
reads each rank's slices straight from the safetensors, so no rank ever holds the whole model.
The library's layers then run on DTensor parameters, swapped for local ones around every
Linear call; `localize()` turns them into plain tensors and puts one all-reduce after each
row-parallel layer and the embedding, measured cheaper per step (docs/performance.md,
"Shards"). lm_head's slices are not gathered here: the engine gathers the logits it keeps,
to rank 0 only (engine/runners/sharded.py).

What the plan can't shard is refused before the weights load (`check_shardable`): a model
without a plan or with styles this does not implement (packed or fused projections, experts),
and heads that do not split evenly, and a plan that splits no attention heads (every rank
would hold every head, in a KV pool sized for its share). KV heads: when there are fewer than
N but N is a multiple of them, each rank keeps the one its query heads read (replicated, as
vLLM does). Where the library's plan leaves a Llama-like attention whole (gpt-oss's and
Qwen3-VL's language model's, in transformers 5: their embedding only), ATTENTION_PLANS
splits it, attention sinks included (Qwen3-VL's MLP too).
Where it gathers fused projections whole (Phi-3's q|k|v and gate|up, `colwise_gather_output`
then `rowwise_split_input`), FUSED_PLANS splits them instead: gate|up with the library's
`packed_colwise` (each rank its share of each half), q|k|v loaded whole and cut by
`localize` to this rank's heads' rows of each of q, k and v (the library's packed styles
split equal parts only, and q is larger than k and v), the attention told its heads.
DeepSeek-V3's multi-head latent attention, which its plan leaves whole, ATTENTION_PLANS
splits per head: the shared latents (q_a_proj, kv_a_proj_with_mqa and their norms) whole on
every rank, q_proj (or q_b_proj) and kv_b_proj (each head's [k_nope | v] rows) colwise, o_proj
rowwise, the attention told its heads; the KV pool then holds this rank's heads' K and V as
kv_b_proj expands them. Its routed experts run on the library's split (EXPERT_PLANS): each
rank its share of every expert's intermediate features (gate|up packed, down by its input
columns), the experts' partial output all-reduced (`moe_tp_experts`), the router whole.
Qwen3-Next's experts likewise.

A vision-language model's plan (transformers') splits its language model only, its entries
under the language model (`language_model_prefix`); the vision tower and projector load
whole on every rank.

Gated DeltaNet (Qwen3-Next, Qwen3.5), whose state layers the library's plan computes whole
on every rank (`colwise_gather_output`), STATE_PLANS splits by heads as the attention is:
each rank its share of the key heads and of the value heads that read them, their rows of
the input projections (Qwen3-Next's are laid out per key head: plain colwise; Qwen3.5's
q|k|v loads whole and is cut like Phi-3's), their channels of the short convolution, their
decay and step parameters; the output projection row-parallel. Each rank's state pool then
holds its heads' states (engine/state_pool.py sizes it from the layers as they are).

The collective is one opaque custom op (`textgen::all_reduce`), so torch.compile'd decode
steps and CUDA graphs keep it as it is; its process group is this process's one model group.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .architectures import IMAGE_FAMILIES
from .shard_layout import ShardingError, ShardLayout
from .state_layers import state_layers

logger = logging.getLogger("textgen.models")

# styles localize() implements; "replicate" and the norms' style need nothing at inference
COLWISE, ROWWISE, EMBEDDING, LM_HEAD = (
    "colwise",
    "rowwise",
    "embedding_rowwise",
    "colwise_gather_output",
)
NO_OP_STYLES = frozenset({"replicate", "replicated_with_grad_allreduce"})
# a routed experts module whose parameters the plan splits by intermediate features: its
# output, a partial sum, all-reduced (EXPERT_PLANS only)
MOE_EXPERTS = "moe_tp_experts"
SUPPORTED_STYLES = frozenset({COLWISE, ROWWISE, EMBEDDING, LM_HEAD}) | NO_OP_STYLES
# the fused projections' styles, in FUSED_PLANS only: a Linear whose rows are [q | k | v]
# (textgen's: loaded whole, cut by localize), and one whose rows are [gate | up] (the
# library's: each half split colwise, so the rank's rows are [its gate | its up])
PACKED_QKV, PACKED_COLWISE = "packed_qkv", "packed_colwise"
LOADED_AS = {PACKED_QKV: "replicate"}  # how transformers' loader reads what it can't split
KV_PROJECTIONS = ("k_proj", "v_proj")
# what computes a layer's queries or keys, unfused or fused: a plan that splits none of them
# (colwise) leaves every head on every rank
HEAD_PROJECTIONS = ("q_proj", "k_proj", "qkv_proj", "query_key_value", "q_b_proj", "kv_b_proj")
# MLA: the projection that expands the shared latent into every head's K and V
MLA_KV_PROJECTION = "kv_b_proj"
HEAD_SPLITS = frozenset({COLWISE, PACKED_QKV})

# model_type -> the attention's split where transformers' plan has none (added under the
# model's base prefix, the library's own entries kept): Llama's, each rank's query heads'
# attention sinks (a parameter) with them, the library's way of writing that (granite_swa)
ATTENTION_PLANS: dict[str, dict[str, str]] = {
    "gpt_oss": {
        "layers.*.self_attn.q_proj": COLWISE,
        "layers.*.self_attn.k_proj": COLWISE,
        "layers.*.self_attn.v_proj": COLWISE,
        "layers.*.self_attn.o_proj": ROWWISE,
        "layers.*.self_attn.sinks": COLWISE,
    },
    # Qwen3-VL's language model, whose plan in transformers 5 splits its embedding only:
    # Qwen3's split (its per-head q/k norms run on each rank's heads as they are), the
    # MLP's too
    "qwen3_vl_text": {
        "layers.*.self_attn.q_proj": COLWISE,
        "layers.*.self_attn.k_proj": COLWISE,
        "layers.*.self_attn.v_proj": COLWISE,
        "layers.*.self_attn.o_proj": ROWWISE,
        "layers.*.mlp.gate_proj": COLWISE,
        "layers.*.mlp.up_proj": COLWISE,
        "layers.*.mlp.down_proj": ROWWISE,
    },
    # multi-head latent attention: q_proj or, with q_lora_rank, q_b_proj (one of them:
    # tp_plan_overrides keeps what the config builds) and kv_b_proj per head; the latents'
    # projections and norms (q_a_*, kv_a_*) replicated, as modules the plan doesn't name are
    "deepseek_v3": {
        "layers.*.self_attn.q_proj": COLWISE,
        "layers.*.self_attn.q_b_proj": COLWISE,
        "layers.*.self_attn.kv_b_proj": COLWISE,
        "layers.*.self_attn.o_proj": ROWWISE,
    },
}
# model_type -> the routed experts' entries of transformers' plan that textgen runs as the
# library loads them (each rank its share of every expert's gate|up rows and down columns);
# install_collectives all-reduces the experts' output. Other models' expert styles stay
# refused (untested here).
_SPLIT_EXPERTS = {
    "layers.*.mlp.experts.gate_up_proj": PACKED_COLWISE,
    "layers.*.mlp.experts.down_proj": ROWWISE,
    "layers.*.mlp.experts": MOE_EXPERTS,
}
EXPERT_PLANS: dict[str, dict[str, str]] = {
    "deepseek_v3": _SPLIT_EXPERTS,
    "qwen3_next": _SPLIT_EXPERTS,
}
# a Gated DeltaNet's fused [q | k | v] input projection (Qwen3.5's): loaded whole, cut by
# localize to this rank's key heads' q and k rows and value heads' v rows
PACKED_GATED_DELTA = "packed_gated_delta"
LOADED_AS[PACKED_GATED_DELTA] = "replicate"
# model_type -> the split of its Gated DeltaNet layers by heads (over the library's
# entries, which compute them whole): the module docstring
STATE_PLANS: dict[str, dict[str, str]] = {
    "qwen3_next": {
        "layers.*.linear_attn.in_proj_qkvz": COLWISE,  # rows per key head: q, k, v, z
        "layers.*.linear_attn.in_proj_ba": COLWISE,  # rows per key head: b, a
        "layers.*.linear_attn.out_proj": ROWWISE,
    },
    "qwen3_5_text": {
        "layers.*.linear_attn.in_proj_qkv": PACKED_GATED_DELTA,
        "layers.*.linear_attn.in_proj_z": COLWISE,
        "layers.*.linear_attn.in_proj_b": COLWISE,
        "layers.*.linear_attn.in_proj_a": COLWISE,
        "layers.*.linear_attn.out_proj": ROWWISE,
    },
}
# model_type -> the split of its fused projections, over the library's entries for them
# (which gather the fused outputs whole): each rank its heads' q, k and v rows, its share of
# gate and up, o and down row-parallel
FUSED_PLANS: dict[str, dict[str, str]] = {
    "phi3": {
        "layers.*.self_attn.qkv_proj": PACKED_QKV,
        "layers.*.self_attn.o_proj": ROWWISE,
        "layers.*.mlp.gate_up_proj": PACKED_COLWISE,
        "layers.*.mlp.down_proj": ROWWISE,
    },
}

_group: dist.ProcessGroup | None = None  # the model's group (set by localize)


def tp_plan_overrides(model_class: type, config, layout: ShardLayout) -> dict[str, str]:
    """The model's plan, checked, with the overrides we load it with (transformers'
    styles): ATTENTION_PLANS' and FUSED_PLANS' entries (a fused q|k|v replicated, sliced
    per rank afterwards), KV projections replicated when there are fewer KV heads than
    shards (sliced per rank afterwards too)."""
    plan = dict(getattr(model_class, "_tp_plan", None) or {})
    text = config.get_text_config()
    base = getattr(text, "base_model_tp_plan", None) or {}
    prefix = language_model_prefix(model_class, config)
    plan.update({f"{prefix}.{k}": v for k, v in base.items()})
    if not base:
        raise ShardingError(
            f"{model_class.__name__} has no tensor-parallel plan in transformers "
            "(base_model_tp_plan): it can't be sharded; serve it with --num-shard 1"
        )
    model_type = getattr(text, "model_type", None)
    attention = ATTENTION_PLANS.get(model_type, {})
    if getattr(text, "q_lora_rank", None) is not None:  # MLA: the config builds q_b_proj
        attention = {k: v for k, v in attention.items() if not k.endswith(".q_proj")}
    elif getattr(text, "kv_lora_rank", None) is not None:  # ... or q_proj
        attention = {k: v for k, v in attention.items() if not k.endswith(".q_b_proj")}
    added = {f"{prefix}.{k}": v for k, v in attention.items() if f"{prefix}.{k}" not in plan}
    fused = {
        f"{prefix}.{k}": v
        for k, v in {**FUSED_PLANS.get(model_type, {}), **STATE_PLANS.get(model_type, {})}.items()
    }
    added.update(fused)
    plan.update(added)
    experts = {f"{prefix}.{k}": v for k, v in EXPERT_PLANS.get(model_type, {}).items()}
    unsupported = sorted(
        {
            s
            for k, s in plan.items()
            if s not in SUPPORTED_STYLES and k not in fused and experts.get(k) != s
        }
    )
    if unsupported:
        raise ShardingError(
            f"{model_class.__name__}'s tensor-parallel plan uses {', '.join(unsupported)}, "
            "which textgen's shards don't implement (packed or fused projections, experts); "
            "serve it with --num-shard 1"
        )
    splits = (
        s in HEAD_SPLITS and k.rsplit(".", 1)[-1] in HEAD_PROJECTIONS for k, s in plan.items()
    )
    if not any(splits):
        raise ShardingError(
            f"{model_class.__name__}'s tensor-parallel plan in transformers splits no attention "
            "heads (each shard would hold all of them); serve it with --num-shard 1"
        )
    if layout.kv_replicated:
        added.update({k: "replicate" for k in plan if k.rsplit(".", 1)[-1] in KV_PROJECTIONS})
    return {k: LOADED_AS.get(s, s) for k, s in added.items()}


def language_model_prefix(model_class: type, config) -> str:
    """Where the plan's entries (the text config's) sit in the model: under its base model,
    or, in a vision-language model, under its language model (`model.language_model`,
    Idefics 3's `model.text_model`), found on an empty (meta) instance."""
    prefix = getattr(model_class, "base_model_prefix", "model")
    if getattr(config, "model_type", None) not in IMAGE_FAMILIES:
        return prefix
    with torch.device("meta"):
        return language_model(model_class._from_config(config))


def language_model(model: torch.nn.Module) -> str:
    """The name of a vision-language model's language model (`model.language_model`,
    Idefics 3's `model.text_model`): the module that holds its token embedding."""
    embedding = model.get_input_embeddings()
    return next(n for n, m in model.named_modules() if m is embedding).rpartition(".")[0]


def localize(model: torch.nn.Module, rank: int, layout: ShardLayout) -> None:
    """DTensor parameters -> this rank's plain tensors; the library's per-call wrappers ->
    our collectives (module docstring). Run once, after loading; `install_collectives`
    puts the all-reduces in (after quantization, which may replace the Linear layers)."""
    from torch.distributed.tensor import DTensor

    for _, module in model.named_modules():
        module.__dict__.pop("forward", None)  # the library's wrapper: the class's forward again
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                local = param.to_local().detach()
                setattr(module, name, torch.nn.Parameter(local, requires_grad=False))
        if isinstance(module, torch.nn.Linear):
            module.out_features, module.in_features = module.weight.shape
    for name, style in resolved_plan(model).items():
        module = model.get_submodule(name)
        if style == ROWWISE and module.bias is not None and rank != 0:
            module.bias.data.zero_()  # added once: the sum of the ranks' partials
        if style == PACKED_QKV:
            _keep_rows(module, qkv_rows(layout, rank))
            _local_heads(model.get_submodule(name.rpartition(".")[0]), layout, rank)
        elif style == COLWISE and name.rsplit(".", 1)[-1] == MLA_KV_PROJECTION:
            _local_heads(model.get_submodule(name.rpartition(".")[0]), layout, rank)
        elif layout.kv_replicated and name.rsplit(".", 1)[-1] in KV_PROJECTIONS:
            _keep_kv_head(module, layout.kv_head_of(rank), layout.head_dim)
    model_type = getattr(model.config.get_text_config(), "model_type", None)
    if model_type in STATE_PLANS:
        for layer in state_layers(model).values():
            _local_gated_delta(layer, rank, layout.world_size)


def install_collectives(
    model: torch.nn.Module, group: dist.ProcessGroup, rank: int, world_size: int
) -> VocabSlice:
    """All-reduce after each row-parallel layer, split experts module and the vocab-parallel
    embedding; -> the slice of the vocabulary this rank's lm_head computes."""
    global _group
    _group = group
    vocab = None
    for name, style in resolved_plan(model).items():
        module = model.get_submodule(name)
        if style in (ROWWISE, MOE_EXPERTS):
            _all_reduce_output(module)
        elif style == EMBEDDING:
            _vocab_parallel(module, rank, world_size)
        elif style == LM_HEAD:
            vocab = VocabSlice.of(model.config.get_text_config().vocab_size, rank, world_size)
    if vocab is None:
        raise ShardingError("the plan shards no lm_head: the logits would be incomplete")
    return vocab


@dataclass(frozen=True)
class VocabSlice:
    """The rows of the vocabulary rank `rank` projects (torch.chunk's split, as DTensor's)."""

    vocab_size: int
    chunk: int  # rows per rank but maybe the last
    start: int
    stop: int

    @classmethod
    def of(cls, vocab_size: int, rank: int, world_size: int) -> VocabSlice:
        chunk = -(-vocab_size // world_size)
        start = min(rank * chunk, vocab_size)
        return cls(vocab_size, chunk, start, min(start + chunk, vocab_size))


def lora_slices(
    model: torch.nn.Module, rank: int, world_size: int, layout: ShardLayout
) -> dict[str, tuple[slice | torch.Tensor | None, slice | None]]:
    """Per sharded Linear (after localize): the (output rows, input columns) of the full
    weight this rank holds, so that a LoRA adapter's B and A are sliced the same way
    (models/lora_layers.py); a packed layer's rows are an index (its parts' shares). Even
    splits, as the plan's checks leave them."""
    slices = {}
    for name, style in resolved_plan(model).items():
        module = model.get_submodule(name)
        if not hasattr(module, "out_features"):  # the embedding
            continue
        if style == PACKED_QKV:
            slices[name] = (qkv_rows(layout, rank), None)
        elif style == PACKED_COLWISE:
            n = module.out_features // 2  # this rank's share of each half
            full = n * world_size
            slices[name] = (torch.cat([_rows(rank * n, n), _rows(full + rank * n, n)]), None)
        elif layout.kv_replicated and name.rsplit(".", 1)[-1] in KV_PROJECTIONS:
            head = layout.kv_head_of(rank)
            slices[name] = (slice(head * layout.head_dim, (head + 1) * layout.head_dim), None)
        elif style == COLWISE:
            n = module.out_features
            slices[name] = (slice(rank * n, (rank + 1) * n), None)
        elif style == ROWWISE:
            n = module.in_features
            slices[name] = (None, slice(rank * n, (rank + 1) * n))
    return slices


def resolved_plan(model: torch.nn.Module) -> dict[str, str]:
    """Module name -> style, for every module the model's plan names (FUSED_PLANS' styles
    where the model's loaded with them)."""
    plan = dict(model.tp_plan)
    prefix = getattr(model, "base_model_prefix", "model")
    model_type = getattr(model.config.get_text_config(), "model_type", None)
    plan.update({f"{prefix}.{k}": v for k, v in FUSED_PLANS.get(model_type, {}).items()})
    plan.update({f"{prefix}.{k}": v for k, v in STATE_PLANS.get(model_type, {}).items()})
    patterns = [
        (re.compile("^" + re.escape(p).replace(r"\*", r"\d+") + "$"), s) for p, s in plan.items()
    ]
    return {
        name: style
        for name, _ in model.named_modules()
        for pattern, style in patterns
        if pattern.match(name)
    }


def qkv_rows(layout: ShardLayout, rank: int) -> torch.Tensor:
    """The rows of a fused [q | k | v] projection rank `rank` keeps: its query heads' q rows,
    its KV heads' (layout.kv_heads_of) k and v rows."""
    d = layout.head_dim
    q = layout.heads_per_rank
    kv = layout.kv_heads_of(rank)
    k_start = layout.num_heads * d
    v_start = k_start + layout.num_kv_heads * d
    return torch.cat(
        [
            _rows(rank * q * d, q * d),
            _rows(k_start + kv.start * d, len(kv) * d),
            _rows(v_start + kv.start * d, len(kv) * d),
        ]
    )


def _local_gated_delta(layer: torch.nn.Module, rank: int, world_size: int) -> None:
    """A Gated DeltaNet layer as rank `rank` runs it: its key heads and the value heads
    that read them (a contiguous share of each), their convolution channels ([q | k | v],
    as the layer concatenates them) and decay/step parameters; Qwen3.5's fused q|k|v
    projection cut to the same rows. Its input projections were split by the plan."""
    nk, nv = layer.num_k_heads // world_size, layer.num_v_heads // world_size
    k_width, v_width = nk * layer.head_k_dim, nv * layer.head_v_dim
    channels = torch.cat(
        [
            _rows(rank * k_width, k_width),
            _rows(layer.key_dim + rank * k_width, k_width),
            _rows(2 * layer.key_dim + rank * v_width, v_width),
        ]
    )
    if hasattr(layer, "in_proj_qkv"):
        _keep_rows(layer.in_proj_qkv, channels)
    conv = layer.conv1d
    for name in ("weight", "bias"):
        param = getattr(conv, name)
        if param is not None:
            local = param.data[channels.to(param.device)].clone()
            setattr(conv, name, torch.nn.Parameter(local, requires_grad=False))
    conv.in_channels = conv.out_channels = conv.groups = len(channels)
    heads = slice(rank * nv, (rank + 1) * nv)
    for name in ("A_log", "dt_bias"):
        local = getattr(layer, name).data[heads].clone()
        setattr(layer, name, torch.nn.Parameter(local, requires_grad=False))
    layer.num_k_heads, layer.num_v_heads = nk, nv
    layer.key_dim, layer.value_dim = k_width, v_width
    layer.conv_dim = len(channels)


def _rows(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n)


def _keep_rows(linear: torch.nn.Linear, rows: torch.Tensor) -> None:
    rows = rows.to(linear.weight.device)
    linear.weight = torch.nn.Parameter(linear.weight.data[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias.data[rows].clone(), requires_grad=False)
    linear.out_features = len(rows)


class _LocalHeads:
    """A config as one rank's attention sees it: its head counts, everything else the
    model's config's, read through (so that what's set there later, the attention
    implementation, shows)."""

    def __init__(self, config, **heads: int) -> None:
        self._config = config
        self.__dict__.update(heads)

    def __getattr__(self, name: str):
        if name == "_config":  # (not set yet: copied or unpickled)
            raise AttributeError(name)
        return getattr(self._config, name)


def _local_heads(attention: torch.nn.Module, layout: ShardLayout, rank: int) -> None:
    """A fused or latent attention's head counts, those of this rank's heads (Phi-3's splits
    its qkv output by the config's num_attention_heads and its own num_key_value_heads;
    DeepSeek-V3's eager path repeats K/V by its num_key_value_groups)."""
    heads, kv_heads = layout.heads_per_rank, len(layout.kv_heads_of(rank))
    attention.config = _LocalHeads(
        attention.config, num_attention_heads=heads, num_key_value_heads=kv_heads
    )
    for name, value in (
        ("num_heads", heads),
        ("num_key_value_heads", kv_heads),
        ("num_key_value_groups", heads // kv_heads),
    ):
        if hasattr(attention, name):
            setattr(attention, name, value)


def _keep_kv_head(linear: torch.nn.Linear, head: int, head_dim: int) -> None:
    rows = slice(head * head_dim, (head + 1) * head_dim)
    linear.weight = torch.nn.Parameter(linear.weight.data[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias.data[rows].clone(), requires_grad=False)
    linear.out_features = head_dim


def _all_reduce_output(module: torch.nn.Module) -> None:
    forward = type(module).forward

    def reduced(*args, **kwargs) -> torch.Tensor:  # experts: (states, top-k ids, weights)
        return all_reduce(forward(module, *args, **kwargs))

    module.forward = reduced


def _vocab_parallel(embedding: torch.nn.Module, rank: int, world_size: int) -> None:
    rows = VocabSlice.of(embedding.num_embeddings, rank, world_size)
    embedding.num_embeddings = rows.stop - rows.start
    forward = type(embedding).forward

    def looked_up(ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < rows.start) | (ids >= rows.stop)
        local = forward(embedding, (ids - rows.start).masked_fill(outside, 0))
        return all_reduce(local.masked_fill(outside.unsqueeze(-1), 0))

    embedding.forward = looked_up


@torch.library.custom_op("textgen::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the model's ranks (a new tensor)."""
    out = x.contiguous().clone()
    dist.all_reduce(out, group=_group)
    return out


@all_reduce.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)
