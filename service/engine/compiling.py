"""`own_code`: a function with a code object of its own, so that it has its own compiled
graphs, guards and recompile limit (the compiled decode step, runners/compiled.py). Where
compiles keep their artifacts: models/compile_cache.py's `artifacts_in`."""

from __future__ import annotations

import types
from collections.abc import Callable


def own_code(fn: Callable, name: str | None = None) -> Callable:
    """`fn` with a code object of its own (named `name`): dynamo keeps compiled graphs,
    and counts recompiles, per code object, so two copies never share them."""
    code = fn.__code__.replace(co_name=name) if name else fn.__code__.replace()
    return types.FunctionType(
        code, fn.__globals__, name or fn.__name__, fn.__defaults__, fn.__closure__
    )
