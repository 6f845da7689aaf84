"""Every model family the server serves, as a tiny random model built at test time from
transformers' own config class: one table, model_type -> the config's options
(`AutoConfig.for_model(model_type, **options)`), and `build_family`, which writes the
model (float32) and the tiny byte-level tokenizer (tiny_model.build_tokenizer) into a
normal Hugging Face folder.

The sizes are the smallest each config's constraints allow (hidden 64, 2 layers unless a
family needs more, 4 query heads of 16); sliding windows of 8 tokens, so that prompts and
decodes cross them; `initializer_range=0.2` (and unit logit scales), so that greedy
choices are well separated; a context of 1024 where the config states one. Bloom's
config states none: a server of it needs --max-total-tokens.
"""

from __future__ import annotations

from pathlib import Path

HIDDEN = 64
HEADS = 4
HEAD_DIM = HIDDEN // HEADS
WINDOW = 8
CONTEXT = 1024

# the options most configs name alike (Llama's)
_LLAMA_LIKE = {
    "hidden_size": HIDDEN,
    "intermediate_size": 2 * HIDDEN,
    "num_hidden_layers": 2,
    "num_attention_heads": HEADS,
    "num_key_value_heads": 2,
    "max_position_embeddings": CONTEXT,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
}
_MOE = {"intermediate_size": HIDDEN, "num_experts_per_tok": 2}
_TWO_KINDS = ["sliding_attention", "full_attention"]  # a window layer, then a global one
# DeepSeek's multi-head latent attention: low-rank Q and KV, a rotary part of each
# query/key head beside a position-free one, values of their own size
_MLA = {
    "num_key_value_heads": HEADS,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,  # layer 0 dense, layer 1 experts
}

# Untied: GPT-2, GPTBigCode, Bloom and MPT tie their output embeddings to the input ones;
# random and tied, in these GELU models of 2 layers, the greedy output mostly repeats one
# token whatever the prompt (which proves little about attention): untied, it doesn't.

