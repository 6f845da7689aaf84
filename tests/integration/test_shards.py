"""`--num-shard N` through the real server: `textgen serve` starts its shard processes
(gloo on CPU), and every request's greedy tokens equal those of one unsharded server
(float32), for mixed batches, prefix-cache hits, preemption, aborts and a grammar; the
architectures whose attention differs (GQA with a replicated KV head and q/k/v biases,
sliding windows, softcapping), an 8-bit KV cache, and the embedded model on 3 shards; more
families (Qwen3, Gemma 3, Phi-3's fused q|k|v and gate|up, DeepSeek-V3's latent attention
and experts, gpt-oss's attention sinks) split in 2 and equal transformers' own greedy
generate; a shard killed under load ends the streams typed and the server exits non-zero."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import signal
import time

import pytest
from support.families import build_family, library_greedy
from support.serve_process import textgen_serve
from support.servers import ServerThread, tiny_settings
from support.tiny_model import build_tiny_model
from textgen.sdk import Client, TextGenError
from textgen.service.engine.config import every_layer_window
from textgen.service.models.shard_layout import ShardingError, ShardLayout, shard_layout
from textgen.service.models.sharding import tp_plan_overrides
from transformers import AutoConfig, AutoTokenizer

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(600)]

PROMPTS = [
    "The quick brown fox",
    "What is the capital of France? The capital",
    "def add(a, b):",
    "日本語のテキスト、中文文本",
    "textgen serves large language models over gRPC and HTTP. " * 3,
]
# a KV pool too small for every request at once: the scheduler preempts and recomputes
LIMITS = ["--max-total-tokens", "128", "--max-batch-total-tokens", "192"]


def sharded(model_dir, num_shard: int, *extra: str):
    args = ["--model-id", str(model_dir), "--num-shard", str(num_shard), "--master-port", "0"]
    args += ["--dtype", "float32", "--no-envoy", "--grpc-port", "0", *extra]
    return textgen_serve(*args)


def unsharded(model_dir, **overrides):
    settings = tiny_settings(
        model_dir, max_total_tokens=128, max_batch_total_tokens=192, **overrides
    )
    return ServerThread(settings).start()


def greedy(target: str, prompts=PROMPTS, max_new_tokens: int = 40) -> list[list[int]]:
    """Every prompt at once (a mixed batch: prefills beside decodes): their token ids."""

    def one(prompt: str) -> list[int]:
        with Client(target, timeout=300) as client:
            out = client.generate(
                prompt, max_new_tokens=max_new_tokens, ignore_eos=True, details=True
            )
        return [t.id for t in out.details.tokens]

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def metric(target: str, name: str) -> float:
    with Client(target, timeout=30) as client:
        text = client.metrics()
    found = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.fixture(scope="module")
def llama_pair(tiny_model_dir):
    """The tiny Llama unsharded (in process) and on 2 shards (`textgen serve`), these with
    --speculate 3 (every decode verifying: --no-speculate-adaptive): greedy and seeded tokens
    are the same with it as without."""
    reference = unsharded(tiny_model_dir)
    try:
        with sharded(
            tiny_model_dir, 2, *LIMITS, "--speculate", "3", "--no-speculate-adaptive"
        ) as served:
            assert served.grpc_target, served.log[-3000:]
            served.drain_log()
            yield reference.target, served
    finally:
        reference.stop()


def test_two_shards_equal_one(llama_pair):
    one, served = llama_pair
    two = served.grpc_target
    with Client(two, timeout=30) as client:
        info = client.info()
    assert info.num_shard == 2
    before = metric(two, "textgen_preemptions")
    assert greedy(two) == greedy(one)
    assert metric(two, "textgen_preemptions") > before, "the load preempted nothing"
    # n choices fork the prompt's blocks (a shared partial block copied on first write):
    # the copy reaches every shard's pool
    body = {"prompt": PROMPTS[1], "n": 3, "seed": 7, "max_tokens": 20, "temperature": 1.0}
    choices = []
    for target in (one, two):
        with Client(target, timeout=120) as client:
            choices.append([c["text"] for c in client.completions(body)["choices"]])
    assert choices[0] == choices[1] and len(set(choices[1])) > 1, choices


def test_prefix_hits_grammar_and_an_abort(llama_pair):
    one, served = llama_pair
    two = served.grpc_target
    prompt = "What is the capital of France? The capital of France is Paris. " * 2
    hits = metric(two, "textgen_prefix_cache_hit_tokens")
    for target in (one, two):  # twice: the second is served from the prefix cache
        assert greedy(target, [prompt]) == greedy(target, [prompt])
    assert greedy(two, [prompt]) == greedy(one, [prompt])
    assert metric(two, "textgen_prefix_cache_hit_tokens") > hits

    regex = {"type": "regex", "value": "[0-9]{3}-[a-z]{4}"}
    texts = []
    for target in (one, two):
        with Client(target, timeout=120) as client:
            texts.append(
                client.generate("The code is", max_new_tokens=12, grammar=regex).generated_text
            )
    assert texts[0] == texts[1] and re.fullmatch("[0-9]{3}-[a-z]{4}", texts[1]), texts

    with Client(two, timeout=120) as client:  # a stream walked away from mid-generation
        stream = client.generate_stream("The quick brown fox", max_new_tokens=100, ignore_eos=True)
        for _ in range(3):
            next(stream)
        stream.close()
    deadline = time.monotonic() + 30
    while metric(two, "textgen_kv_cache_blocks_used") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(two, "textgen_kv_cache_blocks_used") == 0
    assert greedy(two, PROMPTS[:2]) == greedy(one, PROMPTS[:2])  # and it serves on


def test_speculation_on_two_shards(llama_pair):
    """--speculate on a sharded model: each verification chunk crosses to the other rank as
    any step does (its kept rows are more logits rows), and the tokens are the same."""
    one, served = llama_pair
    two = served.grpc_target
    repeating = [p * 3 for p in PROMPTS[:3]]
    proposed = metric(two, "textgen_speculative_proposed_tokens")
    assert greedy(two, repeating) == greedy(one, repeating)
    assert metric(two, "textgen_speculative_proposed_tokens") > proposed


@pytest.mark.parametrize(
    ("architecture", "kv_cache_dtype"),
    [("qwen2", None), ("gemma2", None), ("mistral", "fp8_e4m3fn")],
)
def test_other_attention_layouts(architecture, kv_cache_dtype, tmp_path):
    """Each layout's slices on 2 shards give transformers' greedy tokens. Mistral's with an
    8-bit KV cache (--kv-cache-dtype reaches every shard: each rank's pool of its heads is
    8-bit, and the tokens are those of one server with the same 8-bit pool)."""
    model_dir = build_tiny_model(tmp_path / architecture, architecture=architecture)
    if kv_cache_dtype is None:  # generate itself (a server start saved)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        expected = library_greedy(model_dir, [tokenizer(p)["input_ids"] for p in PROMPTS], 40)
    else:
        reference = unsharded(model_dir, kv_cache_dtype=kv_cache_dtype)
        try:
            expected = greedy(reference.target)
        finally:
            reference.stop()
    extra = ["--kv-cache-dtype", kv_cache_dtype] if kv_cache_dtype else []
    with sharded(model_dir, 2, *LIMITS, *extra) as served:
        assert served.grpc_target, served.log[-3000:]
        served.drain_log()
        if kv_cache_dtype:
            assert "shard 1 of 2 ready on cpu (KV cache float8_e4m3fn)" in served.log
            assert f"kv_cache_dtype={kv_cache_dtype}" in served.log
        assert greedy(served.grpc_target) == expected


def test_the_embedded_model_on_three_shards():
    """SmolLM2-135M: 9 heads and 3 KV heads split in 3 (in 2 they don't: test_preflight)."""
    from textgen.service.models import ensure_embedded

    prompts = ["What is the capital of France?", PROMPTS[0]]
    folder = ensure_embedded()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    expected = library_greedy(folder, [tokenizer(p)["input_ids"] for p in prompts], 16)
    common = ["--dtype", "float32", "--no-envoy", "--grpc-port", "0", *LIMITS]
    with textgen_serve(*common, "--num-shard", "3", "--master-port", "0") as served:
        assert served.grpc_target, served.log[-3000:]
        served.drain_log()
        assert greedy(served.grpc_target, prompts, 16) == expected
        with Client(served.grpc_target, timeout=30) as client:
            assert client.info().num_shard == 3
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(60) == 0


def test_a_dead_shard_ends_the_streams_typed_and_the_server(tiny_model_dir):
    """TGI's streams and OpenAI's end with textgen's incomplete_generation naming the rank
    killed, not the transport's words (gloo's `pair.cc ... Read error`)."""
    with sharded(tiny_model_dir, 2) as served:
        assert served.grpc_target, served.log[-3000:]
        served.drain_log()
        shard_pid = int(re.search(r"started shards \[1\] \(pids \[(\d+)\]\)", served.log).group(1))
        started = cf.ThreadPoolExecutor(4)
        chat = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 400,
            "ignore_eos": True,
        }

        def stream(face: str) -> tuple[str, str]:
            with Client(served.grpc_target, timeout=120) as client:
                if face == "openai":
                    events = client.chat_completions_stream(chat)
                else:
                    events = client.generate_stream("hello", max_new_tokens=400, ignore_eos=True)
                try:
                    for _ in events:
                        pass
                except TextGenError as exc:
                    return exc.error_type, exc.message
            return "finished", ""

        streams = [started.submit(stream, face) for face in ("tgi", "tgi", "tgi", "openai")]
        with Client(served.grpc_target, timeout=30) as client:
            deadline = time.monotonic() + 60
            while metric(served.grpc_target, "textgen_requests_running") < 4:
                assert time.monotonic() < deadline, "the four streams never ran together"
                time.sleep(0.1)
            os.kill(shard_pid, signal.SIGKILL)
            killed = time.monotonic()
            serving = True
            while serving and time.monotonic() - killed < 10:
                try:
                    serving = client.health(timeout=1)
                except TextGenError:  # the server is gone already
                    serving = False
        assert not serving, "still SERVING 10 s after its shard died"
        ends = [s.result(timeout=60) for s in streams]
        started.shutdown()
        served.proc.wait(30)
        took = time.monotonic() - killed
    lost = f"shard 1 (pid {shard_pid}) exited with code -9: generation can't go on"
    assert ends == [("incomplete_generation", lost)] * 4, ends
    assert served.proc.returncode not in (0, None)
    assert took < 10, f"the server took {took:.1f}s to exit"


