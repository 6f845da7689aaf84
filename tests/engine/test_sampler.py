"""The batched sampler: every sampled row drawn at once from a uniform keyed by (seed,
position), top-k/top-p masks over one sort of the most probable tokens, typical-p over one
of the most typical, a fallback for rows with no distribution."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from textgen.service.engine import sampler
from textgen.service.engine.sampler import Sampler
from textgen.service.engine.types import SamplingParams

from .factories import make_seq

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def rows_of(logits: torch.Tensor, **sampling) -> list:
    """One sequence per row, seeds 0..n-1 (so each row draws its own uniform)."""
    return [
        make_seq([1, 2, 3], request_id=f"s{i}", sampling=SamplingParams(seed=i, **sampling))
        for i in range(logits.shape[0])
    ]


def test_draws_follow_the_distribution():
    n = 4000
    logits = PROBS.log().repeat(n, 1)
    result = Sampler().sample(logits, rows_of(logits, do_sample=True))
    counts = torch.bincount(torch.tensor(result.token_ids), minlength=4).float()
    sigma = (n * PROBS * (1 - PROBS)).sqrt()
    assert ((counts - n * PROBS).abs() < 4 * sigma).all(), counts
    # logprobs are of the distribution before truncation, for the token drawn
    assert result.logprobs[0] == pytest.approx(math.log(PROBS[result.token_ids[0]]), abs=1e-6)


def test_truncation_keeps_only_the_allowed_tokens():
    logits = PROBS.log().repeat(400, 1)
    for sampling in ({"top_k": 2}, {"top_p": 0.6}, {"top_k": 3, "top_p": 0.6}):
        ids = Sampler().sample(logits.clone(), rows_of(logits, do_sample=True, **sampling))
        assert set(ids.token_ids) == {0, 1}, sampling


def test_top_k_on_every_row_sorts_only_the_top_and_agrees_with_the_full_sort():
    torch.manual_seed(0)
    logprobs = torch.randn(6, 1000).mul(3).log_softmax(-1)
    seqs = [
        make_seq([1], sampling=SamplingParams(do_sample=True, top_k=k, top_p=p, seed=k))
        for k, p in [(1, 1.0), (5, 0.9), (40, 1.0), (40, 0.5), (200, 0.95), (3, 1.0)]
    ]
    rows = sampler._SampledRows.build(seqs, [s.request.sampling for s in seqs], logprobs.device)
    assert rows.max_top_k == 200
    fast = sampler._dropped_by_rank(logprobs, rows)
    full = sampler._dropped_by_rank(logprobs, dataclasses.replace(rows, max_top_k=None))
    assert torch.equal(fast, full)


def test_top_p_sorts_widening_prefixes_and_agrees_with_the_full_sort(monkeypatch):
    """top-p rows sort only their most probable tokens, in the TOP_P_PREFIXES in turn, a
    row going on to the next only when the last didn't hold its kept set, and to a full
    sort only past the longest. Each row's truncation is the full sort's either way, so it
    doesn't hang on the batch."""
    monkeypatch.setattr(sampler, "TOP_P_PREFIXES", (16, 64))
    torch.manual_seed(0)
    peaked = torch.randn(5, 4000).mul(6).log_softmax(-1)  # a 0.9 nucleus of a few tokens
    flat = torch.randn(1, 4000).mul(0.1).log_softmax(-1)  # a 0.9 nucleus of thousands
    settings = [(0, 0.9), (0, 0.5), (50, 0.95), (0, 1.0), (3000, 0.9)]  # (top_k, top_p)
    peaked_seqs = [
        make_seq([1], sampling=SamplingParams(do_sample=True, top_k=k, top_p=p, seed=i))
        for i, (k, p) in enumerate(settings)
    ]
    flat_seq = make_seq([1], sampling=SamplingParams(do_sample=True, top_p=0.9, seed=9))
    sorts, topks = [], []
    real_sort, real_topk = torch.sort, torch.topk
    monkeypatch.setattr(
        torch, "sort", lambda rows, **k: sorts.append(len(rows)) or real_sort(rows, **k)
    )
    monkeypatch.setattr(
        torch,
        "topk",
        lambda rows, width, **k: topks.append((len(rows), width)) or real_topk(rows, width, **k),
    )

    def dropped(logprobs, seqs):
        rows = sampler._SampledRows.build(seqs, [s.request.sampling for s in seqs], "cpu")
        return sampler._dropped(logprobs, logprobs.exp(), rows)

    prefix = dropped(peaked, peaked_seqs)
    # the untruncated row sorts nothing; the others' nuclei fit in the first prefix
    assert topks == [(4, 16)] and not sorts
    assert not prefix[3].any(), "a row without top-k or top-p keeps every token"
    topks.clear()
    mixed = dropped(torch.cat([peaked, flat]), [*peaked_seqs, flat_seq])
    assert topks == [(5, 16), (1, 64)], "only the flat row goes on to the second prefix"
    assert sorts == [1], "the flat row's nucleus spills past the longest prefix: its full sort"
    assert torch.equal(mixed[:5], prefix)
    both = torch.cat([peaked, flat])
    rows = sampler._SampledRows.build(
        [*peaked_seqs, flat_seq], [s.request.sampling for s in [*peaked_seqs, flat_seq]], "cpu"
    )
    full_sort = real_sort(both, dim=-1, descending=True).values
    reference = both < sampler._rank_threshold(full_sort, rows.top_k, rows.top_p)
    reference[3] = False  # untruncated
    assert torch.equal(mixed, reference)
    whole = sampler._dropped_by_rank(peaked, dataclasses.replace(
        sampler._SampledRows.build(peaked_seqs, [s.request.sampling for s in peaked_seqs], "cpu"),
        top_p=torch.full((5,), 0.9999)))  # fmt: skip
    # a top_p of 0.9999 reaches past the peaked rows' prefixes too, but for the row with
    # top_k 50 and the one without truncation: those three rows sort
    assert sorts == [1, 3] and (~whole[[0, 1, 4]]).sum(-1).min() > 64
    assert (~mixed[5]).sum() > 64


