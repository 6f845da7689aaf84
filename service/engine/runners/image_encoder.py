"""A vision-language model's images at prefill: its vision tower and projector (the
model's own `get_image_features`) turn an image's pixels into one feature row per
placeholder token, and those rows replace the placeholders' token embeddings in the
language model's `inputs_embeds`, as transformers' own forward merges them.

Chunked prefill: a chunk may cover part of an image's placeholders. Each image is
encoded once and its features kept in a small LRU keyed by the image's content hash, so
the request's later chunks (and a recompute after preemption, or another request with
the same image) slice the rows they cover instead of encoding again.

Deepstack (Qwen3-VL): the vision tower also returns rows from some of its blocks, one
level per block, which the language model adds to the hidden states its first decoder
layers put out (level k after layer k) at the image tokens. They are kept with the
image's features and added by hooks on those layers, for the step's image tokens only
(the chunk's rows of each level, at the chunk's image positions), as transformers'
forward adds them at the prompt's.
"""

from __future__ import annotations

import contextlib
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


@dataclass(frozen=True, slots=True)
class DeepstackStep:
    """What the hooks add: level k's rows [K, hidden] at the flattened batch's `targets`."""

    targets: torch.Tensor  # [K] long
    levels: list[torch.Tensor]


class ImageEncoder:
    """The model's vision side, with the LRU of its images' features."""

    def __init__(self, model: torch.nn.Module, capacity: int = ENCODER_CACHE_IMAGES) -> None:
        self.model = model
        self.capacity = capacity
        self.device = next(model.parameters()).device
        self.dtype = model.get_input_embeddings().weight.dtype
        # per image: its feature rows, then each deepstack level's (Qwen3-VL)
        self.cache: OrderedDict[bytes, tuple[torch.Tensor, ...]] = OrderedDict()
        self.encoded = 0  # images run through the vision tower so far (tests, metrics)
        self._step: DeepstackStep | None = None  # the running forward's deepstack rows
        self._install_deepstack(model)

    def _install_deepstack(self, model: torch.nn.Module) -> None:
        """A hook on each decoder layer that takes a deepstack level (none: no deepstack)."""
        vision = getattr(model.config, "vision_config", None)
        levels = len(getattr(vision, "deepstack_visual_indexes", None) or ())
        layers = model.model.language_model.layers if levels else []
        for level, layer in enumerate(layers[:levels]):
            layer.register_forward_hook(self._deepstack_hook(level))

    def _deepstack_hook(self, level: int):
        def add_level(module, args, hidden: torch.Tensor) -> torch.Tensor | None:
            step = self._step
            if step is None:
                return None
            hidden = hidden.clone()
            hidden[0, step.targets] += step.levels[level].to(hidden.dtype)
            return hidden

        return add_level

    @contextlib.contextmanager
    def bound(self, step: DeepstackStep | None):
        """The step's deepstack rows for the layers' hooks while its forward runs."""
        self._step = step
        try:
            yield
        finally:
            self._step = None

    def embeddings(
        self, ids: torch.Tensor, slices: list[ImageSlice]
    ) -> tuple[torch.Tensor, DeepstackStep | None]:
        """`inputs_embeds` [1, T, hidden] for the flattened batch `ids` [1, T], and the
        deepstack rows its forward adds (None: no deepstack)."""
        embeds = self.model.get_input_embeddings()(ids)
        targets, levels = [], []
        for part in slices:
            encoded = self.encode(part.image)
            rows = [level[part.first_row : part.first_row + len(part.targets)] for level in encoded]
            embeds[0, torch.tensor(part.targets, device=embeds.device)] = rows[0].to(embeds.dtype)
            targets.extend(part.targets)
            levels.append(rows[1:])
        if not targets or not levels[0]:
            return embeds, None
        stacked = [torch.cat(level) for level in zip(*levels, strict=True)]
        return embeds, DeepstackStep(torch.tensor(targets, device=self.device), stacked)

    def features(self, image: ImageInput) -> torch.Tensor:
        """The image's feature rows [num_tokens, hidden], from the cache or encoded now."""
        return self.encode(image)[0]

    def encode(self, image: ImageInput) -> tuple[torch.Tensor, ...]:
        """The image's feature rows, then each deepstack level's [num_tokens, hidden], from
        the cache or encoded now."""
        cached = self.cache.get(image.digest)
        if cached is not None:
            self.cache.move_to_end(image.digest)
            return cached
        out = self.model.get_image_features(**self._inputs(image), return_dict=True)
        # one [rows, hidden] per image (LLaVA) or per tile (Idefics 3): the image's rows
        levels = [out.pooler_output, *(getattr(out, "deepstack_features", None) or ())]
        encoded = tuple(torch.cat([f.reshape(-1, f.shape[-1]) for f in rows]) for rows in levels)
        if encoded[0].shape[0] != image.num_tokens:
            raise RuntimeError(
                f"the vision tower gave {encoded[0].shape[0]} feature rows for an image of "
                f"{image.num_tokens} tokens"
            )
        self.encoded += 1
        self.cache[image.digest] = encoded
        if len(self.cache) > self.capacity:
            self.cache.popitem(last=False)
        return encoded

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
