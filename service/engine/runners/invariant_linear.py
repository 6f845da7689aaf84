"""Batch-invariant matmuls for the CPU path: every `F.linear` of a forward computed over
fixed blocks of `LINEAR_BLOCK_ROWS` rows, the last one zero-padded, so a row's result never
depends on how many rows the step has.

Why padding the batch to a multiple of 4 rows (model_runner.py) is not enough on every CPU:
measured on a 2-core Intel Xeon with AMX (torch 2.13, oneDNN/MKL), a row of `F.linear`
differs between products of 64, 65, 128 and 300 rows in float32 (input width 1536), and
between 5-128 rows and 300 in bfloat16: the library picks its blocking by the row count.
A product of a fixed row count meets one kernel and one blocking, and gave every row the
same bits wherever it sat in its block and however many blocks there were (float32 and
bfloat16, widths 576 and 1536, lm_head's 49152 outputs; a batched `matmul` over the blocks
did not).

A product of fewer rows than a block is padded only up to `min_rows`, the fewest rows whose
products still give every row a full block's bits on this machine (probe_min_rows, run once
at warm-up on the engine's thread): a lone request's decode step then costs that many
rows' matmuls instead of 32. Measured on that Xeon: bfloat16 products of any row count up
to 32 agreed (a lone request's decode step of the embedded model, padded to 4 rows by the
runner, 105-111 ms against 126-131 with 32-row products); float32 ones of 16 or more
(fewer rows take another kernel).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F

# Rows per product: a decode step of up to 32 sequences is one product; longer batches
# (prefill chunks) take one product per 32 rows.
LINEAR_BLOCK_ROWS = 32


def fixed_rows_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    min_rows: int = LINEAR_BLOCK_ROWS,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed LINEAR_BLOCK_ROWS rows at a time, the last
    product zero-padded up to `min_rows` rows (probe_min_rows; a whole block by default)."""
    rows = x.reshape(-1, x.shape[-1])
    num_rows = rows.shape[0]
    tail = num_rows % LINEAR_BLOCK_ROWS
    padding = min_rows - tail if 0 < tail < min_rows else 0
    if padding:
        rows = torch.cat([rows, rows.new_zeros(padding, rows.shape[1])])
    blocks = [F.linear(block, weight, bias) for block in rows.split(LINEAR_BLOCK_ROWS)]
    out = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    if padding:
        out = out[:num_rows]
    return out.view(*x.shape[:-1], out.shape[-1])


def probe_min_rows(linears: list[torch.nn.Linear]) -> int:
    """The fewest rows a product of these layers may have on this machine (CPU, library,
    thread count: call it where the forward runs) and still give each row the bits it has
    in a full LINEAR_BLOCK_ROWS product: every product of that many rows or more, up to a
    block, agrees with the full one, at the block's start and at its end. The libraries
    pick their kernel and blocking by shape, not data: random rows show it."""
    generator = torch.Generator().manual_seed(0)
    min_rows = 1
    distinct = {(tuple(m.weight.shape), m.weight.dtype, m.bias is not None): m for m in linears}
    for linear in distinct.values():
        weight, bias = linear.weight, linear.bias
        x = torch.randn(LINEAR_BLOCK_ROWS, weight.shape[1], generator=generator)
        x = x.to(device=weight.device, dtype=weight.dtype)
        full = F.linear(x, weight, bias)
        for rows in range(LINEAR_BLOCK_ROWS - 1, min_rows - 1, -1):
            starts = (0, LINEAR_BLOCK_ROWS - rows)
            same = (
                torch.equal(F.linear(x[s : s + rows], weight, bias), full[s : s + rows])
                for s in starts
            )
            if not all(same):
                min_rows = rows + 1
                break
    return min_rows


@contextlib.contextmanager
def fixed_rows_linears(
    linears: list[torch.nn.Linear], min_rows: int = LINEAR_BLOCK_ROWS
) -> Iterator[None]:
    """Inside the block, each of `linears` computes as fixed_rows_linear. Set on the
    modules for one forward and taken off after, so a model shared with other runners
    keeps its plain matmuls (a TorchFunctionMode would do the same for every torch call
    of the forward: 15-30 % of a decode step, measured)."""
    for linear in linears:
        linear.forward = functools.partial(_forward, linear, min_rows)
    try:
        yield
    finally:
        for linear in linears:
            del linear.forward  # back to the class's forward


# Linear subclasses whose own forward is the plain product (Falcon's, without F.linear)
_PLAIN_PRODUCT_LINEARS = frozenset({"FalconLinear"})


def linear_modules(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The Linear layers whose forward is the product alone: a subclass that computes more
    (Llama 4's router returns scores and logits) keeps its forward."""
    return [
        m
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
        and (
            type(m).forward is torch.nn.Linear.forward or type(m).__name__ in _PLAIN_PRODUCT_LINEARS
        )
    ]


def _forward(linear: torch.nn.Linear, min_rows: int, x: torch.Tensor) -> torch.Tensor:
    return fixed_rows_linear(x, linear.weight, linear.bias, min_rows)
