"""`textgen bench` reads the served engine's settings from Info by field name
(service/bench/command.py's ENGINE_INFO_FIELDS): each name is a field of the proto's
InfoResponse and of Settings, and an unset optional field is None."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Self

import pytest
import textgen.sdk
from textgen.sdk import InfoResponse
from textgen.service.bench.command import ENGINE_INFO_FIELDS, served_settings
from textgen.service.proto import text_generation_service_pb2 as service_pb2
from textgen.service.settings.table import Settings

pytestmark = pytest.mark.timeout(30)


def test_engine_info_fields_are_info_and_settings_fields() -> None:
    info = service_pb2.InfoResponse.DESCRIPTOR.fields_by_name
    settings = {field.name for field in fields(Settings)}
    assert [name for name in ENGINE_INFO_FIELDS if name not in info] == []
    assert [name for name in ENGINE_INFO_FIELDS if name not in settings] == []


class FakeClient:
    """textgen.sdk.AsyncClient's context manager and info(), answering `INFO`."""

    info_response = InfoResponse()

    def __init__(self, target: str, *, timeout: float | None = None) -> None:
        pass

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    async def info(self) -> InfoResponse:
        return self.info_response


@pytest.mark.parametrize("speculate_model", [None, "draft"])
async def test_served_settings_come_from_info(monkeypatch, speculate_model) -> None:
    FakeClient.info_response = InfoResponse(
        model_dtype="bfloat16",
        max_batch_total_tokens=4096,
        max_batch_prefill_tokens=512,
        max_batch_size=8,
        deterministic=True,
        compile=True,
        cuda_graphs=False,
        speculate=3,
        speculate_max_batch=4,
        speculate_model=speculate_model,
        quantize="int8",
        max_loras=2,  # not taken: the adapters' sources aren't in Info
    )
    monkeypatch.setattr(textgen.sdk, "AsyncClient", FakeClient)
    args = argparse.Namespace(target="fake:1", timeout=1.0, serve=False, model_id="m")
    settings = await served_settings(args)
    expected = {name: getattr(FakeClient.info_response, name) for name in ENGINE_INFO_FIELDS}
    assert {name: getattr(settings, name) for name in ENGINE_INFO_FIELDS} == expected
    assert settings.speculate_model == speculate_model
    assert (settings.model_id, settings.dtype) == ("m", "bfloat16")
    assert settings.max_batch_total_tokens == 4096 and settings.num_shard is None
    assert settings.max_loras == Settings().max_loras
