"""Images in a request: the bytes a face received, decoded (Pillow) and checked where the
face parses them, so an error names the part; then, at validation, the model's processor
turns the prompt and its images into token ids (each image's placeholder expanded to its
tokens) and the engine's ImageInputs (engine/types.py). No torch here: the processor
hands numpy arrays."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

from ..engine.types import ImageInput
from .image_urls import FetchLimits, ImageFetchError, fetch_image
from .validation import ValidationError

# Pixels an image may have (--max-image-pixels, 4096 x 4096): checked from its header
# before it decodes, so a small file that would decode to gigabytes (a decompression bomb)
# is refused first
MAX_IMAGE_PIXELS = 4096 * 4096
# Images one request may hold (--max-images-per-request): each may be fetched and decoded
# before the prompt's tokens are counted, so this bounds that work (8 x 20 MB, 8 x 16 Mpx);
# 8 LLaVA-1.5 images are 4,608 tokens, past its 4,096 context already
MAX_IMAGES = 8
# Fetches of one request that run at once
_FETCHES = 8
# TGI's images in a prompt: markdown, ![alt](url)
_MARKDOWN_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
# data:[<mime type>][;<parameter>]*;base64,<data> (RFC 2397)
_DATA_URI = re.compile(r"data:([\w.+-]+/[\w.+-]+)?(;[^;,]*)*?;base64,", re.IGNORECASE)


@dataclass(frozen=True)
class ImageLimits:
    """What a request's images may be: the --max-image* settings and how URLs are fetched."""

    max_pixels: int = MAX_IMAGE_PIXELS
    max_images: int = MAX_IMAGES
    fetch: FetchLimits = field(default_factory=FetchLimits)


class ImageSource(NamedTuple):
    """An image as a face received it: its URL (data: or http(s)), or the file's bytes
    (gRPC's typed image), and the part's name."""

    url: str | bytes
    name: str
    param: str | None = None  # the field to blame, when it isn't the part's name


@dataclass(frozen=True, slots=True)
class ImagePart:
    """A decoded image of a request, and the face's name of the part it came in."""

    image: object  # PIL.Image.Image, RGB
    name: str  # e.g. messages[0].content[1].image_url


def read_images(
    sources: Sequence[tuple], limits: ImageLimits | None, param: str | None = None
) -> tuple[ImagePart, ...]:
    """Each source's image (ImageSource, or (url, name)), in order, or a ValidationError
    naming the first bad part (blaming its param, else `param`, else its name). limits
    None: the model takes no images. The count is checked before any image is read;
    http(s) URLs are fetched side by side. Blocking: call it off the event loop."""
    sources = [ImageSource(*source) for source in sources]
    if not sources:
        return ()

    def blame(source: ImageSource) -> str:
        return source.param or param or source.name

    if limits is None:
        first = sources[0]
        raise ValidationError(
            f"`{first.name}`: this model is text-only; it takes no images", blame(first)
        )
    if len(sources) > limits.max_images:
        over = sources[limits.max_images]
        raise ValidationError(
            f"`{over.name}`: a request holds at most {limits.max_images} images "
            "(--max-images-per-request)",
            blame(over),
        )

    def read(source: ImageSource) -> ImagePart:
        if isinstance(source.url, bytes):
            return decode_image(source.url, source.name, blame(source), limits.max_pixels)
        return image_from_url(source.url, source.name, blame(source), limits)

    fetches = sum(isinstance(s.url, str) and _is_http(s.url) for s in sources)
    if fetches < 2:
        return tuple(map(read, sources))
    with ThreadPoolExecutor(min(fetches, _FETCHES), thread_name_prefix="textgen-fetch") as pool:
        return tuple(pool.map(read, sources))  # the first failure, in order, is raised


def markdown_images(
    inputs: str, name: str, placeholder: str, limits: ImageLimits | None
) -> tuple[str, tuple[ImagePart, ...]]:
    """TGI's images: each markdown image `![](data:...)` or `![](https://...)` of the
    prompt becomes the model's placeholder, its image read (named `inputs (image 1)`, ...)."""
    urls = [match.group(1) for match in _MARKDOWN_IMAGE.finditer(inputs)]
    sources = [(url, f"{name} (image {i})") for i, url in enumerate(urls, 1)]
    parts = read_images(sources, limits, name)
    return _MARKDOWN_IMAGE.sub(placeholder, inputs), parts


def has_markdown_images(text: str) -> bool:
    return _MARKDOWN_IMAGE.search(text) is not None


