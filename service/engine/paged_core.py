"""The fast engine core: continuous batching over a paged KV cache with prefix caching.

One step = `Scheduler.schedule()` (which sequences, how many tokens each) -> one forward of
the model over the flattened ragged batch (`ModelRunner`) -> `Sampler` on the sequences that
reached their last token -> tokens appended, finished sequences' blocks freed at once.
Implements the `EngineCore` protocol (core.py).
"""

from __future__ import annotations

import time

import torch

from ..errors import ErrorType
from .block_manager import BlockManager, num_blocks_for_choices, num_blocks_for_tokens
from .compiled_decode import CompiledRunner, CompileSettings
from .core import StepOutput
from .cuda_graphs import GraphedRunner, GraphSettings
from .grammar import GrammarMasks, PendingMasks
from .kv_pool import KVCachePool
from .runner import ModelRunner, Runner, RunnerOutput
from .sampler import Sampler
from .scheduler import Scheduler
from .sequence import Sequence
from .shards import ShardedRunner, ShardGroup
from .stopping import token_stop_reason
from .types import EngineError, EngineStats
from .watermark import Watermark


class PagedCore:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_batch_total_tokens: int,
        max_batch_prefill_tokens: int,
        max_batch_size: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        grammars: GrammarMasks | None = None,
        batch_invariant: bool = False,
        cuda_graphs: GraphSettings | None = None,
        compile: CompileSettings | None = None,
        shards: ShardGroup | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        watermark: Watermark | None = None,
    ) -> None:
        """
        Args:
            model: a transformers causal LM; its attention implementation is switched to ours.
            max_batch_total_tokens: KV-cache budget in tokens, summed over all sequences; the
                pool gets ceil(max_batch_total_tokens / block_size) blocks per layer.
            max_batch_prefill_tokens: prompt tokens computed per step (chunked prefill).
            max_batch_size: sequences running at once.
            block_size: tokens per KV block.
            grammars: token masks for requests with a grammar; None: such requests are refused.
            batch_invariant: a request's tokens the same whatever runs beside it, for greedy
                and seeded requests (runner.py, invariant_attention.py); CPU only.
            cuda_graphs: decode steps replayed from graphs per batch bucket, captured by
                warm_up() (cuda_graphs.py); None: every step eager.
            compile: decode steps through torch.compile'd graphs per batch bucket, compiled
                by warm_up() (compiled_decode.py; CPU only, so never with cuda_graphs).
            shards: this is rank 0 of a sharded model (`model` is its slice): every step
                runs on all ranks, which follow in engine/shards.py's follow_steps().
            kv_cache_dtype: the KV pool's storage dtype (an 8-bit float, upcast in
                attention); None: the model's K/V dtype.
            watermark: the green lists of requests with `watermark` (watermark.py);
                None: TGI's gamma and delta.
        """
        if max_batch_total_tokens <= 0:
            raise ValueError(
                f"max_batch_total_tokens must be positive, got {max_batch_total_tokens}"
            )
        num_blocks = num_blocks_for_tokens(max_batch_total_tokens, block_size)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_batch_prefill_tokens=max_batch_prefill_tokens,
            max_batch_size=max_batch_size,
        )
        self.runner: Runner = build_runner(
            model, num_blocks, block_size, batch_invariant, cuda_graphs, compile, kv_cache_dtype
        )
        self.shards = shards
        if shards is not None:
            self.runner = ShardedRunner(self.runner, shards)
        self.sampler = Sampler(watermark)
        self.grammars = grammars
        self._steps = 0

    @property
    def max_total_tokens(self) -> int:
        """The longest sequence (prompt + new tokens) the pool can hold."""
        return self.block_manager.num_blocks * self.block_manager.block_size

    # EngineCore --------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        # The engine's own invariants: a request that could never fit would wait forever.
        # Validated requests never fail them (validation bounds max_new_tokens by
        # max_total_tokens, which startup checks against the pool: app.py).
        bm = self.block_manager
        needed = num_blocks_for_choices(
            seq.num_prompt_tokens, seq.request.stopping.max_new_tokens, seq.width, bm.block_size
        )
        if needed > bm.num_blocks:
            raise EngineError(
                f"request needs {needed * bm.block_size} tokens of KV cache for its "
                f"{seq.width} choice(s) but the pool holds {self.max_total_tokens} "
                "(max_batch_total_tokens)",
                ErrorType.VALIDATION,
            )
        if seq.num_prompt_tokens == 0:
            raise EngineError("empty prompt", ErrorType.VALIDATION)
        if seq.request.grammar is not None and self.grammars is None:
            raise EngineError("this engine has no grammar support", ErrorType.VALIDATION)
        self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def warm_up(self) -> None:
        """Allocate every layer's KV pool (out of memory shows at startup) and run the
        lazy initialisations: one 1-token forward, then the graph captures or compiles if
        any, or batch-invariant mode's probe of the matmuls (EngineLoop calls it on its
        thread)."""
        self.runner.warmup()

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        self._steps += 1
        now = time.monotonic()
        for seq, _ in batch.scheduled:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        # grammar masks are computed on a worker thread while the forward runs
        masks = self.start_masks(batch)
        result = self.runner.execute(batch)  # copies forked blocks first (batch.block_copies)
        self.scheduler.commit(batch)
        _store_prompt_logprobs(result)
        if not result.sample_seqs:
            return []
        return self._append_sampled(result, masks)

    def shrink_after_oom(self) -> bool:
        """After an out-of-memory step: halve the batch size and preempt every running
        sequence (recomputed later, nothing lost). False when already at one sequence, or
        sharded (the other ranks are mid-step: the step can't be taken back)."""
        sched = self.scheduler
        if self.shards is not None or (sched.max_batch_size <= 1 and len(sched.running) <= 1):
            return False
        sched.max_batch_size = max(1, min(sched.max_batch_size, max(len(sched.running), 1)) // 2)
        sched.preempt_all()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return True

    def close(self) -> None:
        """Release the other ranks of a sharded model (they exit); a no-op otherwise."""
        if isinstance(self.runner, ShardedRunner):
            self.runner.stop()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            kv_block_size=bm.block_size,
            prefix_cache_hit_tokens=bm.prefix_hit_tokens,
            prefix_cache_queried_tokens=bm.prefix_queried_tokens,
            preemptions=self.scheduler.num_preemptions,
            steps=self._steps,
            prefill_tokens=self.scheduler.num_prefill_tokens,
        )

    # internals ---------------------------------------------------------------

    def start_masks(self, batch) -> PendingMasks | None:
        """Begin the grammar masks of the batch's sampling sequences (None: none has a
        grammar); call before the forward, which they overlap."""
        return self.grammars.start(_constrained_to_sample(batch)) if self.grammars else None

    def _append_sampled(
        self, result: RunnerOutput, masks: PendingMasks | None = None
    ) -> list[StepOutput]:
        logits = result.sample_logits.float()
        if masks is not None:
            self.grammars.apply(logits, result.sample_seqs, masks)
        seqs, logits = self._fork(result.sample_seqs, logits)
        sampled = self.sampler.sample(logits, seqs)
        outputs = []
        now = time.monotonic()
        for row, seq in enumerate(seqs):
            prefill = None
            if seq.request.decoder_input_details and seq.num_output_tokens == 0:
                prefill = [None, *seq.prefill_logprobs]
            token_id = sampled.token_ids[row]
            seq.append_token(token_id, now)
            complete = seq.grammar_state is not None and self.grammars.advance(seq, token_id)
            reason = token_stop_reason(seq, token_id, grammar_complete=complete, now=now)
            if reason is not None:
                seq.finish(reason)
            outputs.append(
                StepOutput(seq, token_id, sampled.logprobs[row], sampled.top_tokens[row], prefill)
            )
            if seq.is_finished:
                self.scheduler.finish(seq)
        return outputs

    def _fork(
        self, seqs: list[Sequence], logits: torch.Tensor
    ) -> tuple[list[Sequence], torch.Tensor]:
        """The sequences that sample this step, with the forks of those whose prompt it
        computed (other choices of their request), and their logits rows: a fork shares
        its parent's blocks and samples its own first token from the parent's row (its
        grammar mask included), so the prompt is computed once for all n choices."""
        if not any(s.forks for s in seqs):
            return seqs, logits
        out, rows = [], []
        for row, seq in enumerate(seqs):
            out.append(seq)
            rows.append(row)
            forks, seq.forks = seq.forks, []
            for child in forks:
                if child.is_finished:  # aborted with its request
                    continue
                self.scheduler.add_fork(seq, child)
                child.prefill_logprobs = list(seq.prefill_logprobs)
                if seq.grammar_state is not None:  # before seq's token moves it on
                    child.grammar_state = seq.grammar_state.deep_copy()
                out.append(child)
                rows.append(row)
        return out, logits[torch.tensor(rows, device=logits.device)]


