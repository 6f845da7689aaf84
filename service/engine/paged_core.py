"""The fast engine core: continuous batching over a paged KV cache with prefix caching.

One step = proposals for the decoding sequences when speculation is on (speculation.py; when
it adapts, of those whose measured acceptance pays for verifying: speculation_gate.py) ->
`Scheduler.schedule()` (which sequences, how many tokens each) -> one forward of the model
over the flattened ragged batch (`ModelRunner`) -> `Sampler` on the sequences that reached
their last token (and on every proposal's position) -> the tokens kept appended, the step's
computed tokens committed, finished sequences' blocks freed at once.
The engine loop (loop.py) drives it: add, abort, has_work, warm_up, step, stats.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import ErrorType
from ..models.lora_layers import LoraLayers
from .adapters import AdapterRegistry, SlotTable
from .block_manager import BlockManager, num_blocks_for_choices
from .config import EngineConfig
from .grammar import GrammarMasks, PendingMasks
from .kv_pool import KVCachePool
from .runners.compiled import CompiledRunner
from .runners.cuda_graphs import GraphedRunner
from .runners.model_runner import ModelRunner, Runner, RunnerOutput
from .runners.sharded import ShardedRunner, ShardGroup
from .sampler import Sampler
from .scheduler import Scheduler
from .sequence import Sequence
from .speculation import (
    NgramProposer,
    Proposer,
    accepted_run,
    sample_rows,
)
from .speculation_gate import SpeculationGate
from .state_slots import StateSlots
from .stopping import token_stop_reason
from .types import EngineError, EngineStats
from .watermark import Watermark


@dataclass(slots=True)
class StepOutput:
    """A token one sequence gained in a step (the sequence already holds it). A speculative
    step can give a sequence several, one StepOutput each, in order."""

    seq: Sequence
    token_id: int
    logprob: float
    top_tokens: list[tuple[int, float]]  # (id, logprob), top_n_tokens of them
    # prompt logprobs (first is None) on the step that finished the prefill, when
    # the request asked for decoder_input_details
    prefill_logprobs: list[float | None] | None = None
    num_tokens: int = 0  # the sequence's length with this token (token_ids[num_tokens - 1])

    @property
    def is_last(self) -> bool:
        """The sequence's last token so far (a finished sequence's final one)."""
        return self.num_tokens == self.seq.num_tokens


class PagedCore:
    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig,
        *,
        grammars: GrammarMasks | None = None,
        shards: ShardGroup | None = None,
        proposer: Proposer | None = None,
        lora: LoraLayers | None = None,
        adapters: AdapterRegistry | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """
        Args:
            model: a transformers causal LM; its attention implementation is switched to ours.
            config: limits, KV sizing, runner strategy, speculation (config.py).
            grammars: token masks for requests with a grammar; None: such requests are refused.
            shards: this is rank 0 of a sharded model (`model` is its slice): every step
                runs on all ranks, which follow in runners/sharded.py's follow_steps().
            proposer: who proposes tokens when config.speculation is on (default: n-gram
                lookup, speculation.py's NgramProposer; draft_model.py's DraftModelProposer
                for a draft model).
            lora: the model's LoRA slots (models/lora_layers.py), serving the adapters of
                `adapters` (engine/adapters.py); None: requests name no adapter.
            clock: seconds, monotonic: what adaptive speculation times steps with.
        """
        self.config = config
        self.runner: Runner = build_runner(model, config, lora, adapters)
        # a hybrid model's state pool: a slot per running sequence (state_slots.py). A
        # prefix-cache hit would skip the state layers' pass over the prefix: off for it.
        states = getattr(self.runner, "states", None)
        self.state_slots = StateSlots(states.num_slots) if states is not None else None
        prefix_caching = config.enable_prefix_caching and states is None
        # a sliding window's released table entries point at the pool's scratch block
        # (build_runner's; block id num_blocks, BlockManager.placeholder)
        self.block_manager = BlockManager(
            config.num_blocks, config.block_size, prefix_caching, config.sliding_window
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_batch_prefill_tokens=config.max_batch_prefill_tokens,
            max_batch_size=config.max_batch_size,
            max_loras=lora.num_slots if lora is not None else 0,
            state_slots=self.state_slots,
        )
        self.shards = shards
        if shards is not None:
            self.runner = ShardedRunner(self.runner, shards)
        # the eager runner of a vision-language model, which times its image encodes
        self._encoder_runner = _eager_with_images(self.runner)
        self.adapters = adapters
        if lora is not None:
            self.runner.slot_table = SlotTable(lora.num_slots)
        self.sampler = Sampler(Watermark(config.watermark_gamma, config.watermark_delta))
        self.grammars = grammars
        speculation = self.speculation = config.speculation
        if speculation is not None and proposer is None:
            proposer = NgramProposer(speculation.ngram_min, speculation.ngram_max)
        self.proposer = proposer if speculation is not None else None
        # who proposes, step by step, when speculation adapts (speculation_gate.py)
        self.gate: SpeculationGate | None = None
        if speculation is not None and speculation.adaptive:
            self.gate = SpeculationGate(free=getattr(proposer, "free", False), clock=clock)
        self._steps = 0
        self._spec_proposed = self._spec_accepted = self._spec_verifications = 0

    @property
    def max_total_tokens(self) -> int:
        """The longest sequence (prompt + new tokens) the pool can hold."""
        return self.block_manager.num_blocks * self.block_manager.block_size

    # EngineCore --------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        # The engine's own invariants: a request that could never fit would wait forever.
        # Validated requests never fail them (validation bounds max_new_tokens by
        # max_total_tokens, which startup checks against the pool: replica/kv_sizing.py).
        bm = self.block_manager
        needed = num_blocks_for_choices(
            seq.num_prompt_tokens, seq.request.stopping.max_new_tokens, seq.width, bm.block_size
        )
        # Under a sliding window each choice holds at most its window and one step's tokens
        # (a prefill chunk; proposals only ever take blocks there are): longer sequences than
        # the pool holds whole run too.
        window_blocks = bm.window_blocks(self.config.max_batch_prefill_tokens)
        if window_blocks is not None:
            needed = min(needed, seq.width * window_blocks)
        if needed > bm.num_blocks:
            raise EngineError(
                f"request needs {needed * bm.block_size} tokens of KV cache for its "
                f"{seq.width} choice(s) but the pool holds {self.max_total_tokens} "
                "(max_batch_total_tokens)",
                ErrorType.VALIDATION,
            )
        if seq.num_prompt_tokens == 0:
            raise EngineError("empty prompt", ErrorType.VALIDATION)
        if self.state_slots is not None and seq.width > self.state_slots.num_slots:
            raise EngineError(
                f"request of {seq.width} choices needs as many state slots, but this hybrid "
                f"model's state pool holds {self.state_slots.num_slots} (max_batch_size)",
                ErrorType.VALIDATION,
            )
        if seq.request.grammar is not None and self.grammars is None:
            raise EngineError("this engine has no grammar support", ErrorType.VALIDATION)
        uid = seq.request.adapter_uid
        if uid:
            if self.adapters is None or not self.adapters.acquire(uid):
                raise EngineError(
                    f"LoRA adapter {seq.request.adapter_id!r} is not loaded (unloaded meanwhile)",
                    ErrorType.VALIDATION,
                )
            seq.holds_adapter = True
        self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> None:
        self._retire(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def warm_up(self) -> None:
        """Allocate every layer's KV pool (out of memory shows at startup) and run the
        lazy initialisations: one 1-token forward, then the graph captures or compiles if
        any, or batch-invariant mode's probe of the matmuls (EngineLoop calls it on its
        thread); and the draft model's, if one proposes."""
        self.runner.warmup()
        if self.proposer is not None:
            self.proposer.warmup()

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        gate = self.gate
        if gate is not None:  # the whole step is timed: what a user waits for
            gate.start_step()
        batch = self.scheduler.schedule(self._propose())
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
        self.scheduler.commit(batch)  # before a fork copies its parent's computed tokens
        _store_prompt_logprobs(result)
        outputs, kept = self._append_sampled(result, masks) if result.sample_seqs else ([], {})
        # after the append: a verifying decode's computed tokens are those it kept
        self.scheduler.commit_verified(batch, kept)
        for seq in dict.fromkeys(out.seq for out in outputs):  # forks included
            if seq.is_finished:
                self._retire(seq)
        if gate is not None:
            gate.end_step(batch)
        return outputs

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

    def take_encode_seconds(self) -> list[float]:
        """Seconds per image the vision encoder ran since the last call (metrics)."""
        runner = self._encoder_runner
        if runner is None or not runner.encode_seconds:
            return []
        taken, runner.encode_seconds = runner.encode_seconds, []
        return taken

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
            window_released_blocks=bm.window_released_blocks,
            state_slots_total=self.state_slots.num_slots if self.state_slots else 0,
            state_slots_used=self.state_slots.num_used if self.state_slots else 0,
            steps=self._steps,
            prefill_tokens=self.scheduler.num_prefill_tokens,
            spec_proposed_tokens=self._spec_proposed,
            spec_accepted_tokens=self._spec_accepted,
            spec_verifications=self._spec_verifications,
            spec_sequences_off=self.gate.sequences_off if self.gate else 0,
            spec_skipped_proposals=self.gate.skipped if self.gate else 0,
        )

    # internals ---------------------------------------------------------------

    def start_masks(self, batch) -> PendingMasks | None:
        """Begin the grammar masks of the batch's sampling sequences (None: none has a
        grammar); call before the forward, which they overlap."""
        if not self.grammars:
            return None
        constrained = _constrained_to_sample(batch)
        if not batch.proposals:
            return self.grammars.start(constrained)
        return self.grammars.start(constrained, [batch.proposals.get(s, []) for s in constrained])

    def _propose(self) -> dict[Sequence, list[int]]:
        """Proposed tokens for the running sequences in decode state, when speculation is on
        and at most `max_batch` sequences run (above, verifying costs more compute than the
        batch has to spare), and, when it adapts, for those the gate lets propose. At most as
        many as the sequence may still gain, less one (the verification's own draw), and only
        those its grammar admits."""
        spec = self.speculation
        running = self.scheduler.running
        if spec is None or not running or len(running) > spec.max_batch:
            return {}
        seqs, limits = [], []
        for seq in running:
            left = seq.request.stopping.max_new_tokens - seq.num_output_tokens - 1
            if seq.num_computed_tokens == seq.num_tokens - 1 and seq.num_output_tokens and left > 0:
                seqs.append(seq)
                limits.append(min(spec.num_tokens, left))
        if not seqs:
            return {}
        if self.gate is None:
            drafted = self.proposer.propose(seqs, limits)
        else:
            # a step without prefill chunks: none running still prefills, none admitted
            sched = self.scheduler
            decode_only = len(seqs) == len(running) or all(
                s.num_computed_tokens == s.num_tokens - 1 for s in running
            )
            decode_only &= not sched.waiting or len(running) >= sched.max_batch_size
            drafted = self.gate.propose(self.proposer, seqs, limits, len(running), decode_only)
        proposals = {}
        for seq, drafts in zip(seqs, drafted):
            if drafts and seq.grammar_state is not None:
                drafts = drafts[: self.grammars.admitted(seq, drafts)]
            if drafts:
                proposals[seq] = drafts
        return proposals

    def _append_sampled(
        self, result: RunnerOutput, masks: PendingMasks | None = None
    ) -> tuple[list[StepOutput], dict[Sequence, int]]:
        """Sample every row, append each sequence's tokens (a verifying decode's kept
        proposals and the draw that ends them) up to the first that stops it. Returns the
        step's outputs and, per verifying decode, the tokens it appended."""
        logits = result.sample_logits.float()
        speculative = any(result.drafts)
        rows = sample_rows(result.sample_seqs, result.drafts) if speculative else result.sample_seqs
        if masks is not None:
            owners = [getattr(r, "seq", r) for r in rows] if speculative else rows
            self.grammars.apply(logits, owners, masks)
        seqs, drafts, rows, logits = self._fork(result.sample_seqs, result.drafts, rows, logits)
        sampled = self.sampler.sample(logits, rows)
        outputs, kept = [], {}
        now = time.monotonic()
        row = 0
        for seq, proposed in zip(seqs, drafts):
            prefill = None
            if seq.request.decoder_input_details and seq.num_output_tokens == 0:
                prefill = [None, *seq.prefill_logprobs]
            run = 1
            if proposed:
                run += accepted_run(sampled.token_ids[row : row + len(proposed)], proposed)
                self._spec_proposed += len(proposed)
                self._spec_accepted += run - 1
                self._spec_verifications += 1
                if self.gate is not None:
                    self.gate.verified(seq, len(proposed), run - 1)
            for at in range(row, row + run):
                token_id = sampled.token_ids[at]
                seq.append_token(token_id, now)
                complete = seq.grammar_state is not None and self.grammars.advance(seq, token_id)
                reason = token_stop_reason(seq, token_id, grammar_complete=complete, now=now)
                outputs.append(
                    StepOutput(
                        seq,
                        token_id,
                        sampled.logprobs[at],
                        sampled.top_tokens[at],
                        prefill if at == row else None,
                        seq.num_tokens,
                    )
                )
                if reason is not None:  # EOS, length or time inside a run ends it there
                    seq.finish(reason)
                    break
            if proposed:
                kept[seq] = seq.num_tokens - (seq.num_computed_tokens + 1)
            row += 1 + len(proposed)
        return outputs, kept

    def _retire(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence: its blocks, its hold on its adapter (once),
        and what the proposer keeps."""
        self.scheduler.finish(seq)
        if seq.holds_adapter:
            seq.holds_adapter = False
            self.adapters.release(seq.request.adapter_uid)
        if self.proposer is not None:
            self.proposer.forget(seq)
        if self.gate is not None:
            self.gate.forget(seq)

    def _fork(
        self, seqs: list[Sequence], drafts: list[list[int]], rows: list, logits: torch.Tensor
    ) -> tuple[list[Sequence], list[list[int]], list, torch.Tensor]:
        """The sequences that sample this step with their proposals, sampler rows and logits
        rows, the forks of those whose prompt it computed (other choices of their request)
        added: a fork shares its parent's blocks and samples its own first token from the
        parent's row (its grammar mask included), so the prompt is computed once for all n
        choices. A parent verifies no proposal (it has no output yet): one row each."""
        if not any(s.forks for s in seqs):
            return seqs, drafts, rows, logits
        out_seqs, out_drafts, out_rows, index = [], [], [], []
        at = 0
        for seq, proposed in zip(seqs, drafts):
            span = 1 + len(proposed)
            out_seqs.append(seq)
            out_drafts.append(proposed)
            out_rows.extend(rows[at : at + span])
            index.extend(range(at, at + span))
            forks, seq.forks = seq.forks, []
            for child in forks:
                if child.is_finished:  # aborted with its request
                    continue
                self.scheduler.add_fork(seq, child)
                if seq.holds_adapter:
                    self.adapters.share(seq.request.adapter_uid)
                    child.holds_adapter = True
                child.prefill_logprobs = list(seq.prefill_logprobs)
                if seq.grammar_state is not None:  # before seq's token moves it on
                    child.grammar_state = seq.grammar_state.deep_copy()
                out_seqs.append(child)
                out_drafts.append([])
                out_rows.append(child)
                index.append(at)
            at += span
        return out_seqs, out_drafts, out_rows, logits[torch.tensor(index, device=logits.device)]


# where each strategy keeps the runner it wraps (ShardedRunner, GraphedRunner, CompiledRunner)
_WRAPPED = ("inner", "runner", "eager")


def _eager_with_images(runner) -> ModelRunner | None:
    """The eager runner under whatever strategies wrap it, if its model takes images."""
    while not isinstance(runner, ModelRunner):
        wrapped = [getattr(runner, name) for name in _WRAPPED if hasattr(runner, name)]
        if not wrapped:
            return None
        runner = wrapped[0]
    return runner if runner.images is not None else None


def build_runner(
    model: torch.nn.Module,
    config: EngineConfig,
    lora: LoraLayers | None = None,
    adapters: AdapterRegistry | None = None,
) -> Runner:
    """The device side of a step (runners/): the eager runner over a KV pool of
    config.num_blocks (stored as config.kv_cache_dtype, None: the model's), wrapped in its
    strategy if any (every rank of a sharded model builds the same)."""
    # one scratch block for padding tokens (batch-invariant steps, graph buckets, compiled
    # buckets): they write and read only there; a sliding window's released table entries
    # point at it too (BlockManager.placeholder: block id num_blocks), read only masked
    pool = KVCachePool(
        config.num_blocks, config.block_size, scratch_blocks=1, dtype=config.kv_cache_dtype
    )
    runner: Runner = ModelRunner(
        model,
        pool,
        batch_invariant=config.batch_invariant,
        custom_kernels=config.custom_kernels,
        lora=lora,
        adapters=adapters,
        state_slots=config.max_batch_size,
    )
    if config.cuda_graphs is not None:
        return GraphedRunner(runner, config.cuda_graphs)
    if config.compile is not None:
        return CompiledRunner(runner, config.compile)
    return runner


def _constrained_to_sample(batch) -> list[Sequence]:
    """The sequences with a grammar whose step reaches their last token (the runner samples
    those): one pass over the batch, a cheap one when nobody has a grammar."""
    return [
        s
        for s, n in batch.scheduled
        if s.request.grammar is not None
        and (s.num_computed_tokens + n == s.num_tokens or s in batch.proposals)
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
