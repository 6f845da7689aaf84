"""Vision-language models on `--num-shard 2` through the real server (`textgen serve`, gloo
on CPU): the language model split as its text family's, the vision tower and projector on
every rank, each step's images (and M-RoPE rows, both-ways key limits) sent to the other
rank. Every answer's greedy tokens equal transformers' processor + generate on the same
folder (float32), with the image's placeholders cut across prefill chunks, each image alone
and two requests with other images in one batch."""

from __future__ import annotations

import concurrent.futures as cf
import io

import pytest
import torch
from support.serve_process import textgen_serve
from support.tiny_vlm import BUILDERS, png, transformers_processor
from textgen.sdk import Client

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(600)]

TEXT = "What is in the picture?"
MAX_NEW = 8
IMAGES = [png((200, 30, 30), stripes=True), png((30, 30, 200), (40, 16), stripes=True)]
# LLaVA's 16 placeholders, Qwen2.5-VL's and Qwen3-VL's (M-RoPE; deepstack) cut by chunks
# of 12; Gemma 3's attend to each other both ways, so one chunk holds them (and the
# prompt's text goes in the next), as PaliGemma's whole prompt (its prefix both ways)
PREFILL_TOKENS = {"llava": 12, "qwen2_5_vl": 12, "qwen3_vl": 12, "gemma3": 20, "paligemma": 49}


@torch.inference_mode()
def reference(folder, prompt: str, image: bytes) -> tuple[str, int]:
    """transformers' processor + greedy generate: the answer and its token count."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    processor = transformers_processor(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    picture = Image.open(io.BytesIO(image)).convert("RGB")
    inputs = processor(images=[picture], text=prompt, return_tensors="pt")
    out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW)
    ids = out[0, inputs["input_ids"].shape[1] :].tolist()
    return processor.tokenizer.decode(ids, skip_special_tokens=True), len(ids)


def chat_prompt(folder) -> str:
    """The chat template's prompt of one image and TEXT; without a template (PaliGemma),
    the placeholder first, as its processor expects."""
    processor = transformers_processor(folder)
    if processor.chat_template is None:
        return processor.image_token + TEXT
    content = [{"type": "image"}, {"type": "text", "text": TEXT}]
    return processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )


@pytest.mark.parametrize("family", list(PREFILL_TOKENS))
def test_two_shards_equal_generate(family, tmp_path):
    folder = BUILDERS[family](tmp_path / family)
    prompt = chat_prompt(folder)
    expected = [reference(folder, prompt, image) for image in IMAGES]
    args = ["--model-id", str(folder), "--num-shard", "2", "--master-port", "0"]
    args += ["--dtype", "float32", "--no-envoy", "--grpc-port", "0"]
    args += ["--max-batch-prefill-tokens", str(PREFILL_TOKENS[family])]
    with textgen_serve(*args) as served:
        assert served.grpc_target, served.log[-3000:]

        def answer(image: bytes) -> tuple[str, int]:
            with Client(served.grpc_target, timeout=300) as client:
                out = client.generate(prompt, images=[image], max_new_tokens=MAX_NEW)
            return out.generated_text, out.details.generated_tokens

        assert [answer(i) for i in IMAGES] == expected
        with cf.ThreadPoolExecutor(len(IMAGES)) as pool:  # both in one batch
            assert list(pool.map(answer, IMAGES)) == expected
