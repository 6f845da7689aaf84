"""A vision-language model's images at prefill: its vision tower and projector (the
model's own `get_image_features`) turn an image's pixels into one feature row per
placeholder token, and those rows replace the placeholders' token embeddings in the
language model's `inputs_embeds`, as transformers' own forward merges them.

Chunked prefill: a chunk may cover part of an image's placeholders. Each image is
encoded once and its features kept in a small LRU keyed by the image's content hash, so
the request's later chunks (and a recompute after preemption, or another request with
the same image) slice the rows they cover instead of encoding again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from ..types import ImageInput

# Images whose features are kept (LLaVA-1.5-7B's: 576 x 4096 bf16 rows, 4.5 MiB each)
ENCODER_CACHE_IMAGES = 32


@dataclass(frozen=True, slots=True)
class ImageSlice:
    """Rows first_row .. first_row + rows - 1 of an image's features replace the
    embeddings of the flattened batch's tokens at .. at + rows - 1."""

    image: ImageInput
    first_row: int
    rows: int
    at: int


def image_slices(
    images: tuple[ImageInput, ...], start: int, num_new: int, at: int
) -> list[ImageSlice]:
    """The parts of `images` a chunk of positions start .. start + num_new - 1 covers, the
    chunk's first token at flattened position `at`."""
    out = []
    end = start + num_new
    for image in images:
        lo, hi = max(start, image.offset), min(end, image.offset + image.num_tokens)
        if lo < hi:
            out.append(ImageSlice(image, lo - image.offset, hi - lo, at + lo - start))
    return out


class ImageEncoder:
    """The model's vision side, with the LRU of its images' features."""

    def __init__(self, model: torch.nn.Module, capacity: int = ENCODER_CACHE_IMAGES) -> None:
        self.model = model
        self.capacity = capacity
        self.device = next(model.parameters()).device
        self.dtype = model.get_input_embeddings().weight.dtype
        self.cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.encoded = 0  # images run through the vision tower so far (tests, metrics)

    def embeddings(self, ids: torch.Tensor, slices: list[ImageSlice]) -> torch.Tensor:
        """`inputs_embeds` [1, T, hidden] for the flattened batch `ids` [1, T]."""
        embeds = self.model.get_input_embeddings()(ids)
        for part in slices:
            rows = self.features(part.image)[part.first_row : part.first_row + part.rows]
            embeds[0, part.at : part.at + part.rows] = rows.to(embeds.dtype)
        return embeds

    def features(self, image: ImageInput) -> torch.Tensor:
        """The image's feature rows [num_tokens, hidden], from the cache or encoded now."""
        cached = self.cache.get(image.digest)
        if cached is not None:
            self.cache.move_to_end(image.digest)
            return cached
        pixels = torch.from_numpy(np.asarray(image.pixel_values)).unsqueeze(0)
        out = self.model.get_image_features(
            pixel_values=pixels.to(self.device, self.dtype), return_dict=True
        )
        features = torch.cat(list(out.pooler_output), dim=0)
        if features.shape[0] != image.num_tokens:
            raise RuntimeError(
                f"the vision tower gave {features.shape[0]} feature rows for an image of "
                f"{image.num_tokens} tokens"
            )
        self.encoded += 1
        self.cache[image.digest] = features
        if len(self.cache) > self.capacity:
            self.cache.popitem(last=False)
        return features
