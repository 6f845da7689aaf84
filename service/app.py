"""Wire one replica together: model -> engine core -> engine loop -> validator ->
servicer -> grpc.aio server. `serve` runs it until a signal arrives."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
from opentelemetry.sdk.trace import TracerProvider

from . import __version__
from .admission import Admission
from .build_info import source_commit
from .config import DEFAULT_MAX_TOTAL_TOKENS, SettingError, Settings
from .cpus import default_torch_threads, in_own_thread
from .engine.adapters import AdapterRegistry
from .engine.block_manager import num_blocks_for_tokens
from .engine.compiled_decode import CompileSettings
from .engine.cuda_graphs import GraphSettings, unavailable_reason
from .engine.draft_model import DraftModelProposer, TokenizerMismatch, check_same_tokenizer
from .engine.grammar import GrammarMasks
from .engine.kv_pool import KV_CACHE_DTYPES
from .engine.loop import EngineLoop
from .engine.paged_core import PagedCore
from .engine.shards import ShardGroup, agree
from .engine.speculation import SpeculationSettings
from .engine.watermark import Watermark
from .errors import ErrorType
from .grammar_compiler import GrammarCompiler
from .grpc.interceptors import ApiKeyInterceptor, DecodingInterceptor
from .grpc.lora_rpcs import LoraServing
from .grpc.server import SERVICE_NAME, build_server, set_serving
from .grpc.servicer import ServedModel, TextGenerationServicer
from .models import LoadedModel, load_model
from .models.compile_cache import compile_cache_dir
from .models.loader import LoadOptions, LoraSetup, ModelShard
from .models.lora import AdapterError, read_adapter
from .observability.metrics import Metrics, MetricsListener
from .observability.requests import RequestRecorder
from .observability.tracing import otlp_tracer_provider, server_interceptors
from .openai.response_store import ResponseStore
from .preflight import (
    LoraPlan,
    base_model_names,
    chat_template_of,
    check_kv_capacity,
    check_lora,
    check_strategies,
    device_type,
    model_config,
    visible_gpus,
)
from .proto import text_generation_service_pb2 as svc_pb
from .proxy import Envoy, HttpOptions, start_envoy
from .shard_processes import (
    ShardError,
    ShardProcesses,
    join,
    leave,
    num_shards,
    placement,
)
from .validation import Limits, Validator

log = logging.getLogger("textgen.serve")

# Share of free memory the KV cache takes when --max-batch-total-tokens is unset: most
# of what a GPU has left after the weights; on CPU a tenth of free RAM, since the pool
# is zero-filled up front and shares the machine with everything else.
KV_MEMORY_FRACTION = {"cuda": 0.85, "cpu": 0.1}
KV_BLOCK_SIZE = 16
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


def kv_bytes_per_token(
    model: torch.nn.Module, dtype: torch.dtype, kv_heads: int | None = None
) -> int:
    """KV-cache bytes one token takes in this process's pool (`kv_heads`: a shard's own)."""
    cfg = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    heads = kv_heads or getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * 2 * heads * head_dim * torch.finfo(dtype).bits // 8


def free_memory_bytes(device: torch.device, cuda_memory_fraction: float = 1.0) -> int:
    """Memory still free for the KV cache; on CUDA within --cuda-memory-fraction of the
    device's total, less what torch holds already (the weights)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if cuda_memory_fraction < 1.0:
            allowed = int(total * cuda_memory_fraction) - torch.cuda.memory_reserved(device)
            free = max(0, min(free, allowed))
        return free
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def kv_floor(settings: Settings, context: int) -> int:
    """The fewest tokens the KV pool holds: one request of --max-total-tokens. With
    --full-context, which the pool then bounds, one of serve's default length (or just
    past --max-input-tokens), or --max-batch-total-tokens when that is given."""
    if settings.max_total_tokens or not settings.full_context:
        return settings.resolved_limits(context)[1]
    if settings.max_batch_total_tokens:
        return min(context, settings.max_batch_total_tokens)
    return min(context, max(DEFAULT_MAX_TOTAL_TOKENS, (settings.max_input_tokens or 0) + 1))