FAMILIES: dict[str, dict] = {
    "llama": {**_LLAMA_LIKE},
    "mistral": {**_LLAMA_LIKE, "sliding_window": WINDOW},
    "qwen2": {**_LLAMA_LIKE, "num_key_value_heads": 1},  # q/k/v biases, one KV head
    "qwen3": {**_LLAMA_LIKE, "head_dim": HEAD_DIM},  # q/k norms
    "gemma2": {
        **_LLAMA_LIKE,
        "head_dim": HEAD_DIM,
        "query_pre_attn_scalar": HEAD_DIM,
        "sliding_window": WINDOW,  # and softcapping, alternating window layers
    },
    "gemma3_text": {
        **_LLAMA_LIKE,
        "head_dim": HEAD_DIM,
        "query_pre_attn_scalar": HEAD_DIM,
        "sliding_window": WINDOW,
        "layer_types": _TWO_KINDS,
    },
    "phi": {**_LLAMA_LIKE},  # partial rotary, parallel attention and MLP
    "phi3": {**_LLAMA_LIKE, "sliding_window": WINDOW},  # fused qkv and gate/up
    "granite": {
        **_LLAMA_LIKE,
        "embedding_multiplier": 4.0,
        "attention_multiplier": 1.0 / HEAD_DIM,
        "residual_multiplier": 0.5,
        "logits_scaling": 1.0,
    },
    "cohere": {**_LLAMA_LIKE, "logit_scale": 1.0, "use_qk_norm": True},
    "cohere2": {
        **_LLAMA_LIKE,
        "logit_scale": 1.0,
        "sliding_window": WINDOW,
        "layer_types": _TWO_KINDS,
    },
    "olmo2": {**_LLAMA_LIKE},
    "starcoder2": {**_LLAMA_LIKE, "sliding_window": WINDOW},
    "gpt_bigcode": {  # multi-query
        "n_embd": HIDDEN,
        "n_layer": 2,
        "n_head": HEADS,
        "n_positions": CONTEXT,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,  # untied: see above
    },
    "gpt_neox": {**_LLAMA_LIKE, "num_key_value_heads": None},  # a quarter of each head rotary
    "gptj": {
        "n_embd": HIDDEN,
        "n_layer": 2,
        "n_head": HEADS,
        "rotary_dim": 8,
        "n_positions": CONTEXT,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
    },
    "gpt2": {
        "n_embd": HIDDEN,
        "n_layer": 2,
        "n_head": HEADS,
        "n_positions": CONTEXT,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,  # untied: see above
    },
    "smollm3": {**_LLAMA_LIKE, "no_rope_layer_interval": 2},  # layer 1 without rotary
    "glm4": {**_LLAMA_LIKE, "head_dim": HEAD_DIM},
    "exaone4": {**_LLAMA_LIKE, "sliding_window": WINDOW, "layer_types": _TWO_KINDS},
    "seed_oss": {**_LLAMA_LIKE, "head_dim": HEAD_DIM},
    "mixtral": {**_LLAMA_LIKE, **_MOE, "num_local_experts": 4},
    "qwen2_moe": {
        **_LLAMA_LIKE,
        **_MOE,
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
    },
    "qwen3_moe": {
        **_LLAMA_LIKE,
        **_MOE,
        "head_dim": HEAD_DIM,
        "num_experts": 4,
        "moe_intermediate_size": 32,
    },
    "deepseek_v2": {**_LLAMA_LIKE, **_MLA, "topk_method": "greedy"},
    "deepseek_v3": {**_LLAMA_LIKE, **_MLA, "n_group": 1, "topk_group": 1},
    "phimoe": {**_LLAMA_LIKE, **_MOE, "num_local_experts": 4},
    "olmoe": {**_LLAMA_LIKE, **_MOE, "num_experts": 4},
    "granitemoe": {**_LLAMA_LIKE, **_MOE, "num_local_experts": 4},
    "glm4_moe": {
        **_LLAMA_LIKE,
        **_MOE,
        "head_dim": HEAD_DIM,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    },
    "ernie4_5_moe": {
        **_LLAMA_LIKE,
        "moe_num_experts": 4,
        "moe_k": 2,
        "moe_num_shared_experts": 1,
        "moe_intermediate_size": 32,
        "moe_layer_start_index": 1,
        "moe_layer_end_index": 1,
    },
    "stablelm": {**_LLAMA_LIKE, "use_parallel_residual": True, "qk_layernorm": True},
    "gpt_oss": {  # attention sinks (made large by build_family), experts
        **_LLAMA_LIKE,
        **_MOE,
        "head_dim": HEAD_DIM,
        "num_local_experts": 4,
        "sliding_window": WINDOW,
    },
    "gemma4_text": {  # global heads of 32 beside sliding ones of 16; the last 2 layers
        **_LLAMA_LIKE,  # reuse earlier layers' K/V; per-layer input embeddings
        "num_hidden_layers": 4,
        "layer_types": _TWO_KINDS * 2,
        "head_dim": HEAD_DIM,
        "global_head_dim": 2 * HEAD_DIM,
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 16,
        "sliding_window": WINDOW,
    },
    "falcon": {  # Falcon-7B's layout: multi-query, parallel attention and MLP, rotary
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "num_hidden_layers": 2,
        "multi_query": True,
        "parallel_attn": True,
        "bias": False,
        "max_position_embeddings": CONTEXT,
        "initializer_range": 0.2,
    },
    "bloom": {
        "hidden_size": HIDDEN,
        "n_head": HEADS,
        "n_layer": 2,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,  # untied: see above
    },
    "mpt": {
        "d_model": HIDDEN,
        "n_heads": HEADS,
        "n_layers": 2,
        "max_seq_len": CONTEXT,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,  # untied: see above
    },
    "llama4_text": {  # rotary layers attending within chunks of 8 positions, a NoPE
        **_LLAMA_LIKE,  # global layer whose query temperature steps every 4 positions
        **_MOE,
        "num_hidden_layers": 4,
        "intermediate_size_mlp": 2 * HIDDEN,
        "head_dim": HEAD_DIM,
        "num_local_experts": 2,
        "num_experts_per_tok": 1,
        "attention_chunk_size": WINDOW,
        "floor_scale": 4,
        "attn_scale": 0.5,
    },
}


# Hybrid and state-space families, apart from FAMILIES: layers that keep a convolution
# and/or recurrent state (transformers' linear-attention cache layers) instead of, or
# beside, a K/V cache. The same sizes as above where the config names them; the mixers'
# heads of 16 (2 * HIDDEN wide in all), SSM states of 16, conv kernels of 4, and SSM
# chunks of 16 so that a prompt spans several; as few layers as hold every kind.
_SSM_CHUNK = 16
# Mamba-2's mixer (Bamba, GraniteMoeHybrid, Falcon-H1): 8 heads of 16 = 2 * HIDDEN wide
_MAMBA2 = {
    "mamba_n_heads": 8,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_chunk_size": _SSM_CHUNK,
}
# Gated DeltaNet (Qwen3-Next, Qwen3.5): 2 key heads shared by 4 value heads, of 16
_GATED_DELTA = {
    "head_dim": HEAD_DIM,  # a quarter of each rotary (partial_rotary_factor 0.25)
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": HEAD_DIM,
    "linear_value_head_dim": HEAD_DIM,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "layer_types": ["linear_attention", "full_attention"],
}

