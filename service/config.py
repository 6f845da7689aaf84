"""Settings: flags and environment -> one immutable object, built once and passed down.

Flags mirror TGI's launcher where the meaning is the same. Every flag can also come
from the environment as TEXTGEN_<FLAG> (e.g. TEXTGEN_MAX_BATCH_SIZE); the prefix
keeps generic names such as HOSTNAME and PORT, which shells and containers set for
their own purposes, from leaking in. The environment is read when the parser is
built, never at import time.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from textgen.sdk.keepalive import Keepalive

ENV_PREFIX = "TEXTGEN_"
# --quantize values (TGI's flag): those service/models/quantize.py implements
QUANTIZE_METHODS = ("int8", "int4", "fp8")


@dataclass(frozen=True)
class Settings:
    model_id: str | None = None  # None: the embedded default model
    revision: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    quantize: str | None = None  # one of QUANTIZE_METHODS; None: the weights as loaded
    max_concurrent_requests: int = 128
    max_queued_requests: int = 0  # requests that may wait for a permit; 0: refuse at once
    max_queued_tokens: int = 0  # prompt tokens those may hold; 0: no token bound
    graceful_termination_timeout: float = 90.0  # seconds in-flight streams get on SIGTERM
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_stop_sequence_length: int = 256  # characters
    max_top_n_tokens: int = 5
    max_client_batch_size: int = 4  # prompts in one /v1/completions request
    max_input_tokens: int | None = None  # None: max_total_tokens - 1
    max_total_tokens: int | None = None  # None: min(model context, 4096)
    max_batch_prefill_tokens: int = 2048  # per-step prefill budget (prompts are chunked)
    max_batch_total_tokens: int | None = None  # KV-cache capacity; None: sized from memory
    max_batch_size: int = 256
    validation_workers: int = 2  # threads validating long prompts and compiling grammars
    torch_threads: int = 0  # intra-op threads of the engine; 0: the CPUs we may use (cpus.py)
    # an idle engine woken by a request steps once no other has arrived for this long
    # (a burst then starts in one prefill step; engine/loop.py); 0: at once
    arrival_gap_ms: float = 1.0
    # batch-invariant engine: a greedy or seeded request's tokens don't depend on the traffic
    # around it (CPU only; costs throughput: docs/performance.md)
    deterministic: bool = False
    # decode steps replayed from CUDA graphs; None: on when the model is on a CUDA device
    cuda_graphs: bool | None = None
    # decode steps through torch.compile'd graphs (CPU only: engine/compiled_decode.py)
    compile: bool = False
    api_key: str | None = None
    api_key_file: str | None = None  # one key per line
    auth_health_and_metrics: bool = False  # True: health and metrics need a key too
    hostname: str = "127.0.0.1"
    port: int = 8080  # HTTP (Envoy)
    grpc_port: int = 50051
    no_envoy: bool = False
    # seconds between keepalive pings on a gRPC connection without data (Envoy's, the
    # SDK's); the server accepts them a third of this apart (textgen.sdk.keepalive)
    keepalive_interval: float = 30.0
    otlp_endpoint: str | None = None  # OTLP/gRPC collector for traces; None: tracing off
    # /v1/responses' store (previous_response_id), in this replica's memory; 0 MB: none
    responses_store_mb: float = 64.0
    responses_store_ttl: float = 3600.0  # seconds a stored response is kept

    @property
    def keepalive(self) -> Keepalive:
        return Keepalive(interval=self.keepalive_interval)

    def resolved_limits(self, max_position_embeddings: int) -> tuple[int, int]:
        """(max_input_tokens, max_total_tokens) for a model with this context length."""
        total = self.max_total_tokens or min(max_position_embeddings, 4096)
        max_input = self.max_input_tokens or total - 1
        if max_input >= total:
            raise ValueError(
                f"--max-input-tokens ({max_input}) must be < --max-total-tokens ({total})"
            )
        if total > max_position_embeddings:
            raise ValueError(
                f"--max-total-tokens ({total}) exceeds the model's context "
                f"({max_position_embeddings})"
            )
        return max_input, total


def _env_name(name: str) -> str:
    return ENV_PREFIX + name.upper().replace("-", "_")


def _env(name: str, default=None):
    return os.environ.get(_env_name(name), default)


def _env_bool(name: str) -> bool | None:
    """TEXTGEN_<NAME> as a tri-state flag: unset or empty -> None (the default applies)."""
    text = (_env(name) or "").strip().lower()
    if not text:
        return None
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(
        f"{ENV_PREFIX}{name.upper().replace('-', '_')}={text!r}: use 1/0 or true/false"
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _quantize_method(text: str) -> str | None:
    value = text.strip().lower()
    if value in ("", "none"):
        return None
    if value not in QUANTIZE_METHODS:
        raise argparse.ArgumentTypeError(
            f"unknown value {text!r}; use one of {', '.join(QUANTIZE_METHODS)}"
        )
    return value


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The `textgen serve` flags; each default comes from TEXTGEN_<FLAG> when set."""
    d = Settings()

    def flag(name: str, *, type=str, default=None, help: str) -> None:
        env_default = _env(name)
        try:
            value = type(env_default) if env_default is not None else default
        except (argparse.ArgumentTypeError, ValueError) as exc:
            parser.error(f"{_env_name(name)}={env_default!r}: {exc}")  # exits 2, as a flag
        parser.add_argument(
            f"--{name}",
            type=type,
            default=value,
            help=f"{help} [env {_env_name(name)}]",
        )

    flag(
        "model-id",
        default=d.model_id,
        help="Hub id or local folder (default: embedded SmolLM2-135M-Instruct)",
    )
    flag("revision", default=d.revision, help="Hub revision (branch, tag or commit)")
    flag("dtype", default=d.dtype, help="auto | float32 | bfloat16 | float16")
    flag("device", default=d.device, help="auto | cpu | cuda | cuda:N")
    flag(
        "quantize",
        type=_quantize_method,
        default=d.quantize,
        help="weight-only quantization at load: int8 | int4 (CPU and CUDA; on CPU they "
        "compute in bfloat16) | fp8 (CUDA, compute capability 8.9+)",
    )
    flag(
        "max-concurrent-requests",
        type=_positive_int,
        default=d.max_concurrent_requests,
        help="requests admitted at once; more get `overloaded`",
    )
    flag(
        "max-queued-requests",
        type=int,
        default=d.max_queued_requests,
        help="requests that may wait for a permit instead of failing with `overloaded` (0: none)",
    )
    flag(
        "max-queued-tokens",
        type=int,
        default=d.max_queued_tokens,
        help="prompt tokens the waiting requests may hold (0: no bound)",
    )
    flag(
        "graceful-termination-timeout",
        type=float,
        default=d.graceful_termination_timeout,
        help="seconds in-flight requests get to finish after SIGTERM/SIGINT",
    )
    flag("max-best-of", type=_positive_int, default=d.max_best_of, help="largest best_of")
    flag(
        "max-stop-sequences",
        type=int,
        default=d.max_stop_sequences,
        help="most stop sequences per request",
    )
    flag(
        "max-stop-sequence-length",
        type=_positive_int,
        default=d.max_stop_sequence_length,
        help="longest stop sequence, in characters",
    )
    flag("max-top-n-tokens", type=int, default=d.max_top_n_tokens, help="largest top_n_tokens")
    flag(
        "max-client-batch-size",
        type=_positive_int,
        default=d.max_client_batch_size,
        help="most prompts in one /v1/completions request",
    )
    flag(
        "max-input-tokens",
        type=_positive_int,
        default=d.max_input_tokens,
        help="longest prompt (default: max-total-tokens - 1)",
    )
    flag(
        "max-total-tokens",
        type=_positive_int,
        default=d.max_total_tokens,
        help="longest prompt + generation (default: min(model context, 4096))",
    )
    flag(
        "max-batch-prefill-tokens",
        type=_positive_int,
        default=d.max_batch_prefill_tokens,
        help="prefill tokens per engine step",
    )
    flag(
        "max-batch-total-tokens",
        type=_positive_int,
        default=d.max_batch_total_tokens,
        help="KV-cache capacity in tokens (default: sized from free memory)",
    )
    flag(
        "max-batch-size",
        type=_positive_int,
        default=d.max_batch_size,
        help="most sequences per step",
    )
    # TGI's --waiting-served-ratio and --max-waiting-tokens have no counterpart: prefill
    # chunks ride in the decodes' forward, so nothing needs rationing (engine/scheduler.py)
    flag(
        "torch-threads",
        type=_non_negative_int,
        default=d.torch_threads,
        help="torch's intra-op threads on the engine's thread (0: OMP_NUM_THREADS if set, "
        "else the CPUs this process may use: its affinity, capped by a container's CPU quota)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        default=_env("deterministic", "") not in ("", "0", "false"),
        help="batch-invariant engine: a greedy or seeded request gives the same tokens "
        "whatever runs beside it (CPU only; slower: docs/performance.md) "
        f"[env {ENV_PREFIX}DETERMINISTIC]",
    )
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=_env_bool("cuda-graphs"),
        help="replay decode steps from CUDA graphs captured per batch size at start-up "
        "(default: on when the model is on a CUDA device; refused on CPU) "
        f"[env {ENV_PREFIX}CUDA_GRAPHS]",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=_env("compile", "") not in ("", "0", "false"),
        help="run decode steps of up to 32 sequences through torch.compile'd graphs, one per "
        "batch bucket, compiled at startup (CPU only, off by default; ~10-15%% faster steps "
        "here, minutes of startup with a cold compile cache: docs/performance.md) "
        f"[env {ENV_PREFIX}COMPILE]",
    )
    flag(
        "arrival-gap-ms",
        type=_non_negative_float,
        default=d.arrival_gap_ms,
        help="an idle engine woken by a request takes its first step once no other request "
        "has arrived for this long, at most 20 ms after the first, so a burst of requests "
        "starts in one prefill step (0: at once)",
    )
    flag(
        "validation-workers",
        type=_positive_int,
        default=d.validation_workers,
        help="threads that validate long prompts and compile grammars (TGI's flag)",
    )
    flag("api-key", default=d.api_key, help="require `authorization: Bearer KEY` on every call")
    flag("api-key-file", default=d.api_key_file, help="file of accepted API keys, one per line")
    parser.add_argument(
        "--auth-health-and-metrics",
        action="store_true",
        default=_env("auth-health-and-metrics", "") not in ("", "0", "false"),
        help="require the API key on health and metrics too",
    )
    flag("hostname", default=d.hostname, help="address to listen on")
    flag("port", type=int, default=d.port, help="HTTP port (Envoy)")
    flag("grpc-port", type=int, default=d.grpc_port, help="gRPC port")
    flag(
        "keepalive-interval",
        type=_positive_float,
        default=d.keepalive_interval,
        help="seconds between HTTP/2 keepalive pings on an idle gRPC connection: Envoy's to "
        "this server; the server accepts clients' pings a third of this apart",
    )
    flag(
        "otlp-endpoint",
        default=d.otlp_endpoint,
        help="send OpenTelemetry traces to this OTLP/gRPC collector (e.g. http://127.0.0.1:4317)",
    )
    flag(
        "responses-store-mb",
        type=_non_negative_float,
        default=d.responses_store_mb,
        help="memory (MB) for the conversations /v1/responses keeps for previous_response_id, "
        "per replica; the oldest go first (0: keep none)",
    )
    flag(
        "responses-store-ttl",
        type=_positive_float,
        default=d.responses_store_ttl,
        help="seconds a stored /v1/responses conversation is kept",
    )
    parser.add_argument(
        "--no-envoy",
        action="store_true",
        default=_env("no-envoy", "") not in ("", "0", "false"),
        help="serve gRPC only",
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    fields = Settings.__dataclass_fields__
    return Settings(**{k: v for k, v in vars(args).items() if k in fields})
