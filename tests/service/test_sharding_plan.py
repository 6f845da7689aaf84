"""The tensor-parallel plan textgen loads a model with (models/sharding.py), without processes:
the plan's overrides and refusals, and Phi-3's fused projections cut per rank as transformers'
loader and `localize` cut them (q|k|v whole then this rank's heads' rows of each part,
gate|up packed, o and down by columns), each rank's partial outputs summing to the whole
layer's, with the heads each rank keeps (GQA split, KV heads replicated, multi-head), and
LoRA's slices those rows; DeepSeek-V3's latent attention split per head and its experts by
intermediate features, likewise summing to the whole layer. The real 2-process load:
tests/integration/test_shards.py."""

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


# DeepSeek-V3: multi-head latent attention and routed experts ----------------------------

MLA_HEADS, NOPE, ROPE, V_DIM, MOE_INTERMEDIATE = 4, 16, 8, 16, 32


def deepseek_v3(q_lora_rank: int | None, attention_bias: bool):
    """A tiny DeepSeek-V3 (tests/support/families.py's): layer 0 a dense MLP, layer 1 four
    routed experts (two a token) beside a shared one."""
    config = AutoConfig.for_model(
        "deepseek_v3",
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=2,
        num_attention_heads=MLA_HEADS,
        num_key_value_heads=MLA_HEADS,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_rope_head_dim=ROPE,
        qk_nope_head_dim=NOPE,
        v_head_dim=V_DIM,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=MOE_INTERMEDIATE,
        first_k_dense_replace=1,
        attention_bias=attention_bias,
        vocab_size=128,
        initializer_range=0.2,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        attn_implementation="eager",  # reads the module's num_key_value_groups
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # biases drawn, not zero; a router that picks different experts
        for name, param in model.named_parameters():
            if name.endswith(("bias", "gate.weight")):
                param.normal_(0.0, 0.5)
    return model


def _heads(rank: int, per_rank: int, width: int) -> slice:
    return slice(rank * per_rank * width, (rank + 1) * per_rank * width)


def deepseek_rank_slice(model, rank: int, layout: ShardLayout):
    """What rank `rank` holds after transformers' loader (the plan with textgen's overrides:
    q/q_b and kv_b colwise by heads, o rowwise; the MLPs' gate/up colwise, down rowwise; the
    experts' gate|up packed, down by input columns; the latents whole) and `localize`."""
    n, heads = layout.world_size, layout.heads_per_rank
    local = copy.deepcopy(model)
    overrides = tp_plan_overrides(type(model), model.config, layout)
    local.tp_plan = {**local.tp_plan, **overrides}  # as from_pretrained merges them
    for layer in local.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        q = attention.q_proj if attention.q_proj is not None else attention.q_b_proj
        _cut(q, rows=_heads(rank, heads, NOPE + ROPE))
        _cut(attention.kv_b_proj, rows=_heads(rank, heads, NOPE + V_DIM))
        _cut(attention.o_proj, cols=_heads(rank, heads, V_DIM))
        dense = getattr(mlp, "shared_experts", mlp)
        share = dense.down_proj.in_features // n
        for linear in (dense.gate_proj, dense.up_proj):
            _cut(linear, rows=slice(rank * share, (rank + 1) * share))
        _cut(dense.down_proj, cols=slice(rank * share, (rank + 1) * share))
        if hasattr(mlp, "experts"):
            experts = mlp.experts
            share = MOE_INTERMEDIATE // n
            gate = torch.arange(rank * share, (rank + 1) * share)
            rows = torch.cat([gate, gate + MOE_INTERMEDIATE])
            experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.data[:, rows].clone())
            experts.down_proj = torch.nn.Parameter(
                experts.down_proj.data[:, :, rank * share : (rank + 1) * share].clone()
            )
    localize(local, rank, layout)
    return local


