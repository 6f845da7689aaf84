"""Shared fixtures: a tiny random model folder, and real gRPC servers on ephemeral ports
(tests/support/servers.py), optionally with a real Envoy in front (`http=True`) for the
HTTP faces; and the test tiers (tests/support/tiers.py): the `server` marker, set by
fixture, and the `gpu` skip."""

from __future__ import annotations

import os

# Without a GPU, Triton kernels run on CPU tensors in Triton's interpreter
# (tests/engine/test_triton_attention.py). It must be chosen before triton is first
# imported, and torch._dynamo imports it as soon as transformers loads, so here, first:
# triton's own library is @triton.jit'd at import time. On a GPU machine (the device
# check) the kernels compile for the GPU.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest
from support.servers import ServerThread, tiny_settings
from support.tiers import checking, mark_tiers, server_fixture, watch_starts
from support.tiny_model import build_tiny_model


def pytest_configure() -> None:
    watch_starts()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_tiers(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    with checking(item, "setup"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with checking(item, "body"):
        return (yield)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@server_fixture(scope="session")
def tiny_server(tiny_model_dir):
    server = ServerThread(tiny_settings(tiny_model_dir)).start()
    yield server
    server.stop()


@server_fixture(scope="session")
def http_server(tiny_model_dir):
    """The tiny model behind a real Envoy: `http_url` (TGI/OpenAI routes and native
    gRPC on one port) and `target` (the gRPC server itself)."""
    server = ServerThread(tiny_settings(tiny_model_dir), http=True).start()
    yield server
    server.stop()
