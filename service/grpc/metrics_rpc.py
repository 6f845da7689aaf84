"""The Metrics RPC (GET /metrics through Envoy): Prometheus' text exposition format
in a google.api.HttpBody, which the transcoder passes through byte for byte.

The metrics themselves come with the observability issue; until then the scrape
answers an empty, valid exposition rather than UNIMPLEMENTED, so scrapers and the
route can be set up now.
"""

from __future__ import annotations

from google.api import httpbody_pb2

# Prometheus' text format, version 0.0.4 (what prometheus_client serves).
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class MetricsRpc:
    """Mixed into TextGenerationServicer, like OpenAIRpcs."""

    def render_metrics(self) -> bytes:
        """The exposition text; empty until the observability issue fills it."""
        return b""

    async def Metrics(self, request, context):
        return httpbody_pb2.HttpBody(
            content_type=PROMETHEUS_CONTENT_TYPE, data=self.render_metrics()
        )
