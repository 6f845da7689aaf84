"""processes/child_process.py: Envoy and the shard processes are started through a small
exec shim (no preexec_fn, so CPython spawns with vfork and gRPC's fork handlers never run in
a forked copy of the server), and still die when the server is killed outright."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from textgen.service.processes.child_process import dying_with_parent

pytestmark = pytest.mark.server

# a stand-in server: starts `sleep` through the shim, says its PID, waits to be killed
SERVER = """
import subprocess, sys, time
from textgen.service.processes.child_process import dying_with_parent
child = subprocess.Popen(dying_with_parent([sys.argv[1], "120"]))
print(child.pid, flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its reaper."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_the_child_runs_the_command_and_dies_with_a_killed_server():
    sleep = "/bin/sleep" if os.path.exists("/bin/sleep") else "/usr/bin/sleep"
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, sleep], stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(server.stdout.readline())
        # the shim exec'd the command in its own process (same PID)
        assert wait_for(lambda: Path(f"/proc/{child}/exe").resolve() == Path(sleep).resolve(), 10)
        server.kill()
        server.wait(timeout=10)
        assert wait_for(lambda: not alive(child), 10), "the child outlived its killed server"
    finally:
        server.kill()
        server.wait(timeout=10)


def test_the_command_line_is_the_shim_then_the_command():
    command = dying_with_parent(["/usr/bin/envoy", "--config-path", "x.yaml"])
    assert command[0] == sys.executable and command[-3:] == [
        "/usr/bin/envoy",
        "--config-path",
        "x.yaml",
    ]
    assert command[-5:-3] == [str(os.getpid()), str(int(signal.SIGTERM))]  # the default
