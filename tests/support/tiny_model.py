"""A tiny random Llama-architecture model and a byte-level BPE tokenizer, built at
test time in a second or two, saved as a normal Hugging Face folder."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "textgen serves large language models over gRPC and HTTP.",
    "日本語のテキスト、中文文本、emoji 🎉🚀 and accents: café, naïve, Ångström.",
    "def add(a, b):\n    return a + b\n",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


# Other architectures of the same size, for what differs between them (tests/integration/
# test_shards.py): Qwen2's biased q/k/v (here one KV head: shards replicate it), Mistral's
# sliding window, Gemma2's softcapping, scaled embeddings and alternating window layers.
ARCHITECTURES = ("llama", "qwen2", "mistral", "gemma2")


def build_tiny_model(
    path: Path, *, seed: int = 0, layers: int = 2, architecture: str = "llama"
) -> Path:
    """Save a tiny random model (float32, Llama unless asked) and its tokenizer into `path`."""
    import torch
    import transformers
    from transformers import GenerationConfig

    tokenizer = build_tokenizer()
    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
    }
    extra = {
        "llama": {},
        "qwen2": {"num_key_value_heads": 1},
        "mistral": {"sliding_window": 8},
        "gemma2": {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16},
    }[architecture]
    name = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral", "gemma2": "Gemma2"}
    config = getattr(transformers, f"{name[architecture]}Config")(**{**common, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name[architecture]}ForCausalLM")(config)
    # sharper logits than the default init, so greedy choices are well separated
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id
    )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
