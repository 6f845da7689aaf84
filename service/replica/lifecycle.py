"""Wire one replica together: model -> engine core -> engine loop -> validator ->
servicer -> grpc.aio server. `serve` runs it until a signal arrives, then drains it."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from opentelemetry.sdk.trace import TracerProvider

from ..engine.adapters import AdapterRegistry
from ..engine.block_manager import num_blocks_for_tokens
from ..engine.loop import EngineLoop
from ..engine.runners.sharded import ShardGroup, agree
from ..grpc.lora_rpcs import LoraServing
from ..grpc.server import build_server, set_serving
from ..grpc.servicer import TextGenerationServicer
from ..intake.admission import Admission
from ..intake.image_urls import FetchLimits
from ..intake.images import ImageLimits, ImagePrompts
from ..intake.validation import Limits, Validator
from ..models import LoadedModel
from ..models.architectures import BOTH_WAYS, IMAGES_LISTED_BY, images_refused_reason
from ..models.loader import ModelShard
from ..observability.metrics import Metrics, MetricsListener
from ..observability.requests import RequestRecorder
from ..observability.tracing import otlp_tracer_provider, server_interceptors
from ..openai.reasoning import resolve_parser
from ..openai.response_store import ResponseStore
from ..processes.cpus import default_torch_threads, in_own_thread
from ..processes.envoy import Envoy, HttpOptions, start_envoy
from ..settings.preflight import device_type, num_shards, visible_gpus
from ..settings.table import Settings
from .assembly import (
    adapter_reader,
    cap_cuda_memory,
    grammar_compiler,
    load_adapters,
    load_draft,
    load_served,
    lora_plan,
    request_interceptors,
    served_core,
    served_model,
)
from .kv_sizing import KV_BLOCK_SIZE, kv_capacity_tokens, kv_floor
from .shard_processes import (
    ShardError,
    ShardProcesses,
    join,
    leave,
    placement,
)

# What Envoy gets, past --graceful-termination-timeout, to deliver the error events of
# the requests the drain had to cut.
CUT_DELIVERY_TIMEOUT = 2.0


@dataclass
class Replica:
    """A started replica; stop() shuts it down."""

    settings: Settings
    loaded: LoadedModel
    engine: EngineLoop
    servicer: TextGenerationServicer
    server: object
    health: object
    grpc_port: int
    shards: ShardProcesses | None = None  # the local ranks 1..N-1 of a sharded model
    metrics_listener: MetricsListener | None = None  # --prometheus-port

    def failure(self) -> str | None:
        """Why this replica can't serve any more (a shard or the engine died), or None."""
        if self.shards is not None and (dead := self.shards.dead()):
            return dead
        if self.engine.last_error is not None:
            return f"the engine stopped: {self.engine.last_error}"
        return None

    async def drain(self, timeout: float) -> bool:
        """Stop taking work (health NOT_SERVING, new requests UNAVAILABLE) and wait up
        to `timeout` seconds for the requests in flight; False if some were cut."""
        self.servicer.draining = True
        await set_serving(self.health, False)
        return await self.servicer.admission.wait_idle(timeout)

    async def cut(self) -> None:
        """End every request still running now: the engine stops, and each one ends
        with its error (`the engine is shutting down`), which a started stream gets
        in-band, so that an HTTP client behind Envoy sees it too."""
        await asyncio.to_thread(self.engine.shutdown)

    async def stop(self, grace: float | None = 5.0) -> None:
        await set_serving(self.health, False)
        await self.server.stop(grace)
        await asyncio.to_thread(self.engine.shutdown)  # tells the other shards to stop too
        if self.servicer.validation_workers is not None:
            self.servicer.validation_workers.shutdown(wait=False)
        if self.metrics_listener is not None:
            self.metrics_listener.stop()
        if self.shards is not None:
            await asyncio.to_thread(self.shards.stop)
            leave()


log = logging.getLogger("textgen.serve")


