"""--compile / --no-compile and TEXTGEN_COMPILE reach Settings.compile; the app refuses it
on CUDA and with --deterministic."""

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


def test_compile_settings_refuse_cuda_and_deterministic():
    from types import SimpleNamespace

    import torch
    from textgen.service.app import compile_settings
    from textgen.service.config import Settings

    cpu = SimpleNamespace(device=torch.device("cpu"))
    assert compile_settings(Settings(), cpu) is None  # off by default
    assert compile_settings(Settings(compile=True, max_batch_size=8), cpu).buckets == (1, 2, 4, 8)
    cuda = SimpleNamespace(device=torch.device("cuda"))
    with pytest.raises(ValueError, match="--compile: runs on CPU"):
        compile_settings(Settings(compile=True), cuda)
    with pytest.raises(ValueError, match="--deterministic"):
        compile_settings(Settings(compile=True, deterministic=True), cpu)
