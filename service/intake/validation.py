"""TGI's request validation: a GenerateRequest (request.py, whatever face built it)
becomes a tokenized EngineRequest or a ValidationError carrying TGI's message, naming
the field as the client's face calls it. The order of the checks is TGI's, so the first
error reported is the one TGI would report. No protobuf, no torch here.
"""

from __future__ import annotations

import json
import math
import random
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..engine.adapters import AdapterRegistry
from ..engine.block_manager import num_blocks_for_choices
from ..engine.types import EngineRequest, SamplingParams, StoppingParams
from ..errors import ErrorType
from ..models.lora import LoraAdapter
from .grammar_compiler import GrammarCompiler, GrammarError
from .request import GenerateParameters, GenerateRequest, Grammar

if TYPE_CHECKING:
    from .images import ImageLimits, ImagePrompts

# The parameters' bounds, declared once: validation enforces them, and the faces' request
# schemas state them (service/openai/protocol.py; scripts/make_openapi.py for TGI's
# GenerateParameters in envoy/openapi.json).
# Below these, logits / temperature (or / penalty) overflow float32 to inf: the
# distribution is no longer a distribution.
MIN_TEMPERATURE = 1e-4
MIN_REPETITION_PENALTY = 1e-4
MAX_REPETITION_PENALTY = 10_000  # 1 / MIN_REPETITION_PENALTY
PENALTY_BOUND = 2  # frequency_penalty and presence_penalty lie in [-2, 2] (OpenAI's)
LOGIT_BIAS_BOUND = 100  # a logit_bias value lies in [-100, 100] (OpenAI's)
# top_p and typical_p, probability masses, lie strictly between these (TGI's)
MIN_MASS, MAX_MASS = 0.0, 1.0
_FLOAT_FIELDS = (
    "temperature", "repetition_penalty", "frequency_penalty", "presence_penalty",
    "top_p", "typical_p", "max_time",
)  # fmt: skip

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1  # priority's range

# TGI's messages for the ranges above ("must be >= -2.0 and <= 2.0", "must be > 0.0 and < 1.0")
_PENALTY_RANGE = f"must be >= {-float(PENALTY_BOUND)} and <= {float(PENALTY_BOUND)}"
_MASS_RANGE = f"must be > {MIN_MASS} and < {MAX_MASS}"

# Random seeds stay below 2^53 so the JSON face (a double) prints them exactly.
_MAX_RANDOM_SEED = 2**53 - 1


class ValidationError(Exception):
    """A refused request: TGI's message, and the refused field as the client named it
    (OpenAI's `param`), when one field is to blame."""

    error_type = ErrorType.VALIDATION

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class Limits:
    max_input_tokens: int
    max_total_tokens: int
    max_best_of: int
    max_stop_sequences: int
    max_top_n_tokens: int
    vocab_size: int
    max_stop_sequence_length: int = 256
    max_n: int = 1  # largest n (choices of one request, OpenAI's routes)
    # the KV pool, in blocks of kv_block_size tokens: a request whose choices can't all
    # be held at once is refused (None: not checked)
    kv_cache_blocks: int | None = None
    kv_block_size: int = 16
    # decoder_input_details (the prompt's logprobs) may be asked (--no-prefill-logprobs)
    prefill_logprobs: bool = True


@dataclass(frozen=True)
class ValidRequest:
    """What the servicer needs besides the engine request."""

    engine_request: EngineRequest
    inputs: str
    best_of: int  # TGI's best_of (engine_request.n is the choices sampled)
    details: bool
    decoder_input_details: bool
    return_full_text: bool
    validation_time: float  # seconds


# `model` values that name the base model whatever it is called (TGI's OpenAI routes: "tgi").
BASE_MODEL_ALIASES = frozenset({"", "tgi"})


