"""The TextGenerationService servicer: parse, validate, call the engine, convert.
It decides nothing itself; errors leave as typed statuses (errors.py)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass, replace

from ..engine.loop import EngineLoop
from ..engine.types import EngineError, TokenEvent
from ..errors import ErrorType, incomplete
from ..intake.admission import Admission, Overloaded
from ..intake.images import read_images
from ..intake.request import GenerateRequest
from ..intake.validation import ValidationError, Validator, ValidRequest
from ..observability.requests import RequestRecorder
from ..openai.response_store import ResponseStore
from ..proto import generate_pb2 as gen_pb
from ..proto import text_generation_service_pb2 as svc_pb
from ..proto import text_generation_service_pb2_grpc as svc_grpc
from . import convert
from .anthropic_rpcs import AnthropicRpcs
from .errors import abort, in_band_error
from .lora_rpcs import LoraRpcs, LoraServing
from .metrics_rpc import MetricsRpc
from .openai_rpcs import OpenAIRpcs
from .tokenize_rpcs import TokenizeRpcs

log = logging.getLogger("textgen.grpc")

# Prompts longer than this are tokenized on a worker thread.
LONG_PROMPT_CHARS = 20_000


@dataclass(frozen=True)
class ServedModel:
    """What Info and ListModels report."""

    info: svc_pb.InfoResponse
    created: int  # unix time the model was loaded


class TextGenerationServicer(
    OpenAIRpcs,
    AnthropicRpcs,
    TokenizeRpcs,
    MetricsRpc,
    LoraRpcs,
    svc_grpc.TextGenerationServiceServicer,
):
    def __init__(
        self,
        engine: EngineLoop,
        validator: Validator,
        served: ServedModel,
        admission: Admission,
        recorder: RequestRecorder,
        validation_workers: Executor | None = None,
        responses_store: ResponseStore | None = None,
        lora: LoraServing | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        """validation_workers: where long prompts and grammars are validated (None:
        asyncio's default executor); responses_store: the conversations /v1/responses
        keeps for previous_response_id (None: the default bounds); lora: the LoRA
        adapters served (None: none); reasoning_parser: how chat, responses and messages tell
        thinking from the answer (openai/reasoning.resolve_parser; None: they don't)."""
        self.lora = lora
        self.reasoning_parser = reasoning_parser
        self.engine = engine
        self.responses_store = responses_store or ResponseStore()
        self.validator = validator
        self.served = served
        self.admission = admission
        self.recorder = recorder
        self.validation_workers = validation_workers
        self.draining = False  # set on SIGTERM: new requests are refused

    @contextlib.asynccontextmanager
    async def request(self, context, method: str):
        """Record the request (metrics, spans, log line); refuse it while draining."""
        async with self.recorder.track(method) as record:
            if self.draining:
                await abort(context, "the server is shutting down", ErrorType.UNAVAILABLE)
            yield record

    @contextlib.asynccontextmanager
    async def admitted(self, context, *valid: ValidRequest):
        """Hold an admission permit for the block, or end the RPC with `overloaded`."""
        tokens = sum(len(v.engine_request.prompt_ids) for v in valid)
        try:
            await self.admission.acquire(tokens, priority=valid[0].engine_request.priority)
        except Overloaded as exc:
            await abort(context, str(exc), ErrorType.OVERLOADED, retry_after=exc.retry_after)
        started = time.monotonic()
        try:
            yield
        finally:
            self.admission.observe_hold(time.monotonic() - started)
            self.admission.release()

    # generation -------------------------------------------------------------------

    async def GenerateStream(self, request, context):
        async with self.request(context, "GenerateStream") as record:
            arrival = record.arrival
            valid = await self._validate(request, context, stream=True, arrival=arrival)
            record.validated(valid)
            prefix = valid.inputs if valid.return_full_text else ""
            sent_any = False
            try:
                async with self.admitted(context, valid):
                    async for event in self.engine.generate(valid.engine_request):
                        yield convert.stream_response(
                            event,
                            prefix=prefix,
                            seed_reported=valid.engine_request.sampling.do_sample,
                            validation_time=valid.validation_time,
                            total_time=time.monotonic() - arrival,
                        )
                        sent_any = True
                        if event.finish is not None:
                            record.finished(event.finish)
                            context.set_trailing_metadata(
                                _timing_metadata(valid, event.finish, arrival)
                            )
            except EngineError as exc:
                if sent_any:
                    # an HTTP/1.1 client can't see a status after the first frame
                    yield in_band_error(exc.message, incomplete(exc.error_type))
                    await abort(context, exc.message, incomplete(exc.error_type))
                await abort(context, exc.message, exc.error_type)

    async def Generate(self, request, context):
        async with self.request(context, "Generate") as record:
            arrival = record.arrival
            valid = await self._validate(request, context, stream=False, arrival=arrival)
            record.validated(valid)
            try:
                async with self.admitted(context, valid):
                    runs = await self._generate_best_of(valid)
            except EngineError as exc:
                await abort(context, exc.message, exc.error_type)
            record.finished(*(run[-1].finish for run in runs))
            response = self._generate_response(valid, runs, arrival)
            await context.send_initial_metadata(_tgi_headers(valid, runs[0][-1].finish, arrival))
            return response

    async def _validate(self, request, context, *, stream: bool, arrival: float) -> ValidRequest:
        """A TGI RPC's protobuf request, validated, or the RPC ends with the error."""
        try:
            generate = convert.generate_request(request)
            generate = await self.with_images(generate, convert.image_sources(request))
            return await self.validate(generate, stream=stream, arrival=arrival, context=context)
        except ValidationError as exc:
            await abort(context, exc.message, exc.error_type, exc.param)

    async def with_images(self, generate: GenerateRequest, sources) -> GenerateRequest:
        """`generate` with its images (intake/images.ImageSource) read, on a worker
        thread: they may be fetched (seconds, idle) and decode."""
        if not sources:
            return generate
        images = await asyncio.to_thread(read_images, sources, self.validator.image_limits)
        return replace(generate, images=images)

    async def validate(
        self, request: GenerateRequest, *, stream: bool, arrival: float, context=None
    ) -> ValidRequest:
        """Validate (and tokenize); long prompts, grammars (compiled on first sight) and
        images (the processor's resize) on the validation workers, so one 2 MB prompt or
        large schema doesn't stall every other stream while it is processed; TGI's
        markdown images, which may be fetched, on a thread of their own. A request without
        a priority takes the `x-textgen-priority` header's (a mesh may set it at the edge)."""
        if request.parameters.priority is None and context is not None:
            priority = header_priority(context)
            if priority is not None:
                request = replace(
                    request, parameters=replace(request.parameters, priority=priority)
                )
        validate = functools.partial(
            self.validator.validate, request, stream=stream, arrival_time=arrival
        )
        if request.markdown_images and "![" in request.inputs and self.validator.images is not None:
            return await asyncio.to_thread(validate)  # may fetch its images: seconds, idle
        grammar = request.lark is not None or request.parameters.grammar is not None
        if len(request.inputs) < LONG_PROMPT_CHARS and not grammar and not request.images:
            return validate()
        return await asyncio.get_running_loop().run_in_executor(self.validation_workers, validate)

    async def prompt_length(self, request: GenerateRequest) -> int:
        """The prompt's tokens as validate() counts them (Anthropic's count_tokens), on the
        validation workers where validate() would run there (a long prompt, images)."""
        if len(request.inputs) < LONG_PROMPT_CHARS and not request.images:
            return self.validator.prompt_length(request)
        return await asyncio.get_running_loop().run_in_executor(
            self.validation_workers, self.validator.prompt_length, request
        )

    async def _generate_best_of(self, valid: ValidRequest) -> list[list[TokenEvent]]:
        """best_of sequences run side by side with their own seeds (the engine's n
        choices, sharing the prompt's KV blocks); the first is the best by summed token
        logprob (TGI's rule)."""
        runs = await self.collect_choices(valid.engine_request)
        return sorted(runs, key=lambda events: -sum(e.token.logprob for e in events))

    async def collect_choices(self, engine_request) -> list[list[TokenEvent]]:
        """Each of the request's n choices' events, in choice order."""
        runs: list[list[TokenEvent]] = [[] for _ in range(engine_request.n)]
        async for event in self.engine.generate(engine_request):
            runs[event.choice].append(event)
        return runs

    def _generate_response(self, valid: ValidRequest, runs: list[list[TokenEvent]], arrival: float):
        best = runs[0]
        prefix = valid.inputs if valid.return_full_text else ""
        response = gen_pb.GenerateResponse(generated_text=prefix + best[-1].finish.generated_text)
        if valid.details:
            seed_reported = valid.engine_request.sampling.do_sample
            details = convert.details(
                best,
                seed_reported=seed_reported,
                validation_time=valid.validation_time,
                total_time=time.monotonic() - arrival,
            )
            if valid.best_of > 1:
                details.best_of_sequences.extend(
                    convert.best_of_sequence(run, prefix, seed_reported) for run in runs[1:]
                )
            response.details.CopyFrom(details)
        return response

    # model and server -------------------------------------------------------------

    async def Info(self, request, context):
        info = svc_pb.InfoResponse()
        info.CopyFrom(self.served.info)
        info.lora_adapters.extend(self.adapter_names())
        return info

    async def Version(self, request, context):
        response = svc_pb.VersionResponse(version=self.served.info.version)
        if self.served.info.HasField("sha"):
            response.commit = self.served.info.sha
        return response

    async def Health(self, request, context):
        if not self.engine.healthy or self.draining:
            await abort(context, "unhealthy", ErrorType.HEALTHCHECK)
        return svc_pb.HealthResponse()

    async def ListModels(self, request, context):
        return svc_pb.ListModelsResponse(object="list", data=self.model_cards())


# A request's priority when its parameters name none: set by a client or by a mesh's edge.
PRIORITY_HEADER = "x-textgen-priority"


def header_priority(context) -> int | None:
    """The `x-textgen-priority` metadata (an HTTP header through Envoy) as an integer."""
    for key, value in context.invocation_metadata() or ():
        if key == PRIORITY_HEADER:
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            try:
                return int(text.strip())
            except ValueError:
                raise ValidationError(
                    f"`{PRIORITY_HEADER}` must be an integer. Given: {text!r}", PRIORITY_HEADER
                ) from None
    return None


def _tgi_headers(valid: ValidRequest, finish, arrival: float) -> tuple[tuple[str, str], ...]:
    """TGI's /generate response headers, as initial metadata: Envoy's transcoder turns
    them into HTTP headers."""
    total = time.monotonic() - arrival
    return (
        ("x-compute-type", "textgen"),
        ("x-compute-time", f"{total:.6f}"),
        ("x-compute-characters", str(len(valid.inputs))),
        *_timing_metadata(valid, finish, arrival),
    )


def _timing_metadata(valid: ValidRequest, finish, arrival: float) -> tuple[tuple[str, str], ...]:
    """Per-request timings (milliseconds) and token counts under TGI's header names;
    also the trailing metadata of a finished GenerateStream."""
    per_token = finish.inference_time / finish.generated_tokens if finish.generated_tokens else 0.0
    return (
        ("x-total-time", _ms(time.monotonic() - arrival)),
        ("x-validation-time", _ms(valid.validation_time)),
        ("x-queue-time", _ms(finish.queue_time)),
        ("x-inference-time", _ms(finish.inference_time)),
        ("x-time-per-token", _ms(per_token)),
        ("x-prompt-tokens", str(finish.input_length)),
        ("x-generated-tokens", str(finish.generated_tokens)),
    )


def _ms(seconds: float) -> str:
    return str(int(seconds * 1000))
