"""Several models behind one front proxy (`textgen proxy --pool MODEL=...`, README
"Several models"): one cluster of replicas per pool, chosen by the request's model.

The Lua filter (lua.py) names the model of each request in MODEL_HEADER: OpenAI's and
Anthropic's JSON body `model`, else the client's own MODEL_HEADER (TGI's routes, native
gRPC metadata). It looks the name up in the table rendered here (every id the pool's
replicas report: the base model and its LoRA adapters) and writes the pool's index into
POOL_HEADER, which the routes match (routes.py: one copy of each route per pool after the
first, before the route of the first pool, which also takes requests that name no model).
A name no pool serves is answered 404 `model_not_found` there. A stored response (the
Responses API's retrieval, deletion, input items) naming no model goes to the pool of the
replica its id names (pool_by_replica), so the ring of that pool can find the replica.
`GET /v1/models` is a direct response: the union of the pools' model cards, as their
replicas reported them when the proxy started.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from .clusters import CLUSTER, Upstream

# The model a request is for: clients set it on TGI's routes and in native gRPC
# metadata; the Lua filter sets it from a JSON body's `model` (which wins).
MODEL_HEADER = "x-model-id"
# The chosen pool's index, written by the Lua filter only (a client's is replaced).
POOL_HEADER = "x-textgen-pool"
# Marks a request answered 404 for its model, for local_reply_config's mapper (errors.py).
MODEL_ERROR_HEADER = "x-textgen-error-code"
MODEL_NOT_FOUND = "model_not_found"  # its value, and OpenAI's `code` in the answer
# Routes whose JSON body names the model: OpenAI's, and Anthropic's Messages.
MODEL_BODY_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


@dataclass(frozen=True)
class ModelCard:
    """One entry of /v1/models, as a replica's ListModels reports it."""

    id: str
    created: int = 0
    owned_by: str = "textgen"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model

    def as_json(self) -> dict:
        card = {"id": self.id, "object": "model", "created": self.created}
        card["owned_by"] = self.owned_by
        card |= {k: v for k, v in (("root", self.root), ("parent", self.parent)) if v}
        return card


@dataclass(frozen=True)
class Pool:
    """Replicas that serve one model: `name`, among the `models` they report."""

    name: str
    upstreams: tuple[Upstream, ...]
    models: tuple[ModelCard, ...] = ()  # empty: just `name`

    @property
    def names(self) -> tuple[str, ...]:
        """The names that route here: the pool's, then every other id its replicas report."""
        return (self.name, *(m.id for m in self.models if m.id != self.name))


def cluster_name(index: int) -> str:
    """The first pool is the single-model proxy's cluster; the others are numbered."""
    return CLUSTER if index == 0 else f"{CLUSTER}_{index}"


def pool_by_model(pools: Sequence[Pool]) -> dict[str, int]:
    """Every model name to its pool's index; a name two pools claim is refused."""
    table: dict[str, int] = {}
    for index, pool in enumerate(pools):
        for name in pool.names:
            if name in table:
                raise ValueError(f"model {name!r} is served by pools {table[name]} and {index}")
            table[name] = index
    return table


def pool_by_replica(pools: Sequence[Pool]) -> dict[str, int]:
    """The address (`ip:port`, as Envoy names an upstream host) of every replica given by
    IP to its pool's index: a stored response's id names its replica (affinity.py). DNS
    names are resolved by Envoy alone: their replicas aren't here."""
    table = {}
    for index, pool in enumerate(pools):
        for u in pool.upstreams:
            if u.is_ip:
                table[f"[{u.host}]:{u.port}" if ":" in u.host else f"{u.host}:{u.port}"] = index
    return table


# The served models a 404 names at most.
MAX_NAMED = 10

# The tables and helpers both Lua filters share: lua.py's (before the transcoder: HTTP by the
# body's `model` or the header, native gRPC by its metadata) and affinity.py's (after it:
# native gRPC's OpenAI methods by their JSON's `model`, stored responses by their replica;
# both filters also carry affinity.REPLICA_OF).
POOL_LUA = r"""
-- Several models (textgen.envoy.pools): a request goes to the pool of the model it names
-- through POOL_HEADER, which the routes match. Empty tables: one pool, nothing to do.
local POOL_BY_MODEL = {__POOL_BY_MODEL__}
-- A stored response lives on the replica that made it, whose address its id carries.
local POOL_BY_REPLICA = {__POOL_BY_REPLICA__}  -- `ip:port` -> pool (--pool's replicas)
local MODEL_HEADER, POOL_HEADER = "__MODEL_HEADER__", "__POOL_HEADER__"
local SERVED_MODELS = "__SERVED_MODELS__"  -- for the 404's message

local function not_served(model)
  return "The model `" .. model .. "` does not exist (served: " .. SERVED_MODELS .. ")"
end

-- Native gRPC's answer to a model no pool serves: NOT_FOUND, trailers-only.
local function grpc_not_served(handle, model)
  local message = not_served(model):gsub('[^%w%-_%.~ ]', function(c)
    return string.format('%%%02X', c:byte())  -- grpc-message is percent-encoded
  end)
  handle:respond({[":status"] = "200", ["content-type"] = "application/grpc",
    ["grpc-status"] = "5", ["grpc-message"] = message})
end
"""


def pool_lua(pools: Sequence[Pool] = ()) -> str:
    """POOL_LUA with the pools' tables (no pools: empty ones)."""
    table = pool_by_model(pools)
    names = list(table)
    served = ", ".join(names[:MAX_NAMED]) + (", ..." if len(names) > MAX_NAMED else "")
    return (
        POOL_LUA.replace("__POOL_BY_MODEL__", _lua_table(table))
        .replace("__POOL_BY_REPLICA__", _lua_table(pool_by_replica(pools)))
        .replace("__MODEL_HEADER__", MODEL_HEADER)
        .replace("__POOL_HEADER__", POOL_HEADER)
        .replace("__SERVED_MODELS__", _lua_quoted(served))
        .strip()
    )


def _lua_quoted(text: str) -> str:
    """`text` for inside a Lua string literal's double quotes."""
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _lua_table(entries: dict[str, int]) -> str:
    return ", ".join(f'["{_lua_quoted(k)}"] = {v}' for k, v in entries.items())


def models_body(pools: Sequence[Pool]) -> str:
    """OpenAI's model list: every pool's cards (a pool without any: its name)."""
    cards = [card for pool in pools for card in (pool.models or (ModelCard(pool.name),))]
    return json.dumps({"object": "list", "data": [c.as_json() for c in cards]})
