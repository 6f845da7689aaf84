"""Would an API process beside an engine process (vLLM's split) make serving cheaper
here? Measure the engine core alone under a synthetic serving load (not a test).

The served engine shares its process with the gRPC event loop: the loop's Python work
holds the GIL, and the core's thread waits for the GIL after every torch op. A split
would take that GIL away from the core, not the CPU time. So: the core alone (the bench's
`CoreAlone`, the served load of `textgen bench --core`) runs the same load three ways,
alternating, several rounds:

- quiet: nothing else running;
- thread: a thread of this process does the event loop's share of work after every
  step-long pause: `--chunks` bursts of pure Python (it holds the GIL), `--burst-ms` in all;
- process: the same work in another process (the CPU taken, no GIL shared).

If `thread` costs the core clearly more than `process`, the GIL is what serving costs
and the split would pay; if they cost the same, only less serving CPU would. Run:

    .venv/bin/python scripts/measure_serving_noise.py [--dtype bfloat16] [--burst-ms 2]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import threading
import time


def serving_noise(stop, period_s: float, burst_ms: float, chunks: int) -> None:
    """Every `period_s`, `chunks` pieces of busy Python, `burst_ms` in all."""
    piece = burst_ms / 1000 / chunks
    while not stop.is_set():
        time.sleep(period_s)
        for _ in range(chunks):
            started = time.perf_counter()
            while time.perf_counter() - started < piece:
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--burst-ms", type=float, default=2.0, help="serving work per period")
    parser.add_argument("--period-ms", type=float, default=75.0, help="about one decode step")
    parser.add_argument("--chunks", type=int, default=32, help="pieces per burst (one a token)")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()

    from textgen.service.bench.baselines import CoreAlone
    from textgen.service.bench.loads import LOADS
    from textgen.service.settings.table import Settings

    settings = Settings(
        dtype=args.dtype,
        max_batch_total_tokens=65536,
        max_batch_prefill_tokens=4096,
        max_batch_size=256,
    )
    core = CoreAlone(settings, LOADS["chat"], {})
    noise = (args.period_ms / 1000, args.burst_ms, args.chunks)
    results: dict[str, list[float]] = {"quiet": [], "thread": [], "process": []}
    for round_ in range(args.rounds):
        for mode, values in results.items():
            worker = None
            if mode == "thread":
                stop = threading.Event()
                worker = threading.Thread(target=serving_noise, args=(stop, *noise))
            elif mode == "process":
                stop = multiprocessing.Event()
                worker = multiprocessing.Process(target=serving_noise, args=(stop, *noise))
            if worker is not None:
                worker.start()
                time.sleep(1.0 if mode == "process" else 0.0)  # the child imports nothing
            out = core.run(
                concurrency=args.concurrency,
                requests=args.concurrency,
                max_new_tokens=args.max_new_tokens,
                ignore_eos=True,
            )
            if worker is not None:
                stop.set()
                worker.join()
            values.append(out["output_tokens_per_s"])
            print(
                f"round {round_ + 1} {mode:8s} {out['output_tokens_per_s']:8.1f} tok/s  "
                f"decode step p50 {out['decode_step_p50_ms']} ms",
                flush=True,
            )
    quiet = statistics.median(results["quiet"])
    for mode, values in results.items():
        median = statistics.median(values)
        print(f"{mode:8s} median {median:8.1f} tok/s  / quiet {median / quiet:.3f}")


if __name__ == "__main__":
    multiprocessing.set_start_method("spawn")
    main()