async def start_replica(
    settings: Settings, tracer_provider: TracerProvider | None = None
) -> Replica:
    """Load, build and start one replica; returns once it serves. Tracing is on when a
    tracer provider is given or --otlp-endpoint is set. With --num-shard N > 1 it is rank 0
    of N: it starts the local shards first (shard_processes.py)."""
    world_size = num_shards(settings, device_type(settings), visible_gpus())
    plan = await asyncio.to_thread(lora_plan, settings)
    shards = groups = None
    if world_size > 1:
        shards = ShardProcesses.start(settings, world_size)
        settings = replace(settings, master_port=shards.master_port)
    device = "cuda:0" if world_size > 1 and device_type(settings) == "cuda" else settings.device
    try:
        if shards is not None:
            groups = await _join_watching(settings, world_size, shards)
        cap_cuda_memory(settings, device if device != "auto" else device_type(settings))
        loaded = await in_own_thread(
            load_served,
            settings,
            device,
            ModelShard(0, world_size, groups.model) if groups else None,
            plan,
        )
        adapters = None
        if plan is not None:
            adapters = await in_own_thread(load_adapters, settings, loaded, plan)
        return await _start_loaded(settings, loaded, tracer_provider, shards, groups, adapters)
    except BaseException:
        if shards is not None:
            await asyncio.to_thread(shards.stop, 0.0)
            leave()
        raise


async def _join_watching(settings: Settings, world_size: int, shards: ShardProcesses):
    """Join the shards' group as rank 0, failing at once if a local shard dies meanwhile."""
    joining = asyncio.ensure_future(
        in_own_thread(
            join, 0, world_size, settings.master_addr, settings.master_port, device_type(settings)
        )
    )
    while not joining.done():
        if dead := shards.dead():
            raise ShardError(f"{dead} before the shards joined")
        await asyncio.wait([joining], timeout=0.2)
    return joining.result()


