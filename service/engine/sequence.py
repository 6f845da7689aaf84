"""The state of one request inside the engine.

One accounting rule covers prefill, chunked prefill, prefix caching and decode:
`num_computed_tokens` (tokens whose K/V are in the cache) catches up with
`num_tokens` (prompt + generated). A step computes some of the missing tokens;
when it reaches the end of the sequence the step's logits yield a new token.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .types import EngineRequest, FinishReason


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request: EngineRequest
    eos_token_ids: frozenset[int]
    token_ids: list[int] = field(default_factory=list)  # prompt, then generated
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0  # tokens whose K/V are cached (incl. prefix-cache hits)
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache
    block_table: list[int] = field(default_factory=list)  # KV-cache block ids, in order
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    prefill_logprobs: list[float] = field(default_factory=list)  # decoder_input_details
    first_scheduled_time: float | None = None  # monotonic, first forward it joined
    first_token_time: float | None = None  # monotonic
    last_token_time: float | None = None
    num_preemptions: int = 0
    arrival_order: int = 0  # set by the scheduler when it is added: ties between priorities
    grammar_state: object | None = None  # owned by GrammarMasks (the request's matcher)
    choice: int = 0  # which of the request's n choices this is (0: the one that prefills)
    # the request's other choices, waiting for this one's prompt to be computed: then they
    # are forked from it (sharing its KV blocks) and sample their own first token from
    # its logits (paged_core.py). Empty once forked, or when n is 1.
    forks: list[Sequence] = field(default_factory=list)
    holds_adapter: bool = False  # counted among its LoRA adapter's users (PagedCore)
    state_slot: int = -1  # its slot of a hybrid model's state pool (state_slots.py); -1: none

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.request.prompt_ids)
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def width(self) -> int:
        """Sequences this one will be once its pending forks are made."""
        return 1 + len(self.forks)

    @property
    def in_prefill(self) -> bool:
        """True while prompt tokens remain to be computed."""
        return self.num_computed_tokens < self.num_prompt_tokens

    def append_token(self, token_id: int, now: float | None = None) -> None:
        """Append a sampled token (whether it ends the sequence is stopping.py's call)."""
        self.token_ids.append(token_id)
        self.last_token_time = time.monotonic() if now is None else now
        if self.first_token_time is None:
            self.first_token_time = self.last_token_time

    def finish(self, reason: FinishReason) -> None:
        self.finish_reason = reason
        self.status = SequenceStatus.FINISHED
