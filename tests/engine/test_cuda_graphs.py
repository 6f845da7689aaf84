"""GraphedRunner (cuda_graphs.py): decode steps from static buffers per batch bucket, all other
steps eager. On CPU the static buffers run without a graph (capture=False): the same inputs,
padding rows, metadata and bucket choice a CUDA graph replays; the capture itself is tested
on a CUDA device only."""

from __future__ import annotations

import pytest
import torch
from textgen.service.engine.attention import paged as attention
from textgen.service.engine.config import EngineConfig
from textgen.service.engine.paged_core import PagedCore
from textgen.service.engine.runners.cuda_graphs import (
    GraphedRunner,
    GraphSettings,
    default_buckets,
    unavailable_reason,
)
from textgen.service.engine.runners.model_runner import StepInputs, lay_out
from textgen.service.engine.scheduler import SchedulerOutput

from .factories import (
    VOCAB_SIZE,
    assert_idle,
    assert_matches_generate,
    engine_copy,
    make_seq,
    random_prompt,
    run_to_completion,
)

CPU = torch.device("cpu")


def graphed_core(
    model,
    *,
    buckets=(1, 2, 4, 8),
    max_blocks=16,
    total_tokens=4096,
    prefill_tokens=64,
    batch_size=16,
    block_size=16,
    capture=False,
) -> PagedCore:
    core = PagedCore(
        engine_copy(model),
        EngineConfig(
            max_batch_total_tokens=total_tokens,
            max_batch_prefill_tokens=prefill_tokens,
            max_batch_size=batch_size,
            block_size=block_size,
            cuda_graphs=GraphSettings(tuple(buckets), max_blocks, capture=capture),
        ),
    )
    core.warm_up()
    return core


def prompts(lengths, seed, max_new_tokens=10):
    g = torch.Generator().manual_seed(seed)
    return [
        make_seq(random_prompt(n, VOCAB_SIZE, g), request_id=f"g{i}", max_new_tokens=max_new_tokens)
        for i, n in enumerate(lengths)
    ]


def test_decode_from_static_buffers_matches_generate_beside_eager_prefill(tiny_llama):
    """Late arrivals make steps that mix a prefill chunk with decodes (eager); the decode-only
    steps run 5, then 6 sequences in the 8 bucket (padding rows), then fewer as they finish."""
    core = graphed_core(tiny_llama)
    seqs = prompts([1, 5, 17, 40, 70, 33], seed=1)
    for seq in seqs[:5]:
        core.add(seq)
    for _ in range(6):
        core.step()
    core.add(seqs[5])
    run_to_completion(core)
    stats = core.runner.stats
    assert stats.graph_steps > 0 and stats.eager_steps > 0 and stats.padded_rows > 0
    assert_matches_generate(tiny_llama, seqs)
    assert_idle(core)


def test_preemption_and_abort_between_graph_steps(tiny_llama):
    """A pool too small for all of them preempts (recompute goes eager, decodes resume from
    the buffers); a sequence aborted mid-run leaves its bucket to padding rows."""
    core = graphed_core(tiny_llama, total_tokens=96, prefill_tokens=64, block_size=8, max_blocks=6)
    seqs = prompts([10 + 3 * i for i in range(6)], seed=2, max_new_tokens=16)
    for seq in seqs:
        core.add(seq)
    for _ in range(8):
        core.step()
    core.abort(seqs[1])
    run_to_completion(core)
    assert core.stats().preemptions > 0
    assert core.runner.stats.graph_steps > 0
    assert_matches_generate(tiny_llama, [s for s in seqs if s is not seqs[1]])
    assert seqs[1].is_finished
    assert_idle(core)


def _step_of(entries) -> StepInputs:
    return lay_out(SchedulerOutput(scheduled=entries)).inputs


