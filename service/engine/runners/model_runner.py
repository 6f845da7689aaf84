"""The model runner: turns a SchedulerOutput into one forward of the transformers model over a
flattened ragged batch and hands back the logits the step needs.

The model's own code runs unchanged; only its attention is swapped for our paged function
(engine/attention/paged.py) through `AttentionInterface`. The runner never touches queues;
the scheduler never touches tensors.

A step has two sides. The host side (`StepRunner.execute`, the same for every runner) lays
the scheduled sequences out as a flattened batch, `StepInputs`: plain token ids, positions,
per-entry query and context lengths, block tables and the rows whose logits are kept, with
no Sequence in it. A decode verifying proposed tokens (speculation.py) is one more chunk
there: its last token and its proposals, every row kept. The device side (`run(inputs)`)
turns those into logits: `ModelRunner` eagerly, cuda_graphs.py's GraphedRunner through its
graphs for pure decodes (a verifying step is not one: eager), compiled.py's
CompiledRunner through its graphs for decodes and verifying steps alike (each keeps every
token's logits), and sharded.py's ShardedRunner by sending the inputs to the other ranks,
which run the same device side on their slice of the model. The host side then picks the
sampled rows and prompt logprobs out of the logits.

Hybrid models: each entry of StepInputs names its sequence's slot of the state pool
(state_pool.py), and `state_copies` the forks' copies of their parents' states, made
before the forward; the state layers split the step by entry (`StateStep`).

Multimodal rotary positions (M-RoPE: Qwen2-VL, Qwen2.5-VL, Qwen3-VL): `positions` stay
token indices (KV slots, masks, key_limits); StepInputs' `rope_positions` are the 3 rows
the model's rotary embedding reads, laid out host-side per chunk from the request's images
(mrope.py).

LoRA adapters: each entry of StepInputs names the slot of stacked adapter weights its rows
read (-1: the base model), and `lora_loads` the adapters the device side writes into slots
before the forward; the host side keeps the slot table (engine/adapters.py), so every rank
of a sharded model writes the same. models/lora_layers.py computes the deltas.

Batch-invariant mode (`batch_invariant`): besides the attention's fixed key chunks, every
matmul sees a row count that is a multiple of ROW_MULTIPLE. Padding tokens (token 0 at
position 0 of the pool's scratch block, one 1-token query each, laid out with the decodes)
round the flattened batch up, and the logits rows to keep are rounded up with repeats.
NOTE measured on an AMD EPYC (torch 2.13): float32 `F.linear` computes the last M % 4 rows
of a product of M < 12 rows otherwise than a longer product; bfloat16 computes a lone row
(M = 1) otherwise for input widths of 1152 and more (the MLP's down projection). Other CPUs
pick their blocking by the row count at any size, so every `F.linear` of the forward runs
over fixed blocks of rows as well (invariant_linear.py).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import AttentionInterface

from ...models import attention_adapters
from ...models.architectures import (
    FIRST_POSITION,
    IMAGE_FAMILIES,
    MROPE_FAMILIES,
    interface_reason,
    keeps_recurrent_state,
    layer_types_reason,
    module_sdpa_only_terms,
    not_invariant_reason,
    state_reason,
    unsupported_layer_types,
)
from ...models.lora_layers import LoraLayers, LoraStep, bound_lora, register_layers
from ...models.state_layers import has_state_layers, probe_states
from ..adapters import AdapterRegistry, SlotTable
from ..attention.invariant import ROW_MULTIPLE
from ..attention.paged import (
    ATTENTION_NAME,
    METADATA_KWARG,
    BatchMetadata,
    bound_metadata,
    paged_attention_forward,
)
from ..kv_pool import KVCachePool
from ..scheduler import SchedulerOutput
from ..sequence import Sequence
from ..state_pool import StatePool, StateStep, bound_state_step
from ..state_pool import install as install_state_layers
from ..types import BothWays
from .image_encoder import DeepstackStep, ImageEncoder, ImageSlice, image_slices
from .invariant_linear import (
    LINEAR_BLOCK_ROWS,
    fixed_rows_linears,
    linear_modules,
    probe_min_rows,
)
from .mrope import MRope

PROMPT_LOGPROB_ROWS = 256  # rows per float32 log_softmax when scoring prompt tokens


@dataclass(slots=True)
class PromptLogprobs:
    """Logprobs of prompt tokens token_ids[first_index : first_index + len(logprobs)]."""

    seq: Sequence
    first_index: int  # >= 1: the first prompt token has no logprob
    logprobs: list[float]


@dataclass(slots=True)
class RunnerOutput:
    # sequences whose step reached their last token (they get a new token), in the row
    # order of sample_logits
    sample_seqs: list[Sequence]
    # [rows, vocab], the model's dtype, on its device: one row per sequence, then one more
    # per proposal it verifies (row i + 1 follows its i-th proposal)
    sample_logits: torch.Tensor
    # prompt-token logprobs of chunks computed for decoder_input_details requests
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # per sample_seqs entry, the proposals its rows verify ([] for a plain decode)
    drafts: list[list[int]] = field(default_factory=list)


@dataclass(slots=True)
class StepInputs:
    """One forward's inputs, the same on every rank of a sharded model: plain ints.

    Entries are sequences (or batch-invariant padding tokens) in batch order; entry i's
    tokens are the next `query_lens[i]` of `token_ids`."""

    token_ids: list[int]  # [T]
    positions: list[int]  # [T]
    query_lens: list[int]  # [B] tokens computed this step
    context_lens: list[int]  # [B] tokens cached after the step
    block_tables: list[list[int]]  # [B] each entry's blocks, covering its context
    keep: list[int]  # batch rows whose logits are projected, in the logits' row order
    # (source, destination) KV blocks to copy before the forward: a fork's first write into
    # the partial block it shares with its request's other choices (block_manager.py)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    lora_slots: list[int] = field(default_factory=list)  # [B] each entry's slot, -1: none
    # (slot, adapter uid) to write before the forward, in order
    lora_loads: list[tuple[int, int]] = field(default_factory=list)
    state_slots: list[int] = field(default_factory=list)  # [B] each entry's state slot
    # (source, destination) state slots to copy before the forward: forks (state_slots.py)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # image features that replace placeholder tokens' embeddings (image_encoder.py)
    images: list[ImageSlice] = field(default_factory=list)
    # [T] the last key position each token sees (attention/paged.py), past its own in a
    # span attended both ways; None: every token its own (causal)
    key_limits: list[int] | None = None
    # [3][T] the tokens' rotary positions where they aren't `positions` (M-RoPE: mrope.py);
    # empty: the model's rotary embedding reads `positions`
    rope_positions: list[list[int]] = field(default_factory=list)

    @property
    def is_pure_decode(self) -> bool:
        """Every entry computes one token and keeps its logits (its sequence's last token):
        the steps the runner strategies (cuda_graphs.py, compiled.py) take over; not with
        M-RoPE positions, which they don't take (refused with them: settings/preflight.py)."""
        return (
            not self.images
            and self.key_limits is None
            and not self.rope_positions
            and len(self.keep) == len(self.query_lens)
            and all(n == 1 for n in self.query_lens)
        )

    @classmethod
    def empty(cls) -> StepInputs:
        return cls([], [], [], [], [], [])


class Runner(Protocol):
    """What PagedCore drives: ModelRunner, or a strategy wrapping it (cuda_graphs.py's
    GraphedRunner, compiled.py's CompiledRunner, sharded.py's ShardedRunner)."""

    pool: KVCachePool
    batch_invariant: bool

    def warmup(self) -> None:
        """Run once, at start-up on the engine's thread, what the first request would."""

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Logits `[len(inputs.keep), vocab]` (one row when nothing is kept)."""

    def execute(self, batch: SchedulerOutput) -> RunnerOutput: ...


class StepRunner:
    """The host side of a step, shared by every runner: lay the batch out, `run` it, pick
    the sampled rows and prompt logprobs out of the logits."""

    pool: KVCachePool
    batch_invariant: bool
    slot_table: SlotTable | None = None  # the LoRA slots' adapters (PagedCore sets it)
    rope: MRope | None = None  # a multimodal-RoPE model's rotary positions (mrope.py)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        raise NotImplementedError

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        slots, loads = self._lora_slots(batch)
        if self.batch_invariant:
            layout = lay_out(batch, ROW_MULTIPLE, self.pool.scratch_block, slots, self.rope)
        else:
            layout = lay_out(batch, slots=slots, rope=self.rope)
        inputs = layout.inputs
        inputs.block_copies = batch.block_copies
        inputs.state_copies = batch.state_copies
        inputs.lora_loads = loads
        logits = self.run(inputs)
        if len(layout.sample_rows) == logits.shape[0]:
            sample_logits = logits
        else:
            rows = torch.tensor(layout.sample_rows, dtype=torch.long, device=logits.device)
            sample_logits = logits[rows]
        prompt_logprobs = _prompt_logprobs(logits, layout.prompt_spans)
        return RunnerOutput(layout.sample_seqs, sample_logits, prompt_logprobs, layout.drafts)

    def _lora_slots(self, batch: SchedulerOutput) -> tuple[dict[int, int], list]:
        """The slot of each adapter the step uses, and the slot writes that takes."""
        if self.slot_table is None:
            return {}, []
        uids = {seq.request.adapter_uid for seq, _ in batch.scheduled} - {0}
        if not uids:
            return {}, []
        return self.slot_table.assign(uids)


class ModelRunner(StepRunner):
    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVCachePool,
        *,
        batch_invariant: bool = False,
        custom_kernels: bool = True,
        lora: LoraLayers | None = None,
        adapters: AdapterRegistry | None = None,
        state_slots: int = 0,
    ) -> None:
        """batch_invariant: each sequence's logits bit for bit the same whatever else the
        step computes (CPU only; needs a pool with a scratch block for padding tokens).
        custom_kernels=False: attention never takes textgen's Triton kernel (on CUDA,
        flash-attn or SDPA instead; --disable-custom-kernels). lora: the model's LoRA slots
        (models/lora_layers.py), filled from `adapters`. state_slots: a hybrid model's
        state pool holds that many sequences (the engine's max_batch_size)."""
        check_model_supported(model)
        AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
        images = getattr(model.config, "model_type", None) in IMAGE_FAMILIES
        if model._can_set_attn_implementation():
            # a vision-language model: the language model's attention only (the vision
            # tower attends over an image's patches, with its own)
            model.set_attn_implementation(
                {"text_config": ATTENTION_NAME} if images else ATTENTION_NAME
            )
        # Falcon, Bloom, MPT, Llama 4: through an attention adapter of ours
        attention_adapters.install(model, paged_attention_forward, ATTENTION_NAME)
        attention_adapters.install_shared_attention(model)  # Zamba's, run by several layers
        terms = module_sdpa_only_terms(model)
        if batch_invariant and terms:
            raise ValueError(not_invariant_reason(terms))
        if lora is not None and (adapters is None or batch_invariant):
            raise ValueError(
                "LoRA slots need an adapter registry, and don't run batch-invariant "
                "(each adapter's rows are their own matmuls)"
            )
        self.model = model.eval()
        self.pool = pool
        self.device = next(model.parameters()).device
        if batch_invariant and self.device.type != "cpu":
            raise ValueError(
                f"--deterministic (batch-invariant execution) runs on CPU only, not on "
                f"{self.device.type}: there the matmul kernels change with the batch size"
            )
        if batch_invariant and pool.scratch_block is None:
            raise ValueError("batch-invariant execution needs a KV pool with a scratch block")
        self.batch_invariant = batch_invariant
        self.custom_kernels = custom_kernels
        # batch-invariant matmuls: the model's Linear layers, over fixed blocks of rows
        self._linears = linear_modules(model) if batch_invariant else []
        self._min_rows = LINEAR_BLOCK_ROWS  # until warmup() probes this machine
        self.lora = lora
        self.adapters = adapters
        if lora is not None:
            register_layers(lora)
        self.states = self._state_pool(model, state_slots)
        self.images = ImageEncoder(model) if images else None
        # added to the positions the model sees (PaliGemma's are 1-indexed)
        self.first_position = FIRST_POSITION.get(model.config.model_type, 0)
        # the rotary positions of a multimodal-RoPE family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL),
        # host-side
        self.rope = MRope(model) if model.config.model_type in MROPE_FAMILIES else None
        # seconds per image the encoder ran, since the engine took them (metrics)
        self.encode_seconds: list[float] = []

    def _state_pool(self, model: torch.nn.Module, num_slots: int) -> StatePool | None:
        """A hybrid model's state pool, its state layers set to split each step; None
        when it keeps no state."""
        shapes = probe_states(model)
        if not shapes:
            return None
        if self.batch_invariant:
            raise ValueError("a hybrid model's state layers don't run batch-invariant")
        install_state_layers(model)
        return StatePool(shapes, max(num_slots, 1), self.device)

    @torch.inference_mode()
    def warmup(self) -> None:
        """One 1-token forward into block 0, so every layer's pool is allocated at start-up
        (out-of-memory shows at once) and lazy init runs before the first request. Block 0
        is free: whatever lands there is overwritten before anything reads it."""
        meta = BatchMetadata.build(
            self.pool,
            [1],
            [1],
            [[0]],
            self.device,
            batch_invariant=self.batch_invariant,
            custom_kernels=self.custom_kernels,
        )
        meta.warm_up = True  # and the CPU decode kernel's compile (attention/cpu_decode.py)
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        keep = torch.zeros(1, dtype=torch.long, device=self.device)
        self.forward(ids, ids, meta, keep, state=self.state_step([1], [1], [0]))
        if self._linears:  # on the thread that runs the forwards, with its thread count
            self._min_rows = probe_min_rows(self._linears)

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        self.pool.copy_blocks(inputs.block_copies)
        if self.states is not None:
            self.states.copy_slots(inputs.state_copies)
        meta = BatchMetadata.build(
            self.pool,
            inputs.query_lens,
            inputs.context_lens,
            inputs.block_tables,
            self.device,
            batch_invariant=self.batch_invariant,
            custom_kernels=self.custom_kernels,
            key_limits=inputs.key_limits,
        )
        embeds, deepstack = self.embeddings(inputs)
        with self.images.bound(deepstack) if deepstack else contextlib.nullcontext():
            return self.forward(
                self._tensor([inputs.token_ids]),
                self.rotary_positions(inputs),
                meta,
                self._tensor(inputs.keep),
                self.prepare_lora(inputs),
                self.state_step(inputs.query_lens, inputs.context_lens, inputs.state_slots),
                embeds,
            )

    def rotary_positions(self, inputs: StepInputs) -> torch.Tensor:
        """The model's `position_ids`: [1, T] token indices, or M-RoPE's [3, 1, T]."""
        if inputs.rope_positions:
            return self._tensor(inputs.rope_positions).unsqueeze(1)
        return self._tensor([inputs.positions])

    def embeddings(self, inputs: StepInputs) -> tuple[torch.Tensor | None, DeepstackStep | None]:
        """`inputs_embeds` with the step's image features merged, and the deepstack rows
        its forward adds (Qwen3-VL); None, None: no image."""
        if not inputs.images:
            return None, None
        encoded, started = self.images.encoded, time.perf_counter()
        embeds, deepstack = self.images.embeddings(self._tensor([inputs.token_ids]), inputs.images)
        if count := self.images.encoded - encoded:  # not all from the encoder cache
            if self.device.type == "cuda":  # the time the device took, not the launches'
                torch.cuda.synchronize(self.device)
            self.encode_seconds += [(time.perf_counter() - started) / count] * count
        return embeds, deepstack

    def state_step(self, query_lens, context_lens, slots) -> StateStep | None:
        """How the step splits in the state layers (None: the model keeps no state)."""
        if self.states is None:
            return None
        return StateStep.build(self.states, query_lens, context_lens, slots, self.device)

    def prepare_lora(self, inputs: StepInputs) -> LoraStep | None:
        """Write the step's new adapters into their slots; -> the step's LoRA rows (None:
        none). The runner strategies call it for the steps they run themselves."""
        if self.lora is None:
            return None
        self.write_adapters(inputs)
        return LoraStep.build(
            inputs.lora_slots, inputs.query_lens, self.device, kernel=self.device.type == "cuda"
        )

    def write_adapters(self, inputs: StepInputs) -> None:
        """The adapters this step puts into slots, written before its forward."""
        for slot, uid in inputs.lora_loads:
            self.lora.write(slot, self.adapters.weights(uid))

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        meta: BatchMetadata,
        keep: torch.Tensor,
        lora: LoraStep | None = None,
        state: StateStep | None = None,
        embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """-> logits `[len(keep), vocab]`. Public for runner strategies that lay out
        their own inputs (cuda_graphs.py). embeds: the tokens' embeddings, image features
        merged (they replace `ids`)."""
        if keep.numel() == 0:  # a step of prefill chunks only: nothing to project
            keep = keep.new_zeros(1)
        linears = fixed_rows_linears(self._linears, self._min_rows) if self._linears else None
        with (
            linears or contextlib.nullcontext(),
            bound_lora(lora),
            bound_metadata(meta),
            bound_state_step(state),
        ):
            tokens = {"input_ids": ids} if embeds is None else {"inputs_embeds": embeds}
            out = self.model(
                **tokens,
                position_ids=positions + self.first_position if self.first_position else positions,
                use_cache=False,
                logits_to_keep=keep,
                **{METADATA_KWARG: meta},
            )
        return out.logits[0]


@dataclass(slots=True)
class Layout:
    """Where each sequence's tokens sit in the flattened batch (host-side lists): the
    StepInputs, and what the host side needs to read the logits back."""

    token_ids: list[int] = field(default_factory=list)  # [T]
    positions: list[int] = field(default_factory=list)  # [T]
    # per entry (a sequence or a padding token), in batch order: the attention's metadata
    query_lens: list[int] = field(default_factory=list)  # tokens computed this step
    context_lens: list[int] = field(default_factory=list)  # tokens cached after the step
    block_tables: list[list[int]] = field(default_factory=list)
    lora_slots: list[int] = field(default_factory=list)  # LoRA slot, -1: none
    state_slots: list[int] = field(default_factory=list)  # state pool slot, -1: none
    keep: list[int] = field(default_factory=list)  # batch positions whose logits we project
    sample_seqs: list[Sequence] = field(default_factory=list)  # reached their last token
    # rows in `keep` sampled: one per sample_seqs entry, then one per proposal it verifies
    sample_rows: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)  # per sample_seqs entry
    # (seq, first row in `keep`, first position, chunk length) for prompt logprobs
    prompt_spans: list[tuple[Sequence, int, int, int]] = field(default_factory=list)
    slot_of: dict[int, int] = field(default_factory=dict)  # adapter uid -> its LoRA slot
    images: list[ImageSlice] = field(default_factory=list)  # image features to merge
    key_limits: list[int] | None = None  # StepInputs'; None until a span attended both ways
    rope: MRope | None = None  # lays out rope_positions (M-RoPE models only)
    rope_positions: list[list[int]] = field(default_factory=list)  # [3][T] with `rope`

    @property
    def inputs(self) -> StepInputs:
        return StepInputs(
            self.token_ids,
            self.positions,
            self.query_lens,
            self.context_lens,
            self.block_tables,
            self.keep,
            lora_slots=self.lora_slots,
            state_slots=self.state_slots,
            images=self.images,
            key_limits=self.key_limits,
            rope_positions=self.rope_positions,
        )

    def add(self, seq: Sequence, num_new: int, drafts: list[int] | None = None) -> None:
        """`drafts`: the proposals a decode verifies (its num_new - 1 tokens after the
        sequence's last): every row of the chunk is sampled."""
        start = seq.num_computed_tokens
        offset = len(self.token_ids)
        if drafts:
            self.token_ids.append(seq.token_ids[start])
            self.token_ids.extend(drafts)
        else:
            self.token_ids.extend(seq.token_ids[start : start + num_new])
        reaches_end = drafts or start + num_new == seq.num_tokens
        self.positions.extend(range(start, start + num_new))
        if self.rope is not None:
            self._add_rope(self.rope.positions(seq.request.images, start, num_new))
        self.query_lens.append(num_new)
        self.context_lens.append(start + num_new)
        self.block_tables.append(seq.block_table)
        self.lora_slots.append(self.slot_of.get(seq.request.adapter_uid, -1))
        self.state_slots.append(seq.state_slot)
        if seq.request.images and start < seq.num_prompt_tokens:
            self.images.extend(image_slices(seq.request.images, start, num_new, offset))
        self._add_key_limits(seq.request.both_ways, start, num_new)
        if drafts:
            self.sample_rows.extend(range(len(self.keep), len(self.keep) + num_new))
            self.keep.extend(range(offset, offset + num_new))
        elif wants_prompt_logprobs(seq):
            self.prompt_spans.append((seq, len(self.keep), start, num_new))
            self.keep.extend(range(offset, offset + num_new))
        elif reaches_end:
            self.keep.append(offset + num_new - 1)
        if reaches_end:
            self.sample_seqs.append(seq)
            self.drafts.append(drafts or [])
            if not drafts:
                self.sample_rows.append(len(self.keep) - 1)

    def _add_rope(self, rows: list[list[int]]) -> None:
        if not self.rope_positions:
            self.rope_positions = [[] for _ in rows]
        for laid, row in zip(self.rope_positions, rows, strict=True):
            laid.extend(row)

    def add_padding(self, count: int, scratch_block: int) -> None:
        """`count` 1-token queries at position 0 of the scratch block; nothing reads their
        logits. They all write the same slot, the same K/V (token 0 at position 0)."""
        for _ in range(count):
            self.token_ids.append(0)
            self.positions.append(0)
            if self.rope is not None:
                self._add_rope(self.rope.positions((), 0, 1))
            self.query_lens.append(1)
            self.context_lens.append(1)
            self.block_tables.append([scratch_block])
            self.lora_slots.append(-1)
            self.state_slots.append(-1)
            if self.key_limits is not None:
                self.key_limits.append(0)

    def _add_key_limits(self, spans: tuple[BothWays, ...], start: int, num_new: int) -> None:
        """The chunk's key_limits (positions start .. start + num_new - 1): a span's tokens
        see up to its last (the scheduler keeps the rest of a span in the chunk), others
        themselves; the list starts at the first chunk in a span, causal before it."""
        end = start + num_new
        touched = [span for span in spans if span.first < end and start <= span.last]
        if not touched and self.key_limits is None:
            return
        if self.key_limits is None:
            self.key_limits = self.positions[: len(self.positions) - num_new]
        limits = list(range(start, end))
        for span in touched:
            for p in range(max(span.first, start), min(span.last + 1, end)):
                limits[p - start] = span.last
        self.key_limits.extend(limits)


