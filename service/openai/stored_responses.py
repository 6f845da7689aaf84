"""GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items: a response
kept in this replica's store (response_store.py) as OpenAI's API shows it.

A response that is not kept here is `not_found` (404), with the reason spelled out:
behind the front proxy the id names the replica that stored it (the proxy routes there
while it is reachable), so a miss there says which replica that was.
"""

from __future__ import annotations

from dataclasses import dataclass

from .common import OpenAIRequestError, json_bytes
from .response_store import ResponseStore, StoredResponse, replica_of

# OpenAI's bounds and default of `limit`.
MAX_LIMIT, DEFAULT_LIMIT = 100, 20
ORDERS = ("asc", "desc")


class ResponseNotFound(Exception):
    """The id is not kept on this replica (HTTP 404 `not_found`)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class ItemsQuery:
    """The query of GET /v1/responses/{id}/input_items (None: not given)."""

    limit: int | None = None
    order: str | None = None
    after: str | None = None
    before: str | None = None
    include: tuple[str, ...] = ()


def retrieve(
    store: ResponseStore,
    response_id: str,
    here: str | None,
    *,
    include: tuple[str, ...] = (),
    stream: bool = False,
    starting_after: int | None = None,
) -> bytes:
    """The response object as it completed."""
    if stream or starting_after is not None:
        raise OpenAIRequestError(
            "`stream`: a stored response's events are not kept; retrieve it as JSON",
            "stream" if stream else "starting_after",
        )
    _refuse_include(include, "the stored response is returned as it was made")
    return json_bytes(_stored(store, response_id, here).response)


def delete(store: ResponseStore, response_id: str, here: str | None) -> bytes:
    """Forget the response; OpenAI's deletion object."""
    _stored(store, response_id, here)
    store.delete(response_id)
    return json_bytes({"id": response_id, "object": "response", "deleted": True})


def input_items(
    store: ResponseStore, response_id: str, here: str | None, query: ItemsQuery
) -> bytes:
    """A page of the items the response was made from (the previous response's items
    and output first, when it continued one), as OpenAI's cursor-paged list."""
    limit = DEFAULT_LIMIT if query.limit is None else query.limit
    if not 1 <= limit <= MAX_LIMIT:
        raise OpenAIRequestError(f"`limit` must be between 1 and {MAX_LIMIT}", "limit")
    order = query.order or "desc"
    if order not in ORDERS:
        raise OpenAIRequestError('`order` must be "asc" or "desc"', "order")
    _refuse_include(query.include, "input items carry their text only")
    items = list(_stored(store, response_id, here).items)
    if order == "desc":
        items.reverse()
    start = _position(items, query.after, "after") + 1 if query.after else 0
    end = _position(items, query.before, "before") if query.before else len(items)
    window = items[start:end]
    # `before` alone pages backwards: the items just before the cursor
    page = window[-limit:] if query.before and not query.after else window[:limit]
    return json_bytes(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(window) > len(page),
        }
    )


def not_kept(store: ResponseStore, response_id: str, here: str | None) -> str:
    """Why `response_id` is not in this replica's store."""
    if not store.enabled:
        return (
            f"response {response_id!r} not found: responses are not kept on this server"
            " (--responses-store-mb 0)"
        )
    origin = replica_of(response_id)
    if origin is not None and here is not None and origin != here:
        return (
            f"response {response_id!r} not found: it was stored by replica {origin}, which the"
            f" proxy cannot reach now (stopped, restarted or out of its rotation), not by this"
            f" one ({here}); a replica keeps its responses in memory only"
        )
    return (
        f"response {response_id!r} not found: it was never stored (`store: false`), expired"
        f" (responses are kept {store.ttl:g} s), was evicted or deleted, or was lost in a"
        " restart"
    )


def _stored(store: ResponseStore, response_id: str, here: str | None) -> StoredResponse:
    stored = store.get(response_id)
    if stored is None:
        raise ResponseNotFound(not_kept(store, response_id, here))
    return stored


def _position(items: list[dict], item_id: str, param: str) -> int:
    for index, item in enumerate(items):
        if item["id"] == item_id:
            return index
    raise OpenAIRequestError(f"`{param}`: {item_id!r} is not an input item of this response", param)


def _refuse_include(include: tuple[str, ...], why: str) -> None:
    if include:
        raise OpenAIRequestError(f"`include`: {include[0]!r} is not supported ({why})", "include")
