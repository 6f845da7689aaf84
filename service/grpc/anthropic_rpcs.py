"""Anthropic's Messages API RPCs (HttpBody in, HttpBody out): parse with
service.anthropic, validate and generate as the OpenAI RPCs do, write Anthropic's bytes.
Errors leave as typed statuses; Envoy's Lua filter writes them in Anthropic's shape and
status (service/errors.py ANTHROPIC_ERRORS)."""

from __future__ import annotations

from google.api import httpbody_pb2

from ..anthropic.messages import parse_count_tokens_request, parse_messages_request
from ..anthropic.output import MessageRenderer, MessageStream
from ..engine.types import EngineError
from ..errors import ErrorType, incomplete
from ..intake.validation import ValidationError
from ..openai.common import json_bytes
from .errors import abort
from .openai_rpcs import JSON, model_name, sse_body


class AnthropicRpcs:
    """Mixed into TextGenerationServicer (uses its engine, validator, admission and
    OpenAIRpcs.parse)."""

    async def Messages(self, request, context):
        async with self.request(context, "Messages") as record:
            try:
                req = await self.parse(parse_messages_request, request.data)
            except ValidationError as exc:  # OpenAIRequestError included
                await abort(context, exc.message, exc.error_type, exc.param)
            try:
                valid = await self.validate(
                    req.generate, stream=req.stream, arrival=record.arrival, context=context
                )
            except ValidationError as exc:
                await abort(context, exc.message, _error_type(exc), exc.param)
            record.validated(valid)
            renderer = MessageRenderer(
                model_name(self, valid), req, len(valid.engine_request.prompt_ids)
            )
            async with self.admitted(context, valid):
                if req.stream:
                    async for body in self._messages_stream(renderer, valid, context, record):
                        yield body
                    return
                try:
                    events = [e async for e in self.engine.generate(valid.engine_request)]
                except EngineError as exc:
                    await abort(context, exc.message, exc.error_type)
                record.finished(events[-1].finish)
                yield httpbody_pb2.HttpBody(content_type=JSON, data=renderer.message(events))

    async def _messages_stream(self, renderer: MessageRenderer, valid, context, record):
        """message_start goes with the first token: a failure before it is the RPC's
        status (an HTTP status), one after it an `error` event, then the status."""
        stream = MessageStream(renderer)
        try:
            async for event in self.engine.generate(valid.engine_request):
                if event.finish is not None:
                    record.finished(event.finish)
                for data in stream.events(event):
                    yield sse_body(data)
        except EngineError as exc:
            if not stream.started:
                await abort(context, exc.message, exc.error_type)
            error_type = incomplete(exc.error_type)
            yield sse_body(stream.error(exc.message, error_type))
            await abort(context, exc.message, error_type)

    async def CountMessageTokens(self, request, context):
        try:
            generate = await self.parse(parse_count_tokens_request, request.data)
            count = await self.prompt_length(generate)
        except ValidationError as exc:  # OpenAIRequestError included
            await abort(context, exc.message, exc.error_type, exc.param)
        return httpbody_pb2.HttpBody(content_type=JSON, data=json_bytes({"input_tokens": count}))


def _error_type(exc: ValidationError) -> ErrorType:
    """A validation error's type: Anthropic answers a `model` nothing serves with
    not_found_error (the validator blames `model` only for that: an unknown LoRA
    adapter's name, when adapters are served)."""
    return ErrorType.NOT_FOUND if exc.param == "model" else exc.error_type
