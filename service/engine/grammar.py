"""Constrained decoding on the engine thread: one llguidance matcher per constrained
sequence; the masks of a step are computed on a worker thread while the forward runs,
then applied to the logits. The grammars come compiled and checked from the validation
side (service/intake/grammar_compiler.py)."""

from __future__ import annotations

import itertools
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from .sequence import Sequence

log = logging.getLogger("textgen.engine")


@dataclass(slots=True)
class PendingMasks:
    # the owner of each mask row: a sequence, repeated once per proposal it verifies (its
    # rows are consecutive; the i-th follows its first i proposals)
    rows: list[Sequence]
    future: Future  # -> [len(rows), vocab] bool, True where banned


class GrammarMasks:
    """Engine-thread side: matchers, masks and their application to a batch's logits."""

    def __init__(self, ll_tokenizer: llguidance.LLTokenizer, vocab_size: int) -> None:
        """ll_tokenizer: the compiler's (GrammarCompiler.ll_tokenizer); vocab_size: the
        width of the logits."""
        self.ll_tokenizer = ll_tokenizer
        self.vocab_size = vocab_size
        self._words = (self.vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor(num_threads=1)
        # one worker: the masks of step N+1 never start before those of step N are used
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="textgen-grammar")

    def start(
        self, constrained: list[Sequence], drafts: list[list[int]] | None = None
    ) -> PendingMasks | None:
        """Begin computing, in the background, the next-token masks of `constrained`
        (sequences with a grammar, about to sample); None when there are none. `drafts`:
        the proposals each verifies (speculation.py), whose positions get masks too, each
        after the proposals before it."""
        if not constrained:
            return None
        drafts = drafts or [[] for _ in constrained]
        rows = [s for s, d in zip(constrained, drafts) for _ in range(1 + len(d))]
        return PendingMasks(rows, self._worker.submit(self._fill, constrained, drafts))

    def admitted(self, seq: Sequence, drafts: list[int]) -> int:
        """How many of the proposed `drafts` the sequence's grammar admits in a row (a
        proposal it forbids ends the run). Engine thread, with no masks pending."""
        matcher = seq.grammar_state
        return len(drafts) if matcher is None else matcher.validate_tokens(drafts)

    def apply(
        self, logits: torch.Tensor, rows: list[Sequence], pending: PendingMasks | None
    ) -> None:
        """Give -inf to the disallowed tokens of the rows of `logits` ([len(rows), vocab],
        float) whose sequence has a grammar; `rows`: each row's sequence, as in
        PendingMasks; `pending` is what start() returned for them."""
        if pending is None:
            return
        banned = _widen(pending.future.result(), logits.shape[1]).to(
            logits.device, non_blocking=True
        )
        if len(pending.rows) == len(rows) and all(a is b for a, b in zip(pending.rows, rows)):
            logits.masked_fill_(banned, float("-inf"))  # every row constrained, in order
            return
        first_row: dict[int, int] = {}
        for i, s in enumerate(pending.rows):
            first_row.setdefault(id(s), i)
        pairs, seen = [], {}
        for row, s in enumerate(rows):
            if id(s) in first_row:
                nth = seen[id(s)] = seen.get(id(s), -1) + 1
                pairs.append((row, first_row[id(s)] + nth))
        if not pairs:
            return
        rows = torch.tensor([r for r, _ in pairs], device=logits.device)
        picked = banned[torch.tensor([m for _, m in pairs], device=logits.device)]
        logits[rows] = logits[rows].masked_fill(picked, float("-inf"))

    def advance(self, seq: Sequence, token_id: int) -> bool:
        """Feed the sampled token to the sequence's matcher; True when the grammar is
        complete (nothing may follow: the sequence ends as if on EOS)."""
        matcher = seq.grammar_state
        if matcher is None:
            return False
        if not matcher.consume_token(token_id):
            # cannot happen for a token drawn under its mask; if it does, end cleanly
            log.warning(
                "grammar rejected token %d of %s: %s", token_id, seq.request_id, matcher.get_error()
            )
            return True
        return matcher.is_stopped()

    def _matcher(self, seq: Sequence) -> llguidance.LLMatcher:
        if seq.grammar_state is None:
            seq.grammar_state = llguidance.LLMatcher(
                self.ll_tokenizer, seq.request.grammar, log_level=0
            )
        return seq.grammar_state

    def _fill(self, seqs: list[Sequence], drafts: list[list[int]]) -> torch.Tensor:
        """-> [rows, vocab] bool, True where a token is banned: a row per sequence, and one
        per proposal after it. On the worker: a new sequence's matcher is built here (~1 ms
        each), and the bits are unpacked here, so the engine thread has only a masked_fill
        left to do. The engine thread touches seq.grammar_state only after waiting for this
        result."""
        matchers = [self._matcher(s) for s in seqs]
        num_rows = len(seqs) + sum(map(len, drafts))
        bitmask = torch.empty((num_rows, self._words), dtype=torch.int32)
        first = itertools.accumulate((1 + len(d) for d in drafts), initial=0)
        plain, drafted = [], []
        for matcher, row, proposed in zip(matchers, first, drafts):
            if proposed:  # its proposals are consumed, masked and rolled back in turn
                drafted.append((matcher, row, proposed))
            else:
                plain.append((matcher, row))
        args = (bitmask.data_ptr(), self._words * 4, num_rows)
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, *args)
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, *args)
        return unpack_banned(bitmask, self.vocab_size)


def unpack_banned(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 bit sets (bit j of word w set: token 32w + j allowed) -> [rows,
    vocab] bool, True where banned. numpy's unpackbits: single-threaded, so on the worker
    it doesn't start an OpenMP team that fights the forward's for the cores."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
    return torch.from_numpy(bits == 0)


def _widen(banned: torch.Tensor, width: int) -> torch.Tensor:
    """Logits wider than the grammar's vocabulary: the extra ids are banned too."""
    if banned.shape[1] >= width:
        return banned[:, :width]
    return torch.nn.functional.pad(banned, (0, width - banned.shape[1]), value=True)
