"""The family matrix: every model family the server serves, through a real server.

Each family's tiny random model (tests/support/families.py: transformers' own config
class, float32) is served by a real in-process server (no Envoy) whose KV pool is five
blocks of 16 tokens, and a burst of requests is sent at once: prompts of 9 to 44 tokens
and one prompt twice, more than the pool holds together, so that some wait and running
ones are preempted (recomputed) as their decodes grow, prompts are chunked by a prefill
budget of 16 beside decodes, and the repeated prompt's blocks come from the prefix cache;
then the repeated prompt alone, twice: the second from the cache for sure (the burst's
own hits depend on the order its requests are admitted in). Every request's greedy tokens
(ignore_eos) equal transformers' `generate` on the same folder (EOS not stopping it).

The hybrid and state-space families (STATE_FAMILIES: Mamba, Gated DeltaNet and convolution
layers beside or instead of attention) run the same burst with their state pool: their
chunks carry each sequence's state from chunk to chunk, and prefix caching is off for them
(the repeated prompt is computed again, with the same tokens).

A family listed in NOT_SERVED stays in the matrix, an expected failure (strict) saying why.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from support.families import FAMILIES, STATE_FAMILIES, build_family, library_greedy
from support.servers import ServerThread, tiny_settings
from textgen.service.engine.config import every_layer_window
from textgen.service.proto import generate_pb2 as pb
from textgen.service.proto import text_generation_service_pb2 as svc_pb
from textgen.service.proto import text_generation_service_pb2_grpc as svc_grpc
from transformers import AutoConfig, AutoTokenizer

pytestmark = [pytest.mark.server, pytest.mark.timeout(120)]

NEW_TOKENS = 12
BLOCK = 16  # the server's KV block size (replica/kv_sizing.py)
REPEATED = (  # 32 tokens: two full blocks, the first one a prefix-cache hit when repeated
    "The quick brown fox jumps over the lazy dog. "
    "What is the capital of France? The capital of France is Paris."
)
PROMPTS = [  # 9, 15, 30, 44 and 32 tokens with the tiny tokenizer
    "Hi there, fox.",
    "What is the capital of France? The capital of France is Paris.",
    "def add(a, b):\n    return a + b\ntextgen serves large language models over gRPC and HTTP.",
    "Zebras quietly juggle xylophones. The quick brown fox jumps over the lazy dog.",
    REPEATED,
]
BURST = [*PROMPTS, REPEATED]
# five blocks of 16 for six requests of up to 56 tokens (four blocks)
LIMITS = {
    "max_total_tokens": 64,  # Bloom's config states no context: it needs one given
    "max_batch_total_tokens": 5 * BLOCK,
    "max_batch_prefill_tokens": BLOCK,
    "arrival_gap_ms": 20.0,  # the burst's requests start in one step
    "torch_threads": 1,  # see single_intra_op_thread
}
RPC_TIMEOUT = 60
KERNEL_SOURCES = {"torch", "causal_conv1d", "mamba_ssm", "fla", "gptqmodel"}

# model_type -> why the server doesn't serve it token for token (an xfail, strict)
NOT_SERVED: dict[str, str] = {}


@pytest.fixture(autouse=True, scope="module")
def single_intra_op_thread():
    """The tiny models' ops are microseconds long: a second intra-op thread only adds sync
    points, each of which can wait out another process's time slice on a shared machine
    (as tests/engine/conftest.py's). The server's engine thread likewise (LIMITS)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def families():
    return [
        pytest.param(
            model_type,
            marks=[pytest.mark.xfail(strict=True, reason=NOT_SERVED[model_type])]
            if model_type in NOT_SERVED
            else [],
            id=model_type,
        )
        for model_type in [*FAMILIES, *STATE_FAMILIES]
    ]


def request(prompt: str) -> pb.GenerateRequest:
    params = pb.GenerateParameters(max_new_tokens=NEW_TOKENS, ignore_eos=True, details=True)
    return pb.GenerateRequest(inputs=prompt, parameters=params)


@pytest.mark.parametrize("model_type", families())
def test_served_greedy_tokens_equal_generate(model_type, tmp_path):
    folder = build_family(model_type, tmp_path / model_type)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt_ids = {prompt: tokenizer(prompt)["input_ids"] for prompt in PROMPTS}
    expected = dict(zip(PROMPTS, library_greedy(folder, list(prompt_ids.values()), NEW_TOKENS)))

    server = ServerThread(tiny_settings(folder, **LIMITS)).start(timeout=120)
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = svc_grpc.TextGenerationServiceStub(channel)
            before = server.engine.stats()
            calls = [stub.Generate.future(request(p), timeout=RPC_TIMEOUT) for p in BURST]
            burst = [call.result() for call in calls]
            during = server.engine.stats()
            alone = stub.Generate(request(REPEATED), timeout=RPC_TIMEOUT)
            between = server.engine.stats()
            cached = stub.Generate(request(REPEATED), timeout=RPC_TIMEOUT)
            after = server.engine.stats()
            info = stub.Info(svc_pb.InfoRequest(), timeout=RPC_TIMEOUT)
    finally:
        server.stop()

    for prompt, out in [*zip(BURST, burst), (REPEATED, alone), (REPEATED, cached)]:
        assert out.details.input_length == len(prompt_ids[prompt]), prompt
        served = [t.id for t in out.details.tokens]
        assert served == expected[prompt], f"{len(prompt_ids[prompt])}-token prompt {prompt!r}"
    if every_layer_window(AutoConfig.from_pretrained(folder)) is None:
        assert during.preemptions > before.preemptions, "the small pool preempted nothing"
    else:  # the sequences give back what their window left: the pool's pressure is that
        assert during.window_released_blocks > before.window_released_blocks
    if model_type in STATE_FAMILIES:  # every sequence's slot back; nothing from a cache
        assert during.state_slots_total > 0 and after.state_slots_used == 0
        assert after.prefix_cache_hit_tokens == 0
        assert (info.state_slots, info.prefix_caching) == (during.state_slots_total, False)
        assert info.state_bytes_per_sequence > 0
        # transformers' torch code, or a kernel package it resolved (gptqmodel ships one)
        assert set(info.state_kernels.split(", ")) <= KERNEL_SOURCES, info.state_kernels
        return
    assert info.prefix_caching and not info.state_slots and not info.HasField("state_kernels")
    # the first of its two full blocks (the last prompt token is always computed)
    assert after.prefix_cache_hit_tokens - between.prefix_cache_hit_tokens == BLOCK
