"""glibc malloc keeps what a step frees for the next step (allocator.py)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
from textgen.service.processes import allocator

pytestmark = pytest.mark.timeout(60)

glibc = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc",
    reason="needs glibc (mallopt is glibc's; other libcs are left as they are)",
)

# In a fresh interpreter: malloc and free 20 MiB, then glibc's count of free memory at the
# heap's top (mallinfo2's keepcost). glibc's defaults serve 20 MiB with mmap() and unmap
# it on free; kept, it stays at the heap's top for the next step.
_KEEPCOST = """
import ctypes, sys
if sys.argv[1] == "keep":
    from textgen.service.processes.allocator import keep_freed_memory
    assert keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]
libc.mallinfo2.restype = Mallinfo2
libc.free(libc.malloc(20 << 20))
print(libc.mallinfo2().keepcost)
"""


def _keepcost(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _KEEPCOST, mode], capture_output=True, text=True, check=True,
        timeout=30, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    return int(out.stdout)


@pytest.mark.server
@glibc
def test_freed_memory_is_kept_for_the_next_step():
    assert _keepcost("default") < 1 << 20
    assert _keepcost("keep") >= 20 << 20


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"),
        ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0"),
        ("MALLOC_TRIM_THRESHOLD_", "0"),
        ("MALLOC_MMAP_THRESHOLD_", "65536"),
    ],
)
def test_a_users_own_malloc_settings_stand(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert allocator.keep_freed_memory() is False