def lay_out(
    batch: SchedulerOutput,
    row_multiple: int = 1,
    scratch_block: int | None = None,
    slots: dict[int, int] | None = None,
    rope: MRope | None = None,
) -> Layout:
    """The flattened batch; with row_multiple > 1, padded to a multiple of that many tokens
    and logits rows (padding tokens go to `scratch_block`). slots: each adapter uid's LoRA
    slot. rope: a multimodal-RoPE model's, for the tokens' rotary positions."""
    # Single-token queries first: they form the cheap decode groups of the attention (and
    # the padding tokens join them). Then the chunks, those that start their sequence
    # first. Each kind runs largest first, so that the attention can cut a run into groups
    # where sizes fall far apart (engine/attention/paged.py, `_split_run`). With LoRA adapters, the
    # decodes of one adapter run together (largest first within it): each adapter's rows
    # are then one slice of the batch for the LoRA matmuls, not gathered and scattered.
    decodes = [e for e in batch.scheduled if e[1] == 1]
    if slots:
        decodes.sort(
            key=lambda e: (slots.get(e[0].request.adapter_uid, -1), attention_size(e)),
            reverse=True,
        )
    else:
        decodes.sort(key=attention_size, reverse=True)
    chunks = [e for e in batch.scheduled if e[1] > 1]
    chunks.sort(
        key=lambda entry: (entry[0].num_computed_tokens == 0, attention_size(entry)),
        reverse=True,
    )
    layout = Layout(slot_of=slots or {}, rope=rope)
    for seq, num_new in decodes:
        layout.add(seq, num_new)
    if row_multiple > 1:
        num_tokens = sum(n for _, n in batch.scheduled)
        layout.add_padding(-num_tokens % row_multiple, scratch_block)
    for seq, num_new in chunks:  # verifying decodes among them: short chunks after their
        layout.add(seq, num_new, batch.proposals.get(seq))  # cached tokens
    if row_multiple > 1 and layout.keep:  # repeats of the last row; the extra logits unread
        layout.keep.extend(layout.keep[-1:] * (-len(layout.keep) % row_multiple))
    return layout


