"""Images in, through a real server and Envoy (issue 47's first family, a tiny LLaVA):
OpenAI chat with `image_url` data: URIs, Anthropic's image blocks, and TGI's /generate
with markdown images, give transformers' processor + `generate` on the same folder,
greedy, in float32; another image changes the answer as it changes the reference; two
requests with the same text and different images in one batch each get their own answer
(the prefix cache keeps their blocks apart); a bad image is a 422 naming its part, and the
server keeps serving; a text-only model refuses images by name (and reads TGI's markdown
as text, as TGI does). http(s) image URLs, served by a local http.server, give the same
answers as data: URIs; a private address the server isn't allowed, a 404 and too many
images are 422s."""

from __future__ import annotations

import base64
import io
import ipaddress
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import openai
import pytest
import requests
import torch
from support.replica_processes import wait_until
from support.servers import ServerThread, tiny_settings
from support.tiers import server_fixture
from support.tiny_vlm import BUILDERS, build_tiny_llava, data_uri, png, transformers_processor

pytestmark = pytest.mark.timeout(120)

TEXT = "What is in the picture?"
MAX_NEW = 8
RED, BLUE, GREEN = (200, 30, 30), (30, 30, 200), (30, 200, 30)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("llava") / "model")


@server_fixture(scope="module")
def llava_server(llava_dir):
    # a small prefill budget: a prompt's 16 image tokens are cut across steps; image URLs
    # at 127.0.0.1 only (the test's image server), not the rest of loopback
    settings = tiny_settings(
        llava_dir,
        max_batch_prefill_tokens=12,
        allow_private_image_urls=(ipaddress.ip_network("127.0.0.1/32"),),
        max_images_per_request=3,
    )
    server = ServerThread(settings, http=True).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference_of(llava_dir):
    """Greedy text and token count of transformers' processor + generate for a
    conversation (chat template messages) and its images (PNG bytes), in float32."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(llava_dir)
    model = AutoModelForImageTextToText.from_pretrained(llava_dir, dtype=torch.float32).eval()

    @torch.inference_mode()
    def answer(messages: list[dict], images_png: list[bytes]) -> tuple[str, int]:
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
        images = [Image.open(io.BytesIO(i)).convert("RGB") for i in images_png]
        inputs = processor(images=images, text=prompt, return_tensors="pt")
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW)
        ids = out[0, inputs["input_ids"].shape[1] :].tolist()
        return processor.tokenizer.decode(ids, skip_special_tokens=True), len(ids)

    return answer


@pytest.fixture(scope="module")
def reference(reference_of):
    """The answer to one user message: an image, then TEXT."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}]
    return lambda image_png: reference_of(messages, [image_png])


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
        ("https://10.0.0.1/cat.png", "private"),
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


def tokenize(server, body: dict) -> requests.Response:
    return requests.post(f"{server.http_url}/tokenize", json=body, timeout=60)


@pytest.mark.parametrize("add_special_tokens", [None, True])
def test_vllm_tokenize_counts_the_image_tokens(llava_server, llava_dir, add_special_tokens):
    """vLLM's /tokenize of a conversation with an image: the processor's ids for the
    templated prompt (the image's placeholder expanded to its 16 tokens), as many as the
    chat's usage counts for the same messages."""
    from PIL import Image
    from transformers import AutoProcessor

    request = body(data_uri(png(RED)))
    extra = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
    resp = tokenize(llava_server, {"messages": request["messages"], **extra})
    assert resp.status_code == 200, resp.text
    tokens = resp.json()["tokens"]
    processor = AutoProcessor.from_pretrained(llava_dir)
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}],
        add_generation_prompt=True,
    )
    picture = Image.open(io.BytesIO(png(RED))).convert("RGB")
    expected = processor(
        images=[picture], text=prompt, add_special_tokens=bool(add_special_tokens)
    )["input_ids"][0]
    assert tokens == list(expected)
    assert tokens.count(processor.image_token_id) == 16
    assert resp.json()["count"] == len(tokens)
    if add_special_tokens:  # what the chat's prompt is: the engine's prompts take them
        usage = chat(llava_server, request).json()["usage"]
        assert usage["prompt_tokens"] == len(tokens)


