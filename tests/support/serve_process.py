"""`textgen serve` (or `text-generation-launcher`) as a user runs it: a subprocess whose
ready line the tests parse, stopped by PID (and its Envoy too) whatever happens."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

TEXTGEN = str(Path(sys.executable).with_name("textgen"))
LAUNCHER = str(Path(sys.executable).with_name("text-generation-launcher"))


@dataclass
class ServeProcess:
    proc: subprocess.Popen
    log: str  # stderr up to the ready line (or to the exit)
    grpc_target: str | None = None
    http_url: str | None = None
    envoy_pid: int | None = None
    envoy_admin: str | None = None  # Envoy's admin URL

    def drain_log(self) -> None:
        """Keep reading stderr so the server never blocks on a full pipe."""
        threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()


@contextlib.contextmanager
def textgen_serve(
    *args: str,
    until: str = "textgen ready",
    command: tuple[str, ...] = (TEXTGEN, "serve"),
    env: dict[str, str] | None = None,
):
    """Start `textgen serve ARGS` (or `command ARGS`, with `env` as its environment),
    read its log until `until` (or its exit), yield it; on the way out kill whatever is
    still running, server and Envoy, by PID."""
    proc = subprocess.Popen(
        [*command, *args],
        stderr=subprocess.PIPE,
        text=True,
        env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"},
    )
    served = ServeProcess(proc, "")
    try:
        for line in proc.stderr:
            served.log += line
            if m := re.search(r"envoy \(pid (\d+)\)", line):
                served.envoy_pid = int(m.group(1))
            if m := re.search(r"envoy \(pid \d+\) serves \S+, admin (http://\S+)", line):
                served.envoy_admin = m.group(1)
            if until in line:
                break
        if m := re.search(r"textgen ready: .*grpc=(\S+:\d+)", served.log):
            served.grpc_target = m.group(1)
        if m := re.search(r"textgen ready: .* http=(http://\S+)", served.log):
            served.http_url = m.group(1)
        yield served
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if served.envoy_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(served.envoy_pid, signal.SIGKILL)
