"""Adaptive speculation: which decoding sequences propose this step (docs/speculation.md,
"Adaptive speculation").

A verification pays when the tokens it keeps are worth more than the time it adds to the
step. Both sides are measured, on the core's clock, over decode-only steps (no prefill
chunk in them), whole steps as a user waits for them (proposing, scheduling, the forward,
sampling, appending):

- `base_ms[b]`: a step of b decoding sequences that verifies nothing (a moving average per
  batch size);
- `cost_ms`: what one proposed token adds to a step, (elapsed - base_ms[b]) / the step's
  proposed tokens, over verifying steps;
- per sequence, its accepted tokens per verification (a moving average, optimistic until
  measured: as many as it proposes).

A sequence proposing k tokens in a batch of b proposes iff acc * base_ms[b] / b > k * cost_ms:
the step then gives more tokens per millisecond, (b + acc) / (base + k cost) > b / base.
Unknown costs propose (they get measured so): when no plain step of the batch's size was
measured in the last `stale_steps` steps, the next decode-only step proposes nothing.

A sequence that is off still proposes every `probe_every` steps (a probe), which measures
its acceptance and the cost again; the interval doubles after each probe that didn't pay,
up to `max_probe_every`, and starts over when the sequence pays again. Where proposals are
free (the n-gram proposer, `free = True`), an off sequence also keeps a shadow proposal
that is never verified: the tokens it then appends tell how many of it would have been kept,
an acceptance sample at no cost, so a sequence that starts copying turns on at once.

The gate only chooses who proposes: the tokens are the model's own either way.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from .scheduler import SchedulerOutput
from .sequence import Sequence
from .speculation import Proposer


@dataclass(slots=True)
class _Track:
    """What the gate knows of one sequence."""

    probe_every: int  # steps between probes while off
    acceptance: float | None = None  # accepted tokens per verification (None: unmeasured)
    off: bool = False
    next_probe: int = 0  # the step from which an off sequence probes
    probed_at: int = 0  # the step of its latest probe
    probing: bool = False  # its next verification is a probe
    probed: bool = False  # a probe was verified since the last decision
    shadow: tuple[int, list[int]] | None = None  # (position, proposal) not verified


class SpeculationGate:
    def __init__(
        self,
        *,
        free: bool,
        clock: Callable[[], float] = time.perf_counter,
        probe_every: int = 16,
        max_probe_every: int = 128,
        stale_steps: int = 32,
        acceptance_weight: float = 0.2,
        cost_weight: float = 0.1,
        probe_weight: float = 0.5,
    ) -> None:
        """
        Args:
            free: proposals cost nothing worth measuring (the n-gram proposer): off
                sequences keep shadow proposals. Otherwise the proposer is only asked for
                the sequences that propose.
            clock: seconds, monotonic (the core's).
            probe_every, max_probe_every: the steps between an off sequence's probes, at
                first and at most.
            stale_steps: a batch size's plain-step time is measured again after as many
                steps.
            acceptance_weight: a verification's (or a shadow's) weight in its sequence's
                acceptance; a probe's is `probe_weight`.
            cost_weight: a step time's weight when it follows the previous sample of the
                same average; after a gap of g steps, 1 - (1 - cost_weight) ** g (an average
                over steps, not samples: a sample after a long gap tells more), at most
                `probe_weight`.
        """
        if not 1 <= probe_every <= max_probe_every:
            raise ValueError("need 1 <= probe_every <= max_probe_every")
        self.free = free
        self.clock = clock
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.stale_steps = stale_steps
        self.acceptance_weight, self.cost_weight = acceptance_weight, cost_weight
        self.probe_weight = probe_weight
        self.base_ms: dict[int, float] = {}  # batch size -> a plain decode step's time
        self._base_at: dict[int, int] = {}  # batch size -> the step of its latest sample
        self.cost_ms: float | None = None  # what a proposed token adds to a decode step
        self._cost_at = 0
        self.skipped = 0  # (sequence, step) pairs kept from proposing, cumulative
        # sequences (not ended) that propose only to probe, counted on the engine's thread
        # after each step (stats() reads it from others)
        self.sequences_off = 0
        self._steps = 0
        self._started: float | None = None
        self._tracks: weakref.WeakKeyDictionary[Sequence, _Track] = weakref.WeakKeyDictionary()

    # the core's calls, in step order ------------------------------------------------

    def start_step(self) -> None:
        self._steps += 1
        self._started = self.clock()

    def propose(
        self,
        proposer: Proposer,
        seqs: list[Sequence],
        limits: list[int],
        batch_size: int,
        decode_only: bool,
    ) -> list[list[int]]:
        """The proposals to verify for `seqs` (decoding, at most `limits[i]` tokens each),
        [] for those that don't propose this step. `batch_size`: the sequences the step
        runs; `decode_only`: it will have no prefill chunk (a step that can be measured)."""
        tracks = [self._track(seq) for seq in seqs]
        for seq, track in zip(seqs, tracks):
            self._read_shadow(seq, track)
        if decode_only and self._base_stale(batch_size):
            # measure a plain step of this size first
            self.skipped += sum(not t.off for t in tracks)
            return [[] for _ in seqs]
        if self.free:
            drafts = proposer.propose(seqs, limits)
            wanted = [self._wants(t, len(d), batch_size) for t, d in zip(tracks, drafts)]
        else:
            wanted = [self._wants(t, k, batch_size) for t, k in zip(tracks, limits)]
            asked = [i for i, want in enumerate(wanted) if want]
            got = proposer.propose([seqs[i] for i in asked], [limits[i] for i in asked])
            drafts = [[] for _ in seqs]
            for i, proposed in zip(asked, got if asked else ()):
                drafts[i] = proposed
        out = []
        for seq, track, want, proposed in zip(seqs, tracks, wanted, drafts):
            if want:
                out.append(proposed)
                continue
            out.append([])
            if proposed or not self.free:
                self.skipped += 1
            if proposed and track.shadow is None:
                track.shadow = (seq.num_tokens, proposed)
        return out

    def verified(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """`seq` verified `proposed` tokens and kept `accepted` of them."""
        track = self._tracks.get(seq)
        if track is None:
            return
        weight = self.acceptance_weight
        if track.probing:
            track.probing, track.probed = False, True
            weight = self.probe_weight
        track.acceptance = _average(track.acceptance, float(accepted), weight)

    def end_step(self, batch: SchedulerOutput) -> None:
        """The step ran `batch`: a decode-only step's time is a sample of the costs."""
        if self._started is None:
            return
        elapsed_ms = (self.clock() - self._started) * 1000.0
        self._started = None
        self._count_off()
        if batch.num_prefill_tokens or not batch.scheduled:
            return
        size = len(batch.scheduled)
        proposed = sum(len(p) for p in batch.proposals.values())
        if not proposed:
            gap = self._steps - self._base_at.get(size, self._steps - 1)
            self.base_ms[size] = _average(self.base_ms.get(size), elapsed_ms, self._weight(gap))
            self._base_at[size] = self._steps
            return
        base = self.base_of(size)
        if base is None:
            return
        sample = max(0.0, (elapsed_ms - base) / proposed)
        self.cost_ms = _average(self.cost_ms, sample, self._weight(self._steps - self._cost_at))
        self._cost_at = self._steps

    def forget(self, seq: Sequence) -> None:
        if self._tracks.pop(seq, None) is not None:
            self._count_off()

    # what it knows -------------------------------------------------------------------

    def is_off(self, seq: Sequence) -> bool:
        track = self._tracks.get(seq)
        return track is not None and track.off

    def acceptance(self, seq: Sequence) -> float | None:
        track = self._tracks.get(seq)
        return track.acceptance if track is not None else None

    def base_of(self, size: int) -> float | None:
        """A plain step's time at this batch size, or at the nearest one measured."""
        if size in self.base_ms:
            return self.base_ms[size]
        if not self.base_ms:
            return None
        return self.base_ms[min(self.base_ms, key=lambda b: (abs(b - size), b))]

    def pays(self, acceptance: float | None, proposed: int, batch_size: int) -> bool:
        """Whether `proposed` tokens, of which `acceptance` are kept on average (None:
        unmeasured, all of them), raise the tokens per millisecond of a step of
        `batch_size` sequences. Unknown costs: yes."""
        if proposed <= 0:
            return False
        kept = proposed if acceptance is None else min(acceptance, float(proposed))
        base, cost = self.base_of(batch_size), self.cost_ms
        if base is None or cost is None:
            return True
        return kept * base / max(batch_size, 1) > proposed * cost

    # internals -----------------------------------------------------------------------

    def _track(self, seq: Sequence) -> _Track:
        track = self._tracks.get(seq)
        if track is None:
            track = self._tracks[seq] = _Track(self.probe_every)
        return track

    def _wants(self, track: _Track, proposed: int, batch_size: int) -> bool:
        """Whether the sequence proposes: it pays, or it is off and a probe is due."""
        if proposed <= 0:
            return False
        pays = self.pays(track.acceptance, proposed, batch_size)
        if track.probed:  # a probe's outcome: probe sooner or later from now on
            track.probed = False
            if not pays:
                track.probe_every = min(2 * track.probe_every, self.max_probe_every)
                track.next_probe = track.probed_at + track.probe_every
        if pays:
            track.off, track.shadow, track.probing = False, None, False
            track.probe_every = self.probe_every
            return True
        if not track.off:
            track.off = True
            track.next_probe = self._steps + track.probe_every
        if self._steps >= track.next_probe:
            track.probing, track.probed_at = True, self._steps
            track.shadow = None  # the probe samples this stretch
            return True
        return False

    def _read_shadow(self, seq: Sequence, track: _Track) -> None:
        """An off sequence's shadow proposal, once the tokens it appended since settle it:
        the prefix a verification would have kept is an acceptance sample."""
        if track.shadow is None:
            return
        at, proposed = track.shadow
        appended = seq.token_ids[at : at + len(proposed)]
        kept = 0
        while kept < len(appended) and appended[kept] == proposed[kept]:
            kept += 1
        if kept == len(appended) < len(proposed):
            return  # all agree so far: wait for the rest
        track.shadow = None
        if track.off:
            track.acceptance = _average(track.acceptance, float(kept), self.acceptance_weight)

    def _count_off(self) -> None:
        self.sequences_off = sum(t.off for t in self._tracks.values())

    def _base_stale(self, size: int) -> bool:
        at = self._base_at.get(size)
        return at is None or self._steps - at > self.stale_steps

    def _weight(self, gap: int) -> float:
        return min(self.probe_weight, 1.0 - (1.0 - self.cost_weight) ** max(gap, 1))


def _average(current: float | None, sample: float, weight: float) -> float:
    """An exponential moving average; the first sample is taken whole."""
    return sample if current is None else current + weight * (sample - current)