def typical_dropped(logprobs: torch.Tensor, settings: list[dict]) -> torch.Tensor:
    seqs = [
        make_seq([1], sampling=SamplingParams(do_sample=True, seed=i, **kw))
        for i, kw in enumerate(settings)
    ]
    rows = sampler._SampledRows.build(seqs, [s.request.sampling for s in seqs], "cpu")
    return sampler._dropped(logprobs, logprobs.exp(), rows)


@pytest.mark.parametrize("mass", [0.2, 0.6, 0.95])
def test_typical_p_drops_what_transformers_typical_warper_drops(mass):
    """The typical set is HF's TypicalLogitsWarper's (ties with the last token kept stay),
    plus the most probable token, which always stays."""
    from transformers.generation.logits_process import TypicalLogitsWarper

    torch.manual_seed(1)
    logits = torch.randn(8, 3000).mul(torch.linspace(0.5, 6, 8).unsqueeze(1))
    logits[:, 100:110] = logits[:, 100:101]  # ties on the set's edge in some rows
    logprobs = logits.log_softmax(-1)
    ours = typical_dropped(logprobs, [{"typical_p": mass}] * 8)
    theirs = TypicalLogitsWarper(mass)(None, logprobs.clone()).isinf()
    theirs.scatter_(1, logprobs.argmax(-1, keepdim=True), False)
    assert torch.equal(ours, theirs)
    assert (~ours).sum(-1).min() >= 1 and ours.any()


