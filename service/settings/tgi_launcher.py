"""`text-generation-launcher`: TGI's launcher, its flags and its environment, on textgen.

A TGI deployment is a command line or a set of variables (`--model-id X --num-shard 2`,
`MODEL_ID=X`, `docker run IMAGE --model-id X`). This entry point takes them as they are
and translates them onto textgen's settings table (table.py), then serves exactly as
`textgen serve` does: the same preflight, the same server. It keeps no rules of its own
beyond TGI's translation; every TGI flag is in FLAGS with what textgen does with it:

- `Setting`: honoured, by the setting of that name (its own parser, bounds and checks);
- `Accepted`: validated and accepted, with the reason it changes nothing here (e.g.
  --max-waiting-tokens: textgen admits waiting requests at every step, as TGI 3 does with
  chunked prefill; --usage-stats: textgen collects nothing);
- `Refused`: has no meaning here; given, the launcher exits 2 with the reason.

Where a value comes from, first found: the flag, TGI's variable (the bare name, MODEL_ID,
PORT, ...: only this entry point reads those), textgen's TEXTGEN_<SETTING>, the launcher's
default (TGI's, where it differs from serve's: LAUNCHER_DEFAULTS), serve's default.

SageMaker's environment (HF_MODEL_ID, SM_NUM_GPUS, ...) is first mapped onto TGI's
variables and `--port 8080`, as TGI's SageMaker image's entrypoint does
(sagemaker_entrypoint).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import platform
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

from .. import __version__
from .table import (
    Settings,
    env_value,
    format_value,
    non_negative_float,
    non_negative_int,
    parse_bool,
)

PROG = "text-generation-launcher"
log = logging.getLogger("textgen.launcher")

# TGI's defaults where they differ from `textgen serve`'s.
LAUNCHER_DEFAULTS: dict[str, object] = {
    "hostname": "0.0.0.0",
    "port": 3000,  # TGI's outside its image; the image sets PORT=80
    "prometheus_port": 9000,
    # one public port, as TGI: gRPC on loopback at any free port (Envoy serves it on
    # --port too); TEXTGEN_GRPC_HOSTNAME / TEXTGEN_GRPC_PORT expose it
    "grpc_hostname": "127.0.0.1",
    "grpc_port": 0,
    "full_context": True,  # max-total-tokens from the model: min(KV capacity, context)
    "prefill_logprobs": False,  # --enable-prefill-logprobs turns them on
    "cors_allow_origin": ("*",),  # TGI's CORS layer allows any origin unless told
    "otlp_service_name": "text-generation-inference.router",
}
LOG_LEVELS = {"trace": "DEBUG", "debug": "DEBUG", "info": "INFO", "warn": "WARNING",
              "warning": "WARNING", "error": "ERROR"}  # fmt: skip


class LaunchError(ValueError):
    """A flag or variable refused: str() is the one line printed."""


# what a flag does ---------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """Honoured by textgen's setting `name`, parsed by its own parser."""

    name: str
    note: str = ""  # how textgen's meaning or default differs from TGI's


@dataclass(frozen=True)
class Accepted:
    """Validated and accepted; `reason` says why it changes nothing here."""

    parse: Callable[[str], object]
    reason: str


@dataclass(frozen=True)
class Refused:
    """No meaning here: given, the launcher refuses to start."""

    reason: str


@dataclass(frozen=True)
class Flag:
    """One of TGI's launcher flags."""

    name: str  # --model-id
    does: Setting | Accepted | Refused
    env: str | None = ""  # TGI's variable; "" derives it from the name; None: none
    switch: bool = False  # takes no value (its variable reads true/false)
    short: str | None = None
    tgi_default: str = "—"
    default: str | None = None  # textgen's, when the setting's value says it badly

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")

    @property
    def variable(self) -> str | None:
        return self.dest.upper() if self.env == "" else self.env


def _usage_stats(text: str) -> str:
    value = text.strip().lower()
    if value not in ("on", "off", "no-stack"):
        raise ValueError("use on, off or no-stack")
    return value