# model_type -> why `--num-shard 2` refuses it: ShardingError from the check each rank makes
# of transformers' plan before reading a weight (models/sharding.py; strict xfails, so that
# a transformers whose plan does split them says so)
REFUSED_ON_SHARDS: dict[str, str] = {}
# what differs from the layouts above: Qwen3's q/k norms, Gemma 3's alternating window
# layers (q/k norms, scaled embeddings), Phi-3's fused q|k|v and gate|up (sharding.py's
# FUSED_PLANS: transformers' gathers them whole), DeepSeek-V3's multi-head latent attention
# (sharding.py's ATTENTION_PLANS: transformers' leaves it whole) and routed experts split by
# intermediate features (EXPERT_PLANS), a dense first layer and a shared expert, gpt-oss's
# attention sinks (sharding.py's own plan for its attention: transformers' splits only the
# embedding) and biased q/k/v/o, experts
FAMILIES_ON_SHARDS = ("qwen3", "gemma3_text", "phi3", "deepseek_v3", "gpt_oss")
# 7, 9 and 48 tokens (a window of 8 crossed, a block of 16 filled): 2, 2 and 4 blocks with
# their 16 new tokens, in a pool of 6
FAMILY_PROMPTS = [PROMPTS[0], PROMPTS[1], PROMPTS[4]]
FAMILY_NEW_TOKENS = 16
FAMILY_LIMITS = ["--max-total-tokens", "64", "--max-batch-total-tokens", "96"]


