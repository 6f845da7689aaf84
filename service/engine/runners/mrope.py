"""Multimodal rotary positions (M-RoPE: Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the language model's
rotary position of a token is 3 rows (temporal, height, width), not its index in the
sequence.

transformers' `get_rope_index` lays a prompt out as runs: a text run counts on from where
the last run ended, all three rows alike; an image of t x h x w merged patches takes its
grid's coordinates, offset by where it starts, and the next run starts max(h, w) later
(not the image's h x w tokens later). So an image shifts every later token's positions
by a constant, its `delta` (span - tokens), and a token's positions are

    text at index p:                    p + (the deltas of the images before it)
    image token j of an image at p0:    rows[:, j] + p0 + (the deltas of the images before it)
    generated token at index p:         p + (the deltas of all the prompt's images)

where `rows` are the image's grid coordinates from 0, taken from the model's own
`get_rope_index` on the image alone (cached per image, by its content hash). The engine
keeps a token's index for everything else (KV slots, masks, key_limits, the prefix cache:
the same tokens after the same images have the same positions); only the model's rotary
embedding reads these.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from ..types import ImageInput

ROWS = 3  # temporal, height, width
CACHE_IMAGES = 256  # images whose rows are kept (a few KiB each)


@dataclass(frozen=True, slots=True)
class ImageRope:
    """An image's rotary rows from 0 ([3][num_tokens]) and the positions it takes."""

    rows: tuple[tuple[int, ...], ...]
    span: int  # the next run starts this many positions after the image's start

    def delta(self, num_tokens: int) -> int:
        return self.span - num_tokens


class MRope:
    """The rotary positions of a step's tokens, from the model's `get_rope_index`."""

    def __init__(self, model: torch.nn.Module, capacity: int = CACHE_IMAGES) -> None:
        self.rope_index = model.model.get_rope_index
        self.image_token_id = model.config.image_token_id
        self.capacity = capacity
        self.cache: OrderedDict[bytes, ImageRope] = OrderedDict()

    def positions(self, images: tuple[ImageInput, ...], start: int, count: int) -> list[list[int]]:
        """[3][count]: the rotary positions of indices start .. start + count - 1 of a
        sequence whose prompt holds `images` (in order)."""
        rows = [list(range(start, start + count)) for _ in range(ROWS)]
        end = start + count
        for image in images:
            rope = self.image(image)
            first, last = image.offset, image.positions[-1]
            for p in range(max(start, first), min(end, last + 1)):  # its tokens in the chunk
                for r in range(ROWS):
                    rows[r][p - start] = rope.rows[r][p - first] + first + (rows[r][p - start] - p)
            shift = rope.delta(image.num_tokens)
            for p in range(max(start, last + 1), end):  # every later token moves on
                for r in range(ROWS):
                    rows[r][p - start] += shift
        return rows

    def image(self, image: ImageInput) -> ImageRope:
        """The image's rows and span, from the cache or the model's get_rope_index on
        its tokens alone."""
        cached = self.cache.get(image.digest)
        if cached is not None:
            self.cache.move_to_end(image.digest)
            return cached
        if image.positions[-1] - image.offset + 1 != image.num_tokens:
            raise ValueError("M-RoPE takes an image's tokens as one run")
        ids = torch.full((1, image.num_tokens), self.image_token_id, dtype=torch.long)
        grid = torch.from_numpy(np.asarray(image.extra["image_grid_thw"])).long()
        positions, _ = self.rope_index(
            ids, mm_token_type_ids=torch.ones_like(ids, dtype=torch.int), image_grid_thw=grid
        )
        rows = positions[:, 0].tolist()
        rope = ImageRope(tuple(map(tuple, rows)), int(positions.max()) + 1)
        self.cache[image.digest] = rope
        if len(self.cache) > self.capacity:
            self.cache.popitem(last=False)
        return rope
