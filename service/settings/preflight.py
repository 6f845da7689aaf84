"""Everything about the settings that can be checked before the model loads.

table.py refuses a value out of its own bounds; this refuses what only the other
settings, the model's config or the machine can show: token limits against each other
and against the model's context (read from its config.json, before any weight), the
device, dtype and quantization, the decode strategies the device can run, files that
must be readable, and ports that must be free. Each failure is a `SettingError`: one
line naming the flag, the value and the rule. `textgen serve` runs this first and exits
with status 2 on a failure, in about a second, where loading the model takes 10-60.

start_replica() keeps its own checks of the same rules (it is also called without this,
by tests and embedders); both raise the same SettingError.
"""

from __future__ import annotations

import errno
import importlib.metadata
import json
import socket
from dataclasses import dataclass
from pathlib import Path

from .table import SettingError, Settings, flag_name


@dataclass(frozen=True)
class Preflight:
    """What the checks learned, for the log line that says they passed."""

    model: str
    context: int  # the model's context length, from its config (else --max-total-tokens)
    max_input_tokens: int
    max_total_tokens: int
    device: str
    num_shard: int
    lora: LoraPlan | None = None  # the LoRA slots, when adapters are served


def preflight(settings: Settings) -> Preflight:
    """Check `settings` (see the module docstring); raises SettingError."""
    check_files(settings)
    check_envoy(settings)
    check_ports(settings)
    device = check_device(settings)
    check_strategies(settings, device)
    check_speculation(settings)
    model, config = model_config(settings)
    check_remote_code(settings, model, config)
    check_architecture(settings, model, config)
    check_state_layers(settings, model, config)
    check_mrope(settings, model, config)
    check_quantization(settings, device, config)
    context = check_context(settings, model, config)
    # with --full-context the limits are bounded by the KV cache: here by the one given
    max_input, max_total = settings.resolved_limits(context, settings.max_batch_total_tokens)
    check_kv_capacity(settings, max_total)
    check_images(settings)
    shards = check_shards(settings, device, config)
    lora = check_lora(settings, base_model_names(settings, model))
    return Preflight(model, context, max_input, max_total, device, shards, lora)


# files --------------------------------------------------------------------------------


def check_files(settings: Settings) -> None:
    check_api_key_file(settings)
    if settings.tokenizer_config_path is not None:
        chat_template_of(settings.tokenizer_config_path)
    if settings.weights_cache_override is not None:
        _check_weights_folder(settings.weights_cache_override)
    cache = settings.huggingface_hub_cache
    if cache is not None and Path(cache).expanduser().is_file():
        raise SettingError("--huggingface-hub-cache", cache, "is a file, not a folder")


def chat_template_of(path_text: str) -> str | dict:
    """The chat template a tokenizer_config.json holds (a string, or named templates),
    or a SettingError naming --tokenizer-config-path."""
    flag, path = "--tokenizer-config-path", Path(path_text).expanduser()
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SettingError(flag, path, f"cannot be read ({exc.strerror})") from None
    except ValueError as exc:
        raise SettingError(flag, path, f"is not JSON ({exc})") from None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):  # [{"name": ..., "template": ...}], as the Hub writes it
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if not template or not (isinstance(template, str) or all(template.values())):
        raise SettingError(flag, path, "holds no chat_template (the one thing textgen reads)")
    return template


def _check_weights_folder(folder: str) -> None:
    from ..models.errors import ModelError
    from ..models.hub import check_model_folder

    path = Path(folder).expanduser()
    if not path.is_dir():
        raise SettingError("--weights-cache-override", folder, "is not a folder")
    try:
        check_model_folder(path)
    except ModelError as exc:
        raise SettingError("--weights-cache-override", folder, str(exc)) from None


def check_api_key_file(settings: Settings) -> None:
    if settings.api_key_file is None:
        return
    path = Path(settings.api_key_file).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SettingError("--api-key-file", path, f"cannot be read ({reason})") from None
    if not any(line.strip() and not line.startswith("#") for line in text.splitlines()):
        raise SettingError("--api-key-file", path, "holds no key (one per line)")


