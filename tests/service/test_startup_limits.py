"""Startup refuses token limits that contradict each other, with a message that says
which flags, instead of refusing requests one by one at run time."""

from __future__ import annotations

import pytest
from support.servers import tiny_settings
from textgen.service.replica.kv_sizing import kv_capacity_tokens
from textgen.service.replica.lifecycle import start_replica
from textgen.service.settings.table import Settings

pytestmark = pytest.mark.timeout(60)


def test_a_kv_cache_smaller_than_one_request_is_refused():
    with pytest.raises(
        ValueError, match=r"--max-batch-total-tokens 100: must be >= --max-total-tokens \(512\)"
    ):
        kv_capacity_tokens(Settings(max_batch_total_tokens=100), None, 512)
    assert kv_capacity_tokens(Settings(max_batch_total_tokens=512), None, 512) == 512


async def test_start_replica_refuses_it(tiny_model_dir):
    settings = tiny_settings(tiny_model_dir, max_total_tokens=512, max_batch_total_tokens=256)
    with pytest.raises(ValueError, match="must fit in the KV cache"):
        await start_replica(settings)


def test_max_input_tokens_must_leave_room():
    with pytest.raises(ValueError, match="must be < --max-total-tokens"):
        Settings(max_input_tokens=512, max_total_tokens=512).resolved_limits(1024)


async def test_cuda_graphs_asked_for_on_cpu_are_refused_at_startup(tiny_model_dir):
    settings = tiny_settings(tiny_model_dir, cuda_graphs=True)
    with pytest.raises(ValueError, match="--cuda-graphs: CUDA graphs need a CUDA device"):
        await start_replica(settings)


def test_cuda_graphs_flag_and_environment(monkeypatch):
    import argparse

    from textgen.service.settings.table import add_serve_arguments, settings_from_args

    def parsed(*argv):
        parser = argparse.ArgumentParser()
        add_serve_arguments(parser)
        return settings_from_args(parser.parse_args(list(argv))).cuda_graphs

    monkeypatch.delenv("TEXTGEN_CUDA_GRAPHS", raising=False)
    assert parsed() is None  # on where the device is CUDA
    assert parsed("--cuda-graphs") is True and parsed("--no-cuda-graphs") is False
    monkeypatch.setenv("TEXTGEN_CUDA_GRAPHS", "0")
    assert parsed() is False and parsed("--cuda-graphs") is True
    monkeypatch.setenv("TEXTGEN_CUDA_GRAPHS", "maybe")
    with pytest.raises(SystemExit, match="2"):  # parser.error: exit 2, as a bad flag
        parsed()
