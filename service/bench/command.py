"""`textgen bench`: a load generator for a running server (or one it starts).

N concurrent GenerateStream calls over gRPC; reports output tokens/s, time to first
token and inter-token latency percentiles, as a table and as JSON. In the same run,
after the served load and on the same prompts, `--core` measures the engine core alone
and `--baseline` plain transformers (baselines.py), and the report gives the
served figures as ratios of theirs. `--compare-serve-args` prices a server flag: a second
server with it, loads alternating between the two; `--adapters` prices LoRA: the same load
with its streams spread over the server's adapters, against the base model's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..settings.table import Settings, add_serve_arguments, settings_from_args
from .baselines import (
    WARM_UP_TOKENS,
    CoreAlone,
    PlainLoop,
    distinct_prompts,
)
from .loads import LOADS

PROMPTS = LOADS["chat"]


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
    sampling: dict = field(default_factory=dict)  # --temperature/--top-p/...; {}: greedy
    ignore_eos: bool = False  # every stream ran to max_new_tokens (--ignore-eos, --baseline)
    load: str = "chat"  # the built-in prompts (--load), or the --prompts file
    # a speculating server's proposals during the load: proposed and kept tokens, the
    # acceptance ratio and the tokens kept per verifying decode
    speculation: dict | None = None
    baseline: dict | None = None  # --baseline: plain transformers, and served / theirs
    core: dict | None = None  # --core: the engine core alone, and served / core
    constrained: dict | None = None  # --grammar: the same load with the grammar, and the ratio
    compared: dict | None = None  # --compare-serve-args: the second server's load, and the ratio
    lora: dict | None = None  # --adapters: the load spread over them, and the ratio to the base
    # --serve: the server's resident memory after the load, and its peak (Linux /proc)
    server_rss_mib: float | None = None
    # --serve: the server process's CPU time over the load (user + system, all threads), and
    # output tokens per CPU second: on a shared machine, where other processes take the
    # cores for a while, this moves less than tokens per wall second
    server_cpu_s: float | None = None
    tokens_per_server_cpu_s: float | None = None
    server_peak_rss_mib: float | None = None


def load_prompts(path: str | None, load: str = "chat") -> list[str]:
    """--prompts FILE, else the built-in --load (loads.py)."""
    if not path:
        return LOADS[load]
    text = Path(path).read_text()
    if path.endswith(".jsonl"):
        return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    return [line for line in text.splitlines() if line.strip()]


async def _drain(call) -> None:
    async for _ in call:
        pass


def _request(
    prompt: str,
    max_new_tokens: int,
    ignore_eos: bool,
    grammar: dict | None,
    sampling: dict,
    adapter: str | None = None,
):
    from google.protobuf import json_format
    from textgen.service.proto import generate_pb2 as pb

    params = pb.GenerateParameters(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, **sampling)
    if adapter is not None:
        params.adapter_id = adapter
    if grammar is not None:
        params.grammar.type = grammar["type"]
        json_format.ParseDict(grammar["value"], params.grammar.value)
    return pb.GenerateRequest(inputs=prompt, parameters=params)


async def _one(
    stub, prompt: str, args, progress, grammar: dict | None, adapter: str | None = None
) -> RequestResult:
    import grpc

    result = RequestResult()
    request = _request(
        prompt, args.max_new_tokens, args.ignore_eos, grammar, sampling_options(args), adapter
    )
    start = last = time.perf_counter()
    try:
        async for message in stub.GenerateStream(request, timeout=args.timeout):
            if message.error_type:  # TGI's in-band error, before the failing status
                result.error = f"{message.error_type}: {message.error}"
                break
            now = time.perf_counter()
            if result.output_tokens == 0:
                result.ttft = now - start
            else:
                result.itls.append(now - last)
            last = now
            result.output_tokens += 1
            progress.update(1)
            if message.HasField("details"):
                result.prompt_tokens = message.details.input_length
    except grpc.aio.AioRpcError as exc:
        result.error = f"{exc.code().name}: {exc.details()}"
    result.latency = time.perf_counter() - start
    return result


async def run_load(
    args, prompts: list[str], grammar: dict | None = None, adapters: list[str] | None = None
) -> Report:
    """The load, on grpc.aio with the server's own protobuf classes (upb: a fraction of a
    microsecond per message, where betterproto2 takes ~10 us): the client shares the CPU
    with the server it measures, so it takes as little of it as it can. `adapters`: request
    i asks for adapters[i % len] (LoRA)."""
    import grpc
    from textgen.service.proto import text_generation_service_pb2_grpc as svc_grpc
    from tqdm import tqdm

    n = args.requests or args.concurrency
    work = asyncio.Queue()
    for i, prompt in enumerate(distinct_prompts(prompts, n)):
        work.put_nowait((prompt, adapters[i % len(adapters)] if adapters else None))
    results: list[RequestResult] = []
    async with grpc.aio.insecure_channel(args.target) as channel:
        stub = svc_grpc.TextGenerationServiceStub(channel)
        # warm up with a short load at full width (allocations, grammar compilation, the
        # connection's flow-control windows), so that the measured load, and a --grammar
        # or --core run after it, all start from a warm server
        warm = [
            _request(
                prompt,
                WARM_UP_TOKENS,
                True,
                grammar,
                sampling_options(args),
                adapters[i % len(adapters)] if adapters else None,
            )
            for i, prompt in enumerate(distinct_prompts(prompts, args.concurrency))
        ]
        await asyncio.gather(*(_drain(stub.GenerateStream(r, timeout=args.timeout)) for r in warm))
        with tqdm(
            total=n * args.max_new_tokens,
            unit="tok",
            desc="bench",
            file=sys.stderr,
            mininterval=1.0,
        ) as progress:

            async def worker() -> None:
                while not work.empty():
                    prompt, adapter = work.get_nowait()
                    results.append(await _one(stub, prompt, args, progress, grammar, adapter))

            before = await _speculation_counters(stub)
            pid = getattr(args, "server_pid", None)
            cpu = _cpu_seconds(pid)
            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            duration = time.perf_counter() - start
            cpu = _cpu_seconds(pid) - cpu if cpu is not None else None
            after = await _speculation_counters(stub)
    report = summarize(args, results, duration)
    report.speculation = _speculation_delta(before, after)
    if cpu:
        report.server_cpu_s = round(cpu, 2)
        report.tokens_per_server_cpu_s = round(report.output_tokens / cpu, 2)
    return report


def _cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of a process and all its threads so far (Linux /proc)."""
    import os

    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


