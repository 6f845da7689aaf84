"""Children that die with the server: Envoy and the local shard processes.

Each is started through a few lines of Python that make the one prctl call (SIGTERM to the
child when the server's spawning thread exits, even by SIGKILL) and then exec the command
(same PID). Not as Popen's preexec_fn: that makes subprocess fork() the server itself, and
the forked copy runs gRPC's fork handlers against the event-engine threads of this
process's channels and servers: now and then it aborts before exec ("epoll_wait error: Bad
file descriptor", SIGABRT, ~1 % of spawns), and Envoy or the shard never starts. Without a
preexec_fn CPython spawns with vfork, which runs no fork handlers."""

from __future__ import annotations

import os
import signal
import sys

# argv: the parent's PID, the signal, then the command
_DIE_WITH_PARENT = """
import ctypes, os, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(sys.argv[2]))  # PR_SET_PDEATHSIG
except (OSError, AttributeError):  # not Linux: no parent-death signal
    pass
if os.getppid() != int(sys.argv[1]):  # the parent is already gone
    os._exit(1)
os.execv(sys.argv[3], sys.argv[3:])
"""


def dying_with_parent(
    command: list[str], death_signal: signal.Signals = signal.SIGTERM
) -> list[str]:
    """`command` (its first item a path to an executable) started so that it gets
    `death_signal` if this process is killed outright."""
    shim = [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT]
    return [*shim, str(os.getpid()), str(int(death_signal)), *command]
