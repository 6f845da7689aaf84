"""A request's n choices (OpenAI's `n`, TGI's `best_of`): the prompt is computed once,
its KV blocks shared by every choice (the partial last block copied on first write),
and each choice samples with its own seed exactly what an n=1 request with that seed
samples."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from textgen.service.engine.block_manager import BlockManager
from textgen.service.engine.sequence import Sequence
from textgen.service.engine.types import EngineError, SamplingParams

from .factories import (
    VOCAB_SIZE,
    assert_idle,
    assert_matches_generate,
    make_core,
    make_seq,
    random_prompt,
    reference_greedy,
    run_to_completion,
)

HOT = SamplingParams(do_sample=True, temperature=5.0, seed=11)  # choices that differ


def choices(prompt, n: int, *, request_id="c", sampling=HOT, max_new_tokens=12) -> list[Sequence]:
    """The request's sequences as EngineLoop makes them: the first carries the others."""
    first = make_seq(
        prompt, request_id=request_id, sampling=sampling, max_new_tokens=max_new_tokens
    )
    request = replace(first.request, n=n)
    seqs = [Sequence(r, first.eos_token_ids, choice=i) for i, r in enumerate(request.choices())]
    seqs[0].forks = seqs[1:]
    return seqs


def alone(model, seq: Sequence, **core_args) -> list[int]:
    """What `seq`'s request gives as an n=1 request, in a core of its own."""
    core = make_core(model, **core_args)
    single = make_seq(
        list(seq.request.prompt_ids),
        sampling=seq.request.sampling,
        max_new_tokens=seq.request.stopping.max_new_tokens,
    )
    core.add(single)
    run_to_completion(core)
    return single.output_ids


def test_request_choices_derive_their_seeds_from_the_request():
    seqs = choices([1, 2, 3], 3, sampling=replace(HOT, seed=2**64 - 2))
    assert [s.request.sampling.seed for s in seqs] == [2**64 - 2, 2**64 - 1, 0]
    assert [s.request_id for s in seqs] == ["c", "c-1", "c-2"]
    assert all(s.request.n == 1 for s in seqs) and seqs[0].width == 3


@pytest.mark.parametrize("prompt_len", [37, 32])  # a partial last block (copied), whole blocks
def test_choices_prefill_once_and_sample_as_their_seeds_alone(tiny_llama, prompt_len):
    prompt = random_prompt(prompt_len, VOCAB_SIZE, torch.Generator().manual_seed(prompt_len))
    core = make_core(tiny_llama)
    seqs = choices(prompt, 3)
    core.add(seqs[0])
    run_to_completion(core)
    # one prefill: the prompt's tokens, once; the choices' first tokens come from its logits
    assert core.stats().prefill_tokens == prompt_len
    assert core.stats().running == 0 and all(s.is_finished for s in seqs)
    outputs = [s.output_ids for s in seqs]
    assert outputs == [alone(tiny_llama, s) for s in seqs]
    assert len({tuple(o) for o in outputs}) > 1  # the seeds differ, so do the choices
    assert_idle(core)


def test_greedy_choices_all_equal_generate(tiny_llama):
    prompt = random_prompt(21, VOCAB_SIZE, torch.Generator().manual_seed(5))
    core = make_core(tiny_llama)
    seqs = choices(prompt, 4, sampling=SamplingParams(), max_new_tokens=10)
    core.add(seqs[0])
    outputs = run_to_completion(core)
    expected = reference_greedy(tiny_llama, prompt, 10)
    assert [s.output_ids for s in seqs] == [expected] * 4
    assert len(outputs) == 4 * 10
    assert_idle(core)


def test_forks_copy_the_shared_partial_block_once_each(tiny_llama):
    prompt = list(range(1, 38))  # 2 full blocks of 16, 5 tokens in the third
    core = make_core(tiny_llama)
    seqs = choices(prompt, 3)
    core.add(seqs[0])
    core.step()  # the prefill; the forks now share all three blocks
    tables = [list(s.block_table) for s in seqs]
    assert tables[0] == tables[1] == tables[2]
    assert [core.block_manager.blocks[b].ref_count for b in tables[0]] == [3, 3, 3]
    batch = core.scheduler.schedule()  # each choice's first decode writes into block 3
    # the first two writers copy it; the last one holds it alone by then and writes in place
    assert len(batch.block_copies) == 2
    assert {src for src, _ in batch.block_copies} == {tables[0][2]}
    assert [s.block_table[:2] for s in seqs] == [tables[0][:2]] * 3
    assert len({s.block_table[2] for s in seqs}) == 3


