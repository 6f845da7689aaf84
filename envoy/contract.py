"""The contract as Envoy 1.40 loads it: the descriptor set generated from api/
(`textgen.binpb`, beside this file).

TRAP: Envoy rejects the whole descriptor set ("Setting response_body is not
supported yet for non-HttpBody fields") if one HttpRule has `response_body` on an
ordinary message. No rule of ours has one (POST /tokenize, TGI's bare array, is an
HttpBody RPC that writes the array itself); contract() refuses one at render time,
naming the method, rather than leave Envoy to refuse to start.

The transcoder also drops, silently, a JSON field its message lacks (Envoy 1.40 has no
option to refuse one). `tgi_body_fields()` reads from the same descriptor set the field
names a TGI body (POST /generate, /generate_stream, /) may hold, in both spellings the
transcoder accepts, for the Lua filter to refuse the others (lua.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from google.api import annotations_pb2
from google.protobuf import descriptor_pb2

DESCRIPTOR = Path(__file__).with_name("textgen.binpb")


@dataclass(frozen=True)
class Contract:
    """The descriptor set as Envoy loads it."""

    descriptor_set: bytes


def contract(descriptor: Path | str = DESCRIPTOR) -> Contract:
    """Read the descriptor set; refuse the `response_body` rules Envoy 1.40 rejects."""
    data = Path(descriptor).read_bytes()
    files = descriptor_pb2.FileDescriptorSet.FromString(data)
    for file in files.file:
        for service in file.service:
            for method in service.method:
                rule = method.options.Extensions[annotations_pb2.http]
                if rule.response_body and method.output_type != ".google.api.HttpBody":
                    raise ValueError(
                        f"{service.name}.{method.name}: Envoy 1.40 rejects `response_body`"
                        " on a non-HttpBody response; return google.api.HttpBody instead"
                    )
    return Contract(data)


# The TGI body's objects whose keys are checked, below the body itself: `parameters` and
# its `grammar` (whose `value`, a JSON schema, is anyone's).
TGI_BODY_PATH = ("parameters", "grammar")
# Top-level fields of a TGI body that the contract lacks, accepted and ignored.
# `stream`: TGI's compat route's (`POST /`: the Lua filter reads it to pick the route);
# text_generation's Client (Request.stream) and huggingface_hub's
# InferenceClient.text_generation send it there, and TGI's /generate and /generate_stream
# ignore it, as these do.
TGI_COMPAT_FIELDS = ("stream",)
TGI_HTTP_PATHS = ("/generate", "/generate_stream")


@dataclass(frozen=True)
class BodyFields:
    """The field names of one JSON object of a TGI body."""

    names: tuple[str, ...]  # the proto's field names (snake_case) and the extras, sorted
    json_names: tuple[str, ...]  # their JSON names (lowerCamelCase) where they differ

    @property
    def accepted(self) -> frozenset[str]:
        return frozenset(self.names + self.json_names)


def tgi_body_fields(api: Contract) -> tuple[BodyFields, ...]:
    """The names a TGI body may hold: the body's (GenerateRequest, plus TGI_COMPAT_FIELDS),
    then those of each object of TGI_BODY_PATH, from the messages the HttpRules of
    TGI_HTTP_PATHS take (both must take the same)."""
    files = descriptor_pb2.FileDescriptorSet.FromString(api.descriptor_set)
    messages = {
        f".{file.package}.{message.name}" if file.package else f".{message.name}": message
        for file in files.file
        for message in file.message_type
    }
    inputs = {
        rule.post: method.input_type
        for file in files.file
        for service in file.service
        for method in service.method
        if (rule := method.options.Extensions[annotations_pb2.http]).post in TGI_HTTP_PATHS
    }
    if sorted(inputs) != sorted(TGI_HTTP_PATHS) or len(set(inputs.values())) != 1:
        raise ValueError(f"{' and '.join(TGI_HTTP_PATHS)} must take one message: {inputs}")
    message = messages[next(iter(inputs.values()))]
    out = []
    for level in range(len(TGI_BODY_PATH) + 1):
        extras = TGI_COMPAT_FIELDS if level == 0 else ()
        out.append(
            BodyFields(
                names=tuple(sorted([f.name for f in message.field] + list(extras))),
                json_names=tuple(
                    sorted(f.json_name for f in message.field if f.json_name not in ("", f.name))
                ),
            )
        )
        if level < len(TGI_BODY_PATH):
            name = TGI_BODY_PATH[level]
            field = next((f for f in message.field if f.name == name), None)
            if field is None or field.type_name not in messages:
                raise ValueError(f"{message.name} has no message field `{name}`")
            message = messages[field.type_name]
    return tuple(out)
