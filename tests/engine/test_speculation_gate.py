"""Adaptive speculation (engine/speculation_gate.py): a sequence proposes while its kept
tokens pay for what verifying costs, stops when they don't, and starts again when they would
(probes; shadows of free proposals), the costs measured on the core's clock. Here the clock
is fake and each step costs what a cost model says it costs; whatever the gate decides, the
output is the model's own."""

from __future__ import annotations

import pytest
import torch
from textgen.service.engine.config import EngineConfig
from textgen.service.engine.paged_core import PagedCore
from textgen.service.engine.scheduler import SchedulerOutput
from textgen.service.engine.speculation import SpeculationSettings
from textgen.service.engine.speculation_gate import SpeculationGate
from textgen.service.engine.types import SamplingParams

from .factories import VOCAB_SIZE, engine_copy, make_core, make_seq, random_prompt

SPECULATE = 3


class FakeCost:
    """The core's clock, in seconds, advanced only by the runner: a step of b sequences
    verifying k proposed tokens in all costs `base + per_seq * b + surcharge * k` ms."""

    def __init__(self, surcharge: float, base: float = 10.0, per_seq: float = 1.0) -> None:
        self.surcharge, self.base, self.per_seq = surcharge, base, per_seq
        self.now = 0.0
        self.proposed: list[int] = []  # per decode-only step run: its proposed tokens

    def clock(self) -> float:
        return self.now

    def install(self, core: PagedCore) -> None:
        execute = core.runner.execute

        def timed(batch):
            proposed = sum(len(p) for p in batch.proposals.values())
            cost_ms = self.base + self.per_seq * len(batch.scheduled) + self.surcharge * proposed
            self.now += cost_ms / 1000
            if not batch.num_prefill_tokens:
                self.proposed.append(proposed)
            return execute(batch)

        core.runner.execute = timed

    def verifying(self, last: int | None = None) -> int:
        """Decode steps that verified something (among the `last` ones)."""
        steps = self.proposed if last is None else self.proposed[-last:]
        return sum(1 for k in steps if k)


class CopyProposer:
    """Stands in for n-gram lookup over text the model copies (a tiny random model copies
    nothing): proposes each sequence's known continuation (its output without speculation),
    wrong while fewer than `right_from[request_id]` tokens are out. Free, as the n-gram
    proposer: the gate keeps shadows of its proposals."""

    free = True

    def __init__(self, expected: dict[str, list[int]], right_from: dict[str, int] | None = None):
        self.expected = expected
        self.right_from = right_from or {}
        self.asked = 0

    def propose(self, seqs, limits):
        self.asked += len(seqs)
        out = []
        for seq, limit in zip(seqs, limits):
            done = seq.num_output_tokens
            drafts = list(self.expected[seq.request_id][done : done + limit])
            if done < self.right_from.get(seq.request_id, 0):
                drafts = [(t + 1) % VOCAB_SIZE for t in drafts]
            out.append(drafts)
        return out

    def forget(self, seq) -> None:
        pass

    def warmup(self) -> None:
        pass


def gated_core(model, proposer, cost: FakeCost, *, adaptive: bool = True) -> PagedCore:
    core = PagedCore(
        engine_copy(model),
        EngineConfig(
            max_batch_total_tokens=8192,
            max_batch_prefill_tokens=256,
            max_batch_size=8,
            speculation=SpeculationSettings(SPECULATE, 8, adaptive=adaptive),
        ),
        proposer=proposer,
        clock=cost.clock,
    )
    cost.install(core)
    return core


def copy_heavy(count: int = 1, max_new_tokens: int = 160, sampled: bool = False):
    """Prompts of a repeated phrase; the second of two samples (seeded) when `sampled`."""
    g = torch.Generator().manual_seed(40)
    seqs = []
    for i in range(count):
        sampling = (
            SamplingParams(do_sample=True, temperature=0.9, seed=5) if sampled and i else None
        )
        prompt = random_prompt(6, VOCAB_SIZE, g) * 4
        seqs.append(
            make_seq(prompt, request_id=f"c{i}", max_new_tokens=max_new_tokens, sampling=sampling)
        )
    return seqs