# the server's cumulative speculation gauges (observability/metrics.py)
_SPECULATION_GAUGES = {
    "proposed": "textgen_speculative_proposed_tokens",
    "accepted": "textgen_speculative_accepted_tokens",
    "verifications": "textgen_speculative_verifications",
}


async def _speculation_counters(stub) -> dict[str, float] | None:
    """The server's speculation counters now (None when it doesn't speculate)."""
    from textgen.service.proto import text_generation_service_pb2 as svc

    info = await stub.Info(svc.InfoRequest())
    if not info.speculate:
        return None
    text = (await stub.Metrics(svc.MetricsRequest())).data.decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = value
    return {key: float(values.get(name, 0)) for key, name in _SPECULATION_GAUGES.items()}


def _speculation_delta(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    d = {key: int(after[key] - before[key]) for key in _SPECULATION_GAUGES}
    d["acceptance_ratio"] = round(d["accepted"] / d["proposed"], 3) if d["proposed"] else 0.0
    d["accepted_per_verification"] = (
        round(d["accepted"] / d["verifications"], 3) if d["verifications"] else 0.0
    )
    return d


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
        sampling=sampling_options(args),
        ignore_eos=args.ignore_eos,
        load=args.prompts or args.load,
    )


def sampling_options(args) -> dict:
    """The requests' sampling parameters, as TGI's GenerateParameters and the engine's
    SamplingParams both name them: --temperature, --top-p, --top-k and --typical-p (any of
    them samples) and --repetition-penalty (greedy or sampled alike); {}: plain greedy."""
    drawn = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "typical_p": args.typical_p,
    }
    drawn = {k: v for k, v in drawn.items() if v is not None}
    penalty = {"repetition_penalty": args.repetition_penalty}
    penalty = {k: v for k, v in penalty.items() if v is not None}
    return ({"do_sample": True, **drawn} if drawn else {}) | penalty


# presentation and entry point -----------------------------------------------------