# ports --------------------------------------------------------------------------------


def check_ports(settings: Settings) -> None:
    """Every listening port must be free on its address (0: any free one): gRPC's on
    --grpc-hostname, HTTP's and the metrics' on --hostname."""
    grpc_host_flag = "--grpc-hostname" if settings.grpc_hostname else "--hostname"
    wanted = [("--grpc-port", grpc_host_flag, settings.grpc_host, settings.grpc_port)]
    if not settings.no_envoy:
        wanted.append(("--port", "--hostname", settings.hostname, settings.port))
    if settings.prometheus_port is not None:
        metrics_port = settings.prometheus_port
        wanted.append(("--prometheus-port", "--hostname", settings.hostname, metrics_port))
    if settings.prometheus_port is not None and settings.auth_health_and_metrics:
        raise SettingError(
            "--prometheus-port",
            settings.prometheus_port,
            "serves the metrics without an API key, and --auth-health-and-metrics asks for one",
        )
    taken: dict[int, str] = {}
    for flag, _, _, port in wanted:
        if port and port in taken:
            raise SettingError(flag, port, f"is also {taken[port]}; give each its own port")
        taken[port] = flag
    for flag, host_flag, host, port in wanted:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise SettingError(host_flag, host, f"does not resolve ({exc.strerror})") from None
        if port:
            _probe(flag, infos[0][0], infos[0][4][0], port, host, host_flag)


def _probe(
    flag: str, family: int, address: str, port: int, hostname: str, host_flag: str = "--hostname"
) -> None:
    # SO_REUSEADDR as the servers set it: a port left in TIME_WAIT by a previous run is
    # free to them, and must be to the probe too.
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                rule = f"is already in use on {hostname} (another server listens there)"
            elif exc.errno == errno.EACCES:
                rule = f"may not be bound on {hostname} by this user (ports below 1024 need root)"
            elif exc.errno == errno.EADDRNOTAVAIL:
                rule = "is not an address of this machine"
                raise SettingError(host_flag, hostname, rule) from None
            else:
                rule = f"cannot be bound on {hostname} ({exc.strerror})"
            raise SettingError(flag, port, rule) from None


# device, dtype, quantization, decode strategies ---------------------------------------


def cuda_available() -> bool:
    """Whether torch sees a CUDA device; a CPU build of torch says no without importing."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return False
    if "+cpu" in version:
        return False
    import torch

    return torch.cuda.is_available()


def visible_gpus() -> int:
    """CUDA devices torch sees (CUDA_VISIBLE_DEVICES applies); 0 without importing torch on
    a CPU build."""
    if not cuda_available():
        return 0
    import torch

    return torch.cuda.device_count()


def num_shards(settings: Settings, device_type: str, visible_gpus: int) -> int:
    """--num-shard, else TGI's rule: every visible GPU on CUDA, one shard on CPU;
    --sharded false forces one, --sharded true refuses one."""
    if settings.sharded is False:
        return 1
    n = settings.num_shard or (max(visible_gpus, 1) if device_type == "cuda" else 1)
    if settings.sharded and n < 2:
        raise SettingError(
            "--sharded", "true", "needs --num-shard 2 or more (or 2+ visible GPUs on CUDA)"
        )
    return n


def device_type(settings: Settings) -> str:
    """The device type the model loads on: --device, or auto's choice."""
    kind = settings.device.split(":")[0]
    if kind == "auto":
        return "cuda" if cuda_available() else "cpu"
    return kind


def check_device(settings: Settings) -> str:
    """-> the device type the model will load on ("cpu", "cuda", ...)."""
    wanted = settings.device
    kind = wanted.split(":")[0]
    if kind == "auto":
        kind = "cuda" if cuda_available() else "cpu"
    elif kind == "cuda":
        if not cuda_available():
            raise SettingError("--device", wanted, "needs a CUDA GPU, and torch sees none")
        import torch

        index = int(wanted.split(":")[1]) if ":" in wanted else 0
        if index >= torch.cuda.device_count():
            raise SettingError(
                "--device", wanted, f"does not exist ({torch.cuda.device_count()} GPUs visible)"
            )
    return kind


