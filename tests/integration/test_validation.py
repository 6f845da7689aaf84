"""Every TGI validation rule, over gRPC: INVALID_ARGUMENT, TGI's message, and a
google.rpc.ErrorInfo whose reason is `validation`."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from textgen.service.proto import generate_pb2 as pb
from textgen.service.proto import text_generation_service_pb2_grpc as svc_grpc

pytestmark = pytest.mark.timeout(60)

MAX_TOTAL = 512  # tiny_server's limits (support.servers.tiny_settings)
MAX_INPUT = 511


@pytest.fixture(scope="module")
def stub(tiny_server):
    with grpc.insecure_channel(tiny_server.target) as channel:
        yield svc_grpc.TextGenerationServiceStub(channel)


def error_of(call) -> tuple[grpc.StatusCode, str, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = info.value
    status = rpc_status.from_call(err)
    reasons = []
    for detail in status.details:
        ei = error_details_pb2.ErrorInfo()
        if detail.Unpack(ei):
            reasons.append(ei.reason)
    return err.code(), err.details(), reasons[0] if reasons else ""


CASES = [
    ("empty inputs", "", {}, "`inputs` cannot be empty"),
    ("temperature 0", "hi", {"temperature": 0.0}, "`temperature` must be strictly positive"),
    (
        "repetition_penalty 0",
        "hi",
        {"repetition_penalty": 0.0},
        "`repetition_penalty` must be strictly positive",
    ),
    (
        "frequency_penalty > 2",
        "hi",
        {"frequency_penalty": 2.5},
        "`frequency_penalty` must be >= -2.0 and <= 2.0",
    ),
    (
        "presence_penalty < -2",
        "hi",
        {"presence_penalty": -3.0},
        "`presence_penalty` must be >= -2.0 and <= 2.0",
    ),
    ("top_p 1", "hi", {"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
    ("top_p 0", "hi", {"top_p": 0.0}, "`top_p` must be > 0.0 and < 1.0"),
    ("typical_p 1", "hi", {"typical_p": 1.0}, "`typical_p` must be > 0.0 and < 1.0"),
    ("top_k 0", "hi", {"top_k": 0}, "`top_k` must be strictly positive"),
    ("max_new_tokens 0", "hi", {"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    (
        "max_new_tokens negative",
        "hi",
        {"max_new_tokens": -5},
        "`max_new_tokens` must be strictly positive",
    ),
    (
        "max_new_tokens beyond max_total_tokens",
        "hi",
        {"max_new_tokens": MAX_TOTAL},
        (
            f"`inputs` tokens + `max_new_tokens` must be <= {MAX_TOTAL}. "
            f"Given: {{n}} `inputs` tokens and {MAX_TOTAL} `max_new_tokens`"
        ),
    ),
    (
        "too many stops",
        "hi",
        {"stop": ["a", "b", "c", "d", "e"]},
        "`stop` supports up to 4 stop sequences. Given: 5",
    ),
    (
        "top_n_tokens too large",
        "hi",
        {"top_n_tokens": 6},
        "`top_n_tokens` must be >= 0 and <= 5. Given: 6",
    ),
    (
        "best_of without sampling",
        "hi",
        {"best_of": 2},
        "you must use sampling when `best_of` is > 1",
    ),
    (
        "best_of with seed",
        "hi",
        {"best_of": 2, "do_sample": True, "seed": 3},
        "`seed` must not be set when `best_of` > 1",
    ),
    (
        "best_of too large",
        "hi",
        {"best_of": 3, "do_sample": True},
        "`best_of` must be > 0 and <= 2. Given: 3",
    ),
    (
        "truncate 0",
        "hi",
        {"truncate": 0},
        f"`truncate` must be strictly positive and less than {MAX_INPUT}. Given: 0",
    ),
    (
        "truncate too large",
        "hi",
        {"truncate": MAX_INPUT + 1},
        f"`truncate` must be strictly positive and less than {MAX_INPUT}. Given: {MAX_INPUT + 1}",
    ),
    (
        "stop too long",
        "hi",
        {"stop": ["x" * 300]},
        "`stop` sequences must be at most 256 characters. Given: 300",
    ),
    ("max_time 0", "hi", {"max_time": 0.0}, "`max_time` must be strictly positive"),
    (
        "logit_bias outside the vocabulary",
        "hi",
        {"logit_bias": {10**6: 1.0}},
        "`logit_bias` token id 1000000 is outside the vocabulary (size 400)",
    ),
]


@pytest.mark.parametrize("name,inputs,params,message", CASES, ids=[c[0] for c in CASES])
def test_rule(stub, tiny_server, name, inputs, params, message):
    n = len(tiny_server.replica.loaded.tokenizer(inputs)["input_ids"])
    message = message.replace("{n}", str(n))
    req = pb.GenerateRequest(inputs=inputs, parameters=pb.GenerateParameters(**params))
    code, details, reason = error_of(lambda: stub.Generate(req, timeout=30))
    assert (code, details, reason) == (grpc.StatusCode.INVALID_ARGUMENT, message, "validation")


def test_input_longer_than_max_input_tokens(stub):
    long_text = "The quick brown fox jumps over the lazy dog. " * 100
    req = pb.GenerateRequest(inputs=long_text, parameters=pb.GenerateParameters(max_new_tokens=1))
    code, details, reason = error_of(lambda: stub.Generate(req, timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and reason == "validation"
    assert details.startswith(
        (
            f"`inputs` tokens + `max_new_tokens` must be <= {MAX_TOTAL}",
            f"`inputs` must have less than {MAX_INPUT} tokens",
        )
    )


def test_truncate_keeps_the_last_tokens(stub):
    long_text = "The quick brown fox jumps over the lazy dog. " * 100
    req = pb.GenerateRequest(
        inputs=long_text,
        parameters=pb.GenerateParameters(max_new_tokens=2, truncate=16, details=True),
    )
    resp = stub.Generate(req, timeout=30)
    assert resp.details.input_length == 16


def test_unset_max_new_tokens_fills_to_max_total_tokens(tiny_server):
    from textgen.service.intake.request import GenerateRequest
    from textgen.service.intake.validation import Validator

    validator: Validator = tiny_server.replica.servicer.validator
    valid = validator.validate(GenerateRequest(inputs="hi"), stream=False)
    prompt_len = len(valid.engine_request.prompt_ids)
    assert valid.engine_request.stopping.max_new_tokens == MAX_TOTAL - prompt_len


@pytest.mark.parametrize(
    "params,message",
    [
        (
            {"best_of": 2, "do_sample": True},
            "`best_of` != 1 is not supported when streaming tokens",
        ),
        (
            {"decoder_input_details": True},
            "`decoder_input_details` == true is not supported when streaming tokens",
        ),
    ],
)
def test_streaming_rules(stub, params, message):
    req = pb.GenerateRequest(inputs="hi", parameters=pb.GenerateParameters(**params))
    code, details, reason = error_of(lambda: list(stub.GenerateStream(req, timeout=30)))
    assert (code, details, reason) == (grpc.StatusCode.INVALID_ARGUMENT, message, "validation")
