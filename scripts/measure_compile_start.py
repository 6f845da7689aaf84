"""Time `textgen serve --compile` to its `textgen ready` line, cold then warm (not a test).

Both starts get a fresh, empty temp dir (TMPDIR), as a new container does; they share one
textgen cache (TEXTGEN_CACHE), fresh too, except for the converted models, linked in from
the real cache so neither start pays the conversion. The first start compiles every decode
bucket; the second should load them all from the cache's compile folder.

    .venv/bin/python scripts/measure_compile_start.py [--rounds 2] [--cache DIR] [-- flags]

--cache DIR reuses the textgen cache of an earlier run (its path is printed first), so
every start is warm.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from textgen.service.models import default_cache_root

TEXTGEN = str(Path(sys.executable).with_name("textgen"))


def start_once(cache: Path, extra: list[str]) -> tuple[float, str]:
    """Seconds from spawn to `textgen ready`, and the compile log line."""
    tmp = Path(tempfile.mkdtemp(prefix="textgen-compile-tmp-"))
    env = {**os.environ, "TEXTGEN_CACHE": str(cache), "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # torch sets it on import: not ours to pass on
    args = [TEXTGEN, "serve", "--compile", "--no-envoy", "--grpc-port", "0", *extra]
    start = time.monotonic()
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=env)
    compiled = ""
    try:
        for line in proc.stderr:
            if "compiled decode step" in line:
                compiled = line.strip()
            if "textgen ready" in line:
                return time.monotonic() - start, compiled
        raise SystemExit(f"textgen serve exited with {proc.wait()} before it was ready")
    finally:
        proc.kill()
        proc.wait(30)
        print(f"  temp dir after the start: {sum(1 for _ in tmp.rglob('*'))} entries", flush=True)
        shutil.rmtree(tmp, ignore_errors=True)


def load() -> float:
    return os.getloadavg()[0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2, help="starts: one cold, then warm")
    parser.add_argument("--cache", type=Path, help="an earlier run's textgen cache")
    parser.add_argument("extra", nargs="*", help="more `textgen serve` flags (after --)")
    args = parser.parse_args()
    cache = args.cache or Path(tempfile.mkdtemp(prefix="textgen-compile-cache-"))
    if not args.cache:
        (cache / "models").symlink_to(default_cache_root() / "models")
    print(f"textgen cache: {cache}", flush=True)
    for _ in range(args.rounds):
        seconds, compiled = start_once(cache, args.extra)
        hits = re.search(r"\((\d+) of (\d+) from", compiled)
        kind = "warm" if hits and hits.group(1) == hits.group(2) else "cold"
        print(f"{kind} start: ready in {seconds:.1f} s (load average {load():.1f})", flush=True)
        print(f"  {re.sub(r'^.*?compiled', 'compiled', compiled)}", flush=True)


if __name__ == "__main__":
    main()
