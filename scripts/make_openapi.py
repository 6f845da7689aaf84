"""Write envoy/openapi.json: the OpenAPI 3.1 description of textgen's HTTP face.

Derived from TGI's published spec (tests/data/tgi-openapi.json), restricted to the
routes Envoy serves (textgen.envoy.config.ROUTES; tests/integration/test_fuzz.py checks that they
match), with TGI's request and response schemas kept and adjusted where textgen differs:

- TGI routes: `GenerateParameters` gains presence_penalty, logit_bias, ignore_eos and
  max_time, and states the bounds validation enforces (its constants,
  service/intake/validation.py, and the server's default limits, Settings'; an
  `exclusiveMinimum` of 0 is TGI's "must be strictly positive"); `grammar`
  (json / json_schema / regex) constrains the output; responses carry
  `details.input_length` and `details.timings`; a seed is a JSON number (it is echoed
  as a double); `finish_reason` may be `time_limit`; a stream may end with an in-band
  `{"error", "error_type"}` event. GET /info's `Info` is the InfoResponse message
  (info_schema(), from the contract's descriptor set and its comments).
- OpenAI routes (/v1/*): the request fields service/openai parses, with OpenAI's types
  (`stop` a string or a list, `logit_bias` a map, content a string or text parts);
  OpenAI's response and chunk shapes; OpenAI's error object. /v1/responses (OpenAI's
  Responses API, responses_schemas()): its request, the response object, and each of
  its stream's named events (`event: response.created` ..., no `[DONE]`); the stored
  responses' routes (retrieve, delete, input items: stored_response_schemas()).
- Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): the request
  bodies service/anthropic parses (its protocol models), the message object, its stream's
  named events and count_tokens' answer (anthropic_schemas()); errors in Anthropic's shape
  and statuses (service/errors.py ANTHROPIC_ERRORS).
- /tokenize also takes vLLM's body and answers vLLM's shape; /detokenize and /version
  (tokenizer_schemas()).
- SageMaker's routes, as TGI's router serves them: GET /ping (/health's answers) and
  POST /invocations (TGI's SagemakerRequest: TGI's body, OpenAI chat's or completions',
  answered as the route it picks, with that face's errors).
- Errors: every non-2xx answer is typed, `{"error", "error_type"}` on TGI routes and
  `{"error": {"message", "type", "param", "code"}}` under /v1/, with the statuses of
  textgen.envoy.config.HTTP_STATUS_BY_ERROR_TYPE.

Usage: python scripts/make_openapi.py [--out FILE]   (default: envoy/openapi.json;
tests/integration/test_fuzz.py checks the committed file is this script's output).
TGI publishes OpenAPI 3.0.3; the schemas are written here in that dialect (TGI's,
`nullable`) and converted at the end to OpenAPI 3.1 (JSON Schema 2020-12), which can
say what an SSE event carries: each event's `data` is JSON (`contentMediaType`) of a
given schema (`contentSchema`); OpenAI streams end with the literal `[DONE]`.
"""

from __future__ import annotations

import argparse
import copy
import json
import tomllib
from pathlib import Path

from google.protobuf import descriptor_pb2
from textgen.envoy.contract import DESCRIPTOR
from textgen.service.anthropic import protocol as anthropic_protocol
from textgen.service.errors import ANTHROPIC_ERRORS, ANTHROPIC_TOO_LARGE, ErrorType
from textgen.service.errors import ErrorType as E
from textgen.service.intake.validation import (
    INT32_MAX,
    INT32_MIN,
    LOGIT_BIAS_BOUND,
    MAX_MASS,
    MIN_MASS,
    PENALTY_BOUND,
)
from textgen.service.openai import protocol, responses_protocol
from textgen.service.settings.table import Settings

REPO = Path(__file__).resolve().parent.parent
TGI_SPEC = REPO / "tests" / "data" / "tgi-openapi.json"
OUT = REPO / "envoy" / "openapi.json"

UINT64_MAX = 2**64 - 1
# A token id as a JSON object key (3.1's propertyNames; uint32 on the wire).
TOKEN_ID = {"type": "string", "pattern": "^[0-9]{1,10}$"}
# The server's defaults for the limits a request meets (--max-top-n-tokens, ...).
DEFAULTS = Settings()

# The error_types a typed error may carry (service/errors.py's vocabulary). Envoy's
# fallbacks for an unexpected failure (`internal`, `proxy`, `unimplemented`) are not
# part of the contract: they mean a bug.
ERROR_TYPES = [t.value for t in ErrorType if t.in_contract]

# TGI schemas kept as they are (after cleaning), by name.
KEEP_AS_IS = ["PrefillToken", "Token", "SimpleToken", "TokenizeResponse", "JsonSchemaConfig"]


def ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def nullable(schema: dict) -> dict:
    """`schema` or null (OpenAPI 3.0); a $ref is wrapped as TGI does (allOf)."""
    if "$ref" in schema:
        return {"allOf": [schema], "nullable": True}
    return {**schema, "nullable": True}


# cleaning TGI's schemas -------------------------------------------------------------


def _typed_example(value, kind: str | None):
    """TGI writes many examples as strings ("20", "true"); give them their type."""
    if not isinstance(value, str) or kind in (None, "string"):
        return value
    try:
        parsed = json.loads(value)
    except ValueError:
        return None
    if kind == "integer" and isinstance(parsed, int) and not isinstance(parsed, bool):
        return parsed
    if kind == "number" and isinstance(parsed, (int, float)) and not isinstance(parsed, bool):
        return parsed
    if kind == "boolean" and isinstance(parsed, bool):
        return parsed
    if kind == "array" and isinstance(parsed, list):
        return parsed
    return None


