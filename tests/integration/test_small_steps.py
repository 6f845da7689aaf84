"""A server with --dtype auto on a CPU without native bf16 (the CPU detection patched, so
this runs the same on any machine): /info says what auto chose and why, and its greedy
tokens equal transformers' generate on the same model with the same int8 copies for small
steps (service/models/small_steps.py)."""

from __future__ import annotations

import grpc
import pytest
import torch
from support.servers import ServerThread, tiny_settings
from support.tiers import server_fixture
from textgen.service.models.small_steps import SMALL_STEP_ROWS, add_small_step_weights
from textgen.service.proto import generate_pb2 as pb
from textgen.service.proto import text_generation_service_pb2 as svc
from textgen.service.proto import text_generation_service_pb2_grpc as svc_grpc
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.timeout(180)


@server_fixture(scope="module")
def auto_server(tiny_model_dir):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("textgen.service.models.loader.cpu_has_native_bf16", lambda: False)
        server = ServerThread(tiny_settings(tiny_model_dir, dtype="auto")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stub(auto_server):
    with grpc.insecure_channel(auto_server.target) as channel:
        yield svc_grpc.TextGenerationServiceStub(channel)


def test_info_says_what_auto_chose_and_why(stub):
    info = stub.Info(svc.InfoRequest(), timeout=30)
    assert info.model_dtype == "float32"
    assert info.small_step_int8_tokens == SMALL_STEP_ROWS[torch.float32]
    assert info.dtype_reason.startswith("float32: this CPU has no native bf16")
    assert f"steps of up to {SMALL_STEP_ROWS[torch.float32]} tokens read int8" in info.dtype_reason


def greedy(model, tokenizer, prompt: str, new_tokens: int) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


# prompts whose greedy continuation through the int8 copies parts from float32's within 40
# tokens on the tiny model: the served tokens must follow the copies', not float32's
@pytest.mark.parametrize(
    "prompt", ["What is the capital of France? The capital of", "def add(a, b):", "日本語"]
)
def test_greedy_tokens_equal_generate_with_the_same_copies(stub, tiny_model_dir, prompt):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    exact = greedy(model, tokenizer, prompt, 40)
    assert add_small_step_weights(model) > 0
    expected = greedy(model, tokenizer, prompt, 40)
    assert expected != exact  # the prompt tells the two apart
    request = pb.GenerateRequest(
        inputs=prompt, parameters=pb.GenerateParameters(max_new_tokens=40, details=True)
    )
    response = stub.Generate(request, timeout=60)
    assert [t.id for t in response.details.tokens] == expected