def attention_size(entry: tuple[Sequence, int]) -> int:
    """Query x key pairs of a scheduled (sequence, new tokens) in the attention."""
    seq, num_new = entry
    return num_new * (seq.num_computed_tokens + num_new)


def check_model_supported(model: torch.nn.Module) -> None:
    """Refuse models the paged path would serve wrong text for: the rules of
    models/architectures.py (which the settings' checks apply to config.json before
    loading), held here on the loaded model."""
    name = type(model).__name__
    model_type = getattr(model.config, "model_type", None)
    if model_type and keeps_recurrent_state(model_type) and not has_state_layers(model):
        raise ValueError(state_reason(name))
    adapted = attention_adapters.is_adapted(model_type)
    if not adapted and not model._can_set_attn_implementation():
        raise ValueError(interface_reason(name))
    text_config = model.config.get_text_config()
    unsupported = unsupported_layer_types(
        getattr(text_config, "model_type", None), getattr(text_config, "layer_types", None)
    )
    if unsupported:
        raise ValueError(layer_types_reason(name, unsupported))


def decode_bucket(inputs: StepInputs, buckets: list[int]) -> int | None:
    """The smallest of the sorted `buckets` that holds this step when it is a pure decode;
    None when the eager runner must take it."""
    if not inputs.is_pure_decode:
        return None
    n = len(inputs.query_lens)
    return next((b for b in buckets if b >= n), None)


def wants_prompt_logprobs(seq: Sequence) -> bool:
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