def format_table(report: Report) -> str:
    rows = [
        ("load", report.load),
        ("concurrency", report.concurrency),
        ("sampling", ", ".join(f"{k}={v}" for k, v in report.sampling.items()) or "greedy"),
        ("stops at EOS", "no (--ignore-eos)" if report.ignore_eos else "yes"),
        ("requests", report.requests),
        ("output tokens", report.output_tokens),
        ("duration (s)", report.duration_s),
        ("output tokens/s", report.output_tokens_per_s),
        ("TTFT p50 / p95 (ms)", f"{report.ttft_p50_ms} / {report.ttft_p95_ms}"),
        ("ITL p50 / p95 (ms)", f"{report.itl_p50_ms} / {report.itl_p95_ms}"),
        ("errors", report.errors),
    ]
    if report.speculation:
        s = report.speculation
        kept = f"{s['accepted']} / {s['proposed']} ({s['acceptance_ratio']}; "
        kept += f"{s['accepted_per_verification']} per verification)"
        rows.append(("speculation: kept / proposed", kept))
    if report.tokens_per_server_cpu_s is not None:
        cpu = f"{report.server_cpu_s} / {report.tokens_per_server_cpu_s}"
        rows.append(("server CPU s / tokens per CPU s", cpu))
    if report.server_rss_mib is not None:
        rows.append(
            ("server RSS / peak (MiB)", f"{report.server_rss_mib} / {report.server_peak_rss_mib}")
        )
    compared = report.core or report.baseline
    if compared and len(compared.get("rounds", ())) > 1:
        # the rows above are the first load's; those below, medians over the rounds
        rows.append(
            (f"served tok/s, median of {len(compared['rounds'])} rounds",
             compared["served_output_tokens_per_s"])
        )  # fmt: skip
    if report.core:
        c = report.core
        rows.append((f"core alone, {c['dtype']} (tok/s)", c["output_tokens_per_s"]))
        rows.append(("core decode step p50 (ms)", c["decode_step_p50_ms"]))
        rows.append(("served / core alone", c["served_over_core"]))
        rows.append(("served ITL p50 / core step", c.get("itl_p50_over_core_step")))
    if report.baseline:
        b = report.baseline
        rows.append((f"transformers greedy loop, {b['dtype']} (tok/s)", b["loop_tokens_per_s"]))
        rows.append(("naive sequential generate (tok/s)", b["naive_generate_tokens_per_s"]))
        rows.append(("served / transformers loop", b["served_over_loop"]))
        rows.append(("served / naive generate", b["served_over_naive"]))
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
        help="model for --serve, --core and --baseline (default: the embedded model); with "
        "--target, name the model the server serves",
    )
    parser.add_argument(
        "--openai",
        default=None,
        metavar="URL",
        help="time an OpenAI-compatible server instead (e.g. http://127.0.0.1:8080/v1, "
        "llama.cpp's llama-server or textgen behind Envoy): streamed /completions, greedy, "
        "the same prompts and figures; --model-id names its model",
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--requests", type=int, default=None, help="total requests (default: one per stream)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    for flag, kind in (
        ("--temperature", float),
        ("--top-p", float),
        ("--top-k", int),
        ("--typical-p", float),
    ):
        parser.add_argument(
            flag,
            type=kind,
            default=None,
            help="sample (served load and --core alike) instead of decoding greedily",
        )
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="penalize the prompt's and output's tokens (served load and --core alike)",
    )
    parser.add_argument(
        "--prompts",
        default=None,
        help="a text file (one prompt a line) or JSONL with a `prompt` field",
    )
    parser.add_argument(
        "--load",
        choices=sorted(LOADS),
        default="chat",
        help="the built-in prompts when --prompts is not given: chat (questions answered in "
        "new words) or copy (code and passages written out again with small edits, records "
        "extracted to JSON: where speculative decoding's n-gram lookup finds its proposals)",
    )
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="after the load, measure plain transformers' greedy loop on the same model, "
        "prompts and dtype (implies --ignore-eos: the loop runs every prompt to "
        "--max-new-tokens, so the load does too)",
    )
    parser.add_argument(
        "--core",
        action="store_true",
        help="after the load, run the same requests through the engine core alone (the "
        "server's engine as its settings build it, no serving): served / core, and the ITL "
        "against the core's step",
    )
    parser.add_argument("--json", default=None, help="write the report here as JSON")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument(
        "--serve-args", default="", help="extra flags for --serve, e.g. '--dtype bfloat16'"
    )
    parser.add_argument(
        "--compare-serve-args",
        default="",
        help="with --serve: start a second server with these extra flags too (e.g. "
        "--compare-serve-args=--deterministic) and alternate loads between the two "
        "(--rounds): the report gives its tok/s over the first's",
    )
    parser.add_argument(
        "--grammar",
        default=None,
        help='a JSON file holding a TGI grammar ({"type": "json", "value": <schema>}): '
        "the load runs twice, without and with it, and the report gives the "
        "constrained/unconstrained ratio",
    )
    parser.add_argument(
        "--adapters",
        default=None,
        help="comma-separated LoRA adapters the server serves: the load runs again with its "
        "requests spread over them (round robin), and the report gives its tok/s over the "
        "base model's (with --rounds: alternating, the median ratio)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --grammar: alternate plain and constrained loads this many times; with "
        "--compare-serve-args: loads on the two servers; with --core or --baseline: served "
        "and comparison runs (the ratios, and the served, core and loop figures beside them, "
        "are medians over the rounds)",
    )


