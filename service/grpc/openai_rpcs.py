"""OpenAI's RPCs (HttpBody in, HttpBody out): parse with service.openai, validate and
generate exactly as the TGI RPCs do, write OpenAI's bytes."""

from __future__ import annotations

import time

from google.api import httpbody_pb2

from ..engine.types import EngineError, TokenEvent
from ..openai.chat import (
    DONE,
    ChatRenderer,
    OpenAIRequestError,
    StopHoldback,
    parse_chat_request,
    sse_error,
)
from ..validation import ValidationError
from .errors import ServiceError, abort

JSON = "application/json"
SSE = "text/event-stream"


class OpenAIRpcs:
    """Mixed into TextGenerationServicer (uses its engine, validator, admission)."""

    async def ChatCompletions(self, request, context):
        arrival = time.monotonic()
        try:
            self.admission.acquire()
        except ServiceError as exc:
            await abort(context, exc.message, exc.error_type)
        try:
            try:
                chat = parse_chat_request(request.data, self.validator.tokenizer)
                valid = self.validator.validate(chat.generate, stream=chat.stream, arrival_time=arrival)
            except (OpenAIRequestError, ValidationError) as exc:
                await abort(context, exc.message, "validation")
            renderer = ChatRenderer(self.served.info.model_id, f"textgen-{self.served.info.version}", chat)
            if chat.stream:
                async for body in self._chat_stream(renderer, valid, context):
                    yield body
            else:
                try:
                    events = [e async for e in self.engine.generate(valid.engine_request)]
                except EngineError as exc:
                    await abort(context, exc.message, exc.error_type)
                yield httpbody_pb2.HttpBody(content_type=JSON, data=renderer.completion(events))
        finally:
            self.admission.release()

    async def _chat_stream(self, renderer: ChatRenderer, valid, context):
        holdback = StopHoldback(renderer.request.stop)
        sent_any = False
        try:
            async for event in self.engine.generate(valid.engine_request):
                if not sent_any:
                    yield _sse(renderer.first_chunk())
                    sent_any = True
                for body in self._chat_event(renderer, holdback, event):
                    yield body
        except EngineError as exc:
            if sent_any:
                yield _sse(sse_error(exc.message, exc.error_type))
            await abort(context, exc.message, exc.error_type)

    def _chat_event(self, renderer: ChatRenderer, holdback: StopHoldback, event: TokenEvent):
        final = event.finish is not None
        text = "" if event.token.special else event.token.text
        delta = holdback.feed(text, final)
        if delta or (renderer.request.logprobs and not event.token.special):
            yield _sse(renderer.content_chunk(delta, event if renderer.request.logprobs else None))
        if final:
            yield _sse(renderer.final_chunk(event.finish))
            if renderer.request.include_usage:
                yield _sse(renderer.usage_chunk(event.finish))
            yield _sse(DONE)


def _sse(data: bytes) -> httpbody_pb2.HttpBody:
    return httpbody_pb2.HttpBody(content_type=SSE, data=data)
