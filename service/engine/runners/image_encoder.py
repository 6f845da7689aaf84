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

Batching: the images a step needs that the LRU doesn't hold, across its requests, go
through the vision tower together, one batch per shape of their inputs past the first
dimension (each input is the processor's for the image alone, a batch of one or its
patches, so a batch is their concatenation: images of one size are one batch behind most
processors, and Qwen2.5-VL's patches of any sizes, listed by `image_grid_thw`; LLaVA-Next's
and Idefics 3's tile counts vary with the image, so theirs group by it): one forward per
shape instead of one per image.
"""

from __future__ import annotations

import contextlib
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
        self.batches = 0  # the vision tower's forwards that ran them
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
        encoded = self.encode(part.image for part in slices)
        targets, levels = [], []
        for part in slices:
            span = slice(part.first_row, part.first_row + len(part.targets))
            rows = [level[span] for level in encoded[part.image.digest]]
            embeds[0, torch.tensor(part.targets, device=embeds.device)] = rows[0].to(embeds.dtype)
            targets.extend(part.targets)
            levels.append(rows[1:])
        if not targets or not levels[0]:
            return embeds, None
        stacked = [torch.cat(level) for level in zip(*levels, strict=True)]
        return embeds, DeepstackStep(torch.tensor(targets, device=self.device), stacked)

    def features(self, image: ImageInput) -> torch.Tensor:
        """The image's feature rows [num_tokens, hidden], from the cache or encoded now."""
        return self.encode([image])[image.digest][0]

    def encode(self, images: Iterable[ImageInput]) -> dict[bytes, tuple[torch.Tensor, ...]]:
        """Each image's feature rows, then each deepstack level's [num_tokens, hidden], by
        digest: from the cache, the others encoded now, a batch per shape of their inputs."""
        out: dict[bytes, tuple[torch.Tensor, ...]] = {}
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
            for image, encoded in zip(batch, self._encode(batch), strict=True):
                out[image.digest] = encoded
                self._keep(image.digest, encoded)
        return out

    def _encode(self, batch: list[ImageInput]) -> list[tuple[torch.Tensor, ...]]:
        """The vision tower and projector over images of one input shape, in one forward:
        each image's rows of each level (its features, then its deepstack levels)."""
        out = self.model.get_image_features(**self._inputs(batch), return_dict=True)
        # one [rows, hidden] per image (LLaVA) or per tile (Idefics 3), in order
        levels = [out.pooler_output, *(getattr(out, "deepstack_features", None) or ())]
        rows = [torch.cat([f.reshape(-1, f.shape[-1]) for f in level]) for level in levels]
        counts = [image.num_tokens for image in batch]
        if rows[0].shape[0] != sum(counts):
            raise RuntimeError(
                f"the vision tower gave {rows[0].shape[0]} feature rows for {len(batch)} "
                f"images of {sum(counts)} tokens"
            )
        self.encoded += len(batch)
        self.batches += 1
        return list(zip(*(level.split(counts) for level in rows), strict=True))

    def _keep(self, digest: bytes, encoded: tuple[torch.Tensor, ...]) -> None:
        self.cache[digest] = encoded
        if len(self.cache) > self.capacity:
            self.cache.popitem(last=False)

    def _inputs(self, batch: list[ImageInput]) -> dict[str, torch.Tensor]:
        """get_image_features' inputs for the batch: each input as the processor gave it
        for each image alone (a batch of one, or its patches and grid row), concatenated;
        floats in the model's dtype (pixels), the rest as they are (sizes, masks, grids)."""
        out = {}
        for name in ("pixel_values", *batch[0].extra):
            rows = np.concatenate([_input(image, name) for image in batch])
            value = torch.from_numpy(rows).to(self.device)
            out[name] = value.to(self.dtype) if value.is_floating_point() else value
        return out


def _input(image: ImageInput, name: str) -> np.ndarray:
    return np.asarray(image.pixel_values if name == "pixel_values" else image.extra[name])


def _same_shapes(images: Iterable[ImageInput]) -> list[list[ImageInput]]:
    """The images grouped by the names, dtypes and shapes past the first dimension of their
    inputs: those that concatenate into one batch."""
    groups: dict[tuple, list[ImageInput]] = defaultdict(list)
    for image in images:
        names = ("pixel_values", *sorted(image.extra))
        arrays = [_input(image, name) for name in names]
        key = tuple((n, a.shape[1:], str(a.dtype)) for n, a in zip(names, arrays, strict=True))
        groups[key].append(image)
    return list(groups.values())
