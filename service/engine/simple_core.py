"""A reference core: one transformers forward per running sequence per step, each
with its own DynamicCache. Correct and simple, not fast; the paged core replaces
it for serving. Kept as the oracle that the paged core is tested against.
"""

from __future__ import annotations

import time
from collections import deque

import torch
from transformers import DynamicCache

from .core import StepOutput
from .sampler import Sampler
from .sequence import Sequence, SequenceStatus
from .types import EngineStats


class SimpleCore:
    def __init__(self, model, max_batch_size: int = 32) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.sampler = Sampler()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._caches: dict[int, DynamicCache] = {}
        self._steps = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self._caches.pop(id(seq), None)
        seq.status = SequenceStatus.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
        if not self.running:
            return []
        self._steps += 1
        batch = list(self.running)
        logits, prefill = [], []
        for seq in batch:
            last, prompt_lp = self._forward(seq)
            logits.append(last)
            prefill.append(prompt_lp)
        result = self.sampler.sample(torch.stack(logits), batch)
        outputs = []
        for i, seq in enumerate(batch):
            seq.num_computed_tokens = seq.num_tokens
            seq.append_token(result.token_ids[i])
            outputs.append(
                StepOutput(seq, result.token_ids[i], result.logprobs[i], result.top_tokens[i], prefill[i])
            )
            if seq.is_finished:
                self.abort(seq)
                seq.status = SequenceStatus.FINISHED
        return outputs

    def _forward(self, seq: Sequence) -> tuple[torch.Tensor, list[float | None] | None]:
        cache = self._caches.setdefault(id(seq), DynamicCache())
        new_ids = seq.token_ids[seq.num_computed_tokens :]
        ids = torch.tensor([new_ids], device=self.device)
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
        prompt_lp = None
        if seq.num_computed_tokens == 0 and seq.request.decoder_input_details:
            lp = torch.log_softmax(out.logits[0, :-1].float(), -1)
            picked = lp.gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1).tolist()
            prompt_lp = [None, *picked]
        return out.logits[0, -1], prompt_lp

    def stats(self) -> EngineStats:
        return EngineStats(waiting=len(self.waiting), running=len(self.running), steps=self._steps)
