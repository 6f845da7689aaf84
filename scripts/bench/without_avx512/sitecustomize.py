"""Measurement aid (not a test, not part of the server): run textgen on an AVX-512 machine
as it runs on a CPU without AVX-512 and without native bfloat16, to reproduce that machine
kind's code paths where none is at hand.

Python imports this file at start-up when its folder is on PYTHONPATH; it hides the
`avx512*` and `amx*` flags of /proc/cpuinfo from textgen (so `--dtype auto` is float32 and
textgen's AVX512-BF16 kernels stay off), and the two environment variables limit torch's
own kernels and oneDNN to their AVX2 builds:

    PYTHONPATH=scripts/bench/without_avx512 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
      .venv/bin/textgen bench --serve --concurrency 1 --requests 8 --max-new-tokens 64 \
      --ignore-eos --baseline --core --rounds 3

The memory system and the clock stay this machine's: the paths are emulated, not the
speed of another CPU.
"""

import textgen.service.models.cpuinfo as _cpuinfo

_flags = _cpuinfo.cpuinfo_flags


def _without_avx512(cpuinfo: str, key: str = "flags") -> frozenset[str]:
    return frozenset(f for f in _flags(cpuinfo, key) if not f.startswith(("avx512", "amx")))


_cpuinfo.cpuinfo_flags = _without_avx512
