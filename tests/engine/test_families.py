"""Families whose transformers code needs something of the paged engine the Llama-like
ones don't, each a tiny random model against its own `generate` (float32, greedy): a mixed
batch of different lengths, prefill chunks beside decodes, a preemption."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, StableLmConfig, StableLmForCausalLM

from .factories import (
    VOCAB_SIZE,
    assert_idle,
    assert_matches_generate,
    make_core,
    make_seq,
    random_prompt,
    run_to_completion,
)


def serve_through_preemption(model, lengths: list[int], prefill_tokens: int, seed: int):
    """Sequences of these prompt lengths through a 12-block pool of 8 tokens: prompts wait
    for room, and running sequences that grow preempt others; -> (core, sequences)."""
    g = torch.Generator().manual_seed(seed)
    seqs = [
        make_seq(random_prompt(n, VOCAB_SIZE, g), request_id=f"r{i}", max_new_tokens=8 + i)
        for i, n in enumerate(lengths)
    ]
    core = make_core(
        model, total_tokens=96, prefill_tokens=prefill_tokens, batch_size=4, block_size=8
    )
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    assert_matches_generate(model, seqs)
    assert core.stats().preemptions > 0
    assert_idle(core)
    return core, g


def tiny_stablelm(**options) -> torch.nn.Module:
    torch.manual_seed(3)
    config = StableLmConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
        attn_implementation="sdpa",
        **options,
    )
    model = StableLmForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize(
    "options",
    [{}, {"use_parallel_residual": True, "qk_layernorm": True}],
    ids=["sequential", "parallel-qk-norm"],
)
def test_stablelm_whose_layers_drop_the_attention_keywords(options):
    """StableLM's decoder layer calls its attention without the keywords the model was
    given: the step's metadata reaches it bound (attention/paged.py)."""
    serve_through_preemption(tiny_stablelm(**options), [10, 13, 16, 19, 22, 25], 64, seed=5)