def build_runner(
    model: torch.nn.Module,
    num_blocks: int,
    block_size: int,
    batch_invariant: bool = False,
    cuda_graphs: GraphSettings | None = None,
    compile: CompileSettings | None = None,
    kv_cache_dtype: torch.dtype | None = None,
) -> Runner:
    """The device side of a step (runner.py): the eager runner over a KV pool of
    `num_blocks` (stored as `kv_cache_dtype`, None: the model's), wrapped in its decode
    strategy if any (every rank of a sharded model builds the same)."""
    if cuda_graphs is not None and compile is not None:
        raise ValueError("cuda_graphs and compile are two runner strategies (CUDA, CPU): pick one")
    # one scratch block for padding tokens (batch-invariant steps, graph buckets, compiled
    # buckets): they write and read only there
    pool = KVCachePool(num_blocks, block_size, scratch_blocks=1, dtype=kv_cache_dtype)
    runner: Runner = ModelRunner(model, pool, batch_invariant=batch_invariant)
    if cuda_graphs is not None:
        return GraphedRunner(runner, cuda_graphs)
    if compile is not None:
        return CompiledRunner(runner, compile)
    return runner


def _constrained_to_sample(batch) -> list[Sequence]:
    """The sequences with a grammar whose step reaches their last token (the runner samples
    those): one pass over the batch, a cheap one when nobody has a grammar."""
    return [
        s
        for s, n in batch.scheduled
        if s.request.grammar is not None and s.num_computed_tokens + n == s.num_tokens
    ]


def _store_prompt_logprobs(result: RunnerOutput) -> None:
    """seq.prefill_logprobs[i] is the logprob of prompt token i + 1. A chunk recomputed after
    a preemption brings logprobs the sequence already has: keep the first ones."""
    for chunk in result.prompt_logprobs:
        have = len(chunk.seq.prefill_logprobs)
        skip = have - (chunk.first_index - 1)
        if skip < 0:
            raise RuntimeError(f"prompt logprobs of {chunk.seq.request_id} arrived out of order")
        chunk.seq.prefill_logprobs.extend(chunk.logprobs[skip:])
