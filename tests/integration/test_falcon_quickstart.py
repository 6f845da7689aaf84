"""TGI's quick-start line, `text-generation-launcher --model-id tiiuae/falcon-7b-instruct
--num-shard 1 --quantize bitsandbytes`, on a tiny random model of Falcon-7B's layout
(multi-query: one KV head; attention and MLP in parallel; rotary), served through the
Falcon attention adapter (service/models/attention_adapters.py) with its Linear layers in
bitsandbytes 8-bit: greedy tokens equal transformers' own `generate` on the same folder
quantized the same way. transformers quantizes only exact `nn.Linear` layers and Falcon's
are a subclass (`FalconLinear`), so both sides build them as `nn.Linear`
(attention_adapters.plain_linears): without it the flag would leave Falcon dense."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest
import torch
from support.servers import ServerThread
from support.tiny_model import build_tokenizer
from textgen.service.models.attention_adapters import plain_linears
from textgen.service.proto import generate_pb2 as pb
from textgen.service.proto import text_generation_service_pb2_grpc as svc_grpc
from textgen.service.settings import tgi_launcher as launcher
from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

pytestmark = pytest.mark.timeout(300)

NEW_TOKENS = 16
PROMPTS = ["The quick brown fox", "What is the capital of France? The capital"]


@pytest.fixture(scope="module")
def falcon_7b_layout(tmp_path_factory):
    path = tmp_path_factory.mktemp("falcon-7b-layout")
    tokenizer = build_tokenizer()
    config = AutoConfig.for_model(
        "falcon",
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        multi_query=True,
        parallel_attn=True,
        new_decoder_architecture=False,
        alibi=False,
        bias=False,
        initializer_range=0.2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(21)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def library_generate(path, prompt: list[int], dtype: torch.dtype) -> list[int]:
    with plain_linears("falcon", wanted=True):
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, quantization_config=BitsAndBytesConfig(load_in_8bit=True)
        )
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.server
def test_tgis_quickstart_line_serves_falcon_7b_layout_in_8_bit(falcon_7b_layout):
    argv = ["--model-id", str(falcon_7b_layout), "--num-shard", "1", "--quantize", "bitsandbytes"]
    argv.append("--enable-prefill-logprobs")  # the prompt's ids come back in the details
    settings = launcher.settings_from(argv, environ={})
    settings = replace(settings, hostname="127.0.0.1", grpc_port=0, port=0, no_envoy=True)
    server = ServerThread(settings).start()
    try:
        loaded = server.replica.loaded
        qkv = loaded.model.transformer.h[0].self_attention.query_key_value
        assert type(qkv).__module__.startswith("bitsandbytes")
        with grpc.insecure_channel(server.target) as channel:
            stub = svc_grpc.TextGenerationServiceStub(channel)
            params = pb.GenerateParameters(
                max_new_tokens=NEW_TOKENS, ignore_eos=True, decoder_input_details=True
            )
            futures = [  # at once: one batch
                stub.Generate.future(pb.GenerateRequest(inputs=p, parameters=params), timeout=120)
                for p in PROMPTS
            ]
            outputs = [f.result() for f in futures]
    finally:
        server.stop()
    for out in outputs:
        prompt = [t.id for t in out.details.prefill]
        served = [t.id for t in out.details.tokens]
        assert served == library_generate(falcon_7b_layout, prompt, loaded.dtype)
