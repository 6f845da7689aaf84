"""Speculative decoding in the paged core (engine/speculation.py): whatever is proposed, the
output is the target model's own, token for token for greedy and seeded requests, through
prefill chunks, prefix hits, preemption, aborts and every stopping rule; rejected proposals
leave no KV slot taken and nothing in the prefix cache."""

from __future__ import annotations

import pytest
import torch
from textgen.service.engine.attention import cpu_decode
from textgen.service.engine.config import EngineConfig
from textgen.service.engine.paged_core import PagedCore
from textgen.service.engine.speculation import NgramProposer, SpeculationSettings
from textgen.service.engine.types import FinishReason, SamplingParams

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

SPECULATE = 3


class ScriptedProposer:
    """Proposes each sequence's known continuation (`expected[request_id]`, its output from a
    run without speculation), with every `wrong_every`-th proposal replaced by another token:
    runs kept whole, in part and not at all. Stands in for a proposer that is sometimes right
    (the n-gram one rarely is on random models)."""

    def __init__(self, expected: dict[str, list[int]], wrong_every: int = 4) -> None:
        self.expected = expected
        self.wrong_every = wrong_every
        self.count = 0
        self.proposed: list[tuple[str, int]] = []  # (request id, length) per proposal
        self.forgotten: set[str] = set()

    def propose(self, seqs, limits):
        proposals = []
        for seq, limit in zip(seqs, limits):
            done = seq.num_output_tokens
            drafts = list(self.expected.get(seq.request_id, [])[done : done + limit])
            for i in range(len(drafts)):
                self.count += 1
                if self.count % self.wrong_every == 0:
                    drafts[i] = (drafts[i] + 1) % VOCAB_SIZE
            proposals.append(drafts)
            self.proposed.append((seq.request_id, len(drafts)))
        return proposals

    def forget(self, seq) -> None:
        self.forgotten.add(seq.request_id)

    def warmup(self) -> None:
        pass


def spec_core(model, proposer=None, *, total_tokens=8192, prefill_tokens=256, block_size=16,
              max_batch=64, grammars=None, num_tokens=SPECULATE,
              adaptive=False) -> PagedCore:  # fmt: skip
    return PagedCore(
        engine_copy(model),
        EngineConfig(
            max_batch_total_tokens=total_tokens,
            max_batch_prefill_tokens=prefill_tokens,
            max_batch_size=32,
            block_size=block_size,
            # adaptive: which steps verify depends on their timing (test_speculation_gate.py)
            speculation=SpeculationSettings(num_tokens, max_batch, adaptive=adaptive),
        ),
        grammars=grammars,
        proposer=proposer,
    )


def requests(count: int, seed: int, max_len: int = 120, max_new: int = 24):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (count,), generator=g).tolist()
    return [
        make_seq(
            random_prompt(n, VOCAB_SIZE, g),
            request_id=f"r{i}",
            max_new_tokens=6 + (5 * i) % max_new,
        )
        for i, n in enumerate(lengths)
    ]


def expected_outputs(model, seqs) -> dict[str, list[int]]:
    return {
        s.request_id: reference_greedy(
            model, list(s.request.prompt_ids), s.request.stopping.max_new_tokens
        )
        for s in seqs
    }


# the n-gram proposer -----------------------------------------------------------------


def ngram(tokens: list[int], limit: int = 3, min_n: int = 1, max_n: int = 3) -> list[int]:
    seq = make_seq(tokens)
    return NgramProposer(min_n, max_n).propose([seq], [limit])[0]


def test_ngram_proposes_what_followed_the_longest_suffix_match():
    # "7 8 9" ends the sequence and occurred once: 1 2 follow it there. The shorter "8 9"
    # also occurs later (after 5), but the longest match wins
    assert ngram([7, 8, 9, 1, 2, 3, 5, 8, 9, 4, 6, 7, 8, 9]) == [1, 2, 3]


def test_ngram_takes_the_most_recent_occurrence_and_respects_min_n():
    assert ngram([5, 1, 2, 5, 3, 4, 5], limit=2) == [3, 4]
    assert ngram([5, 1, 2, 5, 3, 4, 5], limit=2, min_n=2) == []  # only a 1-gram matches
    assert ngram([1, 2, 3, 4], limit=2) == []


def test_ngram_reads_a_repeating_run_on_into_its_own_proposal():
    # the latest "1 2" ends two tokens back: its continuation runs into the proposal itself
    assert ngram([9, 1, 2, 1, 2], limit=5) == [1, 2, 1, 2, 1]