_NO_TUNNEL = "textgen opens no ngrok tunnel; put your own tunnel or proxy before its port"
# TGI 3's router, where the model chunks prefills: "Model supports prefill chunking.
# `waiting_served_ratio` and `max_waiting_tokens` will be ignored." (backends/v3/src/backend.rs)
_CHUNKED = (
    "textgen chunks prefills into the decodes' steps and admits waiting requests at every "
    "step, as TGI 3 does with chunked prefill (where it ignores this too)"
)

FLAGS: tuple[Flag, ...] = (
    Flag("--model-id", Setting("model_id", "default: the embedded SmolLM2-135M-Instruct"),
         tgi_default="bigscience/bloom-560m"),
    Flag("--revision", Setting("revision")),
    Flag("--validation-workers", Setting("validation_workers"), tgi_default="2"),
    Flag("--sharded", Setting("sharded")),
    Flag("--num-shard", Setting("num_shard"), tgi_default="all visible GPUs"),
    Flag("--quantize", Setting("quantize", "TGI's values and int8, int4 (quantized at "
                                           "load); a checkpoint that arrives quantized loads "
                                           "in its format; exl2 is refused at startup "
                                           "(docs/quantization.md)")),
    Flag("--speculate", Setting("speculate", "n-gram lookup, or a draft model by "
                                             "TEXTGEN_SPECULATE_MODEL (docs/speculation.md)")),
    Flag("--dtype", Setting("dtype", "also auto and float32")),
    Flag("--kv-cache-dtype", Setting("kv_cache_dtype", "fp8_e4m3fn, fp8_e5m2, on CPU too "
                                                       "(docs/quantization.md)")),
    Flag("--trust-remote-code", Setting("trust_remote_code"), switch=True, tgi_default="off"),
    Flag("--max-concurrent-requests", Setting("max_concurrent_requests"), tgi_default="128"),
    Flag("--max-best-of", Setting("max_best_of"), tgi_default="2"),
    Flag("--max-stop-sequences", Setting("max_stop_sequences"), tgi_default="4"),
    Flag("--max-top-n-tokens", Setting("max_top_n_tokens"), tgi_default="5"),
    Flag("--max-input-tokens", Setting("max_input_tokens"),
         tgi_default="max-total-tokens - 1"),
    Flag("--max-input-length", Setting("max_input_tokens", "TGI's legacy name of "
                                                           "--max-input-tokens")),
    Flag("--max-total-tokens", Setting("max_total_tokens"),
         tgi_default="min(max_allocatable, max_position_embeddings)",
         default="the same (--full-context)"),
    Flag("--waiting-served-ratio", Accepted(non_negative_float, _CHUNKED), tgi_default="0.3"),
    Flag("--max-batch-prefill-tokens", Setting("max_batch_prefill_tokens",
                                               "default 2048: prompts are chunked, so any "
                                               "budget serves any prompt"),
         tgi_default="4096, at most the context"),
    Flag("--max-batch-total-tokens", Setting("max_batch_total_tokens"),
         tgi_default="inferred from free memory"),
    Flag("--max-waiting-tokens", Accepted(non_negative_int, _CHUNKED), tgi_default="20"),
    Flag("--max-batch-size", Setting("max_batch_size", "default 256"), tgi_default="none"),
    Flag("--cuda-graphs", Setting("cuda_graph_sizes", "0: --no-cuda-graphs; a list: graphs "
                                                      "for those sizes (refused on CPU)"),
         tgi_default="1,2,4,8,16,32", default="1,2,4,8, then every 16 (CUDA)"),
    Flag("--hostname", Setting("hostname", "a name that is not an IP address means 0.0.0.0, "
                                           "as TGI's router says"), tgi_default="0.0.0.0"),
    Flag("--port", Setting("port", "the image sets PORT=80"), short="-p", tgi_default="3000"),
    Flag("--prometheus-port", Setting("prometheus_port"), tgi_default="9000"),
    Flag("--shard-uds-path", Refused("textgen's shards talk over torch.distributed, not "
                                     "unix sockets: there is no socket path to set"),
         tgi_default="/tmp/text-generation-server"),
    Flag("--master-addr", Setting("master_addr"), tgi_default="localhost"),
    Flag("--master-port", Setting("master_port"), tgi_default="29500"),
    Flag("--huggingface-hub-cache", Setting("huggingface_hub_cache"), tgi_default="— (/data "
                                                                                  "in the image)"),
    Flag("--weights-cache-override", Setting("weights_cache_override")),
    Flag("--disable-custom-kernels", Setting("disable_custom_kernels", "textgen's custom "
                                             "kernels: its Triton paged attention, its "
                                             "C++ CPU decode attention"),
         switch=True, tgi_default="off"),
    Flag("--cuda-memory-fraction", Setting("cuda_memory_fraction"), tgi_default="1.0"),
    Flag("--rope-scaling", Setting("rope_scaling")),
    Flag("--rope-factor", Setting("rope_factor")),
    Flag("--json-output", Setting("json_output"), switch=True, tgi_default="off"),
    Flag("--otlp-endpoint", Setting("otlp_endpoint")),
    Flag("--otlp-service-name", Setting("otlp_service_name"),
         tgi_default="text-generation-inference.router"),
    Flag("--cors-allow-origin", Setting("cors_allow_origin", "repeat it, or separate origins "
                                        "by commas"), tgi_default="any origin"),
    Flag("--api-key", Setting("api_key")),
    Flag("--watermark-gamma", Setting("watermark_gamma", "for requests with "
                                                         "`watermark: true`")),
    Flag("--watermark-delta", Setting("watermark_delta", "for requests with "
                                                         "`watermark: true`")),
    Flag("--ngrok", Refused(_NO_TUNNEL), switch=True, tgi_default="off"),
    Flag("--ngrok-authtoken", Refused(_NO_TUNNEL)),
    Flag("--ngrok-edge", Refused(_NO_TUNNEL)),
    Flag("--tokenizer-config-path", Setting("tokenizer_config_path", "its chat_template is "
                                            "used; it must have one")),
    Flag("--disable-grammar-support", Setting("disable_grammar_support"), switch=True,
         tgi_default="off"),
    Flag("--env", Accepted(parse_bool, "logs the runtime environment at startup, then serves"),
         env=None, switch=True, short="-e"),
    Flag("--max-client-batch-size", Setting("max_client_batch_size"), tgi_default="4"),
    Flag("--lora-adapters", Setting("lora_adapters", "`id` or `name=path`, comma-separated; "
                                                     "a request picks one by name "
                                                     "(docs/lora.md)")),
    Flag("--usage-stats", Accepted(_usage_stats, "textgen collects no usage statistics "
                                                 "whatever the value"), tgi_default="on"),
    Flag("--payload-limit", Setting("payload_limit"), tgi_default="2000000"),
    Flag("--enable-prefill-logprobs", Setting("prefill_logprobs", "without it "
                                              "decoder_input_details is refused (TGI returns "
                                              "an empty prefill instead)"),
         switch=True, tgi_default="off"),
    Flag("--graceful-termination-timeout", Setting("graceful_termination_timeout"),
         tgi_default="90"),
)  # fmt: skip
BY_NAME = {flag.name: flag for flag in FLAGS}


