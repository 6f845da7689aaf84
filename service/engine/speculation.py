"""Speculative decoding: a proposer guesses a decoding sequence's next tokens, one forward
verifies them all, and the sampler keeps the longest run the target model agrees with.

Where it sits (docs/architecture.md, the engine's seams): PagedCore.step()
asks the proposer for up to N tokens per decoding sequence, the scheduler reserves KV slots
for them (scheduler.py), the runner computes each such sequence's last token and its
proposals as one short chunk of 1 + N query tokens (the varlen path prefill chunks take:
runners/model_runner.py), the sampler draws a token at every one of those positions, and the
core keeps the proposals up to the first one the draw disagrees with, plus that draw
(`accepted_run`). The KV slots of the rejected proposals go back to the block manager, and
only accepted tokens are ever counted as computed, so the prefix cache never registers a
rejected one.

Why the output is the target's own. Row i of a verification is sampled exactly as a decode
step would sample the sequence with its first i proposals appended (`DraftRow`: penalties
see them, a seeded draw is keyed by the same position, a grammar mask follows them). A
proposal is kept when it equals that draw. Greedy rows then give the non-speculative tokens
one for one. For sampled rows this is rejection sampling with a point-mass proposal (both
proposers here propose one token per position, deterministically): the proposal d survives
with probability p(d), and a rejected position emits the draw, which given x != d is
distributed as p(x) / (1 - p(d)), the residual max(0, p - q) normalized. So every emitted
token is distributed as the target's, and a seeded request gives the same text with or
without speculation (tests/engine/test_speculation.py checks both).

Proposers:
- `NgramProposer` (prompt lookup, vLLM's `ngram`): the longest of the sequence's recent
  n-grams (n from `max_n` down to `min_n`) that ends it and occurred before, and the tokens
  that followed its most recent occurrence.
- draft_model.py's `DraftModelProposer`: a small model sharing the tokenizer, greedily.

With `SpeculationSettings.adaptive` (the default), speculation_gate.py's `SpeculationGate`
chooses, step by step, which decoding sequences propose: those whose measured acceptance
pays for the measured cost of verifying (and, now and then, the others, to measure again).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Protocol

from .sequence import Sequence
from .types import SamplingParams


@dataclass(frozen=True)
class SpeculationSettings:
    num_tokens: int  # N: proposals per sequence per step, at most
    max_batch: int  # steps with more running sequences than this don't speculate
    ngram_min: int = 2  # the shortest suffix n-gram the n-gram proposer matches
    ngram_max: int = 4  # the longest
    # propose only while it pays, per sequence, by measured costs and acceptance
    # (speculation_gate.py); False: every decoding sequence proposes whenever it can
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.num_tokens <= 0 or self.max_batch <= 0:
            raise ValueError("speculation needs num_tokens and max_batch > 0")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}"
            )


class Proposer(Protocol):
    # proposing costs next to nothing (no forward): the gate (speculation_gate.py) may ask
    # for sequences it won't verify, to measure their acceptance for free. A proposer
    # without the attribute counts as not free.
    free: bool

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Up to `limits[i]` tokens that may follow `seqs[i]` (each in decode state: all
        but its last token computed), [] where there is no guess."""

    def forget(self, seq: Sequence) -> None:
        """`seq` ended: drop what the proposer keeps for it."""

    def warmup(self) -> None:
        """Run once, at start-up on the engine's thread, what the first proposal would."""


class NgramProposer:
    """Prompt lookup over the sequence's own tokens, prompt and output alike.

    Each sequence keeps an index from every n-gram it holds (min_n <= n <= max_n) to where
    its latest occurrence ends, extended by the tokens appended since the last call: a
    proposal costs O(max_n) dict look-ups, not a scan of the context."""

    free = True

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._indexes: weakref.WeakKeyDictionary[Sequence, _NgramIndex] = (
            weakref.WeakKeyDictionary()
        )

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [self._propose_one(seq, limit) for seq, limit in zip(seqs, limits)]

    def forget(self, seq: Sequence) -> None:
        self._indexes.pop(seq, None)

    def warmup(self) -> None:
        pass

    def _propose_one(self, seq: Sequence, limit: int) -> list[int]:
        tokens = seq.token_ids
        index = self._indexes.get(seq)
        if index is None:
            index = self._indexes[seq] = _NgramIndex()
        # every n-gram ending before the last token: the suffix must match an earlier one
        index.extend(tokens, len(tokens) - 1, self.min_n, self.max_n)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = index.latest.get(tuple(tokens[length - n :]))
            if end is not None:
                return _continuation(tokens, end, limit)
        return []


@dataclass(slots=True)
class _NgramIndex:
    latest: dict[tuple[int, ...], int] = None  # n-gram -> end (exclusive) of its latest run
    indexed: int = 0  # n-grams ending at or before this index are in `latest`

    def __post_init__(self) -> None:
        self.latest = {}

    def extend(self, tokens: list[int], upto: int, min_n: int, max_n: int) -> None:
        latest = self.latest
        for end in range(self.indexed + 1, upto + 1):
            for n in range(min_n, min(max_n, end) + 1):
                latest[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, upto)


def _continuation(tokens: list[int], start: int, limit: int) -> list[int]:
    """The `limit` tokens from `tokens[start]` on, reading on into the proposal itself past
    the end: a repeating run (start near the end) proposes its period over and over."""
    length = len(tokens)
    draft: list[int] = []
    for i in range(limit):
        at = start + i
        draft.append(tokens[at] if at < length else draft[at - length])
    return draft


# verification -----------------------------------------------------------------------


class DraftRow:
    """What the sampler sees of verification row i of a sequence: the sequence as if its
    first i proposals were appended (penalties count them, a seeded draw is keyed by the
    position they lead to)."""

    __slots__ = ("drafts", "seq")

    def __init__(self, seq: Sequence, drafts: list[int]) -> None:
        self.seq, self.drafts = seq, drafts

    @property
    def request(self):
        return self.seq.request

    @property
    def sampling(self) -> SamplingParams:
        return self.seq.request.sampling

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.drafts

    @property
    def output_ids(self) -> list[int]:
        return self.seq.output_ids + self.drafts

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens + len(self.drafts)


def sample_rows(seqs: list[Sequence], drafts: list[list[int]]) -> list:
    """The sampler's row contexts, one per logits row: each sequence, then a `DraftRow` per
    proposal it is verifying."""
    rows: list = []
    for seq, proposed in zip(seqs, drafts):
        rows.append(seq)
        rows.extend(DraftRow(seq, proposed[:i]) for i in range(1, len(proposed) + 1))
    return rows


def accepted_run(sampled: list[int], drafts: list[int]) -> int:
    """How many of `drafts` the draws keep: `sampled[i]` is the token drawn at the position
    of drafts[i] (after drafts[:i]); the first disagreement ends the run, whose last token
    is then that draw (or, when all are kept, the draw after them)."""
    accepted = 0
    while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
        accepted += 1
    return accepted
