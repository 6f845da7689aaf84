"""`textgen bench`: a load generator for a running server (or one it starts).

N concurrent GenerateStream calls over gRPC; reports output tokens/s, time to first
token and inter-token latency percentiles, as a table and as JSON. With
--baseline it also measures, in the same run and on the same model, the ceiling
of plain transformers (a batched forward loop with a DynamicCache at the same
batch size, prefill included, the faster of float32 and bfloat16) and naive
sequential `model.generate`, and prints the engine's throughput as ratios of both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain how a transformer language model generates text, step by step.",
    "List three uses of Python in science.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What are the benefits of regular exercise for mental health and for the body?",
    "Translate 'good morning, how are you today?' into French.",
    "How do vaccines train the immune system?",
    "Describe the water cycle.",
    "What is the difference between a list and a tuple in Python?",
    "Write a haiku about autumn leaves falling in the quiet park.",
    "Explain recursion to a ten year old.",
    "What causes the seasons on Earth?",
    "Suggest a name for a friendly robot.",
]


@dataclass
class RequestResult:
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds to the first token
    itls: list[float] = field(default_factory=list)  # seconds between tokens
    latency: float = 0.0
    error: str | None = None


@dataclass
class Report:
    concurrency: int
    requests: int
    max_new_tokens: int
    duration_s: float
    output_tokens: int
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    itl_p50_ms: float
    itl_p95_ms: float
    errors: int
    baseline: dict | None = None
    constrained: dict | None = None  # --grammar: the same load with the grammar, and the ratio


def load_prompts(path: str | None) -> list[str]:
    if not path:
        return PROMPTS
    text = Path(path).read_text()
    if path.endswith(".jsonl"):
        return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    return [line for line in text.splitlines() if line.strip()]


async def _one(client, prompt: str, args, progress, grammar: dict | None) -> RequestResult:
    from textgen.sdk import TextGenError

    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async for message in client.generate_stream(
            prompt,
            max_new_tokens=args.max_new_tokens,
            ignore_eos=args.ignore_eos,
            details=False,
            grammar=grammar,
        ):
            now = time.perf_counter()
            if result.output_tokens == 0:
                result.ttft = now - start
            else:
                result.itls.append(now - last)
            last = now
            result.output_tokens += 1
            progress.update(1)
            if message.details is not None:
                result.prompt_tokens = message.details.input_length
    except TextGenError as exc:
        result.error = f"{exc.error_type}: {exc.message}"
    result.latency = time.perf_counter() - start
    return result


async def run_load(args, prompts: list[str], grammar: dict | None = None) -> Report:
    from textgen.sdk import AsyncClient
    from tqdm import tqdm

    n = args.requests or args.concurrency
    work = asyncio.Queue()
    for i in range(n):
        work.put_nowait(prompts[i % len(prompts)])
    results: list[RequestResult] = []
    async with AsyncClient(args.target, timeout=args.timeout) as client:
        # warm up at full width (allocations, grammar compilation), so that the measured
        # load, and a --grammar run after it, both start from a warm server
        warm = [prompts[i % len(prompts)] for i in range(args.concurrency)]
        await asyncio.gather(*(client.generate(p, max_new_tokens=2, grammar=grammar) for p in warm))
        with tqdm(
            total=n * args.max_new_tokens, unit="tok", desc="bench", file=sys.stderr
        ) as progress:

            async def worker() -> None:
                while not work.empty():
                    results.append(await _one(client, work.get_nowait(), args, progress, grammar))

            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            duration = time.perf_counter() - start
    return summarize(args, results, duration)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0] * 1000
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] * 1000


def summarize(args, results: list[RequestResult], duration: float) -> Report:
    ok = [r for r in results if r.error is None]
    tokens = sum(r.output_tokens for r in results)
    itls = [x for r in ok for x in r.itls]
    return Report(
        concurrency=args.concurrency,
        requests=len(results),
        max_new_tokens=args.max_new_tokens,
        duration_s=round(duration, 3),
        output_tokens=tokens,
        output_tokens_per_s=round(tokens / duration, 2) if duration else 0.0,
        ttft_p50_ms=round(_pct([r.ttft for r in ok], 50), 2),
        ttft_p95_ms=round(_pct([r.ttft for r in ok], 95), 2),
        itl_p50_ms=round(_pct(itls, 50), 2),
        itl_p95_ms=round(_pct(itls, 95), 2),
        errors=len(results) - len(ok),
    )


# baselines ------------------------------------------------------------------------


def measure_baselines(
    model_id: str | None, prompts: list[str], batch: int, max_new_tokens: int
) -> dict:
    """Plain transformers on the same model: the batched forward ceiling (both dtypes,
    the faster counts) and naive sequential generate."""
    import torch
    from textgen.service.models import load_model

    out: dict = {"ceiling_tokens_per_s": {}, "naive_generate_tokens_per_s": None}
    batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
    for dtype in ("float32", "bfloat16"):
        loaded = load_model(model_id, dtype=dtype, device="auto")
        out["ceiling_tokens_per_s"][dtype] = round(
            _forward_ceiling(loaded.model, loaded.tokenizer, batch_prompts, max_new_tokens), 2
        )
        if dtype == "float32":
            out["naive_generate_tokens_per_s"] = round(
                _naive_generate(loaded.model, loaded.tokenizer, batch_prompts[:2], max_new_tokens),
                2,
            )
        del loaded
    best = max(out["ceiling_tokens_per_s"], key=out["ceiling_tokens_per_s"].get)
    out["ceiling_dtype"] = best
    out["ceiling"] = out["ceiling_tokens_per_s"][best]
    torch.set_grad_enabled(True)
    return out


def _forward_ceiling(model, tokenizer, prompts: list[str], max_new_tokens: int) -> float:
    """Left-padded prefill, then greedy decode steps with a DynamicCache: no sampling
    logic, no stopping, no scheduling — what the model's forward pass allows."""
    import torch

    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    with torch.inference_mode():
        _ceiling_run(model, ids, mask, 2)  # warm-up
        start = time.perf_counter()
        _ceiling_run(model, ids, mask, max_new_tokens)
        elapsed = time.perf_counter() - start
    return len(prompts) * max_new_tokens / elapsed