class Validator:
    def __init__(
        self,
        tokenizer,
        limits: Limits,
        grammars: GrammarCompiler | None = None,
        adapters: AdapterRegistry | None = None,
        base_names: tuple[str, ...] = (),
        images: ImagePrompts | None = None,
        no_images: str | None = None,
        image_limits: ImageLimits | None = None,
    ) -> None:
        """adapters: the served LoRA adapters (None: none); base_names: what names the
        base model (its id first) in `adapter_id` and `model`; images: a vision-language
        model's processor (None: the model takes no images); no_images: why, for a model served
        as text that has a vision tower (Mllama; None: a text-only model); image_limits: what
        its images may be (None: the defaults)."""
        from .images import ImageLimits

        self.tokenizer = tokenizer
        self.images = images
        self.no_images = no_images or "this model is text-only; it takes no images"
        # None where the model takes no images: the faces refuse them before reading any
        self.image_limits = (image_limits or ImageLimits()) if images is not None else None
        self.limits = limits
        self.grammars = grammars  # None: requests with a grammar are refused
        self.adapters = adapters
        self.base_names = base_names

    def validate(
        self, request: GenerateRequest, *, stream: bool, arrival_time: float | None = None
    ) -> ValidRequest:
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        check = _Checker(request)
        p = request.parameters
        best_of = self._best_of(check, p, stream)
        sampling = self._sampling(check, p, best_of, request.max_top_n_tokens)
        n = self._n(check, p, best_of)
        if p.max_new_tokens is not None and p.max_new_tokens <= 0:
            raise check.error("max_new_tokens", "must be strictly positive")
        stops = self._stops(check, p.stop)
        if stream and p.decoder_input_details:
            raise check.error(
                "decoder_input_details", "== true is not supported when streaming tokens"
            )
        if p.decoder_input_details and not self.limits.prefill_logprobs:
            raise check.error(
                "decoder_input_details",
                "== true is not supported: this server computes no prefill logprobs "
                "(start it with --enable-prefill-logprobs)",
            )
        if p.max_time is not None and not p.max_time > 0:
            raise check.error("max_time", "must be strictly positive")
        adapter = self._adapter(check, p)
        grammar = self._grammar(check, request)
        if not request.inputs:
            raise check.error("inputs", "cannot be empty")
        truncate = self._truncate(check, p.truncate)
        prompt_ids, images, both_ways = self._tokenize(check, request, truncate)
        max_new_tokens = self._max_new_tokens(check, p.max_new_tokens, len(prompt_ids))
        self._choices_fit(check, p, n, len(prompt_ids), max_new_tokens)
        engine_request = EngineRequest(
            request_id=uuid.uuid4().hex,
            prompt_ids=tuple(prompt_ids),
            sampling=sampling,
            stopping=StoppingParams(
                max_new_tokens=max_new_tokens,
                stop_sequences=stops,
                ignore_eos=p.ignore_eos,
                deadline=arrival + p.max_time if p.max_time is not None else None,
            ),
            decoder_input_details=p.decoder_input_details,
            arrival_time=arrival,
            grammar=grammar,
            priority=self._priority(check, p.priority),
            n=n,
            adapter_id=adapter.name if adapter is not None else None,
            adapter_uid=adapter.uid if adapter is not None else 0,
            images=images,
            both_ways=both_ways,
        )
        return ValidRequest(
            engine_request=engine_request,
            inputs=request.inputs,
            best_of=best_of,
            details=p.details or p.decoder_input_details,
            decoder_input_details=p.decoder_input_details,
            return_full_text=bool(p.return_full_text),
            validation_time=time.monotonic() - arrival,
        )

    def prompt_length(self, request: GenerateRequest) -> int:
        """The tokens `request`'s prompt takes, as validate() tokenizes it (a vision-language
        model's image tokens included), with no other check (Anthropic's count_tokens)."""
        return len(self._tokenize(_Checker(request), request, None)[0])

    # the parts, in TGI's order ----------------------------------------------------

    def _best_of(self, check: _Checker, p: GenerateParameters, stream: bool) -> int:
        best_of = p.best_of
        if best_of is None:
            return 1
        if self.limits.max_best_of == 1 and best_of != 1:
            raise check.error("best_of", "!= 1 is not allowed for this endpoint")
        if best_of <= 0 or best_of > self.limits.max_best_of:
            raise check.error(
                "best_of", f"must be > 0 and <= {self.limits.max_best_of}. Given: {best_of}"
            )
        if best_of > 1 and stream:
            raise check.error("best_of", "!= 1 is not supported when streaming tokens")
        return best_of

    def _n(self, check: _Checker, p: GenerateParameters, best_of: int) -> int:
        """The choices to sample: OpenAI's n (best_of when larger), else TGI's best_of."""
        if p.n is None:
            return best_of
        if best_of > 1:
            raise check.error("n", "must not be set with `best_of`")
        if not 1 <= p.n <= self.limits.max_n:
            raise check.error("n", f"must be >= 1 and <= {self.limits.max_n}. Given: {p.n}")
        return p.n

    def _choices_fit(
        self, check: _Checker, p: GenerateParameters, n: int, input_length: int, max_new: int
    ) -> None:
        """n choices run side by side: all of them, at full length, must fit the KV pool
        at once (each alone fits: max_total_tokens is checked against it at startup)."""
        blocks, block_size = self.limits.kv_cache_blocks, self.limits.kv_block_size
        if n == 1 or blocks is None:
            return
        needed = num_blocks_for_choices(input_length, max_new, n, block_size)
        if needed > blocks:
            field_name = "best_of" if p.n is None else "n"
            raise ValidationError(
                f"{n} choices ({check.quoted(field_name)}) of up to {input_length + max_new} "
                f"tokens each need {needed * block_size} tokens of KV cache but the server "
                f"holds {blocks * block_size}: lower {check.quoted(field_name)} or "
                f"{check.quoted('max_new_tokens')}",
                check.name(field_name),
            )

    def _sampling(
        self,
        check: _Checker,
        p: GenerateParameters,
        best_of: int,
        max_top_n_tokens: int | None = None,
    ) -> SamplingParams:
        for name in _FLOAT_FIELDS:
            value = getattr(p, name)
            if value is not None and not math.isfinite(value):
                raise check.error(name, "must be a finite number")
        sampling = p.do_sample or any(
            v is not None for v in (p.temperature, p.top_k, p.top_p, p.typical_p)
        )
        if best_of > 1 and not sampling:
            raise ValidationError(
                f"you must use sampling when {check.quoted('best_of')} is > 1",
                check.name("best_of"),
            )
        temperature = 1.0 if p.temperature is None else p.temperature
        if temperature <= 0.0:
            raise check.error("temperature", "must be strictly positive")
        if temperature < MIN_TEMPERATURE:
            raise check.error(
                "temperature", f"must be >= {MIN_TEMPERATURE} (use greedy decoding instead)"
            )
        repetition_penalty = _default(p.repetition_penalty, 1.0)
        if repetition_penalty <= 0.0:
            raise check.error("repetition_penalty", "must be strictly positive")
        if not MIN_REPETITION_PENALTY <= repetition_penalty <= MAX_REPETITION_PENALTY:
            raise check.error(
                "repetition_penalty",
                f"must be >= {MIN_REPETITION_PENALTY} and <= {MAX_REPETITION_PENALTY:g}",
            )
        frequency_penalty = _default(p.frequency_penalty, 0.0)
        if not -PENALTY_BOUND <= frequency_penalty <= PENALTY_BOUND:
            raise check.error("frequency_penalty", _PENALTY_RANGE)
        presence_penalty = _default(p.presence_penalty, 0.0)
        if not -PENALTY_BOUND <= presence_penalty <= PENALTY_BOUND:
            raise check.error("presence_penalty", _PENALTY_RANGE)
        if p.top_p is not None and not MIN_MASS < p.top_p < MAX_MASS:
            raise check.error("top_p", _MASS_RANGE)
        if p.typical_p is not None and not MIN_MASS < p.typical_p < MAX_MASS:
            raise check.error("typical_p", _MASS_RANGE)
        if p.top_k is not None and p.top_k <= 0:
            raise check.error("top_k", "must be strictly positive")
        if p.seed is not None and best_of > 1:
            raise ValidationError(
                f"{check.quoted('seed')} must not be set when {check.quoted('best_of')} > 1",
                check.name("seed"),
            )
        top_n_tokens = _default(p.top_n_tokens, 0)
        max_top_n = self.limits.max_top_n_tokens if max_top_n_tokens is None else max_top_n_tokens
        if not 0 <= top_n_tokens <= max_top_n:
            raise check.error(
                "top_n_tokens", f"must be >= 0 and <= {max_top_n}. Given: {top_n_tokens}"
            )
        return SamplingParams(
            # TGI samples as soon as any sampling parameter is given
            do_sample=sampling,
            temperature=temperature,
            top_k=p.top_k or 0,
            top_p=1.0 if p.top_p is None else p.top_p,
            typical_p=1.0 if p.typical_p is None else p.typical_p,
            repetition_penalty=repetition_penalty,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            logit_bias=self._logit_bias(check, p.logit_bias),
            seed=random.randint(0, _MAX_RANDOM_SEED) if p.seed is None else p.seed,
            top_n_tokens=top_n_tokens,
            watermark=p.watermark,
        )

    def _logit_bias(self, check: _Checker, logit_bias) -> tuple[tuple[int, float], ...]:
        for token_id, bias in logit_bias.items():
            if not math.isfinite(bias):
                raise check.error("logit_bias", "values must be finite numbers")
            if not 0 <= token_id < self.limits.vocab_size:
                raise check.error(
                    "logit_bias",
                    f"token id {token_id} is outside the vocabulary "
                    f"(size {self.limits.vocab_size})",
                )
            if not -LOGIT_BIAS_BOUND <= bias <= LOGIT_BIAS_BOUND:
                raise check.error(
                    "logit_bias", f"values must be >= {-LOGIT_BIAS_BOUND} and <= {LOGIT_BIAS_BOUND}"
                )
        return tuple(sorted(logit_bias.items()))

    def _stops(self, check: _Checker, stops: tuple[str, ...]) -> tuple[str, ...]:
        stops = tuple(stops)
        if len(stops) > self.limits.max_stop_sequences:
            raise check.error(
                "stop",
                f"supports up to {self.limits.max_stop_sequences} stop sequences. "
                f"Given: {len(stops)}",
            )
        if any(s == "" for s in stops):
            raise check.error("stop", "sequences must not be empty")
        longest = max((len(s) for s in stops), default=0)
        if longest > self.limits.max_stop_sequence_length:
            raise check.error(
                "stop",
                f"sequences must be at most {self.limits.max_stop_sequence_length} characters."
                f" Given: {longest}",
            )
        return stops

    def _grammar(self, check: _Checker, request: GenerateRequest) -> str | None:
        """The request's output grammar compiled (llguidance), or None: a face's Lark
        grammar (tool calls) first, else TGI's `grammar`."""
        if request.lark is not None:
            return self._compiled(check, "lark", request.lark)
        if request.parameters.grammar is not None:
            return self._compiled(check, *grammar_spec(request.parameters.grammar, check))
        return None

    def _compiled(self, check: _Checker, kind: str, source) -> str:
        """A grammar ("json" schema, "regex" or llguidance "lark") compiled; one the
        compiler can't use is a validation error."""
        if self.grammars is None:
            raise ValidationError("grammar is not supported", check.name("grammar"))
        compile_ = {
            "json": self.grammars.json_schema,
            "regex": self.grammars.regex,
            "lark": self.grammars.lark,
        }
        try:
            return compile_[kind](source)
        except GrammarError as exc:
            raise ValidationError(f"grammar is not valid: {exc}", check.name("grammar")) from exc

    def _adapter(self, check: _Checker, p: GenerateParameters) -> LoraAdapter | None:
        """The LoRA adapter TGI's `adapter_id` or OpenAI's `model` names (None: the base).
        A `model` naming nothing served is the base model's when no adapter is served (as
        OpenAI clients send any name), a validation error otherwise."""
        field, name = ("adapter_id", p.adapter_id) if p.adapter_id else ("model", p.model)
        if (
            name is None
            or name in self.base_names
            or (field == "model" and name in BASE_MODEL_ALIASES)
        ):
            return None
        serving = self.adapters is not None and self.adapters.max_loras > 0
        if not serving:
            if field == "model":
                return None
            raise check.error(
                field, ": LoRA adapters are not served here (start with --lora-adapters)"
            )
        adapter = self.adapters.lookup(name)
        if adapter is None:
            served = [repr(n) for n in self.base_names[:1]]
            served += [repr(a.name) for a in self.adapters.serving()]
            more = ", ..." if len(served) > 10 else ""
            raise check.error(
                field,
                f": unknown LoRA adapter {name!r} (served: {', '.join(served[:10])}{more})",
            )
        return adapter

    @staticmethod
    def _priority(check: _Checker, priority: int | None) -> int:
        if priority is None:
            return 0
        if not INT32_MIN <= priority <= INT32_MAX:
            raise check.error("priority", f"must be a 32-bit integer. Given: {priority}")
        return priority

    def _truncate(self, check: _Checker, truncate: int | None) -> int | None:
        if truncate is not None and not 0 < truncate <= self.limits.max_input_tokens:
            raise check.error(
                "truncate",
                f"must be strictly positive and less than {self.limits.max_input_tokens}. "
                f"Given: {truncate}",
            )
        return truncate

    def _tokenize(
        self, check: _Checker, request: GenerateRequest, truncate: int | None
    ) -> tuple[list[int], tuple, tuple]:
        """The prompt's ids (a vision-language model's: through its processor, each image's
        placeholder expanded, so image tokens count against max_input_tokens), its images
        (engine/types.py ImageInput) and its spans attended both ways (BothWays)."""
        if request.images and self.images is None:
            name = request.images[0].name
            raise ValidationError(f"`{name}`: {self.no_images}", name)
        from .images import has_markdown_images, markdown_images

        images, both_ways = (), ()
        try:
            if self.images is not None:
                inputs, parts = request.inputs, request.images
                if request.markdown_images and parts and has_markdown_images(inputs):
                    raise ValidationError(
                        "`images`: a prompt with markdown images takes no `images`; give "
                        "them one way",
                        "images",
                    )
                if request.markdown_images and not parts:
                    inputs, parts = markdown_images(
                        inputs, check.name("inputs"), self.images.image_token, self.image_limits
                    )
                ids, images, both_ways = self.images.tokenize(inputs, parts, check.name("inputs"))
            else:
                ids = self.tokenizer(request.inputs, add_special_tokens=True)["input_ids"]
        except ValidationError:
            raise
        except Exception as exc:
            raise ValidationError(f"tokenizer error {exc}", check.name("inputs")) from exc
        if truncate is not None and truncate < len(ids):
            if images:  # cutting into or before an image would misplace its tokens
                raise check.error("truncate", "can't cut a prompt with images")
            ids = ids[-truncate:]
        if not ids:
            raise check.error("inputs", "cannot be empty")
        return ids, images, both_ways

    def _max_new_tokens(self, check: _Checker, requested: int | None, input_length: int) -> int:
        """The request's max_new_tokens (already checked positive), or what fits in
        max_total_tokens after the prompt. Validation is the one place it is bounded:
        the KV pool holds at least max_total_tokens (checked at startup, replica/kv_sizing.py)."""
        limits = self.limits
        max_new = (
            requested if requested is not None else max(limits.max_total_tokens - input_length, 0)
        )
        if input_length + max_new > limits.max_total_tokens:
            raise ValidationError(
                f"{check.quoted('inputs')} tokens + {check.quoted('max_new_tokens')} must be <= "
                f"{limits.max_total_tokens}. Given: {input_length} {check.quoted('inputs')} "
                f"tokens and {max_new} {check.quoted('max_new_tokens')}",
                check.name("max_new_tokens"),
            )
        # max_input_tokens < max_total_tokens (Settings): an unset max_new_tokens of 0
        # only happens for a prompt this refuses
        if input_length > limits.max_input_tokens:
            raise check.error(
                "inputs",
                f"must have less than {limits.max_input_tokens} tokens. Given: {input_length}",
            )
        return max_new


