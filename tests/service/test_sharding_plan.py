"""The tensor-parallel plan textgen loads a model with (models/sharding.py), without processes:
the plan's overrides and refusals, and Phi-3's fused projections cut per rank as transformers'
loader and `localize` cut them (q|k|v whole then this rank's heads' rows of each part,
gate|up packed, o and down by columns), each rank's partial outputs summing to the whole
layer's, with the heads each rank keeps (GQA split, KV heads replicated, multi-head), and
LoRA's slices those rows. The real 2-process load: tests/integration/test_shards.py."""

from __future__ import annotations

import copy

import pytest
import torch
from textgen.service.models.shard_layout import ShardingError, ShardLayout
from textgen.service.models.sharding import (
    localize,
    lora_slices,
    qkv_rows,
    resolved_plan,
    tp_plan_overrides,
)
from transformers import AutoConfig, AutoModelForCausalLM

pytestmark = pytest.mark.timeout(120)

HIDDEN, HEAD_DIM, INTERMEDIATE = 64, 8, 96


def phi3(heads: int, kv_heads: int):
    config = AutoConfig.for_model(
        "phi3",
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=HEAD_DIM,
        vocab_size=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        attn_implementation="eager",  # reads the module's num_key_value_groups
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def layout_of(model, world_size: int) -> ShardLayout:
    config = model.config
    return ShardLayout(world_size, config.num_attention_heads, config.num_key_value_heads, HEAD_DIM)


def _cut(linear: torch.nn.Linear, rows=None, cols=None) -> None:
    weight = linear.weight.data
    weight = weight[rows] if rows is not None else weight
    weight = weight[:, cols] if cols is not None else weight
    linear.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    linear.out_features, linear.in_features = weight.shape


def rank_slice(model, rank: int, layout: ShardLayout):
    """What rank `rank` holds after the load and `localize`: transformers' loader's cuts
    (the plan's `rowwise` o and down by input columns, `packed_colwise` gate|up: its share
    of each half; q|k|v loaded whole, `replicate`), then localize's."""
    n = layout.world_size
    local = copy.deepcopy(model)
    for layer in local.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        width = layout.heads_per_rank * HEAD_DIM
        _cut(attention.o_proj, cols=slice(rank * width, (rank + 1) * width))
        share = INTERMEDIATE // n
        gate = torch.arange(rank * share, (rank + 1) * share)
        _cut(mlp.gate_up_proj, rows=torch.cat([gate, gate + INTERMEDIATE]))
        _cut(mlp.down_proj, cols=slice(rank * share, (rank + 1) * share))
    localize(local, rank, layout)
    return local


@pytest.mark.parametrize(
    ("heads", "kv_heads", "world_size"),
    [(4, 2, 2), (8, 2, 4), (4, 1, 2), (4, 4, 2), (8, 2, 8)],
    ids=["gqa-split", "gqa-2-per-rank", "kv-replicated", "multi-head", "kv-replicated-8"],
)
def test_phi3_ranks_sum_to_the_whole_layer(heads, kv_heads, world_size):
    model = phi3(heads, kv_heads)
    layout = layout_of(model, world_size)
    ranks = [rank_slice(model, rank, layout) for rank in range(world_size)]
    x = torch.randn(1, 7, HIDDEN)
    positions = torch.arange(7)[None]
    mask = torch.full((7, 7), float("-inf")).triu(1)[None, None]
    with torch.inference_mode():
        embeddings = model.model.rotary_emb(x, positions)
        for i, layer in enumerate(model.model.layers):
            whole_attention = layer.self_attn(x, embeddings, mask)[0]
            whole_mlp = layer.mlp(x)
            attention = sum(r.model.layers[i].self_attn(x, embeddings, mask)[0] for r in ranks)
            mlp = sum(r.model.layers[i].mlp(x) for r in ranks)
            torch.testing.assert_close(attention, whole_attention)
            torch.testing.assert_close(mlp, whole_mlp)
    for rank, local in enumerate(ranks):
        attention = local.model.layers[0].self_attn
        kv_heads_kept = len(layout.kv_heads_of(rank))
        assert kv_heads_kept == layout.kv_heads_per_rank  # what the KV pool is sized for
        assert (
            attention.qkv_proj.out_features
            == (layout.heads_per_rank + 2 * kv_heads_kept) * HEAD_DIM
        )
        assert attention.config.num_attention_heads == layout.heads_per_rank
        assert attention.num_key_value_heads == kv_heads_kept
        assert attention.num_key_value_groups == layout.heads_per_rank // kv_heads_kept
        # the rest of the config is the model's (the one config every layer shares)
        assert model.config.num_attention_heads == heads
        assert attention.config.sliding_window == model.config.sliding_window


def test_the_attention_sees_the_implementation_set_after_localize():
    """The runner sets its paged attention on the model's config after loading: the
    per-rank head counts don't hide it."""
    model = phi3(4, 2)
    local = rank_slice(model, 1, layout_of(model, 2))
    local.set_attn_implementation("sdpa")
    assert local.model.layers[1].self_attn.config._attn_implementation == "sdpa"


def test_lora_slices_are_the_rows_each_rank_keeps():
    model = phi3(4, 2)
    layout = layout_of(model, 2)
    full = dict(model.named_modules())
    for rank in range(2):
        local = rank_slice(model, rank, layout)
        slices = lora_slices(local, rank, 2, layout)
        assert set(slices) == {
            f"model.layers.{i}.{p}"
            for i in range(2)
            for p in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
        }
        for name, (rows, cols) in slices.items():
            weight = full[name].weight.data
            weight = weight[rows] if rows is not None else weight
            weight = weight[:, cols] if cols is not None else weight
            torch.testing.assert_close(local.get_submodule(name).weight.data, weight)


def test_qkv_rows():
    # 4 query heads and 2 KV heads of 2 values: q rows 0-7, k rows 8-11, v rows 12-15
    layout = ShardLayout(2, 4, 2, 2)
    assert qkv_rows(layout, 0).tolist() == [0, 1, 2, 3, 8, 9, 12, 13]
    assert qkv_rows(layout, 1).tolist() == [4, 5, 6, 7, 10, 11, 14, 15]
    replicated = ShardLayout(4, 4, 2, 2)  # ranks 0 and 1 read KV head 0, 2 and 3 head 1
    assert [qkv_rows(replicated, r).tolist() for r in (1, 2)] == [
        [2, 3, 8, 9, 12, 13],
        [4, 5, 10, 11, 14, 15],
    ]


def overrides(model_type: str, world_size: int = 2, **options):
    config = AutoConfig.for_model(model_type, **options)
    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    layout = ShardLayout(world_size, heads, kv_heads, text.hidden_size // heads)
    return tp_plan_overrides(model_class, config, layout)


def test_phi3s_plan_splits_its_fused_projections():
    """Over transformers' plan, which gathers q|k|v and gate|up whole: the loader's styles."""
    assert overrides("phi3", num_attention_heads=4, num_key_value_heads=2) == {
        "model.layers.*.self_attn.qkv_proj": "replicate",  # cut by localize
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.gate_up_proj": "packed_colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
    }
    # resolved per module, with textgen's own style for the fused q|k|v
    plan = resolved_plan(phi3(4, 2))
    assert plan["model.layers.1.self_attn.qkv_proj"] == "packed_qkv"
    assert plan["model.layers.1.mlp.gate_up_proj"] == "packed_colwise"


def test_other_plans_are_unchanged():
    """Llama's is the library's as it is; packed styles in the library's own plans (experts)
    stay refused; replicated KV heads as before."""
    assert overrides("llama", num_attention_heads=4, num_key_value_heads=2) == {}
    assert overrides("llama", 4, num_attention_heads=4, num_key_value_heads=2) == {
        "model.layers.*.self_attn.k_proj": "replicate",
        "model.layers.*.self_attn.v_proj": "replicate",
    }
    with pytest.raises(ShardingError, match="packed_colwise"):
        overrides("qwen3_moe", num_attention_heads=4, num_key_value_heads=2)