def test_forks_preempted_in_a_small_pool_still_sample_as_alone(tiny_llama):
    # 12 blocks of 8. The request (a 30-token prompt, 3 choices of up to 18 more tokens)
    # needs all 12 at the end: 3 shared prompt blocks + 3 of each choice's own. With
    # another request holding blocks, some choices are preempted and recomputed.
    prompt = random_prompt(30, VOCAB_SIZE, torch.Generator().manual_seed(9))
    args = {"total_tokens": 96, "prefill_tokens": 64, "block_size": 8}
    core = make_core(tiny_llama, **args)
    seqs = choices(prompt, 3, max_new_tokens=18)
    core.add(make_seq(list(range(1, 21)), request_id="busy", max_new_tokens=30))
    core.step()
    core.add(seqs[0])
    run_to_completion(core)
    assert core.stats().preemptions > 0
    assert [s.output_ids for s in seqs] == [alone(tiny_llama, s, **args) for s in seqs]
    assert_idle(core)


def test_choices_that_can_never_fit_at_once_are_refused(tiny_llama):
    core = make_core(tiny_llama, total_tokens=96, block_size=8)  # 12 blocks
    # a 20-token prompt (2 shared blocks) + 20 new tokens: 3 more blocks per choice
    with pytest.raises(EngineError) as info:
        core.add(choices(list(range(20)), 4, max_new_tokens=20)[0])  # 2 + 4 * 3 = 14
    assert info.value.error_type.value == "validation"
    core.add(choices(list(range(20)), 3, max_new_tokens=20)[0])  # 2 + 3 * 3 = 11
    run_to_completion(core)
    assert_idle(core)


def test_a_request_is_admitted_only_with_room_for_all_its_choices(tiny_llama):
    core = make_core(tiny_llama, batch_size=4)
    first, second = (
        choices(list(range(1, 20)), 3, request_id="a"),
        choices(list(range(2, 21)), 3, request_id="b"),
    )
    core.add(first[0])
    core.add(second[0])
    while core.has_work():
        core.step()
        assert len(core.scheduler.running) <= 4
    assert all(s.is_finished for s in first + second)
    assert_idle(core)


def test_aborting_every_choice_before_the_fork_frees_everything(tiny_llama):
    core = make_core(tiny_llama, prefill_tokens=16)  # the 40-token prompt takes 3 steps
    seqs = choices(list(range(1, 41)), 3)
    core.add(seqs[0])
    core.step()
    for s in seqs:
        core.abort(s)
    run_to_completion(core)
    assert all(s.num_output_tokens == 0 for s in seqs)
    assert_idle(core)


def test_fork_and_copy_on_write_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent, child = make_seq(list(range(6))), make_seq(list(range(6)), request_id="child")
    bm.allocate(parent)
    bm.append_slots(parent, 6)
    parent.num_computed_tokens = 6
    bm.fork(parent, child)
    assert child.block_table == parent.block_table and child.num_computed_tokens == 6
    assert bm.num_used_blocks == 2
    # the child's next token lands in the shared partial block: a copy of it first
    assert bm.blocks_needed(child, 1) == 1 and bm.blocks_needed(child, 3) == 2
    assert bm.num_fitting_tokens(child, 100) == 6 * 4 - 2  # 6 free + its full block, less 6
    bm.append_slots(child, 1)
    shared = parent.block_table[1]
    assert bm.take_copies() == [(shared, child.block_table[1])] and bm.take_copies() == []
    assert bm.blocks[shared].ref_count == 1
    assert bm.blocks_needed(parent, 1) == 0  # it holds the block alone now: no copy
    bm.free(child)
    bm.free(parent)
    assert bm.num_used_blocks == 0 and all(b.ref_count == 0 for b in bm.blocks)


def test_choices_fork_in_a_step_that_verifies_proposals(tiny_llama):
    """n choices whose prompt completes while other sequences verify proposed tokens
    (--speculate): each fork samples from its parent's row, whatever rows the proposals
    take before it, and every output is what it is alone without speculation."""
    from textgen.service.engine.speculation import SpeculationSettings

    g = torch.Generator().manual_seed(9)
    copying = make_seq(random_prompt(9, VOCAB_SIZE, g) * 3, request_id="copy", max_new_tokens=30)
    core = make_core(tiny_llama, speculation=SpeculationSettings(3, 64, adaptive=False))
    core.add(copying)
    while copying.num_output_tokens < 2:  # decoding: proposals from the next step on
        core.step()
    seqs = choices(random_prompt(37, VOCAB_SIZE, g), 3)
    core.add(seqs[0])
    run_to_completion(core)
    assert core.stats().spec_proposed_tokens > 0
    assert [s.output_ids for s in seqs] == [alone(tiny_llama, s) for s in seqs]
    assert_matches_generate(tiny_llama, [copying])
    assert_idle(core)