def _ceiling_run(model, ids, mask, steps: int) -> None:
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    for _ in range(steps - 1):
        next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        positions = positions[:, -1:] + 1
        out = model(
            input_ids=next_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
    out.logits[:, -1].argmax(-1).tolist()


def _naive_generate(model, tokenizer, prompts: list[str], max_new_tokens: int) -> float:
    import torch

    tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(model.device)
            out = model.generate(
                ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False
            )
            tokens += out.shape[1] - ids.shape[1]
    return tokens / (time.perf_counter() - start)


# presentation and entry point -----------------------------------------------------


def format_table(report: Report) -> str:
    rows = [
        ("concurrency", report.concurrency),
        ("requests", report.requests),
        ("output tokens", report.output_tokens),
        ("duration (s)", report.duration_s),
        ("output tokens/s", report.output_tokens_per_s),
        ("TTFT p50 / p95 (ms)", f"{report.ttft_p50_ms} / {report.ttft_p95_ms}"),
        ("ITL p50 / p95 (ms)", f"{report.itl_p50_ms} / {report.itl_p95_ms}"),
        ("errors", report.errors),
    ]
    if report.baseline:
        b = report.baseline
        for dtype, value in b["ceiling_tokens_per_s"].items():
            rows.append((f"transformers forward ceiling, {dtype} (tok/s)", value))
        rows.append(("naive sequential generate (tok/s)", b["naive_generate_tokens_per_s"]))
        rows.append(("engine / ceiling", b["engine_over_ceiling"]))
        rows.append(("engine / naive generate", b["engine_over_naive"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", default="127.0.0.1:50051", help="gRPC address of a running server"
    )
    parser.add_argument(
        "--serve",
        action="store_true",
        help="start `textgen serve --no-envoy` for the run and stop it after",
    )
    parser.add_argument(
        "--model-id",
        default=None,
        help="model for --serve and --baseline (default: the embedded model)",
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--requests", type=int, default=None, help="total requests (default: one per stream)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    parser.add_argument(
        "--prompts",
        default=None,
        help="a text file (one prompt a line) or JSONL with a `prompt` field",
    )
    parser.add_argument(
        "--baseline", action="store_true", help="also measure plain transformers on the same model"
    )
    parser.add_argument("--json", default=None, help="write the report here as JSON")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument(
        "--serve-args", default="", help="extra flags for --serve, e.g. '--dtype bfloat16'"
    )
    parser.add_argument(
        "--grammar",
        default=None,
        help='a JSON file holding a TGI grammar ({"type": "json", "value": <schema>}): '
        "the load runs twice, without and with it, and the report gives the "
        "constrained/unconstrained ratio",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --grammar: alternate plain and constrained loads this many times",
    )


def run(args: argparse.Namespace) -> int:
    prompts = load_prompts(args.prompts)
    server = _start_server(args) if args.serve else None
    try:
        report = asyncio.run(run_load(args, prompts))
        if args.grammar:
            report.constrained = _constrained_rounds(args, prompts, report)
    finally:
        if server is not None:
            _stop_server(server)
    if args.baseline:
        base = measure_baselines(args.model_id, prompts, args.concurrency, args.max_new_tokens)
        base["engine_over_ceiling"] = round(report.output_tokens_per_s / base["ceiling"], 3)
        base["engine_over_naive"] = round(
            report.output_tokens_per_s / base["naive_generate_tokens_per_s"], 3
        )
        report.baseline = base
    print(format_table(report))
    if report.constrained:
        c = report.constrained
        print(
            f"constrained ({args.grammar}): {c['output_tokens_per_s']:.1f} tok/s, "
            f"TTFT p50 {c['ttft_p50_ms']:.0f} ms, ITL p50 {c['itl_p50_ms']:.0f} ms, "
            f"errors {c['errors']}; constrained / unconstrained = {c['over_unconstrained']}"
            + (f" (median of {c['ratios']})" if len(c["ratios"]) > 1 else "")
        )
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2))
    return 1 if report.errors or (report.constrained or {}).get("errors") else 0


def _constrained_rounds(args, prompts: list[str], first: Report) -> dict:
    """The load under the grammar, alternating with plain loads for --rounds rounds: a
    shared machine's speed drifts between loads, so each constrained load is compared
    with the plain one just before it, and the median ratio is reported."""
    grammar = json.loads(Path(args.grammar).read_text())
    plain, ratios, constrained = first, [], None
    for round_ in range(args.rounds):
        if round_:
            plain = asyncio.run(run_load(args, prompts))
        constrained = asyncio.run(run_load(args, prompts, grammar))
        ratios.append(round(constrained.output_tokens_per_s / plain.output_tokens_per_s, 3))
    return {
        **asdict(constrained),
        "ratios": ratios,
        "over_unconstrained": statistics.median(ratios),
    }


def _start_server(args) -> subprocess.Popen:
    import shlex
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        str(Path(sys.executable).parent / "textgen"),
        "serve",
        "--no-envoy",
        "--grpc-port",
        str(port),
    ]
    if args.model_id:
        cmd += ["--model-id", args.model_id]
    cmd += shlex.split(args.serve_args)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        sys.stderr.write(line)
        if "textgen ready" in line:
            break
    else:
        raise RuntimeError("the server exited before it was ready")
    args.target = f"127.0.0.1:{port}"
    # keep draining its log so it never blocks on a full pipe
    import threading

    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    return proc


def _stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
