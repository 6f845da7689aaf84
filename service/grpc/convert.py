"""textgen.v1 protobuf <-> plain data: the TGI RPCs' requests become intake/request.py's
GenerateRequest, engine results become response messages. The only place that knows
both."""

from __future__ import annotations

from google.protobuf import json_format, struct_pb2

from ..engine.types import FinishInfo, PrefillInfo, TokenEvent, TokenInfo
from ..intake.images import ImageSource
from ..intake.request import GenerateParameters, GenerateRequest, Grammar
from ..intake.validation import ValidationError
from ..proto import generate_pb2 as pb

# proto3 `optional` fields: unset stays None (TGI's default applies)
_OPTIONAL = (
    "best_of", "frequency_penalty", "max_new_tokens", "repetition_penalty",
    "return_full_text", "seed", "temperature", "top_k", "top_n_tokens", "top_p",
    "truncate", "typical_p", "presence_penalty", "max_time", "adapter_id", "priority",
)  # fmt: skip


# requests ---------------------------------------------------------------------------


def generate_request(request: pb.GenerateRequest) -> GenerateRequest:
    return GenerateRequest(
        inputs=request.inputs, parameters=parameters(request.parameters), markdown_images=True
    )


def image_sources(request: pb.GenerateRequest) -> tuple[ImageSource, ...]:
    """The request's typed images (read later, off the event loop), named images[i]."""
    sources = []
    for i, image in enumerate(request.images):
        source = image.WhichOneof("source")
        if source is None:
            raise ValidationError(f"`images[{i}]` holds neither `data` nor `url`", f"images[{i}]")
        sources.append(ImageSource(getattr(image, source), f"images[{i}]"))
    return tuple(sources)


def parameters(p: pb.GenerateParameters) -> GenerateParameters:
    return GenerateParameters(
        **{name: getattr(p, name) if p.HasField(name) else None for name in _OPTIONAL},
        decoder_input_details=p.decoder_input_details,
        details=p.details,
        do_sample=p.do_sample,
        grammar=grammar(p.grammar) if p.HasField("grammar") else None,
        stop=tuple(p.stop),
        watermark=p.watermark,
        logit_bias=dict(p.logit_bias),
        ignore_eos=p.ignore_eos,
    )


def grammar(g: pb.Grammar) -> Grammar:
    return Grammar(type=g.type, value=json_value(g.value) if g.HasField("value") else None)


def json_value(value: struct_pb2.Value) -> object:
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


# responses --------------------------------------------------------------------------


def token(t: TokenInfo) -> pb.Token:
    return pb.Token(id=t.id, text=t.text, logprob=t.logprob, special=t.special)


def prefill_token(t: PrefillInfo) -> pb.PrefillToken:
    logprob = struct_pb2.Value()
    if t.logprob is None:
        logprob.null_value = struct_pb2.NULL_VALUE
    else:
        logprob.number_value = t.logprob
    return pb.PrefillToken(id=t.id, text=t.text, logprob=logprob)


def top_tokens_list(tokens: tuple[TokenInfo, ...]) -> struct_pb2.ListValue:
    """One position's alternatives as a JSON list of Token objects (TGI's nested arrays)."""
    out = struct_pb2.ListValue()
    for t in tokens:
        out.values.add().struct_value.update(
            {"id": t.id, "text": t.text, "logprob": t.logprob, "special": t.special}
        )
    return out


def timings(finish: FinishInfo, validation_time: float, total_time: float) -> pb.Timings:
    per_token = finish.inference_time / finish.generated_tokens if finish.generated_tokens else 0.0
    return pb.Timings(
        total_time=total_time,
        validation_time=validation_time,
        queue_time=finish.queue_time,
        inference_time=finish.inference_time,
        time_per_token=per_token,
    )


def stream_response(
    event: TokenEvent,
    *,
    prefix: str,
    seed_reported: bool,
    validation_time: float,
    total_time: float,
) -> pb.GenerateStreamResponse:
    msg = pb.GenerateStreamResponse(
        index=event.index,
        token=token(event.token),
        top_tokens=[token(t) for t in event.top_tokens],
    )
    if event.finish is not None:
        f = event.finish
        msg.generated_text = prefix + f.generated_text
        msg.details.CopyFrom(
            pb.StreamDetails(
                finish_reason=f.reason.value,
                generated_tokens=f.generated_tokens,
                input_length=f.input_length,
                timings=timings(f, validation_time, total_time),
                cached_tokens=f.cached_tokens,
            )
        )
        if seed_reported:  # TGI reports a seed only when sampling
            msg.details.seed = float(f.seed)
    return msg


def details(
    events: list[TokenEvent], *, seed_reported: bool, validation_time: float, total_time: float
) -> pb.Details:
    finish = events[-1].finish
    out = pb.Details(
        finish_reason=finish.reason.value,
        generated_tokens=finish.generated_tokens,
        prefill=[prefill_token(p) for p in events[0].prefill],
        tokens=[token(e.token) for e in events],
        input_length=finish.input_length,
        timings=timings(finish, validation_time, total_time),
        cached_tokens=finish.cached_tokens,
    )
    if seed_reported:
        out.seed = float(finish.seed)
    if any(e.top_tokens for e in events):
        out.top_tokens.extend(top_tokens_list(e.top_tokens) for e in events)
    return out


def best_of_sequence(
    events: list[TokenEvent], prefix: str, seed_reported: bool
) -> pb.BestOfSequence:
    finish = events[-1].finish
    seq = pb.BestOfSequence(
        generated_text=prefix + finish.generated_text,
        finish_reason=finish.reason.value,
        generated_tokens=finish.generated_tokens,
        prefill=[prefill_token(p) for p in events[0].prefill],
        tokens=[token(e.token) for e in events],
    )
    if seed_reported:
        seq.seed = float(finish.seed)
    if any(e.top_tokens for e in events):
        seq.top_tokens.extend(top_tokens_list(e.top_tokens) for e in events)
    return seq
