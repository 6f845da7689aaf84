"""TGI's request validation: a GenerateRequest becomes a tokenized EngineRequest or
a ValidationError carrying TGI's message. The order of the checks is TGI's, so the
first error reported is the one TGI would report.
"""

from __future__ import annotations

import json
import math
import random
import time
import uuid
from dataclasses import dataclass

from google.protobuf import json_format

from .engine.grammar import GrammarCompiler, GrammarError
from .engine.types import EngineRequest, SamplingParams, StoppingParams

# Below these, logits / temperature (or / penalty) overflow float32 to inf: the
# distribution is no longer a distribution.
MIN_TEMPERATURE = 1e-4
MIN_REPETITION_PENALTY = 1e-4
_FLOAT_FIELDS = (
    "temperature", "repetition_penalty", "frequency_penalty", "presence_penalty",
    "top_p", "typical_p", "max_time",
)  # fmt: skip

# Random seeds stay below 2^53 so the JSON face (a double) prints them exactly.
_MAX_RANDOM_SEED = 2**53 - 1


class ValidationError(Exception):
    error_type = "validation"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class Limits:
    max_input_tokens: int
    max_total_tokens: int
    max_best_of: int
    max_stop_sequences: int
    max_top_n_tokens: int
    vocab_size: int
    max_stop_sequence_length: int = 256


@dataclass(frozen=True)
class ValidRequest:
    """What the servicer needs besides the engine request."""

    engine_request: EngineRequest
    inputs: str
    best_of: int
    details: bool
    decoder_input_details: bool
    return_full_text: bool
    validation_time: float  # seconds


def _opt(params, name: str):
    """A proto3 `optional` field's value, or None when unset."""
    return getattr(params, name) if params.HasField(name) else None


