"""The one request type every face builds: TGI's generation request as plain data.

Each face builds it in exactly one place (grpc/convert.py from protobuf for TGI's RPCs,
openai/ from OpenAI's JSON) and the validator (validation.py) takes it; nothing below
the faces knows protobuf or JSON. `None` means unset: the validator applies TGI's
defaults. `names` says how the face calls each field, so that an error names the field
the client actually sent (`max_tokens`, not `max_new_tokens`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class Grammar:
    """TGI's grammar: `type` "json" (value: a JSON schema), "json_schema" (value:
    {"schema": ...}) or "regex" (value: the pattern); value is plain JSON."""

    type: str
    value: object = None


@dataclass(frozen=True, slots=True)
class GenerateParameters:
    """TGI's parameters (and textgen's additions); None: unset."""

    best_of: int | None = None
    decoder_input_details: bool = False
    details: bool = False
    do_sample: bool = False
    frequency_penalty: float | None = None
    grammar: Grammar | None = None
    max_new_tokens: int | None = None
    repetition_penalty: float | None = None
    return_full_text: bool | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    temperature: float | None = None
    top_k: int | None = None
    top_n_tokens: int | None = None
    top_p: float | None = None
    truncate: int | None = None
    typical_p: float | None = None
    watermark: bool = False
    presence_penalty: float | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    ignore_eos: bool = False
    max_time: float | None = None
    adapter_id: str | None = None  # TGI's: a served LoRA adapter's name, or the base model's
    # OpenAI's `model` as sent: the base model (its id, "tgi", or any name when no adapter
    # is served) or a served adapter's name (validation.py decides)
    model: str | None = None
    priority: int | None = None  # lower is served sooner; None: the face's default (0)
    # choices sampled from the one prompt (OpenAI's `n`, or its `best_of` when larger);
    # None: best_of's (TGI's), else 1
    n: int | None = None


# TGI's own names: the identity.
TGI_NAMES: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    inputs: str
    parameters: GenerateParameters = field(default_factory=GenerateParameters)
    # An llguidance Lark grammar the face built (OpenAI's tool calls); it replaces
    # parameters.grammar. Never taken from a client.
    lark: str | None = None
    # The face's name of a field, where it differs from TGI's (for error messages).
    names: Mapping[str, str] = field(default_factory=lambda: TGI_NAMES)
    # The face's own bound on top_n_tokens (OpenAI's top_logprobs: 20); None: the
    # server's --max-top-n-tokens (TGI's).
    max_top_n_tokens: int | None = None
    # the prompt's images in order (intake/images.py ImagePart: decoded, named as the face
    # calls the part); the prompt holds one placeholder per image
    images: tuple = ()
    # TGI's: a vision-language model reads the prompt's markdown images, ![](data:...), as
    # images (a text model, as text)
    markdown_images: bool = False

    def name(self, field_name: str) -> str:
        """How the client calls `field_name` (a GenerateParameters field or "inputs")."""
        return self.names.get(field_name, field_name)
