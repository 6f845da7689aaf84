"""The issue's check on the embedded model: three random LoRA adapters made with peft
(ranks 8, 16, 64 on other layers each), served by `textgen serve --lora-adapters` in
float32; each adapter's greedy answer equals peft's merged model's `generate` token for
token, alone and in a batch mixing the three with the base model."""

from __future__ import annotations

import concurrent.futures as cf
import copy
import signal

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from support.serve_process import textgen_serve
from support.tiers import server_fixture
from textgen.sdk import Client
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ADAPTERS = {
    "r8": (8, ["q_proj", "v_proj"]),
    "r16": (16, ["o_proj", "gate_proj", "down_proj"]),
    "r64": (64, ["k_proj", "up_proj", "q_proj", "v_proj"]),
}
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def embedded_dir():
    from textgen.service.models import ensure_embedded

    return ensure_embedded()


@pytest.fixture(scope="module")
def adapters(embedded_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-embedded")
    base = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32)
    folders = {}
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets)
        model = get_peft_model(base, config)
        with torch.no_grad():  # random, large enough to change the answers
            for param_name, param in model.named_parameters():
                if ".lora_A." in param_name:
                    param.normal_(0, param.shape[1] ** -0.5)
                elif ".lora_B." in param_name:
                    param.normal_(0, 0.04)
        model.save_pretrained(root / name)
        base = model.unload()
        folders[name] = str(root / name)
    return folders


@pytest.fixture(scope="module")
def expected(embedded_dir, adapters) -> dict[tuple[str | None, str], list[int]]:
    """peft's merged model's greedy tokens per (adapter, prompt), chat-templated."""
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    base = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32)
    out = {}
    for name in (None, *ADAPTERS):
        model = base
        if name is not None:
            merged = PeftModel.from_pretrained(copy.deepcopy(base), adapters[name])
            model = merged.merge_and_unload()
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer(templated(tokenizer, prompt)).input_ids])
            with torch.inference_mode():
                tokens = model.eval().generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=NEW_TOKENS,
                    eos_token_id=None,
                    pad_token_id=tokenizer.pad_token_id,
                )
            out[name, prompt] = tokens[0, ids.shape[1] :].tolist()
    return out


def templated(tokenizer, prompt: str) -> str:
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@server_fixture(scope="module")
def server(adapters):
    lora = ",".join(f"{name}={path}" for name, path in adapters.items())
    args = ["--no-envoy", "--grpc-port", "0", "--dtype", "float32", "--lora-adapters", lora]
    with textgen_serve(*args) as served:
        if not served.grpc_target:
            pytest.fail("textgen serve did not become ready:\n" + served.log[-3000:])
        served.drain_log()
        yield served.grpc_target
        served.proc.send_signal(signal.SIGTERM)
        served.proc.wait(60)


def ask(target: str, tokenizer, name: str | None, prompt: str) -> list[int]:
    with Client(target, timeout=600) as client:
        out = client.generate(
            templated(tokenizer, prompt),
            max_new_tokens=NEW_TOKENS,
            ignore_eos=True,
            details=True,
            adapter_id=name,
        )
    return [t.id for t in out.details.tokens]


def test_each_adapter_alone_and_mixed_equals_pefts_merged_model(server, expected, embedded_dir):
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    for name in ADAPTERS:  # each adapter changes some answer
        assert any(expected[name, p] != expected[None, p] for p in PROMPTS), name
    for name, prompt in expected:  # alone, one after another
        assert ask(server, tokenizer, name, prompt) == expected[name, prompt], (name, prompt)
    with cf.ThreadPoolExecutor(len(expected)) as pool:  # all at once
        mixed = dict(zip(expected, pool.map(lambda k: ask(server, tokenizer, *k), list(expected))))
    assert mixed == expected
