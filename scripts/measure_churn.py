"""Memory under churn (not a test): RSS of a real `textgen serve` across many short
streams, to tell a leak from warm-up.

Starts `textgen serve` (the embedded model unless --model-id names another), warms it
up, then runs two phases of N streams each, --concurrency at a time:
  cancel  each stream is cancelled after its first token (a client that disconnects;
          over HTTP through Envoy with --http, else a gRPC cancel),
  finish  each stream runs to its end.
The requests vary as users' do: every prompt is distinct (new prefix-cache blocks), some
sample with a seed, some carry stop sequences, some ask for top tokens, some a JSON
grammar (a matcher each). The server's VmRSS and RssAnon (/proc/PID/status) are sampled
every --every streams; the report gives each phase's growth over its first and second
half: a leak keeps growing in the second half, warm-up does not.

    .venv/bin/python scripts/measure_churn.py [--streams 1000] [--concurrency 8] [--http]
        [--model-id DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from google.protobuf import struct_pb2
from textgen.service.proto import generate_pb2 as pb
from textgen.service.proto import text_generation_service_pb2_grpc as svc_grpc

TEXTGEN = str(Path(sys.executable).with_name("textgen"))
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def rss_kib(pid: int) -> dict[str, int]:
    """VmRSS and RssAnon of `pid`, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) for k in ("VmRSS", "RssAnon")}


def make_request(i: int, max_new_tokens: int) -> pb.GenerateRequest:
    """The i-th request: a distinct prompt, and one of four kinds of parameters."""
    params = pb.GenerateParameters(max_new_tokens=max_new_tokens, details=True)
    kind = i % 4
    if kind == 1:
        params.do_sample, params.seed, params.temperature, params.top_p = True, i, 0.8, 0.9
    elif kind == 2:
        params.stop.extend([f"zq{i}", "\n\n\n"])
        params.top_n_tokens = 3
    elif kind == 3:
        value = struct_pb2.Value()
        value.struct_value.update(SCHEMA)
        params.grammar.CopyFrom(pb.Grammar(type="json", value=value))
    inputs = f"Request {i}: tell me something about the number {i * 7919 % 10007}."
    return pb.GenerateRequest(inputs=inputs, parameters=params)


async def grpc_stream(stub, request: pb.GenerateRequest, cancel: bool) -> None:
    call = stub.GenerateStream(request, timeout=300)
    async for _ in call:
        if cancel:
            call.cancel()
            return


async def http_stream(client, url: str, request: pb.GenerateRequest, cancel: bool) -> None:
    from google.protobuf.json_format import MessageToDict

    body = MessageToDict(request, preserving_proto_field_name=True)
    async with client.stream("POST", f"{url}/generate_stream", json=body, timeout=300) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data:") and cancel:
                return  # leaving the block closes the connection: a disconnect


class Churn:
    def __init__(self, args, pid: int, grpc_target: str, http_url: str | None) -> None:
        self.args, self.pid = args, pid
        self.grpc_target, self.http_url = grpc_target, http_url
        self.samples: dict[str, list[tuple[int, dict[str, int]]]] = {}
        self.errors = 0

    async def phase(self, name: str, first: int, count: int, cancel: bool) -> None:
        import httpx

        samples = self.samples.setdefault(name, [(0, rss_kib(self.pid))])
        next_index = iter(range(first, first + count))
        done = 0
        async with (
            grpc.aio.insecure_channel(self.grpc_target) as channel,
            httpx.AsyncClient(http2=False) as client,
        ):
            stub = svc_grpc.TextGenerationServiceStub(channel)

            async def worker() -> None:
                nonlocal done
                for i in next_index:
                    request = make_request(i, self.args.max_new_tokens)
                    try:
                        if self.args.http and cancel:
                            await http_stream(client, self.http_url, request, cancel)
                        else:
                            await grpc_stream(stub, request, cancel)
                    except (grpc.aio.AioRpcError, httpx.HTTPError) as exc:
                        self.errors += 1
                        print(f"  stream {i}: {exc!r}"[:200], file=sys.stderr)
                    done += 1
                    if done % self.args.every == 0:
                        mark = done
                        await asyncio.sleep(0.2)  # let the engine retire what was cancelled
                        samples.append((mark, rss_kib(self.pid)))
                        print(f"  {name} {mark:>5}: {fmt(samples[-1][1])}", flush=True)

            await asyncio.gather(*(worker() for _ in range(self.args.concurrency)))

    def report(self) -> dict:
        out = {}
        for name, samples in self.samples.items():
            start, mid, end = samples[0][1], samples[len(samples) // 2][1], samples[-1][1]
            out[name] = {
                k: {
                    "start_mib": start[k] / 1024,
                    "first_half_mib": (mid[k] - start[k]) / 1024,
                    "second_half_mib": (end[k] - mid[k]) / 1024,
                }
                for k in start
            }
            out[name]["samples"] = samples
        return out


def fmt(kib: dict[str, int]) -> str:
    return "  ".join(f"{k} {v / 1024:7.1f} MiB" for k, v in kib.items())


def start_server(args) -> tuple[subprocess.Popen, str, str | None, int | None]:
    cmd = [TEXTGEN, "serve", "--grpc-port", "0", "--port", "0"]
    if not args.http:
        cmd.append("--no-envoy")
    if args.model_id:
        cmd += ["--model-id", args.model_id]
    cmd += args.serve_args
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    envoy_pid = None
    for line in proc.stderr:
        if m := re.search(r"envoy \(pid (\d+)\)", line):
            envoy_pid = int(m.group(1))
        if "textgen ready" in line:
            target = re.search(r"grpc=(\S+:\d+)", line).group(1)
            http = re.search(r"http=(http://\S+)", line)
            # keep reading the log, so the server never blocks on a full pipe
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, target, http.group(1) if http else None, envoy_pid
    raise SystemExit(f"textgen serve exited with {proc.wait()} before it was ready")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=1000, help="streams per phase")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--warm-up", type=int, default=200, help="finished streams first")
    parser.add_argument("--every", type=int, default=50, help="streams between samples")
    parser.add_argument("--http", action="store_true", help="cancel through Envoy (HTTP)")
    parser.add_argument("--model-id", help="default: the embedded model")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("serve_args", nargs="*", help="more `textgen serve` flags (after --)")
    args = parser.parse_args()
    proc, target, http_url, envoy_pid = start_server(args)
    print(f"textgen serve pid {proc.pid}: {fmt(rss_kib(proc.pid))}", flush=True)
    churn = Churn(args, proc.pid, target, http_url)
    try:

        async def run() -> None:
            await churn.phase("warm-up", 0, args.warm_up, cancel=False)
            await churn.phase("cancel", args.warm_up, args.streams, cancel=True)
            await churn.phase("finish", args.warm_up + args.streams, args.streams, cancel=False)

        started = time.monotonic()
        asyncio.run(run())
        report = churn.report()
        report["errors"] = churn.errors
        report["seconds"] = time.monotonic() - started
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        if envoy_pid is not None:
            try:
                os.kill(envoy_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for name in ("cancel", "finish"):
        for k, v in report[name].items():
            if k != "samples":
                print(
                    f"{name:>6} {k:>7}: start {v['start_mib']:7.1f} MiB, first half "
                    f"{v['first_half_mib']:+6.1f} MiB, second half {v['second_half_mib']:+6.1f} MiB"
                )
    print(f"errors: {churn.errors}, {report['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
