"""--compile / --no-compile and TEXTGEN_COMPILE reach Settings.compile."""

from __future__ import annotations

import argparse

import pytest
from textgen.service.config import add_serve_arguments, settings_from_args


def parse(argv: list[str]):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return settings_from_args(parser.parse_args(argv))


@pytest.mark.parametrize(
    ("env", "argv", "expected"),
    [
        (None, [], False),
        (None, ["--compile"], True),
        ("1", [], True),
        ("1", ["--no-compile"], False),
        ("0", [], False),
    ],
)
def test_compile_flag_and_env(monkeypatch, env, argv, expected):
    if env is None:
        monkeypatch.delenv("TEXTGEN_COMPILE", raising=False)
    else:
        monkeypatch.setenv("TEXTGEN_COMPILE", env)
    assert parse(argv).compile is expected