def clean(node):
    """TGI's spec, made valid OpenAPI 3.0: `exclusiveMinimum: <number>` (3.1 style)
    becomes `minimum` + `exclusiveMinimum: true`; `default: "null"` and mistyped
    examples are dropped or typed."""
    if isinstance(node, list):
        return [clean(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: clean(v) for k, v in node.items()}
    kind = out.get("type")
    for key, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        value = out.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[bound] = value
            out[key] = True
    if out.get("default") == "null":
        del out["default"]
    elif "default" in out:
        typed = _typed_example(out["default"], kind)
        if typed is None:
            del out["default"]
        else:
            out["default"] = typed
    if "example" in out:
        typed = _typed_example(out["example"], kind)
        if typed is None:
            del out["example"]
        else:
            out["example"] = typed
    return out


# TGI's face ------------------------------------------------------------------------


def _number(value: float) -> int | float:
    """A bound as JSON writes it most simply (1, not 1.0)."""
    return int(value) if float(value).is_integer() else value


def _bounded(kind: str, description: str, *, fmt: str | None = None, **bounds) -> dict:
    schema = {"type": kind, "description": description, "nullable": True}
    if fmt:
        schema["format"] = fmt
    schema.update(bounds)
    return schema


def _priority() -> dict:
    return _bounded(
        "integer",
        "Scheduling priority (vLLM's convention): lower is served sooner, ties in arrival"
        " order; a full bounded queue refuses the lowest first. Unset: the"
        " `x-textgen-priority` header's, else 0.",
        fmt="int32",
        minimum=INT32_MIN,
        maximum=INT32_MAX,
        example=0,
    )


def generate_parameters(tgi: dict) -> dict:
    params = copy.deepcopy(tgi["GenerateParameters"])
    props = params["properties"]
    props["adapter_id"] = {
        "type": "string",
        "nullable": True,
        "description": "TGI's LoRA adapter id: a served adapter's name (GET /info lists them)"
        " or the base model's id; unset or empty: the base model. Any other name is refused"
        " with 422.",
    }
    desc = {k: v.get("description", "") for k, v in props.items()}
    props["best_of"] = _bounded(
        "integer",
        desc["best_of"] + " At most the server's max_best_of (GET /info); needs sampling;"
        " not with streaming, nor with `seed`.",
        fmt="int32",
        minimum=0,
        exclusiveMinimum=True,
        example=1,
    )
    props["details"]["default"] = False
    props["frequency_penalty"] = _bounded(
        "number",
        "Penalize tokens by how often they already occurred in the output (OpenAI"
        " semantics); 0 means none.",
        fmt="float",
        minimum=-PENALTY_BOUND,
        maximum=PENALTY_BOUND,
        example=0.1,
    )
    props["presence_penalty"] = _bounded(
        "number",
        "Penalize tokens that already occurred in the output (OpenAI semantics); 0 means none.",
        fmt="float",
        minimum=-PENALTY_BOUND,
        maximum=PENALTY_BOUND,
        example=0.1,
    )
    props["grammar"] = {
        "allOf": [ref("GrammarType")],
        "nullable": True,
        "description": "Constrained decoding: the output follows the JSON schema or the"
        " regex. A schema or regex that can't be compiled is refused with 422 `validation`.",
    }
    props["max_new_tokens"] = _bounded(
        "integer",
        "Maximum number of tokens to generate. Unset: up to max_total_tokens minus the"
        " prompt's tokens. The prompt's tokens plus max_new_tokens must not exceed"
        " max_total_tokens (GET /info).",
        fmt="int32",
        minimum=0,
        exclusiveMinimum=True,
        example=20,
    )
    props["seed"] = _bounded(
        "integer",
        "Random sampling seed (unsigned 64 bits). Not with best_of > 1.",
        minimum=0,
        maximum=UINT64_MAX,
        example=42,
    )
    longest = DEFAULTS.max_stop_sequence_length
    props["stop"].update(
        description="Stop generating when one of these strings is generated. At most the"
        f" server's max_stop_sequences (GET /info), each 1 to {longest} characters.",
        items={"type": "string", "minLength": 1, "maxLength": longest},
        maxItems=DEFAULTS.max_stop_sequences,
    )
    props["top_k"]["minimum"] = 0
    props["top_k"]["exclusiveMinimum"] = True
    props["top_n_tokens"].update(
        description="Also return the top_n_tokens most probable alternatives at each"
        f" position. At most {DEFAULTS.max_top_n_tokens} (the server's max_top_n_tokens).",
        minimum=0,
        maximum=DEFAULTS.max_top_n_tokens,
    )
    props["top_n_tokens"].pop("exclusiveMinimum", None)
    for name in ("top_p", "typical_p"):
        props[name].update(
            minimum=_number(MIN_MASS),
            exclusiveMinimum=True,
            maximum=_number(MAX_MASS),
            exclusiveMaximum=True,
        )
    props["truncate"].update(
        description="Keep only the last `truncate` prompt tokens. At most max_input_tokens.",
        format="int32",
        minimum=0,
        exclusiveMinimum=True,
    )
    props["watermark"].update(
        description="Green-list watermark (Kirchenbauer et al.) with the server's"
        " --watermark-gamma and --watermark-delta: transformers' WatermarkDetector detects it.",
        default=False,
        example=False,
    )
    props["logit_bias"] = {
        "type": "object",
        "description": "Bias added to the logits of token ids before sampling: keys are"
        " token ids (decimal strings, inside the vocabulary), values in"
        f" [{-LOGIT_BIAS_BOUND}, {LOGIT_BIAS_BOUND}].",
        "propertyNames": TOKEN_ID,
        "additionalProperties": {
            "type": "number",
            "format": "float",
            "minimum": -LOGIT_BIAS_BOUND,
            "maximum": LOGIT_BIAS_BOUND,
        },
        "example": {"2": -100},
    }
    props["ignore_eos"] = {
        "type": "boolean",
        "description": "Keep generating past EOS until max_new_tokens (vLLM's ignore_eos;"
        " for benchmarks).",
        "default": False,
    }
    props["priority"] = _priority()
    props["max_time"] = _bounded(
        "number",
        "Stop after this many seconds from arrival; finish_reason is then `time_limit`.",
        fmt="float",
        minimum=0,
        exclusiveMinimum=True,
        example=10.0,
    )
    params["properties"] = dict(sorted(props.items()))
    params["description"] = (
        "TGI's generation parameters. Unset (or null) fields take TGI's defaults;"
        " an unknown field is refused (422, naming it). Each field may also be spelled"
        " in lowerCamelCase (its proto JSON name)."
    )
    return params


# GenerateRequest.images (api/textgen/v1/generate.proto): textgen's own field
IMAGES = {
    "type": "array",
    "description": "textgen's own field: images for a vision-language model, in prompt order;"
    " `inputs` holds the model's image placeholder (/info's `image_token`; LLaVA's `<image>`)"
    " once per image. TGI's markdown images in `inputs` are read too; a request uses one of"
    " the two. A text-only model refuses them (422).",
    "items": {
        "type": "object",
        "description": "One image: `data` or `url`.",
        "properties": {
            "data": {
                "type": "string",
                "format": "byte",
                "description": "The image file (any format Pillow reads), base64.",
            },
            "url": {
                "type": "string",
                "description": "An http(s) URL the server fetches, or a base64 data: URI.",
            },
        },
    },
}


def generate_request(tgi: dict, name: str) -> dict:
    schema = copy.deepcopy(tgi[name])
    schema["properties"]["inputs"].update(minLength=1, description="The prompt; must not be empty.")
    schema["properties"]["images"] = IMAGES
    if name == "CompatGenerateRequest":
        schema["properties"]["stream"].update(
            description="Answer as /generate_stream (true) or as /generate, wrapped in a"
            " one-element array (false).",
            default=False,
        )
    schema["description"] = (
        "A field other than these (here, in `parameters` or in `parameters.grammar`) is refused"
        " (422, naming it)"
        + (
            "."
            if name == "CompatGenerateRequest"
            else "; `stream`, which TGI's clients send to POST /, is accepted and ignored."
        )
    )
    return schema


CACHED_TOKENS = {
    "type": "integer",
    "format": "int32",
    "minimum": 0,
    "description": "Prompt tokens served from the prefix cache (not computed).",
}


def seed_number() -> dict:
    return {
        "type": "number",
        "description": "Seed used for sampling (only when sampling). A JSON number: exact"
        " below 2^53.",
        "nullable": True,
        "minimum": 0,
        "example": 42,
    }


def tgi_schemas(tgi: dict) -> dict:
    s = {name: copy.deepcopy(tgi[name]) for name in KEEP_AS_IS}
    s["GenerateParameters"] = generate_parameters(tgi)
    s["GenerateRequest"] = generate_request(tgi, "GenerateRequest")
    s["CompatGenerateRequest"] = generate_request(tgi, "CompatGenerateRequest")
    s["GrammarType"] = copy.deepcopy(tgi["GrammarType"])
    s["GrammarType"]["description"] = (
        "`json`: value is a JSON schema (an object, or a string holding one); `json_schema`:"
        ' value is {"schema": ...}; `regex`: value is the regular expression.'
    )

    s["FinishReason"] = {
        "type": "string",
        "enum": ["length", "eos_token", "stop_sequence", "time_limit"],
        "description": "`time_limit`: the request's max_time ran out.",
        "example": "length",
    }
    s["Timings"] = {
        "type": "object",
        "description": "Where a request's time went, in seconds.",
        "required": [
            "total_time",
            "validation_time",
            "queue_time",
            "inference_time",
            "time_per_token",
        ],
        "properties": {
            "total_time": {"type": "number", "description": "From arrival to the last token."},
            "validation_time": {"type": "number", "description": "Validation and tokenization."},
            "queue_time": {"type": "number", "description": "Waiting before the first forward."},
            "inference_time": {"type": "number", "description": "First forward to last token."},
            "time_per_token": {
                "type": "number",
                "description": "inference_time / generated_tokens.",
            },
        },
    }
    details = copy.deepcopy(tgi["Details"])
    details["properties"]["seed"] = seed_number()
    details["properties"]["input_length"] = {
        "type": "integer",
        "format": "int32",
        "minimum": 0,
        "description": "Number of prompt tokens.",
    }
    details["properties"]["timings"] = ref("Timings")
    details["properties"]["cached_tokens"] = CACHED_TOKENS
    details["properties"]["best_of_sequences"].pop("nullable", None)
    s["Details"] = details
    best_of = copy.deepcopy(tgi["BestOfSequence"])
    best_of["properties"]["seed"] = seed_number()
    s["BestOfSequence"] = best_of
    s["GenerateResponse"] = copy.deepcopy(tgi["GenerateResponse"])

    stream_details = copy.deepcopy(tgi["StreamDetails"])
    stream_details["properties"]["seed"] = seed_number()
    stream_details["properties"]["timings"] = ref("Timings")
    stream_details["properties"]["cached_tokens"] = CACHED_TOKENS
    s["StreamDetails"] = stream_details
    stream = copy.deepcopy(tgi["StreamResponse"])
    stream["description"] = (
        "One SSE event of a stream: a token; the last one also carries generated_text and details."
    )
    s["StreamResponse"] = stream
    s["StreamError"] = {
        "type": "object",
        "description": (
            "The last SSE event of a stream that failed after it started (TGI's in-band error)."
        ),
        "required": ["error", "error_type"],
        "properties": {
            "error": {"type": "string"},
            "error_type": {"type": "string", "enum": ERROR_TYPES},
        },
    }
    s["StreamEvent"] = {"oneOf": [ref("StreamResponse"), ref("StreamError")]}

    s["ErrorResponse"] = {
        "type": "object",
        "description": "Every error of a TGI route.",
        "required": ["error", "error_type"],
        "properties": {
            "error": {"type": "string", "description": "What went wrong, for people."},
            "error_type": {"type": "string", "enum": ERROR_TYPES, "description": "For programs."},
        },
        "example": {"error": "Input validation error", "error_type": "validation"},
    }

    # SageMaker's POST /invocations (TGI's router/src/sagemaker.rs: an untagged enum, its
    # variants tried in this order; the Lua filter routes by the first key present)
    s["SagemakerRequest"] = {
        "description": "TGI's body (`inputs`: as POST /, `stream` switching), else OpenAI"
        " chat's (`messages`), else OpenAI completions' (`prompt`), as TGI's"
        " SagemakerRequest.",
        "anyOf": [ref("CompatGenerateRequest"), ref("ChatRequest"), ref("CompletionRequest")],
    }

    s["Info"] = info_schema(tgi)
    return s


# GET /info: the InfoResponse message ----------------------------------------------

F = descriptor_pb2.FieldDescriptorProto
# JSON types of the proto scalars /info carries (64-bit integers, which the transcoder
# prints as strings, and messages would need a rule of their own)
JSON_TYPES = {
    F.TYPE_STRING: "string",
    F.TYPE_BOOL: "boolean",
    F.TYPE_UINT32: "integer",
    F.TYPE_INT32: "integer",
    F.TYPE_DOUBLE: "number",
    F.TYPE_FLOAT: "number",
}


def proto_message(name: str, package: str = "textgen.v1") -> tuple[list, dict[str, str]]:
    """The fields of message `name` in the contract's descriptor set (envoy/textgen.binpb,
    with source info), in declaration order, and each field's comment by field name."""
    files = descriptor_pb2.FileDescriptorSet.FromString(DESCRIPTOR.read_bytes())
    for file in files.file:
        if file.package != package:
            continue
        for index, message in enumerate(file.message_type):
            if message.name != name:
                continue
            comments = {}
            for location in file.source_code_info.location:
                path = list(location.path)  # 4: message_type, 2: field
                if len(path) == 4 and path[:2] == [4, index] and path[2] == 2:
                    text = " ".join(line.strip() for line in location.leading_comments.splitlines())
                    comments[message.field[path[3]].name] = text.strip()
            return list(message.field), comments
    raise LookupError(f"{package}.{name} is not in {DESCRIPTOR}")


def info_schema(tgi: dict) -> dict:
    """GET /info: the InfoResponse message as the transcoder prints it (proto field names,
    every field but a proto3 `optional` one printed, so required), its fields in
    declaration order after TGI's. TGI's own fields keep TGI's schemas (their examples);
    textgen's take their types from the proto's and their descriptions from its comments.
    Every number /info gives is a count, a size or a duration: none is negative."""
    info = copy.deepcopy(tgi["Info"])
    fields, comments = proto_message("InfoResponse")
    required = {f.name for f in fields if not f.proto3_optional}
    tgi_fields = set(info["properties"])
    missing = tgi_fields - {f.name for f in fields}
    assert not missing, f"TGI's /info fields missing from InfoResponse: {sorted(missing)}"
    assert set(info["required"]) == tgi_fields & required, "TGI's required /info fields"
    for field in fields:
        if field.type not in JSON_TYPES:
            raise TypeError(f"InfoResponse.{field.name}: no JSON type for proto type {field.type}")
        if field.name in tgi_fields:
            assert info["properties"][field.name]["type"] == JSON_TYPES[field.type], field.name
            continue
        scalar: dict = {"type": JSON_TYPES[field.type]}
        if field.label == F.LABEL_REPEATED:
            schema = {"type": "array", "items": scalar}
        else:
            schema = scalar
        if comments.get(field.name):
            schema["description"] = comments[field.name]
        if scalar["type"] in ("integer", "number"):
            scalar["minimum"] = 0
        info["properties"][field.name] = schema
        if field.name in required:
            info["required"].append(field.name)
    info["properties"]["router"]["example"] = "textgen"
    return info


def sse_event(name: str, *, done: bool = False) -> dict:
    """One server-sent event whose `data` is JSON of schema `name` (or, with `done`,
    OpenAI's final `[DONE]`). Before OpenAPI 3.2's itemSchema, a text/event-stream
    `schema` describes each event."""
    data = {"type": "string", "contentMediaType": "application/json", "contentSchema": ref(name)}
    if done:
        data = {"type": "string", "anyOf": [{"const": "[DONE]"}, data]}
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"event": {"type": "string"}, "data": data},
    }


