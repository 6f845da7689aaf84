"""Startup refuses token limits that contradict each other, with a message that says
which flags, instead of refusing requests one by one at run time."""

from __future__ import annotations

import pytest
from conftest import tiny_settings
from textgen.service.app import kv_capacity_tokens, start_replica
from textgen.service.config import Settings

pytestmark = pytest.mark.timeout(60)


def test_a_kv_cache_smaller_than_one_request_is_refused():
    with pytest.raises(
        ValueError, match=r"--max-batch-total-tokens \(100\) must be >= --max-total-tokens \(512\)"
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