def run(args: argparse.Namespace) -> int:
    if args.compare_serve_args and not args.serve:
        raise SystemExit("--compare-serve-args needs --serve")
    if args.baseline and sampling_options(args):
        raise SystemExit(
            "--baseline times transformers' greedy loop: leave out --temperature, --top-p, "
            "--top-k, --typical-p and --repetition-penalty (--core compares that load)"
        )
    if args.baseline:
        # the loop runs every prompt to --max-new-tokens: a load whose streams end at EOS
        # pays a prefill per ~10 tokens where the loop pays one per max-new-tokens
        args.ignore_eos = True
    if args.openai and sampling_options(args):
        raise SystemExit(
            "--openai times greedy completions: leave out --temperature, --top-p, --top-k, "
            "--typical-p and --repetition-penalty"
        )
    prompts = load_prompts(args.prompts, args.load)
    if args.openai:
        return _run_openai(args, prompts)
    servers = []
    try:
        if args.serve:
            server, args.target = _start_server(args, args.serve_args)
            servers.append(server)
            args.server_pid = server.pid
        if args.compare_serve_args:
            server, compared_target = _start_server(
                args, f"{args.serve_args} {args.compare_serve_args}"
            )
            servers.append(server)
        settings = asyncio.run(served_settings(args))
        report = asyncio.run(run_load(args, prompts))
        if args.grammar:
            report.constrained = _constrained_rounds(args, prompts, report)
        if args.adapters:
            report.lora = _adapter_rounds(args, prompts, report)
        if args.compare_serve_args:
            report.compared = _compared_rounds(
                args, prompts, report, compared_target, servers[-1].pid
            )
        if args.core or args.baseline:
            _comparison_rounds(args, prompts, settings, report)
    finally:
        memory = _rss_mib(servers[0].pid) if servers else (None, None)
        for server in servers:
            _stop_server(server)
    if servers:
        report.server_rss_mib, report.server_peak_rss_mib = memory
    print(format_table(report))
    if report.constrained:
        c = report.constrained
        print(
            f"constrained ({args.grammar}): {c['output_tokens_per_s']:.1f} tok/s, "
            f"TTFT p50 {c['ttft_p50_ms']:.0f} ms, ITL p50 {c['itl_p50_ms']:.0f} ms, "
            f"errors {c['errors']}; constrained / unconstrained = {c['over_unconstrained']}"
            + (f" (median of {c['ratios']})" if len(c["ratios"]) > 1 else "")
        )
    if report.lora:
        c = report.lora
        print(
            f"over adapters {c['adapters']}: {c['output_tokens_per_s']:.1f} tok/s, "
            f"ITL p50 {c['itl_p50_ms']:.0f} ms, errors {c['errors']}; "
            f"adapters / base = {c['over_base']}"
            + (f" (median of {c['ratios']})" if len(c["ratios"]) > 1 else "")
        )
    if report.compared:
        c = report.compared
        print(
            f"with {c['serve_args']!r}: {c['output_tokens_per_s']:.1f} tok/s, "
            f"ITL p50 {c['itl_p50_ms']:.0f} ms, errors {c['errors']}; "
            f"over without = {c['over_served']}"
            + (f" (median of {c['ratios']})" if len(c["ratios"]) > 1 else "")
        )
        if c.get("cpu_ratios"):
            print(
                f"  per server CPU second: over without = {c['over_served_per_cpu_s']}"
                + (f" (median of {c['cpu_ratios']})" if len(c["cpu_ratios"]) > 1 else "")
            )
        if c.get("speculation"):
            s = c["speculation"]
            print(
                f"  its speculation (last load): kept {s['accepted']} of {s['proposed']} proposed "
                f"tokens ({s['acceptance_ratio']}), {s['accepted_per_verification']} per "
                f"verification"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2))
    failed = [
        report.errors,
        (report.constrained or {}).get("errors"),
        (report.lora or {}).get("errors"),
    ]
    return 1 if any(failed) or (report.compared or {}).get("errors") else 0


