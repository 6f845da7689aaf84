"""CompiledRunner (compiled_decode.py): float32 greedy tokens equal generate's through
padding, preemption and aborts, and steady state never recompiles."""

from __future__ import annotations

import copy

import pytest
import torch
from textgen.service.engine.config import EngineConfig
from textgen.service.engine.kv_pool import KVCachePool
from textgen.service.engine.paged_core import PagedCore
from textgen.service.engine.runners.compiled import (
    CompiledRunner,
    CompileSettings,
    decode_buckets,
)
from textgen.service.engine.runners.cuda_graphs import GraphSettings
from textgen.service.engine.runners.model_runner import ModelRunner, lay_out
from textgen.service.engine.scheduler import SchedulerOutput
from textgen.service.models.small_steps import add_small_step_weights

from .factories import (
    VOCAB_SIZE,
    assert_idle,
    assert_matches_generate,
    engine_copy,
    make_seq,
    random_prompt,
    reference_greedy,
    run_to_completion,
)


@pytest.fixture(scope="module")
def compiled_core(tiny_llama) -> PagedCore:
    # 12 blocks of 8 tokens: the workload below preempts; buckets 1, 2, 4
    core = PagedCore(
        engine_copy(tiny_llama),
        EngineConfig(
            max_batch_total_tokens=96,
            max_batch_prefill_tokens=64,
            max_batch_size=4,
            block_size=8,
            compile=CompileSettings.for_engine(4),
        ),
    )
    core.warm_up()  # compiles every bucket
    return core


def test_buckets_are_powers_of_two_up_to_the_batch_size():
    assert decode_buckets(256) == (1, 2, 4, 8, 16, 32)
    assert decode_buckets(5) == (1, 2, 4, 5)
    assert decode_buckets(1) == (1,)


def test_with_speculation_the_buckets_reach_every_speculating_step():
    """A verification computes 1 + N tokens per sequence: one stream speculating 3 needs a
    4-token graph, and a batch too large to speculate needs no more than its decodes."""
    from textgen.service.engine.speculation import SpeculationSettings

    assert CompileSettings.for_engine(1).buckets == (1,)
    assert CompileSettings.for_engine(1, SpeculationSettings(3, 8)).buckets == (1, 2, 4)
    assert CompileSettings.for_engine(4, SpeculationSettings(2, 2)).buckets == (1, 2, 4, 6)
    assert CompileSettings.for_engine(256, SpeculationSettings(3, 8)).buckets[-1] == 32


def test_compiled_greedy_equals_generate_through_preemption_without_recompiling(
    compiled_core, tiny_llama
):
    runner = compiled_core.runner
    assert isinstance(runner, CompiledRunner)
    assert sorted(runner.compile_seconds) == runner.buckets == [1, 2, 4]
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
    stats = runner.stats
    assert stats.compiled_steps > 0 and stats.padded_rows > 0 and stats.eager_steps > 0
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
    steps_before = compiled_core.runner.stats.compiled_steps
    for _ in range(6):
        compiled_core.step()
    assert compiled_core.runner.stats.compiled_steps > steps_before
    compiled_core.abort(seqs[1])
    compiled_core.step()  # the others go on, one row fewer
    for seq in seqs:
        compiled_core.abort(seq)
    assert_idle(compiled_core)


def test_needs_a_scratch_block(tiny_llama):
    eager = ModelRunner(engine_copy(tiny_llama), KVCachePool(4, 8))  # no scratch block
    with pytest.raises(ValueError, match="scratch block"):
        CompiledRunner(eager, CompileSettings((1,)))


def test_not_with_batch_invariance_nor_with_cuda_graphs(tiny_llama):
    def core(**options):
        return PagedCore(
            engine_copy(tiny_llama),
            EngineConfig(
                max_batch_total_tokens=96,
                max_batch_prefill_tokens=64,
                max_batch_size=4,
                compile=CompileSettings((1,)),
                **options,
            ),
        )

    with pytest.raises(ValueError, match="--deterministic"):
        core(batch_invariant=True)
    with pytest.raises(ValueError, match="pick one"):
        core(cuda_graphs=GraphSettings((1,), 4, capture=False))
    with pytest.raises(ValueError, match="buckets"):
        CompileSettings(())


def test_a_runner_built_without_warm_up_runs_everything_eagerly(tiny_llama):
    eager = ModelRunner(engine_copy(tiny_llama), KVCachePool(4, 8, scratch_blocks=1))
    runner = CompiledRunner(eager, CompileSettings((1,)))
    seq = make_seq([1, 2, 3], request_id="e", max_new_tokens=2)
    seq.block_table.append(0)
    seq.num_computed_tokens = 2  # its one last prompt token to compute: a pure decode
    batch = SchedulerOutput(scheduled=[(seq, 1)])
    assert (
        runner.bucket_for(lay_out(batch).inputs) is None
    )  # nothing compiled yet: no compile on a request
    out = runner.execute(batch)
    assert out.sample_seqs == [seq] and out.sample_logits.shape == (1, VOCAB_SIZE)
    assert runner.stats.eager_steps == 1 and runner.stats.compiled_steps == 0


def test_compiled_decodes_read_the_small_step_int8_copies(tiny_llama):
    """--compile with --dtype auto on a CPU: the compiled decode graphs read the int8 copies
    (models/small_steps.py), the eager prefills the wide weights. To tell the two apart the
    wide weights are changed after the copies were taken: the tokens must be generate's on
    the same model, not those of the changed weights alone."""
    model, wide_only = engine_copy(tiny_llama), engine_copy(tiny_llama)
    assert add_small_step_weights(model) > 0
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("proj.weight"):
                changed = torch.randn(weight.shape, generator=g) * 0.2
                weight.copy_(changed)
                wide_only.get_parameter(name).copy_(changed)
    reference = copy.deepcopy(model)
    core = PagedCore(
        model,
        EngineConfig(
            max_batch_total_tokens=96,
            max_batch_prefill_tokens=64,
            max_batch_size=2,
            block_size=8,
            compile=CompileSettings.for_engine(2),
        ),
    )
    core.warm_up()
    seqs = [
        make_seq(random_prompt(20 + 3 * i, VOCAB_SIZE, g), request_id=f"s{i}", max_new_tokens=8)
        for i in range(3)
    ]
    for seq in seqs:  # one at a time: prefills of 20+ rows (wide), decodes of 1 (copies)
        core.add(seq)
        run_to_completion(core)
    assert core.runner.stats.compiled_steps > 0
    assert_matches_generate(reference, seqs)
    assert any(
        seq.output_ids != reference_greedy(wide_only, list(seq.request.prompt_ids), 8)
        for seq in seqs
    )
    assert_idle(core)