def test_ngram_index_follows_appended_tokens():
    seq = make_seq([4, 5, 6, 7])
    proposer = NgramProposer(1, 3)
    assert proposer.propose([seq], [3]) == [[]]
    seq.token_ids += [1, 4, 5]
    assert proposer.propose([seq], [3]) == [[6, 7, 1]]
    seq.token_ids += [6, 9]  # "6 9" is new; "9" too
    assert proposer.propose([seq], [3]) == [[]]


# greedy equality --------------------------------------------------------------------


def test_mixed_batch_with_prefill_chunks_verifies_and_equals_generate(tiny_llama):
    seqs = requests(12, seed=1)
    proposer = ScriptedProposer(expected_outputs(tiny_llama, seqs))
    core = spec_core(tiny_llama, proposer, prefill_tokens=64)  # long prompts take chunks
    early, late = seqs[:8], seqs[8:]
    for seq in early:
        core.add(seq)
    outputs, runs = [], []  # runs: the most tokens a sequence gained in each step
    for step in range(200):
        if step == 6:  # verification chunks ride with late arrivals' prefill chunks
            for seq in late:
                core.add(seq)
        if not core.has_work():
            break
        stepped = core.step()
        outputs.extend(stepped)
        runs.append(max((sum(o.seq is s for o in stepped) for s in seqs), default=0))
    assert_matches_generate(tiny_llama, seqs)
    stats = core.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens
    assert max(runs) == 1 + SPECULATE  # some verification kept all its proposals
    # every output in order, each once
    assert len(outputs) == sum(s.num_output_tokens for s in seqs)
    for seq in seqs:
        mine = [o for o in outputs if o.seq is seq]
        assert [o.token_id for o in mine] == seq.output_ids
        assert [o.num_tokens for o in mine] == list(
            range(seq.num_prompt_tokens + 1, seq.num_tokens + 1)
        )
    assert {s.request_id for s in seqs} <= proposer.forgotten
    assert_idle(core)


def test_ngram_speculation_equals_generate(tiny_llama):
    # prompts that repeat a phrase: the n-gram proposer finds matches from the first decode
    g = torch.Generator().manual_seed(5)
    seqs = [
        make_seq(random_prompt(7 + i, VOCAB_SIZE, g) * 3, request_id=f"n{i}", max_new_tokens=40)
        for i in range(6)
    ]
    core = spec_core(tiny_llama, adaptive=True)  # timed on the real clock: any proposals
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    assert_matches_generate(tiny_llama, seqs)
    assert core.stats().spec_proposed_tokens > 0
    assert_idle(core)


