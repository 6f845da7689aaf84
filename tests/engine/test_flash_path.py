"""The CUDA flash-attn path's index building, run on CPU against a reference varlen kernel.

flash-attn can't run here, so its call is replaced by a slow per-sequence implementation of
`flash_attn_varlen_func`'s documented semantics; greedy output must still equal generate.
"""

from __future__ import annotations

import pytest
import torch
from textgen.service.engine.attention import paged as attention

from .factories import (
    VOCAB_SIZE,
    assert_idle,
    assert_matches_generate,
    make_core,
    make_seq,
    random_prompt,
    run_to_completion,
)


def reference_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale,
    causal,
    window_size=(-1, -1),
    softcap=0.0,
    block_table=None,
):
    """flash_attn_varlen_func: causal aligned bottom-right, window (left, right), paged K/V
    when block_table is given ([num_blocks, block_size, KVH, D] pools)."""
    assert causal and window_size[1] in (-1, 0)
    outputs = []
    for i in range(len(cu_seqlens_q) - 1):
        q_i = q[cu_seqlens_q[i] : cu_seqlens_q[i + 1]].float()  # [n, H, D]
        num_keys = int(cu_seqlens_k[i + 1] - cu_seqlens_k[i])
        if block_table is None:
            k_i = k[cu_seqlens_k[i] : cu_seqlens_k[i + 1]]
            v_i = v[cu_seqlens_k[i] : cu_seqlens_k[i + 1]]
        else:
            k_i = k[block_table[i].long()].flatten(0, 1)[:num_keys]
            v_i = v[block_table[i].long()].flatten(0, 1)[:num_keys]
        groups = q_i.shape[1] // k_i.shape[1]
        k_i = k_i.float().repeat_interleave(groups, dim=1)
        v_i = v_i.float().repeat_interleave(groups, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q_i, k_i) * softmax_scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(num_keys - q_i.shape[0], num_keys).unsqueeze(1)
        k_pos = torch.arange(num_keys).unsqueeze(0)
        allowed = k_pos <= q_pos
        if window_size[0] >= 0:
            allowed &= k_pos >= q_pos - window_size[0]
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        outputs.append(torch.einsum("hnl,lhd->nhd", probs, v_i).to(q.dtype))
    return torch.cat(outputs)


@pytest.mark.parametrize("paged", [False, True], ids=["gathered-kv", "block-table"])
@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_gemma2"])
def test_flash_path_matches_generate(model_name, paged, request, monkeypatch):
    model = request.getfixturevalue(model_name)
    calls = []

    def kernel(*args, **kwargs):
        calls.append(kwargs["block_table"] is not None)
        return reference_varlen(*args, **kwargs)

    monkeypatch.setattr(attention, "flash_attn_varlen_func", kernel)
    monkeypatch.setattr(attention, "_flash_available", lambda device: True)
    monkeypatch.setattr(attention, "_flash_supports", lambda *tensors: True)
    if paged:  # read the pool in place, as flash-attn does for 256-token blocks
        monkeypatch.setattr(attention, "FLASH_PAGED_BLOCK_MULTIPLE", 16)
    core = make_core(model, prefill_tokens=48)
    g = torch.Generator().manual_seed(11)
    seqs = [
        make_seq(random_prompt(n, VOCAB_SIZE, g), request_id=f"f{n}", max_new_tokens=12)
        for n in (1, 9, 40, 75)
    ]
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    assert calls and all(used_table == paged for used_table in calls)
    assert_matches_generate(model, seqs)
    assert_idle(core)
