#!/usr/bin/env bash
# Run scripts/device_check.py with the repo's python (.venv) or, on a machine without one
# (the lent GPU machine), python3; results under $OUT (default /tmp/device-check-out).
#
# Carried wheels (see the docstring of scripts/device_check.py for the `pip download` command)
# in $WHEELS (default .device-wheels) are installed once, offline and without dependencies,
# into $TEXTGEN_DEVICE_DEPS (default /tmp/textgen-device-deps), which goes first on PYTHONPATH:
# the machine's own packages are left as they are.
#
#   scripts/device_check.sh                      # full run (GPU profile when CUDA is there)
#   scripts/device_check.sh --quick              # CPU-sized run, tiny model
#   OUT=/tmp/dc scripts/device_check.sh --sizes 0.5b --skip-serve
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi

WHEELS=${WHEELS:-.device-wheels}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  DEPS=${TEXTGEN_DEVICE_DEPS:-/tmp/textgen-device-deps}
  if [ ! -f "$DEPS/.installed" ]; then
    echo "installing $(ls "$WHEELS"/*.whl | wc -l) carried wheels from $WHEELS into $DEPS" >&2
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps \
      --target "$DEPS" "$WHEELS"/*.whl
    touch "$DEPS/.installed"
  fi
  export TEXTGEN_DEVICE_DEPS="$DEPS"
  export PYTHONPATH="$DEPS${PYTHONPATH:+:$PYTHONPATH}"
fi

OUT=${OUT:-/tmp/device-check-out}
mkdir -p "$OUT"
exec "$PY" scripts/device_check.py --out "$OUT" "$@"