def kv_cache_dtype(settings: Settings, loaded: LoadedModel) -> torch.dtype:
    """The KV pool's storage dtype: --kv-cache-dtype, else the model's."""
    return KV_CACHE_DTYPES[settings.kv_cache_dtype] if settings.kv_cache_dtype else loaded.dtype


def kv_capacity_tokens(settings: Settings, loaded: LoadedModel, max_total_tokens: int) -> int:
    """--max-batch-total-tokens, or what a share of free memory holds in the pool's dtype
    (--kv-cache-dtype): at least one full-length request either way (a smaller pool is
    refused at startup, so that validation's bound, max_total_tokens, is the only one a
    request meets)."""
    if settings.max_batch_total_tokens:
        check_kv_capacity(settings, max_total_tokens)
        return settings.max_batch_total_tokens
    layout = loaded.shard_layout
    per_token = kv_bytes_per_token(
        loaded.model, kv_cache_dtype(settings, loaded), layout.kv_heads_per_rank if layout else None
    )
    fraction = KV_MEMORY_FRACTION.get(loaded.device.type, 0.1)
    free = free_memory_bytes(loaded.device, settings.cuda_memory_fraction)
    fits = int(free * fraction) // per_token
    return max(max_total_tokens, min(fits, 1 << 20))


def cuda_graph_settings(
    settings: Settings, loaded: LoadedModel, max_total_tokens: int
) -> GraphSettings | None:
    """--cuda-graphs as given (refused where graphs can't run), else on where they can;
    captured for --cuda-graph-sizes, else for every bucket up to --max-batch-size."""
    reason = unavailable_reason(loaded.device)
    if settings.disable_custom_kernels and reason is None:
        reason = "CUDA graphs replay the Triton kernel that --disable-custom-kernels turns off"
    if settings.cuda_graphs and reason:
        raise SettingError("--cuda-graphs", None, f"{reason} (pass --no-cuda-graphs)")
    if settings.cuda_graphs is None:
        if reason and loaded.device.type == "cuda":
            log.warning("CUDA graphs off: %s", reason)
        if reason or settings.deterministic:  # --deterministic refuses CUDA anyway
            return None
    elif not settings.cuda_graphs:
        return None
    graphs = GraphSettings.for_engine(
        settings.max_batch_size, max_total_tokens, KV_BLOCK_SIZE, progress=not settings.json_output
    )
    if settings.cuda_graph_sizes:
        graphs = replace(graphs, buckets=settings.cuda_graph_sizes)
    return graphs


def compile_settings(settings: Settings, loaded: LoadedModel) -> CompileSettings | None:
    """--compile (off by default): CPU only, and not with --deterministic. Its artifacts
    live in the textgen cache (models/compile_cache.py), whatever TORCHINDUCTOR_CACHE_DIR
    says (torch sets it to its temp-dir default on import, and children inherit that);
    if that cache can't be written, in torch's default."""
    if not settings.compile:
        return None
    check_strategies(settings, loaded.device.type)
    try:
        cache_dir = compile_cache_dir(loaded)
    except OSError as exc:
        log.warning("compile cache unavailable (%s): compiling under the temp dir", exc)
        cache_dir = None
    return CompileSettings.for_engine(
        settings.max_batch_size,
        speculation_settings(settings),
        progress=not settings.json_output,
        cache_dir=cache_dir,
    )


def speculation_settings(settings: Settings) -> SpeculationSettings | None:
    if not settings.speculate:
        return None
    return SpeculationSettings(
        settings.speculate,
        settings.speculate_max_batch,
        settings.speculate_ngram_min,
        settings.speculate_ngram_max,
    )


def load_draft(settings: Settings, loaded: LoadedModel) -> LoadedModel | None:
    """--speculate-model, on the model's device and dtype; refused unless it shares the
    model's tokenizer."""
    if settings.speculate_model is None:
        return None
    if not settings.speculate:
        raise SettingError("--speculate-model", settings.speculate_model, "needs --speculate N")
    draft = load_model(
        settings.speculate_model, None, str(loaded.dtype).removeprefix("torch."), str(loaded.device)
    )
    try:
        check_same_tokenizer(loaded.tokenizer, draft.tokenizer)
    except TokenizerMismatch as exc:
        raise SettingError("--speculate-model", settings.speculate_model, str(exc)) from None
    return draft


