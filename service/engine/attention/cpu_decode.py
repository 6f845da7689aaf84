"""Decode attention on CPU that reads the paged pool in place: one query token a sequence
over its cached K/V, through the block table, with no gathered copy.

The SDPA path (paged.py) first gathers a decode's K/V out of the pool with `index_select`
(a copy that writes every cached byte and SDPA then reads again) and runs SDPA's flash
kernel on a one-row query, which on CPU costs well above the bytes it reads. Here a C++
kernel (`cpu_decode.cpp`) reads each cached row where it lies, widens it to float32 in
registers (bfloat16 pools are read at their own size, on any CPU) and splits each sequence
into items of 256 tokens that the threads share, merging them at the end (flash decoding's
split over the context), so that one long sequence spreads over every thread.

- `attend(rows, keys, values, tables, lengths, scale)`: rows `[B, KVH, G, D]` (the G query
  heads of each KV head), the layer's pools `[N, block_size, KVH, D]`, tables `[B, nb]`
  long (padded with any valid block), lengths `[B]` long -> `[B, KVH, G, Dv]`, in the
  rows' dtype (float32 or bfloat16, the pools' too); optionally the layer's sliding
  `window` (keys a query sees, its own included), logit `softcap` and attention `sinks`
  (`[KVH * G]`, one logit per query head).
  With `new=(slots, new_keys, new_values)` it first stores a step's new K/V rows at their
  pool slots, in the same call (paged.py's path for a step of one group).
- `cpu_decode_op.cpp` (`load_op`, `begin_step`/`end_step`, `register_layer`): the CPU
  kernel of paged.py's `textgen::paged_attention` op, through which a compiled step's
  graph reaches that storing kernel's C++ with no Python.
- The kernel is compiled once per kind of layer (head counts and sizes, block size, dtype),
  with those shapes as constants, by inductor's C++ toolchain (the compiler, flags and
  vector ISA torch.compile's CPU kernels use), at the runner's warm-up (paged.py's
  `_warm_up_in_place`), else on first use. Its library goes to `CACHE_DIR`, which a replica
  sets to the textgen cache (models/compile_cache.py `kernel_cache_dir`): a later start
  loads it (here ~10 s to compile the first time, with an empty cache; ~2 s to load).
- Taken by paged.py's SDPA path for CPU decodes in float32 and bfloat16 (`takes`), and for
  groups of up to MAX_QUERY query tokens a sequence (verifications), each query row as a
  decode of its own; windowed, soft-capped or with sinks included; not for ALiBi, chunked
  local attention, 8-bit pools or the batch-invariant mode. `--disable-custom-kernels` or
  `TEXTGEN_CPU_DECODE_KERNEL=0` (or `ENABLED = False`) turns it off, and so does a failed
  compile (a host without a C++ compiler), with a warning.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ...models.compile_cache import artifacts_in

logger = logging.getLogger(__name__)

# off with TEXTGEN_CPU_DECODE_KERNEL=0; tests and benchmarks flip ENABLED directly
ENABLED = os.environ.get("TEXTGEN_CPU_DECODE_KERNEL", "1") != "0"
# where the compiles keep their libraries (set by the replica: replica/assembly.py); None:
# torch's default
CACHE_DIR: Path | None = None
# the pools' element types the kernel reads, and how cpu_decode.cpp names them
POOL_TYPES = {torch.float32: "float", torch.bfloat16: "uint16_t"}
SPLIT = 256  # tokens of a sequence one item attends (cpu_decode.cpp's SPLIT)
# query tokens a sequence (a decode's 1, a verification's 1 + N) up to which paged.py hands
# a step's group to the kernel, each query row as a decode of its own (reading the context
# once a row); longer chunks gather once for SDPA. A verification of 4 tokens per layer, 9
# heads, bfloat16: 0.095 against 0.247 ms gathered at 300 tokens of context, 0.38 against
# 0.62 at 2,300, 1.2 against 2.0 at 8,000 (docs/performance.md).
MAX_QUERY = 8
SOURCE = Path(__file__).with_name("cpu_decode.cpp")


def takes(dtype: torch.dtype) -> bool:
    """Whether the kernel attends decodes whose query and pools are `dtype`."""
    return dtype in POOL_TYPES


class Stats:
    """Calls (one a layer) through Python and compile time, for tests and the log
    (kernel_calls(): the op's C++ calls too)."""

    calls = 0
    compile_seconds = 0.0


def kernel_calls() -> int:
    """The kernel's calls so far (one a layer), through Python or the op's C++ kernel."""
    return Stats.calls + (_op_library.textgen_decode_op_calls() if _op_library else 0)


@dataclass(frozen=True)
class Kernel:
    """One kind of layer's compiled entries (cpu_decode.cpp)."""

    attend: Callable[..., None]  # textgen_decode_attention
    write_and_attend: Callable[..., None]  # textgen_decode_write_attention


# per kind of layer (KVH, G, D, Dv, block size, dtype): the compiled kernel
_kernels: dict[tuple, Kernel] = {}

_ATTENTION_ARGS = [
    ctypes.c_int64,  # batch
    ctypes.c_int64,  # table width
    ctypes.c_float,  # scale
    ctypes.c_int64,  # window (0: none)
    ctypes.c_float,  # softcap (0: none)
    ctypes.c_void_p,  # sinks (None: none)
    ctypes.c_int,  # threads
]


def _kernel(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> Kernel:
    """The kernel for this kind of layer (its head counts and sizes, block size and dtype:
    what a kernel is specialized to), compiled or loaded from the cache on first use;
    raises if it can't be."""
    _, kv_heads, group, head_dim = rows.shape
    kind = (kv_heads, group, head_dim, values.shape[-1], keys.shape[1], keys.dtype)
    kernel = _kernels.get(kind)
    if kernel is not None:
        return kernel
    from torch._inductor.codecache import CppCodeCache

    constants = {
        "KV_HEADS": kv_heads,
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "V_DIM": values.shape[-1],
        "BLOCK_SIZE": keys.shape[1],
        "POOL_T": POOL_TYPES[keys.dtype],
    }
    source = "".join(f"#define {k} {v}\n" for k, v in constants.items()) + SOURCE.read_text()
    start = time.perf_counter()
    with artifacts_in(CACHE_DIR):
        library = CppCodeCache.load(source)
    pointers = [ctypes.c_void_p]
    kernel = Kernel(library.textgen_decode_attention, library.textgen_decode_write_attention)
    # q, keys, values, tables, lengths, out, scratch
    kernel.attend.argtypes = pointers * 7 + _ATTENTION_ARGS
    # q, k_new, v_new, slots, then as attend's
    kernel.write_and_attend.argtypes = pointers * 10 + _ATTENTION_ARGS
    kernel.attend.restype = kernel.write_and_attend.restype = None
    seconds = time.perf_counter() - start
    Stats.compile_seconds += seconds
    _kernels[kind] = kernel
    logger.info("compiled the CPU decode attention for %s in %.1f s", kind, seconds)
    return kernel


def _compiled(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> Kernel | None:
    """_kernel(), or None (and the kernel off from now on, with a warning) where it can't
    be compiled."""
    try:
        return _kernel(rows, keys, values)
    except Exception:  # e.g. no C++ compiler on the host
        global ENABLED
        ENABLED = False
        logger.warning(
            "the CPU decode attention did not compile: decodes gather their K/V for SDPA",
            exc_info=True,
        )
        return None


def _terms(
    rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tables: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, list]:
    """The output, the scratch and the trailing arguments of a kernel's call: each
    sequence's items of SPLIT tokens (the scratch holds one result a query head an item),
    and their KV heads where items are fewer than threads, are shared by up to torch's
    threads (one thread: no team to wake and join)."""
    batch, kv_heads, group, _ = rows.shape
    v_dim, width = values.shape[-1], tables.shape[1]
    items = batch * -(-width * keys.shape[1] // SPLIT)
    out = rows.new_empty(batch, kv_heads, group, v_dim)
    partial = torch.empty(items * kv_heads * group * (v_dim + 2))
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
    threads = min(torch.get_num_threads(), items * kv_heads)
    sink_logits = None if sinks is None else sinks.data_ptr()
    trailing = [batch, width, scale, window or 0, softcap or 0.0, sink_logits, threads]
    return out, partial, trailing


def attend(
    rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    new: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """See the module's docstring. new: `(slots, new_keys, new_values)`, a step's K/V to
    store in the pools first, in the same call: new_keys `[B, KVH, D]` and new_values
    `[B, KVH, Dv]` (the pools' dtype) at pool slots `[B]` long (block x block_size +
    offset), one a row."""
    kernel = _compiled(rows, keys, values)
    if kernel is None:
        if new is not None:
            slots, new_keys, new_values = new
            keys.flatten(0, 1).index_copy_(0, slots, new_keys)
            values.flatten(0, 1).index_copy_(0, slots, new_values)
        return _reference(rows, keys, values, tables, lengths, scale, window, softcap, sinks)
    Stats.calls += 1
    # the kernel reads them as laid out here (no-ops on the paged path's tensors)
    rows, keys, values = rows.contiguous(), keys.contiguous(), values.contiguous()
    tables, lengths = tables.to(torch.long).contiguous(), lengths.to(torch.long).contiguous()
    out, partial, trailing = _terms(rows, keys, values, tables, scale, window, softcap, sinks)
    # the pointers spelled out: this runs once a layer of every eager CPU decode step
    pools = [keys.data_ptr(), values.data_ptr(), tables.data_ptr(), lengths.data_ptr()]
    results = [out.data_ptr(), partial.data_ptr()]
    if new is None:
        kernel.attend(rows.data_ptr(), *pools, *results, *trailing)
    else:
        slots, new_keys, new_values = new
        new_keys, new_values = new_keys.contiguous(), new_values.contiguous()
        stored = [new_keys.data_ptr(), new_values.data_ptr(), slots.data_ptr()]
        kernel.write_and_attend(rows.data_ptr(), *stored, *pools, *results, *trailing)
    return out


# the compiled decode step's op kernel (cpu_decode_op.cpp) --------------------------------

OP_SOURCE = Path(__file__).with_name("cpu_decode_op.cpp")
_op_library: ctypes.CDLL | None = None
_op_tried = False
_thread = threading.local()  # this thread's step: .pool (weakref), .active


def load_op() -> bool:
    """Compile (or load from the cache) and register cpu_decode_op.cpp, the CPU kernel of
    `textgen::paged_attention` (paged.py defines the op first); False, with a warning, if it
    can't be: the op's Python implementation then runs every call."""
    global _op_library, _op_tried
    if _op_tried:
        return _op_library is not None
    _op_tried = True
    from torch._inductor.codecache import CppCodeCache

    start = time.perf_counter()
    try:
        with artifacts_in(CACHE_DIR):
            library = CppCodeCache.load(OP_SOURCE.read_text())
    except Exception:
        logger.warning(
            "the compiled decode step's attention op did not compile: its layers call the "
            "kernel through Python",
            exc_info=True,
        )
        return False
    int64, pointer = ctypes.c_int64, ctypes.c_void_p
    library.textgen_decode_step_begin.argtypes = [pointer] * 3 + [int64] * 3 + [ctypes.c_int]
    library.textgen_decode_layer.argtypes = [int64] + [pointer] * 3 + [int64] * 4 + [ctypes.c_int]
    for name in ("textgen_decode_step_begin", "textgen_decode_step_end", "textgen_decode_layer"):
        getattr(library, name).restype = None
    library.textgen_decode_op_calls.restype = int64
    _op_library = library
    seconds = time.perf_counter() - start
    Stats.compile_seconds += seconds
    logger.info("compiled the compiled decode step's attention op in %.1f s", seconds)
    return True


def begin_step(
    pool: object, slots: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, block_size: int
) -> None:
    """A compiled step of decodes begins on this thread (load_op() done): its layers' op
    calls attend through the C++ kernel once their layers are registered (register_layer).
    `pool` (the KV pool) scopes the registrations: another pool's step forgets them. The
    tensors (long, contiguous) must live until end_step()."""
    known = getattr(_thread, "pool", None)
    if known is None or known() is not pool:
        _op_library.textgen_decode_forget()
        _thread.pool = weakref.ref(pool)
    batch, width = tables.shape
    _op_library.textgen_decode_step_begin(
        slots.data_ptr(),
        tables.data_ptr(),
        lengths.data_ptr(),
        batch,
        width,
        block_size,
        torch.get_num_threads(),
    )
    _thread.active = True


def end_step() -> None:
    _op_library.textgen_decode_step_end()
    _thread.active = False


def step_active() -> bool:
    """Whether a begin_step() step runs on this thread."""
    return getattr(_thread, "active", False)


def register_layer(
    layer_idx: int, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> None:
    """Hand layer `layer_idx`'s pools and compiled kernel to the op's C++ kernel, for this
    thread's later steps of the same pool. rows: a query as attend() takes it (its shape)."""
    kernel = _compiled(rows, keys, values)
    if kernel is None:
        return
    _, kv_heads, group, head_dim = rows.shape
    address = ctypes.cast(kernel.write_and_attend, ctypes.c_void_p).value
    _op_library.textgen_decode_layer(
        layer_idx,
        address,
        keys.data_ptr(),
        values.data_ptr(),
        kv_heads * group,
        kv_heads,
        head_dim,
        values.shape[-1],
        _SCALAR_TYPES[keys.dtype],
    )


# c10::ScalarType's numbers
_SCALAR_TYPES = {torch.float32: 6, torch.bfloat16: 15}


def _reference(
    rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """attend()'s result through torch's ops, softmax in float32 (the call whose compile
    failed, and the tests' reference)."""
    key_rows = keys[tables].flatten(1, 2).transpose(1, 2).float()  # [B, KVH, nb * bs, D]
    value_rows = values[tables].flatten(1, 2).transpose(1, 2).float()
    scores = torch.matmul(rows.float(), key_rows.transpose(-1, -2)) * scale  # [B, KVH, G, n]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    position = torch.arange(key_rows.shape[2], device=rows.device)
    seen = position < lengths[:, None]  # [B, n]
    if window:
        seen &= position >= lengths[:, None] - window
    scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
    if sinks is not None:  # one more logit a query head, with no value
        sink = sinks.float().view(1, *rows.shape[1:3], 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., : value_rows.shape[2]]
    return torch.matmul(probs, value_rows).to(rows.dtype)