def test_typical_p_sorts_a_prefix_when_it_holds_the_set_and_agrees_with_the_full_sort(
    monkeypatch,
):
    """typical-p rows sort only the TYPICAL_PREFIX most typical tokens when those hold their
    set; a row whose set spills past them, and only that row, takes a full sort. Each
    row's set, and top-k/top-p beside it, is the same either way."""
    monkeypatch.setattr(sampler, "TYPICAL_PREFIX", 64)
    torch.manual_seed(0)
    peaked = torch.randn(4, 4000).mul(6).log_softmax(-1)
    flat = torch.randn(1, 4000).mul(0.1).log_softmax(-1)  # a typical set of thousands
    settings = [{"typical_p": 0.9}, {"typical_p": 0.5, "top_k": 3}, {"top_p": 0.8}, {}]
    sorts = []
    real_sort = torch.sort
    monkeypatch.setattr(
        torch, "sort", lambda rows, **k: sorts.append(len(rows)) or real_sort(rows, **k)
    )
    prefix = typical_dropped(peaked, settings)
    assert not sorts, "the peaked rows' typical sets fit in the prefix: no full sort"
    assert not prefix[3].any(), "a row without truncation keeps every token"
    assert prefix[2].sum() > 0 and (prefix[0] != prefix[2]).any()
    mixed = typical_dropped(torch.cat([peaked, flat]), [*settings, {"typical_p": 0.9}])
    assert sorts == [1], "the flat row's typical set spills past the prefix: its full sort"
    assert torch.equal(mixed[:4], prefix)
    assert (~mixed[4]).sum() > 64


def test_penalties_are_hfs_repetition_and_openais_frequency_and_presence():
    """Repetition penalty as transformers' RepetitionPenaltyLogitsProcessor over prompt and
    output; frequency and presence penalties as OpenAI documents them, over the output:
    logit - count * frequency - (count > 0) * presence. Rows without penalties, and tokens
    never seen, keep their logits bit for bit."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    vocab = 300
    g = torch.Generator().manual_seed(5)
    settings = [
        {"repetition_penalty": 1.3},
        {"frequency_penalty": 0.5, "presence_penalty": 0.7},
        {"repetition_penalty": 0.8, "frequency_penalty": -0.4},
        {},
        {"presence_penalty": 1.5},  # no output yet: nothing to penalize
        {"repetition_penalty": 1.2, "frequency_penalty": 1.0, "presence_penalty": -0.5},
    ]
    seqs = []
    for i, kw in enumerate(settings):
        prompt = torch.randint(0, 40, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g)
        seq = make_seq(prompt.tolist(), request_id=f"p{i}", sampling=SamplingParams(**kw))
        outputs = 0 if i == 4 else int(torch.randint(1, 60, (1,), generator=g))
        for token in torch.randint(20, 80, (outputs,), generator=g).tolist():  # repeats
            seq.append_token(token)
        seqs.append(seq)
    logits = torch.randn(len(seqs), vocab, generator=g) * 4
    ours = Sampler()._apply_penalties(logits.clone(), seqs, [s.request.sampling for s in seqs])

    for row, (seq, kw) in enumerate(zip(seqs, settings)):
        expected = logits[row : row + 1].clone()
        if "repetition_penalty" in kw:
            seen = torch.tensor([seq.token_ids])
            expected = RepetitionPenaltyLogitsProcessor(kw["repetition_penalty"])(seen, expected)
        counts = torch.bincount(torch.tensor(seq.output_ids, dtype=torch.long), minlength=vocab)
        expected -= kw.get("frequency_penalty", 0.0) * counts.float()
        expected -= kw.get("presence_penalty", 0.0) * (counts > 0).float()
        assert torch.equal(ours[row], expected[0]), (row, kw)
    assert torch.equal(ours[[3, 4]], logits[[3, 4]])
    assert not torch.equal(ours[[0, 1, 2, 5]], logits[[0, 1, 2, 5]])


def test_probabilities_are_exp_but_zero_where_they_underflow():
    """exp's inputs are clamped so that it stays on its fast path (low temperatures put
    most logprobs under -87): what comes out matches exp wherever exp is at least
    LEAST_PROB, and is 0 elsewhere."""
    logprobs = torch.tensor([[0.0, -1.0, -50.0, -86.0, -87.0, -90.0, -1000.0, float("-inf")]])
    probs = sampler._probabilities(logprobs, out=torch.empty_like(logprobs))
    expected = logprobs.exp().masked_fill(logprobs.exp() < sampler.LEAST_PROB, 0.0)
    assert torch.equal(probs, expected)
    assert probs[0, 3] > 0 and not probs[0, 4:].any()
    # temperature 0.05 on a real spread of logits: the draw stays on the top tokens
    logits = torch.randn(4, 5000).mul(8)
    seqs = rows_of(logits, do_sample=True, temperature=0.05)
    picked = Sampler().sample(logits, seqs).token_ids
    assert picked == logits.argmax(-1).tolist()


def test_dropping_below_a_threshold_keeps_the_ties():
    """_drop_below's pass a row (CPU) drops what `logprobs < threshold` drops: tokens equal
    to a row's threshold stay, and a threshold of -inf drops nothing."""
    torch.manual_seed(3)
    logprobs = torch.randn(5, 300).log_softmax(-1)
    logprobs[:, 7] = float("-inf")
    threshold = logprobs.topk(20, dim=-1).values[:, -1:].clone()
    threshold[2] = float("-inf")
    logprobs[1, :4] = threshold[1]  # ties with the threshold
    out = torch.empty_like(logprobs)
    sampler._drop_below(logprobs, threshold, out=out)
    assert torch.equal(out, logprobs.masked_fill(logprobs < threshold, float("-inf")))
    assert (out[1] > float("-inf")).sum() == 24 and torch.equal(out[2], logprobs[2])


