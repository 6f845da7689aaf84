"""What /proc/cpuinfo says of this CPU's instruction sets (a module of its own: the loader's
dtype choice and the CPU kernels' checks both read it)."""

from __future__ import annotations


def cpuinfo_flags(cpuinfo: str, key: str = "flags") -> frozenset[str]:
    """The words of /proc/cpuinfo's first `key` line (x86's "flags", Arm's "features")."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip().lower() == key:
            return frozenset(value.split())
    return frozenset()
