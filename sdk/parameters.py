"""Generation keyword arguments (TGI's Python client names) to the request message.

`GenerateOptions` types the keywords that `Client.generate` and friends accept: one
per field of the proto's `GenerateParameters`, under its name
(tests/sdk/test_generation_keywords.py holds them to it). `generate_parameters` turns
them into a `GenerateParameters` message. Optional fields the caller leaves at None
stay unset on the wire, so the server applies its own defaults, while an explicit 0 or
False is sent as set (proto3 presence).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from ._generated.google.protobuf import Value
from ._generated.textgen.v1 import GenerateParameters, GenerateRequest, Grammar
from .images import ImageLike, image_inputs

__all__ = ["GenerateOptions", "build_generate_request", "generate_parameters"]


class GenerateOptions(TypedDict, total=False):
    """Keyword arguments of generation; see `generate_parameters` for their defaults."""

    max_new_tokens: int | None
    do_sample: bool
    temperature: float | None
    top_k: int | None
    top_p: float | None
    typical_p: float | None
    repetition_penalty: float | None
    frequency_penalty: float | None
    presence_penalty: float | None
    stop: Sequence[str] | None
    seed: int | None
    truncate: int | None
    return_full_text: bool | None
    best_of: int | None
    details: bool
    decoder_input_details: bool
    top_n_tokens: int | None
    logit_bias: Mapping[int, float] | None
    grammar: Grammar | Mapping[str, Any] | None
    ignore_eos: bool
    max_time: float | None
    adapter_id: str | None
    watermark: bool
    priority: int | None


def generate_parameters(
    *,
    max_new_tokens: int | None = None,
    do_sample: bool = False,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    typical_p: float | None = None,
    repetition_penalty: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    stop: Sequence[str] | None = None,
    seed: int | None = None,
    truncate: int | None = None,
    return_full_text: bool | None = None,
    best_of: int | None = None,
    details: bool = True,
    decoder_input_details: bool = False,
    top_n_tokens: int | None = None,
    logit_bias: Mapping[int, float] | None = None,
    grammar: Grammar | Mapping[str, Any] | None = None,
    ignore_eos: bool = False,
    max_time: float | None = None,
    adapter_id: str | None = None,
    watermark: bool = False,
    priority: int | None = None,
) -> GenerateParameters:
    """The `GenerateParameters` message for TGI-style keyword arguments.

    `details` defaults to True, as TGI's client always asks for them. `stop` is a
    list of strings (a lone string counts as one stop sequence). `grammar` is a
    `Grammar` or TGI's dict, e.g. `{"type": "json", "value": {...schema...}}`.
    `adapter_id` names a LoRA adapter the server serves (None: the base model).
    `watermark` marks the output with the server's green-list watermark. `priority`
    schedules the request (lower is served sooner; None: the `x-textgen-priority`
    header's, else 0).
    """
    return GenerateParameters(
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        typical_p=typical_p,
        repetition_penalty=repetition_penalty,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        stop=_stop_sequences(stop),
        seed=seed,
        truncate=truncate,
        return_full_text=return_full_text,
        best_of=best_of,
        details=details,
        decoder_input_details=decoder_input_details,
        top_n_tokens=top_n_tokens,
        logit_bias=dict(logit_bias or {}),
        grammar=_grammar(grammar),
        ignore_eos=ignore_eos,
        max_time=max_time,
        adapter_id=adapter_id,
        watermark=watermark,
        priority=priority,
    )


def build_generate_request(
    prompt: str, options: GenerateOptions, images: Sequence[ImageLike] | None = None
) -> GenerateRequest:
    """The request for `prompt` and its `images` (images.py); unknown keywords raise
    TypeError like a bad call would."""
    return GenerateRequest(
        inputs=prompt, parameters=generate_parameters(**options), images=image_inputs(images)
    )


def _stop_sequences(stop: Sequence[str] | str | None) -> list[str]:
    # A bare string would otherwise be split into one stop sequence per character.
    if isinstance(stop, str):
        return [stop]
    return list(stop or [])


def _grammar(grammar: Grammar | Mapping[str, Any] | None) -> Grammar | None:
    if grammar is None or isinstance(grammar, Grammar):
        return grammar
    return Grammar(type=grammar["type"], value=Value.from_dict(grammar["value"]))
