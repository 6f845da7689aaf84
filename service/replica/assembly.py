"""A replica's parts from its settings: the engine's config (`engine_config`, the one
function from Settings to EngineConfig), the engine core (`build_core`, the one place a
PagedCore is built outside tests), the draft model, the adapters, the request
interceptors and the model's /info (`served_model`). `standalone_engine` builds the same
engine in this process without a server, for `textgen bench --core` and the measuring
scripts."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import replace

import torch

from .. import __version__
from ..engine.adapters import AdapterRegistry
from ..engine.attention import cpu_decode, cpu_prefill
from ..engine.config import EngineConfig, every_layer_window
from ..engine.draft_model import DraftModelProposer, TokenizerMismatch, check_same_tokenizer
from ..engine.grammar import GrammarMasks
from ..engine.kv_pool import KV_CACHE_DTYPES
from ..engine.loop import EngineLoop
from ..engine.paged_core import PagedCore
from ..engine.runners.compiled import CompileSettings
from ..engine.runners.cuda_graphs import GraphSettings, unavailable_reason
from ..engine.runners.sharded import ShardGroup
from ..engine.speculation import SpeculationSettings
from ..errors import ErrorType
from ..grpc.interceptors import ApiKeyInterceptor, DecodingInterceptor
from ..grpc.server import SERVICE_NAME
from ..grpc.servicer import ServedModel
from ..intake.grammar_compiler import GrammarCompiler
from ..intake.validation import Limits
from ..models import LoadedModel, load_model
from ..models.architectures import (
    MROPE_FAMILIES,
    MROPE_NO_STRATEGY,
    module_sdpa_only_layers,
    module_sdpa_only_terms,
    no_graphs_reason,
)
from ..models.compile_cache import compile_cache_dir, kernel_cache_dir
from ..models.loader import LoadOptions, LoraSetup, ModelShard, auto_dtype_reason
from ..models.lora import AdapterError, read_adapter
from ..models.lora_layers import LoraLayers
from ..models.state_layers import (
    has_state_layers,
    probe_states,
    state_bytes_per_sequence,
    state_kernels,
)
from ..observability.metrics import Metrics
from ..processes.build_info import source_commit
from ..proto import text_generation_service_pb2 as svc_pb
from ..settings.preflight import (
    LoraPlan,
    base_model_names,
    chat_template_of,
    check_lora,
    check_strategies,
    model_config,
)
from ..settings.table import SettingError, Settings
from .kv_sizing import KV_BLOCK_SIZE, kv_capacity_tokens, kv_floor

log = logging.getLogger("textgen.serve")


def cuda_graph_settings(
    settings: Settings, loaded: LoadedModel, max_total_tokens: int
) -> GraphSettings | None:
    """--cuda-graphs as given (refused where graphs can't run), else on where they can;
    captured for --cuda-graph-sizes, else for every bucket up to --max-batch-size."""
    reason = unavailable_reason(loaded.device)
    if settings.disable_custom_kernels and reason is None:
        reason = "CUDA graphs replay the Triton kernel that --disable-custom-kernels turns off"
    terms = None
    if reason is None:
        terms = module_sdpa_only_terms(loaded.model) or module_sdpa_only_layers(loaded.model)
    if terms:
        reason = no_graphs_reason(terms)
    if reason is None and has_state_layers(loaded.model):
        reason = "a hybrid model's state layers run eagerly"
    if reason is None and getattr(loaded.model.config, "model_type", None) in MROPE_FAMILIES:
        reason = MROPE_NO_STRATEGY
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


def place_cpu_kernel_artifacts(settings: Settings, loaded: LoadedModel) -> None:
    """The CPU attention's C++ kernels (engine/attention/cpu_decode.py, compiled at warm-up;
    cpu_prefill.py for a bfloat16 model, compiled here rather than on the first prompt)
    keep their libraries in the textgen cache, as --compile's artifacts, so a later start or
    a new container with the same cache loads them; if that cache can't be written, in
    torch's default (the temp dir)."""
    if loaded.device.type != "cpu" or settings.disable_custom_kernels:
        return
    prefill = loaded.dtype == torch.bfloat16 and cpu_prefill.may_run()
    try:
        cpu_decode.CACHE_DIR = kernel_cache_dir("cpu-decode-attention")
        if prefill:
            cpu_prefill.CACHE_DIR = kernel_cache_dir("cpu-prefill-attention")
    except OSError as exc:
        log.warning("compile cache unavailable (%s): the CPU kernels compile in tmp", exc)
    if prefill:
        cpu_prefill.available()


def speculation_settings(settings: Settings) -> SpeculationSettings | None:
    if not settings.speculate:
        return None
    return SpeculationSettings(
        settings.speculate,
        settings.speculate_max_batch,
        settings.speculate_ngram_min,
        settings.speculate_ngram_max,
        adaptive=settings.speculate_adaptive,
    )


