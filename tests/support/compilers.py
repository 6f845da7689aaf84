"""A host without a C++ compiler, for the tests of textgen's C++ kernels' fallbacks."""

from __future__ import annotations


def without_cpp_compiler(monkeypatch) -> None:
    """Make inductor's C++ builds fail from now on (until the test's monkeypatch undoes it),
    as on a host with no compiler."""
    from torch._inductor.codecache import CppCodeCache

    def no_compiler(*_args, **_kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(CppCodeCache, "load", no_compiler)