def build_core(
    settings: Settings,
    loaded: LoadedModel,
    capacity: int,
    grammars: GrammarCompiler,
    graphs: GraphSettings | None = None,
    compiled: CompileSettings | None = None,
    shards: ShardGroup | None = None,
    draft: LoadedModel | None = None,
    adapters: AdapterRegistry | None = None,
) -> PagedCore:
    proposer = None
    if draft is not None:  # a pool of its own, as many blocks as the model's
        proposer = DraftModelProposer(
            draft.model,
            num_blocks=num_blocks_for_tokens(capacity, KV_BLOCK_SIZE),
            block_size=KV_BLOCK_SIZE,
            vocab_size=loaded.model.config.get_text_config().vocab_size,
            catch_up_tokens=settings.max_batch_prefill_tokens,
        )
    return PagedCore(
        loaded.model,
        max_batch_total_tokens=capacity,
        max_batch_prefill_tokens=settings.max_batch_prefill_tokens,
        max_batch_size=settings.max_batch_size,
        block_size=KV_BLOCK_SIZE,
        grammars=GrammarMasks(grammars.ll_tokenizer, grammars.vocab_size),
        batch_invariant=settings.deterministic,
        cuda_graphs=graphs,
        compile=compiled,
        shards=shards,
        custom_kernels=not settings.disable_custom_kernels,
        speculation=speculation_settings(settings),
        proposer=proposer,
        lora=loaded.lora,
        adapters=adapters,
        kv_cache_dtype=KV_CACHE_DTYPES.get(settings.kv_cache_dtype),
        watermark=Watermark(settings.watermark_gamma, settings.watermark_delta),
    )


def load_options(settings: Settings) -> LoadOptions:
    """Where the model's files come from, and what changes in them as they load."""
    template = settings.tokenizer_config_path
    return LoadOptions(
        hub_cache=settings.huggingface_hub_cache,
        folder=settings.weights_cache_override,
        trust_remote_code=settings.trust_remote_code,
        rope=settings.rope,
        chat_template=chat_template_of(template) if template is not None else None,
    )


def cap_cuda_memory(settings: Settings, device: str) -> None:
    """--cuda-memory-fraction: torch's allocator may not take more of the device."""
    if settings.cuda_memory_fraction < 1.0 and device.startswith("cuda"):
        index = torch.device(device).index
        torch.cuda.set_per_process_memory_fraction(
            settings.cuda_memory_fraction, index if index is not None else 0
        )


def lora_plan(settings: Settings) -> LoraPlan | None:
    """The LoRA slots to load the model with (preflight.py's rules; None: no LoRA)."""
    if not settings.lora_adapters and not settings.max_loras:
        return None
    return check_lora(settings, base_model_names(settings, model_config(settings)[0]))


def load_adapters(settings: Settings, loaded: LoadedModel, plan: LoraPlan) -> AdapterRegistry:
    """The registry of served adapters, with --lora-adapters read and checked against the
    loaded layers, in order (so every rank of a sharded model gives them the same uids)."""
    registry = AdapterRegistry(plan.slots, plan.max_rank)
    for name, source in settings.lora_adapters:
        try:
            registry.add(adapter_reader(loaded)(name, source))
        except AdapterError as exc:
            raise SettingError("--lora-adapters", f"{name}={source}", str(exc)) from None
    return registry


def adapter_reader(loaded: LoadedModel):
    """(name, source) -> the adapter, read and checked for this model's layers."""
    base_names = (loaded.resolved.model_id, str(loaded.resolved.path))
    return functools.partial(read_adapter, layers=loaded.lora, base_names=base_names)


# Methods that need no API key unless --auth-health-and-metrics.
OPEN_METHODS = (
    f"/{SERVICE_NAME}/Health",
    f"/{SERVICE_NAME}/Metrics",
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
)


def api_keys(settings: Settings) -> list[str]:
    keys = [settings.api_key] if settings.api_key else []
    if settings.api_key_file:
        with open(settings.api_key_file, encoding="utf-8") as f:
            keys += [line.strip() for line in f if line.strip() and not line.startswith("#")]
    return keys


