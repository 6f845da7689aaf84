"""The commands: `textgen` (serve, shard, proxy, generate, bench, models) and
`text-generation-launcher` (TGI's flags and environment, served as `textgen serve`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import sys
from collections.abc import Mapping
from dataclasses import replace

from .observability.logs import configure_logging, fail_line
from .settings.table import (
    SettingError,
    Settings,
    add_serve_arguments,
    settings_argv,
    settings_from_args,
)
from .settings.tgi_launcher import (
    PROG,
    LaunchError,
    given,
    log_level,
    parse_bool,
    runtime_environment,
    sagemaker_entrypoint,
    settings_from,
    tgi_environment,
)
from .settings.tgi_launcher import (
    log as launcher_log,
)

LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")
log = logging.getLogger("textgen.serve")


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (the flag, the value, the rule), no usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_log_level(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=default,
        help="debug also prints the traceback of a failed start",
    )


def _serve(args: argparse.Namespace) -> int:
    return serve_settings(
        "textgen serve", settings_from_args(args), debug=args.log_level == "DEBUG"
    )


def serve_settings(prog: str, settings: Settings, debug: bool = False) -> int:
    """Check the settings, then serve until a signal; the exit status (`textgen serve`,
    and text-generation-launcher once it has translated TGI's flags)."""
    from .settings.preflight import preflight

    def _fail(exc: BaseException, status: int) -> int:
        """One line on stderr (a JSON log line with --json-output); the traceback too
        with --log-level debug."""
        if debug:
            log.debug("traceback", exc_info=exc)
        print(fail_line(prog, str(exc), settings.json_output), file=sys.stderr)
        return status

    try:
        checked = preflight(settings)  # before anything heavy: a bad setting costs a second
    except SettingError as exc:
        return _fail(exc, 2)
    log.info(
        "settings checked: model %s (context %d), max_input_tokens %d, max_total_tokens %d, "
        "device %s",
        checked.model,
        checked.context,
        checked.max_input_tokens,
        checked.max_total_tokens,
        checked.device,
    )
    from .models.quantize import import_torchao_quietly
    from .processes.allocator import keep_freed_memory

    keep_freed_memory()
    import_torchao_quietly()  # first, before transformers imports it noisily
    from .models import ModelError
    from .processes.envoy import EnvoyError
    from .replica.lifecycle import serve

    try:
        asyncio.run(serve(settings))
    except SettingError as exc:  # a rule only the loaded model could show
        return _fail(exc, 2)
    except (ModelError, EnvoyError, OSError) as exc:  # the model, Envoy or a port failed
        return _fail(exc, 1)
    return 0


def _shard(args: argparse.Namespace) -> int:
    from .models.quantize import import_torchao_quietly
    from .processes.allocator import keep_freed_memory

    keep_freed_memory()
    import_torchao_quietly()
    from .replica.shard_worker import run_shard

    settings = settings_from_args(args)
    if not settings.num_shard or not 0 < args.rank < settings.num_shard:
        print(
            f"textgen shard: error: --rank {args.rank}: must be 1..--num-shard - 1 "
            f"(--num-shard {settings.num_shard})",
            file=sys.stderr,
        )
        return 2
    return run_shard(settings, args.rank, settings.num_shard, args.local_rank)


def _generate(args: argparse.Namespace) -> int:
    from textgen.sdk import Client, TextGenError

    with Client(args.target, api_key=args.api_key, timeout=args.timeout) as client:
        try:
            if args.chat:
                _generate_chat(client, args)
            else:
                _generate_raw(client, args)
        except TextGenError as exc:
            print(f"error ({exc.error_type}): {exc.message}", file=sys.stderr)
            return 1
    return 0


def _generate_chat(client, args: argparse.Namespace) -> None:
    """The prompt as one user message, rendered with the model's chat template on the
    server (the OpenAI chat RPC)."""
    body = {
        "messages": [{"role": "user", "content": args.prompt}],
        "max_tokens": args.max_new_tokens,
        "temperature": args.temperature or 0.0,
    }
    if args.seed is not None:
        body["seed"] = args.seed
    if not args.stream:
        print(client.chat_completions(body)["choices"][0]["message"]["content"])
        return
    for chunk in client.chat_completions_stream(body):
        for choice in chunk.get("choices", []):
            sys.stdout.write(choice["delta"].get("content") or "")
            sys.stdout.flush()
    sys.stdout.write("\n")


def _generate_raw(client, args: argparse.Namespace) -> None:
    """The prompt as is, through the TGI-style Generate RPCs."""
    params = {"max_new_tokens": args.max_new_tokens}
    if args.temperature:
        params.update(do_sample=True, temperature=args.temperature)
    if args.seed is not None:
        params["seed"] = args.seed
    if not args.stream:
        print(client.generate(args.prompt, **params).generated_text)
        return
    for message in client.generate_stream(args.prompt, **params):
        if message.token is not None and not message.token.special:
            sys.stdout.write(message.token.text)
            sys.stdout.flush()
    sys.stdout.write("\n")


def _bench(args: argparse.Namespace) -> int:
    from .bench.command import run
    from .processes.allocator import keep_freed_memory

    keep_freed_memory()  # as the server does, for --core and --baseline in this process
    return run(args)


def _models(args: argparse.Namespace) -> int:
    """The families served, from models/families.py: no weights, nothing started."""
    from .models.families import models_json, models_text

    if args.json:
        print(json.dumps(models_json(args.all), indent=2))
    else:
        sys.stdout.write(models_text(args.all))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="textgen", description="LLM text generation over gRPC, TGI and OpenAI HTTP"
    )
    add_log_level(parser, default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model (gRPC, and HTTP through Envoy)")
    add_log_level(serve, default=argparse.SUPPRESS)  # after the command too
    add_serve_arguments(serve)
    serve.set_defaults(func=_serve)

    shard = sub.add_parser(
        "shard",
        help="one rank 1..N-1 of a sharded model (serve --num-shard N starts its local ones; "
        "run this on other hosts with the server's settings)",
    )
    shard.add_argument("--rank", type=int, required=True, help="this shard's rank, 1..N-1")
    shard.add_argument(
        "--local-rank",
        type=int,
        default=int(os.environ.get("LOCAL_RANK", "0")),
        help="its place among this host's --local-shards ranks: its GPU, its cores "
        "[env LOCAL_RANK; default 0]",
    )
    add_serve_arguments(shard)
    add_log_level(shard, default=argparse.SUPPRESS)
    shard.set_defaults(func=_shard)

    from .front_proxy.command import add_proxy_arguments  # light: imports no torch
    from .front_proxy.command import run as run_proxy

    proxy = sub.add_parser("proxy", help="Envoy in front of several replicas (serve --no-envoy)")
    add_proxy_arguments(proxy)
    proxy.set_defaults(func=run_proxy)

    gen = sub.add_parser("generate", help="generate text through a running server")
    gen.add_argument("prompt")
    gen.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sample at this temperature (default: greedy)",
    )
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send the prompt as a chat message (the model's chat template, applied by the "
        "server); --no-chat sends it raw",
    )
    gen.add_argument("--target", default="127.0.0.1:50051", help="gRPC address HOST:PORT")
    gen.add_argument("--api-key", default=None)
    gen.add_argument("--timeout", type=float, default=300.0)
    gen.set_defaults(func=_generate)

    from .bench.command import add_bench_arguments  # light: imports nothing heavy at module level

    bench = sub.add_parser("bench", help="load-test a server: tokens/s, TTFT, inter-token latency")
    add_bench_arguments(bench)
    bench.set_defaults(func=_bench)

    models = sub.add_parser(
        "models",
        help="the model families served: how, the engine's features each uses, the tests "
        "that verify them (docs/models.md)",
    )
    models.add_argument(
        "--all",
        action="store_true",
        help="also every other causal LM transformers has: refused (and why) or unverified",
    )
    models.add_argument("--json", action="store_true", help="print it as JSON")
    models.set_defaults(func=_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, getattr(args, "json_output", False))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())


