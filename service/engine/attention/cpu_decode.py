"""Decode attention on CPU that reads the paged pool in place: one query token a sequence
over its cached K/V, through the block table, with no gathered copy.

The SDPA path (paged.py) first gathers a decode's K/V out of the pool with `index_select`
(a copy that writes every cached byte and SDPA then reads again) and runs SDPA's
flash kernel on a one-row query, which on CPU is compute-bound well above the bytes it
reads. Here the same attention is written as plain tensor ops over the pool indexed by the
block table (`pool[tables]`) and handed to torch.compile: inductor fuses the indexing into
its loops, so each cached block is read where it lies, and parallelizes over the blocks, so
one long sequence spreads over every thread (a split over the context).

- `attend(rows, keys, values, tables, lengths, scale)`: rows `[B, KVH, G, D]` (the G query
  heads of each KV head), the layer's pools `[N, block_size, KVH, D]`, tables `[B, nb]`
  long (padded with any valid block), lengths `[B]` long -> `[B, KVH, G, Dv]`.
- Compiled by the runner's warm-up forward (paged.py's `_warm_up_in_place`), else on first
  use, with the batch, the table's width and the pool's size dynamic: one graph for one
  sequence and one for several (dynamo specializes a size of 1), whatever the context.
- Taken by paged.py's SDPA path for decodes with none of the extra terms (softcap, sinks,
  ALiBi, windows, chunks, 8-bit pools, batch-invariant mode) that attend MIN_KEYS keys or
  more, in float32, and in bfloat16 where the CPU has native bf16 for one sequence alone or
  several at BF16_SEVERAL_MIN_TOKENS tokens (`takes`); it computes in float32 either way
  (inductor widens each element as it loads it, so bfloat16 pools are read at their own
  size). `--disable-custom-kernels` or `TEXTGEN_CPU_DECODE_KERNEL=0` (or `ENABLED = False`)
  turns it off, and so does a failed compile (inductor needs a C++ compiler), with a
  warning.
- Its compiled artifacts go to `CACHE_DIR`, which a replica sets to the textgen cache
  (models/compile_cache.py `kernel_cache_dir`), so a later start reads them (~3 s instead of
  ~18 s here); None: torch's default, the temp dir.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..compiling import artifacts_in, own_code

logger = logging.getLogger(__name__)

# off with TEXTGEN_CPU_DECODE_KERNEL=0; tests and benchmarks flip ENABLED directly
ENABLED = os.environ.get("TEXTGEN_CPU_DECODE_KERNEL", "1") != "0"
# the keys a decode group attends (its sequences x its longest context, padded to blocks)
# from which the kernel is taken: below them the compiled call's fixed cost (~0.08 ms a
# layer) outweighs what it saves. Measured (docs/performance.md, issue 49 item 4): one
# sequence gains from ~1000 tokens, four from ~256 each.
MIN_KEYS = 1024
# bfloat16 is taken only where the CPU has native bf16 (avx512_bf16, amx_bf16, Arm's bf16),
# for one sequence from MIN_KEYS keys and for several from BF16_SEVERAL_MIN_TOKENS tokens of
# context: there a one-stream step at 2,300 tokens took 0.80-0.87x the gathered path's time
# and 0.69-0.72x at 8,000, four sequences 0.85x at 4,000 and 0.80x at 6,000, but four at
# 2,300 did not gain (0.98-1.03), nor did a CPU without native bf16 (1.3-1.5x slower);
# docs/performance.md "Decode at long context". NATIVE_BF16 None: not read yet; tests set it.
BF16_SEVERAL_MIN_TOKENS = 4096
NATIVE_BF16: bool | None = None
# where the compiles keep their artifacts (set by the replica: replica/assembly.py); None:
# torch's default
CACHE_DIR: Path | None = None


def takes(dtype: torch.dtype, num_seqs: int, context_tokens: int) -> bool:
    """Whether the kernel attends `num_seqs` decodes whose query and pools are `dtype` and
    whose longest context is `context_tokens` (the caller checks MIN_KEYS)."""
    if dtype == torch.float32:
        return True
    if dtype != torch.bfloat16 or not _native_bf16():
        return False
    return num_seqs == 1 or context_tokens >= BF16_SEVERAL_MIN_TOKENS


def ever_takes(dtype: torch.dtype, num_seqs: int) -> bool:
    """Whether the kernel attends `num_seqs` such decodes at some context (the warm-up
    compiles those kinds)."""
    return takes(dtype, num_seqs, sys.maxsize)


def _native_bf16() -> bool:
    global NATIVE_BF16
    if NATIVE_BF16 is None:
        from ...models.loader import cpu_has_native_bf16

        NATIVE_BF16 = cpu_has_native_bf16()
    return NATIVE_BF16


class Stats:
    """Calls (one a layer) and compile time, for tests and the log."""

    calls = 0
    compile_seconds = 0.0


def _decode_attention(
    rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    num_blocks = tables.shape[1]
    block_size = keys.shape[1]
    out_dtype, rows = rows.dtype, rows.float()  # float32 throughout (a no-op in float32)
    # scores [B, nb, bs, KVH, G]: each block's keys read in place, q.k over the head dim
    key_blocks = keys[tables].float()  # [B, nb, bs, KVH, D], an indexed read inside the loops
    scores = (rows[:, None, None] * key_blocks[:, :, :, :, None, :]).sum(-1) * scale
    position = torch.arange(num_blocks * block_size, device=rows.device).view(num_blocks, -1)
    seen = (position[None] < lengths[:, None, None])[..., None, None]
    scores = torch.where(seen, scores, float("-inf"))
    probs = torch.exp(scores - scores.amax((1, 2), keepdim=True))
    total = probs.sum((1, 2))  # [B, KVH, G]
    # p.v a block at a time (its rows in cache), then the blocks' partial sums
    value_blocks = values[tables].float()
    partial = (probs[..., None] * value_blocks[:, :, :, :, None, :]).sum(2)  # [B, nb, KVH, G, Dv]
    return (partial.sum(1) / total[..., None]).to(out_dtype)


# per kind of call (head shapes, dtype): the compiled function, each over its own copy of
# _decode_attention's code, so that each kind has its own dynamo cache and recompile limit
# (a process running several models, as the tests do, would otherwise exhaust it)
_compiled: dict[tuple, Callable[..., torch.Tensor]] = {}
_seen: set[tuple] = set()  # the kinds, each with or without a batch of one, compiled


def _compiled_function(kind: tuple) -> Callable[..., torch.Tensor]:
    function = _compiled.get(kind)
    if function is None:
        copy = own_code(_decode_attention, f"_decode_attention_{len(_compiled)}")
        # indices come from the block manager's tables: in bounds, no per-element check
        function = torch.compile(copy, fullgraph=True, options={"assert_indirect_indexing": False})
        _compiled[kind] = function
    return function


def attend(
    rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """See the module's docstring."""
    kind = (rows.shape[1:], keys.shape[1:], values.shape[1:], rows.dtype, keys.dtype)
    function = _compiled_function(kind)
    # dynamic batch, context and pool size; a batch of one keeps its own graph (dynamo
    # specializes a size of 1)
    if rows.shape[0] > 1:
        for tensor in (rows, tables, lengths):
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
    for tensor, dim in ((tables, 1), (keys, 0), (values, 0)):
        torch._dynamo.maybe_mark_dynamic(tensor, dim)
    Stats.calls += 1
    kind = (rows.shape[0] == 1, *kind)
    if kind in _seen:
        return function(rows, keys, values, tables, lengths, scale)
    start = time.perf_counter()  # this kind's first call compiles it
    try:
        with artifacts_in(CACHE_DIR):
            out = function(rows, keys, values, tables, lengths, scale)
    except Exception:  # e.g. no C++ compiler for inductor (the Docker image has none)
        global ENABLED
        ENABLED = False
        logger.warning(
            "the CPU decode attention did not compile: decodes gather their K/V for SDPA",
            exc_info=True,
        )
        return _decode_attention(rows, keys, values, tables, lengths, scale)
    seconds = time.perf_counter() - start
    Stats.compile_seconds += seconds
    _seen.add(kind)
    logger.info("compiled the CPU decode attention (batch of one: %s) in %.1f s", kind[0], seconds)
    return out
