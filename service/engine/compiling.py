"""What textgen's users of inductor share (the compiled decode step, runners/compiled.py,
and the C++ kernels built by inductor's toolchain: the CPU decode attention,
attention/cpu_decode.py, and the int4 products, models/int4_avx512.py):

- `artifacts_in`: where the compile's artifacts go while it runs, the textgen cache's folder
  the caller names (models/compile_cache.py), so that a new process or container with the
  same cache volume reads them instead of compiling again;
- `own_code`: a function with a code object of its own, so that it has its own compiled
  graphs, guards and recompile limit."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock


@contextlib.contextmanager
def artifacts_in(cache_dir: Path | None) -> Iterator[None]:
    """torch's compile caches in cache_dir while the block runs (None: torch's default, the
    temp dir): inductor reads the folder from TORCHINDUCTOR_CACHE_DIR at each use (torch's
    own helper sets it, and clears the in-memory caches keyed on it). The C++ wrapper's
    precompiled header (~150 MB) goes there too: inductor puts it in the temp dir, fixed at
    import, and rebuilds it (~8 s here) even when every graph is a cache hit, since its path
    is part of each kernel's build key."""
    if cache_dir is None:
        yield
        return
    from torch._inductor import codecache
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    headers = cache_dir / "precompiled_headers"
    with contextlib.ExitStack() as stack:
        stack.enter_context(temporary_cache_dir(str(cache_dir)))
        if hasattr(codecache, "_HEADER_DIR") and hasattr(codecache, "_HEADER_LOCK_DIR"):
            stack.enter_context(
                mock.patch.multiple(
                    codecache, _HEADER_DIR=str(headers), _HEADER_LOCK_DIR=str(headers / "locks")
                )
            )
        yield


def own_code(fn: Callable, name: str | None = None) -> Callable:
    """`fn` with a code object of its own (named `name`): dynamo keeps compiled graphs,
    and counts recompiles, per code object, so two copies never share them."""
    code = fn.__code__.replace(co_name=name) if name else fn.__code__.replace()
    return types.FunctionType(
        code, fn.__globals__, name or fn.__name__, fn.__defaults__, fn.__closure__
    )