def test_vllm_tokenize_bad_image_is_a_422_naming_it(llava_server):
    resp = tokenize(llava_server, {"messages": body("data:image/png;base64,AAAA")["messages"]})
    assert resp.status_code == 422, resp.text
    assert NAME in resp.text


def test_vllm_tokenize_image_to_a_text_model_is_refused_by_name(http_server):
    resp = tokenize(http_server, {"messages": body(data_uri(png(RED)))["messages"]})
    assert resp.status_code == 422, resp.text
    assert "text-only" in resp.text and NAME in resp.text


# Past LLaVA (issue 47, step 2): each family's tiny model through a real server, OpenAI
# chat with images of other sizes (other token counts), chunks of 12 cutting them (and
# Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's text after its images at their M-RoPE
# positions); a family without chat template (PaliGemma) through TGI's /generate, as TGI
# served it
FAMILIES = [
    "llava_next", "idefics3", "smolvlm", "gemma3", "mistral3", "llava_pixtral", "paligemma",
    "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
]  # fmt: skip
# Gemma 3's 16 image tokens attend to each other both ways: one chunk holds them; so does
# PaliGemma's whole prompt (49 tokens with two images)
PREFILL_TOKENS = {"gemma3": 20, "paligemma": 49}
NO_CHAT_TEMPLATE = {"paligemma"}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def family_dir(family, tmp_path_factory):
    return BUILDERS[family](tmp_path_factory.mktemp(family) / "model")


@server_fixture(scope="module")
def family_server(family, family_dir):
    budget = PREFILL_TOKENS.get(family, 12)
    server = ServerThread(tiny_settings(family_dir, max_batch_prefill_tokens=budget), http=True)
    server.start()
    yield server
    server.stop()


