"""Hostile input, fuzzed (issue 6): Hypothesis over GenerateRequest on native gRPC
(and over raw, undecodable request bytes), and Schemathesis over every HTTP route of
envoy/openapi.json through a real Envoy, positive and negative cases.

What must hold for every case: no crash (the engine stays up), no hang (every call
has a deadline), no untyped failure. A request is either served, or refused with a
typed error: on gRPC INVALID_ARGUMENT/RESOURCE_EXHAUSTED with a google.rpc.ErrorInfo
whose reason is the error_type; on HTTP TGI's `{"error", "error_type"}` (OpenAI's
`{"error": {...}}` under /v1/) with the status of that error_type. An input that
passes validation must not fail in the engine either (424/500, INTERNAL/ABORTED):
hostile values belong in 422s.

The fuzz replica is this module's own (not the session's tiny_server/http_server):
a request that kills its engine must not take the rest of the suite down, and the
replica is restarted before the next case so that Hypothesis can shrink the failure
to the request that does it. Its max_total_tokens is 64 (tiny_settings: 512), which
bounds every generation the fuzzers get served, so the file runs in about a minute on
two cores (longer while it finds bugs: Hypothesis shrinks each failure to a minimal case).

Besides the random cases, every GenerateParameters field is swept alone through its
edge values (NaN, infinities, subnormals, zero, negatives, extremes), and a list of
hand-picked HTTP bodies covers what generators rarely produce ("NaN" as proto3 JSON
spells it, bare NaN for Python's json, integers beyond the proto fields).

Hypothesis runs derandomized (the same cases on every run, as CI needs); set
TEXTGEN_FUZZ_SCALE=10 for ten times as many cases. The number of cases run per
target is printed at the end of the module and checked by each test.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import itertools
import json
import math
import os
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest
import requests
import schemathesis
from google.protobuf import struct_pb2, text_format
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from support.servers import ServerThread, tiny_settings
from support.tiers import server_fixture
from textgen.envoy.config import HTTP_STATUS_BY_ERROR_TYPE, ROUTES
from textgen.service.errors import ANTHROPIC_ERRORS, ANTHROPIC_TOO_LARGE
from textgen.service.grpc.errors import DOMAIN, STATUS_BY_ERROR_TYPE
from textgen.service.proto import generate_pb2 as pb
from textgen.service.proto import text_generation_service_pb2_grpc as svc_grpc

REPO = Path(__file__).resolve().parents[2]
# the description as the package ships it (package data of textgen.envoy)
OPENAPI = Path(str(importlib.resources.files("textgen.envoy") / "openapi.json"))

MAX_TOTAL_TOKENS = 64  # the fuzz replica's; bounds every generation (see above)
CALL_TIMEOUT = 30.0  # seconds: a call that takes longer is a hang
SCALE = float(os.environ.get("TEXTGEN_FUZZ_SCALE", "1"))

# The only ways a hostile request may be refused.
REFUSALS_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: "validation",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded",
}
REFUSALS_HTTP = {(422, "validation"), (413, "validation"), (429, "overloaded")}
# ... on Anthropic's face (/v1/messages), in Anthropic's statuses and types
REFUSALS_ANTHROPIC = {
    (400, "invalid_request_error"),
    ANTHROPIC_TOO_LARGE,
    (429, "rate_limit_error"),
}
ANTHROPIC = "/v1/messages"
# A stored response's routes answer a random id with 404 `not_found`.
STORED = "{response_id}"
FINISH_REASONS = {"length", "eos_token", "stop_sequence", "time_limit"}

CASES: Counter[str] = Counter()  # cases run per target, printed at the end of the module


def fuzz_settings(max_examples: int) -> settings:
    return settings(
        max_examples=max(1, int(max_examples * SCALE)),
        deadline=None,  # generation time varies; hangs are caught by call timeouts
        derandomize=True,  # the same cases on every run
        database=None,  # nothing written into the checkout
        print_blob=False,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
    )


class FuzzReplica:
    """The tiny model behind a real Envoy, restarted when a case killed its engine."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        settings_ = tiny_settings(self.model_dir, max_total_tokens=MAX_TOTAL_TOKENS)
        self.server = ServerThread(settings_, http=True).start()
        self.channel = grpc.insecure_channel(self.server.target)
        self.stub = svc_grpc.TextGenerationServiceStub(self.channel)

    @property
    def alive(self) -> bool:
        return self.server.engine.healthy

    @property
    def http_url(self) -> str:
        return self.server.http_url

    def ensure_alive(self) -> None:
        """A fresh replica if the previous case killed the engine (so that every case,
        and every shrinking step, starts from a working server)."""
        if not self.alive:
            self.stop()
            self.restarts += 1
            self._start()

    def stop(self) -> None:
        self.channel.close()
        self.server.stop()


@server_fixture(scope="module")
def replica(tiny_model_dir, request):
    rep = FuzzReplica(tiny_model_dir)
    started = time.monotonic()
    yield rep
    rep.stop()
    summary = ", ".join(f"{name}: {n}" for name, n in sorted(CASES.items()))
    line = (
        f"fuzz cases run: {sum(CASES.values())} in {time.monotonic() - started:.0f} s"
        f" ({summary}); replica restarts after a killed engine: {rep.restarts}"
    )
    # past pytest's output capture, which is on while fixtures tear down
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if capture is not None and reporter is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line("")
            reporter.write_line(line)
    else:
        print(line)