def check_quantization(settings: Settings, kind: str, config: dict) -> None:
    """The quantization rules of models/quantize.py and checkpoint_quant.py for --quantize
    and the checkpoint's own quantization_config, on the device found above; and what
    a quantized checkpoint can't be served with."""
    from ..models.checkpoint_quant import checkpoint_method

    if settings.quantize is None and not _quantized_checkpoint(config):
        return
    import torch

    from ..models.errors import ModelError
    from ..models.loader import select_dtype
    from ..models.quantize import QuantizationError, resolve_quantization

    wanted = settings.device
    dev = torch.device(kind if wanted == "auto" else wanted)
    flag, value = ("--quantize", settings.quantize) if settings.quantize else ("--model-id", None)
    try:
        _, library = resolve_quantization(
            settings.quantize, config, dev, settings.dtype, select_dtype(settings.dtype, dev)
        )
    except (QuantizationError, ModelError) as exc:
        rule = str(exc).removeprefix(f"--quantize {settings.quantize}").lstrip(": ")
        raise SettingError(flag, value, rule) from None
    if library is None:
        return
    what = f"{library.method} weights ({'the checkpoint' if checkpoint_method(config) else flag})"
    if settings.deterministic:
        raise SettingError(
            "--deterministic",
            None,
            f"is not supported with {what}: its batch-invariant matmuls are torch's Linear "
            "layers', not a quantization library's kernels",
        )
    if settings.compile:
        raise SettingError(
            "--compile",
            None,
            f"is not supported with {what}: the compiled decode step is built and tested "
            "over torch's and torchao's layers only",
        )


def _quantized_checkpoint(config: dict) -> bool:
    return bool(
        config.get("quantization_config")
        or (config.get("text_config") or {}).get("quantization_config")
    )


def check_strategies(settings: Settings, kind: str) -> None:
    """Decode strategies the device can run, and combinations that exclude each other."""
    if settings.cuda_graphs and kind != "cuda":
        raise SettingError(
            "--cuda-graphs", None, f"CUDA graphs need a CUDA device, and the model loads on {kind}"
        )
    check_cuda_settings(settings, kind)
    if settings.compile and kind != "cpu":
        raise SettingError(
            "--compile",
            None,
            f"runs on CPU and the model loads on {kind}, where decode steps take "
            "--cuda-graphs instead",
        )
    if settings.deterministic and kind != "cpu":
        raise SettingError("--deterministic", None, f"runs on CPU only, not on {kind}")
    if settings.compile and settings.deterministic:
        raise SettingError(
            "--compile",
            None,
            "is not supported with --deterministic: the compiled decode step pads batches to "
            "its own buckets, outside the batch-invariant layout",
        )


def check_cuda_settings(settings: Settings, kind: str) -> None:
    """The settings of the CUDA path against the device and each other."""
    sizes = settings.cuda_graph_sizes
    if sizes is not None:
        if kind != "cuda":
            raise SettingError(
                "--cuda-graph-sizes",
                ",".join(map(str, sizes)),
                f"CUDA graphs need a CUDA device, and the model loads on {kind}",
            )
        if settings.cuda_graphs is False:
            raise SettingError("--cuda-graph-sizes", None, "is given with --no-cuda-graphs")
        if sizes[-1] > settings.max_batch_size:
            raise SettingError(
                "--cuda-graph-sizes",
                sizes[-1],
                f"is above --max-batch-size ({settings.max_batch_size}): no batch is that large",
            )
    if settings.disable_custom_kernels and settings.cuda_graphs:
        raise SettingError(
            "--cuda-graphs",
            None,
            "replays textgen's Triton attention kernel, which --disable-custom-kernels turns off",
        )
    if settings.cuda_memory_fraction != 1.0 and kind != "cuda":
        raise SettingError(
            "--cuda-memory-fraction",
            settings.cuda_memory_fraction,
            f"bounds GPU memory, and the model loads on {kind}",
        )


