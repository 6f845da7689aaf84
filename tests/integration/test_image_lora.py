"""A LoRA adapter on a vision-language model's language model (a tiny LLaVA, the adapter
peft's on the whole model) through a real server: OpenAI chat with an image picks it by
`model`, the SDK by `adapter_id`, in process and on `--num-shard 2` (`textgen serve`, gloo),
each answer PeftModel's greedy generate from transformers' processor's inputs, and not the
base model's; an adapter on the vision tower is refused at start, naming its layer."""

from __future__ import annotations

import copy
import io

import pytest
import requests
import torch
from peft import PeftModel
from support.lora_adapters import make_adapter
from support.serve_process import textgen_serve
from support.servers import ServerThread, tiny_settings
from support.tiers import server_fixture
from support.tiny_vlm import build_tiny_llava, data_uri, png, transformers_processor
from textgen.sdk import Client

pytestmark = pytest.mark.timeout(300)

TEXT = "What is in the picture?"
MAX_NEW = 8
IMAGE = png((200, 30, 30), stripes=True)
# the language model's layers (a regex: the CLIP tower has q_proj and v_proj too)
LANGUAGE_TARGETS = r".*language_model.*\.(q_proj|v_proj|o_proj|gate_proj|down_proj)"


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("llava") / "model")


@pytest.fixture(scope="module")
def adapter_dir(llava_dir, tmp_path_factory) -> str:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(llava_dir, dtype=torch.float32)
    folder = tmp_path_factory.mktemp("adapter") / "lang"
    return make_adapter(model, folder, 8, LANGUAGE_TARGETS, seed=5, std=0.3)


def chat_prompt(processor) -> str:
    content = [{"type": "image"}, {"type": "text", "text": TEXT}]
    return processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )


@pytest.fixture(scope="module")
def expected(llava_dir, adapter_dir) -> dict[str | None, str]:
    """PeftModel's (and the base model's: None) greedy answer to the image and TEXT."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    processor = transformers_processor(llava_dir)
    base = AutoModelForImageTextToText.from_pretrained(llava_dir, dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir).eval()
    picture = Image.open(io.BytesIO(IMAGE)).convert("RGB")
    inputs = processor(images=[picture], text=chat_prompt(processor), return_tensors="pt")
    out = {}
    for name, model in ((None, base), ("lang", peft)):
        with torch.inference_mode():
            tokens = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW)
        ids = tokens[0, inputs["input_ids"].shape[1] :].tolist()
        out[name] = processor.tokenizer.decode(ids, skip_special_tokens=True)
    assert out["lang"] != out[None], "the adapter must matter"
    return out


@server_fixture(scope="module")
def server(llava_dir, adapter_dir):
    settings = tiny_settings(
        llava_dir,
        max_batch_prefill_tokens=12,  # the image's 16 placeholders cut across chunks
        lora_adapters=(("lang", adapter_dir),),
        max_loras=1,
    )
    server = ServerThread(settings, http=True).start()
    yield server
    server.stop()


def test_chat_model_picks_the_adapter(server, expected, llava_dir):
    for model in ("lang", str(llava_dir)):  # the adapter, the base model
        body = {
            "model": model,
            "max_tokens": MAX_NEW,
            "temperature": 0,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_uri(IMAGE)}},
                        {"type": "text", "text": TEXT},
                    ],
                }
            ],
        }
        resp = requests.post(f"{server.http_url}/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        answer = resp.json()["choices"][0]["message"]["content"]
        assert answer == expected["lang" if model == "lang" else None], model


def sdk_answers(target: str, prompt: str) -> dict[str | None, str]:
    with Client(target, timeout=120) as client:
        return {
            name: client.generate(
                prompt, images=[IMAGE], adapter_id=name, max_new_tokens=MAX_NEW
            ).generated_text
            for name in ("lang", None)
        }


def test_sdk_adapter_id_with_an_image(server, expected, llava_dir):
    prompt = chat_prompt(transformers_processor(llava_dir))
    assert sdk_answers(server.target, prompt) == expected


@pytest.mark.slow
@pytest.mark.server
def test_the_adapter_on_two_shards(llava_dir, adapter_dir, expected):
    args = ["--model-id", str(llava_dir), "--num-shard", "2", "--master-port", "0"]
    args += ["--dtype", "float32", "--no-envoy", "--grpc-port", "0"]
    args += ["--max-batch-prefill-tokens", "12", "--lora-adapters", f"lang={adapter_dir}"]
    with textgen_serve(*args) as served:
        assert served.grpc_target, served.log[-3000:]
        prompt = chat_prompt(transformers_processor(llava_dir))
        assert sdk_answers(served.grpc_target, prompt) == expected


@pytest.mark.server
def test_an_adapter_on_the_vision_tower_is_refused_at_start(llava_dir, tmp_path):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(llava_dir, dtype=torch.float32)
    folder = make_adapter(model, tmp_path / "vision", 4, ["q_proj"], seed=6)  # CLIP's too
    args = ["--model-id", str(llava_dir), "--dtype", "float32", "--no-envoy"]
    args += ["--grpc-port", "0", "--lora-adapters", f"vision={folder}"]
    with textgen_serve(*args) as served:
        assert served.proc.wait(120) != 0
    assert "model.vision_tower." in served.log and "vision tower or projector" in served.log
