"""The compiled decode step (compiled_decode.py): float32 greedy tokens equal generate's
through padding, preemption and aborts, and steady state never recompiles."""

from __future__ import annotations

import pytest
import torch
from textgen.service.engine.compiled_decode import CompiledDecode, decode_buckets
from textgen.service.engine.paged_core import PagedCore

from .factories import (
    VOCAB_SIZE,
    assert_idle,
    assert_matches_generate,
    engine_copy,
    make_core,
    make_seq,
    random_prompt,
    run_to_completion,
)


@pytest.fixture(scope="module")
def compiled_core(tiny_llama) -> PagedCore:
    # 12 blocks of 8 tokens: the workload below preempts; buckets 1, 2, 4
    core = PagedCore(
        engine_copy(tiny_llama),
        max_batch_total_tokens=96,
        max_batch_prefill_tokens=64,
        max_batch_size=4,
        block_size=8,
        compile_decode=True,
    )
    core.warm_up()  # compiles every bucket
    return core


def test_buckets_are_powers_of_two_up_to_the_batch_size():
    assert decode_buckets(256) == [1, 2, 4, 8, 16, 32]
    assert decode_buckets(5) == [1, 2, 4, 5]
    assert decode_buckets(1) == [1]


def test_compiled_greedy_equals_generate_through_preemption_without_recompiling(
    compiled_core, tiny_llama
):
    decode = compiled_core.runner.decode_step
    assert sorted(decode.compile_seconds) == decode.buckets == [1, 2, 4]
    g = torch.Generator().manual_seed(2)
    seqs = [
        make_seq(random_prompt(10 + 3 * i, VOCAB_SIZE, g), request_id=f"c{i}", max_new_tokens=9 + i)
        for i in range(6)
    ]
    # batches of 1 to 4 sequences (padded to 2 and 4 too), prefill steps eager
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seq in seqs:
            compiled_core.add(seq)
        run_to_completion(compiled_core)
    assert compiled_core.stats().preemptions > 0
    assert decode.steps > 0 and decode.padded_rows > 0
    assert_matches_generate(tiny_llama, seqs)
    assert_idle(compiled_core)


def test_abort_between_compiled_steps_frees_everything(compiled_core):
    g = torch.Generator().manual_seed(3)
    seqs = [
        make_seq(random_prompt(12, VOCAB_SIZE, g), request_id=f"a{i}", max_new_tokens=40)
        for i in range(3)
    ]
    for seq in seqs:
        compiled_core.add(seq)
    steps_before = compiled_core.runner.decode_step.steps
    for _ in range(6):
        compiled_core.step()
    assert compiled_core.runner.decode_step.steps > steps_before
    compiled_core.abort(seqs[1])
    compiled_core.step()  # the others go on, one row fewer
    for seq in seqs:
        compiled_core.abort(seq)
    assert_idle(compiled_core)


def test_needs_a_scratch_block(tiny_llama):
    core = make_core(tiny_llama)  # no compile_decode: its pool has no scratch block
    with pytest.raises(ValueError, match="scratch block"):
        CompiledDecode(core.runner, [1])


def test_not_with_batch_invariance(tiny_llama):
    with pytest.raises(ValueError, match="--deterministic"):
        PagedCore(
            engine_copy(tiny_llama),
            max_batch_total_tokens=96,
            max_batch_prefill_tokens=64,
            max_batch_size=4,
            batch_invariant=True,
            compile_decode=True,
        )
