"""OpenTelemetry tracing: a TracerProvider exporting OTLP when --otlp-endpoint is set
(TGI's flag), nothing otherwise. With no provider the server installs no
interceptor and the recorder uses a no-op tracer: no cost."""

from __future__ import annotations

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

SERVICE_NAME = "textgen"


def otlp_tracer_provider(endpoint: str, service_name: str = SERVICE_NAME) -> TracerProvider:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True))
    )
    return provider


def server_interceptors(provider: TracerProvider | None) -> list:
    """The gRPC interceptor that opens a span per RPC and continues the caller's W3C
    trace context (traceparent metadata, which Envoy forwards from HTTP headers)."""
    if provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(tracer_provider=provider)]
