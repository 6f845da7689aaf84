"""Continuous batching: at each step decide which sequences run and how many tokens each
computes. Pure Python: it sees sequences and the block manager, never a tensor.

Policy, in order, every step. "First" means by rank: the request's priority (lower is
sooner, vLLM's convention), then arrival order.
1. Decodes. Every running sequence with one token left to compute gets it, first first. If
   the KV pool can't hold it, the last-ranked running sequence (the lowest priority, the
   youngest among those) is preempted (recompute) until it can.
2. Prefill chunks of running sequences whose prompt (or recompute) is not done yet, first
   first, within the per-step prefill budget `max_batch_prefill_tokens`.
3. Admission of waiting sequences, first first, while the prefill budget, `max_batch_size`,
   the free blocks and `max_loras` allow. A long prompt is split into chunks across steps.

LoRA adapters: every running sequence decodes in every step, so bounding the adapters of
the running sequences by `max_loras` (the runner's slots) bounds every step's. A waiting
sequence whose adapter would be one too many waits, first in rank as any other, until a
running adapter's sequences end.

Starvation policy. TGI's `waiting_served_ratio` / `max_waiting_tokens` exist because its
prefill is a separate forward that stalls every running decode for the whole prompt, so it
must ration prefills. Here prefill chunks ride in the same forward as the decodes and a step
computes at most `max_batch_prefill_tokens` prompt tokens, so a decode's stall is bounded by
that budget whatever arrives. We therefore admit waiting sequences at every step the budget
and KV pool allow: new requests never wait behind a long generation, and running ones never
lose more than one budgeted chunk of time per step. Waiting requests are served strictly in
rank order (no skipping ahead of a large request that doesn't fit yet), and a preempted
sequence keeps its rank, so nothing of a priority starves behind later arrivals. A
higher priority does not preempt running sequences: it goes ahead of every waiting one.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from dataclasses import dataclass, field

from .block_manager import BlockManager, num_blocks_for_tokens
from .sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work, handed to the runner."""

    # (sequence, number of new tokens it computes this step): decodes first, then prefill
    # chunks of running sequences, then newly admitted ones. Its new tokens are
    # token_ids[num_computed_tokens : num_computed_tokens + n]; blocks for them are allocated.
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    num_prefill_tokens: int = 0  # prompt/recompute tokens, <= max_batch_prefill_tokens
    num_decode_tokens: int = 0  # one per running sequence with a single token left
    # sequences preempted while building this step: blocks freed, back at the waiting front
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_batch_prefill_tokens: int,
        max_batch_size: int,
        max_loras: int = 0,
    ) -> None:
        """max_loras: distinct LoRA adapters among the running sequences (0: no adapters)."""
        if max_batch_prefill_tokens <= 0 or max_batch_size <= 0:
            raise ValueError("max_batch_prefill_tokens and max_batch_size must be positive")
        self.block_manager = block_manager
        self.max_batch_prefill_tokens = max_batch_prefill_tokens
        self.max_batch_size = max_batch_size
        # Both ranked: (priority, arrival). The last running one is the first preempted.
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # cumulative
        self.max_loras = max_loras
        self.running_adapters: Counter[int] = Counter()  # adapter uid -> running sequences
        self._arrivals = itertools.count()

    # queue management --------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.arrival_order = next(self._arrivals)
        _insert(self.waiting, seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Drop `seq` wherever it is and return its blocks (finished or aborted)."""
        if seq in self.running:
            self._remove_running(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def preempt_all(self) -> None:
        """Preempt every running sequence (recompute), keeping their order."""
        out = SchedulerOutput()
        for seq in reversed(list(self.running)):
            self._preempt(seq, out)

    # scheduling --------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._schedule_decodes(out)
        budget = self.max_batch_prefill_tokens
        budget = self._schedule_running_prefills(out, budget)
        # Admitting right after a preemption would hand the blocks just freed for the
        # decodes to a newcomer and preempt again next step.
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def commit(self, out: SchedulerOutput) -> None:
        """After the forward: the scheduled tokens are computed; cache newly full blocks."""
        for seq, num_new in out.scheduled:
            seq.num_computed_tokens += num_new
            self.block_manager.cache_full_blocks(seq)

    def _schedule_decodes(self, out: SchedulerOutput) -> None:
        # First-ranked first; victims come from the tail, so a scheduled decode is never
        # preempted.
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or _remaining(seq) != 1:
                continue
            while not self.block_manager.can_append(seq, 1):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.append_slots(seq, 1)
                out.scheduled.append((seq, 1))
                out.num_decode_tokens += 1

    def _schedule_running_prefills(self, out: SchedulerOutput, budget: int) -> int:
        scheduled = {id(s) for s, _ in out.scheduled}
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or id(seq) in scheduled:
                continue
            wanted = min(_remaining(seq), budget)
            num_new = self.block_manager.num_fitting_tokens(seq, wanted)
            # Out of blocks: take them from younger sequences that have no work this step
            # yet. Decodes keep priority: a scheduled decode is never a victim.
            while (
                num_new == 0
                and self.running[-1] is not seq
                and id(self.running[-1]) not in scheduled
            ):
                self._preempt(self.running[-1], out)
                num_new = self.block_manager.num_fitting_tokens(seq, wanted)
            if num_new == 0:
                continue
            self.block_manager.append_slots(seq, num_new)
            out.scheduled.append((seq, num_new))
            out.num_prefill_tokens += num_new
            budget -= num_new
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]  # the first ranked: no skipping ahead of it
            # Prompt logprobs need the logits of every prompt position: no prefix reuse.
            hits = None if seq.request.decoder_input_details else bm.match_prefix(seq)
            num_to_compute = seq.num_tokens - len(hits or ()) * bm.block_size
            free_blocks = bm.num_free_blocks - bm.num_free_among(hits or [])
            # Admit only when the whole rest of the prompt fits in the free blocks (not just
            # this chunk): a sequence admitted on a sliver would stall mid-prompt and be
            # preempted, wasting the chunks already computed.
            if num_blocks_for_tokens(num_to_compute, bm.block_size) > free_blocks:
                break
            if not self._adapter_fits(seq):
                break
            num_new = min(num_to_compute, budget)
            self.waiting.pop(0)
            bm.allocate(seq, hits)
            bm.append_slots(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            _insert(self.running, seq)
            if seq.request.adapter_uid:
                self.running_adapters[seq.request.adapter_uid] += 1
            out.scheduled.append((seq, num_new))
            out.num_prefill_tokens += num_new
            budget -= num_new

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute preemption: drop seq's K/V; its generated tokens stay in token_ids and
        are recomputed with the prompt when it is admitted again (at the queue's front)."""
        self._remove_running(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        _insert(self.waiting, seq)  # its rank is kept: ahead of what arrived after it
        out.preempted.append(seq)

    def _adapter_fits(self, seq: Sequence) -> bool:
        uid = seq.request.adapter_uid
        return (
            not uid or uid in self.running_adapters or (len(self.running_adapters) < self.max_loras)
        )

    def _remove_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        uid = seq.request.adapter_uid
        if uid:
            self.running_adapters[uid] -= 1
            if not self.running_adapters[uid]:
                del self.running_adapters[uid]


def _rank(seq: Sequence) -> tuple[int, int]:
    return seq.request.priority, seq.arrival_order


def _insert(ranked: list[Sequence], seq: Sequence) -> None:
    """Insert `seq` into a list kept in rank order."""
    bisect.insort(ranked, seq, key=_rank)


def _remaining(seq: Sequence) -> int:
    return seq.num_tokens - seq.num_computed_tokens
