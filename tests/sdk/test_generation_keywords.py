"""The SDK's generation keywords are the proto's GenerateParameters: one keyword per
field, under the field's name, each sent in the request when given. A field added to
api/textgen/v1/generate.proto without its keyword (sdk/parameters.py) fails here."""

from __future__ import annotations

import inspect

import pytest
from google.protobuf.descriptor import FieldDescriptor
from textgen.sdk import AsyncClient, Client, GenerateOptions, generate_parameters
from textgen.sdk.parameters import build_generate_request
from textgen.service.proto import generate_pb2

pytestmark = pytest.mark.timeout(30)

FIELDS = list(generate_pb2.GenerateParameters.DESCRIPTOR.fields)
SIGNATURE = inspect.signature(generate_parameters).parameters


def test_keywords_are_the_proto_fields() -> None:
    fields = {field.name for field in FIELDS}
    keywords = GenerateOptions.__required_keys__ | GenerateOptions.__optional_keys__
    assert set(keywords) == fields, "GenerateOptions and GenerateParameters' fields differ"
    assert set(SIGNATURE) == fields, "generate_parameters' keywords and the fields differ"
    assert all(p.kind is p.KEYWORD_ONLY for p in SIGNATURE.values())


@pytest.mark.parametrize(
    "method",
    [Client.generate, Client.generate_stream, AsyncClient.generate, AsyncClient.generate_stream],
)
def test_client_methods_take_the_keywords(method) -> None:
    (options,) = [
        p for p in inspect.signature(method).parameters.values() if p.kind is p.VAR_KEYWORD
    ]
    assert "GenerateOptions" in str(options.annotation)


def given_value(field: FieldDescriptor):
    """A value for the field's keyword that its default isn't."""
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        return {7: -1.5}
    if field.is_repeated:
        assert field.cpp_type == field.CPPTYPE_STRING, field.name
        return ["x"]
    if field.message_type is not None:
        assert field.message_type.name == "Grammar", field.name
        return {"type": "regex", "value": "a+"}
    by_type = {
        field.CPPTYPE_BOOL: not SIGNATURE[field.name].default,
        field.CPPTYPE_INT32: -3,
        field.CPPTYPE_UINT32: 3,
        field.CPPTYPE_INT64: -3,
        field.CPPTYPE_UINT64: 3,
        field.CPPTYPE_FLOAT: 0.5,
        field.CPPTYPE_DOUBLE: 0.5,
        field.CPPTYPE_STRING: "lora",
    }
    return by_type[field.cpp_type]


def on_the_wire(**options) -> generate_pb2.GenerateParameters:
    """The request's parameters as the server parses them."""
    request = generate_pb2.GenerateRequest.FromString(bytes(build_generate_request("hi", options)))
    return request.parameters


@pytest.mark.parametrize("field", FIELDS, ids=lambda field: field.name)
def test_each_keyword_is_sent(field: FieldDescriptor) -> None:
    value = given_value(field)
    sent, unset = on_the_wire(**{field.name: value}), on_the_wire()
    if field.has_presence:
        assert sent.HasField(field.name) and not unset.HasField(field.name)
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        assert dict(getattr(sent, field.name)) == value
    elif field.is_repeated:
        assert list(getattr(sent, field.name)) == value
    elif field.message_type is not None:
        assert sent.grammar.type == value["type"]
        assert sent.grammar.value.string_value == value["value"]
    else:
        assert getattr(sent, field.name) == value != getattr(unset, field.name)
