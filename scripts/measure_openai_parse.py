"""Measure the cost of parsing an OpenAI request body (not a test).

Times service/openai's parse functions on realistic bodies, in microseconds of CPU per
request (process time, so that other processes on the machine count less; the median
and the minimum of `--repeat` runs of `--number` parses each): a ~2 KB chat completions
body (system prompt, a few turns, a tool, sampling fields, stop, logprobs), a
completions body and a Responses API body. Chat and responses go through the chat
template (the tiny test tokenizer's, tests/support/tiny_model.py), as a request does; the
"template stubbed" rows replace it with a constant, leaving the parsing itself.

`--baseline REV` also times service/ as it was at git revision REV (extracted into a
temporary folder, imported as `textgen_baseline.service`), the two alternating run by
run in this one process, so that whatever else the machine does weighs on both alike.
Run:

    .venv/bin/python scripts/measure_openai_parse.py [--baseline REV] [--number 2000] [--repeat 15]
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from support.tiny_model import build_tokenizer
from textgen.service.openai.response_store import ResponseStore

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city, in metric units.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "The city's name, e.g. Paris"},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city"],
        "additionalProperties": False,
    },
}
TURNS = [
    ("user", "I'm planning a trip to France next month. What should I pack for Paris?"),
    (
        "assistant",
        (
            "Paris in spring is mild but changeable: pack layers, a light waterproof jacket,"
            " comfortable walking shoes and an umbrella. Evenings can be cool, so bring a"
            " sweater. Would you like me to check the forecast for your dates?"
        ),
    ),
    ("user", "Yes please, and also tell me what the weather is like in Lyon this week."),
    (
        "assistant",
        (
            "Lyon is usually a couple of degrees warmer than Paris at this time of year, with"
            " occasional showers in the afternoon. I can look up the current forecast for both."
        ),
    ),
    (
        "user",
        (
            "Great, check Paris first. Keep the answer short and give temperatures in C; if it"
            " will rain, tell me which days so I can plan the museums for those."
        ),
    ),
]
CHAT = {
    "model": "tgi",
    "messages": [
        {
            "role": "system",
            "content": "You are a concise travel assistant. Answer in plain English, use"
            " metric units, and call a tool when live data is needed. Never invent a"
            " forecast: if the tool fails, say so. Prefer short lists to long paragraphs,"
            " and give prices in euros when the user asks about costs. Mention public"
            " transport options where they help, and local customs a visitor should know.",
        },
        *({"role": role, "content": content} for role, content in TURNS),
    ],
    "tools": [{"type": "function", "function": WEATHER}],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "max_tokens": 256,
    "temperature": 0.7,
    "top_p": 0.95,
    "seed": 42,
    "stop": ["\nUser:", "</answer>"],
    "presence_penalty": 0.1,
    "frequency_penalty": 0.2,
    "logprobs": True,
    "top_logprobs": 3,
    "stream": True,
    "stream_options": {"include_usage": True},
    "n": 1,
    "user": "user-1234",
    "prompt_cache_key": "trip-planner-session",
}
COMPLETION = {
    "model": "tgi",
    "prompt": "The quick brown fox jumps over the lazy dog. " * 8,
    "max_tokens": 64,
    "temperature": 0.8,
    "top_p": 0.9,
    "n": 2,
    "stop": ["\n\n"],
    "logprobs": 2,
    "seed": 7,
    "logit_bias": {"65": 1.5, "66": -2},
}
RESPONSES = {
    "model": "tgi",
    "instructions": "You are a concise travel assistant.",
    "input": [
        {"role": role, "content": [{"type": "input_text", "text": content}]}
        for role, content in TURNS
        if role == "user"
    ],
    "tools": [{"type": "function", **WEATHER}],
    "max_output_tokens": 256,
    "temperature": 0.7,
    "text": {"format": {"type": "text"}},
    "metadata": {"session": "abc"},
    "store": False,
}


class StubTemplate:
    """The tokenizer's chat template as a constant: what is left is the parsing."""

    def __init__(self, tokenizer) -> None:
        self.chat_template = tokenizer.chat_template

    def apply_chat_template(self, messages, **options) -> str:
        return "<|im_start|>user\nhi<|im_end|>\n"


def parse_functions(package: str) -> tuple:
    """(chat, completions, responses) parse functions of `package` (textgen.service, or
    a baseline's)."""
    chat = importlib.import_module(f"{package}.openai.chat")
    completions = importlib.import_module(f"{package}.openai.completions")
    responses = importlib.import_module(f"{package}.openai.responses")
    return (
        chat.parse_chat_request,
        completions.parse_completion_request,
        responses.parse_responses_request,
    )


def baseline_package(revision: str, folder: Path) -> str:
    """service/ at `revision`, importable as textgen_baseline.service."""
    archive = subprocess.run(
        ["git", "archive", revision, "service"], cwd=REPO, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder / "textgen_baseline", filter="data")
    sys.path.insert(0, str(folder))
    return "textgen_baseline.service"


def cases(functions: tuple, tokenizer, stub, store, bodies: dict) -> dict:
    chat, completions, responses = functions
    return {
        "chat": lambda: chat(bodies["chat"], tokenizer),
        "completions": lambda: completions(bodies["completions"], 4),
        "responses": lambda: responses(bodies["responses"], tokenizer, store),
        "chat, template stubbed": lambda: chat(bodies["chat"], stub),
        "responses, template stubbed": lambda: responses(bodies["responses"], stub, store),
    }


def timed(parse, number: int) -> float:
    """CPU microseconds per call, over `number` calls."""
    start = time.process_time()
    for _ in range(number):
        parse()
    return (time.process_time() - start) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", metavar="REV", help="also time service/ at this revision")
    parser.add_argument("--number", type=int, default=2000, help="parses per run")
    parser.add_argument("--repeat", type=int, default=15, help="runs (median and min kept)")
    args = parser.parse_args()
    tokenizer = build_tokenizer()
    stub = StubTemplate(tokenizer)
    store = ResponseStore(max_bytes=2**20, ttl=60)
    bodies = {
        "chat": json.dumps(CHAT).encode(),
        "completions": json.dumps(COMPLETION).encode(),
        "responses": json.dumps(RESPONSES).encode(),
    }
    with tempfile.TemporaryDirectory() as folder:
        versions = {"this tree": parse_functions("textgen.service")}
        if args.baseline:
            package = baseline_package(args.baseline, Path(folder))
            versions = {args.baseline: parse_functions(package), **versions}
        table = {v: cases(f, tokenizer, stub, store, bodies) for v, f in versions.items()}
        print(f"{'':28s} {'body':>7s}  {'version':>10s}  {'median':>7s}  {'min':>7s}  (us of CPU)")
        for name in table["this tree"]:
            runs: dict[str, list[float]] = {v: [] for v in table}
            for parse in (t[name] for t in table.values()):
                parse()  # warm: first-call caches (templates, schemas)
            order = list(table)
            for _ in range(args.repeat):  # the versions alternate, run by run
                for version in order:
                    runs[version].append(timed(table[version][name], args.number))
                order.reverse()  # neither always first
            size = len(bodies[name.split(",")[0]])
            for version, times in runs.items():
                median, least = statistics.median(times), min(times)
                print(f"{name:28s} {size:5d} B  {version:>10s}  {median:7.1f}  {least:7.1f}")


if __name__ == "__main__":
    main()
