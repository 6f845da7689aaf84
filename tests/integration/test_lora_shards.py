"""LoRA adapters on a sharded model (`--num-shard 2`, gloo on CPU): each rank slices an
adapter's A and B as its layers are sliced (column-parallel q/k/v/gate/up: B's rows;
row-parallel o/down: A's columns, summed by the layer's all-reduce), and every request's
greedy tokens equal one unsharded server's with the same adapters, in a mixed batch; a
replicated KV head (Qwen2, one KV head over two shards) slices B to its head."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import torch
from support.lora_adapters import make_adapter
from support.serve_process import textgen_serve
from support.servers import ServerThread, tiny_settings
from support.tiny_model import build_tiny_model
from textgen.sdk import Client
from textgen.sdk.errors import ValidationError
from transformers import AutoModelForCausalLM

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(600)]

ADAPTERS = {
    "attn": (8, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": (16, ["gate_proj", "up_proj", "down_proj"]),
}
PROMPTS = ["The quick brown fox", "def add(a, b):", "What is the capital of France?"]


def adapters_for(model_dir, root) -> str:
    """--lora-adapters for random adapters made with peft on the model in `model_dir`."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    specs = []
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items()):
        folder = make_adapter(base, root / name, rank, targets, seed, std=0.3, alpha=rank)
        specs.append(f"{name}={folder}")
    return ",".join(specs)


def greedy(target: str) -> list[list[int]]:
    """Every prompt under every adapter and the base, all at once."""
    asks = [(p, a) for p in PROMPTS for a in (None, *ADAPTERS)]

    def one(ask) -> list[int]:
        prompt, adapter = ask
        with Client(target, timeout=300) as client:
            out = client.generate(
                prompt, max_new_tokens=24, ignore_eos=True, details=True, adapter_id=adapter
            )
        return [t.id for t in out.details.tokens]

    with cf.ThreadPoolExecutor(len(asks)) as pool:
        return list(pool.map(one, asks))


def test_adapters_on_two_shards_equal_one(tmp_path):
    """On Qwen2's layout: its one KV head is replicated on both shards, the other layers
    sliced as Llama's are."""
    model_dir = build_tiny_model(tmp_path / "model", architecture="qwen2")
    lora = adapters_for(model_dir, tmp_path)
    pairs = tuple(tuple(spec.split("=")) for spec in lora.split(","))
    reference = ServerThread(tiny_settings(model_dir, lora_adapters=pairs)).start()
    try:
        expected = greedy(reference.target)
    finally:
        reference.stop()
    assert len({tuple(t) for t in expected}) == len(expected), "the adapters must matter"
    args = ["--model-id", str(model_dir), "--num-shard", "2", "--master-port", "0"]
    args += ["--dtype", "float32", "--no-envoy", "--grpc-port", "0", "--lora-adapters", lora]
    with textgen_serve(*args) as served:
        assert served.grpc_target, served.log[-3000:]
        served.drain_log()
        assert greedy(served.grpc_target) == expected
        with (
            Client(served.grpc_target, timeout=60) as client,
            pytest.raises(ValidationError, match="--num-shard > 1"),
        ):
            client.load_lora_adapter("again", str(tmp_path / "attn"))
