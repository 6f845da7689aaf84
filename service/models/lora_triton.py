"""LoRA deltas on CUDA as Punica's BGMV: each token gathers its own slot's A and B in place
(no per-adapter grouping on the host, no gathered copies), in two Triton kernels per layer:
shrink (`h = A[slot] @ x`, rank-wide) and expand (`y += B[slot] @ h`). A token of slot -1
(the base model, or a CUDA graph's padding row) is skipped. Every tensor they read is a
static buffer (the layer's stacks, the step's token slots), so a CUDA graph captures them
as they are.

Tested on CPU in Triton's interpreter (TRITON_INTERPRET=1) against `segment_delta`, as the
paged-attention kernel is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 64  # input features per shrink iteration
BLOCK_N = 64  # output features per expand program


@triton.jit
def _shrink(
    x_ptr, a_ptr, h_ptr, slots_ptr,
    in_features, stride_xt, stride_as, stride_ar,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """h[t, :RANK] = A[slot(t)] @ x[t], in float32 (zeros for slot -1)."""
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if slot >= 0:
        for k0 in range(0, in_features, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + t * stride_xt + k, mask=k < in_features, other=0.0)
            a = tl.load(
                a_ptr + slot * stride_as + r[:, None] * stride_ar + k[None, :],
                mask=(r[:, None] < RANK) & (k[None, :] < in_features),
                other=0.0,
            )
            acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(h_ptr + t * BLOCK_R + r, acc)


@triton.jit
def _expand(
    h_ptr, b_ptr, y_ptr, slots_ptr,
    out_features, stride_bs, stride_br, stride_yt,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """y[t, n] += B[slot(t)][:, n] . h[t] for one block of n (nothing for slot -1)."""
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, BLOCK_R)
        h = tl.load(h_ptr + t * BLOCK_R + r)
        b = tl.load(
            b_ptr + slot * stride_bs + r[:, None] * stride_br + n[None, :],
            mask=(r[:, None] < RANK) & (n[None, :] < out_features),
            other=0.0,
        )
        delta = tl.sum(b.to(tl.float32) * h[:, None], axis=0)
        y_at = y_ptr + t * stride_yt + n
        y = tl.load(y_at, mask=n < out_features, other=0.0)
        tl.store(y_at, (y.to(tl.float32) + delta).to(y.dtype), mask=n < out_features)


def bgmv_delta(layer, x: torch.Tensor, y: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """y (the base layer's output) plus each token's slot's delta, in place; `layer` is a
    lora_layers.LoraLinear, `token_slots` `[T]` (-1: none)."""
    x2 = x.reshape(-1, layer.in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y2 = y.view(-1, layer.out_features)
    num_tokens = x2.shape[0]
    if num_tokens == 0:
        return y
    rank = layer.a.shape[1]
    block_r = max(16, triton.next_power_of_2(rank))
    h = torch.empty(num_tokens, block_r, dtype=torch.float32, device=x.device)
    _shrink[(num_tokens,)](
        x2, layer.a, h, token_slots,
        layer.in_features, x2.stride(0), layer.a.stride(0), layer.a.stride(1),
        RANK=rank, BLOCK_R=block_r, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    grid = (num_tokens, triton.cdiv(layer.out_features, BLOCK_N))
    _expand[grid](
        h, layer.b, y2, token_slots,
        layer.out_features, layer.b.stride(0), layer.b.stride(1), y2.stride(0),
        RANK=rank, BLOCK_R=block_r, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    return y