class Validator:
    def __init__(self, tokenizer, limits: Limits, grammars: GrammarCompiler | None = None) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.grammars = grammars  # None: requests with a grammar are refused

    def validate(
        self, request, *, stream: bool, arrival_time: float | None = None, lark: str | None = None
    ) -> ValidRequest:
        """request: a textgen.v1 GenerateRequest (protobuf). lark: an output grammar in
        llguidance's Lark dialect, from the OpenAI layer (tool calls), in place of
        request.parameters.grammar."""
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        p = request.parameters
        best_of = self._best_of(p, stream)
        sampling = self._sampling(p, best_of)
        if _opt(p, "max_new_tokens") is not None and p.max_new_tokens <= 0:
            raise ValidationError("`max_new_tokens` must be strictly positive")
        stops = tuple(p.stop)
        if len(stops) > self.limits.max_stop_sequences:
            raise ValidationError(
                f"`stop` supports up to {self.limits.max_stop_sequences} stop sequences. Given: {len(stops)}"
            )
        if any(s == "" for s in stops):
            raise ValidationError("`stop` sequences must not be empty")
        longest = max((len(s) for s in stops), default=0)
        if longest > self.limits.max_stop_sequence_length:
            raise ValidationError(
                f"`stop` sequences must be at most {self.limits.max_stop_sequence_length} characters. Given: {longest}"
            )
        if stream and p.decoder_input_details:
            raise ValidationError(
                "`decoder_input_details` == true is not supported when streaming tokens"
            )
        max_time = _opt(p, "max_time")
        if max_time is not None and not max_time > 0:
            raise ValidationError("`max_time` must be strictly positive")
        if p.watermark:
            raise ValidationError("`watermark` is not supported")
        if _opt(p, "adapter_id"):
            raise ValidationError("`adapter_id`: LoRA adapters are not supported")
        if lark is not None:
            grammar = self._compiled("lark", lark)
        elif p.HasField("grammar"):
            grammar = self._compiled(*grammar_spec(p.grammar))
        else:
            grammar = None
        if not request.inputs:
            raise ValidationError("`inputs` cannot be empty")
        truncate = self._truncate(p)
        prompt_ids = self._tokenize(request.inputs, truncate)
        max_new_tokens = self._max_new_tokens(p, len(prompt_ids))
        engine_request = EngineRequest(
            request_id=uuid.uuid4().hex,
            prompt_ids=tuple(prompt_ids),
            sampling=sampling,
            stopping=StoppingParams(
                max_new_tokens=max_new_tokens,
                stop_sequences=stops,
                ignore_eos=p.ignore_eos,
                deadline=arrival + max_time if max_time is not None else None,
            ),
            decoder_input_details=p.decoder_input_details,
            arrival_time=arrival,
            grammar=grammar,
        )
        return ValidRequest(
            engine_request=engine_request,
            inputs=request.inputs,
            best_of=best_of,
            details=p.details or p.decoder_input_details,
            decoder_input_details=p.decoder_input_details,
            return_full_text=bool(_opt(p, "return_full_text")),
            validation_time=time.monotonic() - arrival,
        )

    # the parts, in TGI's order ----------------------------------------------------

    def _best_of(self, p, stream: bool) -> int:
        best_of = _opt(p, "best_of")
        if best_of is None:
            return 1
        if self.limits.max_best_of == 1 and best_of != 1:
            raise ValidationError("`best_of` != 1 is not allowed for this endpoint")
        if best_of <= 0 or best_of > self.limits.max_best_of:
            raise ValidationError(
                f"`best_of` must be > 0 and <= {self.limits.max_best_of}. Given: {best_of}"
            )
        if best_of > 1 and stream:
            raise ValidationError("`best_of` != 1 is not supported when streaming tokens")
        return best_of

    def _sampling(self, p, best_of: int) -> SamplingParams:
        for name in _FLOAT_FIELDS:
            value = _opt(p, name)
            if value is not None and not math.isfinite(value):
                raise ValidationError(f"`{name}` must be a finite number")
        temperature = _opt(p, "temperature")
        top_k = _opt(p, "top_k")
        top_p = _opt(p, "top_p")
        typical_p = _opt(p, "typical_p")
        sampling = p.do_sample or any(v is not None for v in (temperature, top_k, top_p, typical_p))
        if best_of > 1 and not sampling:
            raise ValidationError("you must use sampling when `best_of` is > 1")
        temperature = 1.0 if temperature is None else temperature
        if temperature <= 0.0:
            raise ValidationError("`temperature` must be strictly positive")
        if temperature < MIN_TEMPERATURE:
            raise ValidationError(f"`temperature` must be >= {MIN_TEMPERATURE} (use greedy decoding instead)")
        repetition_penalty = _default(_opt(p, "repetition_penalty"), 1.0)
        if repetition_penalty <= 0.0:
            raise ValidationError("`repetition_penalty` must be strictly positive")
        if not MIN_REPETITION_PENALTY <= repetition_penalty <= 1 / MIN_REPETITION_PENALTY:
            raise ValidationError(
                f"`repetition_penalty` must be >= {MIN_REPETITION_PENALTY} and <= {1 / MIN_REPETITION_PENALTY:g}"
            )
        frequency_penalty = _default(_opt(p, "frequency_penalty"), 0.0)
        if not -2.0 <= frequency_penalty <= 2.0:
            raise ValidationError("`frequency_penalty` must be >= -2.0 and <= 2.0")
        presence_penalty = _default(_opt(p, "presence_penalty"), 0.0)
        if not -2.0 <= presence_penalty <= 2.0:
            raise ValidationError("`presence_penalty` must be >= -2.0 and <= 2.0")
        if top_p is not None and not 0.0 < top_p < 1.0:
            raise ValidationError("`top_p` must be > 0.0 and < 1.0")
        if typical_p is not None and not 0.0 < typical_p < 1.0:
            raise ValidationError("`typical_p` must be > 0.0 and < 1.0")
        if top_k is not None and top_k <= 0:
            raise ValidationError("`top_k` must be strictly positive")
        seed = _opt(p, "seed")
        if seed is not None and best_of > 1:
            raise ValidationError("`seed` must not be set when `best_of` > 1")
        top_n_tokens = _default(_opt(p, "top_n_tokens"), 0)
        if not 0 <= top_n_tokens <= self.limits.max_top_n_tokens:
            raise ValidationError(
                f"`top_n_tokens` must be >= 0 and <= {self.limits.max_top_n_tokens}. Given: {top_n_tokens}"
            )
        return SamplingParams(
            # TGI samples as soon as any sampling parameter is given
            do_sample=sampling,
            temperature=temperature,
            top_k=top_k or 0,
            top_p=1.0 if top_p is None else top_p,
            typical_p=1.0 if typical_p is None else typical_p,
            repetition_penalty=repetition_penalty,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            logit_bias=self._logit_bias(p),
            seed=random.randint(0, _MAX_RANDOM_SEED) if seed is None else seed,
            top_n_tokens=top_n_tokens,
        )

    def _logit_bias(self, p) -> tuple[tuple[int, float], ...]:
        for token_id, bias in p.logit_bias.items():
            if not math.isfinite(bias):
                raise ValidationError("`logit_bias` values must be finite numbers")
            if token_id >= self.limits.vocab_size:
                raise ValidationError(
                    f"`logit_bias` token id {token_id} is outside the vocabulary (size {self.limits.vocab_size})"
                )
            if not -100.0 <= bias <= 100.0:
                raise ValidationError("`logit_bias` values must be >= -100 and <= 100")
        return tuple(sorted(p.logit_bias.items()))

    def _compiled(self, kind: str, source) -> str:
        """A grammar ("json" schema, "regex" or llguidance "lark") compiled; one the
        compiler can't use is a validation error."""
        if self.grammars is None:
            raise ValidationError("grammar is not supported")
        compile_ = {"json": self.grammars.json_schema, "regex": self.grammars.regex, "lark": self.grammars.lark}
        try:
            return compile_[kind](source)
        except GrammarError as exc:
            raise ValidationError(f"grammar is not valid: {exc}") from exc

    def _truncate(self, p) -> int | None:
        truncate = _opt(p, "truncate")
        if truncate is not None and not 0 < truncate <= self.limits.max_input_tokens:
            raise ValidationError(
                f"`truncate` must be strictly positive and less than {self.limits.max_input_tokens}. Given: {truncate}"
            )
        return truncate

    def _tokenize(self, inputs: str, truncate: int | None) -> list[int]:
        try:
            ids = self.tokenizer(inputs, add_special_tokens=True)["input_ids"]
        except Exception as exc:
            raise ValidationError(f"tokenizer error {exc}") from exc
        if truncate is not None:
            ids = ids[-truncate:]
        if not ids:
            raise ValidationError("`inputs` cannot be empty")
        return ids

    def _max_new_tokens(self, p, input_length: int) -> int:
        requested = _opt(p, "max_new_tokens")
        max_new = requested if requested is not None else max(self.limits.max_total_tokens - input_length, 0)
        if input_length + max_new > self.limits.max_total_tokens:
            raise ValidationError(
                f"`inputs` tokens + `max_new_tokens` must be <= {self.limits.max_total_tokens}. "
                f"Given: {input_length} `inputs` tokens and {max_new} `max_new_tokens`"
            )
        if input_length > self.limits.max_input_tokens:
            raise ValidationError(
                f"`inputs` must have less than {self.limits.max_input_tokens} tokens. Given: {input_length}"
            )
        if max_new == 0:
            raise ValidationError("`max_new_tokens` must be strictly positive")
        return max_new


