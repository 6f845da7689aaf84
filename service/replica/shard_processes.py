"""The processes of a sharded model (`--num-shard N`): started, joined and watched.

`textgen serve --num-shard N` is rank 0: it starts ranks 1..L-1 on this host (L =
`--local-shards`, default N) as `textgen shard --rank R` with its own settings, and every rank
joins one torch.distributed group at `--master-addr:--master-port` (gloo on CPU, NCCL for the
model on CUDA plus a gloo group for control). Ranks L..N-1 run elsewhere (a LeaderWorkerSet's
workers: deploy/kubernetes/leaderworkerset.yaml) with the same settings.

On CPU each local rank gets its own cores (disjoint affinity, `--torch-threads` of them, by
default the available CPUs split evenly); on CUDA rank R takes GPU R of those visible.

A local shard that dies is seen by `ShardProcesses.dead()` within a poll; a remote one by the
next collective, which fails. Either way the server stops serving and exits non-zero (lifecycle.py):
a half model cannot answer, and a supervisor restarts the whole group. Every group operation
has a timeout (`GROUP_TIMEOUT_S`), so no rank waits forever on one that is gone. The step a
local shard's death fails names it (`exited`, asked by engine/runners/sharded.py): the
requests in flight end with that, not with the transport's words.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from datetime import timedelta

from ..processes.child_process import dying_with_parent
from ..processes.cpus import available_cpus
from ..settings.table import Settings, settings_argv

log = logging.getLogger("textgen.shards")


class ShardError(RuntimeError):
    """A shard process failed to start or to join the others."""


# the longest any collective may wait, warm-up compiles included (a cold torch.compile of a
# bucket takes a minute or more on a loaded CPU); a dead peer fails sooner, by its socket
GROUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RankPlacement:
    """Where one local rank runs: its device, and on CPU its cores and threads."""

    local_rank: int  # among this host's ranks
    device: str
    cpus: tuple[int, ...] | None  # None: the process's own affinity, unchanged
    torch_threads: int


def placement(
    settings: Settings, local_rank: int, world_size: int, device_type: str
) -> RankPlacement:
    """The `local_rank`-th of this host's `--local-shards` ranks: GPU `local_rank` of those
    visible, or its share of the CPUs."""
    if device_type == "cuda":
        return RankPlacement(local_rank, f"cuda:{local_rank}", None, settings.torch_threads)
    allowed = sorted(os.sched_getaffinity(0))
    local = settings.local_shards or world_size
    per_rank = max(1, min(len(allowed), available_cpus()) // local)
    threads = settings.torch_threads or per_rank
    first = (local_rank * per_rank) % len(allowed)
    cpus = tuple(allowed[(first + i) % len(allowed)] for i in range(per_rank))
    device = settings.device if settings.device != "auto" else "cpu"
    return RankPlacement(local_rank, device, cpus, threads)


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class ShardProcesses:
    """The local ranks 1..L-1 this server started (by PID)."""

    processes: list[subprocess.Popen]
    master_port: int

    @classmethod
    def start(cls, settings: Settings, world_size: int) -> ShardProcesses:
        port = settings.master_port or free_port(settings.master_addr)
        local = min(settings.local_shards or world_size, world_size)
        argv = settings_argv(replace(settings, master_port=port))
        processes = [_spawn(rank, world_size, argv) for rank in range(1, local)]
        if processes:
            log.info(
                "started shards %s (pids %s); rendezvous at %s:%d",
                list(range(1, local)),
                [p.pid for p in processes],
                settings.master_addr,
                port,
            )
        return cls(processes, port)

    def dead(self) -> str | None:
        """Which shard has exited, if any (why the model can't run any more)."""
        for rank, process in enumerate(self.processes, start=1):
            code = process.poll()
            if code is not None:
                return f"shard {rank} (pid {process.pid}) exited with code {code}"
        return None

    def exited(self, wait: float) -> str | None:
        """dead(), waiting up to `wait` seconds for a shard to have exited: a collective
        fails on a dying shard's sockets, which close a moment before its exit status can
        be read. None: every local shard runs (the failure is elsewhere)."""
        deadline = time.monotonic() + wait
        while (dead := self.dead()) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return dead

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Wait for the shards to leave (rank 0 told them to stop), then SIGTERM, SIGKILL."""
        deadline = time.monotonic() + timeout
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(2.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _spawn(rank: int, world_size: int, argv: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "textgen.service.cli", "shard", "--rank", str(rank)]
    command += ["--local-rank", str(rank)]  # this host's ranks are 0..L-1
    env = {**os.environ, "LOCAL_RANK": str(rank), "PYTHONUNBUFFERED": "1"}
    env.pop("OMP_NUM_THREADS", None)  # each shard sets its own threads
    return subprocess.Popen(
        dying_with_parent([*command, "--num-shard", str(world_size), *argv]),
        env=env,
        stdin=subprocess.DEVNULL,
    )


@dataclass(frozen=True)
class Groups:
    control: object  # gloo ProcessGroup: step headers and inputs
    model: object  # ProcessGroup of the model's collectives


def join(rank: int, world_size: int, addr: str, port: int, device_type: str) -> Groups:
    """Join the ranks' group (blocks until all have, or GROUP_TIMEOUT_S passes)."""
    import torch.distributed as dist

    backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )
    world = dist.group.WORLD
    control = world
    if device_type == "cuda":  # control messages stay on the host
        control = dist.new_group(backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    return Groups(control, world)


def leave() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def pin(place: RankPlacement) -> None:
    """This thread (and the threads it starts) on the rank's cores, with its thread count."""
    import torch

    if place.cpus is not None:
        os.sched_setaffinity(0, place.cpus)
    if place.torch_threads:
        torch.set_num_threads(place.torch_threads)