def check_speculation(settings: Settings) -> None:
    """--speculate and its companions, against each other and the rest."""
    if settings.speculate_ngram_min > settings.speculate_ngram_max:
        raise SettingError(
            "--speculate-ngram-min",
            settings.speculate_ngram_min,
            f"is more than --speculate-ngram-max ({settings.speculate_ngram_max})",
        )
    if settings.speculate_model is None:
        return
    if not settings.speculate:
        raise SettingError(
            "--speculate-model", settings.speculate_model, "needs --speculate N (tokens per step)"
        )
    if (settings.num_shard or 1) > 1:
        raise SettingError(
            "--speculate-model", settings.speculate_model, "is not supported with --num-shard > 1"
        )
    from ..models.errors import ModelError
    from ..models.hub import config_json

    try:
        config_json(settings.speculate_model, None)
    except ModelError as exc:
        raise SettingError("--speculate-model", settings.speculate_model, str(exc)) from None
    if mismatch := _tokenizer_mismatch(settings):
        raise SettingError("--speculate-model", settings.speculate_model, mismatch)


def _tokenizer_mismatch(settings: Settings) -> str | None:
    """How the draft model's tokenizer.json differs from the model's, when both have one
    (otherwise the loaded tokenizers are compared at startup, by the same rule)."""
    from ..models.hub import model_file
    from ..models.tokenizer_files import file_vocab, vocab_mismatch

    target = model_file(
        settings.model_id,
        "tokenizer.json",
        settings.revision,
        hub_cache=settings.huggingface_hub_cache,
        folder=settings.weights_cache_override,
    )
    draft = model_file(
        settings.speculate_model, "tokenizer.json", hub_cache=settings.huggingface_hub_cache
    )
    if target is None or draft is None:
        return None
    target_vocab, draft_vocab = file_vocab(target), file_vocab(draft)
    if target_vocab is None or draft_vocab is None:
        return None
    return vocab_mismatch(target_vocab, draft_vocab)


# the model's context -------------------------------------------------------------------


def model_config(settings: Settings) -> tuple[str, dict]:
    """(the model as named, its config.json): the embedded model's, a local folder's, or
    the Hub's (config.json alone is fetched)."""
    from ..models.errors import ModelError
    from ..models.hub import config_json

    try:
        return config_json(
            settings.model_id,
            settings.revision,
            hub_cache=settings.huggingface_hub_cache,
            folder=settings.weights_cache_override,
        )
    except ModelError as exc:
        raise SettingError("--model-id", settings.model_id or "(embedded)", str(exc)) from None


def check_remote_code(settings: Settings, model: str, config: dict) -> None:
    """A model whose type only its own code knows needs --trust-remote-code."""
    from ..models.hub import needs_remote_code

    if needs_remote_code(config) and not settings.trust_remote_code:
        raise SettingError(
            "--model-id",
            model,
            f"is a {config.get('model_type')!r} model whose modelling code ships with it "
            "(auto_map): pass --trust-remote-code to run that code",
        )


def check_architecture(settings: Settings, model: str, config: dict) -> None:
    """A model whose attention or layers the paged engine doesn't implement is refused
    from its config.json, before its weights load (models/architectures.py)."""
    from ..models.architectures import not_invariant_reason, sdpa_only_terms, unserved_reason

    if reason := unserved_reason(config):
        raise SettingError("--model-id", model, reason)
    terms = sdpa_only_terms(config) if settings.deterministic else None
    if terms:
        raise SettingError("--deterministic", "true", f"{model}: {not_invariant_reason(terms)}")


