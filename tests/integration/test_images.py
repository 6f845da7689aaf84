"""Images in, through a real server and Envoy (issue 47's first family, a tiny LLaVA):
OpenAI chat with `image_url` data: URIs, Anthropic's image blocks, and TGI's /generate
with markdown images, give transformers' processor + `generate` on the same folder,
greedy, in float32; another image changes the answer as it changes the reference; two
requests with the same text and different images in one batch each get their own answer
(the prefix cache keeps their blocks apart); a bad image is a 422 naming its part, and the
server keeps serving; a text-only model refuses images by name (and reads TGI's markdown
as text, as TGI does)."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest
import requests
import torch
from support.servers import ServerThread, tiny_settings
from support.tiers import server_fixture
from support.tiny_vlm import build_tiny_llava, data_uri, png

pytestmark = pytest.mark.timeout(120)

TEXT = "What is in the picture?"
MAX_NEW = 8
RED, BLUE, GREEN = (200, 30, 30), (30, 30, 200), (30, 200, 30)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("llava") / "model")


@server_fixture(scope="module")
def llava_server(llava_dir):
    # a small prefill budget: a prompt's 16 image tokens are cut across steps
    settings = tiny_settings(llava_dir, max_batch_prefill_tokens=12)
    server = ServerThread(settings, http=True).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(llava_dir):
    """Greedy text of transformers' processor + generate for an image, in float32."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(llava_dir)
    model = AutoModelForImageTextToText.from_pretrained(llava_dir, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)

    @torch.inference_mode()
    def answer(image_png: bytes) -> tuple[str, int]:
        image = Image.open(io.BytesIO(image_png)).convert("RGB")
        inputs = processor(images=[image], text=prompt, return_tensors="pt")
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW)
        ids = out[0, inputs["input_ids"].shape[1] :].tolist()
        return processor.tokenizer.decode(ids, skip_special_tokens=True), len(ids)

    return answer


def body(uri: str, **extra) -> dict:
    content = [
        {"type": "image_url", "image_url": {"url": uri, **extra}},
        {"type": "text", "text": TEXT},
    ]
    return {
        "model": "tgi",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_NEW,
        "temperature": 0,
    }


def chat(server, request: dict) -> requests.Response:
    return requests.post(f"{server.http_url}/v1/chat/completions", json=request, timeout=60)


def answer(server, image_png: bytes, **extra) -> tuple[str, int]:
    resp = chat(server, body(data_uri(image_png), **extra))
    assert resp.status_code == 200, resp.text
    out = resp.json()
    return out["choices"][0]["message"]["content"], out["usage"]["completion_tokens"]


def test_openai_sdk_image_equals_generate(llava_server, reference):
    client = openai.OpenAI(
        base_url=f"{llava_server.http_url}/v1", api_key="unused", max_retries=0, timeout=60
    )
    image = png(RED, stripes=True)
    out = client.chat.completions.create(**body(data_uri(image)))
    expected_text, expected_tokens = reference(image)
    assert out.choices[0].message.content == expected_text
    assert out.usage.completion_tokens == expected_tokens
    # 16 image tokens, counted in the prompt
    assert out.usage.prompt_tokens > 16


def test_anthropic_sdk_image_block_equals_generate(llava_server, reference):
    """Anthropic's image block (base64 source) reaches the model as chat's image part; its
    count_tokens counts the image's tokens as create does."""
    client = anthropic.Anthropic(base_url=llava_server.http_url, api_key="unused", max_retries=0)
    image = png(RED, stripes=True)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(image).decode()}
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "source": source}, {"type": "text", "text": TEXT}],
        }
    ]
    out = client.messages.create(
        model="tgi", max_tokens=MAX_NEW, messages=messages, extra_body={"temperature": 0}
    )
    expected_text, expected_tokens = reference(image)
    assert (out.content[0].text, out.usage.output_tokens) == (expected_text, expected_tokens)
    counted = client.messages.count_tokens(model="tgi", messages=messages)
    assert counted.input_tokens == out.usage.input_tokens + out.usage.cache_read_input_tokens > 16


def test_another_image_changes_the_answer_as_the_reference(llava_server, reference):
    red, blue = png(RED, stripes=True), png(BLUE)
    assert answer(llava_server, red, detail="high") == reference(red)
    assert answer(llava_server, blue, detail="low") == reference(blue)
    assert reference(red)[0] != reference(blue)[0]  # the image reaches the answer