# OpenAPI 3.0 -> 3.1 ------------------------------------------------------------------

DATA_KEYWORDS = {"example", "examples", "enum", "default", "const"}


def schema31(node):
    """An OpenAPI 3.0 schema (TGI's dialect) as a 3.1 one: `nullable` becomes a null
    type, boolean exclusive bounds become numeric, `example` becomes `examples`."""
    if isinstance(node, list):
        return [schema31(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in DATA_KEYWORDS:
            out[key] = value
        elif key == "properties":  # names to schemas: a name is not a keyword
            out[key] = {name: schema31(sub) for name, sub in value.items()}
        else:
            out[key] = schema31(value)
    for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if out.get(flag) is True:
            out[flag] = out.pop(bound)
        elif out.get(flag) is False:
            del out[flag]
    if "example" in out:
        out["examples"] = [out.pop("example")]
    if out.pop("nullable", False):
        if "type" in out:
            out["type"] = [out["type"], "null"]
            if "enum" in out:
                out["enum"] = [*out["enum"], None]
        elif "oneOf" in out:
            out["oneOf"] = [*out["oneOf"], {"type": "null"}]
        else:
            combined = {k: out.pop(k) for k in ("allOf", "$ref", "anyOf") if k in out}
            if list(combined) == ["allOf"] and len(combined["allOf"]) == 1:
                combined = combined["allOf"][0]
            out["anyOf"] = [combined, {"type": "null"}]
    return out


def paths31(paths_: dict) -> dict:
    out = copy.deepcopy(paths_)
    for item in out.values():
        for op in item.values():
            bodies = [op.get("requestBody", {}), *op["responses"].values()]
            for body in bodies:
                for media in body.get("content", {}).values():
                    media["schema"] = schema31(media["schema"])
    return out


# OpenAI's face ---------------------------------------------------------------------


# OpenAI's request bodies (service/openai parses each with its model): their schemas
# are the models' (service/openai/protocol.py), under the names this document gives them.
OPENAI_REQUESTS = {
    "ChatRequest": protocol.ChatCompletionBody,
    "CompletionRequest": protocol.CompletionBody,
    "ResponsesRequest": responses_protocol.ResponsesBody,
    "VllmTokenizeRequest": protocol.VllmTokenizeBody,
    "VllmTokenizeChatRequest": protocol.VllmTokenizeChatBody,
    # Anthropic's Messages API (service/anthropic/protocol.py)
    "MessagesRequest": anthropic_protocol.MessagesBody,
    "CountTokensRequest": anthropic_protocol.CountTokensBody,
}


def openai_request_schemas() -> dict:
    """The request bodies and the objects they hold (`$defs`, each under its model's
    name), as JSON Schema 2020-12 (OpenAPI 3.1's dialect already)."""
    s: dict = {}
    for name, model in OPENAI_REQUESTS.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for part, definition in schema.pop("$defs", {}).items():
            # two models of one name (OpenAI's and Anthropic's `Tool`) would be one schema
            assert s.get(part, definition) == definition, f"two schemas named {part}"
            s[part] = definition
        s[name] = schema
    return {name: _tidy(schema) for name, schema in s.items()}


def _tidy(node):
    """Without pydantic's titles (the field names again) and null defaults, descriptions
    on one line, properties in name order, and a map's constrained keys (pydantic's
    patternProperties, which would let other keys through) as what validation does:
    every key matches (propertyNames)."""
    if isinstance(node, list):
        return [_tidy(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "title" or (key == "default" and value is None):
            continue
        if key == "properties":  # names to schemas: a name is not a keyword
            out[key] = {name: _tidy(value[name]) for name in sorted(value)}
        elif key == "patternProperties" and len(value) == 1 and "properties" not in node:
            ((pattern, values),) = value.items()
            out["propertyNames"] = {"type": "string", "pattern": pattern}
            out["additionalProperties"] = _tidy(values)
        elif key == "description":
            out[key] = " ".join(value.split())
        elif key in DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _tidy(value)
    return out


def openai_schemas(tgi: dict) -> dict:
    s: dict = {}
    s["Usage"] = copy.deepcopy(tgi["Usage"])
    s["Usage"]["description"] = (
        "A prompt counts once, however many choices it has; completion_tokens add up over"
        " every choice sampled (best_of's too)."
    )
    s["Usage"]["properties"]["prompt_tokens_details"] = {
        "type": "object",
        "required": ["cached_tokens"],
        "properties": {
            "cached_tokens": {
                "type": "integer",
                "minimum": 0,
                "description": "Prompt tokens served from the prefix cache (not computed).",
            }
        },
    }
    s["Usage"]["required"].append("prompt_tokens_details")
    s["ModelInfo"] = copy.deepcopy(tgi["ModelInfo"])
    s["ModelInfo"]["properties"]["root"] = {
        "type": "string",
        "description": "What it was loaded from: the base model's id, or a LoRA adapter's"
        " folder or Hub id (vLLM's field).",
    }
    s["ModelInfo"]["properties"]["parent"] = {
        "type": "string",
        "description": "A LoRA adapter's base model (vLLM's field); absent for the base.",
    }
    s["LoadLoraAdapterRequest"] = {
        "type": "object",
        "required": ["lora_name", "lora_path"],
        "properties": {
            "lora_name": {"type": "string", "description": "The name requests will give it."},
            "lora_path": {
                "type": "string",
                "description": "A folder made by peft (adapter_config.json,"
                " adapter_model.safetensors) or a Hub id.",
            },
        },
    }
    s["UnloadLoraAdapterRequest"] = {
        "type": "object",
        "required": ["lora_name"],
        "properties": {"lora_name": {"type": "string", "description": "The adapter's name."}},
    }
    s["LoraAdapterResponse"] = {
        "type": "object",
        "required": ["message", "lora_adapters"],
        "properties": {
            "message": {"type": "string", "description": "What was done, for people."},
            "lora_adapters": {
                "type": "array",
                "items": {"type": "string"},
                "description": "The adapters served after it, by name.",
            },
        },
    }
    s["ModelList"] = {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"type": "string", "enum": ["list"]},
            "data": {"type": "array", "items": ref("ModelInfo")},
        },
    }
    s["OpenAIErrorResponse"] = {
        "type": "object",
        "description": "Every error of an OpenAI route, in OpenAI's shape.",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {
                        "type": "string",
                        "enum": ERROR_TYPES,
                        "description": "textgen's error_type.",
                    },
                    "param": {"type": "string", "nullable": True},
                    "code": {"type": "string", "nullable": True},
                },
            }
        },
    }

    # the tool calls of an answer (the requests' are protocol.MessageToolCall)
    s["ToolCall"] = {
        "type": "object",
        "required": ["id", "type", "function"],
        "properties": {
            "id": {"type": "string"},
            "type": {"type": "string", "enum": ["function"]},
            "function": ref("FunctionCall"),
        },
    }
    s["FunctionCall"] = {
        "type": "object",
        "required": ["name", "arguments"],
        "properties": {
            "name": {"type": "string"},
            "arguments": {"type": "string", "description": "The arguments, a JSON object as text."},
        },
    }
    # chat responses
    logprob_entry = {
        "type": "object",
        "required": ["token", "logprob", "bytes"],
        "properties": {
            "token": {"type": "string"},
            "logprob": {"type": "number"},
            "bytes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}},
        },
    }
    s["ChatCompletionTopLogprob"] = logprob_entry
    s["ChatCompletionLogprob"] = {
        **copy.deepcopy(logprob_entry),
        "required": ["token", "logprob", "bytes", "top_logprobs"],
    }
    s["ChatCompletionLogprob"]["properties"]["top_logprobs"] = {
        "type": "array",
        "items": ref("ChatCompletionTopLogprob"),
    }
    s["ChatCompletionLogprobs"] = copy.deepcopy(tgi["ChatCompletionLogprobs"])
    finish = {"type": "string", "enum": ["stop", "length"]}
    chat_finish = {"type": "string", "enum": ["stop", "length", "tool_calls"]}
    envelope = {
        "id": {"type": "string"},
        "created": {"type": "integer", "format": "int64", "minimum": 0},
        "model": {"type": "string"},
        "system_fingerprint": {"type": "string"},
    }
    s["ChatCompletion"] = {
        "type": "object",
        "required": ["id", "object", "created", "model", "system_fingerprint", "choices", "usage"],
        "properties": {
            **envelope,
            "object": {"type": "string", "enum": ["chat.completion"]},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "message", "logprobs", "finish_reason"],
                    "properties": {
                        "index": {"type": "integer", "minimum": 0},
                        "message": {
                            "type": "object",
                            "required": ["role", "content"],
                            "description": "content is null when the answer is tool_calls.",
                            "properties": {
                                "role": {"type": "string", "enum": ["assistant"]},
                                "content": {"type": "string", "nullable": True},
                                "tool_calls": {"type": "array", "items": ref("ToolCall")},
                            },
                        },
                        "logprobs": nullable(ref("ChatCompletionLogprobs")),
                        "finish_reason": chat_finish,
                    },
                },
            },
            "usage": ref("Usage"),
        },
    }
    s["ChatCompletionChunk"] = {
        "type": "object",
        "required": ["id", "object", "created", "model", "system_fingerprint", "choices"],
        "description": "One SSE event of a chat stream. With stream_options.include_usage every"
        " chunk has `usage` (null) and one last chunk, with no choices, the totals.",
        "properties": {
            **envelope,
            "object": {"type": "string", "enum": ["chat.completion.chunk"]},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "delta", "logprobs", "finish_reason"],
                    "properties": {
                        "index": {"type": "integer", "minimum": 0},
                        "delta": {
                            "type": "object",
                            "description": "A call's first delta has its index, id, type and"
                            ' name (arguments ""); the next ones add pieces of its arguments.',
                            "properties": {
                                "role": {"type": "string", "enum": ["assistant"]},
                                "content": {"type": "string", "nullable": True},
                                "tool_calls": {"type": "array", "items": ref("ToolCallDelta")},
                            },
                        },
                        "logprobs": nullable(ref("ChatCompletionLogprobs")),
                        "finish_reason": nullable(chat_finish),
                    },
                },
            },
            "usage": nullable(ref("Usage")),
        },
    }
    s["ToolCallDelta"] = {
        "type": "object",
        "required": ["index", "function"],
        "properties": {
            "index": {"type": "integer", "minimum": 0},
            "id": {"type": "string"},
            "type": {"type": "string", "enum": ["function"]},
            "function": {
                "type": "object",
                "required": ["arguments"],
                "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
            },
        },
    }
    s["ChatStreamEvent"] = {
        "oneOf": [ref("ChatCompletionChunk"), ref("OpenAIErrorResponse")],
        "description": "`data: {json}` events, then `data: [DONE]`; a stream that fails"
        " after it started ends with an error event instead.",
    }

    # completions
    s["CompletionLogprobs"] = {
        "type": "object",
        "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
        "properties": {
            "tokens": {"type": "array", "items": {"type": "string"}},
            "token_logprobs": {"type": "array", "items": {"type": "number"}},
            "top_logprobs": {
                "type": "array",
                "items": {"type": "object", "additionalProperties": {"type": "number"}},
            },
            "text_offset": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        },
    }

    def completion_choice(final: bool) -> dict:
        return {
            "type": "object",
            "required": ["index", "text", "logprobs", "finish_reason"],
            "properties": {
                "index": {"type": "integer", "minimum": 0},
                "text": {"type": "string"},
                "logprobs": nullable(ref("CompletionLogprobs")),
                "finish_reason": finish if final else nullable(finish),
            },
        }

    s["CompletionFinal"] = {
        "type": "object",
        "required": ["id", "object", "created", "model", "system_fingerprint", "choices", "usage"],
        "properties": {
            **envelope,
            "object": {"type": "string", "enum": ["text_completion"]},
            "choices": {"type": "array", "items": completion_choice(True)},
            "usage": ref("Usage"),
        },
    }
    s["Chunk"] = {
        "type": "object",
        "required": ["id", "object", "created", "model", "system_fingerprint", "choices"],
        "description": "One SSE event of a completions stream (see ChatCompletionChunk for usage).",
        "properties": {
            **envelope,
            "object": {"type": "string", "enum": ["text_completion"]},
            "choices": {"type": "array", "items": completion_choice(False)},
            "usage": nullable(ref("Usage")),
        },
    }
    s["CompletionStreamEvent"] = {
        "oneOf": [ref("Chunk"), ref("OpenAIErrorResponse")],
        "description": "`data: {json}` events, then `data: [DONE]`; a stream that fails"
        " after it started ends with an error event instead.",
    }
    return s


