"""The settings TGI's launcher brought to `textgen serve`, where a unit shows their effect:
--full-context's limits, the CUDA settings' rules (and, on a GPU, their effect),
--disable-custom-kernels' attention choice, --otlp-service-name, --json-output's lines.
Their effects through a served model: tests/service/test_model_options.py,
tests/integration/test_launcher.py."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from support.servers import ServerThread, tiny_settings
from textgen.sdk import Client
from textgen.service.engine.attention import paged as attention
from textgen.service.engine.attention.paged import BatchMetadata
from textgen.service.engine.kv_pool import KVCachePool
from textgen.service.observability.logs import JsonFormatter, fail_line
from textgen.service.observability.tracing import otlp_tracer_provider
from textgen.service.replica.kv_sizing import kv_floor
from textgen.service.settings.preflight import check_cuda_settings
from textgen.service.settings.table import SettingError, Settings

pytestmark = pytest.mark.timeout(300)


# --full-context: TGI's default limits ---------------------------------------------------------


def test_full_context_takes_the_models_context_bounded_by_the_kv_cache():
    tgi = Settings(full_context=True)
    assert tgi.resolved_limits(8192) == (8191, 8192)  # before the pool is sized
    assert tgi.resolved_limits(8192, kv_capacity=5000) == (4999, 5000)
    assert tgi.resolved_limits(1024, kv_capacity=5000) == (1023, 1024)
    assert Settings().resolved_limits(8192, kv_capacity=100_000) == (4095, 4096)  # serve's
    assert replace(tgi, max_total_tokens=300).resolved_limits(8192, 5000) == (299, 300)


def test_the_kv_pool_holds_at_least_one_request_whatever_the_limits():
    assert kv_floor(Settings(), 8192) == 4096
    assert kv_floor(Settings(max_total_tokens=600), 8192) == 600
    tgi = Settings(full_context=True)
    assert kv_floor(tgi, 8192) == 4096  # serve's default length; the pool then bounds it
    assert kv_floor(replace(tgi, max_input_tokens=6000), 8192) == 6001
    assert kv_floor(replace(tgi, max_batch_total_tokens=700), 8192) == 700


# the CUDA settings ------------------------------------------------------------------------------


def test_the_cuda_settings_rules_on_a_cuda_device():
    check_cuda_settings(Settings(cuda_graph_sizes=(1, 2, 4), cuda_memory_fraction=0.5), "cuda")
    with pytest.raises(SettingError, match="--cuda-graph-sizes 512: is above --max-batch-size"):
        check_cuda_settings(Settings(cuda_graph_sizes=(1, 512)), "cuda")
    with pytest.raises(SettingError, match="with --no-cuda-graphs"):
        check_cuda_settings(Settings(cuda_graph_sizes=(1,), cuda_graphs=False), "cuda")
    with pytest.raises(SettingError, match="--disable-custom-kernels turns off"):
        check_cuda_settings(Settings(cuda_graphs=True, disable_custom_kernels=True), "cuda")


def test_disable_custom_kernels_keeps_attention_off_the_triton_kernel(monkeypatch):
    """Where triton runs (CUDA), the step's metadata allows its kernel unless told not to;
    attention then takes flash-attn or SDPA (attention._pick_kernel)."""
    monkeypatch.setattr(attention, "triton_available", lambda device: True)
    pool = KVCachePool(4, 4)
    cpu = torch.device("cpu")
    assert BatchMetadata.build(pool, [1], [1], [[0]], cpu).use_triton
    assert not BatchMetadata.build(pool, [1], [1], [[0]], cpu, custom_kernels=False).use_triton


@pytest.mark.server
@pytest.mark.gpu
def test_the_cuda_settings_take_effect_on_a_gpu(tiny_model_dir):
    total = torch.cuda.mem_get_info()[1]
    settings = tiny_settings(
        tiny_model_dir,
        device="cuda",
        max_batch_total_tokens=None,
        cuda_graph_sizes=(1, 2),
        cuda_memory_fraction=0.25,
    )
    server = ServerThread(settings).start()
    try:
        runner = server.replica.engine.core.runner
        assert runner.settings.buckets == (1, 2)  # graphs for TGI's list only
        with Client(server.target, timeout=120) as client:
            assert client.generate("The quick", max_new_tokens=4).generated_text is not None
        assert torch.cuda.memory_reserved() <= 0.25 * total
    finally:
        server.stop()
    plain = ServerThread(tiny_settings(tiny_model_dir, device="cuda", disable_custom_kernels=True))
    plain.start()
    try:
        assert not plain.replica.servicer.served.info.cuda_graphs  # they replay Triton's kernel
        assert plain.engine.core.runner.custom_kernels is False
        with Client(plain.target, timeout=120) as client:
            assert client.generate("The quick", max_new_tokens=4).generated_text is not None
    finally:
        plain.stop()


# --otlp-service-name ------------------------------------------------------------------------------


def test_the_traces_carry_the_service_name():
    provider = otlp_tracer_provider("http://127.0.0.1:4317", "text-generation-inference.router")
    try:
        assert provider.resource.attributes["service.name"] == "text-generation-inference.router"
    finally:
        provider.shutdown()


# --json-output --------------------------------------------------------------------------------


def test_a_json_log_line_has_tgis_shape():
    record = logging.LogRecord("textgen.serve", logging.WARNING, "", 0, "a %s", ("b",), None)
    line = json.loads(JsonFormatter().format(record))
    assert line["level"] == "WARNING" and line["target"] == "textgen.serve"
    assert line["fields"] == {"message": "a b"} and line["timestamp"].endswith("+00:00")
    record.fields = {"event": "request", "status": "ok"}
    assert json.loads(JsonFormatter().format(record))["fields"] == {
        "message": "request",
        "event": "request",
        "status": "ok",
    }
    failed = json.loads(fail_line("textgen serve", "--port 1: in use", json_output=True))
    assert (failed["level"], failed["fields"]["message"]) == ("ERROR", "--port 1: in use")
    assert fail_line("textgen serve", "x", json_output=False) == "textgen serve: error: x"


@pytest.mark.server
def test_whatever_reaches_stderr_becomes_json():
    """Lines written to fd 2 by C code or a child process, and a warning, are JSON too."""
    script = (
        "import logging, os, subprocess, warnings\n"
        "from textgen.service.observability.logs import configure_logging\n"
        "configure_logging('INFO', json_output=True)\n"
        "logging.getLogger('textgen.x').info('hello')\n"
        "os.write(2, b'E1203 12:00:00 raw.cc:1] from C\\n')\n"
        "subprocess.run(['sh', '-c', 'echo from a child >&2'], check=True)\n"
        "warnings.warn('careful')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    records = [json.loads(line) for line in result.stderr.splitlines()]
    assert [r["fields"]["message"] for r in records][:3] == [
        "hello",
        "E1203 12:00:00 raw.cc:1] from C",
        "from a child",
    ]
    assert records[1]["level"] == "ERROR" and records[1]["target"] == "stderr"
    assert "careful" in records[3]["fields"]["message"] and records[3]["target"] == "py.warnings"
    assert result.stdout == ""
