"""The bounds envoy/openapi.json states for TGI's GenerateParameters are the ones
validation enforces (scripts/make_openapi.py takes them from validation's constants and
the server's default limits): each field is accepted at the edge of its stated range and
refused, naming the field, just past it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from support.tiny_model import build_tokenizer
from textgen.service.intake.grammar_compiler import GrammarCompiler
from textgen.service.intake.request import GenerateParameters, GenerateRequest
from textgen.service.intake.validation import ValidationError, Validator
from textgen.service.settings.table import Settings

from .limits import LIMITS

pytestmark = pytest.mark.timeout(30)

SCHEMA = json.loads((Path(__file__).parents[2] / "envoy" / "openapi.json").read_text())
PARAMETERS = SCHEMA["components"]["schemas"]["GenerateParameters"]["properties"]
# seed's range is its wire type's (uint64): nothing else can arrive
WIRE_BOUNDS = {"seed"}
DEFAULTS = Settings()


@pytest.fixture(scope="module")
def validator() -> Validator:
    tokenizer = build_tokenizer()
    limits = replace(  # the server's default limits, which the document states
        LIMITS,
        max_top_n_tokens=DEFAULTS.max_top_n_tokens,
        max_stop_sequences=DEFAULTS.max_stop_sequences,
        max_stop_sequence_length=DEFAULTS.max_stop_sequence_length,
    )
    eos = frozenset({tokenizer.eos_token_id})
    return Validator(tokenizer, limits, GrammarCompiler(tokenizer, limits.vocab_size, eos))


def edges(schema: dict) -> list[tuple[object, bool]]:
    """(value, inside the stated range) at each stated bound of a numeric schema."""
    integer = "integer" in schema.get("type", ())
    step = 1 if integer else 1e-3
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    high = schema.get("maximum", schema.get("exclusiveMaximum"))
    # strictly inside an exclusive bound: the middle of the range, else a step (or 1) in
    middle = (low + high) / 2 if low is not None and high is not None else None
    out = []
    if "minimum" in schema:
        out += [(low, True), (low - step, False)]
    if "exclusiveMinimum" in schema:
        out += [(middle if middle is not None else low + 1, True), (low, False)]
    if "maximum" in schema:
        out += [(high, True), (high + step, False)]
    if "exclusiveMaximum" in schema:
        out += [(middle if middle is not None else high - 1, True), (high, False)]
    return out


def cases():
    for name, schema in PARAMETERS.items():
        if name in WIRE_BOUNDS:
            continue
        for value, inside in edges(schema):
            yield pytest.param(name, value, inside, id=f"{name}={value}")
    bias = PARAMETERS["logit_bias"]["additionalProperties"]
    for value, inside in edges(bias):
        yield pytest.param("logit_bias", {0: value}, inside, id=f"logit_bias=0:{value}")
    stop = PARAMETERS["stop"]
    longest, most = stop["items"]["maxLength"], stop["maxItems"]
    for value, inside in [
        (("x" * longest,), True),
        (("x" * (longest + 1),), False),
        (("",), stop["items"]["minLength"] == 0),
        (("a",) * most, True),
        (("a",) * (most + 1), False),
    ]:
        yield pytest.param("stop", value, inside, id=f"stop={len(value)}x{len(value[0])}")


def test_every_bounded_field_is_covered() -> None:
    covered = {case.values[0] for case in cases()}
    bounded = {
        name
        for name, schema in PARAMETERS.items()
        if {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} & set(schema)
    }
    assert bounded - WIRE_BOUNDS <= covered
    assert {"frequency_penalty", "top_p", "typical_p", "priority", "top_n_tokens"} <= covered


@pytest.mark.parametrize(("name", "value", "inside"), list(cases()))
def test_stated_bounds_are_validations(validator, name, value, inside) -> None:
    sampled = {"do_sample": True} if name == "best_of" else {}
    request = GenerateRequest("The quick brown fox", GenerateParameters(**sampled, **{name: value}))
    if inside:
        validator.validate(request, stream=False)
    else:
        with pytest.raises(ValidationError) as refused:
            validator.validate(request, stream=False)
        assert refused.value.param == name, refused.value.message