def load_draft(settings: Settings, loaded: LoadedModel) -> LoadedModel | None:
    """--speculate-model, on the model's device and dtype; refused unless it shares the
    model's tokenizer."""
    if settings.speculate_model is None:
        return None
    if not settings.speculate:
        raise SettingError("--speculate-model", settings.speculate_model, "needs --speculate N")
    draft = load_model(
        settings.speculate_model,
        None,
        str(loaded.dtype).removeprefix("torch."),
        str(loaded.device),
        # it proposes for the model's sequences: their context, where its config states none
        options=LoadOptions(
            context=loaded.max_position_embeddings, small_step_int8=loaded.small_step_rows > 0
        ),
    )
    try:
        check_same_tokenizer(loaded.tokenizer, draft.tokenizer)
    except TokenizerMismatch as exc:
        raise SettingError("--speculate-model", settings.speculate_model, str(exc)) from None
    return draft


def engine_config(
    settings: Settings, loaded: LoadedModel, capacity: int, max_total_tokens: int
) -> EngineConfig:
    """The engine's config from the settings: the one place they meet (the server, every
    rank of a sharded model, `textgen bench --core`; the measuring scripts write theirs).
    `capacity`: the KV pool's tokens (kv_sizing.py); `max_total_tokens`: the longest
    request (CUDA graphs' block tables are sized for it)."""
    compiled = compile_settings(settings, loaded)
    graphs = cuda_graph_settings(settings, loaded, max_total_tokens)
    place_cpu_kernel_artifacts(settings, loaded)
    hybrid = has_state_layers(loaded.model)
    if hybrid:
        log_state_pool(settings, loaded)
    return EngineConfig(
        max_batch_total_tokens=capacity,
        max_batch_prefill_tokens=settings.max_batch_prefill_tokens,
        max_batch_size=settings.max_batch_size,
        block_size=KV_BLOCK_SIZE,
        kv_cache_dtype=KV_CACHE_DTYPES.get(settings.kv_cache_dtype),
        batch_invariant=settings.deterministic,
        cuda_graphs=graphs,
        compile=compiled,
        custom_kernels=not settings.disable_custom_kernels,
        speculation=speculation_settings(settings),
        watermark_gamma=settings.watermark_gamma,
        watermark_delta=settings.watermark_delta,
        # blocks before the window go back to the pool while a sequence runs
        sliding_window=every_layer_window(loaded.model.config),
        enable_prefix_caching=not hybrid,
    )


def log_state_pool(settings: Settings, loaded: LoadedModel) -> None:
    per_sequence = state_bytes_per_sequence(probe_states(loaded.model))
    log.info(
        "state pool: %d slots (--max-batch-size) of %s, %s in all; prefix caching off (a "
        "cached prefix would skip the state layers' pass over it)",
        settings.max_batch_size,
        _size(per_sequence),
        _size(settings.max_batch_size * per_sequence),
    )


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def build_core(
    config: EngineConfig,
    model: torch.nn.Module,
    *,
    grammars: GrammarCompiler | None = None,
    shards: ShardGroup | None = None,
    draft: LoadedModel | None = None,
    lora: LoraLayers | None = None,
    adapters: AdapterRegistry | None = None,
) -> PagedCore:
    """The engine core: the one place a PagedCore is built outside tests (the server,
    `textgen bench --core`, the measuring scripts). `draft`: the draft model proposing
    tokens for speculation, in a pool of its own as large as the model's."""
    proposer = None
    if draft is not None:
        proposer = DraftModelProposer(
            draft.model,
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            vocab_size=model.config.get_text_config().vocab_size,
            catch_up_tokens=config.max_batch_prefill_tokens,
        )
    masks = GrammarMasks(grammars.ll_tokenizer, grammars.vocab_size) if grammars else None
    return PagedCore(
        model,
        config,
        grammars=masks,
        shards=shards,
        proposer=proposer,
        lora=lora,
        adapters=adapters,
    )


def load_served(
    settings: Settings,
    device: str,
    shard: ModelShard | None = None,
    plan: LoraPlan | None = None,
) -> LoadedModel:
    """The model as the settings ask for it (a shard's slice when `shard` is given), with
    room for `plan`'s LoRA slots."""
    return load_model(
        settings.model_id,
        settings.revision,
        settings.dtype,
        device,
        quantize=settings.quantize,
        shard=shard,
        options=load_options(settings),
        lora=LoraSetup(plan.slots, plan.max_rank) if plan else None,
    )


def grammar_compiler(loaded: LoadedModel) -> GrammarCompiler:
    return GrammarCompiler(
        loaded.tokenizer, loaded.model.config.get_text_config().vocab_size, loaded.eos_token_ids
    )