def _run_openai(args: argparse.Namespace, prompts: list[str]) -> int:
    """--openai URL: the load on another server's OpenAI face; nothing else to compare in
    the same run (--core and the rest need this project's gRPC Info)."""
    from .openai_client import run_openai_load

    others = ["serve", "core", "baseline", "grammar", "compare_serve_args"]
    if given := [f"--{name.replace('_', '-')}" for name in others if getattr(args, name)]:
        raise SystemExit(f"--openai times a server over HTTP only; drop {', '.join(given)}")
    report = asyncio.run(run_openai_load(args, prompts))
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2))
    return 1 if report.errors else 0


# The Info fields that say how the served engine is built, each a Settings field of the
# same name (tests/service/test_bench_info.py holds them to both messages): --core builds
# its engine with them when the bench did not start the server. The other fields shared
# with Settings are the front's limits, the engine loop's (torch_threads, arrival_gap_ms),
# or, for LoRA, need the adapters' sources that Info doesn't give.
ENGINE_INFO_FIELDS = (
    "quantize",
    "max_batch_prefill_tokens",
    "max_batch_size",
    "deterministic",
    "compile",
    "cuda_graphs",
    "speculate",
    "speculate_max_batch",
    "speculate_model",
)


async def served_settings(args) -> Settings:
    """The settings the served engine runs with, so that --core builds the same engine and
    --baseline loads the same model in the same dtype: the serve flags when this bench
    started the server (--serve), else what the server's Info says (ENGINE_INFO_FIELDS; an
    unset optional field is None); the KV pool the size the server's is, and its dtype,
    either way."""
    from textgen.sdk import AsyncClient

    async with AsyncClient(args.target, timeout=args.timeout) as client:
        info = await client.info()
    if args.serve:
        settings = _parse_serve_args(args)
    else:
        settings = Settings(
            model_id=args.model_id, **{name: getattr(info, name) for name in ENGINE_INFO_FIELDS}
        )
    return replace(
        settings,
        # a server whose auto gave small steps int8 copies: the core the same (its
        # model_dtype named would load without them; the plain loop has none)
        dtype="auto" if info.small_step_int8_tokens else info.model_dtype,
        max_batch_total_tokens=info.max_batch_total_tokens,
        num_shard=None,  # the engine alone runs on one shard
    )


def _parse_serve_args(args) -> Settings:
    """`textgen serve`'s settings from the flags _start_server gave it (and the same
    environment, which the server inherited)."""
    import shlex

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    argv = (["--model-id", args.model_id] if args.model_id else []) + shlex.split(args.serve_args)
    return settings_from_args(parser.parse_args(argv))


def _comparison_rounds(args, prompts: list[str], settings: Settings, report: Report) -> None:
    """The same load through the engine core alone (--core) and plain transformers'
    greedy loop (--baseline), in this process while the server idles, alternating with
    the served load for --rounds rounds: each is compared with the served load just
    before it and the median ratios are reported (a shared machine's speed drifts
    between loads). Fills report.core and report.baseline."""
    core_alone = CoreAlone(settings, prompts, sampling_options(args)) if args.core else None
    loop = PlainLoop(settings) if args.baseline else None
    requests = args.requests or args.concurrency
    served, core_rounds, loop_rounds = report, [], []
    for round_ in range(args.rounds):
        if round_:
            served = asyncio.run(run_load(args, prompts))
        if core_alone is not None:
            core = core_alone.run(
                concurrency=args.concurrency,
                requests=requests,
                max_new_tokens=args.max_new_tokens,
                ignore_eos=args.ignore_eos,
            )
            core["served_output_tokens_per_s"] = served.output_tokens_per_s
            core["served_over_core"] = _ratio(
                served.output_tokens_per_s, core["output_tokens_per_s"]
            )
            if core["decode_step_p50_ms"]:
                core["served_itl_p50_ms"] = served.itl_p50_ms
                core["itl_p50_over_core_step"] = _ratio(
                    served.itl_p50_ms, core["decode_step_p50_ms"]
                )
            core_rounds.append(core)
        if loop is not None:
            plain = loop.run(prompts, args.concurrency, args.max_new_tokens)
            plain["served_output_tokens_per_s"] = served.output_tokens_per_s
            plain["served_over_loop"] = _ratio(
                served.output_tokens_per_s, plain["loop_tokens_per_s"]
            )
            loop_rounds.append(plain)
    if core_rounds:
        report.core = _medians(core_rounds, _CORE_MEDIANS)
    if loop_rounds:
        report.baseline = _medians(loop_rounds, _LOOP_MEDIANS)
        naive = loop.naive_generate(prompts, args.max_new_tokens)
        report.baseline["naive_generate_tokens_per_s"] = naive
        served_tok_s = report.baseline["served_output_tokens_per_s"]
        report.baseline["served_over_naive"] = _ratio(served_tok_s, naive)