def _response_event(kind: str, required: list[str], properties: dict) -> dict:
    """One stream event's data: its `type`, `sequence_number` and fields."""
    return {
        "type": "object",
        "required": ["type", "sequence_number", *required],
        "properties": {
            "type": {"type": "string", "enum": [kind]},
            "sequence_number": {"type": "integer", "minimum": 0},
            **properties,
        },
    }


def responses_schemas() -> dict:
    """/v1/responses: its request, the response object and the stream's events."""
    s: dict = {}

    # the response object
    output_text = {
        "type": "object",
        "required": ["type", "text", "annotations", "logprobs"],
        "properties": {
            "type": {"type": "string", "enum": ["output_text"]},
            "text": {"type": "string"},
            "annotations": {"type": "array", "maxItems": 0},
            "logprobs": {"type": "array", "items": ref("ChatCompletionLogprob")},
        },
    }
    s["ResponseOutputText"] = output_text
    status = {"type": "string", "enum": ["in_progress", "completed", "incomplete"]}
    s["ResponseOutputMessage"] = {
        "type": "object",
        "required": ["type", "id", "status", "role", "content"],
        "properties": {
            "type": {"type": "string", "enum": ["message"]},
            "id": {"type": "string"},
            "status": status,
            "role": {"type": "string", "enum": ["assistant"]},
            "content": {"type": "array", "items": ref("ResponseOutputText")},
        },
    }
    s["ResponseFunctionCall"] = {
        "type": "object",
        "required": ["type", "id", "status", "call_id", "name", "arguments"],
        "properties": {
            "type": {"type": "string", "enum": ["function_call"]},
            "id": {"type": "string"},
            "status": status,
            "call_id": {"type": "string"},
            "name": {"type": "string"},
            "arguments": {"type": "string", "description": "A JSON object, as text."},
        },
    }
    s["ResponseOutputItem"] = {"oneOf": [ref("ResponseOutputMessage"), ref("ResponseFunctionCall")]}
    count = {"type": "integer", "minimum": 0}
    s["ResponseUsage"] = {
        "type": "object",
        "required": [
            "input_tokens", "input_tokens_details", "output_tokens", "output_tokens_details",
            "total_tokens",
        ],
        "properties": {
            "input_tokens": count,
            "input_tokens_details": {
                "type": "object",
                "description": "Prompt-cache hits are not counted per request (0).",
                "properties": {"cached_tokens": count, "cache_write_tokens": count},
            },
            "output_tokens": count,
            "output_tokens_details": {
                "type": "object",
                "properties": {"reasoning_tokens": count},
            },
            "total_tokens": count,
        },
    }  # fmt: skip
    s["Response"] = {
        "type": "object",
        "required": [
            "id", "object", "created_at", "status", "error", "incomplete_details",
            "instructions", "model", "output", "parallel_tool_calls", "tool_choice", "tools",
            "temperature", "top_p", "usage",
        ],
        "description": "OpenAI's response object; `usage` is null until it is done.",
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["response"]},
            "created_at": {"type": "integer", "minimum": 0},
            "status": {"type": "string", "enum": ["in_progress", "completed", "incomplete"]},
            "background": {"type": "boolean"},
            "completed_at": {"type": "integer", "nullable": True},
            "error": {"type": "object", "nullable": True},
            "incomplete_details": {
                "type": "object",
                "nullable": True,
                "properties": {"reason": {"type": "string", "enum": ["max_output_tokens"]}},
            },
            "instructions": {"type": "string", "nullable": True},
            "max_output_tokens": {"type": "integer", "nullable": True},
            "max_tool_calls": {"type": "integer", "nullable": True},
            "model": {"type": "string"},
            "output": {"type": "array", "items": ref("ResponseOutputItem")},
            "parallel_tool_calls": {"type": "boolean"},
            "previous_response_id": {"type": "string", "nullable": True},
            "reasoning": {"type": "object"},
            "store": {"type": "boolean"},
            "temperature": {"type": "number"},
            "text": {"type": "object"},
            "tool_choice": {"oneOf": [{"type": "string"}, {"type": "object"}]},
            "tools": {"type": "array", "items": ref("ResponseFunctionTool")},
            "top_logprobs": {"type": "integer", "minimum": 0},
            "top_p": {"type": "number"},
            "truncation": {"type": "string", "enum": ["disabled"]},
            "usage": nullable(ref("ResponseUsage")),
            "user": {"type": "string", "nullable": True},
            "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    }  # fmt: skip

    # the stream's events
    item = {"item_id": {"type": "string"}, "output_index": count}
    text_logprobs = {"type": "array", "items": {"type": "object"}}
    events = {
        "ResponseCreatedEvent": ("response.created", ["response"], {"response": ref("Response")}),
        "ResponseInProgressEvent": (
            "response.in_progress", ["response"], {"response": ref("Response")},
        ),
        "ResponseOutputItemAddedEvent": (
            "response.output_item.added", ["output_index", "item"],
            {"output_index": count, "item": ref("ResponseOutputItem")},
        ),
        "ResponseContentPartAddedEvent": (
            "response.content_part.added", ["item_id", "output_index", "content_index", "part"],
            {**item, "content_index": count, "part": ref("ResponseOutputText")},
        ),
        "ResponseTextDeltaEvent": (
            "response.output_text.delta",
            ["item_id", "output_index", "content_index", "delta", "logprobs"],
            {**item, "content_index": count, "delta": {"type": "string"},
             "logprobs": text_logprobs},
        ),
        "ResponseTextDoneEvent": (
            "response.output_text.done",
            ["item_id", "output_index", "content_index", "text", "logprobs"],
            {**item, "content_index": count, "text": {"type": "string"}, "logprobs": text_logprobs},
        ),
        "ResponseContentPartDoneEvent": (
            "response.content_part.done", ["item_id", "output_index", "content_index", "part"],
            {**item, "content_index": count, "part": ref("ResponseOutputText")},
        ),
        "ResponseFunctionCallArgumentsDeltaEvent": (
            "response.function_call_arguments.delta", ["item_id", "output_index", "delta"],
            {**item, "delta": {"type": "string"}},
        ),
        "ResponseFunctionCallArgumentsDoneEvent": (
            "response.function_call_arguments.done", ["item_id", "output_index", "arguments"],
            {**item, "arguments": {"type": "string"}},
        ),
        "ResponseOutputItemDoneEvent": (
            "response.output_item.done", ["output_index", "item"],
            {"output_index": count, "item": ref("ResponseOutputItem")},
        ),
        "ResponseCompletedEvent": (
            "response.completed", ["response"], {"response": ref("Response")},
        ),
        "ResponseIncompleteEvent": (
            "response.incomplete", ["response"], {"response": ref("Response")},
        ),
        "ResponseErrorEvent": (
            "error", ["code", "message", "param"],
            {
                "code": {"type": "string", "enum": ERROR_TYPES, "description": "error_type"},
                "message": {"type": "string"},
                "param": {"type": "string", "nullable": True},
            },
        ),
    }  # fmt: skip
    for name, (kind, required, properties) in events.items():
        s[name] = _response_event(kind, required, properties)
    s["ResponseStreamEvent"] = {
        "oneOf": [ref(name) for name in events],
        "description": "`event: <type>` and `data: {json}` per event, in OpenAI's order:"
        " response.created, response.in_progress, then per output item"
        " response.output_item.added, (a message) response.content_part.added,"
        " response.output_text.delta..., response.output_text.done,"
        " response.content_part.done, or (a function call)"
        " response.function_call_arguments.delta..., response.function_call_arguments.done,"
        " then response.output_item.done; last response.completed, or response.incomplete"
        " when max_output_tokens cut it short. No `[DONE]`. A stream that fails after it"
        " started ends with an `error` event.",
    }
    return s