# the description itself -------------------------------------------------------------


@pytest.mark.timeout(60)
def test_openapi_is_generated_and_covers_the_routes():
    """envoy/openapi.json is scripts/make_openapi.py's output, and describes exactly
    the routes Envoy serves."""
    spec = importlib.util.spec_from_file_location(
        "make_openapi", REPO / "scripts" / "make_openapi.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert OPENAPI.read_text() == module.render(module.build()), (
        "envoy/openapi.json is stale: run `python scripts/make_openapi.py`"
    )
    served = {(r.method, r.path) for r in ROUTES}
    assert {(m, p) for p, m in HTTP_OPERATIONS} == served
    # every declared error status is one the HTTP face can send
    statuses = set(HTTP_STATUS_BY_ERROR_TYPE.values()) | {413, 504}
    statuses |= {status for status, _ in ANTHROPIC_ERRORS.values()}  # Anthropic's face
    for path, item in json.loads(OPENAPI.read_text())["paths"].items():
        for method, op in item.items():
            codes = {int(c) for c in op["responses"]} - {200}
            assert codes <= statuses, (method, path, codes - statuses)
    assert SCHEMA.validate() is None


# gRPC: strategies ------------------------------------------------------------------

FLOAT_EDGES = [0.0, -0.0, 1e-45, 1e-38, -1.0, 0.5, 1.0, 2.0, 2.0000002, 100.0, 100.5, 3.4e38]
FLOATS = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.sampled_from(FLOAT_EDGES),
    st.floats(width=32),  # anything a proto float holds
)
INT32 = st.one_of(
    st.sampled_from([-(2**31), -1, 0, 1, 2, 3, 5, 6, 63, 64, 65, 512, 2**31 - 1]),
    st.integers(-(2**31), 2**31 - 1),
)
UINT64 = st.one_of(st.sampled_from([0, 1, 2**53, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
UINT32 = st.one_of(st.integers(0, 450), st.integers(0, 2**32 - 1))

SPECIAL_TEXTS = [
    "",
    " ",
    "\x00",
    "\n" * 10,
    "\x1b[31m\x7f\u0085\u2028\u2029",
    "<|im_end|>",
    "<|endoftext|><|im_start|>",
    "🎉🚀👩‍👩‍👧‍👦🏳️‍🌈",
    "\ufeff\u200b\u200d\ufffd",
    "e\u0301" * 50,
    "日本語のテキスト",
]
# text() covers all of Unicode but surrogates (protobuf strings are UTF-8): emoji,
# control characters, combining marks, private use.
TEXT = st.one_of(
    st.text(min_size=1, max_size=40),
    st.text(max_size=40),
    st.sampled_from(SPECIAL_TEXTS),
    # very long prompts, up to ~20k characters
    st.builds(
        lambda unit, n: (unit * n)[:20_000],
        st.text(min_size=1, max_size=8),
        st.integers(100, 20_000),
    ),
)
STOP = st.one_of(st.text(max_size=8), st.sampled_from(SPECIAL_TEXTS), st.just("x" * 300))


def optional(strategy):
    return st.one_of(st.none(), strategy)


VALID_FLOAT = st.floats(1 / 128, 127 / 128, width=32)  # bounds exact in float32

# Per field: (a valid value, a hostile one). Each request makes a few fields hostile
# and leaves the others valid or unset (TGI's defaults), so that most requests pass
# validation and reach the engine with their hostile values: all-hostile requests
# would only ever test the first validation rule.
PARAMETER_FIELDS = {
    "best_of": (st.sampled_from([1, 2]), INT32),
    "decoder_input_details": (st.booleans(), st.booleans()),
    "details": (st.booleans(), st.booleans()),
    "do_sample": (st.booleans(), st.booleans()),
    "frequency_penalty": (st.floats(-2.0, 2.0, width=32), FLOATS),
    "presence_penalty": (st.floats(-2.0, 2.0, width=32), FLOATS),
    "repetition_penalty": (st.floats(0.5, 2.0, width=32), FLOATS),
    "return_full_text": (st.booleans(), st.booleans()),
    "seed": (UINT64, UINT64),
    "temperature": (st.floats(0.125, 2.0, width=32), FLOATS),
    "top_k": (st.integers(1, 500), INT32),
    "top_n_tokens": (st.integers(0, 5), INT32),
    "top_p": (VALID_FLOAT, FLOATS),
    "typical_p": (VALID_FLOAT, FLOATS),
    "truncate": (st.integers(1, MAX_TOTAL_TOKENS - 1), INT32),
    "watermark": (st.booleans(), st.booleans()),
    "ignore_eos": (st.booleans(), st.booleans()),
    "max_time": (st.floats(1.0, 30.0, width=32), FLOATS),
    # a few tokens, so that the run stays fast; unset (up to max_total_tokens) comes
    # second so that shrinking, which prefers the first branch, stays fast too
    "max_new_tokens": (st.one_of(st.integers(1, 4), st.none()), INT32),
    "stop": (
        st.lists(st.text(min_size=1, max_size=8), max_size=4),
        st.lists(STOP, max_size=6),
    ),
    "logit_bias": (
        st.dictionaries(st.integers(0, 300), st.floats(-100.0, 100.0, width=32), max_size=3),
        st.dictionaries(UINT32, FLOATS, max_size=4),
    ),
    "grammar": (
        st.none(),
        st.builds(
            lambda kind, text: pb.Grammar(type=kind, value=struct_pb2.Value(string_value=text)),
            st.sampled_from(["json", "regex", "json_schema", "", "x"]),
            st.text(max_size=20),
        ),
    ),
}


@st.composite
def generate_parameters(draw) -> pb.GenerateParameters | None:
    if draw(st.integers(0, 9)) == 0:
        return None  # parameters unset
    # 0 to 3 hostile fields, evenly (st.sets() would mostly draw none)
    hostile = draw(st.permutations(sorted(PARAMETER_FIELDS)))[: draw(st.integers(0, 3))]
    kwargs = {}
    for name, (valid, bad) in PARAMETER_FIELDS.items():
        if name in hostile:
            value = draw(bad)
        elif name == "max_new_tokens":
            value = draw(valid)
        else:
            value = draw(optional(valid))
        if value is not None:
            kwargs[name] = value
    return pb.GenerateParameters(**kwargs)


GENERATE_REQUESTS = st.builds(
    lambda inputs, params: (
        pb.GenerateRequest(inputs=inputs, parameters=params)
        if params is not None
        else pb.GenerateRequest(inputs=inputs)
    ),
    TEXT,
    generate_parameters(),
)


# gRPC: checks ---------------------------------------------------------------------


def error_reason(err: grpc.RpcError) -> tuple[str, str] | None:
    """(domain, reason) of the call's google.rpc.ErrorInfo, or None."""
    status = rpc_status.from_call(err)
    if status is None:
        return None
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.domain, info.reason
    return None


def describe(request: pb.GenerateRequest) -> str:
    inputs = request.inputs if len(request.inputs) < 200 else request.inputs[:200] + "..."
    params = text_format.MessageToString(request.parameters, as_one_line=True, as_utf8=True)
    return (
        f"GenerateRequest(inputs={inputs!r} ({len(request.inputs)} chars), parameters={{{params}}})"
    )


def check_refusal(err: grpc.RpcError, what: str) -> None:
    code = err.code()
    assert code != grpc.StatusCode.DEADLINE_EXCEEDED, (
        f"hang: no answer in {CALL_TIMEOUT} s to {what}"
    )
    typed = error_reason(err)
    assert typed is not None, f"untyped {code.name} ({err.details()!r}) for {what}"
    domain, reason = typed
    assert domain == DOMAIN and STATUS_BY_ERROR_TYPE.get(reason) == code, (
        f"{code.name} with ErrorInfo {typed} (not a known error type for that code) for {what}"
    )
    assert REFUSALS_GRPC.get(code) == reason, (
        f"{code.name}/{reason} ({err.details()!r}): accepted input failed in the engine: {what}"
    )


def check_tokens(tokens, what: str) -> None:
    for token in tokens:
        assert not math.isnan(token.logprob), f"NaN logprob in the answer to {what}: {token}"


def call_generate(stub, request) -> grpc.RpcError | None:
    try:
        response = stub.Generate(request, timeout=CALL_TIMEOUT)
    except grpc.RpcError as err:
        return err
    p = request.parameters
    if response.HasField("details"):
        details = response.details
        assert details.finish_reason in FINISH_REASONS, details.finish_reason
        assert details.generated_tokens == len(details.tokens) >= 1
        if p.HasField("max_new_tokens"):
            assert details.generated_tokens <= p.max_new_tokens
        check_tokens(details.tokens, describe(request))
        for position in details.top_tokens:
            for alt in position.values:
                assert not math.isnan(alt.struct_value["logprob"]), (
                    f"NaN top-token logprob: {describe(request)}"
                )
    else:
        assert not (p.details or p.decoder_input_details), "details were asked for"
    return None


def call_generate_stream(stub, request) -> grpc.RpcError | None:
    messages = []
    try:
        for message in stub.GenerateStream(request, timeout=CALL_TIMEOUT):
            messages.append(message)  # noqa: PERF402 - kept when the stream breaks
    except grpc.RpcError as err:
        # a stream that failed after it started must have said so in-band first
        if messages:
            last = messages[-1]
            assert last.HasField("error") and last.error_type in STATUS_BY_ERROR_TYPE, (
                f"stream broke after {len(messages)} messages without an in-band error: "
                f"{describe(request)}"
            )
        return err
    assert messages, f"empty stream: {describe(request)}"
    for i, message in enumerate(messages, start=1):
        assert not message.HasField("error"), f"in-band error in a stream that ended OK: {message}"
        assert message.index == i
        check_tokens([message.token, *message.top_tokens], describe(request))
    last = messages[-1]
    assert last.HasField("generated_text") and last.details.finish_reason in FINISH_REASONS
    assert last.details.generated_tokens == len(messages)
    if request.parameters.HasField("max_new_tokens"):
        assert len(messages) <= request.parameters.max_new_tokens
    return None


def fuzz_one(replica: FuzzReplica, key: str, call, request) -> None:
    replica.ensure_alive()
    CASES[key] += 1
    err = call(replica.stub, request)
    assert replica.alive, (
        f"the request killed the engine (every later request fails `unavailable`): "
        f"{describe(request)} -> {err.code().name if err else 'OK'} {err.details() if err else ''}"
    )
    if err is not None:
        check_refusal(err, describe(request))


# gRPC: tests ----------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_grpc_generate_fuzz(replica):
    @fuzz_settings(100)
    @given(request=GENERATE_REQUESTS)
    def run(request):
        fuzz_one(replica, "grpc Generate", call_generate, request)

    run()
    assert CASES["grpc Generate"] >= 100 * SCALE


@pytest.mark.timeout(240)
def test_grpc_generate_stream_fuzz(replica):
    @fuzz_settings(100)
    @given(request=GENERATE_REQUESTS)
    def run(request):
        fuzz_one(replica, "grpc GenerateStream", call_generate_stream, request)

    run()
    assert CASES["grpc GenerateStream"] >= 100 * SCALE


# every parameter alone at each of its edge values: a deterministic sweep, so that
# the obvious hostile values (NaN, infinities, subnormals, extremes) are always tried

FLOAT_SWEEP = [*FLOAT_EDGES, math.nan, math.inf, -math.inf]
INT32_SWEEP = [-(2**31), -1, 0, 1, 2, 5, 6, 63, 64, 2**31 - 1]
BOOL_SWEEP = [True, False]
EDGE_VALUES = {
    "best_of": INT32_SWEEP,
    "decoder_input_details": BOOL_SWEEP,
    "details": BOOL_SWEEP,
    "do_sample": BOOL_SWEEP,
    "frequency_penalty": FLOAT_SWEEP,
    "grammar": [pb.Grammar(type="json", value=struct_pb2.Value(string_value="{}")), pb.Grammar()],
    "max_new_tokens": INT32_SWEEP,
    "repetition_penalty": FLOAT_SWEEP,
    "return_full_text": BOOL_SWEEP,
    "seed": [0, 1, 2**53, 2**63, 2**64 - 1],
    "stop": [
        [""],
        ["x" * 256],
        ["x" * 257],
        ["a"] * 4,
        ["a"] * 5,
        ["\x00"],
        ["🎉"],
        ["<|im_end|>"],
    ],
    "temperature": FLOAT_SWEEP,
    "top_k": INT32_SWEEP,
    "top_n_tokens": INT32_SWEEP,
    "top_p": FLOAT_SWEEP,
    "truncate": INT32_SWEEP,
    "typical_p": FLOAT_SWEEP,
    "watermark": BOOL_SWEEP,
    "presence_penalty": FLOAT_SWEEP,
    "logit_bias": [{0: v} for v in FLOAT_SWEEP] + [{399: 1.0}, {400: 1.0}, {2**32 - 1: 1.0}],
    "ignore_eos": BOOL_SWEEP,
    "max_time": FLOAT_SWEEP,
    "adapter_id": ["", "lora", "\x00" * 3, "é" * 1000],
    "priority": INT32_SWEEP,
}


def sweep_requests():
    """Each field alone at each edge value, greedy and sampled (different code paths)."""
    for name, values in EDGE_VALUES.items():
        for value in values:
            for sampled in ({}, {"do_sample": True, "seed": 7}):
                # details: the answer's logprobs are checked
                kwargs = {"max_new_tokens": 2, "details": True, **sampled, name: value}
                yield pb.GenerateRequest(
                    inputs="The quick brown fox", parameters=pb.GenerateParameters(**kwargs)
                )


@pytest.mark.timeout(10)
def test_sweep_covers_every_parameter():
    fields = {f.name for f in pb.GenerateParameters.DESCRIPTOR.fields}
    assert set(EDGE_VALUES) == fields, "a new GenerateParameters field needs its edge values here"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_grpc_parameter_edges(replica, method):
    """Each failure is collected, so that one run lists every offending value."""
    call = call_generate if method == "Generate" else call_generate_stream
    failures = []
    for request in sweep_requests():
        try:
            fuzz_one(replica, f"grpc {method} edge sweep", call, request)
        except AssertionError as exc:
            failures.append(str(exc).split("\nassert")[0])
    assert not failures, f"{len(failures)} failing edge values:\n" + "\n".join(failures)


# raw bytes: what a hand-rolled or hostile client can put on the wire

METHODS = {
    "Generate": "/textgen.v1.TextGenerationService/Generate",
    "GenerateStream": "/textgen.v1.TextGenerationService/GenerateStream",
    "Tokenize": "/textgen.v1.TextGenerationService/Tokenize",
}
BAD_UTF8 = [
    b"\xff",
    b"\xfe\xff",
    b"\x80",  # a lone continuation byte
    b"\xc0\x80",  # overlong NUL
    b"\xe2\x82",  # truncated
    b"\xed\xa0\x80",  # an encoded surrogate
    b"\xf4\x90\x80\x80",  # beyond U+10FFFF
]


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def length_delimited(field: int, payload: bytes) -> bytes:
    return varint(field << 3 | 2) + varint(len(payload)) + payload


def _invalid(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


INVALID_UTF8 = st.one_of(
    st.builds(
        lambda a, bad, b: a.encode() + bad + b.encode(),
        st.text(max_size=20),
        st.sampled_from(BAD_UTF8),
        st.text(max_size=20),
    ),
    st.binary(min_size=1, max_size=64).filter(_invalid),
)
VALID_PARAMETERS = length_delimited(2, b"\x38\x02")  # parameters { max_new_tokens: 2 }


@st.composite
def invalid_utf8_requests(draw) -> bytes:
    """A GenerateRequest whose `inputs` (field 1), or a stop sequence (parameters
    field 11), is not UTF-8."""
    bad = draw(INVALID_UTF8)
    if draw(st.booleans()):
        return length_delimited(1, bad) + draw(st.sampled_from([b"", VALID_PARAMETERS]))
    return length_delimited(1, b"hello") + length_delimited(
        2, b"\x38\x02" + length_delimited(11, bad)
    )


@st.composite
def garbage_requests(draw) -> bytes:
    """Random bytes, and valid requests cut short or with bytes flipped."""
    kind = draw(st.integers(0, 2))
    if kind == 0:
        return draw(st.binary(max_size=256))
    valid = pb.GenerateRequest(
        inputs=draw(st.text(min_size=1, max_size=30)),
        parameters=pb.GenerateParameters(max_new_tokens=2, stop=["a"], temperature=0.5),
    ).SerializeToString()
    if kind == 1:
        return valid[: draw(st.integers(0, len(valid)))]
    at = draw(st.integers(0, len(valid) - 1))
    return valid[:at] + bytes([draw(st.integers(0, 255))]) + valid[at + 1 :]


def raw_call(replica: FuzzReplica, method: str, data: bytes) -> grpc.RpcError | None:
    path = METHODS[method]
    try:
        if method == "GenerateStream":
            call = replica.channel.unary_stream(
                path, request_serializer=lambda b: b, response_deserializer=lambda b: b
            )
            for _ in call(data, timeout=CALL_TIMEOUT):
                pass
        else:
            call = replica.channel.unary_unary(
                path, request_serializer=lambda b: b, response_deserializer=lambda b: b
            )
            call(data, timeout=CALL_TIMEOUT)
    except grpc.RpcError as err:
        return err
    return None


@pytest.mark.timeout(120)
def test_grpc_invalid_utf8_is_validation(replica):
    @fuzz_settings(60)
    @given(method=st.sampled_from(sorted(METHODS)), data=invalid_utf8_requests())
    def run(method, data):
        replica.ensure_alive()
        CASES["grpc invalid UTF-8"] += 1
        err = raw_call(replica, method, data)
        assert err is not None, f"{method} accepted invalid UTF-8: {data!r}"
        assert (err.code(), error_reason(err)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            (DOMAIN, "validation"),
        ), f"{method} {data!r} -> {err.code().name} {err.details()!r}"

    run()
    assert CASES["grpc invalid UTF-8"] >= 60 * SCALE


@pytest.mark.timeout(120)
def test_grpc_garbage_bytes(replica):
    @fuzz_settings(90)
    @given(method=st.sampled_from(sorted(METHODS)), data=garbage_requests())
    def run(method, data):
        replica.ensure_alive()
        CASES["grpc garbage bytes"] += 1
        err = raw_call(replica, method, data)
        assert replica.alive, f"{method} {data!r} killed the engine"
        if err is not None:
            check_refusal(err, f"{method} {data!r}")

    run()
    assert CASES["grpc garbage bytes"] >= 90 * SCALE


# HTTP: the published description, fuzzed ------------------------------------------

# reproducers keep `max_tokens` (schemathesis masks keys that look like secrets)
SCHEMA = schemathesis.openapi.from_path(
    OPENAPI, config=schemathesis.Config.from_dict({"output": {"sanitization": {"enabled": False}}})
)
HTTP_OPERATIONS = sorted(
    (path, method.upper())
    for path, item in json.loads(OPENAPI.read_text())["paths"].items()
    for method in item
)
# Cases per operation, (positive, negative): the generating routes get the most;
# positive cases cost more (most are served, negative ones mostly refused).
GENERATING = (30, 40)
HTTP_EXAMPLES = {
    "/generate": GENERATING,
    "/generate_stream": GENERATING,
    "/": GENERATING,
    "/tokenize": (25, 25),
    "/v1/chat/completions": GENERATING,
    "/v1/completions": GENERATING,
    "/v1/responses": GENERATING,
    "/v1/messages": GENERATING,
    "/v1/messages/count_tokens": (25, 25),
    "/invocations": (12, 12),  # routed to /, chat or completions by its body (lua.py)
}
HTTP_TARGETS = [
    pytest.param(path, method, mode, id=f"{method} {path} {mode.value}")
    for path, method in HTTP_OPERATIONS
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if method == "POST" or mode is GenerationMode.POSITIVE  # a GET has nothing to negate
]
SCHEMA_CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance]


def curl(case, base_url: str) -> str:
    try:
        return case.as_curl_command(base_url=base_url)
    except Exception:  # noqa: BLE001 - the body is reported anyway
        return f"{case.method} {case.path} body={case.body!r}"


def typed_error(path: str, raw: bytes) -> tuple[str, str]:
    """(error_type, message) of a typed error body in the route's face; fails otherwise
    (on Anthropic's face, Anthropic's type)."""
    try:
        body = json.loads(raw)
    except ValueError:
        raise AssertionError(f"error body is not JSON: {raw[:300]!r}") from None
    if path.startswith(ANTHROPIC):
        error = body.get("error") if isinstance(body, dict) else None
        assert body.get("type") == "error" and isinstance(error, dict), (
            f"not Anthropic's error shape: {body}"
        )
        assert set(error) == {"type", "message"} and error["message"], f"untyped error: {body}"
        return error["type"], error["message"]
    # SageMaker's /invocations answers in the face of the body it was sent (lua.py)
    sagemaker_openai = (
        path == "/invocations" and isinstance(body, dict) and isinstance(body.get("error"), dict)
    )
    if path.startswith("/v1/") or sagemaker_openai:
        error = body.get("error") if isinstance(body, dict) else None
        assert isinstance(error, dict) and set(error) >= {"message", "type", "param", "code"}, (
            f"not OpenAI's error shape: {body}"
        )
        error_type, message = error["type"], error["message"]
    else:
        assert isinstance(body, dict) and set(body) == {"error", "error_type"}, (
            f"not TGI's error shape: {body}"
        )
        error_type, message = body["error_type"], body["error"]
    assert isinstance(error_type, str) and isinstance(message, str) and message, (
        f"untyped error: {body}"
    )
    return error_type, message


def sse_events(raw: bytes) -> list[bytes]:
    return [line[5:].strip() for line in raw.splitlines() if line.startswith(b"data:")]


RESPONSE_ENDS = ("response.completed", "response.incomplete")


def check_responses_stream(raw: bytes, what: str) -> None:
    """The Responses API's events: each named (`event:`) as its data's type, numbered
    from 0, from response.created to response.completed/incomplete, none an `error`."""
    frames = [f for f in raw.decode().split("\n\n") if f.strip()]
    assert frames, f"empty event stream: {what}"
    events = []
    for i, frame in enumerate(frames):
        fields = dict(line.split(": ", 1) for line in frame.splitlines())
        event = json.loads(fields["data"])
        assert fields.get("event") == event.get("type"), f"event {i} misnamed: {frame}: {what}"
        assert event.get("type") != "error", (
            f"in-band error: accepted input failed in the engine: {event}: {what}"
        )
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events))), what
    assert events[0]["type"] == "response.created", what
    assert events[-1]["type"] in RESPONSE_ENDS, f"stream ended early: {events[-1]}: {what}"