def served_core(
    settings: Settings,
    loaded: LoadedModel,
    capacity: int,
    max_total_tokens: int,
    grammars: GrammarCompiler,
    draft: LoadedModel | None = None,
    adapters: AdapterRegistry | None = None,
    shards: ShardGroup | None = None,
) -> PagedCore:
    """The engine core a replica with these settings serves with: its config from the
    settings (engine_config), over the loaded model, its adapters and draft model."""
    return build_core(
        engine_config(settings, loaded, capacity, max_total_tokens),
        loaded.model,
        grammars=grammars,
        shards=shards,
        draft=draft,
        lora=loaded.lora,
        adapters=adapters,
    )


def standalone_engine(settings: Settings) -> tuple[LoadedModel, PagedCore]:
    """The engine a replica with these settings runs, built in this process with no server
    around it (`textgen bench --core`): the same model, adapters, draft model, KV pool and
    runner strategy. One shard only."""
    if settings.num_shard not in (None, 1):
        raise SettingError("--num-shard", settings.num_shard, "the engine alone runs on one shard")
    plan = lora_plan(settings)
    loaded = load_served(settings, settings.device, plan=plan)
    adapters = load_adapters(settings, loaded, plan) if plan else None
    context = loaded.max_position_embeddings
    capacity = kv_capacity_tokens(settings, loaded, kv_floor(settings, context))
    _, max_total = settings.resolved_limits(context, capacity)
    grammars, draft = grammar_compiler(loaded), load_draft(settings, loaded)
    core = served_core(settings, loaded, capacity, max_total, grammars, draft, adapters)
    return loaded, core


def load_options(settings: Settings) -> LoadOptions:
    """Where the model's files come from, and what changes in them as they load."""
    template = settings.tokenizer_config_path
    return LoadOptions(
        hub_cache=settings.huggingface_hub_cache,
        folder=settings.weights_cache_override,
        trust_remote_code=settings.trust_remote_code,
        rope=settings.rope,
        chat_template=chat_template_of(template) if template is not None else None,
        context=settings.max_total_tokens,  # where the config states none: context_length's
        small_step_int8=small_step_int8(settings),
        custom_kernels=not settings.disable_custom_kernels,
    )


def small_step_int8(settings: Settings) -> bool:
    """Whether small steps may read int8 weight copies where --dtype auto computes on a
    CPU (models/small_steps.py): not where every step must compute alike (--deterministic).
    --compile's decode graphs read them too (each graph's rows are fixed, so it traces one
    path): 4.3x faster a compiled one-stream step in bfloat16 than the wide weights'."""
    return settings.dtype == "auto" and not settings.deterministic


def cap_cuda_memory(settings: Settings, device: str) -> None:
    """--cuda-memory-fraction: torch's allocator may not take more of the device."""
    if settings.cuda_memory_fraction < 1.0 and device.startswith("cuda"):
        index = torch.device(device).index
        torch.cuda.set_per_process_memory_fraction(
            settings.cuda_memory_fraction, index if index is not None else 0
        )


def lora_plan(settings: Settings) -> LoraPlan | None:
    """The LoRA slots to load the model with (settings/preflight.py's rules; None: no LoRA)."""
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
    core: PagedCore,
    engine: EngineLoop,
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
        max_batch_total_tokens=core.config.max_batch_total_tokens,
        max_batch_size=settings.max_batch_size,
        kv_cache_block_size=stats.kv_block_size,
        kv_cache_blocks=stats.kv_blocks_total,
        max_position_embeddings=loaded.max_position_embeddings,
        torch_threads=engine.torch_threads or 0,
        deterministic=settings.deterministic,
        cuda_graphs=core.config.cuda_graphs is not None,
        compile=core.config.compile is not None,
        arrival_gap_ms=engine.arrival_gap * 1000,
        num_shard=loaded.shard.world_size if loaded.shard else 1,
        speculate=settings.speculate,
        speculate_max_batch=settings.speculate_max_batch,
        max_loras=loaded.lora.num_slots if loaded.lora else 0,
        max_lora_rank=loaded.lora.max_rank if loaded.lora else 0,
        state_slots=stats.state_slots_total,
        prefix_caching=core.block_manager.enable_prefix_caching,
        takes_images=loaded.processor is not None,
        image_token=loaded.processor.image_token if loaded.processor is not None else None,
        max_images_per_request=settings.max_images_per_request if loaded.processor else 0,
    )
    if stats.state_slots_total:
        info.state_bytes_per_sequence = state_bytes_per_sequence(probe_states(loaded.model))
        info.state_kernels = state_kernels(loaded.model)
    if loaded.resolved.sha:
        info.model_sha = loaded.resolved.sha
    commit = source_commit()
    if commit:
        info.sha = commit
    if loaded.quantize:
        info.quantize = loaded.quantize
    if settings.dtype == "auto":
        info.dtype_reason = auto_dtype_reason(loaded)
    info.small_step_int8_tokens = loaded.small_step_rows
    if settings.speculate and settings.speculate_model:
        info.speculate_model = settings.speculate_model
    return ServedModel(info=info, created=int(time.time()))
