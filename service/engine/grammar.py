"""Constrained decoding on the engine thread: one llguidance matcher per constrained
sequence; the masks of a step are computed on a worker thread while the forward runs,
then applied to the logits. The grammars come compiled and checked from the validation
side (service/grammar_compiler.py)."""

from __future__ import annotations

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
    seqs: list[Sequence]  # bitmask row i belongs to seqs[i]
    future: Future  # -> [len(seqs), vocab] bool, True where banned


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

    def start(self, constrained: list[Sequence]) -> PendingMasks | None:
        """Begin computing, in the background, the next-token masks of `constrained`
        (sequences with a grammar, about to sample); None when there are none."""
        if not constrained:
            return None
        return PendingMasks(constrained, self._worker.submit(self._fill, constrained))

    def apply(
        self, logits: torch.Tensor, seqs: list[Sequence], pending: PendingMasks | None
    ) -> None:
        """Give -inf to the disallowed tokens of the rows of `logits` ([len(seqs), vocab],
        float) whose sequence has a grammar; `pending` is what start() returned for them."""
        if pending is None:
            return
        banned = _widen(pending.future.result(), logits.shape[1]).to(
            logits.device, non_blocking=True
        )
        if len(pending.seqs) == len(seqs) and all(a is b for a, b in zip(pending.seqs, seqs)):
            logits.masked_fill_(banned, float("-inf"))  # every row constrained, in order
            return
        mask_row = {id(s): i for i, s in enumerate(pending.seqs)}
        pairs = [(row, mask_row[id(s)]) for row, s in enumerate(seqs) if id(s) in mask_row]
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

    def _fill(self, seqs: list[Sequence]) -> torch.Tensor:
        """-> [len(seqs), vocab] bool, True where a token is banned. On the worker: a new
        sequence's matcher is built here (~1 ms each), and the bits are unpacked here, so the
        engine thread has only a masked_fill left to do. The engine thread touches
        seq.grammar_state only after waiting for this result."""
        matchers = [self._matcher(s) for s in seqs]
        bitmask = torch.empty((len(matchers), self._words), dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)],
            bitmask.data_ptr(),
            self._words * 4,
            len(matchers),
        )
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
