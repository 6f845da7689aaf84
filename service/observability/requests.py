"""One place that sees each request from arrival to end: counts and histograms
(TGI's names), child spans from the engine's timings, and one JSON log line.

Servicers wrap their body in `recorder.track(...)`, call `validated()` and
`finished()` as the request progresses, and end failures through
`grpc.errors.abort`, which leaves the error type in `current_error_type` for the
record (a context variable: one per RPC task).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import time
from dataclasses import dataclass

from opentelemetry import trace

from ..engine.types import FinishInfo
from ..errors import ErrorType
from .metrics import Metrics, priority_label

current_error_type: contextvars.ContextVar[ErrorType | None] = contextvars.ContextVar(
    "textgen_error_type", default=None
)

request_log = logging.getLogger("textgen.requests")


@dataclass
class RequestRecord:
    method: str
    arrival: float  # monotonic
    request_id: str = ""
    input_length: int = 0
    max_new_tokens: int = 0
    validation_time: float = 0.0
    priority: int = 0
    adapter: str | None = None  # the LoRA adapter's name
    images: int = 0  # a vision-language model's images
    finishes: tuple[FinishInfo, ...] = ()

    def validated(self, valid) -> None:
        """valid: validation.ValidRequest."""
        req = valid.engine_request
        self.request_id = req.request_id
        self.input_length = len(req.prompt_ids)
        self.max_new_tokens = req.stopping.max_new_tokens
        self.validation_time = valid.validation_time
        self.priority = req.priority
        self.adapter = req.adapter_id
        self.images = len(req.images)

    def finished(self, *finishes: FinishInfo) -> None:
        self.finishes = finishes


class RequestRecorder:
    def __init__(self, metrics: Metrics, tracer: trace.Tracer | None = None) -> None:
        self.metrics = metrics
        self.tracer = tracer or trace.NoOpTracer()

    @contextlib.asynccontextmanager
    async def track(self, method: str):
        record = RequestRecord(method=method, arrival=time.monotonic())
        current_error_type.set(None)
        self.metrics.request_count.inc()
        status = "ok"
        try:
            yield record
        except (asyncio.CancelledError, GeneratorExit):  # the client left (a streaming
            # handler is closed at its yield when its RPC is cancelled)
            status = "cancelled"
            self.metrics.cancelled.inc()
            raise
        except BaseException:
            status = str(current_error_type.get() or ErrorType.GENERATION)
            self.metrics.request_failure.inc(status)
            raise
        finally:
            if status == "ok" and not record.finishes:
                status = "cancelled"  # the client left before the end
                self.metrics.cancelled.inc()
            if status == "ok":
                self._success(record)
            self._log(record, status)

    def _success(self, record: RequestRecord) -> None:
        m = self.metrics
        total = time.monotonic() - record.arrival
        m.request_success.inc()
        m.request_duration.observe(total)
        m.validation_duration.observe(record.validation_time)
        m.input_length.observe(record.input_length)
        m.max_new_tokens.observe(record.max_new_tokens)
        if record.images:
            m.request_images.observe(record.images)
        priority = priority_label(record.priority)
        m.requests_by_priority.labels(priority).inc()
        for f in record.finishes:
            m.queue_duration.observe(f.queue_time)
            m.queue_duration_by_priority.labels(priority).observe(f.queue_time)
            m.inference_duration.observe(f.inference_time)
            m.generated_tokens.observe(f.generated_tokens)
            if f.generated_tokens:
                m.mean_time_per_token.observe(f.inference_time / f.generated_tokens)
        if record.adapter is not None:
            m.count_adapter(record.adapter, sum(f.generated_tokens for f in record.finishes))
        self._spans(record)

    def _spans(self, record: RequestRecord) -> None:
        """Child spans of the RPC's span, placed on the engine's own timeline."""
        if not record.finishes or not trace.get_current_span().get_span_context().is_valid:
            return
        f = record.finishes[0]
        to_ns = _wall_clock_ns()
        t0 = record.arrival
        phases = [
            ("validation", t0, t0 + record.validation_time, {"input_tokens": record.input_length}),
            ("queue", t0 + record.validation_time, t0 + f.queue_time, {}),
            (
                "prefill",
                t0 + f.queue_time,
                t0 + f.queue_time + f.prefill_time,
                {"input_tokens": f.input_length},
            ),
            (
                "decode",
                t0 + f.queue_time + f.prefill_time,
                t0 + f.queue_time + f.inference_time,
                {"generated_tokens": f.generated_tokens, "finish_reason": f.reason.value},
            ),
        ]
        for name, start, end, attributes in phases:
            span = self.tracer.start_span(name, start_time=to_ns(start), attributes=attributes)
            span.end(end_time=to_ns(max(start, end)))
        current = trace.get_current_span()
        current.set_attributes(
            {
                "textgen.request_id": record.request_id,
                "textgen.input_tokens": f.input_length,
                "textgen.generated_tokens": f.generated_tokens,
                "textgen.validation_time": record.validation_time,
                "textgen.queue_time": f.queue_time,
                "textgen.prefill_time": f.prefill_time,
                "textgen.inference_time": f.inference_time,
                "textgen.finish_reason": f.reason.value,
            }
        )

    def _log(self, record: RequestRecord, status: str) -> None:
        """One JSON line per request; never the prompt or the output."""
        if not request_log.isEnabledFor(logging.INFO):
            return
        line = {
            "event": "request",
            "method": record.method,
            "id": record.request_id,
            "status": status,
            "input_tokens": record.input_length,
            "total_time": round(time.monotonic() - record.arrival, 6),
            "validation_time": round(record.validation_time, 6),
        }
        if record.finishes:
            f = record.finishes[0]
            line.update(
                generated_tokens=sum(x.generated_tokens for x in record.finishes),
                finish_reason=f.reason.value,
                queue_time=round(f.queue_time, 6),
                inference_time=round(f.inference_time, 6),
                time_per_token=round(f.inference_time / f.generated_tokens, 6)
                if f.generated_tokens
                else 0.0,
            )
        request_log.info(json.dumps(line), extra={"fields": line})


def _wall_clock_ns():
    """Map monotonic seconds to wall-clock nanoseconds (OTel timestamps)."""
    offset = time.time() - time.monotonic()
    return lambda t: int((t + offset) * 1e9)