# Anthropic's Messages API ---------------------------------------------------------------

ANTHROPIC_STOP_REASONS = ["end_turn", "max_tokens", "stop_sequence", "tool_use"]


def _anthropic_event(kind: str, required: list[str], properties: dict) -> dict:
    """One stream event's data: its `type` and fields."""
    return {
        "type": "object",
        "required": ["type", *required],
        "properties": {"type": {"type": "string", "enum": [kind]}, **properties},
    }


def anthropic_schemas() -> dict:
    """/v1/messages' message object and stream events, count_tokens' answer and the face's
    error body (its requests are protocol models: OPENAI_REQUESTS)."""
    s: dict = {}
    count = {"type": "integer", "minimum": 0}
    s["AnthropicUsage"] = {
        "type": "object",
        "required": [
            "input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens",
            "output_tokens",
        ],
        "description": "input_tokens + cache_read_input_tokens is the prompt's length: the"
        " tokens the prefix cache served are apart. Nothing is written to a cache at a price"
        " (cache_creation_input_tokens is 0). In message_start: the whole prompt as"
        " input_tokens, nothing generated yet; message_delta's are the totals.",
        "properties": {
            "input_tokens": count,
            "cache_creation_input_tokens": count,
            "cache_read_input_tokens": count,
            "output_tokens": count,
        },
    }  # fmt: skip
    s["AnthropicTextBlock"] = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
    }
    s["AnthropicThinkingBlock"] = {
        "type": "object",
        "required": ["type", "thinking", "signature"],
        "description": "A reasoning model's thinking (before the answer's blocks).",
        "properties": {
            "type": {"type": "string", "enum": ["thinking"]},
            "thinking": {"type": "string"},
            "signature": {"type": "string", "description": "Always empty: nothing is signed."},
        },
    }
    s["AnthropicToolUseBlock"] = {
        "type": "object",
        "required": ["type", "id", "name", "input"],
        "properties": {
            "type": {"type": "string", "enum": ["tool_use"]},
            "id": {"type": "string"},
            "name": {"type": "string"},
            "input": {
                "type": "object",
                "description": "Valid against the tool's input_schema; `{}` for a call cut short.",
            },
        },
    }
    s["AnthropicContentBlock"] = {
        "oneOf": [
            ref("AnthropicTextBlock"), ref("AnthropicThinkingBlock"), ref("AnthropicToolUseBlock"),
        ]
    }  # fmt: skip
    s["AnthropicMessage"] = {
        "type": "object",
        "required": [
            "id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage",
        ],
        "description": "Anthropic's message object; in message_start, without content and"
        " stop_reason yet.",
        "properties": {
            "id": {"type": "string"},
            "type": {"type": "string", "enum": ["message"]},
            "role": {"type": "string", "enum": ["assistant"]},
            "model": {"type": "string"},
            "content": {"type": "array", "items": ref("AnthropicContentBlock")},
            "stop_reason": {"type": "string", "enum": ANTHROPIC_STOP_REASONS, "nullable": True},
            "stop_sequence": {"type": "string", "nullable": True},
            "usage": ref("AnthropicUsage"),
        },
    }  # fmt: skip
    anthropic_types = sorted(
        {kind for _, kind in [*ANTHROPIC_ERRORS.values(), ANTHROPIC_TOO_LARGE]}
    )
    s["AnthropicErrorResponse"] = {
        "type": "object",
        "required": ["type", "error"],
        "description": "Every error of Anthropic's face, in Anthropic's shape.",
        "properties": {
            "type": {"type": "string", "enum": ["error"]},
            "error": {
                "type": "object",
                "required": ["type", "message"],
                "properties": {
                    "type": {"type": "string", "enum": anthropic_types},
                    "message": {"type": "string"},
                },
            },
        },
    }
    s["CountTokensResponse"] = {
        "type": "object",
        "required": ["input_tokens"],
        "properties": {"input_tokens": {**count, "description": "The prompt's tokens."}},
    }

    def delta(kind: str, field: str) -> dict:
        return {
            "type": "object",
            "required": ["type", field],
            "properties": {"type": {"type": "string", "enum": [kind]}, field: {"type": "string"}},
        }

    index = {"index": count}
    events = {
        "AnthropicMessageStartEvent": (
            "message_start", ["message"], {"message": ref("AnthropicMessage")},
        ),
        "AnthropicContentBlockStartEvent": (
            "content_block_start", ["index", "content_block"],
            {**index, "content_block": ref("AnthropicContentBlock")},
        ),
        "AnthropicPingEvent": ("ping", [], {}),
        "AnthropicContentBlockDeltaEvent": (
            "content_block_delta", ["index", "delta"],
            {
                **index,
                "delta": {
                    "oneOf": [
                        delta("text_delta", "text"),
                        delta("input_json_delta", "partial_json"),
                        delta("thinking_delta", "thinking"),
                        delta("signature_delta", "signature"),
                    ]
                },
            },
        ),
        "AnthropicContentBlockStopEvent": ("content_block_stop", ["index"], index),
        "AnthropicMessageDeltaEvent": (
            "message_delta", ["delta", "usage"],
            {
                "delta": {
                    "type": "object",
                    "required": ["stop_reason", "stop_sequence"],
                    "properties": {
                        "stop_reason": {"type": "string", "enum": ANTHROPIC_STOP_REASONS},
                        "stop_sequence": {"type": "string", "nullable": True},
                    },
                },
                "usage": ref("AnthropicUsage"),
            },
        ),
        "AnthropicMessageStopEvent": ("message_stop", [], {}),
    }  # fmt: skip
    for name, (kind, required, properties) in events.items():
        s[name] = _anthropic_event(kind, required, properties)
    s["AnthropicStreamEvent"] = {
        "oneOf": [*(ref(name) for name in events), ref("AnthropicErrorResponse")],
        "description": "`event: <type>` and `data: {json}` per event, in Anthropic's order:"
        " message_start; per content block content_block_start, content_block_delta...,"
        " content_block_stop (a ping after the first block's start); message_delta,"
        " message_stop. A stream that fails after it started ends with an `error` event.",
    }
    return s