def plain_outputs(model, seqs) -> dict[str, list[int]]:
    """What each request gives without speculation (its own copy of the request)."""
    core = make_core(model)
    copies = [
        make_seq(
            s.request.prompt_ids,
            request_id=s.request_id,
            max_new_tokens=s.request.stopping.max_new_tokens,
            sampling=s.request.sampling,
        )
        for s in seqs
    ]
    for seq in copies:
        core.add(seq)
    while core.has_work():
        core.step()
    return {s.request_id: s.output_ids for s in copies}


def run(core: PagedCore, seqs, on_step=None) -> None:
    for seq in seqs:
        core.add(seq)
    step = 0
    while core.has_work():
        core.step()
        step += 1
        if on_step is not None:
            on_step(step)
        assert step < 2000


# the engine, on a fake clock --------------------------------------------------------------


def test_speculation_that_cannot_pay_stops_but_for_probes(tiny_llama):
    """Each proposed token costs 30 ms where a step costs 11: even all kept, 3 proposals
    never pay. After the first verifications measure that, the sequence only probes."""
    seqs = copy_heavy()
    expected = plain_outputs(tiny_llama, seqs)
    cost = FakeCost(surcharge=30.0)
    core = gated_core(tiny_llama, CopyProposer(expected), cost)
    offs = []
    run(core, seqs, lambda _: offs.append(core.stats().spec_sequences_off))
    assert seqs[0].output_ids == expected["c0"]
    stats = core.stats()
    assert 0 < stats.spec_verifications and stats.spec_accepted_tokens > 0  # it was measured
    last = len(cost.proposed) - 8  # after the warm-up
    assert last > 100
    probe_every = core.gate.probe_every
    assert cost.verifying(last) <= last // probe_every + 1
    assert max(offs) == 1 and stats.spec_skipped_proposals > last / 2
    assert stats.spec_sequences_off == 0  # ended: forgotten


def test_speculation_that_pays_goes_on(tiny_llama):
    """0.1 ms a proposed token, all kept: every step but the few plain ones that measure
    the base verifies."""
    seqs = copy_heavy()
    expected = plain_outputs(tiny_llama, seqs)
    cost = FakeCost(surcharge=0.1)
    core = gated_core(tiny_llama, CopyProposer(expected), cost)
    run(core, seqs)
    assert seqs[0].output_ids == expected["c0"]
    steps = len(cost.proposed)
    assert cost.verifying() >= 0.85 * steps
    assert steps < 0.4 * len(expected["c0"])  # most steps gained SPECULATE + 1 tokens
    assert core.stats().spec_sequences_off == 0


def test_speculation_resumes_when_verifying_gets_cheap(tiny_llama):
    """Expensive, then cheap (another process leaves the cores): off, then on again through
    the probes, which measure the cost anew. A greedy and a seeded request, both the same
    as without speculation."""
    seqs = copy_heavy(2, max_new_tokens=320, sampled=True)
    expected = plain_outputs(tiny_llama, seqs)
    cost = FakeCost(surcharge=30.0)
    core = gated_core(tiny_llama, CopyProposer(expected), cost)
    core.gate.probe_every, core.gate.max_probe_every = 4, 16
    switch, marks = 60, {}

    def on_step(step: int) -> None:
        if step == switch:
            marks["off"] = core.stats().spec_sequences_off
            marks["verifying"] = cost.verifying(40)
            cost.surcharge = 0.1

    run(core, seqs, on_step)
    assert [s.output_ids for s in seqs] == [expected["c0"], expected["c1"]]
    assert marks["off"] == 2
    assert marks["verifying"] <= 40 // 4 + 1  # probes only
    assert cost.verifying(20) >= 17  # on again, both
    assert core.gate.cost_ms < 1.0