STATE_FAMILIES: dict[str, dict] = {
    # Gated DeltaNet layer, then a gated full-attention one; experts and a shared expert
    "qwen3_next": {
        **_LLAMA_LIKE,
        **_MOE,
        **_GATED_DELTA,
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
    },
    "qwen3_5_text": {**_LLAMA_LIKE, **_GATED_DELTA},  # the same, dense
    # Mamba-2 layer, then a position-free attention one; experts and a shared MLP
    "granitemoehybrid": {
        **_LLAMA_LIKE,
        **_MOE,
        **_MAMBA2,
        "num_local_experts": 4,
        "shared_intermediate_size": 64,
        "layer_types": ["linear_attention", "full_attention"],
        "attention_multiplier": 1.0 / HEAD_DIM,
    },
    # Nemotron-H's pattern "M*-": Mamba-2 (2 groups) mixer, position-free attention, and
    # an MLP (squared ReLU) as layers of their own. Its prompt scan clamps dt to at least
    # time_step_min, its one-token step doesn't: transformers' decode differs by ~1e-3
    "nemotron_h": {
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "layers_block_type": ["linear_attention", "full_attention", "mlp"],
        "num_attention_heads": HEADS,
        "num_key_value_heads": 2,
        "head_dim": HEAD_DIM,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "n_groups": 2,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "chunk_size": _SSM_CHUNK,
        "max_position_embeddings": CONTEXT,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
    },
    # Mamba-1 layer with a dense MLP, then an attention layer with experts. Mamba-1's scan
    # (transformers' and mamba-ssm's) starts from a zero state: a prompt continued from a
    # cached state is not what transformers computes (nor are mamba's, falcon_mamba's)
    "jamba": {
        **_LLAMA_LIKE,
        **_MOE,
        "intermediate_size": 2 * HIDDEN,
        "num_experts": 4,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
    },
    # every layer attention and a Mamba-2 mixer side by side
    "falcon_h1": {**_LLAMA_LIKE, **_MAMBA2, "mamba_d_ssm": 2 * HIDDEN},
    # a short (gated, 3-tap) convolution layer, then an attention one
    "lfm2": {
        **_LLAMA_LIKE,
        "layer_types": ["conv", "full_attention"],
        "conv_L_cache": 3,
        "block_auto_adjust_ff_dim": False,  # else the MLP rounds up to 256
    },
    # Bamba's: a Mamba-2 layer, then an attention one
    "bamba": {**_LLAMA_LIKE, **_MAMBA2, "attn_layer_indices": [1]},
    # Mamba-1 only (its selective scan, no attention, no context length)
    "mamba": {
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "state_size": 16,
        "conv_kernel": 4,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
    },
    # the same with Falcon's B/C/dt norms
    "falcon_mamba": {
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "state_size": 16,
        "conv_kernel": 4,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
    },
    # Mamba-2 only: 8 heads of 16, 2 groups, its chunked scan
    "mamba2": {
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "num_heads": 8,
        "head_dim": 16,
        "n_groups": 2,
        "state_size": 16,
        "conv_kernel": 4,
        "chunk_size": _SSM_CHUNK,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
    },
    # Qwen3.5's MoE text model: Gated DeltaNet, gated attention, experts, a shared expert
    "qwen3_5_moe_text": {
        **_LLAMA_LIKE,
        **_MOE,
        **_GATED_DELTA,
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
    },
    # the vision-language configs: their causal LM is the text model alone (its folder
    # saves as qwen3_5_text / qwen3_5_moe_text); the vocabulary the tokenizer's (400)
    "qwen3_5": {"text_config": {**_LLAMA_LIKE, **_GATED_DELTA, "vocab_size": 400}},
    "qwen3_5_moe": {
        "text_config": {
            **_LLAMA_LIKE,
            **_MOE,
            **_GATED_DELTA,
            "num_experts": 4,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "vocab_size": 400,
        }
    },
    # Gated DeltaNet, then a sliding-window layer and a full-attention one; experts and a
    # shared expert
    "lara_mini": {
        **_LLAMA_LIKE,
        **_MOE,
        **_GATED_DELTA,
        "num_hidden_layers": 3,
        "layer_types": ["linear_attention", "sliding_attention", "full_attention"],
        "sliding_window": WINDOW,
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
    },
    # OLMo's hybrid: Gated DeltaNet (negative eigenvalues allowed), then q/k-normed attention
    "olmo_hybrid": {
        **_LLAMA_LIKE,
        **_GATED_DELTA,
        "pad_token_id": None,  # its default, 100277, is past the tiny vocabulary
    },
    # Kimi Delta Attention (per-channel gates), then MLA without rotary; dense, then experts
    "kimi_linear": {
        **_LLAMA_LIKE,
        **_MLA,
        "num_experts": 4,
        "linear_head_dim": HEAD_DIM,
        "linear_num_heads": 8,
        "linear_conv_kernel_dim": 4,
        "layer_types": ["linear_attention", "full_attention"],
        "pad_token_id": None,  # as OLMo-hybrid's
    },
    # Ling's hybrid: Kimi Delta Attention (4 heads of 16), then gated MLA; dense, then
    # experts and a shared expert
    "bailing_hybrid": {
        **_LLAMA_LIKE,
        **_MLA,
        "num_experts": 4,
        "n_group": 1,
        "topk_group": 1,
        "head_dim": HEAD_DIM,  # the delta layers' heads (the config keeps the rotary part's)
        "short_conv_kernel_size": 4,
        "layer_group_size": 2,  # a delta layer, then MLA
        "pad_token_id": None,  # as OLMo-hybrid's
    },
    # LFM2's with experts: a short convolution layer (dense MLP), then attention (experts)
    "lfm2_moe": {
        **_LLAMA_LIKE,
        **_MOE,
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "num_dense_layers": 1,
        "layer_types": ["conv", "full_attention"],
        "conv_L_cache": 3,
    },
    # LFM3: a short convolution, then a sliding-window and a global (partial rotary) layer,
    # gated attention and sandwich norms
    "lfm3": {
        **_LLAMA_LIKE,
        "num_hidden_layers": 3,
        "head_dim": HEAD_DIM,
        "layer_types": ["conv", "sliding_attention", "full_attention"],
        "sliding_window": WINDOW,
        "conv_L_cache": 3,
        "pad_token_id": None,  # as OLMo-hybrid's
    },
    # Zamba: Mamba layers, and hybrid ones running one shared attention block (its module's
    # layer_idx None: each hybrid layer passes its own), two of them
    "zamba": {
        **_LLAMA_LIKE,
        "num_hidden_layers": 3,
        "n_mamba_heads": 2,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
    },
    # Zamba 2: Mamba-2 layers, hybrid ones sharing an attention block likewise
    "zamba2": {
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": 3,
        "num_attention_heads": HEADS,
        "num_key_value_heads": 2,
        "n_mamba_heads": 8,
        "mamba_ngroups": 2,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "chunk_size": _SSM_CHUNK,
        "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
        "max_position_embeddings": CONTEXT,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
    },
    # ZAYA: hybrid layers whose state layer (a convolved attention projection) returns its
    # query, key and value
    "zaya": {
        **_LLAMA_LIKE,
        **_MOE,
        "head_dim": HEAD_DIM,
        "num_experts": 4,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 32,
        "router_hidden_size": 16,
        "layer_types": ["hybrid", "hybrid"],
    },
}

