"""The paged KV cache's storage: one preallocated pool of fixed-size blocks per layer.

A sequence's `block_table` (block_manager.py hands the blocks out) lists its blocks in
position order, so position p lives in slot
`block_table[p // block_size] * block_size + p % block_size` of every layer's pool.

With an 8-bit storage dtype (`--kv-cache-dtype fp8_e4m3fn | fp8_e5m2`) every value is cast
to it as it is written (saturated at the type's largest finite value: a cast of a larger
one gives NaN or inf) and widened back to the model's dtype as attention reads it
(`read_blocks`; the Triton kernel converts its tiles itself), so the pool holds twice the
tokens of a bfloat16 one in the same memory, with no scale: the values are stored as they
are. torch has no CPU index_copy_/index_select for 8-bit floats: the pool is written,
gathered and copied through byte views of the same storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# the 8-bit storage dtypes, by their --kv-cache-dtype names
KV_CACHE_DTYPES = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def is_8bit(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def raw(pool: torch.Tensor) -> torch.Tensor:
    """The tensor to index (copy into, select from): an 8-bit pool's bytes, else the pool."""
    return pool.view(torch.uint8) if is_8bit(pool.dtype) else pool


def read_blocks(pool: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks `index` of `pool` (`[n, block_size, KVH, D]`), in `dtype`."""
    return _widened(raw(pool).index_select(0, index), pool.dtype, dtype)


def read_slots(
    rows: torch.Tensor, slots: torch.Tensor, storage: torch.dtype, dtype: torch.dtype
) -> torch.Tensor:
    """Slots `slots` of a layer's `[1, slots, KVH, D]` rows (raw(): an 8-bit pool's
    bytes) stored as `storage`, in `dtype`."""
    return _widened(rows.index_select(1, slots), storage, dtype)


def _widened(picked: torch.Tensor, storage: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """Values selected from a pool stored as `storage` (an 8-bit pool's as bytes), in `dtype`."""
    if picked.dtype != storage:
        picked = picked.view(storage)
    return picked if picked.dtype == dtype else picked.to(dtype)


def stored(states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`states` as `raw()` of a `dtype` pool holds them (saturated, for an 8-bit one)."""
    if states.dtype == dtype:
        return states
    if not is_8bit(dtype):
        return states.to(dtype)
    largest = torch.finfo(dtype).max
    return states.clamp(-largest, largest).to(dtype).view(torch.uint8)


@dataclass(slots=True)
class LayerCache:
    """One layer's pools and their slot-major views (same storage)."""

    keys: torch.Tensor  # [num_blocks, block_size, KVH, Dk], the storage dtype
    values: torch.Tensor  # [num_blocks, block_size, KVH, Dv]
    key_slots: torch.Tensor  # [num_blocks * block_size, KVH, Dk]
    value_slots: torch.Tensor  # [num_blocks * block_size, KVH, Dv]
    # the slots with a leading 1 (raw(): an 8-bit pool's bytes): the step's `[1, KVH, T, D]`
    # K/V, transposed, copy in with one op each (no select of the batch dim), which matters
    # on a CPU decode step
    key_rows: torch.Tensor  # [1, num_blocks * block_size, KVH, Dk]
    value_rows: torch.Tensor  # [1, num_blocks * block_size, KVH, Dv]

    @classmethod
    def over(cls, keys: torch.Tensor, values: torch.Tensor) -> LayerCache:
        key_slots, value_slots = keys.flatten(0, 1), values.flatten(0, 1)
        key_rows, value_rows = raw(key_slots)[None], raw(value_slots)[None]
        return cls(keys, values, key_slots, value_slots, key_rows, value_rows)


class KVCachePool:
    """Per-layer K and V tensors `[num_blocks, block_size, num_kv_heads, head_dim]`.

    Layers are allocated on first use from the shapes the model hands the attention
    function (the runner triggers that with a warm-up forward at start-up), so K and V may
    have different head dims (MLA) and no per-architecture config reading is needed.
    Pools are zero-filled: slots that are gathered but masked must hold finite values,
    since one NaN there would poison the softmax through `0 * NaN`.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        scratch_blocks: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        """`num_blocks` for the block manager to hand out, then `scratch_blocks` more, from
        block `num_blocks` on, that only padding rows write to and read; `dtype`: the
        storage dtype (None: the model's K/V dtype)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_blocks = scratch_blocks
        self.dtype = dtype
        self._layers: dict[int, LayerCache] = {}  # by the attention module's layer_idx

    @property
    def scratch_block(self) -> int | None:
        return self.num_blocks if self.scratch_blocks else None

    def layer(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> LayerCache:
        """The layer's pools; key/value `[1, KVH, T, D]` give their shapes on first use."""
        cache = self._layers.get(layer_idx)
        if cache is None:
            cache = LayerCache.over(self._allocate(key), self._allocate(value))
            self._layers[layer_idx] = cache
        return cache

    def write(
        self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
    ) -> LayerCache:
        """Store the step's new K/V (`[1, KVH, T, D]`) at `slots` (`[T]`); return the layer."""
        cache = self.layer(layer_idx, key, value)
        key, value = stored(key, cache.keys.dtype), stored(value, cache.values.dtype)
        cache.key_rows.index_copy_(1, slots, key.transpose(1, 2))
        cache.value_rows.index_copy_(1, slots, value.transpose(1, 2))
        return cache

    @property
    def kernel_may_write(self) -> bool:
        """Whether an attention kernel may store a step's K/V itself, as write() would
        (cpu_decode.py's, on a pool of the states' dtype): not for a subclass whose write()
        stores something else."""
        return type(self).write is KVCachePool.write

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy every layer's K/V of block `source` into block `destination`, for each
        (source, destination) pair: a fork's own copy of a block it shared."""
        if not copies or not self._layers:
            return
        some = next(iter(self._layers.values()))
        pairs = torch.tensor(copies, dtype=torch.long, device=some.keys.device)
        source, destination = pairs[:, 0], pairs[:, 1]
        for cache in self._layers.values():
            for pool in (raw(cache.keys), raw(cache.values)):
                pool.index_copy_(0, destination, pool.index_select(0, source))

    def _allocate(self, states: torch.Tensor) -> torch.Tensor:
        _, num_heads, _, head_dim = states.shape
        return torch.zeros(
            self.num_blocks + self.scratch_blocks,
            self.block_size,
            num_heads,
            head_dim,
            dtype=self.dtype or states.dtype,
            device=states.device,
        )
