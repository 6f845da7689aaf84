"""Scheduler policy with plain sequences and no model: budgets, chunking, admission,
preemption and prefix reuse accounting."""

from __future__ import annotations

from textgen.service.engine.block_manager import BlockManager
from textgen.service.engine.scheduler import Scheduler, SchedulerOutput
from textgen.service.engine.sequence import SequenceStatus
from textgen.service.engine.stopping import token_stop_reason

from .factories import make_seq

BS = 4
NEXT_TOKEN = 7  # what the fake "model" always generates


def make_scheduler(
    num_blocks: int = 64, prefill_budget: int = 16, max_batch_size: int = 8
) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, BS),
        max_batch_prefill_tokens=prefill_budget,
        max_batch_size=max_batch_size,
    )


def fake_step(scheduler: Scheduler) -> SchedulerOutput:
    """What the core does around a forward: commit, append a token to completed rows, retire."""
    out = scheduler.schedule()
    scheduler.commit(out)
    for seq, _ in out.scheduled:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(NEXT_TOKEN)
            reason = token_stop_reason(seq, NEXT_TOKEN, grammar_complete=False, now=0.0)
            if reason is not None:
                seq.finish(reason)
                scheduler.finish(seq)
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(seq.request_id, n) for seq, n in out.scheduled]


def test_long_prompt_is_chunked_within_the_prefill_budget():
    sched = make_scheduler(prefill_budget=16)
    seq = make_seq(list(range(40)), request_id="long", max_new_tokens=2)
    sched.add(seq)
    assert plan(fake_step(sched)) == [("long", 16)]
    assert plan(fake_step(sched)) == [("long", 16)]
    out = fake_step(sched)
    assert plan(out) == [("long", 8)] and seq.num_output_tokens == 1
    assert plan(fake_step(sched)) == [("long", 1)]  # the decode
    assert seq.is_finished and not sched.has_work()
    assert sched.block_manager.num_used_blocks == 0


def test_decodes_come_first_and_prefill_chunks_share_the_step():
    sched = make_scheduler(prefill_budget=10)
    short = make_seq([1, 2, 3], request_id="short", max_new_tokens=5)
    sched.add(short)
    fake_step(sched)  # short's prefill
    sched.add(make_seq(list(range(25)), request_id="long"))
    out = fake_step(sched)
    assert plan(out) == [("short", 1), ("long", 10)]
    assert (out.num_decode_tokens, out.num_prefill_tokens) == (1, 10)
    assert plan(fake_step(sched)) == [("short", 1), ("long", 10)]


def test_admission_is_fcfs_within_budget_and_batch_size():
    sched = make_scheduler(prefill_budget=12, max_batch_size=3)
    for i, n in enumerate([5, 5, 5, 5]):
        sched.add(make_seq([i] * n, request_id=f"s{i}"))
    # budget 12: s0 and s1 whole, s2 gets a 2-token chunk
    assert plan(fake_step(sched)) == [("s0", 5), ("s1", 5), ("s2", 2)]
    # s0, s1 decode; s2 continues; s3 waits for a batch slot (max_batch_size 3)
    assert plan(fake_step(sched)) == [("s0", 1), ("s1", 1), ("s2", 3)]
    assert [s.request_id for s in sched.waiting] == ["s3"]


def test_head_of_line_request_that_does_not_fit_blocks_later_ones():
    sched = make_scheduler(num_blocks=4, prefill_budget=64)
    sched.add(make_seq([1] * 9, request_id="running", max_new_tokens=4))
    fake_step(sched)  # 3 blocks used, 1 free
    sched.add(make_seq([2] * 8, request_id="big"))  # needs 2 blocks
    sched.add(make_seq([3] * 2, request_id="small"))  # would fit, but must not overtake
    out = fake_step(sched)
    assert plan(out) == [("running", 1)]
    assert [s.request_id for s in sched.waiting] == ["big", "small"]


def test_pool_exhaustion_preempts_the_youngest_by_recompute():
    sched = make_scheduler(num_blocks=4, prefill_budget=64)
    old = make_seq([1] * 7, request_id="old", max_new_tokens=6)
    young = make_seq([2] * 7, request_id="young", max_new_tokens=6)
    sched.add(old)
    sched.add(young)
    fake_step(sched)  # both prefilled: 2 blocks each, the pool is full
    out = fake_step(sched)  # both decode position 7 into their second block
    assert plan(out) == [("old", 1), ("young", 1)]
    out = fake_step(sched)  # position 8 needs a third block for old: young is preempted
    assert plan(out) == [("old", 1)]
    assert out.preempted == [young] and sched.num_preemptions == 1
    assert young.status is SequenceStatus.WAITING and young.num_computed_tokens == 0
    assert young.block_table == [] and young.output_ids == [NEXT_TOKEN, NEXT_TOKEN]
    assert list(sched.waiting) == [young]
    while sched.has_work():
        fake_step(sched)
    # the preempted sequence recomputed prompt + generated tokens and finished normally
    assert old.num_output_tokens == young.num_output_tokens == 6
    assert sched.block_manager.num_used_blocks == 0


def test_youngest_decode_that_cannot_grow_preempts_itself():
    sched = make_scheduler(num_blocks=3, prefill_budget=64)
    a = make_seq([1] * 4, request_id="a", max_new_tokens=8)
    b = make_seq([2] * 4, request_id="b", max_new_tokens=8)
    sched.add(a)
    sched.add(b)
    fake_step(sched)
    # Each decode of position 4 needs a new block; only one is free: b (youngest) yields.
    out = fake_step(sched)
    assert plan(out) == [("a", 1)] and out.preempted == [b]


