"""Decode attention at long context on CPU (issue 49, item 4): the gathered SDPA path against
cpu_decode.py's in-place kernel, alternating in one process (not a test).

1. `--micro`: the attention alone, `_sdpa_attention` over a KV pool of the embedded model's
   shape (30 layers, 3 KV heads of 64, 9 query heads, float32, 16-token blocks), every layer
   once a round, each context x batch, the two paths alternating; medians of process CPU
   time. Beside it the bytes the layers must read (context x 2 x KVH x D x 4 x 30) and the
   time a plain sum of those bytes takes at this machine's bandwidth (a 256 MB tensor's sum).
2. `--core`: the embedded SmolLM2-135M's core decoding B sequences of ~N tokens (float32,
   or `--dtype bfloat16` with the int8 copies for small steps that `--dtype auto` gives it
   on a CPU with native bf16), the kernel switched on and off on alternate steps of the same
   core (on: where `cpu_decode.takes` takes it); step time and
   the attention's share of it (`_sdpa_attention`'s time summed over the step's layers).

    .venv/bin/python scripts/measure_decode_attention.py --threads 1 --micro --core \
        --contexts 100 2000 8000 --batches 1 4

`--window N`, `--softcap C` and `--sinks` give the micro's layers those terms (Mistral's and
Gemma's sliding windows, Gemma 2's soft-capping, gpt-oss's sinks).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from textgen.service.engine.attention import cpu_decode
from textgen.service.engine.attention import paged as attention
from textgen.service.engine.kv_pool import KVCachePool
from textgen.service.processes.allocator import keep_freed_memory

LAYERS, KV_HEADS, GROUPS, HEAD_DIM, BLOCK = 30, 3, 3, 64, 16


def median_ms(xs: list[float]) -> float:
    return 1000 * statistics.median(xs)


def bandwidth_gbs() -> float:
    """A plain sum of a 256 MB tensor: the bytes per second this machine reads."""
    big = torch.randn(64 * 1024 * 1024)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        big.sum()
        times.append(time.perf_counter() - start)
    return big.numel() * 4 / statistics.median(times) / 1e9


def micro(
    context: int, batch: int, rounds: int, gbs: float, dtype: torch.dtype, terms: dict
) -> None:
    lengths = [context - 3 * i for i in range(batch)]
    needed = [-(-n // BLOCK) for n in lengths]
    pool = KVCachePool(num_blocks=sum(needed) + 1, block_size=BLOCK)
    states = torch.zeros(1, KV_HEADS, 1, HEAD_DIM, dtype=dtype)
    for layer in range(LAYERS):
        cache = pool.layer(layer, states, states)
        cache.keys.normal_()
        cache.values.normal_()
    order = (torch.randperm(sum(needed)) + 1).tolist()  # shuffled blocks
    tables = []
    for n in needed:
        tables.append(order[:n])
        order = order[n:]
    query = torch.randn(1, batch, KV_HEADS * GROUPS, HEAD_DIM, dtype=dtype).transpose(1, 2)
    caches = [pool._layers[layer] for layer in range(LAYERS)]
    scale = HEAD_DIM**-0.5

    def run(in_place: bool) -> list[torch.Tensor]:
        cpu_decode.ENABLED = in_place
        meta = attention.BatchMetadata.build(
            pool, [1] * batch, lengths, tables, torch.device("cpu")
        )
        window, softcap = terms["window"], terms["softcap"]
        return [
            attention._sdpa_attention(query, c, meta, scale, window, softcap, terms["sinks"])
            for c in caches
        ]

    for a, b in zip(run(False), run(True)):  # and the first call compiles
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(a, b, atol=tolerance, rtol=tolerance)
    times = {False: [], True: []}
    for _ in range(rounds):
        for in_place in (False, True):
            start = time.process_time()
            run(in_place)
            times[in_place].append(time.process_time() - start)
    gathered, in_place = median_ms(times[False]), median_ms(times[True])
    seen = sum(min(n, terms["window"] or n) for n in lengths)  # the keys the layers read
    mbytes = seen * 2 * KV_HEADS * HEAD_DIM * dtype.itemsize * LAYERS / 1e6
    print(
        f"{context:>7} {batch:>5} {gathered:>12.2f} {in_place:>12.2f} "
        f"{in_place / gathered:>8.2f} {mbytes:>8.1f} {mbytes / gbs:>10.2f}"
    )


def core(context: int, batch: int, steps: int, dtype: torch.dtype) -> None:
    from measure_core import CoreDecoder, load_model, prompts  # scripts/, beside this one
    from textgen.service.models.small_steps import add_small_step_weights

    model, _ = load_model(dtype)
    if dtype == torch.bfloat16:  # as `--dtype auto` loads it where the CPU has native bf16
        add_small_step_weights(model)
    batch_prompts = prompts(batch, model.config.vocab_size, seed=batch, context=context)
    decoder = CoreDecoder(model, batch_prompts, 2 * steps + 2)
    spent = [0.0]
    sdpa = attention._sdpa_attention

    def timed(*args, **kwargs):
        start = time.process_time()
        out = sdpa(*args, **kwargs)
        spent[0] += time.process_time() - start
        return out

    attention._sdpa_attention = timed
    results = {False: ([], []), True: ([], [])}
    try:
        for in_place in (False, True):  # the first of each: its compile, the caches
            cpu_decode.ENABLED = in_place
            decoder.step()
        for _ in range(steps):
            for in_place in (False, True):
                cpu_decode.ENABLED = in_place
                spent[0] = 0.0
                start = time.process_time()
                decoder.step()
                step_times, attention_times = results[in_place]
                step_times.append(time.process_time() - start)
                attention_times.append(spent[0])
    finally:
        attention._sdpa_attention = sdpa
        decoder.close()
    (step0, attn0), (step1, attn1) = (
        (median_ms(s), median_ms(a)) for s, a in (results[False], results[True])
    )
    print(
        f"{context:>7} {batch:>5} {step0:>10.1f} {attn0 / step0:>7.0%} "
        f"{step1:>10.1f} {attn1 / step1:>7.0%} {step1 / step0:>10.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--contexts", type=int, nargs="+", default=[100, 2000, 8000])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--micro", action="store_true")
    parser.add_argument(
        "--dtype", default="float32", help="the pool's and query's (core: the model's)"
    )
    parser.add_argument("--core", action="store_true")
    parser.add_argument("--window", type=int, help="micro: the layers' sliding window")
    parser.add_argument("--softcap", type=float, help="micro: the layers' logit soft-cap")
    parser.add_argument("--sinks", action="store_true", help="micro: attention sinks")
    parser.add_argument("--rounds", type=int, default=11, help="micro: rounds a case")
    parser.add_argument("--steps", type=int, default=8, help="core: steps a path, a case")
    args = parser.parse_args()
    keep_freed_memory()  # as textgen serve does: no page faults on each step's buffers
    torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}")
    terms = {
        "window": args.window,
        "softcap": args.softcap,
        "sinks": torch.randn(KV_HEADS * GROUPS) if args.sinks else None,
    }
    if args.micro:
        gbs = bandwidth_gbs()
        print(f"bandwidth (sum of 256 MB): {gbs:.1f} GB/s")
        print("attention alone, 30 layers, CPU ms (process time), medians:")
        print(
            f"{'context':>7} {'batch':>5} {'gathered':>12} {'in place':>12} {'ratio':>8} "
            f"{'MB read':>8} {'sum of MB':>10}"
        )
        for context in args.contexts:
            for batch in args.batches:
                micro(context, batch, args.rounds, gbs, getattr(torch, args.dtype), terms)
    if args.core:
        print(f"core decode step, SmolLM2-135M {args.dtype}, CPU ms (process time), medians:")
        print(
            f"{'context':>7} {'batch':>5} {'gathered':>10} {'attn':>7} "
            f"{'in place':>10} {'attn':>7} {'ratio':>10}"
        )
        for context in args.contexts:
            for batch in args.batches:
                core(context, batch, args.steps, getattr(torch, args.dtype))
    cpu_decode.ENABLED = True


if __name__ == "__main__":
    main()