ANTHROPIC_ORDER = {
    "message_start": ("content_block_start", "message_delta"),
    "content_block_start": ("ping", "content_block_delta", "content_block_stop"),
    "ping": ("content_block_delta", "content_block_stop"),
    "content_block_delta": ("content_block_delta", "content_block_stop"),
    "content_block_stop": ("content_block_start", "message_delta"),
    "message_delta": ("message_stop",),
}


def check_anthropic_stream(raw: bytes, what: str) -> None:
    """Anthropic's events: each named (`event:`) as its data's type, from message_start to
    message_stop in Anthropic's order, none an `error`."""
    frames = [f for f in raw.decode().split("\n\n") if f.strip()]
    kinds = []
    for i, frame in enumerate(frames):
        fields = dict(line.split(": ", 1) for line in frame.splitlines())
        event = json.loads(fields["data"])
        assert fields.get("event") == event.get("type"), f"event {i} misnamed: {frame}: {what}"
        assert event["type"] != "error", f"in-band error: accepted input failed: {event}: {what}"
        kinds.append(event["type"])
    assert kinds and kinds[0] == "message_start", what
    assert kinds[-1] == "message_stop", f"stream ended early: {kinds[-3:]}: {what}"
    for kind, after in itertools.pairwise(kinds):
        assert after in ANTHROPIC_ORDER[kind], f"{after} after {kind}: {kinds}: {what}"