def test_a_seed_and_position_give_the_same_draw_in_any_batch():
    logits = PROBS.log().repeat(8, 1)
    alone = Sampler().sample(logits[:1].clone(), rows_of(logits[:1], do_sample=True))
    seqs = rows_of(logits, do_sample=True)
    seqs[0] = make_seq([1, 2, 3], request_id="s0", sampling=SamplingParams(do_sample=True, seed=0))
    busy = Sampler().sample(logits.clone(), seqs)
    assert busy.token_ids[0] == alone.token_ids[0]
    assert sampler._uniform(7, 10) != sampler._uniform(7, 11) != sampler._uniform(8, 10)
    assert 0.0 <= sampler._uniform(2**64 - 1, 0) < 1.0


def test_greedy_rows_beside_sampled_ones_take_the_argmax():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 1.0, 9.0]])
    seqs = [
        make_seq([1], request_id="g0"),
        make_seq([1], request_id="s", sampling=SamplingParams(do_sample=True, temperature=0.5)),
        make_seq([1], request_id="g2"),
    ]
    result = Sampler().sample(logits, seqs)
    assert result.token_ids[0] == 1 and result.token_ids[2] == 2
    # the greedy rows' logprobs are at temperature 1
    assert result.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[1].item())


def test_a_row_without_a_distribution_falls_back_to_its_argmax():
    logits = torch.tensor([[float("nan")] * 4, [0.0, 0.0, 7.0, 0.0]])
    seqs = rows_of(logits, do_sample=True, top_p=0.5)
    result = Sampler().sample(logits, seqs)
    assert result.token_ids[1] == 2
    assert 0 <= result.token_ids[0] < 4


@pytest.mark.parametrize("vocab", [4, 1000, 2048, 32000, 49152])
def test_the_two_level_argmax_is_torchs(vocab):
    """_argmax gives torch.argmax's index, the first maximal one, in rows with ties (bf16
    values tie a lot), NaNs (counted as maximal), all -inf, and a maximum in the vocabulary's
    partial last block or tied between a whole block and it."""
    g = torch.Generator().manual_seed(vocab)
    rows = (torch.randn(12, vocab, generator=g) * 3).to(torch.bfloat16).float()
    rows[0] = float("-inf")
    rows[1, vocab // 2] = float("nan")
    rows[2, [vocab // 3, vocab - 1]] = float("nan")
    rows[3, vocab - 1] = 100.0  # in the partial last block, where there is one
    rows[4, [1, vocab - 1]] = 100.0  # a tie between the first block and the last
    rows[5] = 1.0  # all tied: index 0
    rows[6, [vocab - 2, vocab - 1]] = 100.0
    rows[8, vocab - 1] = float("nan")  # a NaN in the last block only
    assert torch.equal(sampler._argmax(rows), torch.argmax(rows, dim=-1))
    assert torch.equal(sampler._argmax(rows[7:8]), torch.argmax(rows[7:8], dim=-1))
