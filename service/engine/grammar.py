"""Constrained decoding: grammars compiled once, token masks per step, with llguidance.

Why llguidance (measured on the embedded model's 49k vocabulary, 2-core CPU, 32 matchers
walking JSON schemas; scripts in the issue 9 note): a batched mask step took 5.3 ms against
xgrammar's 10.8 ms, a schema compiles in ~1 ms, it has no Python dependencies (xgrammar
pulls triton and a TVM runtime), its Lark dialect embeds JSON schemas (`%json {...}`) so
tool calls need no hand-written JSON grammar, and its batched mask computation runs in
Rust with the GIL released, so it overlaps the model's forward.

Two halves, one per side of the engine boundary:
- `GrammarCompiler` (validation, event-loop side): TGI's grammar / OpenAI's response_format
  and tools -> a checked llguidance grammar string, cached. Bad schemas and regexes are
  `GrammarError`s (422), found before anything reaches the engine.
- `GrammarMasks` (engine thread): one matcher per constrained sequence; the masks of a step
  are computed on a worker thread while the forward runs, then applied to the logits.
"""

from __future__ import annotations

import functools
import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import llguidance.hf
import numpy as np
import torch

from .sequence import Sequence

log = logging.getLogger("textgen.engine")

COMPILED_CACHE_SIZE = 512  # distinct grammars kept compiled (validation is the costly part)
# JSON whitespace between two tokens: enough for pretty-printing a few levels deep, and a
# bound, so a model can't stall in whitespace until max_new_tokens (a known failure of
# unbounded JSON grammars). A schema's own "x-guidance" options take precedence.
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,20}"}


class GrammarError(ValueError):
    """The grammar, schema or regex can't be used; the message says why."""


class GrammarCompiler:
    """Turns user grammars into llguidance grammar strings checked against the tokenizer."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        """tokenizer: the model's fast HF tokenizer; vocab_size: the width of the logits
        (may exceed the tokenizer's size: the extra ids are never allowed)."""
        eos = sorted(eos_token_ids) or None
        # ~0.5 s: the token trie is built once per process
        self.ll_tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=eos
        )
        self.vocab_size = vocab_size
        self._check = functools.lru_cache(maxsize=COMPILED_CACHE_SIZE)(self._check_uncached)

    def json_schema(self, schema: dict | bool) -> str:
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be an object or a boolean")
        # sort_keys would reorder properties, which the generated JSON follows: keep the order
        return self._check("json", json.dumps(schema, separators=(",", ":")))

    def regex(self, pattern: str) -> str:
        return self._check("regex", pattern)

    def lark(self, grammar: str) -> str:
        return self._check("lark", grammar)

    def _check_uncached(self, kind: str, source: str) -> str:
        M = llguidance.LLMatcher
        try:
            if kind == "json":
                grammar = M.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
            elif kind == "regex":
                grammar = M.grammar_from_regex(source)
            else:
                grammar = M.grammar_from_lark(source)
        except ValueError as exc:
            raise GrammarError(str(exc)) from exc
        is_error, messages = M.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error:
            raise GrammarError(_first_line(messages[0]))
        return grammar


@dataclass(slots=True)
class PendingMasks:
    seqs: list[Sequence]  # bitmask row i belongs to seqs[i]
    future: Future  # -> [len(seqs), vocab] bool, True where banned


class GrammarMasks:
    """Engine-thread side: matchers, masks and their application to a batch's logits."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.ll_tokenizer = compiler.ll_tokenizer
        self.vocab_size = compiler.vocab_size
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


def _first_line(message: str) -> str:
    """llguidance's message without the source excerpt it draws: the first line and the
    `error:` line of a regex parse error."""
    lines = [line.strip() for line in message.strip().splitlines()]
    kept = [lines[0]] + [line for line in lines[1:] if line.startswith("error:")] if lines else []
    return " ".join(kept) or "invalid grammar"