def test_a_shadow_turns_an_off_sequence_on_before_any_probe(tiny_llama):
    """Wrong proposals first (kept: none), right ones from the 40th token on. At 5 ms a
    token, 3 proposals pay once more than ~1.4 are kept. Probes never come here: the shadow
    proposals, compared with the tokens that follow, turn the sequence on."""
    seqs = copy_heavy(max_new_tokens=120)
    expected = plain_outputs(tiny_llama, seqs)
    proposer = CopyProposer(expected, right_from={"c0": 40})
    cost = FakeCost(surcharge=5.0)
    core = gated_core(tiny_llama, proposer, cost)
    core.gate.probe_every = core.gate.max_probe_every = 10_000
    seq = seqs[0]
    trace = []  # (tokens out, off) per step
    run(core, seqs, lambda _: trace.append((seq.num_output_tokens, core.gate.is_off(seq))))
    assert seq.output_ids == expected["c0"]
    off_while_wrong = [off for out, off in trace if 8 <= out < 40]
    assert off_while_wrong and all(off_while_wrong)
    turned_on = next(out for out, off in trace if out >= 40 and not off)
    assert turned_on < 56  # a few shadows of 3 tokens after the switch
    assert cost.verifying(10) >= 8
    assert core.stats().spec_accepted_tokens > 40


def test_not_adaptive_verifies_every_decode(tiny_llama):
    """--no-speculate-adaptive: the old behaviour, whatever verifying costs."""
    seqs = copy_heavy(max_new_tokens=60)
    expected = plain_outputs(tiny_llama, seqs)
    cost = FakeCost(surcharge=30.0)
    core = gated_core(tiny_llama, CopyProposer(expected), cost, adaptive=False)
    assert core.gate is None
    run(core, seqs)
    assert seqs[0].output_ids == expected["c0"]
    assert all(cost.proposed[:-1])  # each decode step but a last one with no room
    stats = core.stats()
    assert stats.spec_verifications >= len(cost.proposed) - 1
    assert stats.spec_skipped_proposals == stats.spec_sequences_off == 0


def test_the_n_gram_proposer_is_free_and_the_draft_model_is_not():
    from textgen.service.engine.draft_model import DraftModelProposer
    from textgen.service.engine.speculation import NgramProposer

    assert NgramProposer.free and not DraftModelProposer.free


# the gate alone -------------------------------------------------------------------------


def test_the_rule_pays_when_tokens_per_millisecond_rise():
    gate = SpeculationGate(free=True)
    assert gate.pays(None, 3, 1)  # nothing measured: propose
    gate.base_ms[1] = 11.0
    assert gate.pays(0.0, 3, 1)  # the cost per token unknown: propose
    gate.cost_ms = 30.0
    assert not gate.pays(3.0, 3, 1)  # 3 kept for 90 ms more, where 11 ms gives one
    gate.cost_ms = 5.0
    assert gate.pays(1.5, 3, 1)  # 1.5 * 11 > 3 * 5
    assert not gate.pays(1.3, 3, 1)
    assert gate.pays(3.0, 3, 1)
    assert not gate.pays(3.0, 0, 1)  # nothing to propose
    gate.cost_ms = 12.0
    assert not gate.pays(9.0, 3, 1)  # never more kept than proposed: 3 * 11 < 3 * 12
    # a batch of 4: a step gives 4 tokens in 14 ms, 3.5 ms a token
    gate.base_ms[4] = 14.0
    gate.cost_ms = 5.0
    assert not gate.pays(3.0, 3, 4)  # 3 * 3.5 < 3 * 5
    assert not gate.pays(3.0, 1, 4)  # at most 1 kept: 3.5 < 5
    gate.cost_ms = 3.0
    assert gate.pays(1.0, 1, 4) and not gate.pays(0.8, 1, 4)  # 0.8 * 3.5 < 3
    # an unmeasured batch size: the nearest one's base
    assert gate.base_of(3) == 14.0 and gate.base_of(2) == 11.0 and gate.base_of(9) == 14.0