def test_rejected_slots_are_released_and_only_kept_tokens_are_cached(tiny_llama):
    """A proposer that is always wrong: every verification reserves 1 + N slots and keeps one
    token. The blocks held never exceed what the kept tokens fill, and a follower whose prompt
    is the first request's whole text reuses its cached blocks and still equals generate."""
    g = torch.Generator().manual_seed(3)
    first = make_seq(random_prompt(40, VOCAB_SIZE, g), request_id="first", max_new_tokens=50)
    proposer = ScriptedProposer(expected_outputs(tiny_llama, [first]), wrong_every=1)
    core = spec_core(tiny_llama, proposer, block_size=4)
    core.add(first)
    while core.has_work():
        core.step()
        if not first.is_finished:
            blocks = -(-first.num_computed_tokens // 4)
            assert len(first.block_table) == blocks
            assert core.block_manager.num_used_blocks == blocks
    assert core.stats().spec_accepted_tokens == 0 < core.stats().spec_proposed_tokens
    assert_matches_generate(tiny_llama, [first])
    follower = make_seq(first.token_ids[:-1], request_id="follower", max_new_tokens=8)
    core.add(follower)
    run_to_completion(core)
    assert follower.num_cached_prompt_tokens >= 80
    assert_matches_generate(tiny_llama, [follower])
    assert_idle(core)


def test_prefix_hits_with_speculation_equal_generate(tiny_llama):
    g = torch.Generator().manual_seed(4)
    system = random_prompt(64, VOCAB_SIZE, g)
    seqs = [
        make_seq(
            system + random_prompt(3 + i, VOCAB_SIZE, g), request_id=f"p{i}", max_new_tokens=20
        )
        for i in range(4)
    ]
    proposer = ScriptedProposer(expected_outputs(tiny_llama, seqs))
    core = spec_core(tiny_llama, proposer)
    core.add(seqs[0])
    run_to_completion(core)
    for seq in seqs[1:]:
        core.add(seq)
    run_to_completion(core)
    assert all(s.num_cached_prompt_tokens >= 48 for s in seqs[1:])
    assert_matches_generate(tiny_llama, seqs)
    assert_idle(core)


def test_preemption_with_speculation_equals_generate(tiny_llama):
    # 12 blocks of 8 tokens: each request fits alone, eight together do not
    g = torch.Generator().manual_seed(2)
    seqs = [
        make_seq(
            random_prompt(10 + 3 * i, VOCAB_SIZE, g), request_id=f"q{i}", max_new_tokens=20 + i
        )
        for i in range(8)
    ]
    proposer = ScriptedProposer(expected_outputs(tiny_llama, seqs))
    core = spec_core(tiny_llama, proposer, total_tokens=96, prefill_tokens=64, block_size=8)
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    assert core.stats().preemptions > 0
    assert core.stats().spec_accepted_tokens > 0
    assert_matches_generate(tiny_llama, seqs)
    assert_idle(core)


def test_abort_mid_speculation_frees_everything(tiny_llama):
    seqs = requests(4, seed=6)
    proposer = ScriptedProposer(expected_outputs(tiny_llama, seqs))
    core = spec_core(tiny_llama, proposer)
    for seq in seqs:
        core.add(seq)
    for _ in range(4):
        core.step()
    core.abort(seqs[1])
    run_to_completion(core)
    assert seqs[1].is_finished and "r1" in proposer.forgotten
    assert_matches_generate(tiny_llama, [seqs[0], *seqs[2:]])
    assert_idle(core)


def test_eos_and_max_new_tokens_inside_an_accepted_run_end_it_there(tiny_llama):
    g = torch.Generator().manual_seed(8)
    prompt = random_prompt(20, VOCAB_SIZE, g)
    free_run = reference_greedy(tiny_llama, prompt, 30)
    eos = free_run[7]  # the first occurrence of this token ends the reference
    stop_at = free_run.index(eos)
    expected = reference_greedy(tiny_llama, prompt, 30, eos_token_id=eos)
    assert expected == free_run[: stop_at + 1]
    # the proposer knows the whole free run, EOS and what follows it
    proposer = ScriptedProposer({"eos": free_run, "len": free_run}, wrong_every=1000)
    core = spec_core(tiny_llama, proposer, num_tokens=6)
    with_eos = make_seq(prompt, request_id="eos", max_new_tokens=30, eos_token_ids=frozenset({eos}))
    length = make_seq(prompt, request_id="len", max_new_tokens=stop_at + 3)
    core.add(with_eos)
    core.add(length)
    outputs = run_to_completion(core)
    assert with_eos.output_ids == expected
    assert with_eos.finish_reason is FinishReason.EOS_TOKEN
    assert length.output_ids == free_run[: stop_at + 3]
    assert length.finish_reason is FinishReason.LENGTH
    assert sum(1 for o in outputs if o.seq is with_eos) == len(expected)
    assert core.stats().spec_accepted_tokens >= stop_at - 1  # the run went through
    assert_idle(core)


def test_speculation_switches_off_above_its_batch_size(tiny_llama):
    seqs = requests(6, seed=9)
    proposer = ScriptedProposer(expected_outputs(tiny_llama, seqs))
    core = spec_core(tiny_llama, proposer, max_batch=3)
    for seq in seqs:
        core.add(seq)
    counts = []
    while core.has_work():
        running = len(core.scheduler.running)
        before = len(proposer.proposed)
        core.step()
        counts.append((running, len(proposer.proposed) - before))
    assert all(n == 0 for running, n in counts if running > 3)
    assert any(n > 0 for running, n in counts if 0 < running <= 3)
    assert_matches_generate(tiny_llama, seqs)


# sampled requests -------------------------------------------------------------------


SAMPLINGS = [
    SamplingParams(do_sample=True, temperature=1.5, seed=11),
    SamplingParams(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=12),
    SamplingParams(do_sample=True, temperature=1.2, typical_p=0.9, seed=13),
    SamplingParams(do_sample=True, repetition_penalty=1.3, frequency_penalty=0.5, seed=14,
                   top_n_tokens=3),
    SamplingParams(repetition_penalty=1.5, presence_penalty=0.7, logit_bias=((5, 2.0),)),
]  # fmt: skip


def sampled_seqs(prompts):
    return [
        make_seq(p, request_id=f"s{i}", max_new_tokens=24, sampling=SAMPLINGS[i % len(SAMPLINGS)])
        for i, p in enumerate(prompts)
    ]


def test_seeded_and_penalized_requests_give_the_same_tokens_as_without_speculation(tiny_llama):
    g = torch.Generator().manual_seed(10)
    prompts = [random_prompt(15 + 4 * i, VOCAB_SIZE, g) for i in range(len(SAMPLINGS))]
    plain = sampled_seqs(prompts)
    core = spec_core(tiny_llama)
    core.speculation = None  # the same core, without speculation
    for seq in plain:
        core.add(seq)
    plain_outputs = run_to_completion(core)
    spec = sampled_seqs(prompts)
    proposer = ScriptedProposer({s.request_id: s.output_ids for s in plain}, wrong_every=3)
    core = spec_core(tiny_llama, proposer)
    for seq in spec:
        core.add(seq)
    spec_outputs = run_to_completion(core)
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    assert core.stats().spec_accepted_tokens > 0

    def logprobs(outputs):
        return {(o.seq.request_id, o.num_tokens): (o.logprob, o.top_tokens) for o in outputs}

    mine, theirs = logprobs(spec_outputs), logprobs(plain_outputs)
    assert mine.keys() == theirs.keys()
    for key, (logprob, top) in mine.items():
        assert logprob == pytest.approx(theirs[key][0], abs=1e-4)
        assert [t for t, _ in top] == [t for t, _ in theirs[key][1]]


def test_rejection_sampling_draws_from_the_target_distribution():
    """Many seeded requests on an 8-token vocabulary, each proposing the same two tokens after
    its first: the distribution of the (2nd, 3rd) generated tokens, from kept proposals and
    from draws at rejected positions, matches the model's own joint distribution
    p(t2 | t1) p(t3 | t1, t2), computed exactly, within a chi-square bound of df + 5 sqrt(2 df)
    (about 4.5 sigma). The same bound on the same requests without speculation checks the
    check."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = 8
    torch.manual_seed(21)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        initializer_range=0.08,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    prompt = [1, 2, 3]

    def next_probs(context: list[int]) -> torch.Tensor:
        return torch.softmax(model(torch.tensor([context])).logits[0, -1].double(), -1)

    with torch.inference_mode():
        first = int(next_probs(prompt).argmax())  # the likeliest t1: we condition on it
        p2 = next_probs(prompt + [first])
        joint = torch.stack([p2[t2] * next_probs(prompt + [first, t2]) for t2 in range(vocab)])
    # after t1, every sequence proposes 5 then 6 (the 4th token's draw is not looked at)
    proposer = _FixedProposer([5, 6])

    def pair_counts(speculation: SpeculationSettings | None) -> tuple[torch.Tensor, PagedCore]:
        core = PagedCore(
            model,
            EngineConfig(
                max_batch_total_tokens=1 << 16,
                max_batch_prefill_tokens=4096,
                max_batch_size=1024,
                block_size=4,
                speculation=speculation,
            ),
            proposer=proposer,
        )
        seqs = []
        for i in range(8000):
            sampling = SamplingParams(do_sample=True, seed=1000 + i)
            seqs.append(make_seq(prompt, request_id=f"d{i}", max_new_tokens=4, sampling=sampling))
            core.add(seqs[-1])
        run_to_completion(core)
        counts = torch.zeros(vocab, vocab, dtype=torch.float64)
        for seq in seqs:
            t1, t2, t3, _ = seq.output_ids
            if t1 == first:
                counts[t2, t3] += 1
        return counts, core

    plain, _ = pair_counts(None)
    spec, core = pair_counts(SpeculationSettings(2, 1024, adaptive=False))
    stats = core.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens
    for observed in (plain, spec):
        n = observed.sum()
        assert n > 1000
        expected = joint * n
        cells = expected > 5  # the chi-square approximation needs populated cells
        rest_obs, rest_exp = observed[~cells].sum(), expected[~cells].sum()
        chi2 = (((observed[cells] - expected[cells]) ** 2) / expected[cells]).sum()
        if rest_exp > 0:
            chi2 += (rest_obs - rest_exp) ** 2 / rest_exp
        df = int(cells.sum()) + (1 if rest_exp > 0 else 0) - 1
        assert chi2 < df + 5 * (2 * df) ** 0.5, (float(chi2), df)


class _FixedProposer:
    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts

    def propose(self, seqs, limits):
        return [self.drafts[:limit] for limit in limits]

    def forget(self, seq) -> None:
        pass

    def warmup(self) -> None:
        pass


# runner strategies ------------------------------------------------------------------


def strategy_core(model, proposer, strategy: str, batch_size: int = 4) -> PagedCore:
    from textgen.service.engine.runners.compiled import CompileSettings
    from textgen.service.engine.runners.cuda_graphs import GraphSettings

    options = {
        "graphs": {"cuda_graphs": GraphSettings((1, 2, 4), 32, capture=False)},
        # bucket 4: one sequence verifying SPECULATE proposals
        "compiled": {"compile": CompileSettings((1, 2, 4))},
        "invariant": {"batch_invariant": True},
    }[strategy]
    core = PagedCore(
        engine_copy(model),
        EngineConfig(
            max_batch_total_tokens=4096,
            max_batch_prefill_tokens=128,
            max_batch_size=batch_size,
            speculation=SpeculationSettings(SPECULATE, 4, adaptive=False),
            **options,
        ),
        proposer=proposer,
    )
    core.warm_up()
    return core


@pytest.mark.parametrize("strategy", ["graphs", "compiled", "invariant"])
def test_runner_strategies_take_their_steps_and_the_output_is_generates(tiny_llama, strategy):
    """CUDA-graph buckets (their static buffers, on CPU): verifying steps run eagerly beside
    the graphs' decode steps. Compiled buckets: verifying steps that fit a bucket run
    through its graph too (a graph of T tokens is one whatever the query lengths). Batch-
    invariant layouts. Each way the output is generate's."""
    seqs = requests(4, seed=13)
    proposer = ScriptedProposer(expected_outputs(tiny_llama, seqs), wrong_every=2)
    core = strategy_core(tiny_llama, proposer, strategy)
    for seq in seqs:
        core.add(seq)
    op_calls = cpu_decode.kernel_calls() - cpu_decode.Stats.calls  # the op's C++ kernel's
    run_to_completion(core)
    assert_matches_generate(tiny_llama, seqs)
    assert core.stats().spec_accepted_tokens > 0
    if strategy != "invariant":  # some plain decode steps went through the strategy
        stats = core.runner.stats
        fast = stats.graph_steps if strategy == "graphs" else stats.compiled_steps
        assert fast > 0 and stats.eager_steps > 0
    if strategy == "compiled":
        stats = core.runner.stats
        assert stats.compiled_verifications > 0
        # verifying steps of one group reach the kernel through the op's C++ kernel too:
        # more calls there than the plain decode steps' layers
        op_calls = cpu_decode.kernel_calls() - cpu_decode.Stats.calls - op_calls
        layers = tiny_llama.config.num_hidden_layers
        assert op_calls > layers * (stats.compiled_steps - stats.compiled_verifications)
    assert_idle(core)


def test_batch_invariant_tokens_and_logprobs_do_not_depend_on_speculation(tiny_llama):
    """With --deterministic, a verification row is computed as the decode row it replaces:
    a request alone (speculating) and in a batch above the speculation limit (not) gives the
    same tokens and bitwise the same logprobs."""
    g = torch.Generator().manual_seed(14)
    prompt = random_prompt(30, VOCAB_SIZE, g)
    solo = make_seq(prompt, request_id="solo", max_new_tokens=20)
    expected = expected_outputs(tiny_llama, [solo])
    core = strategy_core(tiny_llama, ScriptedProposer(expected, wrong_every=3), "invariant")
    core.add(solo)
    solo_outputs = run_to_completion(core)
    assert core.stats().spec_accepted_tokens > 0
    crowd = [make_seq(prompt, request_id="solo", max_new_tokens=20)] + [
        make_seq(random_prompt(9 + i, VOCAB_SIZE, g), request_id=f"c{i}", max_new_tokens=20)
        for i in range(4)
    ]  # five running: above the speculation limit of 4
    core = strategy_core(tiny_llama, ScriptedProposer(expected, wrong_every=3), "invariant", 8)
    for seq in crowd:
        core.add(seq)
    crowd_outputs = run_to_completion(core)
    assert core.stats().spec_proposed_tokens == 0
    mine = [(o.token_id, o.logprob) for o in solo_outputs]
    assert mine == [(o.token_id, o.logprob) for o in crowd_outputs if o.seq is crowd[0]]
