"""Logits -> next tokens for a whole batch, on the logits' device.

Per-request parameters are applied as batched tensor ops over the rows that use
them; greedy rows take an argmax. Sampled rows draw together, with no per-row launch:
each row's draw is one uniform number, a counter-based hash (splitmix64) of its seed
and the position it samples, looked up in the row's cumulative distribution. A seed
therefore gives the same text whatever else shares the batch, and a step recomputed
after a preemption the same draw.

Host <-> device traffic of a step: nothing for the parameters of an all-greedy batch,
one small host-to-device copy when some row samples (and one bool read back: whether
every sampled row had a distribution, so the fallback's argmax runs only when one had
not; a few more for top-p and typical-p rows: which rows need a longer sort, and on CPU
the rows' thresholds), and one device-to-host copy of the tokens with their logprobs
(plus one for top_n_tokens when asked).

Logprobs are those of the distribution after penalties, bias, the watermark and
temperature, and before top-k/top-p/typical truncation (what TGI reports).

Rows with `watermark` get the green-list bias of watermark.py after the penalties and the
logit bias, before temperature (a bias on the logits, as transformers' processor is).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from .sequence import Sequence
from .types import SamplingParams
from .watermark import Watermark


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]
    top_tokens: list[list[tuple[int, float]]]  # per row, top_n (id, logprob); [] when not asked


class Sampler:
    def __init__(self, watermark: Watermark | None = None) -> None:
        """`watermark`: the green lists of requests with `watermark` (default: TGI's gamma
        and delta)."""
        self.watermark = watermark or Watermark()

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """logits: [len(seqs), vocab], the last position of each sequence. A row may also
        be a speculation.DraftRow: a sequence with some proposed tokens appended, which reads
        the same (request, token_ids, output_ids, num_tokens)."""
        params = [s.request.sampling for s in seqs]
        logits = logits.float()
        logits = self._apply_penalties(logits, seqs, params)
        logits = _apply_logit_bias(logits, params)
        self._apply_watermark(logits, seqs, params)
        rows = _SampledRows.build(seqs, params, logits.device)
        if rows is not None:
            logits = logits / rows.temperatures.unsqueeze(1)  # 1.0 on greedy rows
        logprobs = torch.log_softmax(logits, dim=-1)

        if rows is None:
            next_ids = _argmax(logprobs)
        elif rows.every_row:  # no greedy row: no argmax
            next_ids = _draw(logprobs, rows)
        else:
            next_ids = _argmax(logprobs)
            next_ids.index_copy_(0, rows.index, _draw(logprobs.index_select(0, rows.index), rows))
        chosen = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
        top = _top_tokens(logprobs, params)
        # the one host read of the step: ids (exact in float64 below 2^53) with logprobs
        ids, chosen_logprobs = torch.stack([next_ids.double(), chosen.double()]).tolist()
        return SampleResult([int(i) for i in ids], chosen_logprobs, top)

    def _apply_watermark(
        self, logits: torch.Tensor, seqs: list[Sequence], params: list[SamplingParams]
    ) -> None:
        rows = [i for i, p in enumerate(params) if p.watermark]
        if rows:
            self.watermark.apply(logits, rows, [seqs[i].token_ids[-1] for i in rows])

    # penalties ---------------------------------------------------------------

    def _apply_penalties(
        self, logits: torch.Tensor, seqs: list[Sequence], params: list[SamplingParams]
    ) -> torch.Tensor:
        """Repetition penalty (HF semantics) on the tokens of the prompt and the output;
        frequency and presence penalties (OpenAI semantics) on the output's. In place, on
        the penalized tokens only (a gather and a scatter of each row's token ids): a few
        hundred of a row's vocabulary, where whole-vocabulary passes cost ~1 ms each for
        32 rows on a slow CPU. A token seen twice is written twice with the same value."""
        device = logits.device
        repeating = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if repeating:
            owner, ids = _token_positions([seqs[i].token_ids for i in repeating], device)
            row = torch.tensor(repeating, device=device)[owner]
            rep = torch.tensor([params[i].repetition_penalty for i in repeating], device=device)
            rep = rep[owner]
            seen = logits[row, ids]
            logits[row, ids] = torch.where(seen > 0, seen / rep, seen * rep)
        counted = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
        if counted:
            owner, ids = _token_positions([seqs[i].output_ids for i in counted], device)
            # each output token's count in its row
            counts = logits.new_zeros(len(counted), logits.shape[1])
            counts.index_put_((owner, ids), torch.ones_like(ids, dtype=counts.dtype), True)
            count = counts[owner, ids]
            freq = torch.tensor([params[i].frequency_penalty for i in counted], device=device)
            pres = torch.tensor([params[i].presence_penalty for i in counted], device=device)
            row = torch.tensor(counted, device=device)[owner]
            values = logits[row, ids] - freq[owner] * count - pres[owner] * (count > 0)
            logits[row, ids] = values
        return logits


# drawing ---------------------------------------------------------------------


@dataclass(slots=True)
class _SampledRows:
    """The sampled rows' parameters on the device, from one host-to-device copy."""

    index: torch.Tensor  # [m] long: the rows that sample
    uniforms: torch.Tensor  # [m] float64 in [0, 1): the row's draw, from (seed, position)
    temperatures: torch.Tensor  # [n] float32, every row (1.0 where greedy)
    top_k: torch.Tensor  # [m] float32, inf where off
    top_p: torch.Tensor  # [m] float32, inf where off
    typical_p: torch.Tensor  # [m] float32
    untruncated: torch.Tensor  # [m] bool: neither top_k nor top_p (every token kept)
    every_row: bool  # no row of the batch is greedy
    ranked: bool  # some row has top_k or top_p on
    typical: bool  # some row has typical_p on
    max_top_k: int | None  # the largest top_k when every row has one

    @classmethod
    def build(
        cls, seqs: list[Sequence], params: list[SamplingParams], device: torch.device
    ) -> _SampledRows | None:
        """None when every row is greedy."""
        index = [i for i, p in enumerate(params) if p.do_sample]
        if not index:
            return None
        n, m = len(params), len(index)
        sub = [params[i] for i in index]
        # keyed by the position sampled: a row's draws differ from step to step, never with
        # the batch around it
        uniforms = [_uniform(p.seed, seqs[i].num_tokens) for i, p in zip(index, sub)]
        # float64 holds the row numbers exactly: everything in one copy
        packed = torch.tensor(
            [p.temperature if p.do_sample else 1.0 for p in params]
            + [float(i) for i in index]
            + uniforms
            + [float(p.top_k) if p.top_k > 0 else math.inf for p in sub]
            + [p.top_p if p.top_p < 1.0 else math.inf for p in sub]  # off: no rounding
            + [p.typical_p for p in sub],
            dtype=torch.float64,
        ).to(device)
        rest = packed[n + 2 * m :].float()
        return cls(
            index=packed[n : n + m].long(),
            uniforms=packed[n + m : n + 2 * m],
            temperatures=packed[:n].float(),
            top_k=rest[:m],
            top_p=rest[m : 2 * m],
            typical_p=rest[2 * m :],
            untruncated=torch.isinf(rest[:m]) & torch.isinf(rest[m : 2 * m]),
            every_row=m == n,
            ranked=any(p.top_k > 0 or p.top_p < 1.0 for p in sub),
            typical=any(p.typical_p < 1.0 for p in sub),
            max_top_k=max(p.top_k for p in sub) if all(p.top_k > 0 for p in sub) else None,
        )


def _draw(logprobs: torch.Tensor, rows: _SampledRows) -> torch.Tensor:
    """One token per row of `logprobs` ([m, vocab], the sampled rows), all rows at once: the
    first token whose cumulative probability exceeds the row's uniform share of the total,
    in vocabulary order."""
    m, vocab = logprobs.shape
    # the probabilities in whole DRAW_BLOCKs (zeros past the vocabulary): exp of log-softmax
    # values (<= 0) needs no max subtracted
    blocks = logprobs.new_empty(m, -(-vocab // DRAW_BLOCK), DRAW_BLOCK)
    blocks.view(m, -1)[:, vocab:] = 0.0
    head = blocks.view(m, -1)[:, :vocab]
    if rows.typical:  # typical sets aren't a logprob threshold: a mask
        probs = _probabilities(logprobs, out=head)
        probs.masked_fill_(_dropped(logprobs, probs, rows), 0.0)
    elif rows.ranked:
        _drop_below(logprobs, _kept_threshold(logprobs, rows), out=head)
        probs = _probabilities(head, out=head)
    else:
        probs = _probabilities(logprobs, out=head)
    picked, total = _inverse_cdf(blocks, rows.uniforms)
    # Validation keeps the parameters finite and sane; should a row still come out as no
    # distribution (NaN logits), it falls back to its most likely token rather than
    # failing the batch.
    has_distribution = total > 0
    if not bool(has_distribution.all()):
        fallback = _argmax(logprobs.nan_to_num(nan=float("-inf")))
        picked = torch.where(has_distribution, picked, fallback)
    return picked


def _probabilities(logprobs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """exp(logprobs) into `out` (which may be `logprobs`), probabilities under LEAST_PROB
    as 0. On CPU, float32 exp takes a slow path where its result is below the least normal
    float (inputs under about -87.3): at temperature 0.1 most of a row's logprobs are, and
    32 rows of a 49k vocabulary took 28 ms against 0.4. Clamped at EXP_FLOOR first, exp
    stays fast; the clamped tokens come out under LEAST_PROB and are zeroed with the rest,
    so a row's probabilities don't depend on which path ran or on the batch."""
    torch.clamp(logprobs, min=EXP_FLOOR, out=out).exp_()
    return torch.threshold(out, LEAST_PROB, 0.0, out=out)


def _drop_below(logprobs: torch.Tensor, threshold: torch.Tensor, out: torch.Tensor) -> None:
    """`out` = `logprobs`, each row's values below its threshold (`[m, 1]`, -inf: none) at
    -inf. On CPU one F.threshold pass a row: a comparison and a masked fill over the batch
    take ~3x longer there (they go through a bool tensor)."""
    if logprobs.device.type != "cpu":
        torch.where(logprobs < threshold, float("-inf"), logprobs, out=out)
        return
    # x > cut keeps exactly x >= threshold
    cuts = torch.nextafter(threshold, threshold.new_tensor(float("-inf"))).view(-1).tolist()
    for row, cut, dest in zip(logprobs, cuts, out):
        torch.threshold(row, cut, float("-inf"), out=dest)


def _inverse_cdf(blocks: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row of `blocks` ([m, num_blocks, DRAW_BLOCK] probabilities, unnormalized):
    the first token whose cumulative probability exceeds `uniforms` ([m] float64) times the
    row's total, and that total. In two levels, each row on its own (so whatever the batch):
    the block the target falls in, from the blocks' masses, then the token inside it."""
    m, _, width = blocks.shape
    block_mass = blocks.sum(-1).double()  # one pass in float32: no float64 copy of the vocabulary
    block_cdf = block_mass.cumsum(-1)
    total = block_cdf[:, -1:]
    target = uniforms.unsqueeze(1) * total
    # rounding can put a target at or past a total: stay on the last nonzero block and token
    block = torch.searchsorted(block_cdf, target, right=True)
    block = torch.minimum(block, _last_nonzero(block_mass))
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    inside = blocks.gather(1, block.unsqueeze(2).expand(m, 1, width)).squeeze(1)
    token = torch.searchsorted(inside.cumsum(-1, dtype=torch.float64), target - before, right=True)
    token = torch.minimum(token, _last_nonzero(inside))
    return (block * width + token).squeeze(1), total.squeeze(1)


def _last_nonzero(values: torch.Tensor) -> torch.Tensor:
    """`[m, 1]`: the index of each row's last value > 0 (0 when none is)."""
    positions = torch.arange(values.shape[1], device=values.device)
    return torch.where(values > 0, positions, 0).amax(-1, keepdim=True)


def _argmax(values: torch.Tensor) -> torch.Tensor:
    """`torch.argmax(values, -1)` of `[m, vocab]` values (the first maximal index; NaN counts
    as maximal), in two levels: the first DRAW_BLOCK-wide block holding the row's maximum,
    from the blocks' `amax`, then the first maximal index inside it. aten's CPU argmax is
    not vectorized: 2.3 ms for 32 x 49k float32 on a 2-core CPU, where amax takes 0.2."""
    m, vocab = values.shape
    width = DRAW_BLOCK
    num_blocks = vocab // width
    if num_blocks < 2:
        return values.argmax(-1)
    head = values[:, : num_blocks * width].unflatten(-1, (num_blocks, width))
    block_max = head.amax(-1)
    block = block_max.argmax(-1, keepdim=True)
    inside = head.gather(1, block.unsqueeze(2).expand(m, 1, width)).squeeze(1)
    picked = block * width + inside.argmax(-1, keepdim=True)
    if num_blocks * width < vocab:  # the last, partial block
        tail_max, tail_at = values[:, num_blocks * width :].max(-1, keepdim=True)
        head_max = block_max.gather(1, block)
        # the head comes first: the tail wins with a greater value, or a NaN the head lacks
        tail_wins = (tail_max > head_max) | (tail_max.isnan() & ~head_max.isnan())
        picked = torch.where(tail_wins, num_blocks * width + tail_at, picked)
    return picked.squeeze(1)


# tokens per block of _inverse_cdf's and _argmax's first level: one cumsum of a whole 49k
# vocabulary in float64 took ~10 ms at 32 rows on a 2-core CPU; block sums and one block's
# cumsum, ~1
DRAW_BLOCK = 1024

# _probabilities: exp's inputs are clamped here (exp: 1.6e-38, a normal float32), and
# probabilities under LEAST_PROB count as 0
EXP_FLOOR = -87.0
LEAST_PROB = 2e-38

# top-p rows sort their most probable tokens in prefixes this long, the next one only for
# the rows whose kept set the last one didn't hold, and the rest of the vocabulary only for
# those the longest doesn't hold (rare: a 0.95 nucleus is a few to a few hundred tokens).
# A full sort of a 49k vocabulary takes ~2.7 ms a row on a slow 2-core CPU, 32 rows 85 ms,
# more than the step; the topk of 32 rows' first 64 tokens ~3.6 ms, of 1024 ~7.5.
TOP_P_PREFIXES = (64, 1024)
# typical-p rows sort this many of their most typical tokens (a 0.95 typical set spans
# tens to a few hundred)
TYPICAL_PREFIX = 1024

# splitmix64 (Steele et al.): a counter-based generator, so a draw needs no state
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def _uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) from a request's seed and the position it samples (53 bits)."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ position) >> 11) * 2.0**-53


def _token_positions(
    token_lists: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(owner, id)` long tensors, one entry per token: the index of its list in
    `token_lists`, and its id. Through numpy: torch.tensor on a Python list of ints costs
    ~0.3 µs an element (24 ms for 32 rows of 2500 tokens), numpy's fromiter a tenth."""
    lengths = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(token_lists))
    ids = np.fromiter(itertools.chain.from_iterable(token_lists), np.int64, int(lengths.sum()))
    owner = np.repeat(np.arange(len(token_lists)), lengths)
    return torch.from_numpy(owner).to(device), torch.from_numpy(ids).to(device)


def _apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    for row, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=logits.device)
            bias = torch.tensor([b for _, b in p.logit_bias], device=logits.device)
            logits[row, ids] += bias
    return logits


def _dropped(logprobs: torch.Tensor, probs: torch.Tensor, rows: _SampledRows) -> torch.Tensor:
    """`[m, vocab]` bool: the tokens top_k and top_p (by rank) or typical_p remove; `probs`
    are the rows' probabilities (`_probabilities(logprobs)`)."""
    if not rows.typical:
        return _dropped_by_rank(logprobs, rows)
    atypical = _atypical(logprobs, probs, rows.typical_p)
    return atypical | _dropped_by_rank(logprobs, rows) if rows.ranked else atypical


def _dropped_by_rank(logprobs: torch.Tensor, rows: _SampledRows) -> torch.Tensor:
    """`[m, vocab]` bool: the tokens top_k and top_p remove."""
    return logprobs < _kept_threshold(logprobs, rows)


def _kept_threshold(logprobs: torch.Tensor, rows: _SampledRows) -> torch.Tensor:
    """`[m, 1]`: the least logprob each row's top_k and top_p keep (-inf: a row without
    either keeps every token). Only each row's most probable tokens are sorted
    (torch.topk): the largest top_k when every row has one (tokens past it are dropped
    whatever the row's top_p), else widening prefixes (_nucleus_threshold). A row's
    threshold is the same value either way, so its kept set does not depend on the batch."""
    if rows.max_top_k is None:
        return _nucleus_threshold(logprobs, rows)
    sorted_lp = torch.topk(logprobs, min(rows.max_top_k, logprobs.shape[1]), dim=-1).values
    return _rank_threshold(sorted_lp, rows.top_k, rows.top_p)


def _nucleus_threshold(logprobs: torch.Tensor, rows: _SampledRows) -> torch.Tensor:
    """`_kept_threshold` of rows that don't all have a top_k: each row is sorted in the
    TOP_P_PREFIXES in turn until one holds its kept set, then wholly."""
    m, vocab = logprobs.shape
    threshold = logprobs.new_full((m, 1), float("-inf"))
    at = None  # the rows still to settle, None: all of them (no copy of the logprobs)
    if bool(rows.untruncated.any()):
        at = (~rows.untruncated).nonzero().squeeze(1)
    for width in (*(w for w in TOP_P_PREFIXES if w < vocab), vocab):
        top_k = rows.top_k if at is None else rows.top_k[at]
        top_p = rows.top_p if at is None else rows.top_p[at]
        pending = logprobs if at is None else logprobs[at]
        if width < vocab:
            sorted_lp = torch.topk(pending, width, dim=-1).values
            # the margin covers float32 rounding between this sum and _rank_threshold's
            held = (top_k <= width) | (sorted_lp.exp().sum(-1) >= top_p + 1e-4)
        else:
            sorted_lp = torch.sort(pending, dim=-1, descending=True).values
            held = torch.ones_like(top_p, dtype=torch.bool)
        found = _rank_threshold(sorted_lp, top_k, top_p)
        rows_held = held.nonzero().squeeze(1) if at is None else at[held]
        threshold[rows_held] = found[held]
        at = (~held).nonzero().squeeze(1) if at is None else at[~held]
        if len(at) == 0:
            break
    return threshold


def _rank_threshold(
    sorted_lp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """`[m, 1]`: the least logprob top_k and top_p keep, from rows sorted (descending) far
    enough. As a threshold, tokens tied with the last one kept stay too (as HF's top-k), so
    the kept set doesn't hang on how a sort ordered ties, which topk and sort do differently
    (a row alone and in a batch may take either)."""
    probs = sorted_lp.exp()
    ranks = torch.arange(sorted_lp.shape[1], device=sorted_lp.device).unsqueeze(0)
    keep = ranks < top_k.unsqueeze(1)
    keep &= probs.cumsum(-1) - probs < top_p.unsqueeze(1)
    keep[:, 0] = True  # the most probable token always survives
    return sorted_lp.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True)


def _atypical(logprobs: torch.Tensor, probs: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    """`[m, vocab]` bool: the tokens outside each row's typical set (Meister et al., as HF's
    TypicalLogitsWarper): the tokens whose surprise (-logprob) is nearest the row's entropy,
    nearest first, until they hold `typical_p` of the mass; tokens as near as the last one
    kept stay too (HF's threshold). The most probable token always stays, so a row's
    top-k/top-p set and its typical set share one. Rows with `typical_p` >= 1 keep all.
    Only the TYPICAL_PREFIX nearest tokens are sorted (a 0.95 typical set spans tens to a few
    hundred tokens at temperature <= 1), and the whole vocabulary of just the rows whose
    set they don't hold; the threshold is the same value either way."""
    entropy = -(probs * logprobs).nansum(-1, keepdim=True)  # 0 * -inf: NaN, left out
    gap = (logprobs + entropy).abs_()  # |surprise - entropy|
    width = min(TYPICAL_PREFIX, gap.shape[1])
    nearest, order = torch.topk(gap, width, dim=-1, largest=False)
    mass = probs.gather(1, order).cumsum(-1)
    threshold = _typical_threshold(nearest, mass, typical_p)
    if width < gap.shape[1]:
        spill = (mass[:, -1] < typical_p + 1e-4) & (typical_p < 1.0)  # margin as for top-p
        if bool(spill.any()):
            at = spill.nonzero().squeeze(1)
            nearest, order = torch.sort(gap[at], dim=-1)
            mass = probs[at].gather(1, order).cumsum(-1)
            threshold[at] = _typical_threshold(nearest, mass, typical_p[at])
    threshold.masked_fill_(typical_p.unsqueeze(1) >= 1.0, float("inf"))
    atypical = gap > threshold
    return atypical.scatter_(1, _argmax(logprobs).unsqueeze(1), False)


def _typical_threshold(
    nearest: torch.Tensor, mass: torch.Tensor, typical_p: torch.Tensor
) -> torch.Tensor:
    """`[m, 1]`: the gap of the first of the sorted tokens at which their cumulative mass
    reaches `typical_p` (the last, when it never does)."""
    last = (mass < typical_p.unsqueeze(1)).sum(-1, keepdim=True)
    return nearest.gather(1, last.clamp(max=nearest.shape[1] - 1))


def _top_tokens(
    logprobs: torch.Tensor, params: list[SamplingParams]
) -> list[list[tuple[int, float]]]:
    n_max = max(p.top_n_tokens for p in params)
    if n_max == 0:
        return [[] for _ in params]
    values, ids = torch.topk(logprobs, n_max, dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [
        list(zip(ids[row][: p.top_n_tokens], values[row][: p.top_n_tokens]))
        for row, p in enumerate(params)
    ]