async def _start_loaded(
    settings: Settings,
    loaded: LoadedModel,
    tracer_provider: TracerProvider | None,
    shards: ShardProcesses | None,
    groups,
    adapters: AdapterRegistry | None = None,
) -> Replica:
    context = loaded.max_position_embeddings
    capacity = kv_capacity_tokens(settings, loaded, kv_floor(settings, context))
    shard_group = None
    if groups is not None:  # every rank's pool the same size: rank 0's
        capacity = await asyncio.to_thread(agree, capacity, groups.control)
        shard_group = ShardGroup(
            0,
            loaded.shard.world_size,
            groups.control,
            groups.model,
            loaded.vocab.vocab_size,
            loaded.vocab.chunk,
            loaded.device,
            exited=shards.exited if shards is not None else None,  # who a failed step lost
        )
    max_input, max_total = settings.resolved_limits(context, capacity)
    limits = Limits(
        max_input_tokens=max_input,
        max_total_tokens=max_total,
        max_best_of=settings.max_best_of,
        max_stop_sequences=settings.max_stop_sequences,
        max_top_n_tokens=settings.max_top_n_tokens,
        max_stop_sequence_length=settings.max_stop_sequence_length,
        vocab_size=loaded.model.config.get_text_config().vocab_size,
        max_n=min(settings.max_n, settings.max_batch_size),
        kv_cache_blocks=num_blocks_for_tokens(capacity, KV_BLOCK_SIZE),
        kv_block_size=KV_BLOCK_SIZE,
        prefill_logprobs=settings.prefill_logprobs,
    )
    grammars = await asyncio.to_thread(grammar_compiler, loaded)
    draft = await in_own_thread(load_draft, settings, loaded)
    core = served_core(
        settings, loaded, capacity, max_total, grammars, draft, adapters, shard_group
    )
    metrics = Metrics()
    lora = None
    if adapters is not None:
        for adapter in adapters.serving():
            metrics.adapter_loaded(adapter.name)
        lora = LoraServing(
            adapters,
            adapter_reader(loaded) if shards is None and groups is None else None,
            refusal="LoRA adapters can't be loaded at run time with --num-shard > 1: list them "
            "in --lora-adapters",
            on_load=metrics.adapter_loaded,
            on_unload=metrics.adapter_unloaded,
        )
    torch_threads = settings.torch_threads or default_torch_threads()
    cpus = None
    if shards is not None:  # rank 0's engine thread on its own cores, as every shard
        place = placement(settings, 0, loaded.shard.world_size, loaded.device.type)
        torch_threads, cpus = place.torch_threads or torch_threads, place.cpus
    engine = EngineLoop(
        core,
        loaded.tokenizer,
        loaded.eos_token_ids,
        metrics=metrics,
        torch_threads=torch_threads,
        arrival_gap=settings.arrival_gap_ms / 1000,
        cpus=cpus,
    )
    admission = Admission(
        settings.max_concurrent_requests, settings.max_queued_requests, settings.max_queued_tokens
    )
    metrics.watch_engine(engine.stats, capacity, queued_fn=lambda: admission.queued)
    await asyncio.to_thread(engine.start)  # warms the core up on the engine's thread
    if tracer_provider is None and settings.otlp_endpoint:
        tracer_provider = otlp_tracer_provider(settings.otlp_endpoint, settings.otlp_service_name)
    tracer = tracer_provider.get_tracer("textgen") if tracer_provider else None
    servicer = TextGenerationServicer(
        engine,
        Validator(
            loaded.tokenizer,
            limits,
            # --disable-grammar-support: no compiler, so requests with a grammar are refused
            None if settings.disable_grammar_support else grammars,
            adapters,
            (loaded.resolved.model_id, str(loaded.resolved.path)),
            image_prompts(loaded.processor, loaded.model.config, settings.max_batch_prefill_tokens),
            no_images=no_images_reason(loaded),
            image_limits=image_limits(settings),
        ),
        served_model(settings, loaded, limits, core, engine),
        admission,
        RequestRecorder(metrics, tracer),
        ThreadPoolExecutor(settings.validation_workers, thread_name_prefix="textgen-validation"),
        ResponseStore(int(settings.responses_store_mb * 2**20), settings.responses_store_ttl),
        lora,
        resolve_parser(settings.reasoning_parser, loaded.tokenizer),
    )
    server, health, port = build_server(
        servicer,
        f"{settings.grpc_host}:{settings.grpc_port}",
        interceptors=[
            *server_interceptors(tracer_provider),
            *request_interceptors(settings, metrics),
        ],
        keepalive=settings.keepalive,
    )
    await server.start()
    listener = None
    if settings.prometheus_port is not None:
        listener = MetricsListener.start(metrics, settings.hostname, settings.prometheus_port)
        log.info("metrics on their own listener: %s", listener.url)
    await set_serving(health, True)
    return Replica(settings, loaded, engine, servicer, server, health, port, shards, listener)


def image_limits(settings: Settings) -> ImageLimits:
    fetch = FetchLimits(
        max_bytes=settings.max_image_bytes,
        timeout_s=settings.image_fetch_timeout,
        allow_private=settings.allow_private_image_urls,
    )
    return ImageLimits(settings.max_image_pixels, settings.max_images_per_request, fetch)


