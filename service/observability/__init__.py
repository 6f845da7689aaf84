"""Metrics (Prometheus, TGI's names), tracing (OpenTelemetry) and request logs."""
