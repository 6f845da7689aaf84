"""The Metrics RPC (GET /metrics through Envoy): Prometheus' text exposition format
in a google.api.HttpBody, which the transcoder passes through byte for byte."""

from __future__ import annotations

from google.api import httpbody_pb2

# Prometheus' text format, version 0.0.4 (what prometheus_client's generate_latest writes).
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class MetricsRpc:
    """Mixed into TextGenerationServicer (uses its recorder's metrics)."""

    async def Metrics(self, request, context):
        return httpbody_pb2.HttpBody(
            content_type=PROMETHEUS_CONTENT_TYPE, data=self.recorder.metrics.render()
        )