def two_shard_plan(folder) -> tuple[ShardLayout, dict[str, str]]:
    """How each of 2 ranks loads the folder's model, checked as the ranks check it before
    reading a weight: the layout of its heads, and the plan (the model's with textgen's
    overrides); ShardingError where refused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    layout = shard_layout(json.loads((folder / "config.json").read_text()), 2)
    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    overrides = tp_plan_overrides(model_class, config, layout)
    plan = dict(model_class._tp_plan or {})
    plan.update({f"model.{k}": v for k, v in config.base_model_tp_plan.items()})
    return layout, {**plan, **overrides}


@pytest.mark.parametrize(
    "model_type",
    [
        pytest.param(
            model_type,
            marks=[
                pytest.mark.xfail(
                    strict=True, raises=ShardingError, reason=REFUSED_ON_SHARDS[model_type]
                )
            ]
            if model_type in REFUSED_ON_SHARDS
            else [],
        )
        for model_type in FAMILIES_ON_SHARDS
    ],
)
def test_more_families_on_two_shards(model_type, tmp_path):
    """Each family's tiny random model (tests/support/families.py; biases drawn, not zero)
    really splits in 2, each rank 2 of the 4 query heads and 1 of the 2 KV heads (gpt-oss:
    and those heads' sinks), and its greedy tokens on 2 shards, under preemption, are
    transformers' own `generate` on the folder (one server start per family, not two).
    Phi-3's fused q|k|v loads whole, each rank then keeping its heads' rows of each (sharding.py's
    localize), and its gate|up loads packed: each rank its share of each half. DeepSeek-V3's
    latent attention: each rank 2 of the 4 heads (q_b_proj and kv_b_proj by heads, the latents
    whole), its pool 2 heads' K and V as kv_b_proj expands them; its experts each rank's share
    of every expert's features, their output all-reduced."""
    folder = build_family(model_type, tmp_path / model_type, bias_std=0.2)
    layout, plan = two_shard_plan(folder)
    kv_heads = 4 if model_type == "deepseek_v3" else 2  # MLA: K/V per query head
    assert (layout.num_heads, layout.num_kv_heads, layout.kv_heads_per_rank) == (
        4,
        kv_heads,
        kv_heads // 2,
    )
    if model_type == "deepseek_v3":
        mla = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
        assert {p: plan.get(f"model.layers.*.self_attn.{p}") for p in mla} == {
            "q_a_proj": None,  # whole on every rank, as kv_a_proj_with_mqa
            "q_b_proj": "colwise",
            "kv_a_proj_with_mqa": None,
            "kv_b_proj": "colwise",
            "o_proj": "rowwise",
        }
        experts = ("experts.gate_up_proj", "experts.down_proj", "experts", "gate")
        assert {p: plan.get(f"model.layers.*.mlp.{p}") for p in experts} == {
            "experts.gate_up_proj": "packed_colwise",
            "experts.down_proj": "rowwise",
            "experts": "moe_tp_experts",
            "gate": None,
        }
    elif model_type == "phi3":
        fused = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
        layer = {p: plan.get(f"model.layers.*.{p}") for p in fused}
        assert layer == {
            "self_attn.qkv_proj": "replicate",
            "self_attn.o_proj": "rowwise",
            "mlp.gate_up_proj": "packed_colwise",
            "mlp.down_proj": "rowwise",
        }
    else:
        attention = {
            p: plan.get(f"model.layers.*.self_attn.{p}_proj") for p in ("q", "k", "v", "o")
        }
        assert attention == {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}
    if model_type == "gpt_oss":
        assert plan["model.layers.*.self_attn.sinks"] == "colwise"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in FAMILY_PROMPTS]
    expected = library_greedy(folder, prompt_ids, FAMILY_NEW_TOKENS)
    with sharded(folder, 2, *FAMILY_LIMITS) as served:
        assert served.grpc_target, served.log[-3000:]
        served.drain_log()
        two = served.grpc_target
        assert greedy(two, FAMILY_PROMPTS, FAMILY_NEW_TOKENS) == expected
        if every_layer_window(AutoConfig.from_pretrained(folder)) is None:
            assert metric(two, "textgen_preemptions") > 0, "the load preempted nothing"
        else:  # Phi-3's window: the sequences give back its blocks instead of waiting
            assert metric(two, "textgen_kv_blocks_window_released") > 0
