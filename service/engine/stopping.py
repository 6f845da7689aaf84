"""Why a sequence stops, for every reason, in one place.

Token-level reasons, decided in the core's step as each sampled token is appended, in
this order:
  1. its grammar is complete: nothing may follow           -> eos_token
  2. the token is an EOS token (unless ignore_eos)         -> eos_token
  3. max_new_tokens reached                                -> length
  4. the request's deadline (max_time) has passed          -> time_limit
Text-level, decided by the loop once it has detokenized the step's tokens (stop strings
need text), with `StopSequenceMatcher`:
  5. a stop sequence completed in the generated text       -> stop_sequence

The deadline is read once per step, at the step that gives the sequence a token: the
first token always comes (as transformers' MaxTimeCriteria), and a running sequence gets
a token every step, so a generation ends at the first step that ends past its deadline.
As in TGI, the text keeps the stop sequence (and whatever the token that completed it
carried).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Sequence
from .types import FinishReason


def token_stop_reason(
    seq: Sequence, token_id: int, *, grammar_complete: bool, now: float
) -> FinishReason | None:
    """Why `seq` stops after appending `token_id` at time `now` (monotonic), or None."""
    stopping = seq.request.stopping
    if grammar_complete:
        return FinishReason.EOS_TOKEN
    if not stopping.ignore_eos and token_id in seq.eos_token_ids:
        return FinishReason.EOS_TOKEN
    if seq.num_output_tokens >= stopping.max_new_tokens:
        return FinishReason.LENGTH
    if stopping.deadline is not None and now >= stopping.deadline:
        return FinishReason.TIME_LIMIT
    return None


@dataclass(slots=True)
class StopSequenceMatcher:
    """Stop sequences matched on the generated text, across token boundaries."""

    stop_sequences: tuple[str, ...]
    _tail: str = field(default="", repr=False)
    _keep: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        self._keep = max((len(s) for s in self.stop_sequences), default=0)

    def feed(self, text: str) -> str | None:
        """Add newly generated text; returns the stop sequence it completed, if any."""
        if not self.stop_sequences or not text:
            return None
        window = self._tail + text
        for stop in self.stop_sequences:
            # only matches that end inside the new text are new
            if stop in window[max(0, len(self._tail) - len(stop) + 1) :]:
                return stop
        self._tail = window[-(self._keep - 1) :] if self._keep > 1 else ""
        return None
