"""The CPU count the engine's torch threads follow: affinity, capped by a cgroup quota."""

from __future__ import annotations

import os

import pytest
from textgen.service import cpus

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
    from textgen.service.engine.loop import EngineLoop
    from tiny_model import build_tokenizer

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