async def serve(settings: Settings) -> None:
    """Run until SIGINT/SIGTERM, or until Envoy dies (then exit 1, all stopped)."""
    started = time.monotonic()
    replica = await start_replica(settings)
    envoy = None
    if not settings.no_envoy:
        try:
            envoy = await start_envoy(
                settings.grpc_host,
                replica.grpc_port,
                listen_host=settings.hostname,
                listen_port=settings.port,
                keepalive=settings.keepalive,
                http=http_options(settings),
            )
        except BaseException:
            await replica.stop()
            raise
    log.info(
        "textgen ready: model=%s dtype=%s%s%s%s device=%s grpc=%s:%d%s (%.1fs)",
        replica.loaded.resolved.model_id,
        replica.servicer.served.info.model_dtype,
        f" ({reason})" if (reason := replica.servicer.served.info.dtype_reason) else "",
        f" quantize={replica.loaded.quantize}" if replica.loaded.quantize else "",
        f" kv_cache_dtype={settings.kv_cache_dtype}" if settings.kv_cache_dtype else "",
        replica.loaded.device,
        settings.grpc_host,
        replica.grpc_port,
        f" http={envoy.http_url}" if envoy else "",
        time.monotonic() - started,
    )
    if envoy:
        log.info("try: %s", curl_example(envoy.http_url))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stopped = asyncio.ensure_future(stop.wait())
    failed = asyncio.ensure_future(_first_failure(replica))
    await asyncio.wait(
        [stopped, failed] + ([envoy.exited] if envoy else []), return_when=asyncio.FIRST_COMPLETED
    )
    stopped.cancel()
    failed.cancel()
    envoy_died = envoy is not None and envoy.exited.done() and not stop.is_set()
    if envoy_died:
        log.error(
            "envoy (pid %d) exited with code %s; shutting down", envoy.pid, envoy.process.returncode
        )
    broken = failed.done() and not failed.cancelled() and not stop.is_set()
    if broken:
        # the in-flight requests got their typed error from the engine; none can finish
        log.error("%s; shutting down", failed.result())
        await set_serving(replica.health, False)
    if not envoy_died and not broken:
        await drain(replica, envoy, settings.graceful_termination_timeout)
    log.info("shutting down (pid %d)", os.getpid())
    await replica.stop()
    if envoy:
        await envoy.stop()
    if envoy_died or broken:
        raise SystemExit(1)


async def drain(replica: Replica, envoy: Envoy | None, timeout: float) -> None:
    """SIGTERM's drain, within `timeout` seconds: refuse new work, let the engine finish
    what runs, then let Envoy deliver it all to its clients. The gRPC server stays up
    meanwhile: Envoy may still be reading a finished stream's last messages from it.
    Requests still running at the timeout end with a typed error, which Envoy gets
    CUT_DELIVERY_TIMEOUT more seconds to deliver."""
    deadline = time.monotonic() + timeout
    log.info(
        "draining: health NOT_SERVING, new requests refused, %d in flight get up to %.0fs",
        replica.servicer.admission.in_flight,
        timeout,
    )
    if not await replica.drain(timeout):
        log.warning(
            "graceful termination timeout: %d requests still running end with an error",
            replica.servicer.admission.in_flight,
        )
        await replica.cut()
        deadline = time.monotonic() + CUT_DELIVERY_TIMEOUT
    if envoy is not None and not await envoy.drain(deadline):
        log.warning("graceful termination timeout: cutting the responses still undelivered")


FAILURE_POLL_S = 0.25


async def _first_failure(replica: Replica) -> str:
    """Why the replica stopped being able to serve, once it has (a shard or the engine
    died): the server then exits non-zero, and its supervisor restarts it."""
    while (reason := replica.failure()) is None:
        await asyncio.sleep(FAILURE_POLL_S)
    return reason


def http_options(settings: Settings) -> HttpOptions:
    """What Envoy's HTTP face takes from the settings."""
    return HttpOptions(
        payload_limit=settings.payload_limit, cors_allow_origin=settings.cors_allow_origin
    )


def curl_example(http_url: str) -> str:
    body = '{"inputs":"What is the capital of France?","parameters":{"max_new_tokens":20}}'
    return f"curl -N {http_url}/generate_stream -H 'Content-Type: application/json' -d '{body}'"


def image_prompts(processor, config, max_chunk: int | None = None) -> ImagePrompts | None:
    """A vision-language model's processor as validation applies it, for the model's
    `config`; None: no processor, no images."""
    if processor is None:
        return None
    return ImagePrompts(
        processor,
        getattr(config, "image_token_id", None),
        BOTH_WAYS.get(config.model_type),
        max_chunk,
        IMAGES_LISTED_BY.get(config.model_type, "pixel_values"),
    )


def no_images_reason(loaded: LoadedModel) -> str | None:
    """Why the loaded model takes no images where its config has a vision tower (Mllama,
    Llama 4: served as text), for Validator's `no_images`; None: a text-only model, or one
    served with images."""
    if loaded.processor is not None:
        return None
    config = loaded.model.config
    vision = getattr(config, "vision_config", None) is not None
    return images_refused_reason(getattr(config, "model_type", None), vision)
