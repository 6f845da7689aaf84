"""Images of a generate request (a vision-language model's: docs/models.md, "Images"):
what a caller has, as the proto's `ImageInput`.

A path (str or os.PathLike) is read; bytes are the image file's own; a PIL image is
saved as PNG; a str that starts with http://, https:// or data: is a URL the server
reads (it fetches http(s) URLs itself). The prompt holds the model's image placeholder
(`InfoResponse.image_token`, LLaVA's `<image>`) once per image, in order.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union

from ._generated.textgen.v1 import ImageInput

__all__ = ["ImageLike", "image_input", "image_inputs"]

# str | os.PathLike | bytes | PIL.Image.Image (Pillow is the caller's, never imported here)
ImageLike = Union[str, "os.PathLike[str]", bytes, Any]

_URL_SCHEMES = ("http://", "https://", "data:")


def image_input(image: ImageLike) -> ImageInput:
    """One image as the request carries it; TypeError for what is none of the above."""
    if isinstance(image, ImageInput):
        return image
    if isinstance(image, (bytes, bytearray, memoryview)):
        return ImageInput(data=bytes(image))
    if isinstance(image, str) and image[:8].lower().startswith(_URL_SCHEMES):
        return ImageInput(url=image)
    if isinstance(image, (str, os.PathLike)):
        return ImageInput(data=Path(image).read_bytes())
    if callable(getattr(image, "save", None)) and hasattr(image, "mode"):  # a PIL image
        out = io.BytesIO()
        image.save(out, format="PNG")
        return ImageInput(data=out.getvalue())
    raise TypeError(
        f"an image is a path, bytes, a PIL image or an http(s)/data: URL, not {type(image)}"
    )


def image_inputs(images: Sequence[ImageLike] | None) -> list[ImageInput]:
    return [image_input(image) for image in images or ()]
