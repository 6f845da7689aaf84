"""The contract as Envoy 1.40 loads it: the descriptor set generated from api/
(`textgen.binpb`, beside this file).

TRAP: Envoy rejects the whole descriptor set ("Setting response_body is not
supported yet for non-HttpBody fields") if one HttpRule has `response_body` on an
ordinary message. No rule of ours has one (POST /tokenize, TGI's bare array, is an
HttpBody RPC that writes the array itself); contract() refuses one at render time,
naming the method, rather than leave Envoy to refuse to start.
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
