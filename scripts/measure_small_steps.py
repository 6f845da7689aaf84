"""Measure the decode step with int8 copies for small steps (service/models/small_steps.py,
what --dtype auto adds on a CPU) against the exact dtype (not a test).

For each batch size: two PagedCores, one on the float32 (or bfloat16) model, one on the
same model with the copies, decode the same ~100-token prompts, their steps alternating so
load from other processes hits both alike; medians of wall and CPU time, and whether the
greedy tokens are the same.

    .venv/bin/python scripts/measure_small_steps.py [--threads 2] [--batches 1 4 8 16 32]
        [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from measure_core import load_model, make_seq, prompts
from textgen.service.engine.config import EngineConfig
from textgen.service.models.small_steps import add_small_step_weights
from textgen.service.replica.assembly import build_core


def decoding_core(model, batch: int, steps: int):
    core = build_core(
        EngineConfig(
            max_batch_total_tokens=batch * (140 + steps + 32),
            max_batch_prefill_tokens=4096,
            max_batch_size=batch,
        ),
        model,
    )
    core.warm_up()
    seqs = [make_seq(p, i, steps + 20) for i, p in enumerate(prompts(batch, 49152, seed=batch))]
    for seq in seqs:
        core.add(seq)
    while any(seq.in_prefill for seq in seqs):
        core.step()
    return core, seqs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    exact, name = load_model(dtype)
    copies, _ = load_model(dtype)
    layers = add_small_step_weights(copies)
    print(f"{name}: {layers} layers with int8 copies, {args.threads} threads")
    print(
        f"| batch | {args.dtype} step (ms, wall / CPU) | with copies (ms, wall / CPU) | faster "
        "| same tokens |"
    )
    print("| --- | --- | --- | --- | --- |")
    with torch.inference_mode():
        for batch in args.batches:
            cores = {
                "exact": decoding_core(exact, batch, args.steps),
                "copies": decoding_core(copies, batch, args.steps),
            }
            wall = {k: [] for k in cores}
            cpu = {k: [] for k in cores}
            for _ in range(args.steps):
                for key, (core, _) in cores.items():
                    c, w = time.process_time(), time.perf_counter()
                    core.step()
                    cpu[key].append(1000 * (time.process_time() - c))
                    wall[key].append(1000 * (time.perf_counter() - w))
            med = {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in cores}
            same = [s.output_ids for s in cores["exact"][1]] == [
                s.output_ids for s in cores["copies"][1]
            ]
            print(
                f"| {batch} | {med['exact'][0]:.1f} / {med['exact'][1]:.1f} "
                f"| {med['copies'][0]:.1f} / {med['copies'][1]:.1f} "
                f"| {med['exact'][0] / med['copies'][0]:.2f}x | {'yes' if same else 'no'} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