def check_stream(path: str, raw: bytes, what: str) -> None:
    """Every `data:` line is JSON: an event of the stream or a typed error; OpenAI's
    streams end with `data: [DONE]` (the Responses API's with response.completed,
    Anthropic's with message_stop), TGI's with the event that has details."""
    if path == "/v1/responses":
        return check_responses_stream(raw, what)
    if path == ANTHROPIC:
        return check_anthropic_stream(raw, what)
    events = sse_events(raw)
    assert events, f"empty event stream: {what}"
    openai = path.startswith("/v1/")
    if path == "/invocations":  # TGI's stream for TGI's body, OpenAI's for OpenAI's
        first = json.loads(events[0]) if events[0] != b"[DONE]" else {}
        openai = isinstance(first, dict) and "object" in first
    if openai:
        assert events[-1] == b"[DONE]", (
            f"OpenAI stream does not end with [DONE]: {events[-3:]}: {what}"
        )
        events = events[:-1]
    for i, data in enumerate(events):
        try:
            event = json.loads(data)
        except ValueError:
            raise AssertionError(f"SSE event {i} is not JSON: {data[:300]!r}: {what}") from None
        assert isinstance(event, dict), f"SSE event {i} is not an object: {data[:300]!r}"
        assert "error" not in event, (
            f"in-band error: accepted input failed in the engine: {event}: {what}"
        )
        if openai:
            assert event.get("object") in ("chat.completion.chunk", "text_completion"), event
        else:
            assert "index" in event and "token" in event, f"not a stream event: {event}: {what}"
    if not openai:
        last = json.loads(events[-1])
        assert "details" in last and "generated_text" in last, f"stream ended early: {last}: {what}"


