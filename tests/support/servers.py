"""A real replica in this process, served from a thread with its own event loop, on an
ephemeral port, optionally with a real Envoy in front (`http=True`) for the HTTP faces;
and the settings the tests serve the tiny model with."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from pathlib import Path


class ServerThread:
    """A replica served from a background thread; `target` is its gRPC address.
    With http=True an Envoy process (stopped by PID in stop()) serves `http_url`."""

    def __init__(self, settings, *, http: bool = False, tracer_provider=None) -> None:
        self.settings = settings
        self.http = http
        self.tracer_provider = tracer_provider
        self.loop = asyncio.new_event_loop()
        self.replica = None
        self.envoy = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from textgen.service.processes.envoy import start_envoy
        from textgen.service.replica.lifecycle import http_options, start_replica

        asyncio.set_event_loop(self.loop)
        try:
            self.replica = self.loop.run_until_complete(
                start_replica(self.settings, tracer_provider=self.tracer_provider)
            )
            if self.http:
                # Envoy is a child of this thread (it dies with it): port 0, Envoy says which
                self.envoy = self.loop.run_until_complete(
                    start_envoy(
                        "127.0.0.1",
                        self.replica.grpc_port,
                        listen_port=0,
                        keepalive=self.settings.keepalive,
                        http=http_options(self.settings),
                    )
                )
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            self._error = exc
        self._ready.set()
        self.loop.run_forever()

    def start(self, timeout: float = 300) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("server did not start")
        if self._error:
            self.stop()
            raise self._error
        return self

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.replica.grpc_port}"

    @property
    def http_url(self) -> str:
        return self.envoy.http_url

    @property
    def engine(self):
        return self.replica.engine

    def stop(self) -> None:
        if self.replica is not None:
            asyncio.run_coroutine_threadsafe(self.replica.stop(grace=1), self.loop).result(30)
        if self.envoy is not None:
            asyncio.run_coroutine_threadsafe(self.envoy.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)


def tiny_settings(model_dir: Path, **overrides):
    from textgen.service.settings.table import Settings

    base = Settings(
        model_id=str(model_dir),
        dtype="float32",
        hostname="127.0.0.1",
        grpc_port=0,
        no_envoy=True,
        max_total_tokens=512,
        max_batch_total_tokens=4096,
    )
    return replace(base, **overrides)
