"""Prometheus metrics with TGI's names and labels, plus what TGI lacks (KV cache,
prefix-cache hits, preemptions, time to first token, inter-token latency).

prometheus_client writes counters as `<name>_total`; TGI's dashboards read
`tgi_request_count`, `tgi_request_success` and `tgi_request_failure` as they are,
so those three are exported under their exact names as untyped samples (Prometheus
and rate() treat them like counters). Everything else is a stock prometheus_client
metric. Each replica has its own registry, so several can live in one process.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric

# Seconds: from 1 ms to ~2 min, roughly doubling.
DURATION_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
)
# Tokens: prompt and output lengths.
TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Tokens a sequence gained in one step beyond the first (speculative decoding's kept proposals)
SKIPPED_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
# Images of one request (--max-images-per-request: 8 by default)
IMAGE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32)


class ExactNameCounter:
    """A labelled counter exported under its exact name (no `_total`), as TGI does."""

    def __init__(self, name: str, doc: str, labelnames: tuple[str, ...] = ()) -> None:
        self.name, self.doc, self.labelnames = name, doc, labelnames
        self._values: dict[tuple[str, ...], float] = defaultdict(float)
        self._lock = threading.Lock()

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        with self._lock:
            self._values[labels] += amount

    def value(self, *labels: str) -> float:
        with self._lock:
            return self._values.get(labels, 0.0)

    def collect(self):
        metric = Metric(self.name, self.doc, "unknown")
        with self._lock:
            items = list(self._values.items()) or ([((), 0.0)] if not self.labelnames else [])
        for labels, value in items:
            metric.add_sample(self.name, dict(zip(self.labelnames, labels)), value)
        yield metric


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def histogram(
            name: str, doc: str, buckets=DURATION_BUCKETS, labels: tuple[str, ...] = ()
        ) -> Histogram:
            return Histogram(name, doc, labelnames=labels, buckets=buckets, registry=r)

        self.request_count = self._register(
            ExactNameCounter("tgi_request_count", "Requests received")
        )
        self.request_success = self._register(
            ExactNameCounter("tgi_request_success", "Requests that completed")
        )
        self.request_failure = self._register(
            ExactNameCounter("tgi_request_failure", "Requests that failed, by error type", ("err",))
        )
        self.request_duration = histogram("tgi_request_duration", "Request duration (s)")
        self.validation_duration = histogram(
            "tgi_request_validation_duration", "Validation duration (s)"
        )
        self.queue_duration = histogram("tgi_request_queue_duration", "Time in the queue (s)")
        self.inference_duration = histogram(
            "tgi_request_inference_duration", "Inference duration (s)"
        )
        self.mean_time_per_token = histogram(
            "tgi_request_mean_time_per_token_duration", "Mean time per generated token (s)"
        )
        self.input_length = histogram("tgi_request_input_length", "Prompt tokens", TOKEN_BUCKETS)
        self.generated_tokens = histogram(
            "tgi_request_generated_tokens", "Generated tokens", TOKEN_BUCKETS
        )
        self.max_new_tokens = histogram(
            "tgi_request_max_new_tokens", "max_new_tokens asked", TOKEN_BUCKETS
        )
        self.batch_forward_duration = histogram(
            "tgi_batch_forward_duration",
            "One engine step's forward and sampling (s)",
            labels=("method",),
        )
        self.batch_size = histogram(
            "textgen_batch_size", "Sequences per engine step", BATCH_BUCKETS
        )
        self.skipped_tokens = histogram(
            "tgi_request_skipped_tokens",
            "Tokens a sequence gained in one step beyond the first: proposals kept by "
            "speculative decoding (one observation per sequence per step)",
            SKIPPED_BUCKETS,
        )
        self.request_images = histogram(
            "textgen_request_images",
            "Images per request, of the requests that have any (a vision-language model's)",
            IMAGE_BUCKETS,
        )
        self.image_encode_duration = histogram(
            "textgen_image_encode_duration_seconds",
            "Vision tower and projector time per image encoded (s): a step's encoding split"
            " over its images; images served from the encoder cache are not encoded",
        )
        self.time_to_first_token = histogram(
            "textgen_time_to_first_token_seconds", "Arrival to first token (s)"
        )
        self.inter_token_latency = histogram(
            "textgen_inter_token_latency_seconds", "Time between tokens (s)"
        )
        # by priority class (priority_label: a bounded set of labels for any integer)
        self.requests_by_priority = Counter(
            "textgen_requests_by_priority",
            "Requests that completed, by priority (lower is served sooner)",
            ["priority"],
            registry=r,
        )
        self.queue_duration_by_priority = histogram(
            "textgen_request_queue_duration_by_priority",
            "Time in the queue (s), by priority",
            labels=("priority",),
        )
        self.cancelled = Counter(
            "textgen_requests_cancelled",
            "Requests the client abandoned (TGI's `dropped`)",
            registry=r,
        )
        # by LoRA adapter: labels only for the adapters loaded now (adapter_loaded/unloaded)
        self.lora_requests = Counter(
            "textgen_lora_requests",
            "Requests that completed with a LoRA adapter, by adapter",
            ["adapter"],
            registry=r,
        )
        self.lora_generated_tokens = Counter(
            "textgen_lora_generated_tokens",
            "Tokens generated with a LoRA adapter, by adapter",
            ["adapter"],
            registry=r,
        )
        self._adapters: set[str] = set()
        self._engine_stats = None

    def adapter_loaded(self, name: str) -> None:
        """Count `name`'s requests from now on (at zero)."""
        self._adapters.add(name)
        self.lora_requests.labels(name)
        self.lora_generated_tokens.labels(name)

    def adapter_unloaded(self, name: str) -> None:
        """Drop `name`'s series: only loaded adapters have labels, so they stay bounded."""
        self._adapters.discard(name)
        for counter in (self.lora_requests, self.lora_generated_tokens):
            try:
                counter.remove(name)
            except KeyError:
                pass

    def count_adapter(self, name: str, generated_tokens: int) -> None:
        """A request with adapter `name` completed (ignored once it is unloaded)."""
        if name in self._adapters:
            self.lora_requests.labels(name).inc()
            self.lora_generated_tokens.labels(name).inc(generated_tokens)

    def _register(self, collector):
        self.registry.register(collector)
        return collector

    def watch_engine(self, stats_fn, max_batch_total_tokens: int, queued_fn=None) -> None:
        """Gauges read from the engine (and the admission queue's length, `queued_fn`)
        at scrape time."""
        self._engine_stats = stats_fn
        self.registry.register(_EngineCollector(stats_fn, max_batch_total_tokens, queued_fn))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, stats_fn, max_batch_total_tokens: int, queued_fn=None) -> None:
        self.stats_fn = stats_fn
        self.max_batch_total_tokens = max_batch_total_tokens
        self.queued_fn = queued_fn or (lambda: 0)

    def collect(self):
        s = self.stats_fn()
        # what a gateway's endpoint picker scrapes (the Gateway API Inference Extension's
        # model-server protocol): queued and running requests, KV-cache use as a fraction
        yield _gauge(
            "textgen_requests_waiting",
            "Requests waiting: for an admission permit, or for their first forward",
            self.queued_fn() + s.waiting,
        )
        yield _gauge("textgen_requests_running", "Sequences running in the engine", s.running)
        yield _gauge(
            "textgen_kv_cache_usage_ratio",
            "Share of the KV-cache blocks in use (0 to 1)",
            s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0,
        )
        yield _gauge("tgi_queue_size", "Requests waiting for their first forward", s.waiting)
        yield _gauge("tgi_batch_current_size", "Sequences running", s.running)
        yield _gauge(
            "tgi_batch_current_max_tokens",
            "KV-cache capacity in tokens",
            self.max_batch_total_tokens,
        )
        yield _gauge("textgen_kv_cache_blocks_used", "KV-cache blocks in use", s.kv_blocks_used)
        yield _gauge(
            "textgen_kv_cache_blocks_total", "KV-cache blocks in the pool", s.kv_blocks_total
        )
        if s.state_slots_total:  # a hybrid model's state pool
            yield _gauge(
                "textgen_state_slots_used",
                "State-pool slots in use (a hybrid model's per-sequence state)",
                s.state_slots_used,
            )
            yield _gauge(
                "textgen_state_slots_total",
                "State-pool slots (one per sequence)",
                s.state_slots_total,
            )
        queried = s.prefix_cache_queried_tokens
        yield _gauge(
            "textgen_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache",
            s.prefix_cache_hit_tokens,
        )
        yield _gauge(
            "textgen_prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache",
            queried,
        )
        yield _gauge(
            "textgen_prefix_cache_hit_ratio",
            "Share of looked-up prompt tokens found cached",
            s.prefix_cache_hit_tokens / queried if queried else 0.0,
        )
        yield _gauge(
            "textgen_preemptions", "Sequences preempted (recomputed) so far", s.preemptions
        )
        yield _gauge(
            "textgen_kv_blocks_window_released",
            "KV blocks running sequences gave back out of their sliding window, so far (a"
            " model whose every layer slides)",
            s.window_released_blocks,
        )
        yield _gauge(
            "textgen_prefill_tokens",
            "Prompt tokens computed so far (recomputes included; prefix-cache hits and the"
            " other choices of an n > 1 request, which share the prompt, not)",
            s.prefill_tokens,
        )
        proposed = s.spec_proposed_tokens
        yield _gauge(
            "textgen_speculative_proposed_tokens",
            "Tokens proposed by speculative decoding and verified, so far",
            proposed,
        )
        yield _gauge(
            "textgen_speculative_accepted_tokens",
            "Proposed tokens the target model kept, so far",
            s.spec_accepted_tokens,
        )
        yield _gauge(
            "textgen_speculative_verifications",
            "Decodes that verified proposed tokens (one per sequence per step), so far",
            s.spec_verifications,
        )
        yield _gauge(
            "textgen_speculative_acceptance_ratio",
            "Share of the proposed tokens kept (0 to 1)",
            s.spec_accepted_tokens / proposed if proposed else 0.0,
        )
        yield _gauge(
            "textgen_speculative_mean_accepted_length",
            "Proposed tokens kept per verifying decode, on average",
            s.spec_accepted_tokens / s.spec_verifications if s.spec_verifications else 0.0,
        )
        yield _gauge(
            "textgen_speculative_sequences_off",
            "Sequences adaptive speculation keeps from proposing (but to probe) now: their"
            " kept tokens don't pay for the verification",
            s.spec_sequences_off,
        )
        yield _gauge(
            "textgen_speculative_skipped_proposals",
            "Decodes adaptive speculation kept from proposing (one per sequence per step), so far",
            s.spec_skipped_proposals,
        )


PRIORITY_LABEL_RANGE = 10  # priorities beyond +-10 share the labels "<-10" and ">10"


def priority_label(priority: int) -> str:
    """A metric label for a priority: the value itself within +-10, else its side."""
    if priority < -PRIORITY_LABEL_RANGE:
        return f"<-{PRIORITY_LABEL_RANGE}"
    if priority > PRIORITY_LABEL_RANGE:
        return f">{PRIORITY_LABEL_RANGE}"
    return str(priority)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


@dataclass
class MetricsListener:
    """The metrics on their own HTTP port (--prometheus-port, as TGI serves them on 9000),
    every path answering them, beside GET /metrics; prometheus_client's server, on a
    thread of its own."""

    server: object  # wsgiref's WSGIServer
    thread: threading.Thread
    url: str

    @classmethod
    def start(cls, metrics: Metrics, host: str, port: int) -> MetricsListener:
        server, thread = start_http_server(port, addr=host, registry=metrics.registry)
        address = f"[{host}]" if ":" in host else host
        return cls(server, thread, f"http://{address}:{server.server_port}/metrics")

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
