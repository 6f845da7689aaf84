"""The tokenizer's RPCs: Tokenize (TGI's, native gRPC), TokenizeBody (POST /tokenize:
TGI's body or vLLM's) and Detokenize (vLLM's /detokenize).

POST /tokenize was the transcoded Tokenize RPC; it takes a raw body now so that vLLM's
body can share the route. A TGI body is parsed into the same TokenizeRequest (what the
transcoder did, unknown fields dropped) and answered with the bytes the transcoder
printed: TGI's bare array, compact, strings escaped as protobuf's JSON printer escapes
them (`<` and `>`, controls, a few invisible code points as \\uXXXX; other non-ASCII raw).
"""

from __future__ import annotations

import asyncio
import json
import re

from google.api import httpbody_pb2
from google.protobuf import json_format

from ..errors import ErrorType
from ..intake.validation import ValidationError
from ..openai.vllm_tokenize import (
    VllmTokenize,
    check_token_ids,
    is_vllm_tokenize,
    parse_vllm_tokenize,
    tokenize_answer,
)
from ..proto import text_generation_service_pb2 as svc_pb
from .errors import abort

JSON = "application/json"


class TokenizeRpcs:
    """Mixed into TextGenerationServicer (uses its validator and served model)."""

    async def Tokenize(self, request, context):
        if not request.inputs:
            await abort(context, "`inputs` cannot be empty", ErrorType.VALIDATION, "inputs")
        truncate = request.parameters.truncate if request.parameters.HasField("truncate") else None
        return svc_pb.TokenizeResponse(tokens=self._tgi_tokens(request.inputs, truncate))

    async def TokenizeBody(self, request, context):
        try:
            data = json.loads(request.data or b"null")
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            data = None  # TGI's parser below says what is wrong
        if not is_vllm_tokenize(data):
            return _json(tgi_tokens_json((await self._tgi_request(request.data, context)).tokens))
        tokenizer = self.validator.tokenizer
        try:
            ids, req = await self._vllm_tokens(data)
        except ValidationError as exc:  # OpenAIRequestError included
            await abort(context, exc.message, ErrorType.VALIDATION, exc.param)
        strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return _json(tokenize_answer(ids, self.served.info.max_total_tokens, strs))

    async def _vllm_tokens(self, data: dict) -> tuple[list[int], VllmTokenize]:
        """vLLM's body, parsed, and its token ids; a vision-language model's on a worker
        thread, since it may fetch and decode images and its processor resizes them."""
        validator = self.validator

        def tokens() -> tuple[list[int], VllmTokenize]:
            req = parse_vllm_tokenize(data, validator.tokenizer, validator.image_limits)
            return _vllm_ids(req, validator), req

        if validator.images is None:
            return tokens()
        return await asyncio.to_thread(tokens)

    async def Detokenize(self, request, context):
        tokenizer = self.validator.tokenizer
        try:
            ids = check_token_ids(list(request.tokens), len(tokenizer))
        except ValidationError as exc:
            await abort(context, exc.message, ErrorType.VALIDATION, exc.param)
        return svc_pb.DetokenizeResponse(prompt=tokenizer.decode(ids))

    async def _tgi_request(self, body: bytes, context) -> svc_pb.TokenizeResponse:
        """TGI's body -> Tokenize's answer (its typed errors included)."""
        request = svc_pb.TokenizeRequest()
        try:
            json_format.Parse(body or b"{}", request, ignore_unknown_fields=True)
        except (json_format.ParseError, ValueError, RecursionError) as exc:
            await abort(
                context, f"the body is not TGI's tokenize request: {exc}", ErrorType.VALIDATION
            )
        return await self.Tokenize(request, context)

    def _tgi_tokens(self, inputs: str, truncate: int | None) -> list[svc_pb.SimpleToken]:
        enc = self.validator.tokenizer(inputs, add_special_tokens=True, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        if truncate is not None and truncate > 0:
            ids, offsets = ids[-truncate:], offsets[-truncate:]
        return [
            svc_pb.SimpleToken(id=i, text=inputs[a:b], start=a, stop=b)
            for i, (a, b) in zip(ids, offsets)
        ]


def tgi_tokens_json(tokens) -> bytes:
    """TGI's bare array of SimpleTokens, as Envoy's transcoder printed it."""
    return (
        "["
        + ",".join(
            f'{{"id":{t.id},"text":{proto_json_string(t.text)},"start":{t.start},"stop":{t.stop}}}'
            for t in tokens
        )
        + "]"
    ).encode()


# protobuf's JSON printer (json/internal/writer.cc, MustEscape): JSON's own escapes, and
# \u escapes for code points that are unsafe in HTML or JavaScript or invisible.
_SHORT_ESCAPES = {
    "\n": "\\n", "\r": "\\r", "\t": "\\t", '"': '\\"', "\f": "\\f", "\b": "\\b", "\\": "\\\\",
}  # fmt: skip
_ESCAPED = re.compile(
    '[\x00-\x1f"\\\\<>\x7f-\x9f\u00ad\u0600-\u0603\u06dd\u070f\u17b4\u17b5\u200b-\u200f'
    "\u2028-\u202e\u2060-\u2064\u206a-\u206f\ufeff\ufff9-\ufffb\U0001d173-\U0001d17a"
    "\U000e0001\U000e0020-\U000e007f]"
)


def proto_json_string(text: str) -> str:
    """`text` as a JSON string, escaped exactly as protobuf's C++ JSON printer does."""
    return '"' + _ESCAPED.sub(_escape, text) + '"'


def _escape(match: re.Match) -> str:
    char = match.group()
    if char in _SHORT_ESCAPES:
        return _SHORT_ESCAPES[char]
    code = ord(char)
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000  # a UTF-16 surrogate pair
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def _json(data: bytes) -> httpbody_pb2.HttpBody:
    return httpbody_pb2.HttpBody(content_type=JSON, data=data)


def _vllm_ids(req: VllmTokenize, validator) -> list[int]:
    """The prompt's ids: through the processor where it has images (each placeholder
    expanded, as the chat's prompt is), else the tokenizer."""
    if req.images:
        prompt = validator.images.tokenize(
            req.text, req.images, "messages", add_special_tokens=req.add_special_tokens
        )
        return prompt.ids
    return validator.tokenizer(req.text, add_special_tokens=req.add_special_tokens)["input_ids"]
