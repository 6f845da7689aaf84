"""The contract as Envoy 1.40 loads it: the descriptor set generated from api/
(`textgen.binpb`, beside this file), less what the transcoder refuses.

TRAP: Envoy rejects the whole descriptor set ("Setting response_body is not
supported yet for non-HttpBody fields") if one HttpRule has `response_body` on an
ordinary message, as Tokenize's does (`response_body: "tokens"`, TGI's bare array).
The rule is stripped here and the Lua filter cuts the answer down to the field, so
the annotation in api/ stays the truth about the HTTP shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from google.api import annotations_pb2
from google.protobuf import descriptor_pb2

DESCRIPTOR = Path(__file__).with_name("textgen.binpb")


@dataclass(frozen=True)
class Contract:
    """The descriptor set as Envoy loads it, and what the Lua filter does in its stead."""

    descriptor_set: bytes
    # HTTP path -> the one field of the response message that is the whole answer
    # (the HttpRule's response_body), e.g. {"/tokenize": "tokens"}
    unwrap: dict[str, str]


def contract(descriptor: Path | str = DESCRIPTOR) -> Contract:
    """Read the descriptor set; strip the `response_body` rules Envoy 1.40 rejects.

    Only a response message with that single field can be unwrapped by the Lua
    filter (it cuts `{"field":` and `}` off the transcoded JSON).
    """
    files = descriptor_pb2.FileDescriptorSet.FromString(Path(descriptor).read_bytes())
    messages = {f".{f.package}.{m.name}": m for f in files.file for m in f.message_type}
    unwrap: dict[str, str] = {}
    for file in files.file:
        for service in file.service:
            for method in service.method:
                rule = method.options.Extensions[annotations_pb2.http]
                if not rule.response_body or method.output_type == ".google.api.HttpBody":
                    continue
                path = getattr(rule, rule.WhichOneof("pattern"))
                fields = [f.name for f in messages[method.output_type].field]
                if fields != [rule.response_body]:
                    raise ValueError(
                        f"{service.name}.{method.name}: response_body {rule.response_body!r} "
                        f"needs a response message with only that field, has {fields}"
                    )
                unwrap[path] = rule.response_body
                rule.response_body = ""
    return Contract(files.SerializeToString(), unwrap)
