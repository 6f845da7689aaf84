"""Batch-invariant mode (PagedCore(batch_invariant=True)): a sequence's logits are bit for bit
the same whatever else the step computes: other sequences, padding, where its prompt was cut
into prefill chunks, a prefix taken from the cache, a preemption and recompute."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from textgen.service.engine.attention import invariant as invariant_attention
from textgen.service.engine.attention.invariant import ChunkedMask, _merge_chunks
from textgen.service.engine.runners import invariant_linear
from textgen.service.engine.runners.invariant_linear import (
    LINEAR_BLOCK_ROWS,
    fixed_rows_linear,
    fixed_rows_linears,
    linear_modules,
    probe_min_rows,
)
from textgen.service.engine.runners.model_runner import lay_out
from textgen.service.engine.sampler import Sampler
from textgen.service.engine.types import SamplingParams

from .factories import (
    VOCAB_SIZE,
    assert_idle,
    assert_matches_generate,
    make_core,
    make_seq,
    random_prompt,
    run_to_completion,
)

MODELS = ["tiny_llama", "tiny_mistral_sliding", "tiny_gemma2"]  # GQA; sliding window; softcap
# 1 token, a block + 1, one key chunk (128) and more, a shared 100-token prefix
PROMPT_LENGTHS = [1, 17, 40, 129, 200, 300, 7, 90, 2, 64]


def _requests(seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [random_prompt(n, VOCAB_SIZE, g) for n in PROMPT_LENGTHS]
    prefix = random_prompt(100, VOCAB_SIZE, g)
    prompts += [prefix + random_prompt(n, VOCAB_SIZE, g) for n in (5, 30)]
    return [
        make_seq(p, request_id=f"r{i}", max_new_tokens=6 + i % 5) for i, p in enumerate(prompts)
    ]


def _record_logits(core) -> dict[str, list[torch.Tensor]]:
    """The logits row each sequence is sampled from, step by step."""
    seen: dict[str, list[torch.Tensor]] = {}
    sample = core.sampler.sample

    def recording(logits, seqs):
        for row, seq in enumerate(seqs):
            seen.setdefault(seq.request_id, []).append(logits[row].clone())
        return sample(logits, seqs)

    core.sampler.sample = recording
    return seen


def _alone(model, seed: int) -> dict[str, list[torch.Tensor]]:
    """Each request alone, one after the other on one core: the later ones with a shared
    prefix start from the cache; prompts are cut into chunks of 64."""
    core = make_core(model, prefill_tokens=64, batch_invariant=True)
    logits = _record_logits(core)
    for seq in _requests(seed):
        core.add(seq)
        run_to_completion(core)
    return logits


def _assert_same_logits(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    differing = [
        rid
        for rid in expected
        if len(got[rid]) != len(expected[rid])
        or not all(torch.equal(a, b) for a, b in zip(got[rid], expected[rid]))
    ]
    assert not differing, f"logits differ for {differing}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("model_name", MODELS)
def test_logits_alone_equal_logits_in_a_busy_batch(model_name, dtype, request):
    model = request.getfixturevalue(model_name).to(dtype)
    try:
        # half arrive first, the rest while they decode; chunks of 50 cut prompts elsewhere
        core = make_core(model, prefill_tokens=50, batch_invariant=True)
        logits = _record_logits(core)
        seqs = _requests(seed=1)
        for seq in seqs[: len(seqs) // 2]:
            core.add(seq)
        for _ in range(3):
            core.step()
        for seq in seqs[len(seqs) // 2 :]:
            core.add(seq)
        run_to_completion(core)
        assert_idle(core)
        _assert_same_logits(logits, _alone(model, seed=1))
    finally:
        model.float()  # the fixture is shared


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_preempted_sequences_keep_their_logits(tiny_llama, dtype):
    model = tiny_llama.to(dtype)
    try:
        # 12 blocks of 8 tokens: each request fits alone, eight together do not
        core = make_core(
            model, total_tokens=96, prefill_tokens=64, block_size=8, batch_invariant=True
        )
        logits = _record_logits(core)
        g = torch.Generator().manual_seed(2)
        prompts = [random_prompt(10 + 3 * i, VOCAB_SIZE, g) for i in range(8)]
        seqs = [
            make_seq(p, request_id=f"p{i}", max_new_tokens=20 + i) for i, p in enumerate(prompts)
        ]
        for seq in seqs:
            core.add(seq)
        run_to_completion(core)
        assert any(seq.num_preemptions for seq in seqs)

        alone = make_core(model, prefill_tokens=64, block_size=8, batch_invariant=True)
        expected = _record_logits(alone)
        for i, prompt in enumerate(prompts):
            alone.add(make_seq(prompt, request_id=f"p{i}", max_new_tokens=20 + i))
            run_to_completion(alone)
        _assert_same_logits(logits, expected)
    finally:
        model.float()


@pytest.mark.parametrize("model_name", MODELS)
def test_greedy_output_still_equals_generate(model_name, request):
    model = request.getfixturevalue(model_name)
    core = make_core(model, prefill_tokens=40, batch_invariant=True)
    seqs = _requests(seed=3)
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    assert_matches_generate(model, seqs)


def test_padding_rounds_the_batch_and_never_reaches_the_sampler(tiny_llama):
    core = make_core(tiny_llama, prefill_tokens=50, batch_invariant=True)
    seqs = _requests(seed=4)[:5]
    for seq in seqs:
        core.add(seq)
    batch = core.scheduler.schedule()
    scratch = core.runner.pool.scratch_block
    layout = lay_out(batch, invariant_attention.ROW_MULTIPLE, scratch)
    num_real = sum(n for _, n in batch.scheduled)
    assert len(layout.token_ids) % 4 == 0 and len(layout.keep) % 4 == 0
    num_padding = len(layout.token_ids) - num_real
    assert num_padding == -num_real % 4
    assert layout.block_tables.count([scratch]) == num_padding
    assert scratch == core.block_manager.num_blocks  # a block the manager never hands out
    reaching_end = [s for s, n in batch.scheduled if s.num_tokens == n]
    assert sorted(map(id, layout.sample_seqs)) == sorted(map(id, reaching_end))


def test_chunks_a_row_cannot_see_leave_the_merge_unchanged():
    """Merging 3 chunks, or the same 3 followed by up to 5 hidden ones (any finite values),
    gives the same bits."""
    g = torch.Generator().manual_seed(5)
    out = torch.randn(3, 2, 4, 8, generator=g).to(torch.bfloat16)  # [nc, KVH, R, Dv]
    lse = torch.randn(3, 2, 4, generator=g) * 5
    visible = torch.ones(1, 3, 1, 4, dtype=torch.bool)
    visible[0, 2, 0, :2] = False  # rows 0 and 1 don't see the last chunk
    expected = _merge_chunks(out, lse, visible, 1, 3)
    for extra in (1, 2, 5):
        hidden_out = torch.randn(extra, 2, 4, 8, generator=g).to(torch.bfloat16)
        hidden_lse = torch.randn(extra, 2, 4, generator=g)
        padded_visible = torch.cat([visible, torch.zeros(1, extra, 1, 4, dtype=torch.bool)], 1)
        got = _merge_chunks(
            torch.cat([out, hidden_out]), torch.cat([lse, hidden_lse]), padded_visible, 1, 3 + extra
        )
        assert torch.equal(got, expected), extra


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_query_row_is_the_same_in_any_call(dtype):
    """The kernel-level property the engine relies on: a row against 50 keys, in a 1-row
    call over 2 key chunks vs as row 5 of 9 in a call of 3 sequences of 3 chunks."""
    g = torch.Generator().manual_seed(6)
    kvh, dim, chunk = 2, 16, 32
    q = torch.randn(kvh, dim, generator=g).to(dtype)
    k = torch.randn(kvh, 2 * chunk, dim, generator=g).to(dtype)  # positions 0..2C-1
    v = torch.randn(kvh, 2 * chunk, dim, generator=g).to(dtype)

    def attend_row(num_seqs, num_rows, num_chunks, row):
        query = torch.randn(num_seqs, kvh, num_rows, dim, generator=g).to(dtype)
        keys = torch.randn(num_seqs * num_chunks, kvh, chunk, dim, generator=g).to(dtype)
        values = torch.randn(keys.shape, generator=g).to(dtype)
        query[0, :, row] = q
        keys[:2] = k.view(kvh, 2, chunk, dim).transpose(0, 1)  # chunk j of sequence 0
        values[:2] = v.view(kvh, 2, chunk, dim).transpose(0, 1)
        allowed = torch.ones(num_seqs, 1, num_rows, num_chunks * chunk, dtype=torch.bool)
        allowed[0, 0, row, 50:] = False  # the row sees keys 0..49
        rows = invariant_attention.padded_rows(num_rows)
        allowed = torch.nn.functional.pad(allowed, (0, 0, 0, rows - num_rows), value=True)
        mask = ChunkedMask.build(allowed, chunk, dtype)
        return invariant_attention.attend(query, keys, values, mask, 0.25, None)[0, :, row]

    assert torch.equal(attend_row(1, 1, 2, 0), attend_row(3, 9, 3, 5))


def test_sampler_rows_are_the_same_alone_and_in_a_batch():
    """Greedy, seeded and truncated rows, penalties, top tokens: one row sampled alone or
    among 16 others gives the same token and the same logprobs, bit for bit."""
    g = torch.Generator().manual_seed(7)
    kinds = [
        SamplingParams(top_n_tokens=3),
        SamplingParams(do_sample=True, seed=1, temperature=0.9, top_p=0.9),
        SamplingParams(do_sample=True, seed=2, temperature=0.9, top_k=40),
        SamplingParams(do_sample=True, seed=3, temperature=0.7, typical_p=0.95),
        SamplingParams(do_sample=True, seed=4, repetition_penalty=1.3, frequency_penalty=0.5),
    ]
    vocab = 4096
    for kind in kinds:  # (the sampler scales its input in place: each call gets a copy)
        row = (torch.randn(vocab, generator=g) * 4).to(torch.bfloat16).float()  # with ties
        alone = Sampler().sample(row[None].clone(), [make_seq([1, 2, 3], sampling=kind)])
        logits = (torch.randn(17, vocab, generator=g) * 4).to(torch.bfloat16).float()
        logits[11] = row
        seqs = [make_seq([1, 2, 3], sampling=kinds[i % len(kinds)]) for i in range(17)]
        seqs[11] = make_seq([1, 2, 3], sampling=kind)
        busy = Sampler().sample(logits, seqs)
        assert (busy.token_ids[11], busy.logprobs[11]) == (alone.token_ids[0], alone.logprobs[0])
        assert busy.top_tokens[11] == alone.top_tokens[0]


def test_truncated_rows_keep_the_same_tokens_whichever_sort_the_batch_takes():
    """A top_k row alone sorts only its top k (torch.topk); beside a top_p row the batch takes
    a full sort, which orders ties otherwise: bf16 logits over a 49k vocabulary tie a lot."""
    g = torch.Generator().manual_seed(8)
    vocab = 49152
    top_k = SamplingParams(do_sample=True, seed=5, temperature=0.9, top_k=40)
    top_p = SamplingParams(do_sample=True, seed=6, temperature=0.9, top_p=0.9)
    for step in range(8):
        row = (torch.randn(vocab, generator=g) * 2).to(torch.bfloat16).float()
        seq = make_seq(list(range(3 + step)), sampling=top_k)
        alone = Sampler().sample(row[None].clone(), [seq])
        other = (torch.randn(vocab, generator=g) * 2).to(torch.bfloat16).float()
        busy = Sampler().sample(torch.stack([other, row]), [make_seq([1], sampling=top_p), seq])
        assert (busy.token_ids[1], busy.logprobs[1]) == (alone.token_ids[0], alone.logprobs[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_rows_linear_gives_a_row_the_same_bits_in_any_batch(dtype):
    """The matmul under batch-invariant mode: a row's product is the same bits with 1 or
    300 rows beside it, at any place among them (oneDNN/MKL pick their blocking by the row
    count on some CPUs, so plain F.linear need not be), and it is F.linear's value."""
    g = torch.Generator().manual_seed(0)
    # the MLP's down projection, outputs of order 1
    weight = (torch.randn(576, 1536, generator=g) / 1536**0.5).to(dtype)
    bias = torch.randn(576, generator=g).to(dtype)
    pool = torch.randn(400, 1536, generator=g).to(dtype)
    probe = fixed_rows_linear(pool[:1], weight, bias)[0]
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2  # summed in another order
    plain = F.linear(pool[:1], weight, bias)[0]
    torch.testing.assert_close(probe, plain, atol=tolerance, rtol=tolerance)
    for num_rows in (2, 3, 8, 31, 33, 64, 65, 128, 300):
        rows = pool[torch.randperm(399, generator=g)[: num_rows - 1] + 1]
        place = int(torch.randint(num_rows, (1,), generator=g))
        batch = torch.cat([rows[:place], pool[:1], rows[place:]]).unsqueeze(0)  # [1, T, D]
        out = fixed_rows_linear(batch, weight, bias)
        assert out.shape == (1, num_rows, 576)
        assert torch.equal(out[0, place], probe), (num_rows, place)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_of_the_probed_fewest_rows_give_a_row_a_full_blocks_bits(dtype):
    """probe_min_rows finds how few rows a product may have on this machine: a row then has
    the same bits padded only that far as in a whole block, wherever it sits among 1 to 70
    rows; and one row fewer than the probe's floor (if any) is where a product differs."""
    g = torch.Generator().manual_seed(1)
    layers = [torch.nn.Linear(576, 1536, bias=False), torch.nn.Linear(1536, 576, bias=False)]
    layers = [layer.to(dtype) for layer in layers]
    min_rows = probe_min_rows(layers)
    assert 1 <= min_rows <= LINEAR_BLOCK_ROWS
    for layer in layers:
        pool = torch.randn(80, layer.in_features, generator=g).to(dtype)
        probe = fixed_rows_linear(pool[:1], layer.weight)[0]  # padded to a whole block
        for num_rows in (1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 32, 33, 36, 48, 70):
            place = int(torch.randint(num_rows, (1,), generator=g))
            rows = pool[torch.randperm(79, generator=g)[: num_rows - 1] + 1]
            batch = torch.cat([rows[:place], pool[:1], rows[place:]])
            out = fixed_rows_linear(batch, layer.weight, min_rows=min_rows)
            assert torch.equal(out[place], probe), (num_rows, place, min_rows)
    # the set's floor is its highest layer's; just below a layer's own floor, a product of
    # that many rows differs from the full block at its start or its end
    floors = [probe_min_rows([layer]) for layer in layers]
    assert min_rows == max(floors)
    for layer, floor in zip(layers, floors):
        if floor > 1:
            x = torch.randn(LINEAR_BLOCK_ROWS, layer.in_features, generator=g).to(dtype)
            full, rows = F.linear(x, layer.weight), floor - 1
            starts = (0, LINEAR_BLOCK_ROWS - rows)
            same = [torch.equal(F.linear(x[s : s + rows], layer.weight), full[s : s + rows])
                    for s in starts]  # fmt: skip
            assert not all(same), (floor, same)


def test_fixed_rows_linears_cover_the_layers_inside_the_block_only(monkeypatch):
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return fixed_rows_linear(*args, **kwargs)

    monkeypatch.setattr(invariant_linear, "fixed_rows_linear", counted)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    x = torch.randn(5, 16)
    with torch.no_grad():
        with fixed_rows_linears(linear_modules(model)):
            inside = model(x)
        assert calls == [(5, 16), (5, 8)]  # both layers went through it
        outside = model(x)  # and after the block, they are plain Linear layers again
    assert calls == [(5, 16), (5, 8)]
    assert "forward" not in vars(model[0])
    torch.testing.assert_close(inside, outside)