def _is_http(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


def image_from_url(
    url: str, name: str, param: str | None = None, limits: ImageLimits | None = None
) -> ImagePart:
    """A `data:` URI's image (base64) or an http(s) URL's, fetched within `limits.fetch`
    (blocking); errors name the part (`param`: the field to blame, when it isn't the
    part's name)."""
    param = param or name
    limits = limits or ImageLimits()
    if _is_http(url):
        try:
            data = fetch_image(url, limits.fetch)
        except ImageFetchError as exc:
            raise ValidationError(f"`{name}`: the image wasn't fetched: {exc}", param) from exc
        return decode_image(data, name, param, limits.max_pixels)
    match = _DATA_URI.match(url)
    if match is None:
        raise ValidationError(
            f"`{name}` must be an http(s) URL or a base64 data: URI (data:image/png;base64,...)",
            param,
        )
    try:
        data = base64.b64decode(url[match.end() :], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValidationError(f"`{name}`: the base64 data doesn't decode ({exc})", param) from exc
    return decode_image(data, name, param, limits.max_pixels)


def decode_image(
    data: bytes, name: str, param: str | None = None, max_pixels: int = MAX_IMAGE_PIXELS
) -> ImagePart:
    """The image in `data` (any format Pillow reads), RGB; a ValidationError naming the part
    when it doesn't decode, has no pixels or more than `max_pixels`."""
    from PIL import Image

    param = param or name
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
        size = image.width * image.height
        if 0 < size <= max_pixels:
            image.load()  # decode now: a truncated file fails here, not in the processor
    except Exception as exc:  # Pillow raises many kinds; each means "not an image"
        raise ValidationError(f"`{name}` is not an image Pillow can decode: {exc}", param) from exc
    if size == 0:
        raise ValidationError(f"`{name}` has no pixels ({image.width}x{image.height})", param)
    if size > max_pixels:
        raise ValidationError(
            f"`{name}` has {image.width}x{image.height} pixels, more than the "
            f"{max_pixels} an image may have (--max-image-pixels)",
            param,
        )
    return ImagePart(image.convert("RGB"), name)


class ImagePrompts:
    """A vision-language model's processor, applied to a prompt and its images."""

    def __init__(self, processor) -> None:
        self.processor = processor
        self.image_token = processor.image_token
        self.image_token_id = processor.image_token_id

    def from_markdown(self, inputs: str, name: str) -> tuple[str, tuple[ImagePart, ...]]:
        """TGI's images: each markdown image `![](data:...)` of the prompt becomes the
        model's placeholder, its image decoded (named `inputs (image 1)`, ...)."""
        parts: list[ImagePart] = []

        def placeholder(match: re.Match) -> str:
            part = f"{name} (image {len(parts) + 1})"
            parts.append(image_from_url(match.group(1), part, name))
            return self.image_token

        return _MARKDOWN_IMAGE.sub(placeholder, inputs), tuple(parts)

    def tokenize(
        self, prompt: str, parts: tuple[ImagePart, ...], inputs_name: str
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt's token ids, each image's placeholder expanded, and the images as the
        engine takes them. The prompt holds one placeholder per image, no more."""
        placeholders = prompt.count(self.image_token)
        if placeholders != len(parts):
            raise ValidationError(
                f"`{inputs_name}` holds {placeholders} image placeholders "
                f"({self.image_token}) for {len(parts)} images",
                inputs_name,
            )
        images = [p.image for p in parts] or None
        try:
            out = self.processor(images=images, text=prompt, return_tensors="np")
        except Exception as exc:  # the processor's refusal, reported as such
            name = parts[0].name if parts else inputs_name
            raise ValidationError(f"the model's processor refused `{name}`: {exc}", name) from exc
        ids = out["input_ids"][0].tolist()
        if not parts:
            return ids, ()
        return ids, self._inputs(ids, out["pixel_values"], parts)

    def _inputs(self, ids: list[int], pixels, parts) -> tuple[ImageInput, ...]:
        """Each image's pixels, content hash and span of placeholder tokens: the images'
        tokens in prompt order, split evenly (LLaVA gives every image as many)."""
        positions = [i for i, token in enumerate(ids) if token == self.image_token_id]
        per_image, rest = divmod(len(positions), len(parts))
        if rest or per_image == 0 or len(pixels) != len(parts):
            raise ValidationError(
                f"the processor gave {len(positions)} image tokens for {len(parts)} images",
                parts[0].name,
            )
        inputs = []
        for index in range(len(parts)):
            span = positions[index * per_image : (index + 1) * per_image]
            if span[-1] - span[0] != per_image - 1:  # one image's tokens are contiguous
                raise ValidationError("the image tokens are not contiguous", parts[index].name)
            values = pixels[index]
            digest = hashlib.blake2b(values.tobytes(), digest_size=16)
            digest.update(repr((values.shape, str(values.dtype))).encode())
            inputs.append(ImageInput(digest.digest(), values, span[0], per_image))
        return tuple(inputs)
