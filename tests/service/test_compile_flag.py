"""--compile / --no-compile and TEXTGEN_COMPILE reach Settings.compile; the app refuses it
on CUDA and with --deterministic, and keeps its artifacts in the textgen cache, one folder
per model, dtype, quantization and torch build."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from textgen.service.settings.table import add_serve_arguments, settings_from_args


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


def loaded_model(device="cpu", dtype="float32", quantize=None, model_id="org/Model", sha="a1"):
    """What compile_settings reads of a LoadedModel."""
    from types import SimpleNamespace

    import torch
    from textgen.service.models import ResolvedModel

    return SimpleNamespace(
        resolved=ResolvedModel(model_id, Path("/models") / model_id, sha),
        device=torch.device(device),
        dtype=getattr(torch, dtype),
        quantize=quantize,
        shard=None,
    )


def test_compile_settings_refuse_cuda_and_deterministic(monkeypatch, tmp_path):
    from textgen.service.replica.assembly import compile_settings
    from textgen.service.settings.table import Settings

    monkeypatch.setenv("TEXTGEN_CACHE", str(tmp_path))
    cpu = loaded_model()
    assert compile_settings(Settings(), cpu) is None  # off by default
    assert compile_settings(Settings(compile=True, max_batch_size=8), cpu).buckets == (1, 2, 4, 8)
    cuda = loaded_model("cuda")
    with pytest.raises(ValueError, match="--compile: runs on CPU"):
        compile_settings(Settings(compile=True), cuda)
    with pytest.raises(ValueError, match="--deterministic"):
        compile_settings(Settings(compile=True, deterministic=True), cpu)


def test_compile_artifacts_live_in_the_textgen_cache_one_folder_per_key(monkeypatch, tmp_path):
    from textgen.service.replica.assembly import compile_settings
    from textgen.service.settings.table import Settings

    monkeypatch.setenv("TEXTGEN_CACHE", str(tmp_path))

    def folder(**loaded):
        return compile_settings(Settings(compile=True), loaded_model(**loaded)).cache_dir

    first = folder()
    assert first.parent == tmp_path / "compile" and first.name.startswith("Model-")
    key = json.loads((first / "key.json").read_text())
    assert key["model_id"] == "org/Model" and key["dtype"] == "float32"
    assert folder() == first  # the same model and build: the same artifacts
    others = [
        folder(dtype="bfloat16"),
        folder(quantize="int8"),
        folder(model_id="org/Other"),
        folder(sha="b2"),
    ]
    assert len({first, *others}) == 5


def test_an_unwritable_cache_falls_back_to_the_temp_dir(monkeypatch, tmp_path):
    from textgen.service.replica.assembly import compile_settings
    from textgen.service.settings.table import Settings

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TEXTGEN_CACHE", str(blocker))  # a file: no folder can go under it
    assert compile_settings(Settings(compile=True), loaded_model()).cache_dir is None
