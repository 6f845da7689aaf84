"""`textgen serve --compile` keeps torch's compile artifacts in the textgen cache, none in
the temp dir: a second start with the same cache and a fresh temp dir (a new container)
loads every bucket's compiled code from there, and serves the same tokens."""

from __future__ import annotations

import os
import re
import signal

import pytest
from support.serve_process import textgen_serve
from textgen.sdk import Client

pytestmark = [pytest.mark.server, pytest.mark.timeout(600)]

PROMPT = "compiled once"


def serve_once(model_dir, cache, tmp) -> tuple[str, str]:
    """Start `--compile` (one bucket: CI's time), generate once, stop; its log and text."""
    tmp.mkdir()
    args = ["--model-id", str(model_dir), "--no-envoy", "--grpc-port", "0", "--compile"]
    args += ["--max-batch-size", "1", "--dtype", "float32", "--max-batch-total-tokens", "4096"]
    env = {**os.environ, "TEXTGEN_CACHE": str(cache), "TMPDIR": str(tmp)}
    with textgen_serve(*args, env=env) as served:
        if not served.grpc_target:
            pytest.fail("textgen serve did not become ready:\n" + served.log[-3000:])
        served.drain_log()
        with Client(served.grpc_target, timeout=120) as client:
            text = client.generate(PROMPT, max_new_tokens=8).generated_text
        served.proc.send_signal(signal.SIGTERM)
        served.proc.wait(60)
    return served.log, text


def from_cache(log: str) -> int:
    m = re.search(r"compiled decode step for batch buckets \[1\] .*\((\d+) of 1 from", log)
    assert m, log[-3000:]
    return int(m.group(1))


def test_a_new_container_reuses_the_compile_cache(tiny_model_dir, tmp_path):
    cache = tmp_path / "textgen-cache"
    first_log, first_text = serve_once(tiny_model_dir, cache, tmp_path / "tmp1")
    assert from_cache(first_log) == 0
    # one model, one folder; and the CPU decode attention's kernel, any model's
    folders = sorted((cache / "compile").iterdir())
    (kernel,) = [f for f in folders if f.name.startswith("cpu-decode-attention-")]
    (folder,) = [f for f in folders if f != kernel]
    assert (folder / "key.json").exists() and any((folder / "fxgraph").iterdir())
    assert (kernel / "key.json").exists() and any(kernel.rglob("*.so"))  # its C++ library
    second_log, second_text = serve_once(tiny_model_dir, cache, tmp_path / "tmp2")
    assert from_cache(second_log) == 1
    assert second_text == first_text
    # nothing was written under either temp dir (inductor's precompiled header included)
    assert not [f for f in tmp_path.glob("tmp*/**/*") if f.is_file()]
