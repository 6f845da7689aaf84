"""Where `--compile` keeps torch's compile artifacts: in the textgen cache, one folder per
model and build, so a new container with the same cache volume reuses them.

    <cache root>/compile/<model>-<key>/   (torch's inductor cache dir: FX graphs,
                                            AOTAutograd entries, the compiled kernels)
    <cache root>/compile/<model>-<key>/key.json   (what the key hashes, for an operator)
    <cache root>/compile/<kernel>-<key>/   (a kernel compiled for every model, e.g. the
                                            CPU decode attention: by torch and CPU only)

`artifacts_in(folder)` makes a compile (torch.compile's, or a C++ kernel's through inductor's
toolchain) read and write its artifacts there while it runs.

torch's own cache keys already cover the graph, the config and the compiler, so a stale
artifact is never used; the folder key splits the cache by what makes artifacts useless
to each other (model, revision, dtype, quantization, shard count, torch version, the CPU's
vector ISA), so one model's folder can be deleted on its own and never holds another's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from unittest import mock

import torch

from .embedded import default_cache_root

if TYPE_CHECKING:  # the loader imports the kernels, which keep their builds here
    from .loader import LoadedModel

logger = logging.getLogger("textgen.models")


def compile_key(loaded: LoadedModel) -> dict[str, str]:
    """What invalidates the compiled decode step, as strings."""
    resolved = loaded.resolved
    return {
        "model_id": resolved.model_id,
        # a Hub snapshot by its revision; a local folder (or the converted embedded
        # model, whose folder name hashes its GGUF) by its path
        "revision": resolved.sha or str(resolved.path.resolve()),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "quantize": loaded.quantize or "none",
        # every rank of a sharded model shares the folder: their graphs differ only where
        # their slices' shapes do, which torch's own keys tell apart
        "num_shard": str(loaded.shard.world_size if loaded.shard else 1),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def compile_cache_dir(loaded: LoadedModel, root: Path | None = None) -> Path:
    """The folder for this model's compile artifacts (created, with its key.json)."""
    key = compile_key(loaded)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", key["model_id"].rsplit("/", 1)[-1])[:48]
    folder = (root or default_cache_root()) / "compile" / f"{slug}-{digest}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "key.json").write_text(json.dumps(key, indent=1, sort_keys=True) + "\n")
    return folder


def kernel_cache_dir(name: str, root: Path | None = None) -> Path:
    """The folder for a kernel's compile artifacts that any model shares (created, with its
    key.json): what invalidates them is torch and the CPU's vector ISA."""
    key = {
        "kernel": name,
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    folder = (root or default_cache_root()) / "compile" / f"{name}-{digest}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "key.json").write_text(json.dumps(key, indent=1, sort_keys=True) + "\n")
    return folder


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


def load_cpp_kernel(source: Path, cache: Path | None, name: str, fallback: str) -> bool:
    """Compile `source` (or load it from `cache`; None: torch's default, the temp dir) with
    inductor's C++ toolchain and load it, which registers the torch ops it implements;
    False where it can't be (e.g. no C++ compiler on the host), with a warning: "`name` did
    not compile: `fallback`"."""
    from torch._inductor.codecache import CppCodeCache

    start = time.perf_counter()
    try:
        with artifacts_in(cache):
            CppCodeCache.load(source.read_text())
    except Exception:
        logger.warning("%s did not compile: %s", name, fallback, exc_info=True)
        return False
    logger.info("compiled %s in %.1f s", name, time.perf_counter() - start)
    return True