@torch.inference_mode()
def family_reference(family_dir, images: list[bytes]) -> str:
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    # transformers' own (PixtralProcessor without torchvision: from its source)
    processor = transformers_processor(family_dir)
    model = AutoModelForImageTextToText.from_pretrained(family_dir, dtype=torch.float32).eval()
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": TEXT}]
    if processor.chat_template is None:  # the placeholders first, as the processor expects
        prompt = processor.image_token * len(images) + TEXT
    else:
        prompt = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True
        )
    pictures = [Image.open(io.BytesIO(image)).convert("RGB") for image in images]
    inputs = processor(images=pictures, text=prompt, return_tensors="pt")
    out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW)
    ids = out[0, inputs["input_ids"].shape[1] :].tolist()
    return processor.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "images",
    [
        [png(RED, stripes=True)],
        [png(BLUE, (40, 16), stripes=True)],
        [png(GREEN, (16, 40)), png(RED, stripes=True)],
    ],
    ids=["20x24", "40x16", "two"],
)
def test_family_chat_images_equal_generate(family, family_server, family_dir, images):
    """Through OpenAI chat; a family without chat template through TGI's /generate (each
    image as markdown, placed first as the processor places them), its chat refused."""
    request = body(data_uri(images[0]))
    parts = [{"type": "image_url", "image_url": {"url": data_uri(i)}} for i in images]
    request["messages"][0]["content"] = [*parts, {"type": "text", "text": TEXT}]
    resp = chat(family_server, request)
    if family in NO_CHAT_TEMPLATE:
        assert resp.status_code == 422, resp.text
        assert "cannot apply the chat template" in resp.text
        markdown = "".join(f"![]({data_uri(i)})" for i in images)
        resp = requests.post(
            f"{family_server.http_url}/generate",
            json={"inputs": markdown + TEXT, "parameters": {"max_new_tokens": MAX_NEW}},
            timeout=60,
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["generated_text"] == family_reference(family_dir, images)
        return
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == family_reference(family_dir, images)


def test_family_tgi_markdown_and_grpc_images_equal_generate(family_server, family_dir):
    """The family's image through TGI's /generate (a markdown image where the template,
    or the processor's layout, puts the placeholder /info names) and gRPC's typed images
    (the SDK): the reference's answer on both faces."""
    from textgen.sdk import Client

    image = png(RED, stripes=True)
    processor = transformers_processor(family_dir)
    content = [{"type": "image"}, {"type": "text", "text": TEXT}]
    if processor.chat_template is None:  # the placeholder first, as the processor expects
        prompt = processor.image_token + TEXT
    else:
        prompt = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True
        )
    info = requests.get(f"{family_server.http_url}/info", timeout=30).json()
    placeholder = info["image_token"]
    assert prompt.count(placeholder) == 1
    expected = family_reference(family_dir, [image])
    markdown = prompt.replace(placeholder, f"![]({data_uri(image)})")
    resp = requests.post(
        f"{family_server.http_url}/generate",
        json={"inputs": markdown, "parameters": {"max_new_tokens": MAX_NEW}},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["generated_text"] == expected
    with Client(family_server.target, timeout=60) as sdk:
        out = sdk.generate(prompt, images=[image], max_new_tokens=MAX_NEW)
    assert out.generated_text == expected


# image URLs -----------------------------------------------------------------------------

IMAGES = {"/red.png": png(RED, stripes=True), "/blue.png": png(BLUE)}
# /slow.png: /red.png once the test opens this gate (never: a 503 after 30 s)
SLOW_GATE = threading.Event()


class ImageHandler(BaseHTTPRequestHandler):
    def do_GET(self):  # http.server calls it by this name
        self.server.paths.append(self.path)
        if self.path == "/slow.png" and not SLOW_GATE.wait(30):
            self.send_response(503)
            self.end_headers()
            return
        data = IMAGES.get(self.path.replace("/slow", "/red"))
        self.send_response(200 if data else 404)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(data or b"")))
        self.end_headers()
        self.wfile.write(data or b"")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    """An http.server on every loopback address: (port, the paths it was asked for)."""
    server = ThreadingHTTPServer(("0.0.0.0", 0), ImageHandler)
    server.daemon_threads = True
    server.paths = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], server.paths
    server.shutdown()
    server.server_close()


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=60
    )


def test_an_image_url_equals_the_same_image_inline(llava_server, reference, image_host):
    port, _ = image_host
    client = openai_client(llava_server)
    url = f"http://127.0.0.1:{port}/red.png"
    by_url = client.chat.completions.create(**body(url))
    inline = client.chat.completions.create(**body(data_uri(IMAGES["/red.png"])))
    assert by_url.choices[0].message.content == inline.choices[0].message.content
    assert by_url.choices[0].message.content == reference(IMAGES["/red.png"])[0]
    assert by_url.usage == inline.usage


def test_two_image_urls_in_one_request(llava_server, image_host):
    """Fetched side by side; each named by its part, in order."""
    port, _ = image_host
    request = body(f"http://127.0.0.1:{port}/red.png")
    request["messages"][0]["content"].insert(
        0, {"type": "image_url", "image_url": {"url": f"http://127.0.0.1:{port}/blue.png"}}
    )
    assert chat(llava_server, request).status_code == 200
    missing = f"http://127.0.0.1:{port}/missing.png"
    request["messages"][0]["content"][1]["image_url"]["url"] = missing
    resp = chat(llava_server, request)
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"]["param"] == "messages[0].content[1].image_url"


@pytest.mark.parametrize(
    ("host", "path", "says"),
    [
        ("127.0.0.2", "/red.png", "private"),  # loopback, but not the network allowed
        ("127.0.0.1", "/missing.png", "HTTP 404"),
    ],
)
def test_a_url_that_is_not_fetched_is_a_422(llava_server, reference, image_host, host, path, says):
    port, _ = image_host
    url = f"http://{host}:{port}{path}"
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        openai_client(llava_server).chat.completions.create(**body(url))
    error = refused.value.body
    assert error["type"] == "validation" and error["param"] == NAME
    assert NAME in error["message"] and url in error["message"] and says in error["message"]
    image = png(GREEN, stripes=True)  # and the server keeps serving
    assert answer(llava_server, image) == reference(image)