def check_http(
    replica: FuzzReplica, path: str, case, response: requests.Response, base_url: str
) -> None:
    what = f"{curl(case, base_url)} -> {response.status_code} {response.content[:500]!r}"
    assert replica.alive, f"the request killed the engine (every later request fails): {what}"
    status = response.status_code
    media_type = response.headers.get("content-type", "").split(";")[0].strip()
    if status >= 300:
        error_type, _ = typed_error(path, response.content)
        refusals = REFUSALS_HTTP | ({(404, "not_found")} if STORED in path else set())
        if path.startswith(ANTHROPIC):
            refusals = REFUSALS_ANTHROPIC
        assert (status, error_type) in refusals, (
            f"{status} {error_type}: not a refusal of bad input "
            f"(a crash or an engine failure): {what}"
        )
        if not path.startswith(ANTHROPIC):
            assert HTTP_STATUS_BY_ERROR_TYPE[error_type] == status or status == 413
    elif media_type == "text/event-stream":
        check_stream(path, response.content, what)
    case.validate_response(response, checks=SCHEMA_CHECKS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path, method, mode", HTTP_TARGETS)
def test_http_fuzz(replica, path, method, mode):
    operation = SCHEMA[path][method]
    positive, negative = HTTP_EXAMPLES.get(path, (3, 0))
    examples = positive if mode is GenerationMode.POSITIVE else negative
    key = f"http {method} {path} {mode.value}"

    @fuzz_settings(examples)
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        replica.ensure_alive()
        CASES[key] += 1
        base_url = replica.http_url
        kwargs = case.as_transport_kwargs(base_url=base_url)
        try:
            response = requests.request(**kwargs, timeout=(5, CALL_TIMEOUT))
        except requests.RequestException as exc:  # reset, hang, broken chunking
            raise AssertionError(
                f"no answer ({type(exc).__name__}: {exc}): {curl(case, base_url)}"
            ) from None
        check_http(replica, path, case, response, base_url)

    run()
    assert CASES[key] >= 1


# HTTP: hand-picked hostile bodies (explicit cases the generators rarely reach) ---

HOSTILE_BODIES = [
    # /tokenize parses its body itself (TGI's or vLLM's shape)
    ("/tokenize", b'\x80{"inputs": "x"}'),
    ("/tokenize", '{"inputs": ' + "[" * 10_000 + "]" * 10_000 + "}"),
    ("/tokenize", '{"prompt": ' + "[" * 10_000 + "]" * 10_000 + "}"),
    ("/tokenize", '{"prompt": "x", "inputs": 3}'),
    ("/tokenize", '{"prompt": "x", "return_token_strs": "yes"}'),
    ("/tokenize", '{"messages": [], "add_generation_prompt": false}'),
    (
        "/tokenize",
        '{"messages": [{"role": "user", "content": "hi"}], "continue_final_message": true}',
    ),
    ("/tokenize", '{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}'),
    ("/detokenize", '{"tokens": [18446744073709551615]}'),
    ("/detokenize", '{"tokens": [-1, 0]}'),
    # JSON numbers and proto3 JSON's special float strings
    ("/generate", '{"inputs": "hi", "parameters": {"max_new_tokens": 2, "temperature": "NaN"}}'),
    ("/generate", '{"inputs": "hi", "parameters": {"max_new_tokens": 2, "temperature": 1e-40}}'),
    (
        "/generate",
        '{"inputs": "hi", "parameters": {"max_new_tokens": 2, "temperature": "Infinity"}}',
    ),
    (
        "/generate",
        (
            '{"inputs": "hi", "parameters": '
            '{"max_new_tokens": 2, "repetition_penalty": "NaN", "details": true}}'
        ),
    ),
    ("/generate", '{"inputs": "hi", "parameters": {"max_new_tokens": 2, "top_p": "-Infinity"}}'),
    ("/generate", '{"inputs": "hi", "parameters": {"max_new_tokens": 1e400}}'),
    ("/generate", '{"inputs": "hi", "parameters": {"seed": 18446744073709551616}}'),
    ("/generate", '{"inputs": "hi", "parameters": {"logit_bias": {"4294967296": 1}}}'),
    (
        "/generate_stream",
        '{"inputs": "hi", "parameters": {"max_new_tokens": 2, "temperature": "NaN"}}',
    ),
    (
        "/",
        '{"inputs": "hi", "stream": true, "parameters": {"max_new_tokens": 2, "typical_p": "NaN"}}',
    ),
    # structure
    ("/generate", '{"inputs": "hi", "parameters": {"max_new_tokens": 2}, "inputs": ""}'),
    ("/generate", '{"inputs": ' + "[" * 10_000 + "]" * 10_000 + "}"),
    ("/generate", b'{"inputs": "\xff\xfe", "parameters": {"max_new_tokens": 2}}'),
    ("/generate", '{"inputs": "\\ud800", "parameters": {"max_new_tokens": 2}}'),
    ("/generate", "\ufeff{}"),
    ("/", '{"stream": "true", "inputs": "hi", "parameters": {"max_new_tokens": 2}}'),
    # SageMaker's /invocations: a body that names no route, or two
    ("/invocations", "{}"),
    ("/invocations", "[]"),
    ("/invocations", '{"stream": true, "parameters": {"max_new_tokens": 2}}'),
    ("/invocations", '{"inputs": "hi", "messages": [], "parameters": {"max_new_tokens": 2}}'),
    ("/invocations", '{"\\u0069nputs": "hi", "parameters": {"max_new_tokens": 2}}'),
    ("/invocations", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 0}'),
    # OpenAI: Python's json reads NaN/Infinity; integers beyond the proto's fields
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": NaN}',
    ),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 1e-40}',
    ),
    (
        "/v1/chat/completions",
        (
            '{"messages": [{"role": "user", "content": "hi"}], '
            '"max_tokens": 2, "seed": 1180591620717411303424}'
        ),
    ),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1099511627776}',
    ),
    (
        "/v1/chat/completions",
        (
            '{"messages": [{"role": "user", "content": "hi"}], '
            '"max_tokens": 2, "logprobs": true, "top_logprobs": 4294967296}'
        ),
    ),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "logit_bias": {"99999999999": 1}}'),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "logit_bias": {"\\u00b2": 1}}'),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "logprobs": 1099511627776}'),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "frequency_penalty": NaN}'),
    ("/v1/completions", '{"prompt": ["hi", "yo"], "max_tokens": 2, "stream": true, "echo": true}'),
    # the Responses API: loose items, numbers beyond the proto fields, NaN
    ("/v1/responses", '{"input": "hi", "max_output_tokens": 2, "temperature": NaN}'),
    ("/v1/responses", '{"input": "hi", "max_output_tokens": 1099511627776}'),
    ("/v1/responses", '{"input": [null, 3, "x"], "max_output_tokens": 2}'),
    ("/v1/responses", '{"input": [{"type": "function_call", "call_id": 1}]}'),
    ("/v1/responses", '{"input": [{"role": "user", "content": [{"type": "input_text"}]}]}'),
    ("/v1/responses", '{"input": "hi", "max_output_tokens": 2, "tools": {"type": "function"}}'),
    ("/v1/responses", '{"input": "hi", "max_output_tokens": 2, "text": {"format": "json"}}'),
    ("/v1/responses", '{"input": "hi", "max_output_tokens": 2, "metadata": {"a": ["b"]}}'),
    ("/v1/responses", '{"input": "hi", "max_output_tokens": 2, "include": "logprobs"}'),
    ("/v1/responses", '{"input": "hi", "max_output_tokens": 2, "previous_response_id": 7}'),
    (
        "/v1/responses",
        (
            '{"input": [{"type": "function_call_output", "call_id": "c", "output": "ok"}],'
            ' "max_output_tokens": 2, "stream": true}'
        ),
    ),
    # Anthropic's Messages API: loose blocks, turns in the wrong role, NaN, huge numbers
    ("/v1/messages", '{"model": "m", "max_tokens": 2, "messages": [], "temperature": NaN}'),
    ("/v1/messages", '{"model": "m", "max_tokens": 1099511627776, "messages": []}'),
    ("/v1/messages", '{"model": "m", "max_tokens": 2, "messages": [null, 3, "x"]}'),
    (
        "/v1/messages",
        '{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [{}]}]}',
    ),
    (
        "/v1/messages",
        (
            '{"model": "m", "max_tokens": 2, "stream": true, "messages": [{"role": "user",'
            ' "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}]}'
        ),
    ),
    (
        "/v1/messages",
        (
            '{"model": "m", "max_tokens": 2, "messages": [{"role": "assistant",'
            ' "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}'
        ),
    ),
    (
        "/v1/messages",
        (
            '{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],'
            ' "tools": [{"name": "f", "input_schema": {"type": "nonsense"}}]}'
        ),
    ),
    (
        "/v1/messages/count_tokens",
        '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}',
    ),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "path, body", HOSTILE_BODIES, ids=[f"{p} {i}" for i, (p, _) in enumerate(HOSTILE_BODIES)]
)
def test_http_hostile_body(replica, path, body):
    replica.ensure_alive()
    CASES["http hand-picked bodies"] += 1
    try:
        response = requests.post(
            replica.http_url + path,
            data=body if isinstance(body, bytes) else body.encode(),
            headers={"Content-Type": "application/json"},
            timeout=(5, CALL_TIMEOUT),
        )
    except requests.RequestException as exc:
        raise AssertionError(
            f"no answer ({type(exc).__name__}: {exc}) to POST {path} {body!r}"
        ) from None
    what = f"POST {path} {body[:200]!r} -> {response.status_code} {response.content[:500]!r}"
    assert replica.alive, f"the request killed the engine (every later request fails): {what}"
    if response.status_code >= 300:
        error_type, _ = typed_error(path, response.content)
        refusals = REFUSALS_ANTHROPIC if path.startswith(ANTHROPIC) else REFUSALS_HTTP
        assert (response.status_code, error_type) in refusals, (
            f"{response.status_code} {error_type}: not a refusal of bad input: {what}"
        )
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        check_stream(path, response.content, what)
    # the answer is one envoy/openapi.json describes (no "NaN" where a number belongs)
    SCHEMA[path]["POST"].validate_response(response)
