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

from bisect import bisect_left
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from ..types import ImageInput

# Images whose features are kept (LLaVA-1.5-7B's: 576 x 4096 bf16 rows, 4.5 MiB each)
ENCODER_CACHE_IMAGES = 32


@dataclass(frozen=True, slots=True)
class ImageSlice:
    """Rows first_row .. first_row + len(targets) - 1 of an image's features replace the
    embeddings of the flattened batch's tokens at `targets`."""

    image: ImageInput
    first_row: int
    targets: tuple[int, ...]


def image_slices(
    images: tuple[ImageInput, ...], start: int, num_new: int, at: int
) -> list[ImageSlice]:
    """The parts of `images` a chunk of positions start .. start + num_new - 1 covers, the
    chunk's first token at flattened position `at`. An image's tokens are in order, so the
    rows a chunk covers are consecutive even where its tokens are not (Idefics 3)."""
    out = []
    end = start + num_new
    for image in images:
        if image.positions[-1] < start or image.offset >= end:
            continue
        first = bisect_left(image.positions, start)
        last = bisect_left(image.positions, end)
        if first < last:
            targets = tuple(at + p - start for p in image.positions[first:last])
            out.append(ImageSlice(image, first, targets))
    return out


def key_limits(slices: list[ImageSlice], positions: list[int]) -> list[int] | None:
    """The attention's key_limits for a step (attention/paged.py): each token of an image
    attended both ways sees up to the image's last token; None where the step has none."""
    both_ways = [part for part in slices if part.image.both_ways]
    if not both_ways:
        return None
    limits = list(positions)
    for part in both_ways:
        for target in part.targets:
            limits[target] = part.image.positions[-1]
    return limits


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
            rows = self.features(part.image)[part.first_row : part.first_row + len(part.targets)]
            targets = torch.tensor(part.targets, device=embeds.device)
            embeds[0, targets] = rows.to(embeds.dtype)
        return embeds

    def features(self, image: ImageInput) -> torch.Tensor:
        """The image's feature rows [num_tokens, hidden], from the cache or encoded now."""
        cached = self.cache.get(image.digest)
        if cached is not None:
            self.cache.move_to_end(image.digest)
            return cached
        out = self.model.get_image_features(**self._inputs(image), return_dict=True)
        # one [rows, hidden] per image (LLaVA) or per tile (Idefics 3): the image's rows
        features = torch.cat([f.reshape(-1, f.shape[-1]) for f in out.pooler_output])
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

    def _inputs(self, image: ImageInput) -> dict[str, torch.Tensor]:
        """get_image_features' inputs for the one image, as the processor gave them for it
        alone (a batch of one, or its patches and grid row): floats in the model's dtype
        (pixels), the rest as they are (sizes, masks, grids)."""
        rows = {"pixel_values": image.pixel_values, **image.extra}
        out = {}
        for name, row in rows.items():
            value = torch.from_numpy(np.asarray(row)).to(self.device)
            out[name] = value.to(self.dtype) if value.is_floating_point() else value
        return out
