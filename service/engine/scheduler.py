"""Continuous batching: at each step decide which sequences run and how many tokens each
computes. Pure Python: it sees sequences and the block manager, never a tensor.

Policy, in order, every step. "First" means by rank: the request's priority (lower is
sooner, vLLM's convention), then arrival order: the order `add` received the requests,
after validation, not the time their RPCs arrived (a request validated slowly ranks behind
one of its priority already running, so it can't preempt it).
1. Decodes. Every running sequence with one token left to compute gets it, first first. If
   the KV pool can't hold it, the last-ranked running sequence (the lowest priority, the
   youngest among those) is preempted (recompute) until it can. A decode with proposed
   tokens (speculation.py) computes them too, when their slots fit in the free blocks;
   proposals never preempt anything: without room the decode goes on alone.
2. Prefill chunks of running sequences whose prompt (or recompute) is not done yet, first
   first, within the per-step prefill budget `max_batch_prefill_tokens`.
3. Admission of waiting sequences, first first, while the prefill budget, `max_batch_size`,
   the free blocks and `max_loras` allow. A long prompt is split into chunks across steps. A
   request of n choices is admitted as one sequence that will be n (Sequence.width): the
   batch must have room for all of them, and the pool for its prompt plus one block per
   other choice (the copy of the shared partial block each will write into). With a
   sliding window (block_manager.py) the prompt never holds more than its window and one
   chunk at once: that bounds what it needs.

Sliding windows: each time a sequence's computed tokens move on (admission's prefix hits,
`commit`, `commit_verified`), the blocks before the window of its next query go back to the
pool (`BlockManager.release_out_of_window`), after the step's full blocks are cached. A
step's earliest query is the sequence's first uncomputed token, so nothing a scheduled step
(or a later one) reads is ever released, and a rejected proposal only rolls back tokens
past the kept ones.

Hybrid models (state layers: state_pool.py): every running sequence owns a slot of the
state pool (`state_slots`), taken at admission, given back at finish or preemption; a
waiting sequence is admitted only when the free slots hold all its choices, as the free
blocks must hold its prompt.

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
from .state_slots import StateSlots


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work, handed to the runner."""

    # (sequence, number of new tokens it computes this step): decodes first, then prefill
    # chunks of running sequences, then newly admitted ones. Its new tokens are
    # token_ids[num_computed_tokens : num_computed_tokens + n]; blocks for them are allocated.
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    num_prefill_tokens: int = 0  # prompt/recompute tokens, <= max_batch_prefill_tokens
    num_decode_tokens: int = 0  # one per running sequence with a single token left, plus
    # its proposals when it verifies some
    # sequences preempted while building this step: blocks freed, back at the waiting front
    preempted: list[Sequence] = field(default_factory=list)
    # (source, destination) KV blocks to copy before the forward: a fork's first write
    # into the partial block it shares (block_manager.py)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # decodes verifying proposed tokens (speculation.py): the proposals, which follow the
    # sequence's last token in its scheduled chunk of 1 + len(proposals) tokens
    proposals: dict[Sequence, list[int]] = field(default_factory=dict)
    # (source, destination) state slots to copy before the forward: a fork's copy of its
    # parent's state (state_slots.py)
    state_copies: list[tuple[int, int]] = field(default_factory=list)

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
        state_slots: StateSlots | None = None,
    ) -> None:
        """max_loras: distinct LoRA adapters among the running sequences (0: no adapters).
        state_slots: a hybrid model's state pool (None: the model keeps no state)."""
        if max_batch_prefill_tokens <= 0 or max_batch_size <= 0:
            raise ValueError("max_batch_prefill_tokens and max_batch_size must be positive")
        self.block_manager = block_manager
        self.state_slots = state_slots
        self.max_batch_prefill_tokens = max_batch_prefill_tokens
        self.max_batch_size = max_batch_size
        # Both ranked: (priority, arrival). The last running one is the first preempted.
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # cumulative
        self.num_prefill_tokens = 0  # prompt and recompute tokens scheduled, cumulative
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
        self._free(seq)
        seq.status = SequenceStatus.FINISHED

    def add_fork(self, parent: Sequence, child: Sequence) -> None:
        """Run `child`, a choice of parent's request, on parent's computed prompt (after
        the step that computed it): it shares parent's blocks and rank."""
        self.block_manager.fork(parent, child)
        if self.state_slots is not None:
            self.state_slots.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        child.arrival_order = parent.arrival_order
        child.first_scheduled_time = parent.first_scheduled_time
        _insert(self.running, child)
        if child.request.adapter_uid:  # parent's adapter: already among the running ones
            self.running_adapters[child.request.adapter_uid] += 1

    def preempt_all(self) -> None:
        """Preempt every running sequence (recompute), keeping their order."""
        out = SchedulerOutput()
        for seq in reversed(list(self.running)):
            self._preempt(seq, out)

    # scheduling --------------------------------------------------------------

    def schedule(self, proposals: dict[Sequence, list[int]] | None = None) -> SchedulerOutput:
        """proposals: tokens proposed to follow some decoding sequences (speculation.py)."""
        out = SchedulerOutput()
        self._schedule_decodes(out, proposals or {})
        budget = self.max_batch_prefill_tokens
        budget = self._schedule_running_prefills(out, budget)
        # Admitting right after a preemption would hand the blocks just freed for the
        # decodes to a newcomer and preempt again next step.
        if not out.preempted:
            self._admit_waiting(out, budget)
        out.block_copies = self.block_manager.take_copies()
        if self.state_slots is not None:
            out.state_copies = self.state_slots.take_copies()
        self.num_prefill_tokens += out.num_prefill_tokens
        return out

    def commit(self, out: SchedulerOutput) -> None:
        """After the forward, before the sampled tokens are appended: the scheduled tokens
        of every entry but the verifying decodes are computed; cache newly full blocks."""
        for seq, num_new in out.scheduled:
            if seq not in out.proposals:
                seq.num_computed_tokens += num_new
                self.block_manager.cache_full_blocks(seq)
                self.block_manager.release_out_of_window(seq)

    def commit_verified(self, out: SchedulerOutput, kept: dict[Sequence, int]) -> None:
        """Once the sampled tokens are appended: a verifying decode (in `out.proposals`)
        computed `kept[seq]` valid tokens, its last token and the proposals kept (a rejected
        one holds K/V of a token the sequence doesn't have): the slots past them are
        released."""
        for seq in out.proposals:
            seq.num_computed_tokens += kept.get(seq, 1)
            self.block_manager.cache_full_blocks(seq)
            self.block_manager.trim(seq)
            self.block_manager.release_out_of_window(seq)

    def _schedule_decodes(self, out: SchedulerOutput, proposals: dict) -> None:
        # First-ranked first; victims come from the tail, so a scheduled decode is never
        # preempted.
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or _remaining(seq) != 1:
                continue
            proposed = proposals.get(seq)
            if proposed and self.block_manager.can_append(seq, 1 + len(proposed)):
                self.block_manager.append_slots(seq, 1 + len(proposed))
                out.scheduled.append((seq, 1 + len(proposed)))
                out.num_decode_tokens += 1 + len(proposed)
                out.proposals[seq] = proposed
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
            num_new = whole_images(seq, num_new)
            if num_new == 0:
                continue
            self.block_manager.append_slots(seq, num_new)
            out.scheduled.append((seq, num_new))
            out.num_prefill_tokens += num_new
            budget -= num_new
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if not self.waiting:
            return
        bm = self.block_manager
        # sequences running, and those their pending forks will add
        occupied = sum(s.width for s in self.running)
        while self.waiting and budget > 0:
            seq = self.waiting[0]  # the first ranked: no skipping ahead of it
            # room for all its choices; alone, it runs whatever its width (the batch size
            # may have been shrunk below it after an out-of-memory step)
            if occupied and occupied + seq.width > self.max_batch_size:
                break
            # Prompt logprobs need the logits of every prompt position: no prefix reuse.
            hits = None if seq.request.decoder_input_details else bm.match_prefix(seq)
            num_to_compute = seq.num_tokens - len(hits or ()) * bm.block_size
            num_new = whole_images(
                seq, min(num_to_compute, budget), seq.num_tokens - num_to_compute
            )
            if num_new == 0:  # a span attended both ways waits for a whole budget
                break
            # Admit only when the whole rest of the prompt fits in the free blocks (not just
            # this chunk): a sequence admitted on a sliver would stall mid-prompt and be
            # preempted, wasting the chunks already computed. Its free prefix hits come off
            # the free list too.
            needed = num_blocks_for_tokens(num_to_compute, bm.block_size)
            needed += bm.num_free_among(hits or [])
            # Under a sliding window it never holds more than its window and a chunk
            # (at most this one; a later, larger chunk is cut to the blocks there are).
            window_blocks = bm.window_blocks(num_new)
            if window_blocks is not None:
                needed = min(needed, window_blocks)
            if needed + len(seq.forks) > bm.num_free_blocks:
                break
            if not self._adapter_fits(seq):
                break
            if self.state_slots is not None and self.state_slots.num_free < seq.width:
                break
            self.waiting.pop(0)
            bm.allocate(seq, hits)
            if self.state_slots is not None:
                self.state_slots.allocate(seq)
            bm.release_out_of_window(seq)  # prefix hits already behind its window
            bm.append_slots(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            _insert(self.running, seq)
            occupied += seq.width
            if seq.request.adapter_uid:
                self.running_adapters[seq.request.adapter_uid] += 1
            out.scheduled.append((seq, num_new))
            out.num_prefill_tokens += num_new
            budget -= num_new

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute preemption: drop seq's K/V; its generated tokens stay in token_ids and
        are recomputed with the prompt when it is admitted again (at the queue's front)."""
        self._remove_running(seq)
        self._free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        _insert(self.waiting, seq)  # its rank is kept: ahead of what arrived after it
        out.preempted.append(seq)

    def _free(self, seq: Sequence) -> None:
        """Give back seq's blocks and state slot."""
        self.block_manager.free(seq)
        if self.state_slots is not None:
            self.state_slots.free(seq)

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


def whole_images(seq: Sequence, num_new: int, start: int | None = None) -> int:
    """`num_new` cut so that the chunk from `start` (the sequence's computed tokens) ends
    in no span of tokens that attend to each other both ways (Gemma 3's images,
    PaliGemma's prompt): it ends before the span, or 0 where the chunk starts in it (the
    span waits for a budget that holds the rest of it; validation keeps each span within
    max_batch_prefill_tokens)."""
    start = seq.num_computed_tokens if start is None else start
    end = start + num_new
    for span in seq.request.both_ways:
        if span.first < end <= span.last:
            return max(span.first - start, 0)
    return num_new


def _remaining(seq: Sequence) -> int:
    return seq.num_tokens - seq.num_computed_tokens
