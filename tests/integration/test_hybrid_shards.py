"""Hybrid models on `--num-shard 2` through the real server (gloo on CPU): Qwen3-Next's and
Qwen3.5's Gated DeltaNet layers split by heads as their attention is (sharding.py's
STATE_PLANS: each rank its key heads and the value heads reading them, their projection
rows, convolution channels and decay parameters; the output projection row-parallel; each
rank's state pool its heads' states), and greedy tokens, in a mixed batch with chunked
prefill and a preemption, equal transformers' own `generate` on the folder."""

from __future__ import annotations

import pytest
import torch
from support.families import build_family, library_greedy
from textgen.sdk import Client
from textgen.service.models.sharding import STATE_PLANS
from textgen.service.models.state_layers import probe_states, state_bytes_per_sequence
from transformers import AutoModelForCausalLM, AutoTokenizer

from .test_shards import greedy, metric, sharded, two_shard_plan

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(600)]

PROMPTS = [  # 5, 10 and 48 tokens: the last one in chunks of 16
    "The quick brown fox",
    "What is the capital of France? The capital",
    "textgen serves large language models over gRPC and HTTP. " * 3,
]
NEW_TOKENS = 16
LIMITS = ["--max-total-tokens", "64", "--max-batch-total-tokens", "96"]
LIMITS += ["--max-batch-prefill-tokens", "16"]


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text"])
def test_gated_deltanet_models_on_two_shards_equal_generate(model_type, tmp_path):
    folder = build_family(model_type, tmp_path / model_type)
    layout, plan = two_shard_plan(folder)
    assert (layout.num_heads, layout.kv_heads_per_rank) == (4, 1)
    state = {k.rpartition(".")[2]: plan[f"model.{k}"] for k in STATE_PLANS[model_type]}
    assert state["out_proj"] == "rowwise"  # and the inputs split (or cut) by heads
    assert all(style in ("colwise", "replicate") for k, style in state.items() if k != "out_proj")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    expected = library_greedy(folder, [tokenizer(p)["input_ids"] for p in PROMPTS], NEW_TOKENS)
    with sharded(folder, 2, *LIMITS) as served:
        assert served.grpc_target, served.log[-3000:]
        served.drain_log()
        two = served.grpc_target
        assert greedy(two, PROMPTS, NEW_TOKENS) == expected
        assert metric(two, "textgen_preemptions") > 0, "the load preempted nothing"
        assert metric(two, "textgen_state_slots_used") == 0
        with Client(two, timeout=30) as client:
            info = client.info()
    # each rank's state pool holds its half of the heads' states
    whole = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert info.num_shard == 2
    assert 2 * info.state_bytes_per_sequence == state_bytes_per_sequence(probe_states(whole))