# (status, Anthropic's type) of the errors Anthropic's routes answer, by status
ANTHROPIC_ERROR_DESCRIPTIONS = {
    400: "Invalid request (malformed JSON, a field refused by name, validation)",
    401: "A valid API key is required (servers started with --api-key): `x-api-key` or"
    " `authorization: Bearer`",
    404: "The model names no served LoRA adapter (when adapters are served)",
    413: "Payload too large: the request body is limited to 2 MB",
    429: "The server is full (--max-concurrent-requests): come back after `retry-after`",
    500: "Generation failed",
    504: "The upstream did not answer in time",
    529: "No replica can take the request now (starting, draining or down)",
}
ANTHROPIC_TYPE_BY_STATUS = {
    **{status: kind for status, kind in ANTHROPIC_ERRORS.values()},
    ANTHROPIC_TOO_LARGE[0]: ANTHROPIC_TOO_LARGE[1],
}


def anthropic_operation(operation_: dict, statuses) -> dict:
    """An operation of Anthropic's face: its tag and errors (Anthropic's shape and statuses)."""
    operation_["tags"] = ["anthropic"]
    responses = {"200": operation_["responses"]["200"]}
    for status in statuses:
        description = ANTHROPIC_ERROR_DESCRIPTIONS[status]
        example = {
            "type": "error",
            "error": {"type": ANTHROPIC_TYPE_BY_STATUS[status], "message": description},
        }
        responses[str(status)] = {
            "description": description,
            "content": {
                "application/json": {"schema": ref("AnthropicErrorResponse"), "example": example}
            },
        }
    operation_["responses"] = responses
    return operation_


# stored responses, the tokenizer routes, /version --------------------------------------


def stored_response_schemas() -> dict:
    """GET/DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items."""
    s: dict = {}
    s["ResponseInputMessageItem"] = {
        "type": "object",
        "required": ["type", "id", "role", "content", "status"],
        "description": "A message given as input (OpenAI's input message item).",
        "properties": {
            "type": {"type": "string", "enum": ["message"]},
            "id": {"type": "string"},
            "role": {"type": "string", "enum": ["user", "system", "developer"]},
            "content": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["type"],
                    "properties": {
                        "type": {"type": "string", "enum": ["input_text", "refusal"]},
                        "text": {"type": "string"},
                        "refusal": {"type": "string"},
                    },
                },
            },
            "status": {"type": "string", "enum": ["completed"]},
        },
    }
    s["ResponseFunctionCallOutputItem"] = {
        "type": "object",
        "required": ["type", "id", "call_id", "output", "status"],
        "properties": {
            "type": {"type": "string", "enum": ["function_call_output"]},
            "id": {"type": "string"},
            "call_id": {"type": "string"},
            "output": {"type": "string"},
            "status": {"type": "string", "enum": ["completed"]},
        },
    }
    s["ResponseItem"] = {
        "description": "An item a response was made from: an input message, an earlier"
        " answer (an output message or function call), or a function call's result.",
        "anyOf": [
            ref("ResponseInputMessageItem"),
            ref("ResponseOutputMessage"),
            ref("ResponseFunctionCall"),
            ref("ResponseFunctionCallOutputItem"),
        ],
    }
    s["ResponseItemList"] = {
        "type": "object",
        "required": ["object", "data", "first_id", "last_id", "has_more"],
        "properties": {
            "object": {"type": "string", "enum": ["list"]},
            "data": {"type": "array", "items": ref("ResponseItem")},
            "first_id": {"type": "string", "nullable": True},
            "last_id": {"type": "string", "nullable": True},
            "has_more": {"type": "boolean"},
        },
    }
    s["DeletedResponse"] = {
        "type": "object",
        "required": ["id", "object", "deleted"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["response"]},
            "deleted": {"type": "boolean", "enum": [True]},
        },
    }
    return s


