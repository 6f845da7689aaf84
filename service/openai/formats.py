"""OpenAI's output formats as TGI grammars: chat's `response_format` and the Responses
API's `text.format` (the same three kinds, shaped differently), and a format as the
answer rule of a tool grammar (tools.ToolPlan.lark)."""

from __future__ import annotations

import json

from ..request import Grammar
from ..validation import grammar_spec
from .common import OpenAIRequestError


def response_format(data: dict) -> Grammar | None:
    """Chat's `response_format` ({"type": "text" | "json_object" | "json_schema",
    "json_schema": {"name", "schema", "strict"}}), or TGI's grammar in its place
    ({"type": "json" | "json_schema" | "regex", "value": ...}), as a TGI grammar."""
    fmt = data.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise OpenAIRequestError("`response_format` must be an object", "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        # TGI's router takes json_object as an alias of json, its schema in `value`;
        # LangChain's ChatHuggingFace.with_structured_output sends it in `schema`
        schema = fmt.get("value", fmt.get("schema"))
        return _json({"type": "object"} if schema is None else schema)
    if kind == "json_schema" and "json_schema" in fmt:
        spec = fmt["json_schema"]
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise OpenAIRequestError(
                "`response_format.json_schema` must have a `name`", "response_format"
            )
        # strict or not, the output follows the schema: constrained decoding costs nothing extra
        return _json(spec.get("schema", {}))
    if kind in ("json", "json_schema", "regex") and "value" in fmt:  # TGI's shape
        return Grammar(type=kind, value=fmt["value"])
    raise OpenAIRequestError(
        '`response_format.type` must be "text", "json_object" or "json_schema"', "response_format"
    )


def text_format(fmt) -> Grammar | None:
    """The Responses API's `text.format`: {"type": "text"}, {"type": "json_object"} or
    {"type": "json_schema", "name", "schema", "strict", "description"} (flat, unlike
    chat's), as a TGI grammar; the error's param is `text`."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _json({"type": "object"})
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str):
            raise OpenAIRequestError("`text.format` of type json_schema needs a `name`", "text")
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise OpenAIRequestError("`text.format.schema` must be a JSON schema object", "text")
        return _json(schema)  # strict or not, the output follows the schema
    raise OpenAIRequestError(
        '`text.format.type` must be "text", "json_object" or "json_schema"', "text"
    )


def _json(schema) -> Grammar:
    return Grammar(type="json", value=schema)  # plain JSON already: it came out of json.loads


def lark_answer(answer_format: Grammar | None, param: str) -> str | None:
    """A format as the answer rule of the tool grammar (None: free text); `param` is the
    field that asked for it."""
    if answer_format is None:
        return None
    kind, schema = grammar_spec(answer_format)
    if kind == "regex":
        raise OpenAIRequestError(f"with `tools`, `{param}` must be a JSON schema", param)
    return "%json " + json.dumps(schema, separators=(",", ":"))
