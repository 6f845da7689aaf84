"""Logits -> next tokens for a whole batch, on the logits' device.

Per-request parameters are applied as batched tensor ops over the rows that use
them; greedy rows take an argmax. Sampled rows draw from their own seeded
torch.Generator, one draw per step, so a seed gives the same text whatever else
shares the batch.

Logprobs are those of the distribution after penalties, bias and temperature and
before top-k/top-p/typical truncation (what TGI reports).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sequence import Sequence
from .types import SamplingParams


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]
    top_tokens: list[list[tuple[int, float]]]  # per row, top_n (id, logprob); [] when not asked


class Sampler:
    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """logits: [len(seqs), vocab], the last position of each sequence."""
        params = [s.request.sampling for s in seqs]
        logits = logits.float()
        logits = self._apply_penalties(logits, seqs, params)
        logits = _apply_logit_bias(logits, params)
        sampled_rows = [i for i, p in enumerate(params) if p.do_sample]
        if sampled_rows:
            temps = torch.tensor(
                [params[i].temperature for i in sampled_rows], device=logits.device
            )
            logits[sampled_rows] = logits[sampled_rows] / temps.unsqueeze(1)
        logprobs = torch.log_softmax(logits, dim=-1)

        next_ids = torch.argmax(logprobs, dim=-1)
        if sampled_rows:
            next_ids[sampled_rows] = self._draw(logprobs[sampled_rows], seqs, params, sampled_rows)
        chosen = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
        top = _top_tokens(logprobs, params)
        # the one host sync of the step
        return SampleResult(next_ids.tolist(), chosen.tolist(), top)

    # penalties ---------------------------------------------------------------

    def _apply_penalties(
        self, logits: torch.Tensor, seqs: list[Sequence], params: list[SamplingParams]
    ) -> torch.Tensor:
        rows = [
            i
            for i, p in enumerate(params)
            if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
        ]
        if not rows:
            return logits
        vocab = logits.shape[1]
        device = logits.device
        # Repetition penalty (HF semantics) looks at prompt and output; frequency and
        # presence penalties (OpenAI semantics) at the output only.
        seen = _counts([seqs[i].token_ids for i in rows], vocab, device) > 0
        out_counts = _counts([seqs[i].output_ids for i in rows], vocab, device)
        rep = torch.tensor([params[i].repetition_penalty for i in rows], device=device)
        freq = torch.tensor([params[i].frequency_penalty for i in rows], device=device)
        pres = torch.tensor([params[i].presence_penalty for i in rows], device=device)
        sub = logits[rows]
        penalized = torch.where(sub > 0, sub / rep.unsqueeze(1), sub * rep.unsqueeze(1))
        sub = torch.where(seen, penalized, sub)
        sub = sub - freq.unsqueeze(1) * out_counts - pres.unsqueeze(1) * (out_counts > 0)
        logits[rows] = sub
        return logits

    # drawing -----------------------------------------------------------------

    def _draw(
        self,
        logprobs: torch.Tensor,
        seqs: list[Sequence],
        params: list[SamplingParams],
        rows: list[int],
    ) -> torch.Tensor:
        sub_params = [params[i] for i in rows]
        logprobs = _truncate(logprobs, sub_params)
        probs = torch.softmax(logprobs, dim=-1)
        # Validation keeps the parameters finite and sane; should a row still come out
        # as no distribution, it falls back to its most likely token rather than failing
        # the whole batch inside multinomial.
        probs = probs.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        broken = probs.sum(-1) <= 0
        if broken.any():
            probs[broken] = torch.nn.functional.one_hot(
                logprobs[broken].nan_to_num(nan=float("-inf")).argmax(-1), probs.shape[-1]
            ).to(probs.dtype)
        draws = [
            torch.multinomial(probs[j], 1, generator=_generator(seqs[i], probs.device))
            for j, i in enumerate(rows)
        ]
        return torch.cat(draws)


def _generator(seq: Sequence, device: torch.device) -> torch.Generator:
    if seq.sampler_state is None:
        gen = torch.Generator(device=device)
        gen.manual_seed(seq.request.sampling.seed % (2**63))
        seq.sampler_state = gen
    return seq.sampler_state  # type: ignore[return-value]


def _counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(t) for t in token_lists))
    ids = torch.full((len(token_lists), width), vocab, dtype=torch.long)
    for row, tokens in enumerate(token_lists):
        if tokens:
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, ids.to(device), torch.ones_like(ids, dtype=counts.dtype, device=device))
    return counts[:, :vocab]  # the extra column swallowed the padding


def _apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    for row, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=logits.device)
            bias = torch.tensor([b for _, b in p.logit_bias], device=logits.device)
            logits[row, ids] += bias
    return logits


def _truncate(logprobs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """top_k, top_p and typical_p as masks over one sort of the rows."""
    if all(p.top_k == 0 and p.top_p >= 1.0 and p.typical_p >= 1.0 for p in params):
        return logprobs
    device = logprobs.device
    vocab = logprobs.shape[1]
    sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True)
    probs = sorted_lp.exp()
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    keep = torch.ones_like(sorted_lp, dtype=torch.bool)

    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    keep &= ranks < top_k.unsqueeze(1)

    top_p = torch.tensor([p.top_p for p in params], device=device)
    mass_before = probs.cumsum(-1) - probs
    keep &= mass_before < top_p.unsqueeze(1)

    typical_p = torch.tensor([p.typical_p for p in params], device=device)
    if (typical_p < 1.0).any():
        keep &= _typical_keep(sorted_lp, probs, typical_p)

    keep[:, 0] = True  # the most probable token always survives
    masked = sorted_lp.masked_fill(~keep, float("-inf"))
    return torch.empty_like(logprobs).scatter_(1, order, masked)


def _typical_keep(sorted_lp: torch.Tensor, probs: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Typical decoding (Meister et al.), as HF's TypicalLogitsWarper, on sorted rows."""
    entropy = -(probs * sorted_lp.nan_to_num(neginf=0.0)).sum(-1, keepdim=True)
    surprise_gap = (-sorted_lp - entropy).abs()
    _, gap_order = torch.sort(surprise_gap, dim=-1)
    cum = probs.gather(1, gap_order).cumsum(-1)
    last = (cum < mass.unsqueeze(1)).sum(-1, keepdim=True)
    keep_in_gap_order = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0) <= last
    keep = torch.zeros_like(keep_in_gap_order)
    keep.scatter_(1, gap_order, keep_in_gap_order)
    keep |= mass.unsqueeze(1) >= 1.0
    return keep


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