def test_deepseek_v3s_plan_splits_mla_heads_and_keeps_the_experts_split():
    plan = overrides(
        "deepseek_v3", num_attention_heads=4, num_key_value_heads=4, n_group=1, topk_group=1
    )
    assert plan == {
        "model.layers.*.self_attn.q_b_proj": "colwise",  # q_lora_rank set (V3's default)
        "model.layers.*.self_attn.kv_b_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
    }
    plan = overrides(
        "deepseek_v3",
        num_attention_heads=4,
        num_key_value_heads=4,
        n_group=1,
        topk_group=1,
        q_lora_rank=None,
    )
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert "model.layers.*.self_attn.q_b_proj" not in plan
    # resolved per module: the experts module all-reduced, the latents not named (whole)
    model = deepseek_v3(32, False)
    layout = ShardLayout(2, MLA_HEADS, MLA_HEADS, HIDDEN // MLA_HEADS)
    local = deepseek_rank_slice(model, 0, layout)
    resolved = resolved_plan(local)
    assert resolved["model.layers.1.mlp.experts"] == "moe_tp_experts"
    assert resolved["model.layers.1.self_attn.kv_b_proj"] == "colwise"
    whole = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm", "gate")
    assert not [name for name in resolved if name.rsplit(".", 1)[-1] in whole]


@pytest.mark.parametrize(
    ("q_lora_rank", "attention_bias"),
    [(32, False), (None, True)],
    ids=["q-lora", "q-proj-biased"],
)
def test_deepseek_v3_ranks_sum_to_the_whole_layer(q_lora_rank, attention_bias):
    model = deepseek_v3(q_lora_rank, attention_bias)
    layout = ShardLayout(2, MLA_HEADS, MLA_HEADS, HIDDEN // MLA_HEADS)
    ranks = [deepseek_rank_slice(model, rank, layout) for rank in range(2)]
    x = torch.randn(1, 7, HIDDEN)
    positions = torch.arange(7)[None]
    mask = torch.full((7, 7), float("-inf")).triu(1)[None, None]
    with torch.inference_mode():
        embeddings = model.model.rotary_emb(x, positions)
        chosen = model.model.layers[1].mlp.gate(x)[2]
        assert len(chosen.unique()) > 2, "the router picks too few experts to prove much"
        for i, layer in enumerate(model.model.layers):
            whole_attention = layer.self_attn(x, embeddings, mask)[0]
            whole_mlp = layer.mlp(x)
            attention = sum(r.model.layers[i].self_attn(x, embeddings, mask)[0] for r in ranks)
            mlp = sum(r.model.layers[i].mlp(x) for r in ranks)
            torch.testing.assert_close(attention, whole_attention)
            torch.testing.assert_close(mlp, whole_mlp)
    for rank, local in enumerate(ranks):
        attention = local.model.layers[1].self_attn
        # each rank's attention sees its 2 heads, and hands the paged attention K and V of
        # them (what kv_sizing sizes each rank's pool for: layout.kv_heads_per_rank)
        assert layout.kv_heads_per_rank == 2
        assert attention.kv_b_proj.out_features == 2 * (NOPE + V_DIM)
        assert attention.config.num_attention_heads == 2
        assert attention.num_heads == 2 and attention.num_key_value_groups == 1
        kv_latent = torch.randn(1, 1, 5, 16)
        k_rot = torch.randn(1, 1, 5, ROPE)
        keys, values = attention.expand_kv(kv_latent, k_rot)
        assert keys.shape == (1, 2, 5, NOPE + ROPE) and values.shape == (1, 2, 5, V_DIM)
        assert model.config.num_attention_heads == MLA_HEADS
        # the latents, the router and the norms whole on every rank
        whole = model.model.layers[1]
        for name in ("self_attn.kv_a_proj_with_mqa", "self_attn.kv_a_layernorm", "mlp.gate"):
            torch.testing.assert_close(
                local.model.layers[1].get_submodule(name).weight,
                whole.get_submodule(name).weight,
            )


def test_the_mla_layout_holds_every_head_kv_b_proj_expands():
    """MLA's pool holds num_attention_heads K/V heads per layer, whatever num_key_value_heads
    says (kv_b_proj expands the one latent into all of them)."""
    from textgen.service.models.shard_layout import shard_layout

    config = {"num_attention_heads": 8, "num_key_value_heads": 1, "kv_lora_rank": 16}
    config["hidden_size"] = 64
    layout = shard_layout(config, 2)
    assert (layout.num_kv_heads, layout.kv_heads_per_rank, layout.kv_replicated) == (8, 4, False)
