"""The CPU count the engine's torch threads follow: affinity, capped by a cgroup quota."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from textgen.service.processes import cpus

pytestmark = pytest.mark.timeout(10)


def test_affinity_without_a_quota(monkeypatch, tmp_path):
    monkeypatch.setattr(cpus, "CGROUP_V2_MAX", tmp_path / "none")
    monkeypatch.setattr(cpus, "CGROUP_V1_QUOTA", tmp_path / "none")
    assert cpus.available_cpus() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize(("text", "expected"), [("max 100000", None), ("150000 100000", 1.5)])
def test_cgroup_v2_quota(monkeypatch, tmp_path, text, expected):
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text(text + "\n")
    monkeypatch.setattr(cpus, "CGROUP_V2_MAX", cpu_max)
    assert cpus.cgroup_cpu_quota() == expected
    if expected is not None:
        # a 1.5-CPU quota allows 2 threads (rounded up), never more than the affinity
        assert cpus.available_cpus() == min(2, len(os.sched_getaffinity(0)))


def test_cgroup_v1_quota(monkeypatch, tmp_path):
    monkeypatch.setattr(cpus, "CGROUP_V2_MAX", tmp_path / "none")
    (tmp_path / "quota").write_text("50000")
    (tmp_path / "period").write_text("100000")
    monkeypatch.setattr(cpus, "CGROUP_V1_QUOTA", tmp_path / "quota")
    monkeypatch.setattr(cpus, "CGROUP_V1_PERIOD", tmp_path / "period")
    assert cpus.cgroup_cpu_quota() == 0.5
    assert cpus.available_cpus() == 1


def test_omp_num_threads_is_honoured(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cpus.default_torch_threads() == 1
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert cpus.default_torch_threads() == cpus.available_cpus()


def test_engine_sets_its_threads_on_its_own_thread(tiny_model_dir):
    """OpenMP keeps the thread count per thread: the engine sets it where torch runs."""
    import torch
    from support.tiny_model import build_tokenizer
    from textgen.service.engine.loop import EngineLoop

    seen = []

    class Core:
        def warm_up(self):
            seen.append(torch.get_num_threads())

        def has_work(self):
            return False

    engine = EngineLoop(Core(), build_tokenizer(), frozenset(), torch_threads=1)
    engine.start(timeout=10)
    engine.shutdown()
    assert seen == [1]


TEAMS_SCRIPT = """
import asyncio, os, time
import torch
from textgen.service.processes.cpus import in_own_thread

def parallel_op():
    torch.set_num_threads(2)
    return float((torch.ones(4_000_000) * 2).sum())  # big enough for an OpenMP region

def threads_settled(expected):
    deadline = time.monotonic() + 5
    while len(os.listdir("/proc/self/task")) > expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(os.listdir("/proc/self/task"))

async def main():
    await in_own_thread(parallel_op)
    first = threads_settled(len(os.listdir("/proc/self/task")) - 1)
    await in_own_thread(parallel_op)
    second = threads_settled(first)
    await asyncio.to_thread(parallel_op)
    print(first, second, len(os.listdir("/proc/self/task")))

asyncio.run(main())
"""


@pytest.mark.server
@pytest.mark.timeout(60)
def test_in_own_thread_leaves_no_openmp_team_behind():
    """Loading on a pooled thread left its OpenMP team alive beside the engine's, and the
    engine's spin-waits were throttled for good (base requests at half speed on a server
    with LoRA adapters). A thread that ends takes its team with it."""
    out = subprocess.run(
        [sys.executable, "-c", TEAMS_SCRIPT],
        capture_output=True,
        check=False,
        text=True,
        timeout=50,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    assert out.returncode == 0, out.stderr
    first, second, pooled = map(int, out.stdout.split())
    assert second == first  # a second load leaves nothing more behind
    assert pooled >= second + 2  # the pooled thread and its team's worker stay