def step(gate, seq, cost_ms: float, plain_ms: float = 11.0, accepted: int = 0) -> list[int]:
    """One decode-only step of `seq` alone: proposing 3 (all right when `accepted` is 3)
    costs `cost_ms` a token. -> what it verified."""
    clock = gate.clock
    gate.start_step()
    [proposed] = gate.propose(Fixed(), [seq], [SPECULATE], 1, True)
    batch = SchedulerOutput(scheduled=[(seq, 1 + len(proposed))])
    if proposed:
        batch.proposals[seq] = proposed
        gate.verified(seq, len(proposed), accepted)
    clock.now += (plain_ms + cost_ms * len(proposed)) / 1000
    gate.end_step(batch)
    seq.token_ids.append(1)
    return proposed


class Fixed:
    free = False

    def propose(self, seqs, limits):
        return [[7] * limit for limit in limits]


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_probes_double_while_they_dont_pay_and_start_over_when_they_do():
    gate = SpeculationGate(free=False, clock=Clock(), probe_every=2, max_probe_every=8)
    seq = make_seq([1, 2, 3], max_new_tokens=500)
    seq.token_ids.append(4)
    seq.num_computed_tokens = 3
    verified = [bool(step(gate, seq, cost_ms=30.0, accepted=3)) for _ in range(40)]
    # a plain step (the base unknown), an optimistic verification, then off: probes after
    # 2 steps, then 4, then 8 (at most)
    assert verified[:3] == [False, True, False]
    assert [i for i, v in enumerate(verified) if v] == [1, 4, 8, 16, 24, 32]
    assert gate.is_off(seq) and gate.sequences_off == 1
    assert gate.cost_ms == pytest.approx(30.0)
    # cheap now: the probes measure it (each weighs half: 15, then 7.5 ms a token) and
    # the second pays: on at every step from then on but the plain ones that keep the base
    # measured
    verified = [bool(step(gate, seq, cost_ms=0.1, accepted=3)) for _ in range(80)]
    assert verified[:10] == [True] + [False] * 7 + [True, True]
    assert gate.cost_ms < 1.0 and not gate.is_off(seq)
    assert sum(verified[-40:]) >= 40 - 40 // gate.stale_steps - 1
    gate.forget(seq)
    assert gate.sequences_off == 0


def test_a_shadow_sample_is_the_prefix_the_tokens_that_followed_would_have_kept():
    gate = SpeculationGate(free=True, clock=Clock())
    seq = make_seq([1, 2, 3], max_new_tokens=100)
    seq.token_ids.append(4)

    class Ngram:
        free = True

        def propose(self, seqs, limits):
            return [[5, 6, 7]]

    gate.base_ms[1], gate.cost_ms = 10.0, 30.0  # known, and nothing pays
    gate._base_at[1] = 0
    gate.start_step()
    assert gate.propose(Ngram(), [seq], [3], 1, True) == [[]]
    assert gate.is_off(seq) and gate.acceptance(seq) is None
    seq.token_ids += [5, 6]  # both as proposed: not settled yet
    gate.start_step()
    gate.propose(Ngram(), [seq], [3], 1, True)
    assert gate.acceptance(seq) is None
    seq.token_ids += [9]  # the third differs: 2 would have been kept
    gate.start_step()
    gate.propose(Ngram(), [seq], [3], 1, True)
    assert gate.acceptance(seq) == 2.0
    assert gate.skipped == 3


def test_a_stale_base_takes_one_plain_step():
    gate = SpeculationGate(free=False, clock=Clock(), stale_steps=5)
    seq = make_seq([1, 2, 3], max_new_tokens=500)
    seq.token_ids.append(4)
    verified = [bool(step(gate, seq, cost_ms=0.1, accepted=3)) for _ in range(20)]
    # plain at 0, then verifying until the base is more than 5 steps old
    assert [i for i, v in enumerate(verified) if not v] == [0, 6, 12, 18]