def tokenizer_schemas() -> dict:
    """POST /tokenize (TGI's body or vLLM's), POST /detokenize, GET /version."""
    s: dict = {}
    model = {"type": "string", "nullable": True, "description": protocol.COMPATIBILITY_ONLY}
    s["TokenizeRequest"] = {
        "description": "TGI's body (`inputs`; only `parameters.truncate` is read), or vLLM's"
        " (`prompt`, or `messages`).",
        "anyOf": [
            ref("GenerateRequest"),
            ref("VllmTokenizeRequest"),
            ref("VllmTokenizeChatRequest"),
        ],
    }
    s["VllmTokenizeResponse"] = {
        "type": "object",
        "required": ["count", "max_model_len", "tokens", "token_strs"],
        "properties": {
            "count": {"type": "integer", "minimum": 0},
            "max_model_len": {
                "type": "integer",
                "minimum": 0,
                "description": "The longest prompt plus generation (max_total_tokens).",
            },
            "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "token_strs": {"type": "array", "items": {"type": "string"}, "nullable": True},
        },
    }
    s["DetokenizeRequest"] = {
        "type": "object",
        "required": ["tokens"],
        "properties": {
            "model": model,
            "tokens": {
                "type": "array",
                "items": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
                "description": "Token ids of the model's vocabulary (others are refused).",
            },
        },
    }
    s["DetokenizeResponse"] = {
        "type": "object",
        "required": ["prompt"],
        "properties": {"prompt": {"type": "string", "description": "Special tokens included."}},
    }
    s["Version"] = {
        "type": "object",
        "required": ["version"],
        "properties": {
            "version": {"type": "string"},
            "commit": {
                "type": "string",
                "description": "The git commit served; absent when the build did not record it.",
            },
        },
    }
    return s


RESPONSE_ID = {
    "name": "response_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
    "description": "A response id, as POST /v1/responses answered it.",
}
INPUT_ITEMS_QUERY = [
    {
        "name": "limit",
        "in": "query",
        "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
    },
    {
        "name": "order",
        "in": "query",
        "schema": {"type": "string", "enum": ["asc", "desc"], "default": "desc"},
    },
    {
        "name": "after",
        "in": "query",
        "schema": {"type": "string"},
        "description": "An item id: the items after it.",
    },
    {
        "name": "before",
        "in": "query",
        "schema": {"type": "string"},
        "description": "An item id: the items before it.",
    },
]


def stored_response_paths(tgi_paths: dict, ok) -> dict:
    json_ = "application/json"
    where = (
        " From the store of the replica that made it (behind `textgen proxy`, the id routes"
        " there); `not_found` when it is not kept (never stored, expired, evicted, deleted,"
        " or its replica is gone)."
    )
    retrieve = operation(
        tgi_paths,
        "/v1/responses/{response_id}",
        "get",
        summary="A stored response object, as it completed." + where,
        ok=ok("The response object", {json_: ref("Response")}),
        errors=STORE_ERRORS,
    )
    delete = operation(
        tgi_paths,
        "/v1/responses/{response_id}",
        "delete",
        summary="Forget a stored response." + where,
        ok=ok("Deleted", {json_: ref("DeletedResponse")}),
        errors=STORE_ERRORS,
    )
    items = operation(
        tgi_paths,
        "/v1/responses/{response_id}/input_items",
        "get",
        summary="The items a stored response was made from (the previous response's items"
        " and output first, when it continued one), a page at a time." + where,
        ok=ok("A page of items", {json_: ref("ResponseItemList")}),
        errors=STORE_ERRORS,
    )
    retrieve["operationId"], delete["operationId"] = "retrieve_response", "delete_response"
    items["operationId"] = "list_response_input_items"
    retrieve["parameters"] = delete["parameters"] = [RESPONSE_ID]
    items["parameters"] = [RESPONSE_ID, *INPUT_ITEMS_QUERY]
    return {
        "/v1/responses/{response_id}": {"get": retrieve, "delete": delete},
        "/v1/responses/{response_id}/input_items": {"get": items},
    }


# paths ------------------------------------------------------------------------------

# (status, error_type, description) of the errors each kind of route can answer.
ERRORS = {
    401: (E.UNAUTHENTICATED, "A valid API key is required (servers started with --api-key)"),
    413: (E.VALIDATION, "Payload too large: the request body is limited to 2 MB"),
    404: (E.NOT_FOUND, "No response with that id is kept by its replica"),
    422: (E.VALIDATION, "Input validation error (also malformed JSON or a wrong field type)"),
    424: (E.GENERATION, "Generation error"),
    429: (E.OVERLOADED, "Model is overloaded"),
    500: (E.INCOMPLETE_GENERATION, "Incomplete generation"),
    503: (E.UNAVAILABLE, "No replica is ready (starting, draining or down)"),
    504: (E.TIMEOUT, "The upstream did not answer in time"),
}
# the vocabulary's statuses (413 is Envoy's payload limit, typed validation)
assert all(t.http_status == s for s, (t, _) in ERRORS.items() if s != 413)
GENERATION_ERRORS = (401, 413, 422, 424, 429, 500, 503)
BODY_ERRORS = (401, 413, 422, 503, 504)
QUICK_ERRORS = (401, 503, 504)
STORE_ERRORS = (401, 404, 422, 503, 504)


def error_responses(statuses, openai: bool) -> dict:
    out = {}
    for status in statuses:
        error_type, description = ERRORS[status]
        if openai:
            example = {
                "error": {"message": description, "type": error_type, "param": None, "code": None}
            }
        else:
            example = {"error": description, "error_type": error_type}
        schema = ref("OpenAIErrorResponse" if openai else "ErrorResponse")
        out[str(status)] = {
            "description": description,
            "content": {"application/json": {"schema": schema, "example": example}},
        }
    return out


def operation(
    tgi_paths: dict, path: str, method: str, *, summary=None, request=None, ok=None, errors=()
) -> dict:
    base = tgi_paths.get(path, {}).get(method, {})
    op = {
        "tags": ["openai" if path.startswith("/v1/") else "tgi"],
        "summary": summary or base.get("summary", ""),
        "operationId": base.get("operationId") or path.strip("/").replace("/", "_"),
    }
    if request:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": ref(request)}},
        }
    op["responses"] = {"200": ok, **error_responses(errors, path.startswith("/v1/"))}
    return op


