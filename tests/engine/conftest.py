"""Tiny random models for the engine tests (float32, fixed seeds, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

# the shared assertion helpers live in factories.py: give them pytest's assert messages
pytest.register_assert_rewrite("engine.factories", "tests.engine.factories")

from .factories import VOCAB_SIZE


def _sharpen(model: torch.nn.Module) -> torch.nn.Module:
    # No EOS in the reference: the engine tests set their own stop conditions.
    model.generation_config.eos_token_id = None
    return model.eval()


@pytest.fixture(scope="session")
def tiny_llama() -> torch.nn.Module:
    """2 layers, GQA (4 query heads over 2 KV heads). A large init range makes the logits
    sharp, so float32 rounding differences between batch layouts never flip a greedy pick."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
        attn_implementation="sdpa",
    )
    return _sharpen(LlamaForCausalLM(config))


@pytest.fixture(scope="session")
def tiny_mistral_sliding() -> torch.nn.Module:
    """Mistral with a 24-token sliding window: prompts longer than that test the window mask."""
    torch.manual_seed(1)
    config = MistralConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=24,
        max_position_embeddings=1024,
        initializer_range=0.2,
        attn_implementation="sdpa",
    )
    return _sharpen(MistralForCausalLM(config))


@pytest.fixture(scope="session")
def tiny_gemma2() -> torch.nn.Module:
    """Gemma2: attention logit soft-capping (our non-SDPA path) and alternating sliding/full
    layers (two windows, two masks per step)."""
    torch.manual_seed(2)
    config = Gemma2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=24,
        attn_logit_softcapping=50.0,
        max_position_embeddings=1024,
        initializer_range=0.2,
        attn_implementation="eager",
    )
    return _sharpen(Gemma2ForCausalLM(config))


@pytest.fixture(autouse=True, scope="module")
def single_intra_op_thread():
    """The tiny models' ops are microseconds long: a second intra-op thread only adds sync
    points, and on a shared 2-core machine every one of them can wait out another process's
    time slice (it made this suite 20x slower under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