def test_only_pure_decodes_that_fit_a_bucket_take_a_graph(tiny_llama):
    core = graphed_core(tiny_llama, buckets=(1, 2), max_blocks=2)
    runner = core.runner
    decode, other = prompts([20, 20], seed=3)
    for seq in (decode, other):
        seq.block_table = [0, 1]
    decode.num_computed_tokens = other.num_computed_tokens = 19  # one token left each
    assert runner.graph_for(_step_of([(decode, 1)])).batch == 1
    assert runner.graph_for(_step_of([(decode, 1), (other, 1)])).batch == 2
    third = prompts([20], seed=4)[0]
    third.block_table, third.num_computed_tokens = [0, 1], 19
    assert runner.graph_for(_step_of([(decode, 1), (other, 1), (third, 1)])) is None  # > bucket
    other.num_computed_tokens = 18  # a 1-token chunk that doesn't reach the prompt's end
    assert runner.graph_for(_step_of([(decode, 1), (other, 1)])) is None
    assert runner.graph_for(_step_of([(other, 2)])) is None  # a prefill chunk
    decode.block_table = [0, 1, 2]  # longer than max_blocks
    assert runner.graph_for(_step_of([(decode, 1)])) is None
    # a request for prompt logprobs decodes from a graph too: its last prompt token's row
    # scores no prompt token, and the host side reads the logits rows as it does eagerly
    logprobs = make_seq([5] * 20, request_id="details", decoder_input_details=True)
    logprobs.block_table, logprobs.num_computed_tokens = [0, 1], 19
    assert runner.graph_for(_step_of([(logprobs, 1)])).batch == 1


def test_static_path_on_the_triton_kernel_matches_generate(tiny_llama, monkeypatch):
    """What a CUDA graph replays on a GPU: the Triton kernel (here in Triton's interpreter)
    over the static int32 tables, padding rows included."""
    monkeypatch.setattr(attention, "triton_available", lambda device: True)

    def sdpa(*args):
        raise AssertionError("a layer took the SDPA path")

    monkeypatch.setattr(attention, "_sdpa_attention", sdpa)
    core = graphed_core(tiny_llama, buckets=(4,), max_blocks=4)
    seqs = prompts([3, 20, 9], seed=5, max_new_tokens=4)
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    assert core.runner.stats.graph_steps > 0 and core.runner.stats.padded_rows > 0
    assert_matches_generate(tiny_llama, seqs)


def test_default_buckets():
    assert default_buckets(1) == (1,)
    assert default_buckets(6) == (1, 2, 4, 6)
    assert default_buckets(40) == (1, 2, 4, 8, 16, 32, 40)
    assert default_buckets(256)[-3:] == (224, 240, 256)
    settings = GraphSettings.for_engine(32, 1000, 16)
    assert settings.buckets == (1, 2, 4, 8, 16, 32) and settings.max_blocks == 63


def test_graphs_are_refused_where_they_cannot_run(tiny_llama):
    assert "CUDA device" in unavailable_reason(CPU)
    assert unavailable_reason(CPU, capture=False) is None
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        graphed_core(tiny_llama, capture=True)
    with pytest.raises(ValueError, match="don't combine"):
        PagedCore(
            engine_copy(tiny_llama),
            EngineConfig(
                max_batch_total_tokens=512,
                max_batch_prefill_tokens=64,
                max_batch_size=4,
                batch_invariant=True,
                cuda_graphs=GraphSettings((1,), 4, capture=False),
            ),
        )
    with pytest.raises(ValueError, match="buckets"):
        GraphSettings((), 4)


def test_a_runner_built_without_warm_up_runs_everything_eagerly(tiny_llama):
    core = PagedCore(
        engine_copy(tiny_llama),
        EngineConfig(
            max_batch_total_tokens=512,
            max_batch_prefill_tokens=64,
            max_batch_size=4,
            cuda_graphs=GraphSettings((1, 2), 4, capture=False),
        ),
    )
    assert isinstance(core.runner, GraphedRunner)
    seqs = prompts([7], seed=6, max_new_tokens=3)
    core.add(seqs[0])
    run_to_completion(core)
    assert core.runner.stats.graph_steps == 0 and core.runner.stats.eager_steps == 3
    assert_matches_generate(tiny_llama, seqs)


@pytest.mark.gpu
def test_captured_graphs_match_generate_on_cuda(tiny_llama):
    # on a CUDA device a missing triton is a defect of the install, not a reason to skip
    assert unavailable_reason(torch.device("cuda")) is None, unavailable_reason(
        torch.device("cuda")
    )
    model = engine_copy(tiny_llama).cuda()
    core = PagedCore(
        model,
        EngineConfig(
            max_batch_total_tokens=4096,
            max_batch_prefill_tokens=64,
            max_batch_size=8,
            cuda_graphs=GraphSettings((1, 2, 4, 8), 16),
        ),
    )
    core.warm_up()
    seqs = prompts([1, 5, 17, 40, 70], seed=7)
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    assert core.runner.stats.graph_steps > 0
    assert_matches_generate(tiny_llama, seqs)  # float32, sharp logits: equal on the GPU too
    assert_idle(core)
