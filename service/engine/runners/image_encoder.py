"""A vision-language model's images at prefill: its vision tower and projector (the
model's own `get_image_features`) turn an image's pixels into one feature row per
placeholder token, and those rows replace the placeholders' token embeddings in the
language model's `inputs_embeds`, as transformers' own forward merges them.

Chunked prefill: a chunk may cover part of an image's placeholders. Each image is
encoded once and its features kept in a small LRU keyed by the image's content hash, so
the request's later chunks (and a recompute after preemption, or another request with
the same image) slice the rows they cover instead of encoding again.

Batching: the images a step needs that the LRU doesn't hold, across its requests, go
through the vision tower together, one batch per shape of their inputs (images of one
size, the usual case behind one processor, are one batch; LLaVA-Next's and Idefics 3's
tile counts vary with the image, so theirs group by it): one forward per shape instead
of one per image.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict, defaultdict
from collections.abc import Iterable
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


class ImageEncoder:
    """The model's vision side, with the LRU of its images' features."""

    def __init__(self, model: torch.nn.Module, capacity: int = ENCODER_CACHE_IMAGES) -> None:
        self.model = model
        self.capacity = capacity
        self.device = next(model.parameters()).device
        self.dtype = model.get_input_embeddings().weight.dtype
        self.cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.encoded = 0  # images run through the vision tower so far (tests, metrics)
        self.batches = 0  # the vision tower's forwards that ran them

    def embeddings(self, ids: torch.Tensor, slices: list[ImageSlice]) -> torch.Tensor:
        """`inputs_embeds` [1, T, hidden] for the flattened batch `ids` [1, T]."""
        embeds = self.model.get_input_embeddings()(ids)
        features = self.features(part.image for part in slices)
        for part in slices:
            rows = features[part.image.digest]
            rows = rows[part.first_row : part.first_row + len(part.targets)]
            targets = torch.tensor(part.targets, device=embeds.device)
            embeds[0, targets] = rows.to(embeds.dtype)
        return embeds

    def features(self, images: Iterable[ImageInput]) -> dict[bytes, torch.Tensor]:
        """Each image's feature rows [num_tokens, hidden] by digest: from the cache, the
        others encoded now, a batch per shape of their inputs."""
        out: dict[bytes, torch.Tensor] = {}
        missing: dict[bytes, ImageInput] = {}
        for image in images:
            if image.digest in out or image.digest in missing:
                continue
            cached = self.cache.get(image.digest)
            if cached is None:
                missing[image.digest] = image
            else:
                self.cache.move_to_end(image.digest)
                out[image.digest] = cached
        for batch in _same_shapes(missing.values()):
            for image, rows in zip(batch, self._encode(batch), strict=True):
                out[image.digest] = rows
                self._keep(image.digest, rows)
        return out

    def _encode(self, batch: list[ImageInput]) -> list[torch.Tensor]:
        """The vision tower and projector over images of one input shape, in one forward."""
        out = self.model.get_image_features(**self._inputs(batch), return_dict=True)
        # one [rows, hidden] per image (LLaVA) or per tile (Idefics 3), in order
        rows = torch.cat([f.reshape(-1, f.shape[-1]) for f in out.pooler_output])
        counts = [image.num_tokens for image in batch]
        if rows.shape[0] != sum(counts):
            raise RuntimeError(
                f"the vision tower gave {rows.shape[0]} feature rows for {len(batch)} images "
                f"of {sum(counts)} tokens"
            )
        self.encoded += len(batch)
        self.batches += 1
        return list(rows.split(counts))

    def _keep(self, digest: bytes, rows: torch.Tensor) -> None:
        self.cache[digest] = rows
        if len(self.cache) > self.capacity:
            self.cache.popitem(last=False)

    def _inputs(self, batch: list[ImageInput]) -> dict[str, torch.Tensor]:
        """get_image_features' inputs for the batch: each input's rows stacked, floats in
        the model's dtype (pixels), the rest as they are (sizes, masks)."""
        names = ["pixel_values", *batch[0].extra]
        out = {}
        for name in names:
            rows = [_row(image, name) for image in batch]
            value = torch.from_numpy(np.stack(rows)).to(self.device)
            out[name] = value.to(self.dtype) if value.is_floating_point() else value
        return out


def _row(image: ImageInput, name: str):
    return np.asarray(image.pixel_values if name == "pixel_values" else image.extra[name])


def _same_shapes(images: Iterable[ImageInput]) -> list[list[ImageInput]]:
    """The images grouped by the names, shapes and dtypes of their inputs: those that
    stack into one batch."""
    groups: dict[tuple, list[ImageInput]] = defaultdict(list)
    for image in images:
        names = ("pixel_values", *sorted(image.extra))
        key = tuple((n, _row(image, n).shape, str(_row(image, n).dtype)) for n in names)
        groups[key].append(image)
    return list(groups.values())
