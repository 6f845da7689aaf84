"""Paged attention plugged into transformers' attention registry.

The model runs one flattened ragged batch (`[1, T]` tokens of many sequences). Our function,
registered with `AttentionInterface`, receives each layer's query `[1, H, T, D]` and new
key/value `[1, KVH, T, D]` (rotary already applied), writes the new K/V into the paged pool
and attends every query token over its own sequence's cached K/V.

Everything that depends only on the batch layout (slot mapping, gather indices, masks) is in
a `BatchMetadata` built once per step by the runner and passed to the model as an extra
keyword argument (transformers forwards it to the attention function untouched). Masks and
indices are built lazily on the first layer that needs them and shared by all the others, so
the per-layer cost has no Python loop over sequences.

Three backends; this module only picks one per call (`_pick_kernel`):
- CPU, and the reference for the others: torch SDPA over gathered blocks, one call per
  group of sequences, usually two a layer: one for the single-token queries (decodes), one
  for the multi-token chunks padded to the longest chunk. Sequences of very different
  sizes split into more groups, so that short ones don't gather and attend up to the long
  ones' length (`_split_run`). A sequence decoding alone (one stream) attends a slice of
  its gathered keys with no mask: SDPA's fastest case, as in plain transformers' decode. With
  `batch_invariant` the keys are cut into fixed chunks and each row's result no longer
  depends on the rest of the batch (invariant.py).
  Decodes and verifications (up to cpu_decode.MAX_QUERY query tokens a sequence) in float32
  or bfloat16, without ALiBi or chunked attention, skip the gather: cpu_decode.py's C++
  kernel reads the pool in place (2-5x faster than gather + SDPA).
- CUDA with `triton`: triton_kernel.py's kernel, one launch per layer for decodes and
  chunks alike, reading the pool in place through the block tables.
- CUDA with the `flash_attn` package: `flash_attn_varlen_func` over the unpadded batch.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType

import torch
import torch.nn.functional as F

from ..kv_pool import KVCachePool, LayerCache, read_blocks, read_slots
from . import cpu_decode, cpu_prefill
from . import invariant as invariant_attention
from .invariant import ChunkedMask

try:  # optional CUDA kernel; absent on CPU machines
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the install
    flash_attn_varlen_func = None

# The registry name. It must not contain "sdpa": transformers treats such names as SDPA and
# refuses them on models without SDPA support.
ATTENTION_NAME = "textgen_paged"
# The keyword argument that carries the BatchMetadata through the model.
METADATA_KWARG = "textgen_batch"
# flash-attn 2 only reads a paged pool directly when its blocks are multiples of 256 tokens;
# with smaller blocks the step's K/V are gathered into one contiguous varlen buffer.
FLASH_PAGED_BLOCK_MULTIPLE = 256
# A run of sequences splits into another SDPA group where a sequence's query x key pairs
# fall to 1/RATIO of its group's largest and that saves at least MIN_PAIRS (_split_run).
SPLIT_RATIO = 2
SPLIT_MIN_PAIRS = 4096


@dataclass(eq=False)
class Alibi:
    """ALiBi (Bloom, MPT, Falcon-RW): each head adds `slope x key position` to its scores,
    times `scale`. Absolute positions, as those families' own code adds them: within a
    query's row they differ from the paper's relative distances by a constant, which the
    softmax cancels. The product is taken in the slopes' dtype (Falcon's, in bfloat16)."""

    slopes: torch.Tensor  # [H]
    scale: float = 1.0

    def bias(self, key_pos: torch.Tensor, num_kv_heads: int, query_len: int, dtype) -> torch.Tensor:
        """The bias laid out as the GQA-folded query rows: `[1, KVH, G * q, K]` for keys at
        `key_pos` `[K]`."""
        bias = (self.slopes[:, None] * key_pos).to(dtype)
        if self.scale != 1.0:
            bias = bias * self.scale
        groups = self.slopes.shape[0] // num_kv_heads
        rows = bias.view(num_kv_heads, groups, 1, -1).expand(-1, -1, query_len, -1)
        return rows.reshape(1, num_kv_heads, groups * query_len, -1)


@dataclass(eq=False)
class AttentionGroup:
    """Sequences attended by one SDPA call, queries padded to `max_query_len`.

    Its tokens are the contiguous slice [token_start, token_end) of the flattened batch.
    """

    token_start: int
    token_end: int
    num_seqs: int  # b
    max_query_len: int  # q: the longest query chunk in the group
    max_blocks: int  # nb: the longest block table in the group
    block_size: int  # positions per block: gathered key j is position j
    block_index: torch.Tensor  # [b * nb] long: pool blocks to gather, row-major, padded with 0
    query_pos: torch.Tensor  # [b, q] long: absolute position of each padded query row
    is_real_query: torch.Tensor  # [b, q] bool: False on padding rows
    query_index: torch.Tensor | None  # [b * q] long: group token of each padded row (None: q == 1)
    output_index: torch.Tensor | None  # [Tg] long: padded row of each real token (None: q == 1)
    # batch-invariant attention: keys per chunk (max_blocks * block_size is a multiple);
    # None: the reference path, one SDPA call over all of them
    chunk_tokens: int | None = None
    # one sequence decoding (b == q == 1, not batch-invariant): the pool slots of its
    # context in position order. Its keys are gathered slot by slot, and SDPA runs on them
    # with no mask (_attend_single).
    context_slots: torch.Tensor | None = None
    # chunks that each start their sequence (nothing cached before them; not batch-invariant):
    # query row i is position i, so causal attention is SDPA's is_causal over the first q keys
    fresh: bool = False
    # [b, q] long: the last key position each padded row sees, where some see past their
    # own (a span's tokens see the whole span: Gemma 3's images, PaliGemma's prompt); None:
    # query_pos, causal
    query_limit: torch.Tensor | None = None
    # cpu_decode.py's view of the group (paged._token_rows), set by the first layer that
    # needs it: each query token's context length `[Tg]` (its position + 1) and block table
    # `[Tg, nb]` (its sequence's)
    token_lengths: torch.Tensor | None = None
    token_tables: torch.Tensor | None = None
    _masks: dict[tuple, torch.Tensor] = field(default_factory=dict)  # (window, chunk, G, dtype)
    _chunked_masks: dict[tuple, ChunkedMask] = field(default_factory=dict)

    def mask(
        self, window: int | None, num_groups: int, dtype: torch.dtype, chunk: int | None = None
    ) -> torch.Tensor:
        """Additive mask `[b, 1, rows, nb * block_size]` (0 = attend, -inf = not) for a
        layer whose query heads are folded `num_groups` per KV head: rows = num_groups * q,
        or 1 when q == 1 (it broadcasts over the heads). Built once per step and key, and
        additive in the query's dtype because SDPA would otherwise convert a bool mask on
        every call."""
        key = (window, chunk, num_groups, dtype)
        mask = self._masks.get(key)
        if mask is None:
            allowed = self._allowed(window, num_groups, chunk)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            mask.masked_fill_(~allowed, float("-inf"))
            self._masks[key] = mask
        return mask

    def alibi_mask(
        self,
        window: int | None,
        num_groups: int,
        dtype: torch.dtype,
        alibi: Alibi,
        num_kv_heads: int,
        chunk: int | None = None,
    ) -> torch.Tensor:
        """`mask()` plus ALiBi's bias: `[b, KVH, G * q, K]`. Built once per step and key (the
        layers share their slopes)."""
        key = (window, chunk, num_groups, dtype, id(alibi.slopes), alibi.scale)
        mask = self._masks.get(key)
        if mask is None:
            key_pos = torch.arange(self.max_blocks * self.block_size, device=self.query_pos.device)
            bias = alibi.bias(key_pos, num_kv_heads, self.max_query_len, dtype)
            mask = self.mask(window, num_groups, dtype, chunk) + bias
            self._masks[key] = mask
        return mask

    def forget_masks(self) -> None:
        """Drop the cached masks: the group's tensors were rewritten in place."""
        self._masks.clear()
        self._chunked_masks.clear()
        self.token_lengths = self.token_tables = None

    def chunked_mask(
        self, window: int | None, num_groups: int, dtype: torch.dtype, chunk: int | None = None
    ) -> ChunkedMask:
        """The mask of the batch-invariant path: `mask()`'s rows padded to whole blocks of
        rows, cut into key chunks. Built once per step and key."""
        key = (window, chunk, num_groups, dtype)
        mask = self._chunked_masks.get(key)
        if mask is None:
            allowed = self._allowed(window, num_groups, chunk)
            num_rows = allowed.shape[2]
            if num_rows > 1:  # padding rows see every key, like the padding rows of chunks
                extra = invariant_attention.padded_rows(num_rows) - num_rows
                allowed = F.pad(allowed, (0, 0, 0, extra), value=True)
            mask = ChunkedMask.build(allowed, self.chunk_tokens, dtype)
            self._chunked_masks[key] = mask
        return mask

    def _allowed(self, window: int | None, num_groups: int, chunk: int | None) -> torch.Tensor:
        """`chunk`: chunked local attention (Llama 4), a query sees the keys of its own
        chunk of `chunk` positions only."""
        num_keys = self.max_blocks * self.block_size
        key_pos = torch.arange(num_keys, device=self.query_pos.device)
        query_pos = self.query_pos.unsqueeze(-1)  # [b, q, 1]
        limit = query_pos if self.query_limit is None else self.query_limit.unsqueeze(-1)
        allowed = key_pos <= limit  # causal; also hides slots past the context length
        if window is not None:
            allowed &= key_pos > query_pos - window
        if chunk is not None:
            allowed &= key_pos // chunk == query_pos // chunk
        # Padding rows would be fully masked and SDPA gives NaN there: let them attend
        # everything (the pool is zero-filled, so finite) and drop their output.
        b, q, k = allowed.shape
        if q == 1:  # decodes: no padding rows
            return allowed.view(b, 1, 1, k)
        allowed |= ~self.is_real_query.unsqueeze(-1)
        return allowed.unsqueeze(1).expand(b, num_groups, q, k).reshape(b, 1, num_groups * q, k)