def grammar_spec(grammar) -> tuple[str, object]:
    """TGI's grammar ({"type": "json" | "json_schema" | "regex", "value": ...}, a
    textgen.v1 Grammar) -> ("json", schema) or ("regex", pattern); malformed ones are
    validation errors."""
    kind = grammar.type
    value = json_value(grammar.value) if grammar.HasField("value") else None
    if kind == "regex":
        if not isinstance(value, str):
            raise ValidationError("grammar is not valid: a `regex` grammar's value must be a string")
        return "regex", value
    if kind == "json":
        return "json", _schema_value(value)
    if kind == "json_schema":
        if not isinstance(value, dict) or "schema" not in value:
            raise ValidationError('grammar is not valid: a `json_schema` grammar\'s value must be {"schema": ...}')
        return "json", _schema_value(value["schema"])
    raise ValidationError(f"grammar is not valid: unknown type {kind!r} (json, json_schema or regex)")


def json_value(value) -> object:
    """A google.protobuf.Value as plain JSON. Value keeps every number as a double, so
    integral ones become ints again: `"maxLength": 24` must not reach a schema as 24.0."""
    return _integral(json_format.MessageToDict(value))


def _integral(value):
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


def _schema_value(value):
    """A JSON schema given as an object, a boolean, or a string holding one (as TGI allows)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValidationError(f"grammar is not valid: the schema is not JSON: {exc}") from exc
    if not isinstance(value, (dict, bool)):
        raise ValidationError("grammar is not valid: a JSON schema must be an object")
    return value


def _default(value, default):
    return default if value is None else value