def test_a_slow_url_holds_no_other_request(llava_server, reference, image_host):
    """While two requests wait on their image's server (which answers only when the test
    lets it), another is answered: the fetches run off the event loop (chat's parse and
    TGI's validation on worker threads); on it, the third request would wait for them."""
    port, paths = image_host
    slow = f"http://127.0.0.1:{port}/slow.png"
    tgi = {"inputs": tgi_prompt(slow), "parameters": {"max_new_tokens": MAX_NEW}}
    SLOW_GATE.clear()
    asked = paths.count("/slow.png")
    with ThreadPoolExecutor(2) as pool:
        waiting = [
            pool.submit(chat, llava_server, body(slow)),
            pool.submit(requests.post, f"{llava_server.http_url}/generate", json=tgi, timeout=60),
        ]
        try:
            assert wait_until(lambda: paths.count("/slow.png") == asked + 2, timeout=30)
            image = png(GREEN, stripes=True)
            assert answer(llava_server, image) == reference(image)
            assert all(not w.done() for w in waiting)
        finally:
            SLOW_GATE.set()
        expected = reference(IMAGES["/red.png"])
        assert waiting[0].result().json()["choices"][0]["message"]["content"] == expected[0]
        assert waiting[1].result().json()["generated_text"] == expected[0]


def test_tgi_generate_markdown_url_equals_generate(llava_server, reference, image_host):
    port, _ = image_host
    resp = requests.post(
        f"{llava_server.http_url}/generate",
        json={
            "inputs": tgi_prompt(f"http://127.0.0.1:{port}/blue.png"),
            "parameters": {"max_new_tokens": MAX_NEW},
        },
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["generated_text"] == reference(IMAGES["/blue.png"])[0]


def test_more_images_than_the_limit_are_refused_by_name(llava_server, image_host):
    """--max-images-per-request 3: the fourth part is named, and nothing is fetched."""
    port, paths = image_host
    request = body(data_uri(png(RED)))
    url = {"type": "image_url", "image_url": {"url": f"http://127.0.0.1:{port}/red.png?n"}}
    request["messages"][0]["content"][1:1] = [url] * 3
    resp = chat(llava_server, request)
    assert resp.status_code == 422, resp.text
    error = resp.json()["error"]
    assert error["param"] == "messages[0].content[3].image_url"
    assert "at most 3 images" in error["message"]
    assert "/red.png?n" not in paths
    resp = requests.post(
        f"{llava_server.http_url}/generate",
        json={"inputs": "![](data:,) " * 4, "parameters": {"max_new_tokens": 2}},
        timeout=60,
    )
    assert resp.status_code == 422, resp.text
    assert "`inputs (image 4)`: a request holds at most 3 images" in resp.json()["error"]


def test_a_text_only_model_fetches_no_url(http_server, image_host):
    port, paths = image_host
    resp = chat(http_server, body(f"http://127.0.0.1:{port}/red.png?text-only"))
    assert resp.status_code == 422
    assert "text-only" in resp.json()["error"]["message"]
    assert "/red.png?text-only" not in paths


# the Responses API ------------------------------------------------------------------------


def image_input(url: str) -> list[dict]:
    image = {"type": "input_image", "image_url": url, "detail": "auto"}
    return [{"role": "user", "content": [image, {"type": "input_text", "text": TEXT}]}]


def test_responses_input_image_equals_generate(llava_server, reference, image_host):
    """As a data: URI and as a URL, through the openai SDK's client.responses.create."""
    port, _ = image_host
    client = openai_client(llava_server)
    image = IMAGES["/blue.png"]
    for url in (data_uri(image), f"http://127.0.0.1:{port}/blue.png"):
        out = client.responses.create(
            model="tgi", input=image_input(url), max_output_tokens=MAX_NEW, temperature=0
        )
        assert (out.output_text, out.usage.output_tokens) == reference(image)
    items = client.responses.input_items.list(out.id).data
    assert items[0].content[0].type == "input_image"
    assert items[0].content[0].image_url == url


def test_a_continuation_keeps_the_images(llava_server, reference_of):
    """previous_response_id: the stored conversation's image is read again and the
    answer is the reference's for the whole conversation; a new image may join it."""
    client = openai_client(llava_server)
    red, blue = png(RED, stripes=True), png(BLUE)
    first = client.responses.create(
        model="tgi", input=image_input(data_uri(red)), max_output_tokens=MAX_NEW, temperature=0
    )
    turn = [{"type": "input_image", "image_url": data_uri(blue)}]
    turn.append({"type": "input_text", "text": "And this one?"})
    second = client.responses.create(
        model="tgi",
        previous_response_id=first.id,
        input=[{"role": "user", "content": turn}],
        max_output_tokens=MAX_NEW,
        temperature=0,
    )
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this one?"}]},
    ]
    assert (second.output_text, second.usage.output_tokens) == reference_of(messages, [red, blue])


