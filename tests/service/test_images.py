"""Images as the faces receive them (intake/images.py), without a server: data: URIs
decode or are refused naming the part; TGI's markdown images become the processor's
placeholders; the processor's expansion gives each image its span and content hash."""

from __future__ import annotations

import pytest
from support.tiny_vlm import build_tiny_llava, data_uri, png
from textgen.service.intake.images import ImageLimits, ImagePrompts, image_from_url, markdown_images
from textgen.service.intake.validation import ValidationError

NAME = "messages[0].content[0].image_url"


def test_a_data_uri_decodes_to_rgb():
    part = image_from_url(data_uri(png((1, 2, 3), (7, 5))), NAME)
    assert (part.image.mode, part.image.size, part.name) == ("RGB", (7, 5), NAME)
    # parameters before ;base64 and an upper-case scheme are RFC 2397's
    uri = data_uri(png((1, 2, 3))).replace("data:image/png", "DATA:image/png;name=x.png")
    assert image_from_url(uri, NAME).image.size == (20, 24)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://127.0.0.1:1/a.png", "private, loopback"),
        ("HTTPS://10.1.2.3/a.png", "private, loopback"),
        ("http://no.such.host.invalid/a.png", "does not resolve"),
        ("data:image/png,abc", "base64 data: URI"),
        ("file:///etc/passwd", "base64 data: URI"),
        ("data:image/png;base64,a$b", "doesn't decode"),
        (data_uri(b"GIF89a broken"), "is not an image"),
    ],
)
def test_bad_urls_are_refused_naming_the_part(url, says):
    with pytest.raises(ValidationError) as refused:
        image_from_url(url, NAME)
    assert refused.value.param == NAME
    assert says in refused.value.message and NAME in refused.value.message


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    from transformers import AutoProcessor

    folder = build_tiny_llava(tmp_path_factory.mktemp("llava"))
    return ImagePrompts(AutoProcessor.from_pretrained(folder))


def test_markdown_images_become_placeholders(prompts):
    red, blue = data_uri(png((200, 0, 0))), data_uri(png((0, 0, 200)))
    inputs = f"a ![x]({red}) b ![]({blue}) c"
    text, parts = markdown_images(inputs, "inputs", "<image>", ImageLimits())
    assert text == "a <image> b <image> c"
    assert [p.name for p in parts] == ["inputs (image 1)", "inputs (image 2)"]
    ids, images, _ = prompts.tokenize(text, parts, "inputs")
    assert [i.num_tokens for i in images] == [16, 16]
    for image in images:
        span = ids[image.offset : image.offset + image.num_tokens]
        assert span == [prompts.image_token_id] * 16
    assert images[0].digest != images[1].digest


def test_placeholders_must_match_the_images(prompts):
    with pytest.raises(ValidationError, match="holds 1 image placeholders .* for 0 images"):
        prompts.tokenize("look: <image>", (), "messages")


def test_image_tokens_count_against_max_input_tokens(prompts):
    """The prompt is 2 text tokens and 16 image tokens: 18 > 17 is refused, as a text
    prompt of 18 tokens would be."""
    from textgen.service.intake.request import GenerateParameters, GenerateRequest
    from textgen.service.intake.validation import Limits, Validator

    tokenizer = prompts.processor.tokenizer
    limits = Limits(17, 64, 1, 4, 5, len(tokenizer))
    image = image_from_url(data_uri(png((9, 9, 9))), NAME)
    request = GenerateRequest(
        inputs="a<image>b", parameters=GenerateParameters(max_new_tokens=4), images=(image,)
    )
    ids = prompts.tokenize("a<image>b", (image,), "inputs").ids
    assert len(ids) == 18
    with pytest.raises(ValidationError, match="must have less than 17 tokens. Given: 18"):
        Validator(tokenizer, limits, images=prompts).validate(request, stream=False)
    limits = Limits(18, 64, 1, 4, 5, len(tokenizer))
    valid = Validator(tokenizer, limits, images=prompts).validate(request, stream=False)
    assert valid.engine_request.images[0].num_tokens == 16
    with pytest.raises(ValidationError, match="text-only"):
        Validator(tokenizer, limits).validate(request, stream=False)


def test_a_decompression_bomb_is_refused_before_it_decodes():
    """A 5000 x 5000 PNG of one colour is a few kilobytes; it is refused from its header."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("L", (5000, 5000)).save(out, format="PNG")
    assert len(out.getvalue()) < 100_000
    with pytest.raises(ValidationError, match="5000x5000 pixels, more than the 16777216"):
        image_from_url(data_uri(out.getvalue()), NAME)


def test_the_image_count_is_checked_before_any_image_is_read():
    """The ninth part is named; the unreachable URL before it is never fetched."""
    from textgen.service.intake.images import ImageLimits, read_images

    sources = [("http://10.255.255.1/a.png", f"part {i}") for i in range(9)]
    with pytest.raises(ValidationError, match="`part 8`: a request holds at most 8 images"):
        read_images(sources, ImageLimits())
    with pytest.raises(ValidationError, match="`part 0`: this model is text-only"):
        read_images(sources[:1], None)


def test_the_pixel_limit_is_the_setting():
    from textgen.service.intake.images import ImageLimits

    uri = data_uri(png((1, 2, 3), (7, 5)))
    assert image_from_url(uri, NAME, limits=ImageLimits(max_pixels=35)).image.size == (7, 5)
    with pytest.raises(ValidationError, match="7x5 pixels, more than the 34 .*--max-image-pix"):
        image_from_url(uri, NAME, limits=ImageLimits(max_pixels=34))


def test_markdown_images_name_each_part(prompts):
    from textgen.service.intake.images import ImageLimits, markdown_images

    red = data_uri(png((200, 0, 0)))
    text, parts = markdown_images(f"a ![]({red}) b", "inputs", "<image>", ImageLimits())
    assert (text, [p.name for p in parts]) == ("a <image> b", ["inputs (image 1)"])
    with pytest.raises(ValidationError) as refused:
        markdown_images(f"![]({red}) ![](http://127.0.0.1:1/x.png)", "inputs", "<image>", None)
    assert refused.value.param == "inputs" and "text-only" in refused.value.message
    with pytest.raises(ValidationError) as refused:
        limits = ImageLimits()
        markdown_images(f"![]({red}) ![](http://127.0.0.1:1/x.png)", "inputs", "<i>", limits)
    assert refused.value.param == "inputs"
    assert "`inputs (image 2)`" in refused.value.message and "private" in refused.value.message


def test_a_requests_urls_are_fetched_side_by_side():
    """Three URLs whose server answers none until all three are asked for: read one after
    another, the first would wait alone and fail (the barrier breaks)."""
    import ipaddress
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from textgen.service.intake.image_urls import FetchLimits
    from textgen.service.intake.images import ImageLimits, read_images

    image = png((5, 6, 7))
    together = threading.Barrier(3, timeout=5)

    class Together(BaseHTTPRequestHandler):
        def do_GET(self):  # http.server calls it by this name
            try:
                together.wait()
            except threading.BrokenBarrierError:
                self.send_response(503)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(image)))
            self.end_headers()
            self.wfile.write(image)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Together)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/a.png"
        loopback = (ipaddress.ip_network("127.0.0.1/32"),)
        limits = ImageLimits(fetch=FetchLimits(allow_private=loopback))
        parts = read_images([(url, f"part {i}") for i in range(3)], limits)
    finally:
        server.shutdown()
        server.server_close()
    assert [p.name for p in parts] == ["part 0", "part 1", "part 2"]
