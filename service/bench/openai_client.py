"""`textgen bench --openai URL`: the same load over any OpenAI-compatible server's streamed
`/v1/completions` (llama.cpp's `llama-server`, vLLM, TGI, textgen behind Envoy), timed by the
same rules as the gRPC load, so that two servers compare on one client.

Each SSE chunk with text counts as the arrival of new tokens; the number of tokens comes
from the final chunk's `usage` (`stream_options.include_usage`) when the server sends it,
else one per chunk (what llama-server and textgen stream).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from .baselines import WARM_UP_TOKENS, distinct_prompts
from .command import RequestResult, summarize


def completion_body(args, prompt: str, max_tokens: int, ignore_eos: bool) -> dict:
    """Greedy, as the gRPC load is; `ignore_eos` is the vLLM/TGI/llama.cpp extension that
    makes every stream produce exactly max_tokens."""
    body = {
        "model": args.model_id or "default",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    return body


async def _stream(client, url: str, body: dict, on_text) -> int | None:
    """POSTs `body` and calls `on_text()` at each chunk carrying text; returns the usage's
    completion_tokens if the server reported it. Raises RuntimeError on an error status."""
    usage = None
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:300]
            raise RuntimeError(f"HTTP {response.status_code}: {detail}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"].get("completion_tokens")
            if any(choice.get("text") for choice in chunk.get("choices") or ()):
                on_text()
    return usage


async def _one(client, url: str, prompt: str, args, progress):
    result = RequestResult()
    start = last = time.perf_counter()
    chunks = 0

    def on_text() -> None:
        nonlocal last, chunks
        now = time.perf_counter()
        if chunks == 0:
            result.ttft = now - start
        else:
            result.itls.append(now - last)
        last = now
        chunks += 1
        progress.update(1)

    try:
        body = completion_body(args, prompt, args.max_new_tokens, args.ignore_eos)
        usage = await _stream(client, url, body, on_text)
        result.output_tokens = usage if usage is not None else chunks
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        result.error = f"{type(exc).__name__}: {exc}"
        result.output_tokens = chunks
    result.latency = time.perf_counter() - start
    return result


async def run_openai_load(args, prompts: list[str]):
    """The --concurrency streams over `args.openai`'s /completions, after a short warm-up
    load at full width (as the gRPC load does)."""
    import httpx
    from tqdm import tqdm

    url = args.openai.rstrip("/") + "/completions"
    n = args.requests or args.concurrency
    work = asyncio.Queue()
    for prompt in distinct_prompts(prompts, n):
        work.put_nowait(prompt)
    results = []
    limits = httpx.Limits(max_connections=args.concurrency + 1)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        warm = [
            completion_body(args, prompt, WARM_UP_TOKENS, True)
            for prompt in distinct_prompts(prompts, args.concurrency)
        ]
        await asyncio.gather(*(_stream(client, url, body, lambda: None) for body in warm))
        with tqdm(
            total=n * args.max_new_tokens, unit="tok", desc="bench", file=sys.stderr
        ) as progress:

            async def worker() -> None:
                while not work.empty():
                    results.append(await _one(client, url, work.get_nowait(), args, progress))

            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            duration = time.perf_counter() - start
    return summarize(args, results, duration)
