"""`textgen proxy`: Envoy in front of several replicas (README, "Several replicas"), or of
several pools of replicas that serve different models (--pool: README, "Several models";
pools.py).

The same HTTP faces and native gRPC as `textgen serve`'s Envoy, over N gRPC
replicas (`textgen serve --no-envoy`): least-request balancing, gRPC health
checks, outlier detection, and a retry onto another replica of a request refused
before its first byte (overloaded, draining, dead). The config is
textgen.envoy.config's `render(front=True)`; the process is supervised by
service/processes/envoy.py, as `textgen serve` supervises its own Envoy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal

from textgen.envoy import config as envoy_config
from textgen.envoy.docs import installed_swagger_ui
from textgen.sdk.keepalive import DEFAULT_KEEPALIVE, Keepalive

from ..processes.envoy import ip_literal, start_front_proxy
from ..settings.table import ENV_PREFIX
from .pools import discover, merged, pool_arg, pool_dns_arg

# How long the proxy waits at start for a replica of each pool to name its models.
DEFAULT_POOL_TIMEOUT = 300.0

log = logging.getLogger("textgen.proxy")


def _address(text: str) -> envoy_config.Upstream:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return envoy_config.Upstream(host.strip("[]"), int(port))


def add_proxy_arguments(parser: argparse.ArgumentParser) -> None:
    """The `textgen proxy` flags. --hostname and --port read TEXTGEN_HOSTNAME and
    TEXTGEN_PORT as `textgen serve` does (the Docker image sets the hostname)."""
    parser.add_argument(
        "--upstream",
        type=_address,
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a replica's gRPC address (repeat for each); a name is resolved once, at start",
    )
    parser.add_argument(
        "--dns",
        type=_address,
        action="append",
        default=[],
        metavar="NAME:PORT",
        help="a DNS name whose every address is a replica, re-resolved every 5 s "
        "(a Kubernetes headless service, a compose service with several replicas)",
    )
    parser.add_argument(
        "--pool",
        type=pool_arg,
        action="append",
        dest="pools",
        default=[],
        metavar="MODEL=HOST:PORT[,HOST:PORT...]",
        help="several models behind one address: the replicas serving MODEL, the model id "
        "they report (their /v1/models; checked at start). Repeat per model, in place of "
        "--upstream/--dns. A request goes to the pool of its model: OpenAI's and Anthropic's "
        "body `model`, else the x-model-id header (TGI's routes) or gRPC metadata; none: the "
        "first pool; another: 404 model_not_found. GET /v1/models lists every pool's models",
    )
    parser.add_argument(
        "--pool-dns",
        type=pool_dns_arg,
        action="append",
        dest="pools",
        metavar="MODEL=NAME:PORT[,NAME:PORT...]",
        help="a pool as --pool, by DNS names whose every address is one of its replicas, "
        "re-resolved every 5 s (as --dns)",
    )
    parser.add_argument(
        "--pool-timeout",
        type=float,
        default=DEFAULT_POOL_TIMEOUT,
        help="seconds to wait at start for a replica of each pool to name its models",
    )
    parser.add_argument(
        "--hostname",
        default=os.environ.get(ENV_PREFIX + "HOSTNAME", "127.0.0.1"),
        help=f"address to listen on [env {ENV_PREFIX}HOSTNAME]",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get(ENV_PREFIX + "PORT", "8080")),
        help=f"HTTP port (TGI/OpenAI routes and native gRPC) [env {ENV_PREFIX}PORT]",
    )
    parser.add_argument(
        "--admin-port", type=int, default=0, help="Envoy's admin port, on 127.0.0.1 (0: any free)"
    )
    parser.add_argument(
        "--keepalive-interval",
        type=float,
        default=float(os.environ.get(ENV_PREFIX + "KEEPALIVE_INTERVAL", "30")),
        help="seconds between Envoy's keepalive pings to a replica on a connection without "
        "data; the replicas' own --keepalive-interval must not be larger "
        f"[env {ENV_PREFIX}KEEPALIVE_INTERVAL]",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print Envoy's bootstrap (JSON) and exit"
    )


def upstreams_from_args(args: argparse.Namespace) -> list[envoy_config.Upstream]:
    upstreams = [envoy_config.Upstream(ip_literal(u.host), u.port) for u in args.upstream]
    upstreams += args.dns
    if upstreams and args.pools:
        raise SystemExit("textgen proxy: --pool replaces --upstream and --dns: give every pool")
    if not upstreams and not args.pools:
        raise SystemExit(
            "textgen proxy: give at least one --upstream HOST:PORT or --dns NAME:PORT "
            "(or --pool MODEL=HOST:PORT per model)"
        )
    return upstreams


def run(args: argparse.Namespace) -> int:
    upstreams = upstreams_from_args(args)
    pools = merged(args.pools)
    if args.print_config:
        # the replicas aren't asked: each pool routes its own name only
        bootstrap = envoy_config.render(
            upstreams,
            listen_host=ip_literal(args.hostname),
            listen_port=args.port,
            admin_port=args.admin_port,
            front=True,
            keepalive=Keepalive(interval=args.keepalive_interval),
            swagger_ui=installed_swagger_ui(),
            pools=pools,
        )
        print(json.dumps(bootstrap, indent=1))
        return 0
    keepalive = Keepalive(interval=args.keepalive_interval)
    return asyncio.run(
        serve_proxy(
            upstreams,
            args.hostname,
            args.port,
            args.admin_port,
            keepalive,
            pools=pools,
            pool_timeout=args.pool_timeout,
        )
    )


async def serve_proxy(
    upstreams: list[envoy_config.Upstream],
    hostname: str,
    port: int,
    admin_port: int,
    keepalive: Keepalive = DEFAULT_KEEPALIVE,
    *,
    pools: list[envoy_config.Pool] | None = None,
    pool_timeout: float = DEFAULT_POOL_TIMEOUT,
) -> int:
    """Run the front proxy until SIGINT/SIGTERM (0) or until Envoy dies (1). `pools`:
    several models (their replicas are asked for their models first), in place of
    `upstreams`."""
    if pools:
        pools = await discover(pools, pool_timeout)
    envoy = await start_front_proxy(
        upstreams,
        listen_host=hostname,
        listen_port=port,
        admin_port=admin_port,
        keepalive=keepalive,
        pools=pools or (),
    )
    log.info(
        "textgen proxy ready: http=%s admin=%s %s",
        envoy.http_url,
        envoy.admin_url,
        _described(upstreams, pools or ()),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([stopped, envoy.exited], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not stop.is_set():
        log.error("envoy (pid %d) exited with code %s", envoy.pid, envoy.process.returncode)
        await envoy.stop()
        return 1
    log.info("shutting down the proxy (pid %d)", os.getpid())
    await envoy.stop()
    return 0


def _described(upstreams: list[envoy_config.Upstream], pools: list[envoy_config.Pool]) -> str:
    def addresses(ups) -> str:
        return ",".join(f"{u.host}:{u.port}" for u in ups)

    if not pools:
        return f"upstreams={addresses(upstreams)}"
    return " ".join(f"pool[{p.name}]={addresses(p.upstreams)}" for p in pools)