def request_interceptors(settings: Settings, metrics: Metrics) -> list:
    """API keys (when configured), then lenient decoding of hostile bytes."""
    interceptors = []
    keys = api_keys(settings)
    if keys:
        open_methods = () if settings.auth_health_and_metrics else OPEN_METHODS

        def rejected() -> None:
            metrics.request_failure.inc(ErrorType.UNAUTHENTICATED.value)

        interceptors.append(ApiKeyInterceptor(keys, open_methods, on_reject=rejected))
    interceptors.append(DecodingInterceptor())
    return interceptors


def served_model(
    settings: Settings,
    loaded: LoadedModel,
    limits: Limits,
    capacity: int,
    core,
    engine,
    cuda_graphs: bool = False,
    compiled: bool = False,
) -> ServedModel:
    stats = core.stats()
    info = svc_pb.InfoResponse(
        model_id=loaded.resolved.model_id,
        model_pipeline_tag="text-generation",
        max_concurrent_requests=settings.max_concurrent_requests,
        max_best_of=settings.max_best_of,
        max_stop_sequences=settings.max_stop_sequences,
        max_input_tokens=limits.max_input_tokens,
        max_total_tokens=limits.max_total_tokens,
        validation_workers=settings.validation_workers,
        max_client_batch_size=settings.max_client_batch_size,
        router="textgen",
        version=__version__,
        model_dtype=str(loaded.dtype).removeprefix("torch."),
        model_device_type=loaded.device.type,
        max_batch_prefill_tokens=settings.max_batch_prefill_tokens,
        max_batch_total_tokens=capacity,
        max_batch_size=settings.max_batch_size,
        kv_cache_block_size=stats.kv_block_size,
        kv_cache_blocks=stats.kv_blocks_total,
        max_position_embeddings=loaded.max_position_embeddings,
        torch_threads=engine.torch_threads or 0,
        deterministic=settings.deterministic,
        cuda_graphs=cuda_graphs,
        compile=compiled,
        arrival_gap_ms=engine.arrival_gap * 1000,
        num_shard=loaded.shard.world_size if loaded.shard else 1,
        speculate=settings.speculate,
        speculate_max_batch=settings.speculate_max_batch,
        max_loras=loaded.lora.num_slots if loaded.lora else 0,
        max_lora_rank=loaded.lora.max_rank if loaded.lora else 0,
    )
    if loaded.resolved.sha:
        info.model_sha = loaded.resolved.sha
    commit = source_commit()
    if commit:
        info.sha = commit
    if loaded.quantize:
        info.quantize = loaded.quantize
    if settings.speculate and settings.speculate_model:
        info.speculate_model = settings.speculate_model
    return ServedModel(info=info, created=int(time.time()))


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
            functools.partial(
                load_model,
                settings.model_id,
                settings.revision,
                settings.dtype,
                device,
                quantize=settings.quantize,
                shard=ModelShard(0, world_size, groups.model) if groups else None,
                options=load_options(settings),
                lora=LoraSetup(plan.slots, plan.max_rank) if plan else None,
            )
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
    grammars = await asyncio.to_thread(
        GrammarCompiler, loaded.tokenizer, limits.vocab_size, loaded.eos_token_ids
    )
    compiled = compile_settings(settings, loaded)
    graphs = cuda_graph_settings(settings, loaded, max_total)
    draft = await in_own_thread(load_draft, settings, loaded)
    core = build_core(
        settings, loaded, capacity, grammars, graphs, compiled, shard_group, draft, adapters
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
        ),
        served_model(
            settings,
            loaded,
            limits,
            capacity,
            core,
            engine,
            cuda_graphs=graphs is not None,
            compiled=compiled is not None,
        ),
        admission,
        RequestRecorder(metrics, tracer),
        ThreadPoolExecutor(settings.validation_workers, thread_name_prefix="textgen-validation"),
        ResponseStore(int(settings.responses_store_mb * 2**20), settings.responses_store_ttl),
        lora,
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
        "textgen ready: model=%s dtype=%s%s%s device=%s grpc=%s:%d%s (%.1fs)",
        replica.loaded.resolved.model_id,
        replica.servicer.served.info.model_dtype,
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
