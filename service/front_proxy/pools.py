"""`textgen proxy --pool MODEL=HOST:PORT,...`: pools of replicas serving different models
behind one proxy (README "Several models"; the Envoy side is textgen.envoy.pools).

A pool is named by the model its replicas serve. At start the proxy asks each pool's
replicas for their models (gRPC ListModels) and refuses a pool whose replicas don't serve
its name: what /v1/models lists and what a request's `model` is matched against are the
replicas' own ids (the base model and the LoRA adapters loaded at start).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import replace

import grpc
from textgen.envoy.config import ModelCard, Pool, Upstream

from ..processes.envoy import ip_literal
from ..proto import text_generation_service_pb2 as svc_pb
from ..proto import text_generation_service_pb2_grpc as svc_grpc

log = logging.getLogger("textgen.proxy")

LIST_MODELS_TIMEOUT = 2.0  # seconds per replica and try
RETRY_INTERVAL = 1.0  # between tries while no replica of a pool answers


def _pool_arg(text: str, *, dns: bool) -> Pool:
    """MODEL=HOST:PORT[,HOST:PORT...] (the last `=` splits: a model id may hold one)."""
    name, sep, addresses = text.rpartition("=")
    form = "MODEL=NAME:PORT[,NAME:PORT...]" if dns else "MODEL=HOST:PORT[,HOST:PORT...]"
    if not sep or not name.strip() or not addresses:
        raise argparse.ArgumentTypeError(f"expected {form}, got {text!r}")
    upstreams = []
    for address in addresses.split(","):
        host, sep, port = address.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise argparse.ArgumentTypeError(f"expected {form}, got {text!r} ({address!r})")
        host = host.strip("[]")
        # --pool names are resolved once, as --upstream's; --pool-dns's are Envoy's to re-resolve
        upstreams.append(Upstream(host if dns else _resolve(host), int(port)))
    return Pool(name.strip(), tuple(upstreams))


def _resolve(host: str) -> str:
    try:
        return ip_literal(host)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot resolve {host!r}: {exc}") from None


def pool_arg(text: str) -> Pool:
    return _pool_arg(text, dns=False)


def pool_dns_arg(text: str) -> Pool:
    return _pool_arg(text, dns=True)


def merged(pools: Sequence[Pool]) -> list[Pool]:
    """The pools in the order first named; one model's --pool and --pool-dns make one pool."""
    by_name: dict[str, Pool] = {}
    for pool in pools:
        known = by_name.get(pool.name)
        by_name[pool.name] = (
            pool if known is None else replace(known, upstreams=known.upstreams + pool.upstreams)
        )
    return list(by_name.values())


async def discover(pools: Sequence[Pool], timeout: float) -> list[Pool]:
    """The pools with the model cards their replicas report; SystemExit when a pool's
    replicas serve another model, or none of them answers within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    return list(await asyncio.gather(*(_discover(pool, deadline, timeout) for pool in pools)))


async def _discover(pool: Pool, deadline: float, timeout: float) -> Pool:
    while True:
        answers = await asyncio.gather(*(_list_models(u) for u in pool.upstreams))
        answered = [(u, cards) for u, cards in zip(pool.upstreams, answers) if cards is not None]
        if answered:
            break
        if time.monotonic() >= deadline:
            raise SystemExit(
                f"textgen proxy: no replica of the pool of {pool.name!r} "
                f"({_addresses(pool.upstreams)}) answered ListModels within {timeout:g} s"
            )
        await asyncio.sleep(RETRY_INTERVAL)
    cards: dict[str, ModelCard] = {}
    for upstream, served in answered:
        ids = [card.id for card in served]
        if pool.name not in ids:
            raise SystemExit(
                f"textgen proxy: --pool {pool.name}: the replica at {_addresses([upstream])} "
                f"serves {', '.join(map(repr, ids))}, not {pool.name!r} (a pool is named by "
                "the model id its replicas report: their /v1/models)"
            )
        for card in served:
            cards.setdefault(card.id, card)
    ordered = [cards.pop(pool.name), *cards.values()]  # the pool's own model first
    log.info("pool %r: %s", pool.name, ", ".join(card.id for card in ordered))
    return replace(pool, models=tuple(ordered))


async def _list_models(upstream: Upstream) -> list[ModelCard] | None:
    """The replica's models, or None if it doesn't answer (yet)."""
    host = f"[{upstream.host}]" if ":" in upstream.host else upstream.host
    async with grpc.aio.insecure_channel(f"{host}:{upstream.port}") as channel:
        stub = svc_grpc.TextGenerationServiceStub(channel)
        try:
            reply = await stub.ListModels(svc_pb.ListModelsRequest(), timeout=LIST_MODELS_TIMEOUT)
        except grpc.RpcError:
            return None
    return [_card(model) for model in reply.data]


def _card(model: svc_pb.Model) -> ModelCard:
    return ModelCard(
        id=model.id,
        created=model.created,
        owned_by=model.owned_by,
        root=model.root if model.HasField("root") else None,
        parent=model.parent if model.HasField("parent") else None,
    )


def _addresses(upstreams: Sequence[Upstream]) -> str:
    return ",".join(f"{u.host}:{u.port}" for u in upstreams)
