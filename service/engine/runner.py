"""The model runner: turns a SchedulerOutput into one forward of the transformers model over a
flattened ragged batch and hands back the logits the step needs.

The model's own code runs unchanged; only its attention is swapped for our paged function
(attention.py) through `AttentionInterface`. The runner never touches queues; the scheduler
never touches tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface

from .attention import ATTENTION_NAME, METADATA_KWARG, BatchMetadata, paged_attention_forward
from .kv_pool import KVCachePool
from .scheduler import SchedulerOutput
from .sequence import Sequence

# Layer kinds the flattened batch handles; anything else (conv, mamba, linear attention)
# keeps per-sequence state the paged cache doesn't have.
SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
PROMPT_LOGPROB_ROWS = 256  # rows per float32 log_softmax when scoring prompt tokens


@dataclass(slots=True)
class PromptLogprobs:
    """Logprobs of prompt tokens token_ids[first_index : first_index + len(logprobs)]."""

    seq: Sequence
    first_index: int  # >= 1: the first prompt token has no logprob
    logprobs: list[float]


@dataclass(slots=True)
class RunnerOutput:
    # sequences whose step reached their last token (they get a new token), row order of
    # sample_logits
    sample_seqs: list[Sequence]
    sample_logits: torch.Tensor  # [len(sample_seqs), vocab], the model's dtype, on its device
    # prompt-token logprobs of chunks computed for decoder_input_details requests
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pool: KVCachePool) -> None:
        check_model_supported(model)
        AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
        model.set_attn_implementation(ATTENTION_NAME)
        self.model = model.eval()
        self.pool = pool
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def warmup(self) -> None:
        """One 1-token forward into block 0, so every layer's pool is allocated at start-up
        (out-of-memory shows at once) and lazy init runs before the first request. Block 0
        is free: whatever lands there is overwritten before anything reads it."""
        meta = BatchMetadata.build(self.pool, [1], [1], [[0]], self.device)
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self._forward(ids, ids, meta, torch.zeros(1, dtype=torch.long, device=self.device))

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        layout = _lay_out(batch)
        meta = BatchMetadata.build(
            self.pool,
            [n for _, n in layout.entries],
            [s.num_computed_tokens + n for s, n in layout.entries],
            [s.block_table for s, _ in layout.entries],
            self.device,
        )
        logits = self._forward(
            self._tensor([layout.token_ids]),
            self._tensor([layout.positions]),
            meta,
            self._tensor(layout.keep),
        )
        if len(layout.sample_rows) == logits.shape[0]:
            sample_logits = logits
        else:
            sample_logits = logits[self._tensor(layout.sample_rows)]
        prompt_logprobs = _prompt_logprobs(logits, layout.prompt_spans)
        return RunnerOutput(layout.sample_seqs, sample_logits, prompt_logprobs)

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: BatchMetadata, keep: torch.Tensor
    ) -> torch.Tensor:
        """-> logits `[len(keep), vocab]`."""
        if keep.numel() == 0:  # a step of prefill chunks only: nothing to project
            keep = keep.new_zeros(1)
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            use_cache=False,
            logits_to_keep=keep,
            **{METADATA_KWARG: meta},
        )
        return out.logits[0]


@dataclass(slots=True)
class _Layout:
    """Where each sequence's tokens sit in the flattened batch (host-side lists)."""

    entries: list[tuple[Sequence, int]]  # (seq, new tokens), in batch order
    token_ids: list[int] = field(default_factory=list)  # [T]
    positions: list[int] = field(default_factory=list)  # [T]
    keep: list[int] = field(default_factory=list)  # batch positions whose logits we project
    sample_seqs: list[Sequence] = field(default_factory=list)  # reached their last token
    sample_rows: list[int] = field(default_factory=list)  # row in `keep` of each of those
    # (seq, first row in `keep`, first position, chunk length) for prompt logprobs
    prompt_spans: list[tuple[Sequence, int, int, int]] = field(default_factory=list)


def _lay_out(batch: SchedulerOutput) -> _Layout:
    # Single-token queries first: they form the cheap decode group of the attention.
    decodes = [e for e in batch.scheduled if e[1] == 1]
    layout = _Layout(entries=decodes + [e for e in batch.scheduled if e[1] > 1])
    for seq, num_new in layout.entries:
        start = seq.num_computed_tokens
        offset = len(layout.token_ids)
        reaches_end = start + num_new == seq.num_tokens
        layout.token_ids.extend(seq.token_ids[start : start + num_new])
        layout.positions.extend(range(start, start + num_new))
        if _wants_prompt_logprobs(seq):
            layout.prompt_spans.append((seq, len(layout.keep), start, num_new))
            layout.keep.extend(range(offset, offset + num_new))
        elif reaches_end:
            layout.keep.append(offset + num_new - 1)
        if reaches_end:
            layout.sample_seqs.append(seq)
            layout.sample_rows.append(len(layout.keep) - 1)
    return layout


def check_model_supported(model: torch.nn.Module) -> None:
    """Refuse models the paged path would serve wrong text for (engine-facts)."""
    name = type(model).__name__
    if not model._can_set_attn_implementation():
        raise ValueError(
            f"{name} does not route attention through transformers' AttentionInterface "
            "(e.g. Falcon, Bloom): the paged engine can't serve it"
        )
    for module_name, module in model.named_modules():
        if getattr(module, "sinks", None) is not None:
            raise ValueError(
                f"{name} has attention sinks ({module_name}.sinks), "
                "which paged attention doesn't implement"
            )
    layer_types = getattr(model.config.get_text_config(), "layer_types", None) or []
    unsupported = sorted(set(layer_types) - SUPPORTED_LAYER_TYPES)
    if unsupported:
        raise ValueError(
            f"{name} has layers of type {unsupported}, which keep state the paged cache can't hold"
        )


def _wants_prompt_logprobs(seq: Sequence) -> bool:
    # Only before the first generated token: a recompute after preemption already reported them.
    return seq.request.decoder_input_details and seq.num_output_tokens == 0


def _prompt_logprobs(
    logits: torch.Tensor, spans: list[tuple[Sequence, int, int, int]]
) -> list[PromptLogprobs]:
    """Logits at position p score prompt token p + 1; the rare decoder_input_details path."""
    results = []
    for seq, first_row, first_pos, num_new in spans:
        # the chunk's last row scores the first generated token, not a prompt token
        num_rows = min(first_pos + num_new, seq.num_prompt_tokens - 1) - first_pos
        if num_rows <= 0:
            results.append(PromptLogprobs(seq, first_pos + 1, []))
            continue
        targets = torch.tensor(
            seq.token_ids[first_pos + 1 : first_pos + 1 + num_rows], device=logits.device
        )
        picked = []
        # float32 log_softmax a slice at a time: a whole long chunk at once would need
        # rows x vocab x 4 bytes on top of the logits (800 MB for 4096 rows of a 49k vocab)
        for lo in range(0, num_rows, PROMPT_LOGPROB_ROWS):
            hi = min(lo + PROMPT_LOGPROB_ROWS, num_rows)
            rows = torch.log_softmax(logits[first_row + lo : first_row + hi].float(), dim=-1)
            picked.extend(rows.gather(1, targets[lo:hi].unsqueeze(1)).squeeze(1).tolist())
        results.append(PromptLogprobs(seq, first_pos + 1, picked))
    return results
