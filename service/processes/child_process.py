"""Children that die with the server: Envoy and the local shard processes."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1
try:  # resolved before fork: the child only makes the call
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def die_with_parent() -> None:
    """In the child (a preexec_fn): if the server is killed outright (SIGKILL), the child
    gets SIGTERM. One prctl call, safe between fork and exec even with threads about."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
