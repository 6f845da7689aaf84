"""The paged KV cache's bookkeeping, in pure Python (the scheduler's view: no tensors):
the free list, ref counts, block tables (on the sequences) and the prefix cache.

A block holds `block_size` consecutive positions of one sequence; the tensors behind the
block ids are kv_pool.py's.

Prefix caching: once a block is full of computed tokens it gets a hash chained over the
previous block's hash and its own token ids, so equal hashes mean equal prefixes. The chain
starts from the sequence's LoRA adapter (its uid; nothing for the base model): K/V
computed under one adapter never serve another. A vision-language request's images salt
the chain where they start (their content hashes), and a span of tokens attended both ways
where it starts (its tokens: their K/V depend on the span's later ones). A new
sequence whose leading full blocks hash to cached blocks shares them (ref count) instead of
recomputing them. A block whose ref count drops to zero goes back to the free list but keeps
its hash, so it is still reusable until the allocator evicts it (LRU over free blocks).

Forks: the choices of an n > 1 request share every block of the computed prompt (ref
counts), the last, partly filled one included; the first write into a shared partial
block copies it to a block of the writer's own (copy-on-write: `append_slots` hands the
copy to the runner through `take_copies`).

Sliding windows (`sliding_window` = W, when every attention layer of the model slides): a
query at position p reads only the keys at positions > p - W, so once a sequence's next
query is at q (its `num_computed_tokens`: every later query, of a prefill chunk, a decode or
a speculative proposal, is at q or after, and a rejected proposal never takes q back), the
blocks whose positions all lie at or before q - W are never read again.
`release_out_of_window` hands them back (to the free list, keeping their hashes, as when a
sequence finishes) and leaves `placeholder` in their entries: tables stay position-indexed,
and the attention reads a placeholder's slots only under its window mask (the block id past
the manager's, the KV pool's scratch block: paged_core.build_runner gives every pool one;
its values are finite, zeros or padding rows' K/V). Released entries are always a prefix of
the table. A sequence then holds at most `window_blocks(step)` blocks at once.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from .sequence import Sequence


def num_blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)


def num_blocks_for_choices(
    num_prompt_tokens: int, max_new_tokens: int, n: int, block_size: int
) -> int:
    """Blocks a request's n choices hold when all run to max_new_tokens at once: the
    prompt's full blocks once (shared), then each choice's own from the partial one on."""
    shared = num_prompt_tokens // block_size
    total = num_blocks_for_tokens(num_prompt_tokens + max_new_tokens, block_size)
    return shared + n * (total - shared)


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0  # sequences holding it; 0: on the free list
    block_hash: bytes | None = None  # set once full and registered in the prefix cache


class BlockManager:
    """Free list, ref counts, block tables (on the sequences) and the prefix cache."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        """sliding_window: every attention layer reads only this many last positions: the
        blocks before a sequence's window are released while it runs (None: kept)."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}"
            )
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        # what a released table entry points at: no block of ours (never freed, hashed or
        # counted), the pool's scratch block, which the attention reads only masked
        self.placeholder = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free block ids in eviction order (front first). Blocks that hold nothing reusable
        # go to the front; cached ones to the back, so the least recently freed cached block
        # is the one evicted.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        # hashes of each running sequence's full, computed blocks, in block order
        self._seq_hashes: dict[Sequence, list[bytes]] = {}
        self.prefix_hit_tokens = 0  # prompt tokens served from the prefix cache, cumulative
        self.prefix_queried_tokens = 0  # prompt tokens looked up in it, cumulative
        self.window_released_blocks = 0  # given back out of a window (release_out_of_window)
        # (source, destination) block copies made by append_slots, for the runner to do
        # before the step's forward (take_copies)
        self._copies: list[tuple[int, int]] = []

    # counts ------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds, including cached ones (evictable)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self._free if self.blocks[b].block_hash is not None)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks `seq` needs to hold `num_new_tokens` more computed tokens (with
        the copy of a shared partial block it writes into)."""
        total = seq.num_computed_tokens + num_new_tokens
        fresh = max(0, num_blocks_for_tokens(total, self.block_size) - len(seq.block_table))
        return fresh + (num_new_tokens > 0 and self._shares_partial_tail(seq))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self._free)

    def num_fitting_tokens(self, seq: Sequence, max_tokens: int) -> int:
        """How many of `max_tokens` new tokens fit in seq's last block plus the free blocks."""
        usable = len(seq.block_table) + len(self._free) - self._shares_partial_tail(seq)
        capacity = usable * self.block_size - seq.num_computed_tokens
        return max(0, min(max_tokens, capacity))

    def window_blocks(self, step_tokens: int) -> int | None:
        """The most blocks a sequence holds at once under the sliding window, when a step
        computes up to `step_tokens` of its tokens: those of positions [q - W + 1, q +
        step_tokens), at worst alignment (None: no window, it holds its whole context)."""
        if self.sliding_window is None:
            return None
        span = self.sliding_window - 1 + max(1, step_tokens)
        return (span - 1 + self.block_size - 1) // self.block_size + 1

    # prefix cache ------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached block ids for the longest run of seq's leading full blocks. No side effects.

        Only blocks within the first `num_tokens - 1` tokens count: the last token is always
        computed so that the step yields logits, and it must not land in a shared block.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent = _chain_start(seq)
        num_blocks = (seq.num_tokens - 1) // self.block_size
        for index, tokens in enumerate(self._full_blocks(seq.token_ids, num_blocks)):
            parent = _block_hash(self._salted(seq, index, parent), tokens)
            block_id = self._cached.get(parent)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def num_free_among(self, block_ids: list[int]) -> int:
        """How many of these prefix-hit blocks are free (acquiring them takes them off the list)."""
        return sum(1 for b in block_ids if self.blocks[b].ref_count == 0)

    # allocation --------------------------------------------------------------

    def allocate(self, seq: Sequence, prefix_hits: list[int] | None = None) -> int:
        """Admit `seq`: share its prefix-hit blocks (from `match_prefix`; None: the cache
        was not consulted) and mark their tokens computed.

        Returns the number of cached tokens. The blocks for the tokens to compute come
        from `append_slots`.
        """
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.request_id} already holds blocks")
        hits = prefix_hits or []
        for block_id in hits:
            self._acquire(block_id)
        seq.block_table = list(hits)
        cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = cached_tokens
        if seq.num_preemptions == 0:  # what the request found; a recompute's hits aren't
            seq.num_cached_prompt_tokens = cached_tokens
        self._seq_hashes[seq] = [self.blocks[b].block_hash for b in hits]  # type: ignore[misc]
        if self.enable_prefix_caching and prefix_hits is not None:
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += cached_tokens
        return cached_tokens

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give `seq` the blocks for `num_new_tokens` more tokens; a shared partial block
        they would write into is first copied to one of its own."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"KV cache out of blocks: need {needed}, have {len(self._free)}")
        if num_new_tokens > 0 and self._shares_partial_tail(seq):
            index = seq.num_computed_tokens // self.block_size
            shared = seq.block_table[index]
            self.blocks[shared].ref_count -= 1  # > 0: another sequence still holds it
            seq.block_table[index] = self._allocate_fresh()
            self._copies.append((shared, seq.block_table[index]))
            needed -= 1
        for _ in range(needed):
            seq.block_table.append(self._allocate_fresh())

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` (a choice of the same request, holding no blocks) shares every block of
        `parent`'s computed tokens and their prefix-cache hashes."""
        if child.block_table:
            raise RuntimeError(f"sequence {child.request_id} already holds blocks")
        for block_id in parent.block_table:
            if block_id != self.placeholder:  # released by parent: nothing to share
                self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_prompt_tokens = parent.num_cached_prompt_tokens
        self._seq_hashes[child] = list(self._seq_hashes.get(parent, []))

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies made since the last call: the runner
        copies their K/V before the forward that writes into the destinations."""
        copies, self._copies = self._copies, []
        return copies

    def free(self, seq: Sequence) -> None:
        """Return all of seq's blocks. Tail blocks are freed first so that, among equally
        old blocks, a prompt's head (the part other requests share) is evicted last."""
        for block_id in reversed(seq.block_table):
            if block_id == self.placeholder:  # released already (release_out_of_window)
                break
            self._release(block_id)
        seq.block_table = []
        self._seq_hashes.pop(seq, None)

    def num_out_of_window(self, num_computed_tokens: int) -> int:
        """Leading blocks of a sequence whose next query is at `num_computed_tokens` that
        no query reads any more: block i's last position (i + 1) * bs - 1 is at or before
        q - W (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def release_out_of_window(self, seq: Sequence) -> None:
        """Return the blocks before seq's window (module docstring), leaving `placeholder`
        in their entries. Call after each change of its computed tokens, once the newly full
        blocks are in the prefix cache (cache_full_blocks): a released block stays a cached
        one, for the next request with the same prefix. Last first, as `free` does: the
        head of a prompt is the last of them evicted."""
        end = min(self.num_out_of_window(seq.num_computed_tokens), len(seq.block_table))
        table = seq.block_table
        for index in range(end - 1, -1, -1):
            if table[index] == self.placeholder:  # the ones before it are released too
                break
            self._release(table[index])
            table[index] = self.placeholder
            self.window_released_blocks += 1

    def trim(self, seq: Sequence) -> None:
        """Return seq's blocks past those its computed tokens fill (the slots a rejected
        speculative proposal took). They hold no computed token, so no hash: they go to the
        front of the free list."""
        keep = num_blocks_for_tokens(seq.num_computed_tokens, self.block_size)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count != 0 or block.block_hash is not None:
                raise RuntimeError(f"block {block.block_id} past the computed tokens is shared")
            self._free[block.block_id] = None
            self._free.move_to_end(block.block_id, last=False)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's newly full, computed blocks in the prefix cache (after a step)."""
        if not self.enable_prefix_caching:
            return
        hashes = self._seq_hashes.setdefault(seq, [])
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= len(hashes):
            return
        parent = hashes[-1] if hashes else _chain_start(seq)
        bs = self.block_size
        for index in range(len(hashes), num_full):
            parent = _block_hash(
                self._salted(seq, index, parent), seq.token_ids[index * bs : (index + 1) * bs]
            )
            hashes.append(parent)
            if seq.block_table[index] == self.placeholder:  # released unhashed: nothing to
                continue  # register (not expected: blocks are cached before release)
            block = self.blocks[seq.block_table[index]]
            # Another sequence may have computed the same content into another block
            # first; keep that one as the cached copy and leave this one unhashed.
            if block.block_hash is None and parent not in self._cached:
                block.block_hash = parent
                self._cached[parent] = block.block_id

    # internals ---------------------------------------------------------------

    def _shares_partial_tail(self, seq: Sequence) -> bool:
        """seq's next token lands in a block another sequence (a fork) holds too."""
        index, offset = divmod(seq.num_computed_tokens, self.block_size)
        return offset != 0 and self.blocks[seq.block_table[index]].ref_count > 1

    def _release(self, block_id: int) -> None:
        """Drop one holder of a block; the last one puts it on the free list (a cached
        block at the back, evicted last; one that holds nothing reusable at the front)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count < 0:
            raise RuntimeError(f"block {block_id} freed more often than allocated")
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.block_hash is None:
                self._free.move_to_end(block_id, last=False)

    def _acquire(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _allocate_fresh(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached content
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _salted(self, seq: Sequence, index: int, parent: bytes) -> bytes:
        """The parent hash block `index` chains from, salted with the request's images'
        content hashes at the block holding its first image token: the blocks before it
        are shared with any request of the same text, that block and (through the chain)
        every later one only with requests of the same images too. A span attended both
        ways salts the block holding its first token with all of its tokens: a token's K/V
        there depends on the span's later tokens (PaliGemma's prompt), so its blocks are
        shared only by requests of the same whole span."""
        bs = self.block_size
        request = seq.request
        salt = b""
        if request.images and index == request.images[0].offset // bs:
            salt += b"".join(image.digest for image in request.images)
        for span in request.both_ways:
            if index == span.first // bs:
                salt += _block_hash(b"both ways", seq.token_ids[span.first : span.last + 1])
        return parent + salt

    def _full_blocks(self, token_ids: list[int], num_blocks: int):
        bs = self.block_size
        for index in range(num_blocks):
            yield token_ids[index * bs : (index + 1) * bs]


def _chain_start(seq: Sequence) -> bytes:
    """The hash a sequence's first block chains from: its adapter's, or none (base)."""
    uid = seq.request.adapter_uid
    return _block_hash(b"lora", [uid]) if uid else b""


def _block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    # A cryptographic hash, so that two different prefixes can't be made to collide and
    # serve one request another's K/V; cost ~1 us per 16-token block.
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()
