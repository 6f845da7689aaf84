"""Measure what LoRA adapters cost a decode step of the engine core (not a test).

Three cores, each with 32 sequences of ~100-token contexts decoding: `plain` (a model
without LoRA layers), `lora-base` (LoRA slots installed, every row the base model) and
`lora-mixed` (the same model, its rows spread round robin over the adapters given). Their
decode steps are timed one after another, round robin (a shared machine's speed drifts,
and each core meets the same drift); the medians and each one's ratio to `plain` are
printed.

    python scripts/make_lora_adapters.py /tmp/ad a=16:q_proj,k_proj,v_proj,o_proj ...
    python scripts/measure_lora.py /tmp/ad/a /tmp/ad/b /tmp/ad/c /tmp/ad/d [--dtype float32]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import replace

import torch
from measure_core import load_model, make_seq, prompts
from textgen.service.engine.adapters import AdapterRegistry
from textgen.service.engine.config import EngineConfig
from textgen.service.engine.paged_core import PagedCore
from textgen.service.models.lora import read_adapter
from textgen.service.models.lora_layers import LoraLayers
from textgen.service.replica.assembly import build_core


def core_for(model, lora=None, registry=None) -> PagedCore:
    return build_core(
        EngineConfig(
            max_batch_total_tokens=32 * 200, max_batch_prefill_tokens=4096, max_batch_size=64
        ),
        model,
        lora=lora,
        adapters=registry,
    )


def decoding(core: PagedCore, batch: int, uids: list[int], seed: int):
    """`batch` sequences prefilled and decoding (uids: their adapters, round robin)."""
    seqs = []
    for i, prompt in enumerate(prompts(batch, 49152, seed)):
        seq = make_seq(prompt, i, 64)
        uid = uids[i % len(uids)] if uids else 0
        seq.request = replace(seq.request, adapter_uid=uid, adapter_id=str(uid) if uid else None)
        core.add(seq)
        seqs.append(seq)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
        core.step()
    return seqs


def time_step(core: PagedCore) -> float:
    start = time.perf_counter()
    core.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("adapters", nargs="+")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each core (< 60)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(torch.get_num_threads())
    model, name = load_model(dtype)
    plain = core_for(copy.deepcopy(model))
    lora_model = copy.deepcopy(model)
    layers = LoraLayers(lora_model, len(args.adapters), 64, dtype, torch.device("cpu"))
    registry = AdapterRegistry(len(args.adapters), 64)
    uids = [
        registry.add(read_adapter(f"a{i}", path, layers)).uid
        for i, path in enumerate(args.adapters)
    ]
    # two cores over one model: each its own KV pool and sequences, the weights shared
    setups = {
        "plain": (plain, []),
        "lora-base": (core_for(lora_model, layers, registry), []),
        "lora-mixed": (core_for(lora_model, layers, registry), uids),
    }
    for core, ids in setups.values():
        decoding(core, args.batch, ids, seed=0)
        time_step(core)  # warm
    results: dict[str, list[float]] = {k: [] for k in setups}
    for _ in range(args.steps):
        for label, (core, _) in setups.items():
            results[label].append(time_step(core))
    print(f"{name}, {args.dtype}, batch {args.batch}, {torch.get_num_threads()} threads")
    base = statistics.median(results["plain"])
    for label, values in results.items():
        step = statistics.median(values)
        print(
            f"{label:>11}: step {step * 1000:.1f} ms (median of {len(values)}), "
            f"plain / this = {base / step:.3f}"
        )


if __name__ == "__main__":
    main()
