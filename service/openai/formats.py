"""OpenAI's output formats as TGI grammars: chat's `response_format` and the Responses
API's `text.format` (the same three kinds, shaped differently), and a format as the
answer rule of a tool grammar (tools.ToolPlan.lark)."""

from __future__ import annotations

import json

from ..intake.request import Grammar
from ..intake.validation import grammar_spec
from .common import OpenAIRequestError
from .protocol import ResponseFormat
from .responses_protocol import TextFormat


def response_format(fmt: ResponseFormat | None) -> Grammar | None:
    """Chat's `response_format` ({"type": "text" | "json_object" | "json_schema",
    "json_schema": {"name", "schema", "strict"}}), or TGI's grammar in its place
    ({"type": "json" | "json_schema" | "regex", "value": ...}), as a TGI grammar."""
    if fmt is None or fmt.type == "text":
        return None
    given_value = "value" in fmt.model_fields_set  # a null value is TGI's too
    if fmt.type == "json_object":
        # TGI's router takes json_object as an alias of json, its schema in `value`;
        # LangChain's ChatHuggingFace.with_structured_output sends it in `schema`
        schema = fmt.value if given_value else fmt.schema_
        return _json({"type": "object"} if schema is None else schema)
    if fmt.type == "json_schema" and fmt.json_schema is not None:
        # strict or not, the output follows the schema: constrained decoding costs nothing extra
        return _json(fmt.json_schema.schema_)
    if given_value:  # TGI's shape
        return Grammar(type=fmt.type, value=fmt.value)
    raise OpenAIRequestError(
        '`response_format.type` must be "text", "json_object" or "json_schema"', "response_format"
    )


def text_format(fmt: TextFormat | None) -> Grammar | None:
    """The Responses API's `text.format`: {"type": "text"}, {"type": "json_object"} or
    {"type": "json_schema", "name", "schema", "strict", "description"} (flat, unlike
    chat's), as a TGI grammar."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _json({"type": "object"})
    return _json(fmt.schema_)  # strict or not, the output follows the schema


def _json(schema) -> Grammar:
    return Grammar(type="json", value=schema)  # plain JSON already, as parsed


def lark_answer(answer_format: Grammar | None, param: str) -> str | None:
    """A format as the answer rule of the tool grammar (None: free text); `param` is the
    field that asked for it."""
    if answer_format is None:
        return None
    kind, schema = grammar_spec(answer_format)
    if kind == "regex":
        raise OpenAIRequestError(f"with `tools`, `{param}` must be a JSON schema", param)
    return "%json " + json.dumps(schema, separators=(",", ":"))