# what _medians takes the median of: each ratio, and the figures it divides, so the
# printed served, core and loop figures agree with the ratio printed beside them
_CORE_MEDIANS = (
    "served_over_core",
    "itl_p50_over_core_step",
    "output_tokens_per_s",
    "decode_step_p50_ms",
    "served_output_tokens_per_s",
    "served_itl_p50_ms",
)
_LOOP_MEDIANS = ("served_over_loop", "loop_tokens_per_s", "served_output_tokens_per_s")


def _ratio(a: float, b: float) -> float:
    """a / b to 4 significant digits (a tiny model's served / core can be 0.0068)."""
    return float(f"{a / b:.4g}") if b else 0.0


def _medians(rounds: list[dict], keys: tuple[str, ...]) -> dict:
    """Every round's figures, and the median over the rounds of each of `keys` (the
    last round's value for any other key)."""
    out = dict(rounds[-1])
    out["rounds"] = rounds
    for key in keys:
        if all(r.get(key) is not None for r in rounds):
            out[key] = statistics.median(r[key] for r in rounds)
    return out


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


def _adapter_rounds(args, prompts: list[str], first: Report) -> dict:
    """The load spread over --adapters, alternating with base loads for --rounds rounds,
    each compared with the base load just before it; the median ratio."""
    adapters = [a.strip() for a in args.adapters.split(",") if a.strip()]
    base, ratios, spread = first, [], None
    for round_ in range(args.rounds):
        if round_:
            base = asyncio.run(run_load(args, prompts))
        spread = asyncio.run(run_load(args, prompts, adapters=adapters))
        ratios.append(round(spread.output_tokens_per_s / base.output_tokens_per_s, 3))
    return {
        **asdict(spread),
        "adapters": adapters,
        "ratios": ratios,
        "over_base": statistics.median(ratios),
    }


def _compared_rounds(
    args, prompts: list[str], first: Report, target: str, pid: int | None = None
) -> dict:
    """The load on the second server (--compare-serve-args, process `pid`), alternating
    with loads on the first for --rounds rounds; each compared with the first's load just
    before it (a shared machine's speed drifts), and the median ratio reported: of tokens
    per wall second, and of tokens per server CPU second."""
    import copy

    other = copy.copy(args)
    other.target = target
    other.server_pid = pid
    served, ratios, cpu_ratios, compared = first, [], [], None
    for round_ in range(args.rounds):
        if round_:
            served = asyncio.run(run_load(args, prompts))
        compared = asyncio.run(run_load(other, prompts))
        ratios.append(round(compared.output_tokens_per_s / served.output_tokens_per_s, 3))
        if compared.tokens_per_server_cpu_s and served.tokens_per_server_cpu_s:
            cpu_ratios.append(
                round(compared.tokens_per_server_cpu_s / served.tokens_per_server_cpu_s, 3)
            )
    return {
        **asdict(compared),
        "serve_args": args.compare_serve_args,
        "ratios": ratios,
        "over_served": statistics.median(ratios),
        "cpu_ratios": cpu_ratios,
        "over_served_per_cpu_s": statistics.median(cpu_ratios) if cpu_ratios else None,
    }


def _start_server(args, serve_args: str) -> tuple[subprocess.Popen, str]:
    """`textgen serve --no-envoy` with `serve_args`, on a free port: (process, target)."""
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
    cmd += shlex.split(serve_args)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        sys.stderr.write(line)
        if "textgen ready" in line:
            break
    else:
        raise RuntimeError("the server exited before it was ready")
    # keep draining its log so it never blocks on a full pipe
    import threading

    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    return proc, f"127.0.0.1:{port}"


def _rss_mib(pid: int) -> tuple[float | None, float | None]:
    """(VmRSS, VmHWM) of a process in MiB; None where /proc doesn't say."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None, None

    def mib(key: str) -> float | None:
        value = fields.get(key, "").split()
        return round(int(value[0]) / 1024, 1) if value else None  # kB

    return mib("VmRSS"), mib("VmHWM")


def _stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