def test_same_text_other_images_in_one_batch(llava_server, reference):
    """Sent together (one batch), then again (prefix-cache hits): each its own answer."""
    images = [png(RED, stripes=True), png(BLUE), png(GREEN, stripes=True), png(BLUE)]
    before = llava_server.engine.stats().prefix_cache_hit_tokens
    with ThreadPoolExecutor(len(images)) as pool:
        for _ in range(2):
            answers = list(pool.map(lambda image: answer(llava_server, image), images))
            assert answers == [reference(image) for image in images]
    assert llava_server.engine.stats().prefix_cache_hit_tokens > before


def png_of_size(width: int, height: int) -> bytes:
    """A PNG whose header says width x height (Pillow refuses to write a 0 x 0 one)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data)
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    pixels = zlib.compress(b"")
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")
    )


NAME = "messages[0].content[0].image_url"


@pytest.mark.parametrize(
    ("uri", "says"),
    [
        (data_uri(b"not an image at all"), "is not an image"),
        (data_uri(png(RED)[:40]), "is not an image"),  # truncated
        (data_uri(png_of_size(0, 0)), NAME),
        ("data:image/png;base64,@@@not-base64@@@", "doesn't decode"),
        ("data:image/png,rawbytes", "base64 data: URI"),
        ("https://example.com/cat.png", "not fetched yet"),
    ],
)
def test_bad_images_are_typed_422s(llava_server, reference, uri, says):
    resp = chat(llava_server, body(uri))
    assert resp.status_code == 422, resp.text
    error = resp.json()["error"]
    assert error["type"] == "validation" and error["param"] == NAME
    assert says in error["message"] and NAME in error["message"]
    # and the server keeps serving
    image = png(GREEN, stripes=True)
    assert answer(llava_server, image) == reference(image)


def test_image_in_an_assistant_message_is_refused(llava_server):
    request = body(data_uri(png(RED)))
    request["messages"].insert(
        0, {"role": "assistant", "content": request["messages"][0]["content"]}
    )
    resp = chat(llava_server, request)
    assert resp.status_code == 422
    assert "user messages only" in resp.json()["error"]["message"]


def test_placeholder_in_text_without_image_is_refused(llava_server):
    request = body(data_uri(png(RED)))
    request["messages"][0]["content"] = "look: <image>"
    resp = chat(llava_server, request)
    assert resp.status_code == 422
    assert "image placeholders" in resp.json()["error"]["message"]


def test_text_only_model_refuses_images(http_server):
    resp = chat(http_server, body(data_uri(png(RED))))
    assert resp.status_code == 422
    error = resp.json()["error"]
    assert error["param"] == NAME and "text-only" in error["message"]


def test_text_prompt_to_the_vision_model(llava_server):
    """A conversation without images is served too."""
    request = body("")
    request["messages"][0]["content"] = TEXT
    resp = chat(llava_server, request)
    assert resp.status_code == 200, resp.text


def tgi_prompt(uri: str) -> str:
    """The chat prompt (tiny_vlm's template) with the image as TGI writes one: markdown."""
    return f"<|im_start|>user\n![]({uri}){TEXT}<|im_end|>\n<|im_start|>assistant\n"


def test_tgi_generate_markdown_image_equals_generate(llava_server, reference):
    image = png(BLUE, stripes=True)
    resp = requests.post(
        f"{llava_server.http_url}/generate",
        json={"inputs": tgi_prompt(data_uri(image)), "parameters": {"max_new_tokens": MAX_NEW}},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["generated_text"] == reference(image)[0]


def test_tgi_generate_bad_markdown_image_is_a_422(llava_server):
    resp = requests.post(
        f"{llava_server.http_url}/generate",
        json={"inputs": tgi_prompt("data:image/png;base64,AAAA"), "parameters": {}},
        timeout=60,
    )
    assert resp.status_code == 422, resp.text
    assert resp.json()["error_type"] == "validation"
    assert "`inputs (image 1)` is not an image" in resp.json()["error"]


def test_tgi_markdown_to_a_text_model_is_text(http_server):
    """As TGI does: only a vision-language model reads markdown images."""
    resp = requests.post(
        f"{http_server.http_url}/generate",
        json={"inputs": f"![]({data_uri(png(RED))})", "parameters": {"max_new_tokens": 2}},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text


def test_vllm_tokenize_with_an_image_is_refused_by_name(llava_server):
    request = body(data_uri(png(RED)))
    resp = requests.post(
        f"{llava_server.http_url}/tokenize", json={"messages": request["messages"]}, timeout=60
    )
    assert resp.status_code == 422, resp.text
    assert "/tokenize takes no images yet" in resp.text and NAME in resp.text
