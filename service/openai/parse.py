"""Bodies parsed with their protocol.py model, and pydantic's errors as OpenAI's: one
OpenAIRequestError naming the field as the client wrote it (`messages[0].content`),
with the top-level field as OpenAI's `param`.

Which error, when a body has several: a field the body may not have first (as it is
refused whatever its value), else the first field in error, at its most precise place
(a union's alternatives that failed at the top are left out)."""

from __future__ import annotations

import json
from typing import TypeVar

import pydantic
from pydantic import BaseModel, TypeAdapter

from .common import OpenAIRequestError

Model = TypeVar("Model", bound=BaseModel)


def parse_body(model: type[Model], body: bytes) -> Model:
    """The body (JSON bytes) as `model`, or OpenAIRequestError."""
    try:
        return model.model_validate_json(body or b"null")
    except pydantic.ValidationError as exc:
        raise refusal(exc, model, lambda: _decoded(body)) from None


def _decoded(body: bytes):
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # then the paths are left as pydantic's
        return None


def parse_value(model: type[Model], value) -> Model:
    """A JSON value already decoded (a dict) as `model`, or OpenAIRequestError."""
    try:
        return model.model_validate(value, strict=True)
    except pydantic.ValidationError as exc:
        raise refusal(exc, model, lambda: value) from None


def parse_field(adapter: TypeAdapter, value, where: str):
    """A decoded value of field `where` (e.g. a body's `input`), with its type's adapter."""
    try:
        return adapter.validate_python(value, strict=True)
    except pydantic.ValidationError as exc:
        raise refusal(exc, None, lambda: {where: value}, where) from None


def refusal(exc: pydantic.ValidationError, model, decoded, where: str | None = None):
    """`exc` as OpenAIRequestError. `decoded()` gives the JSON value that failed, to tell
    the client's fields and indexes from the union tags pydantic adds to a location;
    `where`, the field it was (parse_field)."""
    errors = exc.errors(include_url=False)
    root = errors[0]
    if root["type"] == "json_invalid":
        return OpenAIRequestError(f"the body is not valid JSON: {root['ctx']['error']}")
    if where is None and not root["loc"] and root["type"] == "model_type":
        return OpenAIRequestError("the body must be a JSON object")
    data = decoded()
    located = [(_path(e, data, where), e) for e in errors]
    unknown = [(path, e) for path, e in located if e["type"] == "none_required"]
    path, chosen = _most_precise(unknown or located)
    phrases = [_phrase(e, model, path) for p, e in located if p == path and e is not chosen]
    message = _join([_phrase(chosen, model, path), *phrases])
    name = _name(path)
    separator = "" if message.startswith(":") else " "
    return OpenAIRequestError(f"`{name}`{separator}{message}" if name else message, _param(path))


def _path(error: dict, data, where: str | None) -> list:
    """The error's location as the client's fields and indexes: pydantic adds a union's
    tag ('str', 'list[...]', a discriminator's value) and '[key]' to locations, which
    the decoded body doesn't have."""
    loc = (where, *error["loc"]) if where is not None else error["loc"]
    path, node = [], data
    for i, part in enumerate(loc):
        if _holds(node, part):
            path.append(part)
            node = node[part]
        elif error["type"] == "missing" and i == len(loc) - 1:
            path.append(part)
    return path


def _holds(node, part) -> bool:
    if isinstance(node, dict):
        return isinstance(part, str) and part in node
    return isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)


def _most_precise(located: list[tuple[list, dict]]) -> tuple[list, dict]:
    """The first error of the first field in error, at its most precise: an error at a
    place holding another one (a union's alternative that failed at the top) is left out."""
    field = located[0][0][:1]
    same_field = [(p, e) for p, e in located if p[:1] == field]
    return next(
        (p, e)
        for p, e in same_field
        if not any(len(q) > len(p) and q[: len(p)] == p for q, _ in same_field)
    )


def _name(path: list) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _param(path: list) -> str | None:
    return str(path[0]) if path else None


_PHRASES = {
    "missing": "is required",
    "none_required": "is not supported",  # an undeclared field (OpenAIBody)
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    "bool_type": "must be a boolean",
    "string_type": "must be a string",
    "list_type": "must be an array",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
}
_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def _phrase(error: dict, model, path: list) -> str:
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind in _PHRASES:
        return _PHRASES[kind]
    if kind == "says":  # protocol.Says
        return error["msg"]
    if kind == "literal_error":
        return f"must be {ctx['expected']}. Given: {error['input']!r}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return f"must be {_bounds(model, path, ctx)}. Given: {error['input']!r}"
    if kind == "too_short":
        return "must not be empty" if ctx.get("min_length") == 1 else error["msg"].lower()
    if kind == "string_pattern_mismatch":
        return f"must match {ctx['pattern']}"
    if kind == "union_tag_invalid":
        return f": type {ctx['tag']!r} is not supported (only {ctx['expected_tags']})"
    if kind == "union_tag_not_found":
        return ": `type` is required" if isinstance(error["input"], dict) else "must be an object"
    return ": " + error["msg"][:1].lower() + error["msg"][1:]


def _bounds(model, path: list, ctx: dict) -> str:
    """All of a top-level field's bounds ("> 0 and <= 1"), else the one it broke."""
    field = model.model_fields.get(path[0]) if model is not None and len(path) == 1 else None
    limits = {}
    for constraint in field.metadata if field is not None else ():
        for key, _ in _BOUNDS:
            if getattr(constraint, key, None) is not None:
                limits[key] = getattr(constraint, key)
    limits = limits or ctx
    return " and ".join(f"{op} {limits[key]}" for key, op in _BOUNDS if key in limits)


def _join(phrases: list[str]) -> str:
    """The alternatives at one place ("must be a string", "must be an array") as one."""
    if len(phrases) > 1 and all(p.startswith("must be ") for p in phrases):
        return "must be " + " or ".join(dict.fromkeys(p.removeprefix("must be ") for p in phrases))
    return phrases[0]
