"""Real `textgen` processes for the multi-replica tests: replicas (`serve --no-envoy`)
and the front proxy (`textgen proxy`), each logging to a file and stopped by PID."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from textgen.service.processes.child_process import dying_with_parent
from textgen.service.proto import text_generation_service_pb2 as svc_pb
from textgen.service.proto import text_generation_service_pb2_grpc as svc_grpc

TEXTGEN = Path(sys.executable).with_name("textgen")
# a replica's first start may convert the embedded model (35 s on a slow 2-core machine)
# while the others wait for it on its lock and then load it: allow for that
START_TIMEOUT = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval)
    return predicate()


class Proc:
    """A `textgen` subprocess, its output in a file, stopped by PID."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        env = {k: v for k, v in os.environ.items() if not k.startswith("TEXTGEN_")}
        # two replicas, a proxy and the test share 2 cores: one torch thread each
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        with open(log, "w") as out:
            # SIGKILL when pytest dies: nothing outlives a killed test run (the shim, not
            # a preexec_fn: processes/child_process.py says why)
            self.popen = subprocess.Popen(
                dying_with_parent([str(TEXTGEN), *args], signal.SIGKILL),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )  # fmt: skip

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM, then SIGKILL; by PID."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        self.popen.wait(10)


class Replica(Proc):
    """`textgen serve --no-envoy` on 127.0.0.1:port: the tiny model in `model_dir` (float32,
    small limits), or with model_dir None the embedded model with its defaults."""

    def __init__(self, model_dir: Path | None, port: int, log: Path, *flags: str) -> None:
        self.port = port
        model = (
            ["--model-id", str(model_dir), "--dtype", "float32", "--max-total-tokens", "1024",
             "--max-batch-total-tokens", "16384"]
            if model_dir is not None
            else []
        )  # fmt: skip
        super().__init__(
            ["serve", "--no-envoy", "--hostname", "127.0.0.1", "--grpc-port", str(port),
             *model, *flags],
            log,
        )  # fmt: skip
        self.channel = grpc.insecure_channel(self.target)
        self.stub = svc_grpc.TextGenerationServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def serving_status(self, timeout: float = 2.0):
        return self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout).status

    def wait_serving(self) -> None:
        def serving() -> bool:
            assert self.alive(), self.output()
            with contextlib.suppress(grpc.RpcError):
                return self.serving_status() == health_pb2.HealthCheckResponse.SERVING
            return False

        assert wait_until(serving, START_TIMEOUT, 0.2), self.output()

    def metrics(self) -> dict[str, float]:
        """The replica's own Prometheus counters, `name{labels}` -> value."""
        body = self.stub.Metrics(svc_pb.MetricsRequest(), timeout=5).data.decode()
        out = {}
        for line in body.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def counter(self, name: str) -> float:
        return self.metrics().get(name, 0.0)

    def in_flight(self) -> float:
        m = self.metrics()
        failures = sum(v for k, v in m.items() if k.startswith("tgi_request_failure"))
        return m.get("tgi_request_count", 0) - m.get("tgi_request_success", 0) - failures

    def stop(self, timeout: float = 10) -> None:
        self.channel.close()
        super().stop(timeout)


class Proxy(Proc):
    """`textgen proxy` over the given replicas' addresses; `pools`: several models, each
    model's replicas' ports (`--pool MODEL=...`, in place of `ports`)."""

    def __init__(self, ports: list[int], log: Path, pools: dict[str, list[int]] | None = None):
        self.http_port, self.admin_port = free_port(), free_port()
        upstreams = [a for p in ports for a in ("--upstream", f"127.0.0.1:{p}")]
        for model, pool in (pools or {}).items():
            upstreams += ["--pool", f"{model}=" + ",".join(f"127.0.0.1:{p}" for p in pool)]
        super().__init__(
            [
                "proxy",
                *upstreams,
                "--port",
                str(self.http_port),
                "--admin-port",
                str(self.admin_port),
            ],
            log,
        )
        ready = wait_until(lambda: "textgen proxy ready" in self.output() or not self.alive(), 30)
        assert ready and self.alive(), self.output()
        self.envoy_pid = int(re.search(r"envoy \(pid (\d+)\)", self.output()).group(1))

    def health_flags(self, port: int) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/clusters", timeout=5) as r:
            body = r.read().decode()
        m = re.search(rf"::127\.0\.0\.1:{port}::health_flags::(\S+)", body)
        return m.group(1) if m else "absent"

    def counter(self, name: str) -> int:
        """One of Envoy's counters (admin /stats), e.g. the cluster's upstream_rq_retry."""
        pattern = urllib.parse.quote(f"^{re.escape(name)}$")
        url = f"http://127.0.0.1:{self.admin_port}/stats?filter={pattern}"
        with urllib.request.urlopen(url, timeout=5) as r:
            m = re.search(rf"^{re.escape(name)}: (\d+)$", r.read().decode(), re.MULTILINE)
        return int(m.group(1)) if m else 0

    def stop(self, timeout: float = 10) -> None:
        super().stop(timeout)
        with contextlib.suppress(ProcessLookupError):  # textgen stops it; make sure
            os.kill(self.envoy_pid, signal.SIGKILL)
