"""How many CPUs this process may really use: its CPU affinity, capped by the CPU quota
of its cgroup (a container's `--cpus`, a Kubernetes CPU limit). torch counts the
machine's cores and ignores the quota: in a 2-CPU pod on a 64-core node its intra-op
pool would run 32 threads on 2 CPUs' worth of time."""

from __future__ import annotations

import asyncio
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CGROUP_V2_MAX = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def available_cpus() -> int:
    """min(affinity, cgroup quota rounded up), at least 1."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    count = affinity or os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        count = min(count, max(1, math.ceil(quota)))
    return max(1, count)


def default_torch_threads() -> int:
    """The engine's intra-op threads when --torch-threads is unset: OMP_NUM_THREADS when
    the environment sets it (as torch itself honours it), else available_cpus()."""
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    if text.isdigit() and int(text) > 0:
        return int(text)
    return available_cpus()


def cgroup_cpu_quota() -> float | None:
    """CPUs' worth of time the cgroup may use per period, or None when unlimited/unknown."""
    try:
        if CGROUP_V2_MAX.exists():
            quota, period = CGROUP_V2_MAX.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        if CGROUP_V1_QUOTA.exists():
            quota = int(CGROUP_V1_QUOTA.read_text())
            return None if quota <= 0 else quota / int(CGROUP_V1_PERIOD.read_text())
    except (OSError, ValueError):
        return None
    return None


async def in_own_thread(fn, *args):
    """fn(*args) on a thread that ends with it. Loading runs torch ops, and libgomp gives
    each thread that runs a parallel region an OpenMP team of its own that lives as long
    as the thread: a team left on a pooled thread (asyncio.to_thread's) halves the
    engine's spin-waits for good (engine/loop.py, EngineLoop.start)."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="textgen-load")
    try:
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)
    finally:
        executor.shutdown(wait=False)
