"""Settings: flags and environment -> one immutable object, built once and passed down.

Every setting is declared once, as a field of `Settings` with its `Option` (how its text
reads, its bounds, its help). The `textgen serve` flags, their environment forms, the
settings table in docs/settings.md and the one-line errors all come from that table.

Flags mirror TGI's launcher where the meaning is the same. Every flag can also come from
the environment as TEXTGEN_<FLAG> (e.g. TEXTGEN_MAX_BATCH_SIZE); the prefix keeps generic
names such as HOSTNAME and PORT, which shells and containers set for their own purposes,
from leaking in. The environment is read when the parser is built, never at import time.

A value out of bounds is refused while the flags are parsed: one line naming the flag (or
the variable), the value and the rule, exit status 2. What needs more than one setting,
the model's config or the machine (token limits against the model's context, free ports,
readable files, the device) is checked by preflight.py, still before anything loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from textgen.sdk.keepalive import Keepalive

from ..intake.image_urls import Network, parse_allow_private

ENV_PREFIX = "TEXTGEN_"
# --quantize values (TGI's flag): those service/models/quantize.py knows (each runs where
# its kernels do, or is refused at startup with the reason)
QUANTIZE_METHODS = (
    "int8", "int4", "fp8", "gptq", "awq", "compressed-tensors", "bitsandbytes",
    "bitsandbytes-nf4", "bitsandbytes-fp4", "eetq", "marlin", "exl2",
)  # fmt: skip
# --kv-cache-dtype values (TGI's): the KV pool stored in 8 bits (engine/kv_pool.py)
KV_CACHE_DTYPES = ("fp8_e4m3fn", "fp8_e5m2")
# --dtype values; the aliases are torch's own names for the same types
DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
MAX_PORT = 65535
DEFAULT_MAX_TOTAL_TOKENS = 4096  # the default's cap, unless --full-context
MAX_ARRIVAL_GAP_MS = 20.0  # the engine's wait for a burst is capped there (engine/loop.py)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class SettingError(ValueError):
    """A setting, alone or against another, the model or the machine, that can't work.
    str() is the one line the CLI prints: the flag, the value, the rule."""

    def __init__(self, flag: str, value: object, rule: str) -> None:
        self.flag, self.value, self.rule = flag, value, rule
        super().__init__(f"{flag} {value}: {rule}" if value is not None else f"{flag}: {rule}")


@dataclass(frozen=True)
class Option:
    """How one setting reads from a flag or the environment.

    `parse` turns the text into the value or raises ValueError with the rule it broke;
    a `switch` takes no value (`--flag`, and `--no-flag` when `negatable`)."""

    help: str
    parse: Callable[[str], object] = str
    switch: bool = False
    negatable: bool = False
    metavar: str | None = None
    # other variables read when TEXTGEN_<FLAG> is unset: the names torch.distributed and
    # TGI give the same setting (MASTER_ADDR, NUM_SHARD)
    env_aliases: tuple[str, ...] = ()


def option(default: object, help: str, parse: Callable[[str], object] = str, **kw) -> object:
    return field(default=default, metadata={"option": Option(help, parse, **kw)})


def switch(
    default: bool | None, help: str, *, negatable: bool = False, env_aliases: tuple = ()
) -> object:
    option = Option(help, parse_bool, switch=True, negatable=negatable, env_aliases=env_aliases)
    return field(default=default, metadata={"option": option})


# value parsers: text -> value, or ValueError(the rule) -----------------------------------


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError("use 1/0, true/false, yes/no or on/off")


def _integer(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError("must be a whole number") from None


def _number(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError("must be a number") from None
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


def positive_int(text: str) -> int:
    value = _integer(text)
    if value <= 0:
        raise ValueError("must be a positive whole number")
    return value


def non_negative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise ValueError("must be 0 or more")
    return value


def positive_float(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise ValueError("must be a positive number")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise ValueError("must be 0 or more")
    return value


def port_number(text: str) -> int:
    value = _integer(text)
    if not 0 <= value <= MAX_PORT:
        raise ValueError(f"must be a port number, 1-{MAX_PORT} (0: any free port)")
    return value


def gap_ms(text: str) -> float:
    value = non_negative_float(text)
    if value > MAX_ARRIVAL_GAP_MS:
        raise ValueError(f"must be at most {MAX_ARRIVAL_GAP_MS:g} ms (the engine's cap)")
    return value


def optional_positive_int(text: str) -> int | None:
    """An empty value means unset (the default rule applies)."""
    return positive_int(text) if text.strip() else None


def optional_text(text: str) -> str | None:
    """An empty value (`TEXTGEN_X=`) means unset."""
    return text.strip() or None


def non_empty_text(text: str) -> str:
    value = text.strip()
    if not value:
        raise ValueError("must not be empty")
    return value


def host_name(text: str) -> str:
    value = text.strip()
    if not value or any(c.isspace() for c in value):
        raise ValueError("must be an address or host name")
    return value


def dtype_name(text: str) -> str:
    value = text.strip().lower()
    value = DTYPE_ALIASES.get(value, value)
    if value not in DTYPES:
        raise ValueError(f"use one of {', '.join(DTYPES)}")
    return value


_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?|mps|xpu(:\d+)?)$")


def device_name(text: str) -> str:
    value = text.strip().lower()
    if not _DEVICE.match(value):
        raise ValueError("use auto, cpu, cuda, cuda:N, mps or xpu")
    return value


def quantize_method(text: str) -> str | None:
    value = text.strip().lower()
    if value in ("", "none"):
        return None
    if value not in QUANTIZE_METHODS:
        raise ValueError(f"use one of {', '.join(QUANTIZE_METHODS)} (or none)")
    return value


_ORIGIN = re.compile(r"^https?://[^\s/,]+$")


def origins(text: str) -> tuple[str, ...]:
    """Comma-separated CORS origins (`*`: any); empty: none."""
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    for value in values:
        if value != "*" and not _ORIGIN.match(value):
            raise ValueError(f"{value!r} is not an origin (scheme://host[:port], or *)")
    return values


def batch_sizes(text: str) -> tuple[int, ...] | None:
    """Comma-separated batch sizes, e.g. 1,2,4,8 (empty: unset)."""
    if not text.strip():
        return None
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise ValueError("must be batch sizes separated by commas, e.g. 1,2,4,8") from None
    if not values or values[0] <= 0:
        raise ValueError("must be positive batch sizes, e.g. 1,2,4,8")
    return tuple(values)


ROPE_SCALINGS = ("linear", "dynamic")


def rope_scaling_kind(text: str) -> str | None:
    value = text.strip().lower()
    if not value:
        return None
    if value not in ROPE_SCALINGS:
        raise ValueError(f"use one of {', '.join(ROPE_SCALINGS)}")
    return value


REASONING_PARSERS = ("auto", "none", "deepseek_r1", "qwen3", "openai_gptoss")


def reasoning_parser_name(text: str) -> str:
    value = text.strip().lower()
    if value not in REASONING_PARSERS:
        raise ValueError(f"use one of {', '.join(REASONING_PARSERS)}")
    return value


def optional_positive_float(text: str) -> float | None:
    return positive_float(text) if text.strip() else None


def fraction(text: str) -> float:
    value = _number(text)
    if not 0 < value <= 1:
        raise ValueError("must be a fraction in (0, 1]")
    return value


def private_networks(text: str) -> bool | tuple[Network, ...]:
    """--allow-private-image-urls: false, true or comma-separated networks."""
    return parse_allow_private(text)


def optional_port(text: str) -> int | None:
    """A port, or empty for none."""
    return port_number(text) if text.strip() else None


_ADAPTER_NAME = re.compile(r"^[\w.\-/:@]+$")


def lora_adapter_list(text: str) -> tuple[tuple[str, str], ...]:
    """TGI's `--lora-adapters`: comma-separated `id` (a Hub id or a folder, also its name)
    or `name=path`; -> ((name, source), ...). Empty: none."""
    adapters: list[tuple[str, str]] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, source = item.partition("=")
        name, source = name.strip(), source.strip() if sep else name.strip()
        if not name or not source:
            raise ValueError(f"{item!r}: use `id` or `name=path`")
        if not _ADAPTER_NAME.match(name):
            raise ValueError(f"adapter name {name!r}: letters, digits and . _ - / : @ only")
        if any(name == n for n, _ in adapters):
            raise ValueError(f"adapter name {name!r} is given twice")
        adapters.append((name, source))
    return tuple(adapters)


def kv_cache_dtype_name(text: str) -> str | None:
    value = text.strip().lower()
    if value in ("", "auto"):
        return None
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"use one of {', '.join(KV_CACHE_DTYPES)} (or auto: the model's dtype)")
    return value


def green_share(text: str) -> float:
    value = _number(text)
    if not 0.0 < value < 1.0:
        raise ValueError("must be > 0 and < 1 (the green share of the vocabulary)")
    return value


def otlp_url(text: str) -> str | None:
    value = optional_text(text)
    if value is not None and not re.match(r"^(https?://)?[\w.\-\[\]:]+:\d+/?$", value):
        raise ValueError("must be a collector's address, e.g. http://127.0.0.1:4317")
    return value


# the table -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    model_id: str | None = option(
        None,
        "Hub id or local folder (default: embedded SmolLM2-135M-Instruct)",
        optional_text,
        metavar="ID",
    )
    revision: str | None = option(
        None, "Hub revision (branch, tag or commit)", optional_text, metavar="REV"
    )
    huggingface_hub_cache: str | None = option(
        None,
        "the Hugging Face Hub cache Hub ids are read from and downloaded to (default: "
        "HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)",
        optional_text,
        metavar="PATH",
    )
    weights_cache_override: str | None = option(
        None,
        "a folder holding the model's files (config.json, tokenizer, *.safetensors), loaded "
        "from there without asking the Hub; --model-id still names the model (a mounted disk)",
        optional_text,
        metavar="PATH",
    )
    trust_remote_code: bool = switch(
        False,
        "run the modelling code a model ships (its config's auto_map); pin --revision with it",
    )
    rope_scaling: str | None = option(
        None,
        "rescale a RoPE model's positions for longer prompts: linear | dynamic (factor "
        "--rope-factor, default 1)",
        rope_scaling_kind,
    )
    rope_factor: float | None = option(
        None,
        "RoPE scaling factor; the served context is the model's times it (alone: linear)",
        optional_positive_float,
    )
    tokenizer_config_path: str | None = option(
        None,
        "a tokenizer_config.json whose chat_template replaces the model's",
        optional_text,
        metavar="PATH",
    )
    reasoning_parser: str = option(
        "auto",
        "how chat completions and responses tell a reasoning model's thinking from its "
        "answer: auto (harmony's channels when the chat template writes <|channel|>, the "
        "<think> tags when it writes <think>, else none) | "
        "none (all of it is content) | deepseek_r1 (the think tags; an output without the "
        "opening tag starts inside the thinking) | qwen3 (the think tags; the prompt's end "
        "says whether the output starts inside the thinking) | openai_gptoss (gpt-oss's "
        "harmony channels: analysis is the reasoning, final the content)",
        reasoning_parser_name,
    )
    dtype: str = option(
        "auto",
        "auto | float32 | bfloat16 | float16. auto: bfloat16 on GPUs and CPUs that compute it "
        "natively (float16 on older GPUs), float32 on other CPUs; on a CPU, steps of up to 16 "
        "tokens (8 in bfloat16 on a CPU without AVX512-BF16; one or a few streams' decodes, "
        "verifications) read int8 copies of the Linear weights, 1.4-1.6x faster at one "
        "stream, perplexity within 0.3 %% (not with --deterministic, --quantize, LoRA or "
        "shards); a "
        "dtype named: exact in that dtype throughout. /info's dtype_reason says what auto "
        "chose and why",
        dtype_name,
    )
    device: str = option("auto", "auto | cpu | cuda | cuda:N", device_name)
    quantize: str | None = option(
        None,
        "weights in fewer bits. Quantized at load: int8 | int4 (CPU, in bfloat16, and CUDA) | "
        "fp8 (CUDA 8.9+) with torchao; bitsandbytes (8-bit) | bitsandbytes-nf4 | "
        "bitsandbytes-fp4 (CPU and CUDA) | eetq (CUDA). A checkpoint that arrives quantized "
        "(config.json's quantization_config: gptq, awq, compressed-tensors, fp8, bitsandbytes, "
        "mxfp4: gpt-oss's experts, which no value names) "
        "loads in its format without this flag; naming another is refused, `marlin` picks the "
        "Marlin kernel for GPTQ/AWQ (CUDA 8.0+), exl2 is refused (docs/quantization.md)",
        quantize_method,
    )
    kv_cache_dtype: str | None = option(
        None,
        "KV cache storage: fp8_e4m3fn | fp8_e5m2 (8 bits a value, upcast in attention: twice "
        "the KV blocks of bfloat16 in the same memory, four times float32's) | auto (the "
        "model's dtype)",
        kv_cache_dtype_name,
    )
    num_shard: int | None = option(
        None,
        "tensor-parallel shards: one process per shard, each holding a slice of every layer "
        "(default: every visible GPU on CUDA, 1 on CPU; docs/shards.md)",
        optional_positive_int,
        env_aliases=("NUM_SHARD",),
    )
    sharded: bool | None = switch(
        None,
        "false: one shard whatever --num-shard or the GPUs say; true: refuse to start unsharded",
        negatable=True,
        env_aliases=("SHARDED",),
    )
    master_addr: str = option(
        "127.0.0.1",
        "address of rank 0 for the shards' rendezvous (torch.distributed's MASTER_ADDR)",
        host_name,
        env_aliases=("MASTER_ADDR",),
    )
    master_port: int = option(
        29500,
        "port of the shards' rendezvous on --master-addr (0: any free one, for shards started "
        "by this server)",
        port_number,
        env_aliases=("MASTER_PORT",),
    )
    local_shards: int | None = option(
        None,
        "shards this server starts itself, ranks 0..N-1 (default: all of --num-shard); the "
        "others are started elsewhere with `textgen shard --rank R` (several hosts)",
        optional_positive_int,
    )
    lora_adapters: tuple[tuple[str, str], ...] = option(
        (),
        "LoRA adapters served beside the base model, comma-separated `id` (a Hub id or a "
        "folder made by peft) or `name=path`; a request picks one by name (TGI's "
        "`adapter_id`, OpenAI's `model`; docs/lora.md)",
        lora_adapter_list,
        metavar="IDS",
        env_aliases=("LORA_ADAPTERS",),
    )
    max_loras: int | None = option(
        None,
        "adapters resident at once: the slots of stacked LoRA weights a step reads, and so "
        "the most adapters one step serves (default: the number of --lora-adapters; 0: no "
        "LoRA, and none may be loaded at run time)",
        non_negative_int,
    )
    max_lora_rank: int | None = option(
        None,
        "the largest LoRA rank served: each slot's size (default: the largest rank of "
        "--lora-adapters, at least 16)",
        positive_int,
    )
    max_concurrent_requests: int = option(
        128, "requests admitted at once; more get `overloaded`", positive_int
    )
    max_queued_requests: int = option(
        0,
        "requests that may wait for a permit instead of failing with `overloaded` (0: none)",
        non_negative_int,
    )
    max_queued_tokens: int = option(
        0, "prompt tokens the waiting requests may hold (0: no bound)", non_negative_int
    )
    graceful_termination_timeout: float = option(
        90.0,
        "seconds in-flight requests get to finish after SIGTERM/SIGINT (0: cut them at once)",
        non_negative_float,
    )
    max_best_of: int = option(2, "largest best_of", positive_int)
    max_n: int = option(
        16,
        "largest n (choices per request) on the OpenAI routes, and their best_of; at most "
        "--max-batch-size (a request's choices share its prompt's KV blocks and run together)",
        positive_int,
    )
    max_stop_sequences: int = option(4, "most stop sequences per request", non_negative_int)
    max_stop_sequence_length: int = option(
        256, "longest stop sequence, in characters", positive_int
    )
    max_top_n_tokens: int = option(5, "largest top_n_tokens", non_negative_int)
    max_client_batch_size: int = option(
        4, "most prompts in one /v1/completions request", positive_int
    )
    disable_grammar_support: bool = switch(
        False,
        "refuse requests that constrain the output (TGI's grammar, response_format, tools) "
        "with a 422",
    )
    prefill_logprobs: bool = switch(
        True,
        "answer decoder_input_details (the prompt's logprobs); --no-prefill-logprobs refuses "
        "it with a 422 (TGI's launcher default)",
        negatable=True,
    )
    max_input_tokens: int | None = option(
        None, "longest prompt (default: max-total-tokens - 1)", positive_int
    )
    max_total_tokens: int | None = option(
        None,
        "longest prompt + generation (default: min(model context, 4096); with --full-context "
        "the model's context, at most what the KV cache holds); needed for a model whose "
        "config states no context (Bloom, Mamba): it is the context served",
        positive_int,
    )
    full_context: bool = switch(
        False,
        "default --max-total-tokens to the model's whole context, bounded by the KV cache's "
        "capacity (TGI's launcher default) rather than min(context, 4096)",
    )
    max_batch_prefill_tokens: int = option(
        2048, "prefill tokens per engine step (prompts are chunked)", positive_int
    )
    max_batch_total_tokens: int | None = option(
        None, "KV-cache capacity in tokens (default: sized from free memory)", positive_int
    )
    max_batch_size: int = option(256, "most sequences per step", positive_int)
    # TGI's --waiting-served-ratio and --max-waiting-tokens have no counterpart: prefill
    # chunks ride in the decodes' forward, so nothing needs rationing (engine/scheduler.py;
    # text-generation-launcher accepts them as TGI 3 does with chunked prefill: tgi_launcher.py)
    validation_workers: int = option(
        2, "threads that validate long prompts and compile grammars (TGI's flag)", positive_int
    )
    torch_threads: int = option(
        0,
        "torch's intra-op threads on the engine's thread (0: OMP_NUM_THREADS if set, else the "
        "CPUs this process may use: its affinity, capped by a container's CPU quota)",
        non_negative_int,
    )
    arrival_gap_ms: float = option(
        1.0,
        "an idle engine woken by a request takes its first step once no other request has "
        f"arrived for this long, at most {MAX_ARRIVAL_GAP_MS:g} ms after the first, so a burst "
        "of requests starts in one prefill step (0: at once)",
        gap_ms,
    )
    deterministic: bool = switch(
        False,
        "batch-invariant engine: a greedy or seeded request gives the same tokens whatever "
        "runs beside it (CPU only; slower: docs/performance.md)",
    )
    cuda_graphs: bool | None = switch(
        None,
        "replay decode steps from CUDA graphs captured per batch size at start-up (default: "
        "on when the model is on a CUDA device; refused on CPU)",
        negatable=True,
    )
    cuda_graph_sizes: tuple[int, ...] | None = option(
        None,
        "the decode batch sizes CUDA graphs are captured for, e.g. 1,2,4,8; larger batches "
        "decode eagerly (default: 1, 2, 4, 8, then every 16 up to --max-batch-size)",
        batch_sizes,
        metavar="SIZES",
    )
    cuda_memory_fraction: float = option(
        1.0,
        "share of each GPU's total memory this server may use (torch's allocator is capped "
        "there, and the KV cache sized within it); CUDA only",
        fraction,
    )
    disable_custom_kernels: bool = switch(
        False,
        "on CUDA, attend with flash-attn or torch SDPA instead of textgen's Triton "
        "paged-attention kernel (CUDA graphs, which replay it, are then off); on CPU, "
        "float32 and bfloat16 decodes gather their K/V for SDPA instead of textgen's C++ "
        "kernel reading the KV cache in place (which also skips its compile at startup)",
    )
    compile: bool = switch(
        False,
        "run decode steps of up to 32 tokens (with --speculate, verifications too) through "
        "torch.compile'd graphs, one per bucket of tokens, compiled at startup (CPU only, off "
        "by default; ~10-15%% faster steps here; "
        "the first start per model compiles for minutes, later ones, new containers with the "
        "same cache volume included, load it from the textgen cache in under a minute: "
        "docs/performance.md)",
        negatable=True,
    )
    speculate: int = option(
        0,
        "speculative decoding: propose up to N tokens per sequence per step and verify them in "
        "one forward (TGI's flag), by n-gram lookup over the sequence's own prompt and output, "
        "or by --speculate-model; greedy and seeded outputs are unchanged (0: off; "
        "docs/speculation.md)",
        non_negative_int,
        metavar="N",
        env_aliases=("SPECULATE",),
    )
    speculate_model: str | None = option(
        None,
        "a small draft model sharing the model's tokenizer (Hub id or local folder) that "
        "proposes the --speculate tokens instead of n-gram lookup",
        optional_text,
        metavar="ID",
    )
    speculate_max_batch: int = option(
        8,
        "steps with more running sequences than this don't speculate: a large batch has no "
        "compute to spare for proposals that may be rejected",
        positive_int,
    )
    speculate_ngram_min: int = option(
        2, "the shortest n-gram (ending the sequence) the n-gram lookup matches", positive_int
    )
    speculate_ngram_max: int = option(
        4, "the longest n-gram the n-gram lookup matches (the longest match wins)", positive_int
    )
    speculate_adaptive: bool = switch(
        True,
        "with --speculate, a sequence proposes only while the tokens its verifications keep "
        "pay for the time they add to a step, both measured as it runs (a sequence that "
        "stopped still probes now and then); --no-speculate-adaptive: every decoding "
        "sequence proposes whenever it can",
        negatable=True,
    )
    watermark_gamma: float = option(
        0.5,
        "share of the vocabulary on the green list of requests with `watermark: true` "
        "(Kirchenbauer et al.; transformers' WatermarkDetector with greenlist_ratio=gamma "
        "detects it)",
        green_share,
    )
    watermark_delta: float = option(
        2.0,
        "bias added to the green tokens' logits of requests with `watermark: true`",
        non_negative_float,
    )
    api_key: str | None = option(
        None, "require `authorization: Bearer KEY` on every call", optional_text, metavar="KEY"
    )
    api_key_file: str | None = option(
        None, "file of accepted API keys, one per line", optional_text, metavar="PATH"
    )
    auth_health_and_metrics: bool = switch(False, "require the API key on health and metrics too")
    hostname: str = option("127.0.0.1", "address to listen on", host_name)
    port: int = option(8080, "HTTP port (Envoy)", port_number)
    grpc_hostname: str | None = option(
        None, "address the gRPC server listens on (default: --hostname)", host_name
    )
    grpc_port: int = option(50051, "gRPC port", port_number)
    no_envoy: bool = switch(False, "serve gRPC only")
    payload_limit: int = option(
        2_000_000,
        "largest HTTP request body, in bytes; a larger one is refused with a 413",
        positive_int,
    )
    allow_private_image_urls: bool | tuple[Network, ...] = option(
        (),
        "image URLs the server may fetch at private, loopback or link-local addresses: "
        "false (public addresses only), true (any) or comma-separated networks "
        "(10.0.0.0/8,fd00::/8); a request's URL is the client's, not the operator's",
        private_networks,
        metavar="NETWORKS",
    )
    image_fetch_timeout: float = option(
        10.0,
        "seconds an image URL's fetch may take, redirects and reading included",
        positive_float,
    )
    max_image_bytes: int = option(
        20 * 1024 * 1024, "largest image an image URL may send, in bytes", positive_int
    )
    max_images_per_request: int = option(
        8,
        "most images in one request (vLLM's --limit-mm-per-prompt): each is fetched and "
        "decoded before the prompt's tokens are counted; 8 LLaVA-1.5 images are 4,608 tokens",
        positive_int,
    )
    max_image_pixels: int = option(
        4096 * 4096,
        "most pixels (width x height) an image may have, read from its header before it "
        "decodes (a small file may decode to gigabytes)",
        positive_int,
    )
    cors_allow_origin: tuple[str, ...] = option(
        (),
        "origins browsers may call the HTTP routes from, comma-separated (* for any), "
        "answered by Envoy's CORS filter (default: no CORS headers)",
        origins,
        metavar="ORIGINS",
    )
    prometheus_port: int | None = option(
        None,
        "also serve the Prometheus metrics on this port of --hostname, on their own "
        "listener (0: any free port)",
        optional_port,
    )
    keepalive_interval: float = option(
        30.0,
        "seconds between HTTP/2 keepalive pings on an idle gRPC connection: Envoy's to this "
        "server; the server accepts clients' pings a third of this apart",
        positive_float,
    )
    otlp_endpoint: str | None = option(
        None,
        "send OpenTelemetry traces to this OTLP/gRPC collector (e.g. http://127.0.0.1:4317)",
        otlp_url,
        metavar="URL",
    )
    otlp_service_name: str = option(
        "textgen", "the service.name of the traces --otlp-endpoint receives", non_empty_text
    )
    json_output: bool = switch(False, "write the logs as JSON, one object per line")
    responses_store_mb: float = option(
        64.0,
        "memory (MB) for the conversations /v1/responses keeps for previous_response_id, per "
        "replica; the oldest go first (0: keep none)",
        non_negative_float,
    )
    responses_store_ttl: float = option(
        3600.0, "seconds a stored /v1/responses conversation is kept", positive_float
    )

    @property
    def keepalive(self) -> Keepalive:
        return Keepalive(interval=self.keepalive_interval)

    @property
    def grpc_host(self) -> str:
        return self.grpc_hostname or self.hostname

    @property
    def rope(self) -> tuple[str, float] | None:
        """(kind, factor) of the RoPE scaling asked for, as TGI pairs its two flags."""
        if self.rope_scaling is None and self.rope_factor is None:
            return None
        return self.rope_scaling or "linear", self.rope_factor or 1.0

    def context_length(self, model_context: int | None, model: str = "the model") -> int:
        """The context served: the model's, stretched by --rope-factor. Where its config
        states none (`model_context` None: Bloom's ALiBi, Mamba's recurrent state have no
        length they were made for) it is --max-total-tokens, and without that flag the
        server is refused: TGI assumes 4096 there, a guess the user can't see. Only
        --max-total-tokens says it, as TGI derives --max-input-tokens from the total and
        never the total from the input; the loader is given the same (LoadOptions.context)."""
        if model_context is None:
            if self.max_total_tokens is None:
                raise SettingError(
                    "--max-total-tokens",
                    None,
                    f"needed: {model}'s config states no context length "
                    "(max_position_embeddings or the like); pass --max-total-tokens N, the "
                    "context to serve",
                )
            return self.max_total_tokens
        rope = self.rope
        return int(model_context * rope[1]) if rope and rope[1] > 1 else model_context

    def resolved_limits(
        self, max_position_embeddings: int, kv_capacity: int | None = None
    ) -> tuple[int, int]:
        """(max_input_tokens, max_total_tokens) for a model with this context length (and,
        once known, this many tokens of KV cache: --full-context's bound)."""
        if self.max_total_tokens:
            total = self.max_total_tokens
        elif self.full_context:
            total = min(max_position_embeddings, kv_capacity or max_position_embeddings)
        else:
            total = min(max_position_embeddings, DEFAULT_MAX_TOTAL_TOKENS)
        max_input = self.max_input_tokens or total - 1
        if max_input >= total:
            raise SettingError(
                "--max-input-tokens", max_input, f"must be < --max-total-tokens ({total})"
            )
        if total > max_position_embeddings:
            raise SettingError(
                "--max-total-tokens",
                total,
                f"exceeds the model's context ({max_position_embeddings} tokens)",
            )
        return max_input, total


def options() -> list[tuple[dataclasses.Field, Option]]:
    """Every setting with its option, in the table's order."""
    return [(f, f.metadata["option"]) for f in dataclasses.fields(Settings)]


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper().replace("-", "_")


def _argparse_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """`parse` for argparse: its rule becomes the error argparse prints with the flag."""

    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None

    convert.__name__ = parse.__name__
    return convert


def env_value(name: str, environ=os.environ) -> tuple[str, object] | None:
    """(variable, value) of setting `name` from TEXTGEN_<FLAG> (else its aliases), or None
    when unset (an empty switch is unset); ValueError("VAR='text': rule") when bad."""
    opt = Settings.__dataclass_fields__[name].metadata["option"]
    for var in (env_name(name), *opt.env_aliases):
        text = environ.get(var)
        if text is None:
            continue
        if opt.switch and not text.strip():
            return None
        try:
            return var, opt.parse(text)
        except ValueError as exc:
            raise ValueError(f"{var}={text!r}: {exc}") from None
    return None


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The `textgen serve` flags; each default comes from TEXTGEN_<FLAG> when set. A bad
    environment value stops the parse as a bad flag does (parser.error: exit 2)."""
    for f, opt in options():
        try:
            found = env_value(f.name)
        except ValueError as exc:
            parser.error(str(exc))
        default = found[1] if found is not None else f.default
        help = f"{opt.help} [env {' or '.join((env_name(f.name), *opt.env_aliases))}]"
        if opt.switch:
            action = argparse.BooleanOptionalAction if opt.negatable else "store_true"
            parser.add_argument(flag_name(f.name), action=action, default=default, help=help)
        else:
            parser.add_argument(
                flag_name(f.name),
                type=_argparse_type(opt.parse),
                default=default,
                metavar=opt.metavar,
                help=help,
            )


def settings_from_args(args: argparse.Namespace) -> Settings:
    fields = Settings.__dataclass_fields__
    return Settings(**{k: v for k, v in vars(args).items() if k in fields})


def settings_argv(settings: Settings) -> list[str]:
    """The flags that give `settings` again (the shards a server starts take its own)."""
    argv: list[str] = []
    for f, opt in options():
        value = getattr(settings, f.name)
        if value == f.default:
            continue
        flag = flag_name(f.name)
        if opt.switch:
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif value is not None:
            argv += [flag, format_value(value)]
    return argv


def format_value(value: object) -> str:
    """A setting's value as its flag reads it (lists comma-separated, --lora-adapters'
    (name, source) pairs as name=source)."""
    if isinstance(value, tuple):
        return ",".join("=".join(v) if isinstance(v, tuple) else str(v) for v in value)
    return str(value)


def settings_table() -> str:
    """The settings as a Markdown table (docs/settings.md, checked by a test)."""
    rows = ["| flag | environment | default | meaning |", "| --- | --- | --- | --- |"]
    for f, opt in options():
        flag = flag_name(f.name)
        if opt.negatable:
            flag += f" / --no-{flag[2:]}"
        default = "—" if f.default in (None, ()) else f"`{format_value(f.default)}`"
        meaning = opt.help.replace("%%", "%").replace("|", "\\|")
        envs = ", ".join(f"`{e}`" for e in (env_name(f.name), *opt.env_aliases))
        rows.append(f"| `{flag}` | {envs} | {default} | {meaning} |")
    return "\n".join(rows) + "\n"
