"""Engine results -> textgen.v1 protobuf messages. The only place that knows both."""

from __future__ import annotations

from google.protobuf import struct_pb2

from ..engine.types import FinishInfo, PrefillInfo, TokenEvent, TokenInfo
from ..proto import generate_pb2 as pb


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
    event: TokenEvent, *, prefix: str, seed_reported: bool, validation_time: float, total_time: float
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
    )
    if seed_reported:
        out.seed = float(finish.seed)
    if any(e.top_tokens for e in events):
        out.top_tokens.extend(top_tokens_list(e.top_tokens) for e in events)
    return out


def best_of_sequence(events: list[TokenEvent], prefix: str, seed_reported: bool) -> pb.BestOfSequence:
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
