"""OpenAI's RPCs (HttpBody in, HttpBody out): parse with service.openai, validate and
generate exactly as the TGI RPCs do, write OpenAI's bytes; and the Responses API's
stored responses (retrieve, delete, input items)."""

from __future__ import annotations

import asyncio

from google.api import httpbody_pb2
from textgen.envoy.affinity import REPLICA_HEADER

from ..engine.types import EngineError
from ..errors import ErrorType, incomplete
from ..intake.validation import ValidationError
from ..openai import stored_responses
from ..openai.chat import ChatRenderer, ChatStream, parse_chat_request
from ..openai.common import DONE, StopHoldback, finish_reason, sse_error
from ..openai.completions import CompletionRenderer, parse_completion_request
from ..openai.response_store import new_response_id
from ..openai.responses import parse_responses_request
from ..openai.responses_output import ResponseRenderer, ResponseStream
from .errors import abort

JSON = "application/json"
SSE = "text/event-stream"


class OpenAIRpcs:
    """Mixed into TextGenerationServicer (uses its engine, validator, admission and
    responses_store)."""

    async def ChatCompletions(self, request, context):
        async with self.request(context, "ChatCompletions") as record:
            try:
                chat = await self.parse(parse_chat_request, request.data)
                valid = await self.validate(
                    chat.generate, stream=chat.stream, arrival=record.arrival, context=context
                )
            except ValidationError as exc:  # OpenAIRequestError included
                await abort(context, exc.message, ErrorType.VALIDATION, exc.param)
            record.validated(valid)
            renderer = ChatRenderer(
                model_name(self, valid), f"textgen-{self.served.info.version}", chat
            )
            async with self.admitted(context, valid):
                if chat.stream:
                    async for body in self._chat_stream(renderer, valid, context, record):
                        yield body
                    return
                try:
                    runs = await self.collect_choices(valid.engine_request)
                except EngineError as exc:
                    await abort(context, exc.message, exc.error_type)
                record.finished(*(run[-1].finish for run in runs))
                yield httpbody_pb2.HttpBody(content_type=JSON, data=renderer.completion(runs))

    async def parse(self, parse, body: bytes):
        """A face's parse of `body`, with the server's tokenizer, reasoning parser and image
        limits; a vision-language model's on a worker thread, since it may fetch its images
        (blocking, up to --image-fetch-timeout) and decodes them."""
        args = (body, self.validator.tokenizer, self.reasoning_parser, self.validator.image_limits)
        if self.validator.image_limits is None:
            return parse(*args)
        return await asyncio.to_thread(parse, *args)

    async def _chat_stream(self, renderer: ChatRenderer, valid, context, record):
        streams = [ChatStream(renderer, i) for i in range(valid.engine_request.n)]
        finishes = []
        sent_any = False
        try:
            async for event in self.engine.generate(valid.engine_request):
                if event.finish is not None:
                    finishes.append(event.finish)
                for data in streams[event.choice].chunks(event):
                    yield sse_body(data)
                    sent_any = True
        except EngineError as exc:
            if sent_any:
                yield sse_body(sse_error(exc.message, exc.error_type))
            await abort(context, exc.message, exc.error_type)
        record.finished(*finishes)
        if renderer.request.include_usage:
            reasoning = sum(s.reasoning_tokens for s in streams)
            yield sse_body(renderer.usage_chunk(finishes, reasoning))
        yield sse_body(DONE)

    async def Completions(self, request, context):
        async with self.request(context, "Completions") as record:
            info = self.served.info
            try:
                req = parse_completion_request(request.data, info.max_client_batch_size)
                valid = [
                    await self.validate(
                        g, stream=req.stream, arrival=record.arrival, context=context
                    )
                    for g in req.generates
                ]
            except ValidationError as exc:  # OpenAIRequestError included
                await abort(context, exc.message, ErrorType.VALIDATION, exc.param)
            record.validated(valid[0])
            renderer = CompletionRenderer(
                model_name(self, valid[0]), f"textgen-{info.version}", req
            )
            streams = [self.engine.generate(v.engine_request) for v in valid]
            async with self.admitted(context, *valid):
                if req.stream:
                    async for body in self._completion_stream(renderer, streams, context, record):
                        yield body
                    return
                # per prompt, each sampled choice's events
                runs = [[[] for _ in range(req.best_of)] for _ in valid]
                try:
                    async for p, event in _merged(streams):
                        runs[p][event.choice].append(event)
                except EngineError as exc:
                    await abort(context, exc.message, exc.error_type)
                record.finished(*(choice[-1].finish for run in runs for choice in run))
                yield httpbody_pb2.HttpBody(content_type=JSON, data=renderer.completion(runs))

    async def _completion_stream(self, renderer: CompletionRenderer, streams, context, record):
        """Streamed, best_of is n: choice i of prompt p is index p * n + i."""
        req = renderer.request
        holdbacks = [StopHoldback(req.stop) for _ in range(len(streams) * req.n)]
        finishes: list[list] = [[] for _ in streams]  # per prompt
        sent_any = False
        try:
            if req.echo:
                for index in range(len(holdbacks)):
                    yield sse_body(renderer.chunk(index, req.prompts[index // req.n]))
                    sent_any = True
            async for p, event in _merged(streams):
                index = p * req.n + event.choice
                final = event.finish is not None
                text = holdbacks[index].feed(event.text, final)
                if text or (req.logprobs is not None and not event.token.special):
                    yield sse_body(renderer.chunk(index, text, event))
                    sent_any = True
                if final:
                    finishes[p].append(event.finish)
                    yield sse_body(renderer.chunk(index, "", reason=finish_reason(event.finish)))
                    sent_any = True
        except EngineError as exc:
            if sent_any:
                yield sse_body(sse_error(exc.message, exc.error_type))
            await abort(context, exc.message, exc.error_type)
        record.finished(*(f for prompt in finishes for f in prompt))
        if req.include_usage:
            yield sse_body(renderer.usage_chunk(finishes))
        yield sse_body(DONE)

    async def Responses(self, request, context):
        async with self.request(context, "Responses") as record:
            try:
                req = parse_responses_request(
                    request.data,
                    self.validator.tokenizer,
                    self.responses_store,
                    self.reasoning_parser,
                )
                generate = await self.with_images(req.generate, req.image_sources)
                valid = await self.validate(
                    generate, stream=req.stream, arrival=record.arrival, context=context
                )
            except ValidationError as exc:  # OpenAIRequestError included
                await abort(context, exc.message, ErrorType.VALIDATION, exc.param)
            record.validated(valid)
            renderer = ResponseRenderer(
                model_name(self, valid), req, id=new_response_id(_replica(context))
            )
            async with self.admitted(context, valid):
                if req.stream:
                    async for body in self._responses_stream(renderer, valid, context, record):
                        yield body
                else:
                    try:
                        events = [e async for e in self.engine.generate(valid.engine_request)]
                    except EngineError as exc:
                        await abort(context, exc.message, exc.error_type)
                    record.finished(events[-1].finish)
                    yield httpbody_pb2.HttpBody(content_type=JSON, data=renderer.response(events))
            if req.store and renderer.completed is not None:
                self.responses_store.put(renderer.id, req.stored(renderer.completed))

    async def _responses_stream(self, renderer: ResponseRenderer, valid, context, record):
        stream = ResponseStream(renderer)
        for data in stream.start():
            yield sse_body(data)
        try:
            async for event in self.engine.generate(valid.engine_request):
                if event.finish is not None:
                    record.finished(event.finish)
                for data in stream.events(event):
                    yield sse_body(data)
        except EngineError as exc:
            error_type = incomplete(exc.error_type)  # response.created was sent
            yield sse_body(stream.error(exc.message, error_type))
            await abort(context, exc.message, error_type)

    # stored responses ------------------------------------------------------------------

    async def GetResponse(self, request, context):
        return await self._stored(
            context,
            stored_responses.retrieve,
            request.response_id,
            include=tuple(request.include),
            stream=request.stream,
            starting_after=_optional(request, "starting_after"),
        )

    async def DeleteResponse(self, request, context):
        return await self._stored(context, stored_responses.delete, request.response_id)

    async def ListResponseInputItems(self, request, context):
        query = stored_responses.ItemsQuery(
            limit=_optional(request, "limit"),
            order=_optional(request, "order"),
            after=_optional(request, "after"),
            before=_optional(request, "before"),
            include=tuple(request.include),
        )
        return await self._stored(context, stored_responses.input_items, request.response_id, query)

    async def _stored(self, context, call, response_id: str, *args, **kwargs):
        """`call` on this replica's store, its answer as JSON, or the RPC's typed error."""
        try:
            data = call(self.responses_store, response_id, _replica(context), *args, **kwargs)
        except stored_responses.ResponseNotFound as exc:
            await abort(context, exc.message, ErrorType.NOT_FOUND, "response_id")
        except ValidationError as exc:  # OpenAIRequestError included
            await abort(context, exc.message, ErrorType.VALIDATION, exc.param)
        return httpbody_pb2.HttpBody(content_type=JSON, data=data)


def _replica(context) -> str | None:
    """The address the front proxy reached this replica at (its REPLICA_HEADER), if any."""
    for key, value in context.invocation_metadata() or ():
        if key == REPLICA_HEADER:
            return value.decode(errors="replace") if isinstance(value, bytes) else value
    return None


def _optional(message, field: str):
    return getattr(message, field) if message.HasField(field) else None


async def _merged(streams):
    """Events of several engine streams as (index, event), in arrival order. Leaving
    early cancels every stream (each aborts its sequence)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        try:
            async for event in stream:
                queue.put_nowait((index, event, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((index, None, exc))
        queue.put_nowait((index, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(tasks)
        while open_streams:
            index, event, error = await queue.get()
            if error is not None:
                raise error
            if event is None:
                open_streams -= 1
                continue
            yield index, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def model_name(servicer, valid) -> str:
    """The `model` an answer names: the LoRA adapter that wrote it, or the base model."""
    return valid.engine_request.adapter_id or servicer.served.info.model_id


def sse_body(data: bytes) -> httpbody_pb2.HttpBody:
    return httpbody_pb2.HttpBody(content_type=SSE, data=data)