@pytest.mark.parametrize(
    ("part", "param", "says"),
    [
        ({"type": "input_image", "image_url": "data:image/png;base64,AAAA"}, "image_url", "not an"),
        ({"type": "input_image", "file_id": "file_1"}, "file_id", "files are not served"),
        ({"type": "input_image", "image_url": "https://10.0.0.1/a.png"}, "image_url", "private"),
    ],
)
def test_responses_bad_images_are_typed_422s(llava_server, part, param, says):
    client = openai_client(llava_server)
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.responses.create(
            model="tgi", input=[{"role": "user", "content": [part]}], max_output_tokens=2
        )
    error = refused.value.body
    assert error["type"] == "validation" and error["param"] == f"input[0].content[0].{param}"
    assert says in error["message"]
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.responses.create(
            model="tgi", input=[{"role": "assistant", "content": [part]}], max_output_tokens=2
        )
    assert "user messages only" in refused.value.body["message"]


# gRPC's typed images (GenerateRequest.images) and the SDK -------------------------------

# the chat prompt (tiny_vlm's template) with the image's placeholder
GRPC_PROMPT = f"<|im_start|>user\n<image>{TEXT}<|im_end|>\n<|im_start|>assistant\n"


def test_sdk_generate_with_an_image_equals_generate(llava_server, reference, image_host, tmp_path):
    """As bytes, a path, a PIL image and a URL: each the reference's answer."""
    from PIL import Image
    from textgen.sdk import Client

    port, _ = image_host
    image = IMAGES["/red.png"]
    path = tmp_path / "red.png"
    path.write_bytes(image)
    pil = Image.open(io.BytesIO(image))
    url = f"http://127.0.0.1:{port}/red.png"
    expected = reference(image)
    with Client(llava_server.target, timeout=60) as sdk:
        for given in (image, path, str(path), pil, url, data_uri(image)):
            out = sdk.generate(GRPC_PROMPT, images=[given], max_new_tokens=MAX_NEW)
            assert (out.generated_text, out.details.generated_tokens) == expected
        streamed = sdk.generate_stream(GRPC_PROMPT, images=[image], max_new_tokens=MAX_NEW)
        assert "".join(m.token.text for m in streamed if not m.token.special) == expected[0]