def test_preemption_step_admits_no_one():
    sched = make_scheduler(num_blocks=4, prefill_budget=64)
    sched.add(make_seq([1] * 7, request_id="old", max_new_tokens=6))
    sched.add(make_seq([2] * 7, request_id="young", max_new_tokens=6))
    fake_step(sched)
    fake_step(sched)
    out = fake_step(sched)
    assert out.preempted and all(s.request_id != "young" for s, _ in out.scheduled)


def test_prefix_reuse_starts_after_the_cached_blocks():
    sched = make_scheduler(prefill_budget=64)
    system = list(range(100, 112))  # 3 full blocks
    first = make_seq(system + [1, 2], request_id="first", max_new_tokens=1)
    sched.add(first)
    fake_step(sched)
    second = make_seq(system + [3, 4, 5], request_id="second", max_new_tokens=1)
    sched.add(second)
    out = fake_step(sched)
    assert plan(out) == [("second", 3)]
    assert second.num_cached_prompt_tokens == 12
    bm = sched.block_manager
    assert bm.prefix_hit_tokens == 12 and bm.prefix_queried_tokens == 14 + 15
    assert bm.num_used_blocks == 0  # both finished (max_new_tokens=1)


def test_decoder_input_details_skips_the_prefix_cache():
    sched = make_scheduler(prefill_budget=64)
    prompt = list(range(100, 113))
    sched.add(make_seq(prompt, request_id="first", max_new_tokens=1))
    fake_step(sched)
    detailed = make_seq(prompt, request_id="detailed", max_new_tokens=1, decoder_input_details=True)
    sched.add(detailed)
    assert plan(fake_step(sched)) == [("detailed", 13)]
    assert detailed.num_cached_prompt_tokens == 0


def test_finish_frees_waiting_and_running_sequences():
    sched = make_scheduler(prefill_budget=8)
    running = make_seq(list(range(20)), request_id="running")
    waiting = make_seq([1, 2], request_id="waiting")
    sched.add(running)
    fake_step(sched)  # running is mid-prefill, holding 2 blocks
    sched.add(waiting)
    sched.finish(running)
    sched.finish(waiting)
    assert not sched.has_work() and sched.block_manager.num_used_blocks == 0
    assert running.is_finished and waiting.is_finished
    sched.finish(running)  # idempotent: the engine loop may abort a finished sequence


def test_waiting_sequences_are_admitted_by_priority_then_arrival():
    """Lower priority values first (vLLM's convention); arrival order breaks ties."""
    sched = make_scheduler(max_batch_size=1, prefill_budget=64)
    running = make_seq([1] * 4, request_id="running", max_new_tokens=3, priority=5)
    sched.add(running)
    fake_step(sched)
    for rid, priority in (("low-1", 1), ("low-2", 1), ("high", -1), ("normal", 0)):
        sched.add(make_seq([2] * 4, request_id=rid, max_new_tokens=1, priority=priority))
    assert [s.request_id for s in sched.waiting] == ["high", "normal", "low-1", "low-2"]
    started = []
    while sched.has_work():
        started += [s.request_id for s, n in fake_step(sched).scheduled if n > 1]
    # the one slot frees when `running` ends; a higher priority never preempts it
    assert started == ["high", "normal", "low-1", "low-2"]


def test_preemption_takes_the_lowest_priority_first():
    sched = make_scheduler(num_blocks=3, prefill_budget=64)
    low = make_seq([1] * 4, request_id="low", max_new_tokens=8, priority=3)
    high = make_seq([2] * 4, request_id="high", max_new_tokens=8, priority=0)
    sched.add(low)  # older, but less important
    sched.add(high)
    fake_step(sched)
    # each decode of position 4 needs a block, one is free: the low one yields, not the young
    out = fake_step(sched)
    assert plan(out) == [("high", 1)] and out.preempted == [low]
    # preempted, it keeps its rank: still ahead of a later request of its own priority
    later = make_seq([3] * 4, request_id="later", max_new_tokens=1, priority=3)
    sched.add(later)
    assert [s.request_id for s in sched.waiting] == ["low", "later"]


def test_waiting_requests_join_the_running_decodes_at_the_next_step():
    """TGI's --max-waiting-tokens N: waiting requests join the batch after at most N decode
    steps (its --waiting-served-ratio may pause them sooner). Here a request waits zero
    decode steps, whatever N: it is admitted at the very next step beside every running
    decode, which keeps decoding; and a long prompt, chunked, delays the decodes by one
    budgeted chunk per step, never a whole prefill (text-generation-launcher accepts both
    flags on this ground: docs/launcher.md)."""
    sched = make_scheduler(prefill_budget=8, max_batch_size=8)
    running = [make_seq([i, i + 1], request_id=f"run{i}", max_new_tokens=50) for i in range(3)]
    for seq in running:
        sched.add(seq)
    fake_step(sched)  # their prefills
    for _ in range(5):  # decoding
        assert plan(fake_step(sched)) == [(s.request_id, 1) for s in running]
    late = make_seq(list(range(20)), request_id="late", max_new_tokens=4)
    sched.add(late)
    steps = [plan(fake_step(sched)) for _ in range(3)]
    decodes = [(s.request_id, 1) for s in running]
    assert steps[0] == [*decodes, ("late", 8)]  # admitted at once, a chunk of the budget
    assert steps[1] == [*decodes, ("late", 8)]
    assert steps[2] == [*decodes, ("late", 4)]  # and the decodes never paused