def check_mrope(settings: Settings, model: str, config: dict) -> None:
    """A multimodal-RoPE model (Qwen2.5-VL) runs its decodes eagerly: the runner strategies'
    decode graphs take token indices as positions (engine/runners/mrope.py)."""
    from ..models.architectures import MROPE_NO_STRATEGY, has_mrope

    if not has_mrope(config):
        return
    for flag, given in (("--compile", settings.compile), ("--cuda-graphs", settings.cuda_graphs)):
        if given:
            raise SettingError(flag, None, f"{model}: {MROPE_NO_STRATEGY}")


def check_state_layers(settings: Settings, model: str, config: dict) -> None:
    """What a hybrid model's state layers (the state pool: engine/state_pool.py) don't
    run with yet, refused before the weights load."""
    from ..models.architectures import has_state_layers

    if not has_state_layers(config):
        return
    refused = [
        ("--speculate", settings.speculate, "a rejected proposal would stay in the layers' state"),
        ("--compile", settings.compile, "state layers run eagerly"),
        ("--cuda-graphs", settings.cuda_graphs, "state layers run eagerly"),
        ("--deterministic", settings.deterministic, "no batch-invariant path for state layers"),
    ]
    for flag, given, why in refused:
        if given:
            value = None if given is True else given
            raise SettingError(
                flag,
                value,
                f"is not supported for {model}, a hybrid model with state layers: {why}",
            )


def check_context(settings: Settings, model: str, config: dict) -> int:
    """The context served: the one its config.json states, else --max-total-tokens
    (Settings.context_length decides; a model stating none is refused without it)."""
    from ..models.hub import stated_context

    return settings.context_length(stated_context(config), model)


def check_shards(settings: Settings, kind: str, config: dict) -> int:
    """--num-shard against the device and the model's heads; -> the number of shards."""
    from ..models.shard_layout import ShardingError, shard_layout

    world_size = num_shards(settings, kind, visible_gpus() if kind == "cuda" else 0)
    if world_size == 1:
        return 1
    if kind == "cuda" and world_size > visible_gpus():
        raise SettingError(
            "--num-shard", world_size, f"needs a GPU per shard and {visible_gpus()} are visible"
        )
    if settings.deterministic:
        raise SettingError(
            "--deterministic", None, "is not supported with --num-shard > 1 (serve it unsharded)"
        )
    if _quantized_checkpoint(config) or (
        settings.quantize and settings.quantize not in ("int8", "int4", "fp8")
    ):
        raise SettingError(
            "--num-shard",
            world_size,
            "can't shard a quantization library's weights (a pre-quantized checkpoint, or "
            "--quantize other than int8/int4/fp8): the tensor-parallel plan slices dense "
            "weights, not packed ones; serve it with --num-shard 1",
        )
    if settings.local_shards is not None and settings.local_shards > world_size:
        raise SettingError(
            "--local-shards", settings.local_shards, f"is more than --num-shard ({world_size})"
        )
    check_state_layers_split(world_size, config)
    if "num_attention_heads" in (config.get("text_config") or config):
        try:
            shard_layout(config, world_size)
        except ShardingError as exc:
            raise SettingError("--num-shard", world_size, str(exc)) from None
    if settings.master_port and _is_local(settings.master_addr):
        _probe("--master-port", socket.AF_INET, "0.0.0.0", settings.master_port, "this host")
    return world_size


def check_state_layers_split(world_size: int, config: dict) -> None:
    """A hybrid model's state layers split over shards only where sharding.py has their
    plan (Gated DeltaNet: Qwen3-Next, Qwen3.5), whether --num-shard was given or is one
    shard per visible GPU."""
    from ..models.architectures import has_state_layers
    from ..models.sharding import STATE_PLANS

    model_type = (config.get("text_config") or config).get("model_type")
    if has_state_layers(config) and model_type not in STATE_PLANS:
        raise SettingError(
            "--num-shard",
            world_size,
            f"{model_type}'s state layers have no tensor-parallel plan (Qwen3-Next's and "
            "Qwen3.5's Gated DeltaNet do): serve it with --num-shard 1",
        )


