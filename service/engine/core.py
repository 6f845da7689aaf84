"""The engine core's contract: what the loop (loop.py) drives once per step.

A core owns the waiting and running sequences, the KV cache and the model. It
knows nothing of threads, text or gRPC: the loop detokenizes, matches stop
strings and hands results to the asyncio side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .sequence import Sequence
from .types import EngineStats


@dataclass(slots=True)
class StepOutput:
    """A token one sequence gained in a step (the sequence already holds it). A speculative
    step can give a sequence several, one StepOutput each, in order."""

    seq: Sequence
    token_id: int
    logprob: float
    top_tokens: list[tuple[int, float]]  # (id, logprob), top_n_tokens of them
    # prompt logprobs (first is None) on the step that finished the prefill, when
    # the request asked for decoder_input_details
    prefill_logprobs: list[float | None] | None = None
    num_tokens: int = 0  # the sequence's length with this token (token_ids[num_tokens - 1])

    @property
    def is_last(self) -> bool:
        """The sequence's last token so far (a finished sequence's final one)."""
        return self.num_tokens == self.seq.num_tokens


class EngineCore(Protocol):
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""

    def abort(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is and free its KV blocks (finished or cancelled)."""

    def has_work(self) -> bool: ...

    def warm_up(self) -> None:
        """Allocate and run once what the first request would (on the engine's thread)."""

    def step(self) -> list[StepOutput]:
        """Run one forward over the scheduled batch and sample. Sequences that hit EOS
        or max_new_tokens come back finished and are already freed."""

    def stats(self) -> EngineStats: ...