@pytest.mark.parametrize(
    ("images", "prompt", "says"),
    [
        ([b"not an image"], GRPC_PROMPT, "`images[0]` is not an image"),
        ([png(RED), "http://127.0.0.2:1/a.png"], GRPC_PROMPT * 2, "`images[1]`: the image wasn't"),
        ([png(RED)], TEXT, "holds 0 image placeholders (<image>) for 1 images"),
        ([png(RED)], f"![]({data_uri(png(RED))}) <image>", "markdown images takes no `images`"),
    ],
)
def test_sdk_bad_images_are_invalid_argument_naming_them(
    llava_server, reference, images, prompt, says
):
    from textgen.sdk import Client, ValidationError

    with Client(llava_server.target, timeout=60) as sdk:
        with pytest.raises(ValidationError) as refused:
            sdk.generate(prompt, images=images, max_new_tokens=2)
        assert refused.value.code.name == "INVALID_ARGUMENT"
        assert says in str(refused.value)
        image = png(GREEN, stripes=True)  # and the server keeps serving
        out = sdk.generate(GRPC_PROMPT, images=[image], max_new_tokens=MAX_NEW)
        assert out.generated_text == reference(image)[0]


def test_tgi_generate_images_field(llava_server, reference, image_host):
    """The typed images through the transcoder: base64 `data`, or `url`."""
    import base64

    port, _ = image_host
    image = IMAGES["/blue.png"]
    for source in (
        {"data": base64.b64encode(image).decode()},
        {"url": f"http://127.0.0.1:{port}/blue.png"},
    ):
        resp = requests.post(
            f"{llava_server.http_url}/generate",
            json={
                "inputs": GRPC_PROMPT,
                "images": [source],
                "parameters": {"max_new_tokens": MAX_NEW},
            },
            timeout=60,
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["generated_text"] == reference(image)[0]
    resp = requests.post(
        f"{llava_server.http_url}/generate",
        json={"inputs": GRPC_PROMPT, "images": [{}], "parameters": {}},
        timeout=60,
    )
    assert resp.status_code == 422, resp.text
    assert resp.json()["error_type"] == "validation" and "images[0]" in resp.json()["error"]


def test_a_text_only_model_refuses_typed_images(http_server):
    from textgen.sdk import Client, ValidationError

    text_only = "`images\\[0\\]`: this model is text-only"
    sdk = Client(http_server.target, timeout=60)
    with sdk, pytest.raises(ValidationError, match=text_only):
        sdk.generate("hi <image>", images=[png(RED)], max_new_tokens=2)


# /info and /metrics ---------------------------------------------------------------------


def test_info_says_the_model_takes_images(llava_server, http_server):
    info = requests.get(f"{llava_server.http_url}/info", timeout=30).json()
    assert (info["takes_images"], info["image_token"], info["max_images_per_request"]) == (
        True,
        "<image>",
        3,
    )
    text = requests.get(f"{http_server.http_url}/info", timeout=30).json()
    assert (text["takes_images"], text["max_images_per_request"]) == (False, 0)
    assert "image_token" not in text


def scrape(server) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{server.http_url}/metrics", timeout=30).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith(("textgen_request_images", "textgen_image_encode"))
        and "bucket" not in sample.name
    }


def test_metrics_count_images_and_encoder_time(llava_server):
    """Two images never seen before (so encoded, not from the encoder cache) in one
    request: one observation of 2 images, two of encoder time."""
    before = scrape(llava_server)
    request = body(data_uri(png((1, 2, 3), stripes=True)))
    image = {"type": "image_url", "image_url": {"url": data_uri(png((3, 2, 1)))}}
    request["messages"][0]["content"].insert(0, image)
    assert chat(llava_server, request).status_code == 200
    deadline = time.monotonic() + 10  # observed as the handler ends, after the answer
    while (after := scrape(llava_server)).get("textgen_request_images_count", 0) == before.get(
        "textgen_request_images_count", 0
    ) and time.monotonic() < deadline:
        time.sleep(0.05)
    count, total = "textgen_request_images_count", "textgen_request_images_sum"
    assert after[count] - before.get(count, 0) == 1
    assert after[total] - before.get(total, 0) == 2
    encoded = "textgen_image_encode_duration_seconds_count"
    assert after[encoded] - before.get(encoded, 0) == 2
    seconds = "textgen_image_encode_duration_seconds_sum"
    assert after[seconds] > before.get(seconds, 0)
