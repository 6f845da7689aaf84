"""Batch-invariant matmuls for the CPU path: every `F.linear` of a forward computed over
fixed blocks of `LINEAR_BLOCK_ROWS` rows, the last one zero-padded, so a row's result never
depends on how many rows the step has.

Why padding the batch to a multiple of 4 rows (runner.py) is not enough on every CPU:
measured on a 2-core Intel Xeon with AMX (torch 2.13, oneDNN/MKL), a row of `F.linear`
differs between products of 64, 65, 128 and 300 rows in float32 (input width 1536), and
between 5-128 rows and 300 in bfloat16: the library picks its blocking by the row count.
A product of a fixed row count meets one kernel and one blocking, and gave every row the
same bits wherever it sat in its block and however many blocks there were (float32 and
bfloat16, widths 576 and 1536, lm_head's 49152 outputs; a batched `matmul` over the blocks
did not).
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
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed LINEAR_BLOCK_ROWS rows at a time."""
    rows = x.reshape(-1, x.shape[-1])
    num_rows = rows.shape[0]
    padding = -num_rows % LINEAR_BLOCK_ROWS
    if padding:
        rows = torch.cat([rows, rows.new_zeros(padding, rows.shape[1])])
    blocks = [F.linear(block, weight, bias) for block in rows.split(LINEAR_BLOCK_ROWS)]
    out = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    if padding:
        out = out[:num_rows]
    return out.view(*x.shape[:-1], out.shape[-1])


@contextlib.contextmanager
def fixed_rows_linears(linears: list[torch.nn.Linear]) -> Iterator[None]:
    """Inside the block, each of `linears` computes as fixed_rows_linear. Set on the
    modules for one forward and taken off after, so a model shared with other runners
    keeps its plain matmuls (a TorchFunctionMode would do the same for every torch call
    of the forward: 15-30 % of a decode step, measured)."""
    for linear in linears:
        linear.forward = functools.partial(_forward, linear)
    try:
        yield
    finally:
        for linear in linears:
            del linear.forward  # back to the class's forward


def linear_modules(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def _forward(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return fixed_rows_linear(x, linear.weight, linear.bias)