# text-generation-launcher ----------------------------------------------------------


def tgi_launcher_main(argv: list[str] | None = None) -> int:
    """`text-generation-launcher`: TGI's flags and environment translated onto the
    settings (settings/tgi_launcher.py), then served as `textgen serve` serves them."""
    argv = sys.argv[1:] if argv is None else argv
    environ = os.environ
    json_output = _json_output(argv, environ)
    try:
        level = log_level(environ)
        configure_logging(level, json_output)
        tgi_environment(environ)
        settings, show_env = _settings_and_env(argv, environ)
    except LaunchError as exc:
        print(fail_line(PROG, str(exc), json_output), file=sys.stderr)
        return 2
    if show_env:
        launcher_log.info("%s", runtime_environment())
    shown = replace(settings, api_key="(redacted)") if settings.api_key else settings
    launcher_log.info("serving as: textgen serve %s", shlex.join(settings_argv(shown)))
    if settings.trust_remote_code:
        launcher_log.warning(
            "--trust-remote-code is set: trusting that model %s does not contain malicious code",
            settings.model_id,
        )
    return serve_settings(PROG, settings, debug=level == "DEBUG")


def _settings_and_env(argv: list[str], environ: Mapping[str, str]) -> tuple[Settings, bool]:
    # SageMaker's environment and its `serve` argument, as TGI's SageMaker image maps them
    # (settings_from maps them too: its own output comes back unchanged)
    argv, environ = sagemaker_entrypoint(argv, environ)
    values_env = "--env" in given(argv, environ)
    return settings_from(argv, environ), values_env


def _json_output(argv: list[str], environ: Mapping[str, str]) -> bool:
    """--json-output as early as the first log line (a bad value is refused later)."""
    if "--json-output" in argv:
        return True
    for variable in ("JSON_OUTPUT", "TEXTGEN_JSON_OUTPUT"):
        try:
            if parse_bool(environ.get(variable, "") or "false"):
                return True
        except ValueError:
            pass
    return False
