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
from dataclasses import dataclass

from ..engine.types import ImageInput
from .validation import ValidationError

# Pixels an image may have (4096 x 4096): checked from its header before it decodes, so a
# small file that would decode to gigabytes (a decompression bomb) is refused first
MAX_IMAGE_PIXELS = 4096 * 4096
# TGI's images in a prompt: markdown, ![alt](url)
_MARKDOWN_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
# data:[<mime type>][;<parameter>]*;base64,<data> (RFC 2397)
_DATA_URI = re.compile(r"data:([\w.+-]+/[\w.+-]+)?(;[^;,]*)*?;base64,", re.IGNORECASE)
# a processor's outputs about the text, not the image (the rest go to get_image_features)
_TEXT_INPUTS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})


@dataclass(frozen=True, slots=True)
class ImagePart:
    """A decoded image of a request, and the face's name of the part it came in."""

    image: object  # PIL.Image.Image, RGB
    name: str  # e.g. messages[0].content[1].image_url


def image_from_url(url: str, name: str, param: str | None = None) -> ImagePart:
    """A `data:` URI's image (base64); http(s) URLs are refused for now, naming the part
    (`param`: the field to blame, when it isn't the part's name)."""
    param = param or name
    if url[:8].lower().startswith(("http://", "https://")):
        raise ValidationError(
            f"`{name}`: image URLs are not fetched yet; send the image inline as a data: URI "
            "(data:image/png;base64,...)",
            param,
        )
    match = _DATA_URI.match(url)
    if match is None:
        raise ValidationError(
            f"`{name}` must be a base64 data: URI (data:image/png;base64,...)", param
        )
    try:
        data = base64.b64decode(url[match.end() :], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValidationError(f"`{name}`: the base64 data doesn't decode ({exc})", param) from exc
    return decode_image(data, name, param)


def decode_image(data: bytes, name: str, param: str | None = None) -> ImagePart:
    """The image in `data` (any format Pillow reads), RGB; a ValidationError naming the part
    when it doesn't decode, has no pixels or more than MAX_IMAGE_PIXELS."""
    from PIL import Image

    param = param or name
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
        size = image.width * image.height
        if 0 < size <= MAX_IMAGE_PIXELS:
            image.load()  # decode now: a truncated file fails here, not in the processor
    except Exception as exc:  # Pillow raises many kinds; each means "not an image"
        raise ValidationError(f"`{name}` is not an image Pillow can decode: {exc}", param) from exc
    if size == 0:
        raise ValidationError(f"`{name}` has no pixels ({image.width}x{image.height})", param)
    if size > MAX_IMAGE_PIXELS:
        raise ValidationError(
            f"`{name}` has {image.width}x{image.height} pixels, more than the "
            f"{MAX_IMAGE_PIXELS} an image may have",
            param,
        )
    return ImagePart(image.convert("RGB"), name)


class ImagePrompts:
    """A vision-language model's processor, applied to a prompt and its images."""

    def __init__(
        self,
        processor,
        image_token_id: int | None = None,
        both_ways: bool = False,
        max_chunk: int | None = None,
    ) -> None:
        """image_token_id: the token the image's features replace (the model config's), where
        the processor's placeholder is another (Gemma 3's <start_of_image>); both_ways: the
        family's image tokens attend to each other both ways (Gemma 3), so one prefill
        chunk of at most `max_chunk` tokens (--max-batch-prefill-tokens) must hold them."""
        self.processor = processor
        self.image_token = processor.image_token
        self.image_token_id = processor.image_token_id if image_token_id is None else image_token_id
        self.both_ways = both_ways
        self.max_chunk = max_chunk

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
        try:
            # the prompt's ids with every placeholder expanded; then each image alone: its
            # pixels and other inputs unpadded by the others' (LLaVA-Next pads every image
            # to the most tiles), so its digest is its own, and its count of tokens
            out = self._process(prompt, [p.image for p in parts])
            if len(parts) > 1:
                alone = [self._process(self.image_token, [p.image]) for p in parts]
            else:
                alone = [out] * len(parts)
        except Exception as exc:  # the processor's refusal, reported as such
            name = parts[0].name if parts else inputs_name
            raise ValidationError(f"the model's processor refused `{name}`: {exc}", name) from exc
        ids = out["input_ids"][0].tolist()
        return ids, self._inputs(ids, alone, parts) if parts else ()

    def _process(self, text: str, images: list) -> dict:
        return self.processor(images=images or None, text=text, return_tensors="np")

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
            self._check_chunk(part, count)
            if len(out["pixel_values"]) != 1:  # Gemma 3's pan and scan: crops as images
                raise ValidationError(
                    f"`{part.name}`: the processor made {len(out['pixel_values'])} images of "
                    "it (crops), which textgen doesn't serve",
                    part.name,
                )
            rows = {k: v[0] for k, v in out.items() if k not in _TEXT_INPUTS}
            digest = hashlib.blake2b(digest_size=16)
            for name, row in sorted(rows.items()):
                digest.update(repr((name, row.shape, str(row.dtype))).encode())
                digest.update(row.tobytes())
            pixels = rows.pop("pixel_values")
            span = tuple(positions[start : start + count])
            inputs.append(ImageInput(digest.digest(), pixels, span, rows, self.both_ways))
            start += count
        return tuple(inputs)

    def _check_chunk(self, part: ImagePart, count: int) -> None:
        """An image attended both ways is computed in one prefill chunk: it must fit one."""
        if self.both_ways and self.max_chunk is not None and count > self.max_chunk:
            raise ValidationError(
                f"`{part.name}`: its {count} image tokens attend to each other, so one prefill "
                f"chunk computes them, and that is more than --max-batch-prefill-tokens "
                f"({self.max_chunk})",
                part.name,
            )