@dataclass(eq=False)
class FlashIndices:
    cu_query_lens: torch.Tensor  # [B + 1] int32: query token offsets
    cu_context_lens: torch.Tensor  # [B + 1] int32: key offsets (in the gathered varlen buffer)
    max_query_len: int
    max_context_len: int
    block_table: torch.Tensor | None  # [B, max_blocks] int32, when the pool is read in place
    key_slots: torch.Tensor | None  # [sum(context)] long: pool slots to gather otherwise


@dataclass(eq=False)
class BlockTableIndices:
    """The Triton kernel's view of the step: int32 tensors on the device."""

    query_starts: torch.Tensor  # [B + 1]: sequence i's tokens are [starts[i], starts[i + 1])
    seq_lens: torch.Tensor  # [B]: tokens in the cache after this step
    block_tables: torch.Tensor  # [B, max_blocks], padded with block 0 (never read)


@dataclass(eq=False)
class BatchMetadata:
    """The step's batch layout, built once by the runner and shared by all layers.

    Sequences appear in the flattened batch in list order; the runner puts all single-token
    queries first, longest context first, so they form the cheap decode groups.
    """

    pool: KVCachePool
    # [T] long: pool slot (block * block_size + offset) where each new token's K/V go
    slot_mapping: torch.Tensor
    query_lens: list[int]  # per sequence: tokens computed this step
    context_lens: list[int]  # per sequence: tokens in the cache after this step
    block_tables: list[list[int]]  # per sequence: its blocks, covering context_lens
    device: torch.device
    use_flash: bool = False  # CUDA + flash_attn: the varlen kernel may be used
    use_triton: bool = False  # CUDA + triton: the paged Triton kernel may be used
    # CPU: cpu_decode.py's kernel may attend the decodes (off with
    # --disable-custom-kernels, as the Triton kernel)
    use_cpu_kernel: bool = True
    batch_invariant: bool = False  # the SDPA path's keys in fixed chunks (invariant_attention)
    # [T] per token: the last key position it sees, where some token sees past its own
    # (a span's tokens attend both ways among themselves: Gemma 3's images, PaliGemma's
    # prompt); None: all causal.
    # Only the SDPA path takes it (_pick_kernel).
    key_limits: list[int] | None = None
    _groups: list[AttentionGroup] | None = None
    _flash: FlashIndices | None = None
    _block_table: BlockTableIndices | None = None
    _static_positions: torch.Tensor | None = None  # static_decode's positions (refresh_static)
    # the runner's start-up forward: the layers also compile cpu_decode.py's kernel for
    # their shapes, so that no request's step pays the compile
    warm_up: bool = False

    @classmethod
    def build(
        cls,
        pool: KVCachePool,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        device: torch.device,
        batch_invariant: bool = False,
        custom_kernels: bool = True,
        key_limits: list[int] | None = None,
    ) -> BatchMetadata:
        """custom_kernels=False: never textgen's Triton kernel nor its compiled CPU decode
        kernel (--disable-custom-kernels); key_limits: see the field."""
        slots = _slots(query_lens, context_lens, block_tables, pool.block_size)
        return cls(
            pool=pool,
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True),
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=block_tables,
            device=device,
            use_flash=_flash_available(device),
            use_triton=custom_kernels and triton_available(device),
            use_cpu_kernel=custom_kernels,
            batch_invariant=batch_invariant,
            key_limits=key_limits,
        )

    @classmethod
    def static_decode(
        cls,
        pool: KVCachePool,
        slot_mapping: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> BatchMetadata:
        """A layout of B one-token queries over tensors the caller owns and rewrites in place
        before each step, for CUDA-graph replay (engine/runners/cuda_graphs.py): slot_mapping `[B]`,
        positions `[B]` (each query's position) and block_tables `[B, max_blocks]` (long, on
        the device). Call `refresh_static()` at the start of each forward, inside the graph.

        The SDPA group gathers all `max_blocks` of every row (the causal mask hides the keys
        past a query); the Triton kernel walks only the keys up to the query. flash-attn is
        never picked: its launch takes the longest context as a host integer."""
        num_seqs, max_blocks = block_tables.shape
        device = block_tables.device
        group = AttentionGroup(
            token_start=0,
            token_end=num_seqs,
            num_seqs=num_seqs,
            max_query_len=1,
            max_blocks=max_blocks,
            block_size=pool.block_size,
            block_index=block_tables.view(-1),
            query_pos=positions.view(num_seqs, 1),
            is_real_query=torch.ones(num_seqs, 1, dtype=torch.bool, device=device),
            query_index=None,
            output_index=None,
        )
        int32 = {"dtype": torch.int32, "device": device}
        return cls(
            pool=pool,
            slot_mapping=slot_mapping,
            query_lens=[1] * num_seqs,
            context_lens=[],  # per step on the device only: the tensors carry the layout
            block_tables=[],
            device=device,
            use_flash=False,
            use_triton=triton_available(device),
            _groups=[group],
            _block_table=BlockTableIndices(
                query_starts=torch.arange(num_seqs + 1, **int32),
                seq_lens=torch.ones(num_seqs, **int32),
                block_tables=torch.zeros(num_seqs, max_blocks, **int32),
            ),
            _static_positions=positions,
        )

    def refresh_static(self) -> None:
        """Static metadata (static_decode) after its tensors were rewritten: drop the masks
        built from the old positions (the first layer builds them again) and recompute the
        Triton kernel's int32 lengths and tables from the long ones."""
        if self._static_positions is None:
            raise RuntimeError("refresh_static() is for metadata built by static_decode()")
        group = self._groups[0]
        group.forget_masks()
        if self.use_triton:
            indices = self._block_table
            torch.add(self._static_positions, 1, out=indices.seq_lens)
            indices.block_tables.copy_(group.block_index.view(indices.block_tables.shape))

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.numel()

    def groups(self) -> list[AttentionGroup]:
        """The SDPA groups: the leading single-token queries (split where their contexts
        differ widely), then runs of chunks."""
        if self._groups is None:
            self._groups = self._build_groups()
        return self._groups

    def flash_indices(self) -> FlashIndices:
        if self._flash is None:
            self._flash = _build_flash_indices(self)
        return self._flash

    def block_table_indices(self) -> BlockTableIndices:
        if self._block_table is None:
            self._block_table = _build_block_table_indices(self)
        return self._block_table

    def _build_groups(self) -> list[AttentionGroup]:
        groups, token_start = [], 0
        for first, last in self._group_bounds():
            group = _build_group(
                self.query_lens[first:last],
                self.context_lens[first:last],
                self.block_tables[first:last],
                token_start,
                self.pool.block_size,
                self.device,
                self.batch_invariant,
                self.key_limits,
            )
            groups.append(group)
            token_start = group.token_end
        return groups

    def _group_bounds(self) -> list[tuple[int, int]]:
        """The sequences of each group, `(first, last)`: the leading decodes, then runs of
        chunks that start their sequences (fresh: causal attention needs no mask) and of
        chunks after cached tokens. On the batch-invariant path all chunks form one run (it
        has no fresh path). Each run splits further where its padding would cost more than
        another call (`_split_run`)."""
        query_lens, context_lens = self.query_lens, self.context_lens
        count = len(query_lens)
        # a group pads each sequence to its longest query and its longest context
        block_size = self.pool.block_size
        padded = [q * -(-c // block_size) * block_size for q, c in zip(query_lens, context_lens)]
        first = 0
        while first < count and query_lens[first] == 1:
            first += 1
        bounds = _split_run(padded, 0, first)
        while first < count:
            last = count if self.batch_invariant else first + 1
            fresh = context_lens[first] == query_lens[first]
            while last < count and (context_lens[last] == query_lens[last]) == fresh:
                last += 1
            bounds += _split_run(padded, first, last)
            first = last
        return bounds


def _split_run(padded: list[int], first: int, last: int) -> list[tuple[int, int]]:
    """Cut the run [first, last) of sequences into groups. `padded[i]`: the query-key
    pairs sequence i's rows cover in a group of its own (query length x keys). A group
    pads every member to its largest, so one long conversation among short ones would
    make each short one gather and attend the long one's keys. A new group starts where a
    member's size is SPLIT_RATIO times apart from its group's largest and the pairs that
    saves (on the rest, or on the group so far) reach SPLIT_MIN_PAIRS, about what one more
    gather and SDPA call a layer costs. The runner orders runs largest first, where one
    pass finds the cuts; any order is correct."""
    if first == last:
        return []
    bounds, start, largest = [], first, padded[first]
    for i in range(first + 1, last):
        size = padded[i]
        if size * SPLIT_RATIO <= largest:  # the rest, as small, would pad up to `largest`
            saved = (largest - size) * (last - i)
        elif size >= largest * SPLIT_RATIO:  # the group so far would pad up to `size`
            saved = (size - largest) * (i - start)
        else:
            saved = 0
        if saved >= SPLIT_MIN_PAIRS:
            bounds.append((start, i))
            start, largest = i, size
        else:
            largest = max(largest, size)
    bounds.append((start, last))
    return bounds


def _slots(
    query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int
) -> list[int]:
    """The pool slot of each new token, in batch order: one `range` per block a sequence's
    new tokens touch. Host lists, not tensor ops: a decode step's few dozen slots cost
    microseconds this way, against ~0.1 ms for a dozen tiny tensor ops on a slow CPU."""
    slots: list[int] = []
    for num_new, context_len, table in zip(query_lens, context_lens, block_tables):
        position = context_len - num_new
        while position < context_len:
            block, offset = divmod(position, block_size)
            run = min(block_size - offset, context_len - position)
            first = table[block] * block_size + offset
            slots.extend(range(first, first + run))
            position += run
    return slots


def _pad_tables(block_tables: list[list[int]], multiple: int = 1) -> torch.Tensor:
    """`[B, max_blocks]` long, padded with block 0 (never read unmasked) to a multiple of
    `multiple` blocks."""
    width = -(-max(len(t) for t in block_tables) // multiple) * multiple
    return torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long)


def _build_group(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    token_start: int,
    block_size: int,
    device: torch.device,
    batch_invariant: bool = False,
    key_limits: list[int] | None = None,
) -> AttentionGroup:
    """key_limits: the whole batch's (BatchMetadata.key_limits); they matter to chunks only
    (a decode's token is no image's)."""
    num_seqs, max_q = len(query_lens), max(query_lens)
    chunk_tokens = invariant_attention.chunk_tokens_for(block_size) if batch_invariant else None
    tables = _pad_tables(block_tables, (chunk_tokens or block_size) // block_size)
    if max_q == 1 and num_seqs == 1 and not batch_invariant:  # one stream's decode
        context_len = context_lens[0]
        slots = (tables[0, :, None] * block_size + torch.arange(block_size)).flatten()
        return AttentionGroup(
            token_start=token_start,
            token_end=token_start + 1,
            num_seqs=1,
            max_query_len=1,
            max_blocks=tables.shape[1],
            block_size=block_size,
            block_index=tables.flatten().to(device),
            query_pos=torch.tensor([[context_len - 1]], device=device),
            is_real_query=torch.ones(1, 1, dtype=torch.bool, device=device),
            query_index=None,
            output_index=None,
            context_slots=slots[:context_len].to(device),
        )
    if max_q == 1:  # decodes: each query is its sequence's last position (host lists again)
        return AttentionGroup(
            token_start=token_start,
            token_end=token_start + num_seqs,
            num_seqs=num_seqs,
            max_query_len=1,
            max_blocks=tables.shape[1],
            block_size=block_size,
            block_index=tables.flatten().to(device),
            query_pos=torch.tensor(context_lens).sub_(1).view(num_seqs, 1).to(device),
            is_real_query=torch.ones(num_seqs, 1, dtype=torch.bool, device=device),
            query_index=None,
            output_index=None,
            chunk_tokens=chunk_tokens,
        )
    q_lens = torch.tensor(query_lens)
    row = torch.arange(max_q)
    first_pos = torch.tensor(context_lens) - q_lens
    query_pos = first_pos.unsqueeze(1) + row  # [b, q]
    is_real = row < q_lens.unsqueeze(1)  # [b, q]
    query_index = output_index = None
    if max_q > 1:
        first_token = torch.cumsum(q_lens, 0) - q_lens
        query_index = torch.where(is_real, first_token.unsqueeze(1) + row, 0).flatten().to(device)
        output_index = is_real.flatten().nonzero().squeeze(1).to(device)
    query_limit = None
    if key_limits is not None:
        limits = torch.tensor(key_limits[token_start : token_start + sum(query_lens)])
        rows = torch.where(is_real, first_token.unsqueeze(1) + row, 0)
        query_limit = torch.where(is_real, limits[rows], query_pos).to(device)
    return AttentionGroup(
        token_start=token_start,
        token_end=token_start + sum(query_lens),
        num_seqs=num_seqs,
        max_query_len=max_q,
        max_blocks=tables.shape[1],
        block_size=block_size,
        block_index=tables.flatten().to(device),
        query_pos=query_pos.to(device),
        is_real_query=is_real.to(device),
        query_index=query_index,
        output_index=output_index,
        chunk_tokens=chunk_tokens,
        fresh=not batch_invariant and query_limit is None and context_lens == query_lens,
        query_limit=query_limit,
    )


def _build_flash_indices(meta: BatchMetadata) -> FlashIndices:
    bs = meta.pool.block_size
    q_lens = torch.tensor(meta.query_lens, dtype=torch.int32)
    ctx_lens = torch.tensor(meta.context_lens, dtype=torch.int32)
    cu_q = F.pad(torch.cumsum(q_lens, 0, dtype=torch.int32), (1, 0))
    cu_k = F.pad(torch.cumsum(ctx_lens, 0, dtype=torch.int32), (1, 0))
    tables = _pad_tables(meta.block_tables)
    block_table = key_slots = None
    if bs % FLASH_PAGED_BLOCK_MULTIPLE == 0:
        block_table = tables.to(torch.int32).to(meta.device)
    else:
        seq_of_key = torch.repeat_interleave(torch.arange(len(meta.context_lens)), ctx_lens.long())
        key_pos = torch.arange(int(cu_k[-1])) - cu_k[:-1].long()[seq_of_key]
        key_slots = (tables[seq_of_key, key_pos // bs] * bs + key_pos % bs).to(meta.device)
    return FlashIndices(
        cu_query_lens=cu_q.to(meta.device),
        cu_context_lens=cu_k.to(meta.device),
        max_query_len=max(meta.query_lens),
        max_context_len=max(meta.context_lens),
        block_table=block_table,
        key_slots=key_slots,
    )


def _build_block_table_indices(meta: BatchMetadata) -> BlockTableIndices:
    num_seqs = len(meta.query_lens)
    tables = _pad_tables(meta.block_tables).to(torch.int32)
    starts = F.pad(torch.cumsum(torch.tensor(meta.query_lens, dtype=torch.int32), 0), (1, 0))
    lens = torch.tensor(meta.context_lens, dtype=torch.int32)
    # one host-to-device copy for the three
    packed = torch.cat([starts, lens, tables.flatten()]).to(meta.device, non_blocking=True)
    return BlockTableIndices(
        query_starts=packed[: num_seqs + 1],
        seq_lens=packed[num_seqs + 1 : 2 * num_seqs + 1],
        block_tables=packed[2 * num_seqs + 1 :].view(num_seqs, -1),
    )


# the registered function ---------------------------------------------------------


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query `[1, H, T, D]`, key/value `[1, KVH, T, D]` -> (`[1, T, H, Dv]`, no weights)."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    # The runner passes the step's metadata as a keyword argument and binds it too: some
    # families' decoder layers (StableLM's) call their attention without the keywords
    # the model was given, and those find it bound.
    # attention sinks (gpt-oss: `s_aux`): one logit per head in the softmax's denominator
    sinks: torch.Tensor | None = kwargs.get("s_aux")
    # ALiBi (Bloom, MPT, Falcon-RW; their adapters, models/attention_adapters.py)
    alibi_slopes: torch.Tensor | None = kwargs.get("alibi_slopes")
    alibi_scale: float = kwargs.get("alibi_scale", 1.0)
    # chunked local attention (Llama 4's adapter): the query's own chunk of positions
    chunk: int | None = kwargs.get("attention_chunk_size")
    meta: BatchMetadata | None = kwargs.get(METADATA_KWARG)
    if meta is None and not torch.compiler.is_compiling():
        meta = _bound_metadata.get()
    if meta is None and torch.compiler.is_compiling():
        # a compiled decode step: the metadata comes through bound_metadata(), not the graph
        out = torch.ops.textgen.paged_attention(
            query,
            key,
            value,
            module.layer_idx,
            scaling,
            sliding_window or 0,
            softcap or 0.0,
            sinks,
            alibi_slopes,
            alibi_scale,
            chunk or 0,
        )
        return out, None
    if meta is None:
        raise RuntimeError(
            f"attention '{ATTENTION_NAME}' was called without '{METADATA_KWARG}': this model "
            "belongs to a PagedCore and can only run through its ModelRunner"
        )
    alibi = None if alibi_slopes is None else Alibi(alibi_slopes, alibi_scale)
    return _paged_attention(
        meta,
        module.layer_idx,
        query,
        key,
        value,
        scaling,
        sliding_window,
        softcap,
        sinks,
        alibi,
        chunk,
    ), None


def _paged_attention(
    meta: BatchMetadata,
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    alibi: Alibi | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    if query.shape[0] != 1 or query.shape[2] != meta.num_tokens:
        raise ValueError(
            f"expected one flattened batch of {meta.num_tokens} tokens, got {tuple(query.shape)}"
        )
    cache = meta.pool.layer(layer_idx, key, value)
    decodes = _in_place_decodes(meta, query, key, value, cache, alibi, chunk)
    if decodes is not None:  # most CPU decode steps: the K/V write and attention in one call
        return _write_and_attend_in_place(
            layer_idx, query, key, value, cache, meta, decodes, scaling, window, softcap, sinks
        )
    cache = meta.pool.write(layer_idx, key, value, meta.slot_mapping)
    extra_terms = sinks is not None or alibi is not None or bool(chunk)
    attend = _pick_kernel(meta, query, cache, extra_terms)
    warm_up = meta.warm_up and attend is _sdpa_attention and not meta.batch_invariant
    if warm_up and _in_place_layer(meta, query, cache, alibi, chunk):
        _warm_up_in_place(query, cache, scaling)
    if not extra_terms:
        return attend(query, cache, meta, scaling, window, softcap)
    # Triton or SDPA: flash-attn has no sinks, ALiBi slopes or chunks (_pick_kernel)
    return attend(query, cache, meta, scaling, window, softcap, sinks, alibi, chunk)


# compiled decode steps (runners/compiled.py): the attention as one opaque op -----------------

# The step's BatchMetadata while a forward runs. A compiled forward reads it only here:
# block tables and context lengths change every step, and as graph inputs they would make
# torch.compile recompile.
_bound_metadata: contextvars.ContextVar[BatchMetadata | None] = contextvars.ContextVar(
    "textgen_bound_metadata", default=None
)


@contextlib.contextmanager
def bound_metadata(meta: BatchMetadata) -> Iterator[None]:
    """Hand `meta` to every `textgen::paged_attention` op run inside the block."""
    token = _bound_metadata.set(meta)
    try:
        yield
    finally:
        _bound_metadata.reset(token)


@contextlib.contextmanager
def in_place_decode_step(meta: BatchMetadata) -> Iterator[None]:
    """Around a compiled step (inside bound_metadata): when it is a CPU step of decodes only
    that cpu_decode.py's kernel takes, hand its layout to the op's C++ kernel, so that its
    layers attend with no Python (cpu_decode.begin_step); else nothing."""
    group = _in_place_step_group(meta)
    if group is None:
        yield
        return
    tables, lengths = _token_rows(group)
    cpu_decode.begin_step(meta.pool, meta.slot_mapping, tables, lengths, meta.pool.block_size)
    try:
        yield
    finally:
        cpu_decode.end_step()


def _in_place_step_group(meta: BatchMetadata) -> AttentionGroup | None:
    """The step's one group when the op's C++ kernel may take its layers (those a layer's
    own checks let through: _in_place_decodes): decodes, or verifications."""
    cpu_step = meta.device.type == "cpu" and meta.use_cpu_kernel and cpu_decode.ENABLED
    return _kernel_group(meta) if cpu_step and cpu_decode.load_op() else None


# Opaque to the compiler, so one graph covers any context length. It writes the layer's K/V
# pool, state the compiler can't see: safe because nothing else in the graph reads the pools
# and each layer's call depends on the previous layer's output, which fixes their order.
# Its Python implementation serves every device; on CPU, once cpu_decode.load_op() has
# registered the C++ kernel (cpu_decode_op.cpp), that kernel takes the op's calls and passes
# those it doesn't attend to `textgen::paged_attention_general`, the same Python.
_OP_SCHEMA = (
    "(Tensor query, Tensor key, Tensor value, int layer_idx, float scaling, int window, "
    "float softcap, Tensor? sinks, Tensor? alibi_slopes, float alibi_scale, int chunk) -> Tensor"
)
_op_library = torch.library.Library("textgen", "FRAGMENT")


def _paged_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    scaling: float,
    window: int,
    softcap: float,
    sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    alibi_scale: float,
    chunk: int,
) -> torch.Tensor:
    """paged_attention_forward's output `[1, T, H, Dv]` (contiguous) under the metadata
    bound by bound_metadata(); window 0, softcap 0.0 and chunk 0 mean none."""
    meta = _bound_metadata.get()
    if meta is None:
        raise RuntimeError("textgen::paged_attention ran outside bound_metadata()")
    alibi = None if alibi_slopes is None else Alibi(alibi_slopes, alibi_scale)
    out = _paged_attention(
        meta,
        layer_idx,
        query,
        key,
        value,
        scaling,
        window or None,
        softcap or None,
        sinks,
        alibi,
        chunk or None,
    )
    # the compiled graph assumes the fake's contiguous layout below
    return out.contiguous()


def _paged_attention_fake(
    query, key, value, layer_idx, scaling, window, softcap, sinks, alibi_slopes, alibi_scale, chunk
):
    _, num_heads, num_tokens, _ = query.shape
    return query.new_empty(1, num_tokens, num_heads, value.shape[-1])


for _name in ("paged_attention", "paged_attention_general"):
    _op_library.define(_name + _OP_SCHEMA)
    _op_library.impl(_name, _paged_attention_op, "CompositeExplicitAutograd")
    torch.library.register_fake(f"textgen::{_name}", _paged_attention_fake, lib=_op_library)


def _pick_kernel(
    meta: BatchMetadata, query: torch.Tensor, cache: LayerCache, extra_terms: bool = False
) -> Callable[..., torch.Tensor]:
    """The first kernel, in this order, that the device has and that takes this layer:

    1. flash-attn when the pool's blocks are a multiple of 256 tokens: it then reads the pool
       in place too, and it is the more tuned kernel;
    2. Triton, which reads the pool in place at any block size (flash-attn would gather the
       step's K/V into a copy first: ~3x the KV traffic, which bounds decode);
    3. flash-attn over the gathered K/V (no triton, or shapes the Triton kernel refuses);
    4. SDPA over gathered blocks: the CPU path, and CUDA's last resort.

    extra_terms: the layer has attention sinks, ALiBi or chunked local attention, which
    Triton and SDPA compute and flash-attn doesn't (the picked kernel then takes them as
    three more arguments). Steps with key_limits (a span attended both ways) take SDPA:
    only its masks read them.
    """
    if meta.key_limits is not None:
        return _sdpa_attention
    flash = not extra_terms and meta.use_flash and _flash_supports(query, cache)
    if flash and meta.pool.block_size % FLASH_PAGED_BLOCK_MULTIPLE == 0:
        return _flash_attention
    triton_kernels = meta.use_triton and _triton_module()
    if triton_kernels and triton_kernels.supports(_tokens_first(query), cache.keys, cache.values):
        return _triton_attention
    if flash:
        return _flash_attention
    return _sdpa_attention


# CPU path: SDPA over gathered blocks ---------------------------------------------


def _sdpa_attention(
    query: torch.Tensor,
    cache: LayerCache,
    meta: BatchMetadata,
    scaling: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    alibi: Alibi | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    groups = meta.groups()  # the decodes, then runs of fresh chunks and of later ones
    terms = (scaling, window, softcap, sinks, alibi, chunk)
    in_place = _in_place_layer(meta, query, cache, alibi, chunk)
    kernel_terms = (scaling, window, softcap, sinks)
    # plain causal chunks through cpu_prefill.py's kernel where it takes them (_attend_chunks)
    prefill_kernel = meta.use_cpu_kernel and not meta.batch_invariant
    if len(groups) == 1:  # most steps (all decodes, or all chunks): no slice, no cat
        group = groups[0]
        if in_place and _in_place_takes(group):
            return _attend_in_place(query[0], cache, group, *kernel_terms)[None]
        if group.context_slots is not None:
            return _attend_single(query, cache, group, *terms)
        if group.max_query_len == 1:
            return _attend_decodes(query[0], cache, group, *terms)[None]
        return _attend_chunks(query[0], cache, group, *terms, prefill_kernel)[None]
    outputs = []
    for group in groups:
        rows = query[0, :, group.token_start : group.token_end]  # [H, Tg, D]
        if in_place and _in_place_takes(group):
            outputs.append(_attend_in_place(rows, cache, group, *kernel_terms))
        elif group.context_slots is not None:  # one decode beside chunks
            rows = query[:, :, group.token_start : group.token_end]
            outputs.append(_attend_single(rows, cache, group, *terms)[0])
        elif group.max_query_len == 1:
            outputs.append(_attend_decodes(rows, cache, group, *terms))
        else:
            outputs.append(_attend_chunks(rows, cache, group, *terms, prefill_kernel))
    return torch.cat(outputs)[None]  # [1, T, H, Dv]


def _in_place_layer(
    meta: BatchMetadata,
    query: torch.Tensor,
    cache: LayerCache,
    alibi: Alibi | None,
    chunk: int | None,
) -> bool:
    """Whether cpu_decode.py's kernel may attend this layer's groups: on, on CPU, query and
    pools of one dtype it takes; windows, soft-capping and sinks it computes, ALiBi and
    chunked local attention it doesn't."""
    return (
        cpu_decode.ENABLED
        and meta.use_cpu_kernel
        and alibi is None
        and not chunk
        and query.device.type == "cpu"
        and query.dtype == cache.keys.dtype == cache.values.dtype
        and cpu_decode.takes(query.dtype)
    )


def _in_place_takes(group: AttentionGroup) -> bool:
    """Whether the kernel attends this group of a layer it may attend (_in_place_layer):
    up to cpu_decode.MAX_QUERY query tokens a sequence (decodes, verifications), all
    causal, not batch-invariant."""
    return (
        group.max_query_len <= cpu_decode.MAX_QUERY
        and group.query_limit is None
        and group.chunk_tokens is None
    )


def _in_place_decodes(
    meta: BatchMetadata,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: LayerCache,
    alibi: Alibi | None,
    chunk: int | None,
) -> AttentionGroup | None:
    """The step's one group when cpu_decode.py's kernel may store this layer's new K/V and
    attend them in one call: a step of one group of up to cpu_decode.MAX_QUERY query tokens
    a sequence (decodes, verifications), causal, on a layer the kernel takes, with new K/V
    of the pools' dtype."""
    stored_as_given = key.dtype == value.dtype == cache.keys.dtype and meta.pool.kernel_may_write
    if not stored_as_given or not _in_place_layer(meta, query, cache, alibi, chunk):
        return None
    return _kernel_group(meta)


def _kernel_group(meta: BatchMetadata) -> AttentionGroup | None:
    """The step's group when it is the only one and cpu_decode.py's kernel takes it whole
    (_in_place_takes), all causal."""
    if meta.key_limits is not None:
        return None
    groups = meta.groups()
    return groups[0] if len(groups) == 1 and _in_place_takes(groups[0]) else None


def _write_and_attend_in_place(
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: LayerCache,
    meta: BatchMetadata,
    group: AttentionGroup,
    scaling: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """A step's layer through cpu_decode.attend, storing its K/V too: query `[1, H, T, D]` and new
    key/value `[1, KVH, T, D]` -> `[1, T, H, Dv]`, the K/V stored at the step's slots by the
    kernel itself (no index_copy_ around it: on a one-stream step the per-layer host work is
    most of the attention's cost). Each token is a row of its own, attending its sequence's
    keys up to its position: the step's later tokens, stored in the same call, stay
    unseen."""
    _, num_heads, num_rows, head_dim = query.shape
    num_kv_heads = key.shape[1]
    # token-major, as the projections laid them out (no copy then)
    rows = (
        query[0]
        .transpose(0, 1)
        .reshape(num_rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
    )
    tables, lengths = _token_rows(group)
    if cpu_decode.step_active():  # a compiled step's op: C++ takes this layer from now on
        cpu_decode.register_layer(layer_idx, rows, cache.keys, cache.values)
    new = (meta.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))
    out = cpu_decode.attend(
        rows, cache.keys, cache.values, tables, lengths, scaling, window, softcap, sinks, new
    )
    return out.view(1, num_rows, num_heads, out.shape[-1])


def _token_rows(group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's query tokens as cpu_decode.py's rows: each its sequence's block table
    and its own position + 1 as the length. Built once a step, for all layers."""
    if group.token_lengths is None:
        tables = group.block_index.view(group.num_seqs, group.max_blocks)
        if group.max_query_len == 1:
            group.token_lengths, group.token_tables = (group.query_pos + 1).view(-1), tables
        else:  # the real ones of the padded [b, q] rows, in token order
            real = group.is_real_query
            group.token_lengths = (group.query_pos + 1)[real]
            group.token_tables = tables.repeat_interleave(real.sum(1), 0)
    return group.token_tables, group.token_lengths


def _warm_up_in_place(query: torch.Tensor, cache: LayerCache, scaling: float) -> None:
    """Compile cpu_decode.py's kernel for this layer's kind (head shapes, block size and
    dtype) and run it once over block 0."""
    num_heads, head_dim = query.shape[1], query.shape[3]
    num_kv_heads = cache.keys.shape[2]
    rows = query.new_zeros(1, num_kv_heads, num_heads // num_kv_heads, head_dim)
    tables = torch.zeros(1, 1, dtype=torch.long, device=query.device)
    lengths = torch.ones(1, dtype=torch.long, device=query.device)
    cpu_decode.attend(rows, cache.keys, cache.values, tables, lengths, scaling)


def _attend_in_place(
    query: torch.Tensor,
    cache: LayerCache,
    group: AttentionGroup,
    scaling: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The group through cpu_decode.py, reading the pool in place: query `[H, Tg, D]` ->
    `[Tg, H, Dv]`. Each query token is attended as a decode of its own (its context: the
    keys up to its position), so a sequence's few query tokens (a verification) read its
    context once each."""
    num_heads, num_rows, head_dim = query.shape
    num_kv_heads = cache.keys.shape[2]
    rows = query.transpose(0, 1).reshape(
        num_rows, num_kv_heads, num_heads // num_kv_heads, head_dim
    )
    tables, lengths = _token_rows(group)
    out = cpu_decode.attend(
        rows, cache.keys, cache.values, tables, lengths, scaling, window, softcap, sinks
    )
    return out.reshape(num_rows, num_heads, out.shape[-1])


def _attend_single(
    query: torch.Tensor,
    cache: LayerCache,
    group: AttentionGroup,
    scaling: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    alibi: Alibi | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """One sequence decoding, alone in the step (one stream): query `[1, H, 1, D]` ->
    `[1, 1, H, Dv]`. Its keys are gathered by slot, only those it sees, and attended with no
    mask: as few ops a layer as plain transformers' decode with its contiguous cache (a
    layer's Python and dispatch, ~20 ops, weighed on one stream's step)."""
    _, num_heads, _, head_dim = query.shape
    num_kv_heads = cache.key_rows.shape[2]
    slots = group.context_slots
    if chunk:  # a chunked layer sees the keys of the query's chunk: position // chunk
        slots = slots[-((slots.shape[0] - 1) % chunk + 1) :]
    if window and slots.shape[0] > window:  # a sliding layer sees its last `window` keys
        slots = slots[-window:]
    # [1, KVH, n, D], an 8-bit pool's widened
    keys = read_slots(cache.key_rows, slots, cache.keys.dtype, query.dtype).transpose(1, 2)
    values = read_slots(cache.value_rows, slots, cache.values.dtype, query.dtype).transpose(1, 2)
    # GQA fold: [1, KVH, G, D], the G query heads of a KV head as G rows
    rows = query.view(1, num_kv_heads, num_heads // num_kv_heads, head_dim)
    bias = None
    if alibi is not None:  # the keys are the query's last len(slots) positions
        last = group.query_pos[0, 0]
        key_pos = torch.arange(slots.shape[0], device=slots.device) + (last + 1 - slots.shape[0])
        bias = alibi.bias(key_pos, num_kv_heads, 1, query.dtype)
    out = _attend(rows, keys, values, bias, scaling, softcap, _sink_rows(sinks, num_kv_heads, 1))
    return out.reshape(1, 1, num_heads, out.shape[-1])


def _attend_decodes(
    query: torch.Tensor,
    cache: LayerCache,
    group: AttentionGroup,
    scaling: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    alibi: Alibi | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """One query token per sequence: query `[H, b, D]` -> `[b, H, Dv]`."""
    num_heads, b, head_dim = query.shape
    num_kv_heads = cache.keys.shape[2]
    # GQA fold: the G query heads sharing a KV head become G query rows,
    # [b, KVH, G, D]; several times faster on CPU than SDPA's enable_gqa.
    rows = query.transpose(0, 1).reshape(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
    # the mask has one row per sequence: it broadcasts over the G rows
    sink_rows = _sink_rows(sinks, num_kv_heads, 1)
    out = _attend_rows(rows, cache, group, 1, scaling, window, softcap, sink_rows, alibi, chunk)
    return out.reshape(b, num_heads, out.shape[-1])


def _attend_chunks(
    query: torch.Tensor,
    cache: LayerCache,
    group: AttentionGroup,
    scaling: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    alibi: Alibi | None = None,
    chunk: int | None = None,
    prefill_kernel: bool = False,
) -> torch.Tensor:
    """Multi-token chunks padded to q rows each: query `[H, Tg, D]` -> `[Tg, H, Dv]`;
    `prefill_kernel`: plain causal chunks may take cpu_prefill.py's kernel."""
    num_heads, _, head_dim = query.shape
    causal = not softcap and sinks is None and alibi is None and group.query_limit is None
    fresh = group.fresh and causal
    span = min(window or group.max_query_len, chunk or group.max_query_len)
    # no window or local chunk reaching back past a row's own chunk: plain causal rows
    whole = group.max_query_len <= span if group.fresh else window is None and not chunk
    if prefill_kernel and causal and whole and group.chunk_tokens is None:
        out = _attend_prefill_kernel(query, cache, group, scaling)
        if out is not None:
            return out
    if fresh and group.max_query_len <= span:
        return _attend_fresh(query, cache, group, scaling)
    num_kv_heads = cache.keys.shape[2]
    num_groups = num_heads // num_kv_heads
    b, q = group.num_seqs, group.max_query_len
    rows = query.index_select(1, group.query_index)  # [H, b * q, D]
    # GQA fold: [KVH, G, b, q, D] -> [b, KVH, G * q, D]
    rows = rows.view(num_kv_heads, num_groups, b, q, head_dim).permute(2, 0, 1, 3, 4)
    rows = rows.reshape(b, num_kv_heads, num_groups * q, head_dim)
    sink_rows = _sink_rows(sinks, num_kv_heads, q)
    out = _attend_rows(
        rows, cache, group, num_groups, scaling, window, softcap, sink_rows, alibi, chunk
    )
    v_dim = out.shape[-1]
    out = out.view(b, num_kv_heads, num_groups, q, v_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(b * q, num_heads, v_dim).index_select(0, group.output_index)


def _attend_prefill_kernel(
    query: torch.Tensor, cache: LayerCache, group: AttentionGroup, scaling: float
) -> torch.Tensor | None:
    """Plain causal chunks (each row over its sequence's keys up to its position) through
    cpu_prefill.py's kernel: query `[H, Tg, D]` -> `[Tg, H, Dv]`; None where it doesn't take
    them (not bfloat16 on a CPU with AVX512-BF16, head sizes), decided before any gather:
    2.3-2.7x SDPA's causal attention at 1-2k tokens here."""
    if not cpu_prefill.takes(query, cache.values.shape[-1]):
        return None
    num_heads, _, head_dim = query.shape
    b, q = group.num_seqs, group.max_query_len
    rows = query.index_select(1, group.query_index).view(num_heads, b, q, head_dim)
    rows = rows.transpose(0, 1)  # [b, H, q, D]
    keys, values = (
        _gather(cache.keys, group, query.dtype),
        _gather(cache.values, group, query.dtype),
    )
    out = cpu_prefill.attend(rows, keys, values, group.query_pos, scaling)  # [b, q, H, Dv]
    return out.view(b * q, num_heads, -1).index_select(0, group.output_index)


def _attend_fresh(
    query: torch.Tensor, cache: LayerCache, group: AttentionGroup, scaling: float
) -> torch.Tensor:
    """Chunks that each start their sequence, no window reaching back past a chunk's start:
    query `[H, Tg, D]` -> `[Tg, H, Dv]` through SDPA's is_causal, which needs no mask and
    skips the masked half of the scores (on CPU ~2x faster than a mask at 3000 tokens,
    1.4x at 1000). A padded row of a short chunk attends keys past its sequence's end,
    which only padding rows (dropped) can see."""
    num_heads, _, head_dim = query.shape
    b, q = group.num_seqs, group.max_query_len
    rows = query.index_select(1, group.query_index).view(num_heads, b, q, head_dim)
    keys, values = (
        _gather(cache.keys, group, query.dtype),
        _gather(cache.values, group, query.dtype),
    )
    out = F.scaled_dot_product_attention(
        rows.transpose(0, 1),  # [b, H, q, D]
        keys[:, :, :q],
        values[:, :, :q],
        is_causal=True,
        scale=scaling,
        enable_gqa=True,
    )
    return out.transpose(1, 2).reshape(b * q, num_heads, -1).index_select(0, group.output_index)


def _attend_rows(
    rows: torch.Tensor,
    cache: LayerCache,
    group: AttentionGroup,
    mask_groups: int,
    scaling: float,
    window: int | None,
    softcap: float | None,
    sink_rows: torch.Tensor | None = None,
    alibi: Alibi | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Query rows `[b, KVH, R, D]` over each sequence's cached K/V -> `[b, KVH, R, Dv]`;
    `mask_groups`: the query heads per mask row (1: one mask row for all R rows)."""
    keys, values = _gather(cache.keys, group, rows.dtype), _gather(cache.values, group, rows.dtype)
    if group.chunk_tokens is None:
        if alibi is None:
            mask = group.mask(window, mask_groups, rows.dtype, chunk)
        else:
            mask = group.alibi_mask(window, mask_groups, rows.dtype, alibi, rows.shape[1], chunk)
        return _attend(rows, keys, values, mask, scaling, softcap, sink_rows)
    if sink_rows is not None or alibi is not None:
        raise ValueError("attention sinks and ALiBi have no batch-invariant path (--deterministic)")
    mask = group.chunked_mask(window, mask_groups, rows.dtype, chunk)
    return invariant_attention.attend(rows, keys, values, mask, scaling, softcap)


def _gather(pool: torch.Tensor, group: AttentionGroup, dtype: torch.dtype) -> torch.Tensor:
    """The group's cached states `[b, KVH, nb * block_size, D]` in `dtype` (an 8-bit pool's
    widened), key j at position j; on the batch-invariant path cut into chunks,
    `[b * nc, KVH, chunk_tokens, D]`."""
    num_heads, head_dim = pool.shape[2], pool.shape[3]
    blocks = read_blocks(pool, group.block_index, dtype)  # [b * nb, bs, KVH, D]
    num_rows = group.num_seqs if group.chunk_tokens is None else -1
    return blocks.view(num_rows, group.chunk_tokens or -1, num_heads, head_dim).transpose(1, 2)


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None,
    sink_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """`sink_rows`: each query row's sink logit, `[1, KVH, R, 1]` (_sink_rows)."""
    if not softcap and sink_rows is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling)
    # SDPA has neither logit soft-capping (Gemma2) nor sinks (gpt-oss): the eager formula,
    # softmax in float32.
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask
    if sink_rows is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
        return torch.matmul(probs, values)
    # the sink is one more logit in each row's denominator, with no value: softmax over
    # [scores, sink], the sink's column dropped
    sink = sink_rows.to(scores.dtype).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)
    return torch.matmul(probs[..., :-1].to(values.dtype), values)


def _sink_rows(
    sinks: torch.Tensor | None, num_kv_heads: int, query_len: int
) -> torch.Tensor | None:
    """Per-head sinks `[H]` laid out as the GQA-folded query rows, `[1, KVH, G * q, 1]`: the
    G query heads of each KV head, each repeated for its q query positions."""
    if sinks is None:
        return None
    groups = sinks.shape[0] // num_kv_heads
    rows = sinks.view(num_kv_heads, groups, 1).expand(num_kv_heads, groups, query_len)
    return rows.reshape(1, num_kv_heads, groups * query_len, 1)


# CUDA path: Triton over the pool in place ------------------------------------------


@functools.cache
def _triton_module() -> ModuleType | None:
    """triton_kernel.py, imported on first use: CPU processes never import triton."""
    try:
        from . import triton_kernel as triton_attention
    except ImportError:  # pragma: no cover - depends on the install
        return None
    return triton_attention


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernel runs on `device` (CUDA, triton importable)."""
    return device.type == "cuda" and _triton_module() is not None


def _tokens_first(query: torch.Tensor) -> torch.Tensor:
    """`[1, H, T, D]` -> `[T, H, D]`, a view: the kernel takes strides."""
    return query[0].transpose(0, 1)


def _triton_attention(
    query: torch.Tensor,
    cache: LayerCache,
    meta: BatchMetadata,
    scaling: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    alibi: Alibi | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """The layer through triton_kernel.py; its ALiBi bias is float32 past the slopes' product
    (see `paged_attention`: in half precision the SDPA path rounds it to the query's dtype)."""
    idx = meta.block_table_indices()
    out = _triton_module().paged_attention(
        _tokens_first(query),
        cache.keys,
        cache.values,
        idx.query_starts,
        idx.seq_lens,
        idx.block_tables,
        scale=scaling,
        window=window,
        softcap=softcap,
        sinks=sinks,
        alibi_slopes=None if alibi is None else alibi.slopes,
        alibi_scale=1.0 if alibi is None else alibi.scale,
        chunk=chunk,
    )
    return out.unsqueeze(0)  # [1, T, H, Dv]


# CUDA path: flash-attn varlen ------------------------------------------------------


def _flash_available(device: torch.device) -> bool:
    return device.type == "cuda" and flash_attn_varlen_func is not None


def _flash_supports(query: torch.Tensor, cache: LayerCache) -> bool:
    """flash-attn 2 reads K/V of the query's dtype only (not an 8-bit pool)."""
    return (
        query.dtype in (torch.float16, torch.bfloat16)
        and cache.keys.dtype == query.dtype
        and cache.keys.shape[-1] == cache.values.shape[-1] == query.shape[-1]
        and query.shape[-1] <= 256
    )


def _flash_attention(
    query: torch.Tensor,
    cache: LayerCache,
    meta: BatchMetadata,
    scaling: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    idx = meta.flash_indices()
    if idx.block_table is not None:
        keys, values = cache.keys, cache.values
    else:
        keys = cache.key_slots.index_select(0, idx.key_slots)  # [sum(context), KVH, D]
        values = cache.value_slots.index_select(0, idx.key_slots)
    out = flash_attn_varlen_func(
        query[0].transpose(0, 1).contiguous(),  # [T, H, D]
        keys,
        values,
        idx.cu_query_lens,
        idx.cu_context_lens,
        idx.max_query_len,
        idx.max_context_len,
        softmax_scale=scaling,
        causal=True,  # bottom-right aligned: queries are the last tokens of each context
        window_size=(window - 1, 0) if window else (-1, -1),  # k_pos > q_pos - window
        softcap=softcap or 0.0,
        block_table=idx.block_table,
    )
    return out.unsqueeze(0)  # [1, T, H, D]
