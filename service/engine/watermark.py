"""The green-list watermark of Kirchenbauer et al. (2023), "A Watermark for Large Language
Models": before sampling, each watermarked row adds `delta` to the logits of a "green" share
`gamma` of the vocabulary, chosen pseudo-randomly from the row's previous token. Text
generated so holds more green tokens than chance, which a detector that knows the key
counts (a z-score) without the model.

The green lists are transformers' (`WatermarkLogitsProcessor`, seeding scheme "lefthash",
context width 1): a CPU `torch.Generator` seeded with `HASH_KEY * previous_token` (mod
2^64 - 1), then the first `int(vocab_size * gamma)` ids of `torch.randperm(vocab_size)`.
They are always drawn on the CPU, whatever device the model runs on (a CUDA generator draws
other permutations), so transformers' `WatermarkDetector(device="cpu",
watermarking_config=WatermarkingConfig(greenlist_ratio=gamma, bias=delta))`, given the
model's config, detects what this server writes."""

from __future__ import annotations

import functools

import torch

# transformers' default hashing_key (the millionth prime); the detector's default too
HASH_KEY = 15485863
# TGI's defaults (WATERMARK_GAMMA, WATERMARK_DELTA)
DEFAULT_GAMMA = 0.5
DEFAULT_DELTA = 2.0
# green lists kept, per previous token: one is int(vocab * gamma) ids (196 kB for half of a
# 49k vocabulary). Drawing one is a randperm of the vocabulary: 0.4-0.8 ms for 49k on a
# 2-core CPU, per watermarked row whose previous token's list isn't kept (as transformers'
# and TGI's processors draw one per row and step)
CACHED_LISTS = 256


class Watermark:
    """Adds the green-list bias to the watermarked rows of a batch's logits."""

    def __init__(self, gamma: float = DEFAULT_GAMMA, delta: float = DEFAULT_DELTA) -> None:
        if not 0.0 < gamma < 1.0:
            raise ValueError(f"gamma must be > 0 and < 1, got {gamma}")
        self.gamma = gamma
        self.delta = delta
        self._lists = functools.lru_cache(CACHED_LISTS)(self._green_list)

    def green_list(self, previous_token: int, vocab_size: int) -> torch.Tensor:
        """The green ids (long, on the CPU) after `previous_token`, as transformers draws them."""
        return self._lists(previous_token, vocab_size, torch.device("cpu"))

    def apply(self, logits: torch.Tensor, rows: list[int], previous_tokens: list[int]) -> None:
        """Add delta, in place, to the green ids of each of `rows` of `logits` ([n, vocab]),
        each row's list seeded by its entry of `previous_tokens`."""
        if not rows:
            return
        vocab_size, device = logits.shape[1], logits.device
        size = int(vocab_size * self.gamma)
        deltas = logits.new_full((size,), self.delta)
        # a row at a time: index_add_ of each row's list took 3-8 ms for 32 rows of a 49k
        # vocabulary on a 2-core CPU, one accumulating index_put_ of them all ~45
        for row, token in zip(rows, previous_tokens, strict=True):
            logits[row].index_add_(0, self._lists(token, vocab_size, device), deltas)

    def _green_list(self, token: int, vocab_size: int, device: torch.device) -> torch.Tensor:
        rng = torch.Generator(device="cpu")
        rng.manual_seed((HASH_KEY * token) % (2**64 - 1))
        green = torch.randperm(vocab_size, generator=rng)[: int(vocab_size * self.gamma)]
        return green.to(device)
