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

from ..engine.types import BothWays, ImageInput
from ..models.architectures import BOTH_WAYS_IMAGE, BOTH_WAYS_PROMPT
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
# a processor's outputs about the text, not the image (the rest go to get_image_features)
_TEXT_INPUTS = frozenset(
    {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "labels"}
)


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


class ImagePrompt(NamedTuple):
    """A prompt through the processor: its token ids, its images as the engine takes them,
    and its spans attended both ways (engine/types.py)."""

    ids: list[int]
    images: tuple[ImageInput, ...]
    both_ways: tuple[BothWays, ...] = ()


class ImagePrompts:
    """A vision-language model's processor, applied to a prompt and its images."""

    def __init__(
        self,
        processor,
        image_token_id: int | None = None,
        both_ways: str | None = None,
        max_chunk: int | None = None,
        listed_by: str = "pixel_values",
    ) -> None:
        """image_token_id: the token the image's features replace (the model config's), where
        the processor's placeholder is another (Gemma 3's <start_of_image>); both_ways: which
        tokens attend to each other both ways (models/architectures.py BOTH_WAYS: each
        image's, Gemma 3; the whole prompt, PaliGemma), so one prefill chunk of at most
        `max_chunk` tokens (--max-batch-prefill-tokens) must hold each such span;
        listed_by: the processor's input with one row per image (Qwen2.5-VL's
        `image_grid_thw`, its patches concatenated in `pixel_values`)."""
        self.processor = processor
        self.listed_by = listed_by
        self.image_token = processor.image_token
        self.image_token_id = processor.image_token_id if image_token_id is None else image_token_id
        self.both_ways = both_ways
        self.max_chunk = max_chunk

    def tokenize(
        self,
        prompt: str,
        parts: tuple[ImagePart, ...],
        inputs_name: str,
        add_special_tokens: bool = True,
    ) -> ImagePrompt:
        """The prompt's token ids, each image's placeholder expanded, the images as the
        engine takes them, and the spans attended both ways. The prompt holds one
        placeholder per image, no more. add_special_tokens: the tokenizer's (the engine's
        prompts take them; vLLM's /tokenize of a conversation doesn't, by default)."""
        placeholders = prompt.count(self.image_token)
        if placeholders != len(parts):
            raise ValidationError(
                f"`{inputs_name}` holds {placeholders} image placeholders "
                f"({self.image_token}) for {len(parts)} images",
                inputs_name,
            )
        try:
            # the prompt's ids with every placeholder expanded; then each image alone: its
            # pixels and other inputs unpadded by the others' (LLaVA-Next pads every image
            # to the most tiles), so its digest is its own, and its count of tokens
            out = self._process(prompt, [p.image for p in parts], add_special_tokens)
            if len(parts) > 1:
                alone = [self._process(self.image_token, [p.image]) for p in parts]
            else:
                alone = [out] * len(parts)
        except Exception as exc:  # the processor's refusal, reported as such
            name = parts[0].name if parts else inputs_name
            raise ValidationError(f"the model's processor refused `{name}`: {exc}", name) from exc
        ids = out["input_ids"][0].tolist()
        images = self._inputs(ids, alone, parts) if parts else ()
        return ImagePrompt(ids, images, self._both_ways(ids, images, parts, inputs_name))

    def _process(self, text: str, images: list, add_special_tokens: bool = True) -> dict:
        # the processor's own default unless told otherwise (PaliGemma's writes its bos)
        special = {} if add_special_tokens else {"add_special_tokens": False}
        return self.processor(images=images or None, text=text, return_tensors="np", **special)

    def _inputs(self, ids: list[int], alone: list[dict], parts) -> tuple[ImageInput, ...]:
        """Each image's pixels, other inputs, content hash and prompt positions: the
        prompt's image tokens in order, as many to each image as it has alone."""
        positions = [i for i, token in enumerate(ids) if token == self.image_token_id]
        counts = [int((out["input_ids"][0] == self.image_token_id).sum()) for out in alone]
        if sum(counts) != len(positions) or 0 in counts:
            raise ValidationError(
                f"the processor gave {len(positions)} image tokens for {len(parts)} images",
                parts[0].name,
            )
        inputs, start = [], 0
        for part, out, count in zip(parts, alone, counts, strict=True):
            if len(out[self.listed_by]) != 1:  # Gemma 3's pan and scan: crops as images
                raise ValidationError(
                    f"`{part.name}`: the processor made {len(out[self.listed_by])} images of "
                    "it (crops), which textgen doesn't serve",
                    part.name,
                )
            # the image alone as get_image_features takes it: a batch of one (LLaVA), or
            # its patches and its one row of image_grid_thw (Qwen2.5-VL)
            rows = {k: v for k, v in out.items() if k not in _TEXT_INPUTS}
            digest = hashlib.blake2b(digest_size=16)
            for name, row in sorted(rows.items()):
                digest.update(repr((name, row.shape, str(row.dtype))).encode())
                digest.update(row.tobytes())
            pixels = rows.pop("pixel_values")
            span = tuple(positions[start : start + count])
            inputs.append(ImageInput(digest.digest(), pixels, span, rows))
            start += count
        return tuple(inputs)

    def _both_ways(
        self, ids: list[int], images: tuple[ImageInput, ...], parts, inputs_name: str
    ) -> tuple[BothWays, ...]:
        """The prompt's spans attended both ways; each must fit one prefill chunk."""
        if self.both_ways == BOTH_WAYS_IMAGE:
            for part, image in zip(parts, images, strict=True):
                self._check_chunk(image.num_tokens, f"{image.num_tokens} image tokens", part.name)
            return tuple(BothWays(image.offset, image.positions[-1]) for image in images)
        if self.both_ways == BOTH_WAYS_PROMPT and images:
            what = f"{len(ids)} tokens, its images' and its text's,"
            self._check_chunk(len(ids), what, inputs_name)
            return (BothWays(0, len(ids) - 1),)
        return ()

    def _check_chunk(self, count: int, what: str, name: str) -> None:
        """A span attended both ways is computed in one prefill chunk: it must fit one."""
        if self.max_chunk is not None and count > self.max_chunk:
            raise ValidationError(
                f"`{name}`: its {what} attend to each other, so one prefill chunk computes "
                f"them, and that is more than --max-batch-prefill-tokens ({self.max_chunk})",
                name,
            )
