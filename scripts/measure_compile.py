"""Measure the compiled decode step (service/engine/runners/compiled.py) against the eager one
(not a test).

For each batch size: two PagedCores on the same model, one eager, one with its decode step
compiled for that batch only; both decode the same ~100-token prompts, their steps
alternating so load from other processes hits both alike. Prints the time the compile took
and the median step time (wall, and CPU time of this process, steadier on a shared machine
with --threads 1), and whether both produced the same tokens (float32 should).

    .venv/bin/python scripts/measure_compile.py [--dtype bfloat16] [--threads 1] [--batches 1 8 32]
        [--quantize int8|int4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from measure_core import load_model, make_seq, prompts
from textgen.service.engine.config import EngineConfig
from textgen.service.engine.paged_core import PagedCore
from textgen.service.engine.runners.compiled import CompileSettings
from textgen.service.models.quantize import quantize_model
from textgen.service.replica.assembly import build_core


def decoding_core(model, batch: int, steps: int, compiled: bool) -> tuple[PagedCore, list, float]:
    """A core with `batch` sequences past their prefill, and its warm-up seconds."""
    core = build_core(
        EngineConfig(
            max_batch_total_tokens=batch * (140 + steps + 32),
            max_batch_prefill_tokens=4096,
            max_batch_size=batch,
            compile=CompileSettings((batch,)) if compiled else None,  # this batch's bucket only
        ),
        model,
    )
    start = time.perf_counter()
    core.warm_up()
    warm_up = time.perf_counter() - start
    batch_prompts = prompts(batch, model.config.vocab_size, seed=batch)
    seqs = [make_seq(p, i, steps + 20) for i, p in enumerate(batch_prompts)]
    for seq in seqs:
        core.add(seq)
    while any(seq.in_prefill for seq in seqs):
        core.step()
    return core, seqs, warm_up


def compare(model, batch: int, steps: int) -> None:
    torch._dynamo.reset()
    eager, eager_seqs, _ = decoding_core(model, batch, steps, compiled=False)
    compiled, compiled_seqs, warm_up = decoding_core(model, batch, steps, compiled=True)
    wall = {"eager": [], "compiled": []}
    cpu = {"eager": [], "compiled": []}
    for _ in range(steps):
        for name, core in (("eager", eager), ("compiled", compiled)):
            cpu_start, start = time.process_time(), time.perf_counter()
            core.step()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - cpu_start)
    ms = {k: 1000 * statistics.median(v) for k, v in wall.items()}
    cpu_ms = {k: 1000 * statistics.median(v) for k, v in cpu.items()}
    same = [s.token_ids for s in eager_seqs] == [s.token_ids for s in compiled_seqs]
    print(
        f"{batch:>5} {warm_up:>9.1f} {ms['eager']:>8.1f} {ms['compiled']:>8.1f} "
        f"{ms['eager'] / ms['compiled']:>6.2f}x {cpu_ms['eager']:>8.1f} {cpu_ms['compiled']:>8.1f} "
        f"{cpu_ms['eager'] / cpu_ms['compiled']:>6.2f}x {same!s:>6}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed per core")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--quantize", help="quantize the weights first (service/models/quantize.py)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, source = load_model(getattr(torch, args.dtype))
    if args.quantize:
        quantize_model(model, args.quantize, torch.device("cpu"))
    print(
        f"model: {source}, {args.dtype}, quantize {args.quantize}, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(
        f"{'batch':>5} {'compile s':>9} {'eager ms':>8} {'comp ms':>8} {'wall':>7} "
        f"{'eager cpu':>8} {'comp cpu':>8} {'cpu':>7} {'same':>6}"
    )
    for batch in args.batches:
        compare(model, batch, args.steps)


if __name__ == "__main__":
    main()