class _Checker:
    """Errors that name the refused field as the request's face calls it."""

    def __init__(self, request: GenerateRequest) -> None:
        self.request = request

    def name(self, field_name: str) -> str:
        return self.request.name(field_name)

    def quoted(self, field_name: str) -> str:
        return f"`{self.name(field_name)}`"

    def error(self, field_name: str, text: str) -> ValidationError:
        """ "`field` text" (TGI's wording); text starting with ":" follows it directly."""
        separator = "" if text.startswith(":") else " "
        return ValidationError(f"{self.quoted(field_name)}{separator}{text}", self.name(field_name))


def grammar_spec(grammar: Grammar, check: _Checker | None = None) -> tuple[str, object]:
    """TGI's grammar ({"type": "json" | "json_schema" | "regex", "value": ...}) ->
    ("json", schema) or ("regex", pattern); malformed ones are validation errors."""
    param = check.name("grammar") if check is not None else None

    def invalid(text: str) -> ValidationError:
        return ValidationError(f"grammar is not valid: {text}", param)

    kind, value = grammar.type, grammar.value
    if kind == "regex":
        if not isinstance(value, str):
            raise invalid("a `regex` grammar's value must be a string")
        return "regex", value
    if kind == "json":
        return "json", _schema_value(value, invalid)
    if kind == "json_schema":
        if not isinstance(value, dict) or "schema" not in value:
            raise invalid('a `json_schema` grammar\'s value must be {"schema": ...}')
        return "json", _schema_value(value["schema"], invalid)
    raise invalid(f"unknown type {kind!r} (json, json_schema or regex)")


def _schema_value(value, invalid):
    """A JSON schema given as an object, a boolean, or a string holding one (as TGI allows)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise invalid(f"the schema is not JSON: {exc}") from exc
    if not isinstance(value, (dict, bool)):
        raise invalid("a JSON schema must be an object")
    return value


def _default(value, default):
    return default if value is None else value