# argv and environment -> Settings -------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise LaunchError(message)


def build_parser() -> argparse.ArgumentParser:
    """TGI's flags as given, unparsed: values are read by textgen's parsers afterwards."""
    parser = _Parser(
        prog=PROG,
        description="Text Generation Launcher: TGI's flags and environment, served by textgen "
        "(docs/launcher.md says what each does here)",
    )
    for flag in FLAGS:
        names = [flag.short, flag.name] if flag.short else [flag.name]
        env = f" [env {flag.variable}]" if flag.variable else ""
        help = f"{_does(flag)}{env}"
        if flag.switch:
            parser.add_argument(*names, dest=flag.dest, action="store_const", const="true",
                                help=help)  # fmt: skip
        elif flag.name == "--cors-allow-origin":
            parser.add_argument(*names, dest=flag.dest, action="append", help=help)
        else:
            parser.add_argument(*names, dest=flag.dest, help=help)
    parser.add_argument("-V", "--version", action="version", version=f"{PROG} (textgen) "
                        f"{__version__}")  # fmt: skip
    return parser


def given(argv: list[str], environ: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """The flags given, by name: (where, text), the flag winning over its variable."""
    args = build_parser().parse_args(argv)
    found: dict[str, tuple[str, str]] = {}
    for flag in FLAGS:
        value = getattr(args, flag.dest)
        if isinstance(value, list):  # --cors-allow-origin, repeated
            value = ",".join(value)
        if value is not None:
            found[flag.name] = (flag.name, value)
        elif flag.variable and environ.get(flag.variable, "").strip():
            found[flag.name] = (flag.variable, environ[flag.variable])
    return found


def settings_from(argv: list[str], environ: Mapping[str, str] = os.environ) -> Settings:
    """The settings TGI's `argv` and environment say (SageMaker's too, mapped as TGI's
    SageMaker image does: sagemaker_entrypoint); LaunchError for a refused one."""
    argv, environ = sagemaker_entrypoint(argv, environ)
    values = _defaults(environ)
    flags = given(argv, environ)
    if "--max-input-tokens" in flags and "--max-input-length" in flags:
        raise LaunchError(
            "--max-input-length: --max-input-tokens is given too; give only --max-input-tokens "
            "(--max-input-length is its legacy name)"
        )
    for name, (where, text) in flags.items():
        _apply(BY_NAME[name], where, text, values)
    _hostname(values)
    return Settings(**values)


def _defaults(environ: Mapping[str, str]) -> dict[str, object]:
    """Each setting from TEXTGEN_<SETTING> when set, else the launcher's default, else
    serve's."""
    values: dict[str, object] = {}
    for f in fields(Settings):
        try:
            found = env_value(f.name, environ)
        except ValueError as exc:
            raise LaunchError(str(exc)) from None
        if found is not None:
            values[f.name] = found[1]
        elif f.name in LAUNCHER_DEFAULTS:
            values[f.name] = LAUNCHER_DEFAULTS[f.name]
    return values


def _apply(flag: Flag, where: str, text: str, values: dict[str, object]) -> None:
    """Set what `flag` (given as `where` = `text`) says in `values`, or refuse it."""
    shown = f"{where} {text!r}" if where.startswith("-") else f"{where}={text!r}"
    does = flag.does
    if isinstance(does, Refused):
        raise LaunchError(f"{shown}: {does.reason}")
    try:
        if isinstance(does, Accepted):
            does.parse("true" if flag.switch else text)
            if flag.name != "--env":  # cli.tgi_launcher_main acts on that one
                log.info("%s accepted: %s", shown, does.reason)
            return
        _set(flag, does.name, text, values)
    except ValueError as exc:
        raise LaunchError(f"{shown}: {exc}") from None


def _set(flag: Flag, name: str, text: str, values: dict[str, object]) -> None:
    """values[name] from TGI's text: TGI's spellings first, then the setting's parser."""
    option = Settings.__dataclass_fields__[name].metadata["option"]
    if flag.switch or option.switch:  # TGI's --sharded takes true/false; serve's a switch
        values[name] = parse_bool(text)
    elif flag.name == "--cuda-graphs" and text.strip() == "0":
        values["cuda_graphs"] = False
    elif flag.name == "--cuda-graphs":
        values["cuda_graphs"] = True
        values[name] = option.parse(text)
    else:
        values[name] = option.parse(text)


def _hostname(values: dict[str, object]) -> None:
    """TGI's router binds --hostname if it is an IP address, else 0.0.0.0 with a warning
    (in a container HOSTNAME is the container's name)."""
    host = str(values.get("hostname", ""))
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        log.warning("hostname %r is not an IP address: listening on 0.0.0.0, as TGI does", host)
        values["hostname"] = "0.0.0.0"


# SageMaker's environment -------------------------------------------------------------------

# TGI's SageMaker image (its Dockerfile's `sagemaker` stage) runs sagemaker-entrypoint.sh
# (huggingface/text-generation-inference, read at commit db931fcf), not the launcher:
#   [[ -z "${HF_MODEL_ID}" ]] -> echo "HF_MODEL_ID must be set"; exit 1
#   export MODEL_ID="${HF_MODEL_ID}"
#   [[ -n "${HF_MODEL_REVISION}" ]] -> export REVISION="${HF_MODEL_REVISION}"
#   [[ -n "${SM_NUM_GPUS}" ]] -> export NUM_SHARD="${SM_NUM_GPUS}"
#   [[ -n "${HF_MODEL_QUANTIZE}" ]] -> export QUANTIZE="${HF_MODEL_QUANTIZE}"
#   [[ -n "${HF_MODEL_TRUST_REMOTE_CODE}" ]] -> export TRUST_REMOTE_CODE="${...}"
#   text-generation-launcher --port 8080
# It keys on nothing (the image is SageMaker's); here one launcher serves both, so any of
# these variables set (not empty: the script's -z/-n) says SageMaker's environment is there.
SAGEMAKER_VARIABLES: dict[str, str] = {  # SageMaker's variable -> TGI's, which it overwrites
    "HF_MODEL_ID": "MODEL_ID",
    "HF_MODEL_REVISION": "REVISION",
    "SM_NUM_GPUS": "NUM_SHARD",
    "HF_MODEL_QUANTIZE": "QUANTIZE",
    "HF_MODEL_TRUST_REMOTE_CODE": "TRUST_REMOTE_CODE",
}
SAGEMAKER_PORT = 8080  # the entrypoint's `--port 8080`: a flag, over PORT (80 in the image)
# SageMaker's own variable for a container labelled
# com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true (multi-container endpoints,
# inference pipelines): the port to listen on instead of 8080. TGI's entrypoint ignores it;
# SageMaker sets it for no other container, so unset (8080) is TGI's case.
SAGEMAKER_BIND_TO_PORT = "SAGEMAKER_BIND_TO_PORT"
# SageMaker runs a hosting container as `docker run IMAGE serve`; TGI's entrypoint passes
# the launcher none of its arguments, so `serve` reaches nothing there.
SAGEMAKER_ARGUMENT = "serve"


def sagemaker_entrypoint(
    argv: list[str], environ: Mapping[str, str]
) -> tuple[list[str], dict[str, str]]:
    """(argv, environ) as TGI's sagemaker-entrypoint.sh hands them to the launcher when
    SageMaker's environment is there (any of SAGEMAKER_VARIABLES set); unchanged otherwise.

    SageMaker's variables overwrite TGI's, as the script's `export`s do (SM_NUM_GPUS=2 with
    NUM_SHARD=4 serves 2 shards; logged), and the port is the script's `--port 8080` flag
    (or SAGEMAKER_BIND_TO_PORT), over PORT and TEXTGEN_PORT. SageMaker's `serve` argument
    is dropped. The script passes the launcher no other argument; the flags given here are
    honoured, but one that contradicts what SageMaker's environment sets (--model-id,
    --revision, --num-shard, --quantize, --trust-remote-code, --port) is refused:
    TGI has no such case to copy. Idempotent: its own output comes back unchanged."""
    present = {name: environ[name] for name in SAGEMAKER_VARIABLES if environ.get(name, "")}
    if not present:
        return list(argv), dict(environ)
    if "HF_MODEL_ID" not in present:
        raise LaunchError(
            f"{', '.join(present)} set (SageMaker's environment): HF_MODEL_ID must be set, "
            "as TGI's sagemaker-entrypoint.sh says"
        )
    args = list(argv[1:] if argv[:1] == [SAGEMAKER_ARGUMENT] else argv)
    flags = {name: text for name, (where, text) in given(args, environ).items() if where == name}
    out = dict(environ)
    mapped = []
    for name, text in present.items():
        variable = SAGEMAKER_VARIABLES[name]
        flag = next(f for f in FLAGS if f.variable == variable)
        _refuse_contradiction(flag, flags.get(flag.name), text, f"{name}={text!r}")
        before = environ.get(variable, "")
        if before.strip() and before != text:
            log.warning(
                "%s=%r overwrites %s=%r, as TGI's sagemaker-entrypoint.sh exports it",
                name, text, variable, before,
            )  # fmt: skip
        out[variable] = text
        mapped.append(f"{name} -> {variable}")
    bound = environ.get(SAGEMAKER_BIND_TO_PORT, "").strip()
    port = bound or str(SAGEMAKER_PORT)
    shown = f"{SAGEMAKER_BIND_TO_PORT}={port!r}" if bound else f"--port {port}"
    _refuse_contradiction(BY_NAME["--port"], flags.get("--port"), port, shown)
    if "--port" not in flags:
        args += ["--port", port]
    if args != list(argv) or out != dict(environ):
        log.info(
            "SageMaker's environment: %s, and %s, as TGI's sagemaker-entrypoint.sh does",
            ", ".join(mapped),
            shown,
        )
    return args, out


def _refuse_contradiction(flag: Flag, given_text: str | None, wanted: str, shown: str) -> None:
    """`flag` given as `given_text` where SageMaker's environment sets `wanted` (`shown`
    says where): refused when the two values differ."""
    if given_text is None:
        return
    option = Settings.__dataclass_fields__[flag.does.name].metadata["option"]

    def value(text: str) -> object:
        try:
            return parse_bool(text) if flag.switch else option.parse(text)
        except ValueError:
            return text.strip()

    if value(given_text) != value(wanted):
        raise LaunchError(
            f"{flag.name} {given_text!r}: SageMaker's environment sets it ({shown}, as TGI's "
            "sagemaker-entrypoint.sh does); give one or the other"
        )


# TGI's other variables -------------------------------------------------------------------


def tgi_environment(environ: dict[str, str]) -> None:
    """The variables TGI reads besides its flags': HF_API_TOKEN is HF_TOKEN's old name
    (the shards inherit it); LOG_LEVEL (trace, debug, info, warn, error) the log level."""
    if environ.get("HF_API_TOKEN") and not environ.get("HF_TOKEN"):
        environ["HF_TOKEN"] = environ["HF_API_TOKEN"]


def log_level(environ: Mapping[str, str]) -> str:
    text = environ.get("LOG_LEVEL", "").strip().lower()
    if not text:
        return "INFO"
    if text not in LOG_LEVELS:
        raise LaunchError(
            f"LOG_LEVEL={text!r}: use trace, debug, info, warn or error (textgen has no "
            "per-module filters)"
        )
    return LOG_LEVELS[text]


def runtime_environment() -> str:
    """What `--env` logs: the versions and the machine, as TGI's env_runtime does."""
    lines = [f"textgen: {__version__}", f"Python: {platform.python_version()}",
             f"Platform: {platform.platform()}"]  # fmt: skip
    try:
        import torch
        import transformers

        lines += [f"torch: {torch.__version__}", f"transformers: {transformers.__version__}"]
        if torch.cuda.is_available():
            lines += [f"CUDA: {torch.version.cuda}"] + [
                f"GPU {i}: {torch.cuda.get_device_name(i)}"
                for i in range(torch.cuda.device_count())
            ]
        else:
            lines.append("GPUs: none visible")
    except ImportError:  # pragma: no cover - the server extra is missing
        lines.append("torch/transformers: not installed")
    lines.append(f"CPUs: {os.cpu_count()}")
    return "Runtime environment:\n" + "\n".join(lines)


# the table in docs/launcher.md ------------------------------------------------------------


def _does(flag: Flag) -> str:
    does = flag.does
    if isinstance(does, Setting):
        text = f"honoured: {_setting_flag(does.name)}"
        return f"{text}; {does.note}" if does.note else text
    if isinstance(does, Accepted):
        return f"accepted: {does.reason}"
    return f"refused: {does.reason}"


def _setting_flag(name: str) -> str:
    return "serve's --" + name.replace("_", "-")


def launcher_table() -> str:
    """Every TGI launcher flag and what textgen does with it (docs/launcher.md)."""
    rows = [
        "| flag | TGI's variable | TGI's default | textgen's default | what textgen does |",
        "| --- | --- | --- | --- | --- |",
    ]
    defaults = Settings()
    for flag in FLAGS:
        names = f"`{flag.short}`, `{flag.name}`" if flag.short else f"`{flag.name}`"
        env = f"`{flag.variable}`" if flag.variable else "—"
        ours = flag.default or "—"
        if isinstance(flag.does, Setting) and flag.default is None:
            name = flag.does.name
            value = LAUNCHER_DEFAULTS.get(name, getattr(defaults, name))
            if isinstance(value, bool):
                ours = "on" if value else "off"
            elif value not in (None, ()):
                ours = f"`{format_value(value)}`"
        does = _does(flag).replace("|", "\\|")
        rows.append(f"| {names} | {env} | {flag.tgi_default} | {ours} | {does} |")
    return "\n".join(rows) + "\n"


# the command ------------------------------------------------------------------------------