# the seed a family's weights are drawn with, where 0's model repeats one token (GPT-J's:
# its MLP's GELU mean, the same for every token, outweighs the token in the residual)
SEEDS = {"gptj": 1}


def family_config(model_type: str, tokenizer):
    """transformers' config for the family's tiny model, over `tokenizer`'s vocabulary."""
    from transformers import AutoConfig

    table = FAMILIES if model_type in FAMILIES else STATE_FAMILIES
    options = {k: v for k, v in table[model_type].items() if v is not None}
    vocab = len(tokenizer)
    if model_type == "gemma4_text":
        options["vocab_size_per_layer_input"] = vocab
    return AutoConfig.for_model(
        model_type,
        vocab_size=vocab,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **options,
    )


def build_family(
    model_type: str, path: Path, *, seed: int | None = None, bias_std: float | None = None
) -> Path:
    """Save the family's tiny random model (float32) and the tiny tokenizer into `path`
    (weights drawn with `seed`, else the family's in SEEDS, else 0; with `bias_std`, every
    bias, which transformers initializes to zero, drawn from N(0, bias_std) too)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from .tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    config = family_config(model_type, tokenizer)
    torch.manual_seed(SEEDS.get(model_type, 0) if seed is None else seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # attention sinks large enough to take a real share of each row
        for name, param in model.named_parameters():
            if name.endswith(".sinks"):
                param.normal_(0.0, 2.0)
            elif bias_std is not None and name.endswith("bias"):
                param.normal_(0.0, bias_std)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def library_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy `generate` on the folder's model (float32), each prompt
    alone, EOS not stopping it (as a request with ignore_eos): the new token ids."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # generate's eos_token_id=None keeps it
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),  # a prompt token equal to pad is a token
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=model.generation_config.pad_token_id or 0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs
