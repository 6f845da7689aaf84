"""The test tiers. `make test` runs every test; `make test-fast` leaves out three tiers:

- `server`: the test starts a server (a replica in this process, `textgen serve`, a replica
  or proxy process, Envoy) or a subprocess. Marked by fixture: a fixture declared with
  `server_fixture` instead of `pytest.fixture` marks every test that uses it, directly or
  through another fixture. A test that starts one itself says so with
  `@pytest.mark.server` (or its module's `pytestmark`). The rule is checked: a test not
  marked `server` whose setup or body starts a `ServerThread`, or a subprocess from code
  under tests/ (directly or through the standard library), fails and says which mark it
  needs. Subprocesses that installed libraries start on their own (a compiler for
  torch.compile, `ldconfig` for triton) are not the test's.
- `gpu`: needs a CUDA device; skipped, saying so, where torch sees none.
- `slow`: loads the embedded model.

In-process fakes (a fake gRPC servicer or an `http.server` script in tests/sdk/, the
servicer over a fake engine in tests/service/test_servicer.py) are test doubles, not
servers: their tests stay in the fast tier.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from textgen.service.models import avx512_bf16

from support.servers import ServerThread

_STARTS_SERVER = "_textgen_starts_server"

NO_CUDA = "needs a CUDA device: torch.cuda.is_available() is False here"

# textgen's CPU kernels for AVX512-BF16 (models/avx512_bf16.py, engine/attention/
# cpu_prefill.py): a CPU without those instructions has no such kernel (its layers and
# chunks keep torch's, tested beside); where the CPU has them, a kernel that fails to
# compile fails its tests
needs_avx512_bf16 = pytest.mark.skipif(
    not avx512_bf16.cpu_supports(),
    reason="needs a CPU with avx512_bf16 (and avx512f/bw/vl/dq): /proc/cpuinfo lacks them "
    "here; torch's kernels serve such CPUs, tested beside",
)

TESTS = str(Path(__file__).resolve().parent.parent) + os.sep
_STDLIB = str(Path(sysconfig.get_paths()["stdlib"]).resolve()) + os.sep


def server_fixture(function=None, /, **kwargs):
    """`pytest.fixture` (same arguments) for a fixture that starts a server or a subprocess:
    every test that uses it is marked `server`."""

    def declare(function):
        setattr(function, _STARTS_SERVER, True)
        return pytest.fixture(**kwargs)(function)

    return declare if function is None else declare(function)


def starts_server(item: pytest.Item) -> bool:
    """Whether a fixture in the item's closure was declared with `server_fixture`."""
    definitions = getattr(item, "_fixtureinfo", None)
    if definitions is None:  # not a test function (a doctest, a plugin's item)
        return False
    return any(
        getattr(definition.func, _STARTS_SERVER, False)
        for name in item.fixturenames
        for definition in definitions.name2fixturedefs.get(name, ())
    )


def mark_tiers(items: list[pytest.Item]) -> None:
    """Mark the `server` tier; skip the `gpu` tier where there is no CUDA device."""
    cuda: bool | None = None
    for item in items:
        if starts_server(item):
            item.add_marker(pytest.mark.server)
        if item.get_closest_marker("gpu") is not None:
            if cuda is None:
                import torch

                cuda = torch.cuda.is_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason=NO_CUDA))


# the check: what a test outside the `server` tier starts ------------------------------

_started: list[str] | None = None  # while a test outside the tier runs: what it started


def _from_the_tests() -> bool:
    """Whether the nearest caller outside the standard library is code under tests/."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        stdlib = name.startswith(("<frozen ", _STDLIB)) and "site-packages" not in name
        if not stdlib:
            return name.startswith(TESTS)
        frame = frame.f_back
    return False


def watch_starts() -> None:
    """Have subprocess.Popen and ServerThread.start report to the running test (once)."""
    if getattr(subprocess.Popen, _STARTS_SERVER, False):
        return
    execute_child = subprocess.Popen._execute_child
    start = ServerThread.start

    def _execute_child(self, args, *rest, **kwargs):
        if _started is not None and _from_the_tests():
            argv = [args] if isinstance(args, str | bytes | os.PathLike) else list(args)
            _started.append(f"a subprocess ({os.path.basename(os.fsdecode(argv[0]))})")
        return execute_child(self, args, *rest, **kwargs)

    def _start(self, *args, **kwargs):
        if _started is not None:
            _started.append("a ServerThread")
        return start(self, *args, **kwargs)

    subprocess.Popen._execute_child = _execute_child
    setattr(subprocess.Popen, _STARTS_SERVER, True)
    ServerThread.start = _start


@contextlib.contextmanager
def checking(item: pytest.Item, phase: str):
    """Fail a test outside the `server` tier that starts a server or a subprocess."""
    global _started
    if item.get_closest_marker("server") is not None:
        yield
        return
    _started = []
    try:
        yield
    finally:
        started, _started = _started, None
    if started:
        pytest.fail(
            f"{item.nodeid} starts {', '.join(dict.fromkeys(started))} in its {phase} but is"
            " not marked `server`: mark it @pytest.mark.server, or start it from a fixture"
            " declared with support.tiers.server_fixture",
            pytrace=False,
        )