def paths(tgi_paths: dict) -> dict:
    json_ = "application/json"
    sse = "text/event-stream"

    def ok(description: str, media: dict) -> dict:
        return {"description": description, "content": {m: {"schema": s} for m, s in media.items()}}

    health = operation(
        tgi_paths,
        "/health",
        "get",
        ok=ok("The engine is running", {json_: {"type": "object", "maxProperties": 0}}),
        errors=(401,),
    )
    health["responses"]["503"] = {
        "description": "The engine is down, or the replica is draining or unreachable",
        "content": {
            json_: {
                "schema": ref("ErrorResponse"),
                "example": {"error": "unhealthy", "error_type": "healthcheck"},
            }
        },
    }
    # SageMaker's routes (TGI's router serves both; envoy/lua.py routes them)
    ping = copy.deepcopy(health)
    ping.update(summary="SageMaker's health check: GET /health", operationId="ping")
    invocations = operation(
        tgi_paths,
        "/invocations",
        "post",
        summary="SageMaker's inference route: TGI's body as POST / (`stream` switching),"
        " OpenAI chat's (`messages`) as /v1/chat/completions, OpenAI completions' (`prompt`)"
        " as /v1/completions",
        request="SagemakerRequest",
        ok=ok(
            "What the route the body picks answers",
            {
                json_: {
                    "anyOf": [
                        {"type": "array", "items": ref("GenerateResponse")},
                        ref("ChatCompletion"),
                        ref("CompletionFinal"),
                    ]
                },
                sse: {
                    "anyOf": [
                        sse_event("StreamEvent"),
                        sse_event("ChatStreamEvent", done=True),
                        sse_event("CompletionStreamEvent", done=True),
                    ]
                },
            },
        ),
        errors=GENERATION_ERRORS,
    )
    for status, answer in invocations["responses"].items():
        if status != "200":  # TGI's error body, OpenAI's for an OpenAI body
            media = answer["content"]["application/json"]
            media["schema"] = {"anyOf": [ref("ErrorResponse"), ref("OpenAIErrorResponse")]}
    return {
        "/": {
            "post": operation(
                tgi_paths,
                "/",
                "post",
                request="CompatGenerateRequest",
                ok=ok(
                    "Generated text: a one-element array, or an SSE stream when `stream` is true",
                    {
                        json_: {"type": "array", "items": ref("GenerateResponse")},
                        sse: sse_event("StreamEvent"),
                    },
                ),
                errors=GENERATION_ERRORS,
            )
        },
        "/generate": {
            "post": operation(
                tgi_paths,
                "/generate",
                "post",
                request="GenerateRequest",
                ok=ok("Generated text", {json_: ref("GenerateResponse")}),
                errors=GENERATION_ERRORS,
            )
        },
        "/generate_stream": {
            "post": operation(
                tgi_paths,
                "/generate_stream",
                "post",
                request="GenerateRequest",
                ok=ok(
                    "Server-sent events, one per token (`data: {json}`); best_of > 1 and"
                    " decoder_input_details are refused",
                    {sse: sse_event("StreamEvent")},
                ),
                errors=GENERATION_ERRORS,
            )
        },
        "/health": {"get": health},
        "/ping": {"get": ping},
        "/invocations": {"post": invocations},
        "/info": {
            "get": operation(
                tgi_paths,
                "/info",
                "get",
                ok=ok("Served model info", {json_: ref("Info")}),
                errors=QUICK_ERRORS,
            )
        },
        "/metrics": {
            "get": operation(
                tgi_paths,
                "/metrics",
                "get",
                ok=ok("Prometheus text exposition format", {"text/plain": {"type": "string"}}),
                errors=QUICK_ERRORS,
            )
        },
        "/tokenize": {
            "post": operation(
                tgi_paths,
                "/tokenize",
                "post",
                summary="Tokenize TGI's `inputs` (only `parameters.truncate` is read), or"
                " vLLM's `prompt` or `messages` (through the chat template)",
                request="TokenizeRequest",
                ok=ok(
                    "TGI's body: the tokens, as a bare array; vLLM's: vLLM's answer",
                    {json_: {"anyOf": [ref("TokenizeResponse"), ref("VllmTokenizeResponse")]}},
                ),
                errors=BODY_ERRORS,
            )
        },
        "/detokenize": {
            "post": operation(
                tgi_paths,
                "/detokenize",
                "post",
                summary="Token ids back to text (vLLM's /detokenize)",
                request="DetokenizeRequest",
                ok=ok("The text", {json_: ref("DetokenizeResponse")}),
                errors=BODY_ERRORS,
            )
        },
        "/version": {
            "get": operation(
                tgi_paths,
                "/version",
                "get",
                summary="textgen's version and the git commit it was built from",
                ok=ok("The version", {json_: ref("Version")}),
                errors=QUICK_ERRORS,
            )
        },
        "/v1/chat/completions": {
            "post": operation(
                tgi_paths,
                "/v1/chat/completions",
                "post",
                summary="OpenAI chat completions",
                request="ChatRequest",
                ok=ok(
                    "A chat completion, or an SSE stream of chunks ending `data: [DONE]` "
                    "when `stream` is true",
                    {json_: ref("ChatCompletion"), sse: sse_event("ChatStreamEvent", done=True)},
                ),
                errors=GENERATION_ERRORS,
            )
        },
        "/v1/completions": {
            "post": operation(
                tgi_paths,
                "/v1/completions",
                "post",
                summary="OpenAI (legacy) completions",
                request="CompletionRequest",
                ok=ok(
                    "A completion, or an SSE stream of chunks ending `data: [DONE]` "
                    "when `stream` is true",
                    {
                        json_: ref("CompletionFinal"),
                        sse: sse_event("CompletionStreamEvent", done=True),
                    },
                ),
                errors=GENERATION_ERRORS,
            )
        },
        "/v1/responses": {
            "post": operation(
                tgi_paths,
                "/v1/responses",
                "post",
                summary="OpenAI Responses API",
                request="ResponsesRequest",
                ok=ok(
                    "A response object, or an SSE stream of its events when `stream` is true",
                    {json_: ref("Response"), sse: sse_event("ResponseStreamEvent")},
                ),
                errors=GENERATION_ERRORS,
            )
        },
        "/v1/models": {
            "get": operation(
                tgi_paths,
                "/v1/models",
                "get",
                summary="The served models (OpenAI's list)",
                ok=ok(
                    "The base model and every LoRA adapter served",
                    {json_: ref("ModelList")},
                ),
                errors=QUICK_ERRORS,
            )
        },
        "/v1/messages": {
            "post": anthropic_operation(
                operation(
                    tgi_paths,
                    "/v1/messages",
                    "post",
                    summary="Anthropic's Messages API: a message",
                    request="MessagesRequest",
                    ok=ok(
                        "A message, or Anthropic's server-sent events when `stream` is true",
                        {json_: ref("AnthropicMessage"), sse: sse_event("AnthropicStreamEvent")},
                    ),
                ),
                (400, 401, 404, 413, 429, 500, 529),
            )
        },
        "/v1/messages/count_tokens": {
            "post": anthropic_operation(
                operation(
                    tgi_paths,
                    "/v1/messages/count_tokens",
                    "post",
                    summary="Anthropic's token count: the tokens a message's prompt takes",
                    request="CountTokensRequest",
                    ok=ok("The prompt's tokens", {json_: ref("CountTokensResponse")}),
                ),
                (400, 401, 413, 504, 529),
            )
        },
        **stored_response_paths(tgi_paths, ok),
        "/v1/load_lora_adapter": {
            "post": operation(
                tgi_paths,
                "/v1/load_lora_adapter",
                "post",
                summary="Load a LoRA adapter at run time (vLLM's route; needs LoRA slots:"
                " --lora-adapters or --max-loras)",
                request="LoadLoraAdapterRequest",
                ok=ok("The adapter is served", {json_: ref("LoraAdapterResponse")}),
                errors=BODY_ERRORS,
            )
        },
        "/v1/unload_lora_adapter": {
            "post": operation(
                tgi_paths,
                "/v1/unload_lora_adapter",
                "post",
                summary="Stop serving a LoRA adapter (vLLM's route); its running requests"
                " finish with it",
                request="UnloadLoraAdapterRequest",
                ok=ok("The adapter is no longer served", {json_: ref("LoraAdapterResponse")}),
                errors=BODY_ERRORS,
            )
        },
    }


def version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def build(tgi_spec: Path = TGI_SPEC) -> dict:
    tgi = clean(json.loads(tgi_spec.read_text()))
    tgi_components = tgi["components"]["schemas"]
    schemas = {
        **tgi_schemas(tgi_components),
        **openai_schemas(tgi_components),
        **openai_request_schemas(),
        **responses_schemas(),
        **stored_response_schemas(),
        **tokenizer_schemas(),
        **anthropic_schemas(),
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "textgen",
            "description": "textgen's HTTP face, served by Envoy from the gRPC contract"
            " (api/textgen/v1): TGI's routes, OpenAI's under /v1/ and Anthropic's Messages"
            " API under /v1/messages. Derived from Text"
            f" Generation Inference {tgi['info']['version']}'s published API"
            " (scripts/make_openapi.py). The same port also serves native gRPC.",
            "license": {"name": "Apache 2.0", "identifier": "Apache-2.0"},
            "version": version(),
        },
        "tags": [
            {"name": "tgi", "description": "Text Generation Inference's routes"},
            {"name": "openai", "description": "OpenAI's routes"},
            {"name": "anthropic", "description": "Anthropic's Messages API"},
        ],
        "paths": paths31(paths(tgi["paths"])),
        "components": {
            "schemas": {name: schema31(schemas[name]) for name in sorted(schemas)},
            "securitySchemes": {
                "api_key": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "Needed only when the server runs with --api-key.",
                },
                "x_api_key": {
                    "type": "apiKey",
                    "in": "header",
                    "name": "x-api-key",
                    "description": "Anthropic's header for the same key (any route).",
                },
            },
        },
        "security": [{}, {"api_key": []}, {"x_api_key": []}],
    }


def render(spec: dict) -> str:
    return json.dumps(spec, indent=1, ensure_ascii=False) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    out = parser.parse_args().out
    out.write_text(render(build()))


if __name__ == "__main__":
    main()