def _is_local(host: str) -> bool:
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    return address.startswith("127.") or address in socket.gethostbyname_ex(socket.gethostname())[2]


# LoRA adapters --------------------------------------------------------------------------

DEFAULT_MAX_LORA_RANK = 16  # vLLM's default, when no adapter at start-up says more


@dataclass(frozen=True)
class LoraPlan:
    """The LoRA slots the model's layers get (models/lora_layers.py)."""

    slots: int  # --max-loras
    max_rank: int  # --max-lora-rank


def check_lora(settings: Settings, base_names: tuple[str, ...]) -> LoraPlan | None:
    """--lora-adapters (each adapter's config: a LoRA textgen serves, trained on this model,
    within --max-lora-rank), --max-loras and --max-lora-rank; -> the slots (None: no LoRA).
    The weights are read and checked against the layers once the model is loaded."""
    from ..models.lora import (
        AdapterError,
        check_adapter_config,
        read_adapter_config,
        resolve_adapter,
    )

    adapters = settings.lora_adapters
    slots = settings.max_loras if settings.max_loras is not None else len(adapters)
    if slots == 0:
        if adapters:
            raise SettingError("--max-loras", 0, "leaves no slot for the --lora-adapters")
        return None
    if settings.deterministic:
        raise SettingError(
            "--deterministic",
            None,
            "is not supported with LoRA adapters (each adapter's rows are matmuls of their own)",
        )
    ranks = []
    for name, source in adapters:
        if name in base_names:
            raise SettingError("--lora-adapters", name, "is the base model's name")
        try:
            config = read_adapter_config(resolve_adapter(source))
            ranks.append(
                check_adapter_config(
                    config, max_rank=settings.max_lora_rank or 1 << 30, base_names=base_names
                )
            )
        except AdapterError as exc:
            raise SettingError("--lora-adapters", f"{name}={source}", str(exc)) from None
    return LoraPlan(slots, settings.max_lora_rank or max([DEFAULT_MAX_LORA_RANK, *ranks]))


def base_model_names(settings: Settings, model: str) -> tuple[str, ...]:
    """What an adapter's base_model_name_or_path may call the served model: its id and,
    for a local or embedded one, its folder."""
    from ..models.embedded import EMBEDDED_ALIASES, converted_embedded

    names = [model]
    if settings.model_id is None or settings.model_id in EMBEDDED_ALIASES:
        folder = converted_embedded()
        if folder is not None:
            names.append(str(folder))
    elif Path(model).expanduser().is_dir():
        names.append(str(Path(model).expanduser().resolve()))
    return tuple(names)


def check_kv_capacity(settings: Settings, max_total_tokens: int) -> None:
    if settings.max_batch_total_tokens and settings.max_batch_total_tokens < max_total_tokens:
        raise SettingError(
            flag_name("max_batch_total_tokens"),
            settings.max_batch_total_tokens,
            f"must be >= --max-total-tokens ({max_total_tokens}): a request of "
            "max_total_tokens must fit in the KV cache",
        )


def check_images(settings: Settings) -> None:
    """--max-image-pixels must be one Pillow decodes: past twice its own bound
    (Image.MAX_IMAGE_PIXELS) Pillow refuses an image as a decompression bomb, so a larger
    setting would promise what the server can't read."""
    try:
        from PIL import Image
    except ImportError:  # no Pillow: no vision-language model loads either
        return
    pillow = 2 * (Image.MAX_IMAGE_PIXELS or 0)
    if pillow and settings.max_image_pixels > pillow:
        raise SettingError(
            flag_name("max_image_pixels"),
            settings.max_image_pixels,
            f"must be at most {pillow}: Pillow refuses larger images as decompression bombs",
        )


def check_envoy(settings: Settings) -> None:
    if settings.no_envoy:
        return
    from ..processes.envoy import EnvoyError, envoy_binary

    try:
        envoy_binary()
    except EnvoyError as exc:
        raise SettingError("--no-envoy", None, f"not given, and {exc}") from None