def tiny_gpt_oss() -> torch.nn.Module:
    """Attention sinks (a learned logit per head in the softmax's denominator), sliding
    and full layers alternating, a mixture of experts."""
    torch.manual_seed(4)
    config = AutoConfig.for_model(
        "gpt_oss",
        vocab_size=VOCAB_SIZE,
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
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # sinks large enough to take a real share of each row
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    model.generation_config.eos_token_id = None
    return model


def test_gpt_oss_attention_sinks_equal_generate():
    """gpt-oss's sinks through the paged attention: decodes alone and beside prefill
    chunks, chunks past a sliding window, waits and preemptions."""
    model = tiny_gpt_oss()
    core, g = serve_through_preemption(model, [10, 13, 30, 17, 26, 9], 24, seed=6)
    alone = make_seq(random_prompt(20, VOCAB_SIZE, g), request_id="alone", max_new_tokens=12)
    core.add(alone)  # one stream: the single-sequence decode path
    run_to_completion(core)
    assert_matches_generate(model, [alone])


def test_gpt_oss_is_refused_batch_invariant():
    with pytest.raises(ValueError, match="sinks"):
        make_core(tiny_gpt_oss(), batch_invariant=True)


def tiny_gemma4(**options) -> torch.nn.Module:
    """Gemma 4: its global layers' head size differs from its sliding layers' (a
    heterogeneous config: `head_dim` is per layer), the last layers reuse earlier layers'
    K/V (`num_kv_shared_layers`), per-layer input embeddings."""
    torch.manual_seed(7)
    layer_types = (["sliding_attention"] * 3 + ["full_attention"]) * 2
    config = AutoConfig.for_model(
        "gemma4_text",
        vocab_size=VOCAB_SIZE,
        vocab_size_per_layer_input=VOCAB_SIZE,
        hidden_size_per_layer_input=16,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        sliding_window=8,
        max_position_embeddings=1024,
        initializer_range=0.2,
        **options,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("shared", [0, 2], ids=["own-kv", "kv-shared"])
def test_gemma4_heads_of_two_sizes_equal_generate(shared):
    """Sliding layers of 16-value heads and global ones of 32 in one pool (each layer's
    blocks shaped as its own K/V), chunks past the window."""
    model = tiny_gemma4(num_kv_shared_layers=shared)
    serve_through_preemption(model, [10, 13, 30, 17, 26, 9], 24, seed=8)


def test_gemma4_kv_bytes_count_each_layers_head_size():
    """The pool's size per token sums each layer's heads: 6 sliding layers of 2 x 16
    values, 2 global ones of 2 x 32 (reading the config's one head_dim raises there)."""
    from textgen.service.replica.kv_sizing import kv_bytes_per_token

    model = tiny_gemma4()
    assert kv_bytes_per_token(model, torch.float32) == 2 * (6 * 2 * 16 + 2 * 2 * 32) * 4
    assert kv_bytes_per_token(model, torch.bfloat16) == 2 * (6 * 2 * 16 + 2 * 2 * 32) * 2


# Families whose attention transformers computes inline, served through our adapters
# (models/attention_adapters.py): each layout of the fused QKV, rotary and ALiBi.
ADAPTED = {
    # Falcon-7B: multi-query (one KV head), parallel attention and MLP, rotary
    "falcon-7b": ("falcon", {"multi_query": True, "parallel_attn": True, "bias": False}),
    # Falcon-40B/180B: grouped KV heads interleaved with their queries, two layer norms
    "falcon-40b": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    # Falcon-RW: a head's own QKV, sequential, ALiBi (slopes rounded to bfloat16)
    "falcon-rw": ("falcon", {"multi_query": False, "parallel_attn": False, "alibi": True}),
    "bloom": ("bloom", {"n_head": 4, "n_layer": 2}),
    "mpt": ("mpt", {"d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 1024}),
}


def tiny_adapted(name: str) -> torch.nn.Module:
    model_type, options = ADAPTED[name]
    torch.manual_seed(11)
    if model_type == "falcon":
        options = {"num_attention_heads": 4, "num_hidden_layers": 2, **options}
    config = AutoConfig.for_model(
        model_type, vocab_size=VOCAB_SIZE, hidden_size=64, initializer_range=0.2, **options
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("name", list(ADAPTED))
def test_adapted_family_equals_generate(name):
    """A mixed batch through waits and preemptions, then one stream decoding alone."""
    model = tiny_adapted(name)
    core, g = serve_through_preemption(model, [10, 13, 16, 19, 22, 25], 64, seed=5)
    alone = make_seq(random_prompt(20, VOCAB_SIZE, g), request_id="alone", max_new_tokens=12)
    core.add(alone)
    run_to_completion(core)
    assert_matches_generate(model, [alone])


@pytest.mark.parametrize("name", ["falcon-7b", "bloom"])
def test_adapted_family_speculating_equals_generate(name):
    """n-gram speculation's verification steps (several query tokens after cached ones)
    over the adapters, repetitive prompts so that proposals are taken."""
    from textgen.service.engine.speculation import SpeculationSettings

    model = tiny_adapted(name)
    core = make_core(model, speculation=SpeculationSettings(3, 8, adaptive=False))
    g = torch.Generator().manual_seed(9)
    seqs = [
        make_seq(random_prompt(6, VOCAB_SIZE, g) * 4, request_id=f"s{i}", max_new_tokens=16)
        for i in range(3)
    ]
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    assert_matches_generate(model, seqs)
    assert core.stats().spec_verifications > 0
    assert_idle(core)


def test_alibi_is_refused_batch_invariant():
    with pytest.raises(ValueError, match="ALiBi"):
        make_core(tiny_adapted("bloom"), batch_invariant=True)


def test_falcon_multi_query_pool_holds_one_kv_head():
    """Falcon-7B's config leaves num_kv_heads at the query heads' count; its cache holds
    one KV head (a pool sized from the config's count would be 4x, 71x for the real one,
    too few blocks)."""
    from textgen.service.replica.kv_sizing import kv_bytes_per_token

    model = tiny_adapted("falcon-7b")
    assert model.config.num_kv_heads == 4
    assert kv_bytes_per_token(model, torch.float32) == 2 * 2 * 1 * 16 * 4
    core = make_core(model)
    core.warm_up()
    assert core.runner.pool._layers[0].keys.shape[2] == 1


@pytest.mark.slow
def test_adapted_alibi_family_compiled_equals_generate():
    """--compile: the decode steps as one graph with the attention an opaque op that
    carries the ALiBi slopes (Falcon-RW: fused QKV of full heads, bfloat16 slopes)."""
    from textgen.service.engine.config import EngineConfig
    from textgen.service.engine.paged_core import PagedCore
    from textgen.service.engine.runners.compiled import CompiledRunner, CompileSettings

    from .factories import engine_copy

    model = tiny_adapted("falcon-rw")
    core = PagedCore(
        engine_copy(model),
        EngineConfig(
            max_batch_total_tokens=256,
            max_batch_prefill_tokens=64,
            max_batch_size=1,  # one graph to compile: a decode of one sequence
            block_size=8,
            compile=CompileSettings.for_engine(1),
        ),
    )
    core.warm_up()
    assert isinstance(core.runner, CompiledRunner)
    g = torch.Generator().manual_seed(12)
    seqs = [
        make_seq(random_prompt(9 + 5 * i, VOCAB_SIZE, g), request_id=f"c{i}", max_new_tokens=10)
        for i in range(3)
    ]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seq in seqs:
            core.add(seq)
        run_to_completion(core)
    assert_matches_generate(model, seqs)


def tiny_llama4() -> torch.nn.Module:
    """Llama 4's text model: rotary layers attending within chunks of 8 positions, a NoPE
    layer of global attention whose query temperature steps every 4 positions (the real
    model's floor_scale is 8192), a mixture of experts."""
    torch.manual_seed(13)
    config = AutoConfig.for_model(
        "llama4_text",
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=64,
        intermediate_size_mlp=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        attention_chunk_size=8,
        floor_scale=4,
        attn_scale=0.5,
        max_position_embeddings=1024,
        initializer_range=0.2,
    )
    assert "chunked_attention" in config.layer_types and 0 in config.no_rope_layers
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def test_llama4_chunked_attention_and_nope_temperature_equal_generate():
    """Chunks crossed by prompts and decodes, each token's own position in the NoPE
    layer's temperature (transformers' arange over a flattened batch would be wrong)."""
    model = tiny_llama4()
    core, g = serve_through_preemption(model, [10, 13, 30, 17, 26, 9], 24, seed=14)
    alone = make_seq(random_prompt(21, VOCAB_SIZE, g), request_id="alone", max_new_tokens=12)
    core.add(alone)
    run_to_completion(core)
    assert_matches_generate(model, [alone])


def test_llama4_chunked_attention_batch_invariant_equals_generate():
    model = tiny_llama4()
    core = make_core(model, batch_invariant=True, block_size=8)
    g = torch.Generator().manual_seed(15)
    seqs = [
        make_seq(random_prompt(7 + 6 * i, VOCAB_SIZE, g), request_id=f"i{i}", max_new_tokens=10)
        for i in range(3)
    ]
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    assert_matches_generate(model, seqs)


def test_mla_kv_bytes_count_each_heads_key_and_value():
    """DeepSeek's MLA caches, per attention head, K of nope + rope (16 + 8) and V of 16
    values: its config's head_dim (the rotary part alone) would count 2 x 8."""
    from textgen.service.replica.kv_sizing import kv_bytes_per_token

    config = AutoConfig.for_model(
        "deepseek_v3",
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    assert kv_bytes_per_token(model, torch.float32) == 2 * 4 * (16 + 8 + 16) * 4
    core = make_core(model, block_size=8)
    core.warm_up()
    keys, values = core.runner.pool._layers[0].keys, core.runner.pool._layers[0].values
    assert (keys.shape[2:], values.shape[2:]) == ((4, 24), (4, 16))
