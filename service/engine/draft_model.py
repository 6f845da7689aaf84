"""A draft model that proposes the tokens speculative decoding verifies (`--speculate-model`).

A small model sharing the target's tokenizer, with a paged KV cache and a runner of its own
(kv_pool.py, runners/model_runner.py's ModelRunner, block_manager.py without prefix
caching): the target's scheduler and pool never see it. Each target sequence it proposes
for has a shadow Sequence here, whose tokens are the target's plus the proposals it fed
itself. A call:
1. syncs each shadow with its sequence: the K/V it computed stay valid up to the first token
   where the shadow and the sequence differ (a rejected proposal), the rest is trimmed;
2. one forward computes each shadow's missing tokens (the tokens the target accepted since,
   or a new sequence's whole prompt, within `catch_up_tokens` a call) and proposes the first
   token from its last row;
3. then one decode forward per further token, for the shadows that want more.
Proposals are greedy (the argmax), so speculation.py's verification sees a point-mass
proposal and keeps the target's distribution exactly.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from ..models.tokenizer_files import vocab_mismatch
from .block_manager import BlockManager
from .kv_pool import KVCachePool
from .runners.model_runner import ModelRunner
from .scheduler import SchedulerOutput
from .sequence import Sequence


class TokenizerMismatch(ValueError):
    """The draft model's tokenizer is not the target's: its token ids mean other text."""


def check_same_tokenizer(target, draft) -> None:
    """Raise TokenizerMismatch unless both tokenizers map the same strings to the same ids
    (special tokens included) and agree on EOS."""
    if mismatch := vocab_mismatch(target.get_vocab(), draft.get_vocab()):
        raise TokenizerMismatch(mismatch)
    if target.eos_token_id != draft.eos_token_id:
        raise TokenizerMismatch(
            f"its EOS token ({draft.eos_token_id}) is not the model's ({target.eos_token_id})"
        )


class DraftModelProposer:
    free = False  # each proposal costs draft forwards: asked only for the tokens verified

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_blocks: int,
        block_size: int,
        vocab_size: int,
        catch_up_tokens: int = 2048,
    ) -> None:
        """
        Args:
            model: the draft (a transformers causal LM); its attention becomes the paged one.
            num_blocks: its KV pool's blocks (block_size tokens each). A sequence that finds
                no room gets no proposal.
            vocab_size: the target's logits width: proposals stay below it.
            catch_up_tokens: tokens the draft computes per call in its first forward, when
                shadows catch up with their sequences (a long new prompt takes several calls).
        """
        self.runner = ModelRunner(model, KVCachePool(num_blocks, block_size, scratch_blocks=1))
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.vocab_size = vocab_size
        self.catch_up_tokens = catch_up_tokens
        self._shadows: weakref.WeakKeyDictionary[Sequence, _Shadow] = weakref.WeakKeyDictionary()

    def warmup(self) -> None:
        self.runner.warmup()

    def forget(self, seq: Sequence) -> None:
        shadow = self._shadows.pop(seq, None)
        if shadow is not None:
            self.block_manager.free(shadow.seq)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        proposals: dict[Sequence, list[int]] = {seq: [] for seq in seqs}
        wanted = dict(zip(seqs, limits))
        owner: dict[int, Sequence] = {}  # id(shadow) -> its sequence
        # the first forward: catch up, then each shadow's last row proposes a token
        batch, budget = SchedulerOutput(), self.catch_up_tokens
        for seq in seqs:
            shadow = self._sync(seq)
            missing = shadow.seq.num_tokens - shadow.seq.num_computed_tokens
            if missing > budget or not self._reserve(shadow, missing + wanted[seq] - 1, seqs):
                continue  # it catches up in a later call (or finds room then)
            budget -= missing
            batch.scheduled.append((shadow.seq, missing))
            owner[id(shadow.seq)] = seq
        while batch.scheduled:
            for shadow_seq, token in zip(*self._forward(batch)):
                seq = owner[id(shadow_seq)]
                proposals[seq].append(token)
                shadow_seq.token_ids.append(token)  # fed by the next forward, if any
            batch = SchedulerOutput(
                scheduled=[
                    (self._shadows[seq].seq, 1)
                    for seq in seqs
                    if proposals[seq] and len(proposals[seq]) < wanted[seq]
                ]
            )
        for seq, drafts in proposals.items():  # the last proposal was never fed
            if drafts:
                self._shadows[seq].seq.token_ids.pop()
        return [proposals[seq] for seq in seqs]

    def _forward(self, batch: SchedulerOutput) -> tuple[list[Sequence], list[int]]:
        """One draft forward; -> the shadows and the argmax of their last rows."""
        result = self.runner.execute(batch)
        for shadow_seq, num_new in batch.scheduled:
            shadow_seq.num_computed_tokens += num_new
        tokens = result.sample_logits[:, : self.vocab_size].argmax(-1).tolist()
        return result.sample_seqs, tokens

    def _sync(self, seq: Sequence) -> _Shadow:
        """The shadow of `seq`, its valid K/V kept: those of the tokens it shares with seq."""
        shadow = self._shadows.get(seq)
        if shadow is None:
            request = dataclasses.replace(seq.request, decoder_input_details=False)
            shadow_seq = Sequence(request, frozenset(), token_ids=list(seq.token_ids))
            shadow_seq.num_prompt_tokens = seq.num_prompt_tokens
            shadow = self._shadows[seq] = _Shadow(shadow_seq, len(seq.token_ids))
            return shadow
        mine, theirs = shadow.seq.token_ids, seq.token_ids
        valid = shadow.synced
        limit = min(shadow.seq.num_computed_tokens, len(theirs))
        while valid < limit and mine[valid] == theirs[valid]:
            valid += 1
        # the last token is always computed again: its logits propose the next one
        computed = shadow.seq.num_computed_tokens
        shadow.seq.num_computed_tokens = min(computed, valid, len(theirs) - 1)
        shadow.seq.token_ids = list(theirs)
        shadow.synced = len(theirs)
        self.block_manager.trim(shadow.seq)
        return shadow

    def _reserve(self, shadow: _Shadow, num_tokens: int, keep: list[Sequence]) -> bool:
        """Blocks for `num_tokens` more tokens of the shadow; when the pool is short, the
        shadows of sequences not proposed for now (preempted, or past the batch size) give
        theirs back first."""
        bm = self.block_manager
        if not bm.can_append(shadow.seq, num_tokens):
            keeping = {id(s) for s in keep}
            for seq in [s for s in self._shadows if id(s) not in keeping]:
                self.forget(seq)
                if bm.can_append(shadow.seq, num_tokens):
                    break
        if not bm.can_append(shadow.seq, num_tokens):
            return False
        bm.append_slots(shadow.seq, num_tokens)
        return True


@dataclasses.dataclass(slots=True)
class _Shadow:
    seq: Sequence  # the draft's view: the target's tokens, then the proposals it fed
    synced: int  # the shadow's first `synced` tokens are the target's (checked)
