"""The SDK's SSE streams over HTTP (textgen.sdk.sse.EventStream, textgen.sdk.http_streams):
a stream that ends, or breaks, before its last event is an IncompleteGenerationError
that says how many tokens arrived; error events and refusals raise their class.

The HTTP functions run against a scripted standard-library server on 127.0.0.1 that
can cut a chunked body short, as Envoy does when the replica behind it dies
(docs/failures.md); tests/integration/test_replicas.py kills a real one.
"""

from __future__ import annotations

import http.client
import http.server
import json
import socket
import threading
from collections.abc import Iterator

import pytest
from textgen.sdk import (
    IncompleteGenerationError,
    OverloadedError,
    UnavailableError,
    ValidationError,
)
from textgen.sdk.http_streams import (
    chat_completions_stream,
    generate_stream,
    openai_events,
    responses_stream,
    tgi_events,
)

pytestmark = pytest.mark.timeout(30)


def sse(*events: object) -> bytes:
    return b"".join(
        b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    )


def token(index: int) -> dict:
    return {"index": index, "token": {"id": index, "text": f" t{index}", "special": False}}


TOKENS = [token(i) for i in (1, 2, 3)]
FINAL = {**token(4), "generated_text": " t1 t2 t3 t4", "details": {"generated_tokens": 4}}
TGI = sse(*TOKENS, FINAL)

ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
CONTENT = [{"choices": [{"index": 0, "delta": {"content": c}}]} for c in ("Pa", "ris")]
STOP = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
CHAT = sse(ROLE, *CONTENT, STOP, b"[DONE]")


def split(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def broken_after(data: bytes, exc: Exception) -> Iterator[bytes]:
    """A body reader that yields `data`, then fails as a cut connection does."""
    yield data
    raise exc


# --- EventStream: bytes in, checked events out --------------------------------------


@pytest.mark.parametrize("size", [1, 7, 10_000])
def test_a_whole_tgi_stream_in_any_split(size: int) -> None:
    assert list(tgi_events(split(TGI, size))) == [*TOKENS, FINAL]


def test_tgi_stream_ending_before_its_last_event_is_incomplete() -> None:
    events = []
    with pytest.raises(IncompleteGenerationError) as raised:
        events.extend(tgi_events([sse(*TOKENS)]))
    assert events == TOKENS
    assert raised.value.tokens_received == 3
    assert "ended before its last event (3 tokens received)" in raised.value.message


def test_tgi_stream_cut_mid_event_is_incomplete() -> None:
    cut = TGI[: TGI.index(b"generated_text")]  # the final event half there
    with pytest.raises(IncompleteGenerationError) as raised:
        list(tgi_events([cut]))
    assert raised.value.tokens_received == 3


def test_a_body_that_breaks_is_incomplete_with_its_cause() -> None:
    reader = broken_after(sse(*TOKENS[:2]), http.client.IncompleteRead(b""))
    with pytest.raises(IncompleteGenerationError) as raised:
        list(tgi_events(reader))
    assert raised.value.tokens_received == 2
    assert isinstance(raised.value.__cause__, http.client.IncompleteRead)


def test_a_body_that_breaks_after_the_last_event_is_whole() -> None:
    reader = broken_after(TGI, ConnectionResetError())
    assert list(tgi_events(reader)) == [*TOKENS, FINAL]


def test_an_error_event_raises_its_class_with_tokens_received() -> None:
    error = {"error": "Request failed during generation", "error_type": "incomplete_generation"}
    events = []
    with pytest.raises(IncompleteGenerationError) as raised:
        events.extend(tgi_events([sse(*TOKENS[:2], error)]))
    assert events == TOKENS[:2]
    assert (raised.value.message, raised.value.tokens_received) == (error["error"], 2)
    overloaded = {"error": {"message": "busy", "type": "overloaded"}}
    with pytest.raises(OverloadedError):
        list(openai_events([sse(overloaded)]))


def test_openai_stream_ends_at_done_and_counts_text_chunks() -> None:
    assert list(openai_events(split(CHAT, 5))) == [ROLE, *CONTENT, STOP]
    with pytest.raises(IncompleteGenerationError) as raised:
        list(openai_events([sse(ROLE, *CONTENT)]))  # no [DONE]
    assert raised.value.tokens_received == 2  # the role chunk carries no text


def test_responses_stream_ends_at_its_last_event() -> None:
    delta = {"type": "response.output_text.delta", "delta": "Paris"}
    done = {"type": "response.completed", "response": {"error": None}}
    assert list(openai_events([sse(delta, done)])) == [delta, done]
    with pytest.raises(IncompleteGenerationError) as raised:
        list(openai_events([sse(delta)]))
    assert raised.value.tokens_received == 1


# --- http_streams: a real HTTP/1.1 exchange -----------------------------------------


class Script(http.server.BaseHTTPRequestHandler):
    """Answers every POST as `server.script` says: (status, body, cut) where `cut`
    closes the connection without the chunked body's last chunk."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.server.requests.append(  # type: ignore[attr-defined]
            (
                self.path,
                dict(self.headers),
                json.loads(self.rfile.read(int(self.headers["Content-Length"]))),
            )
        )
        status, body, cut = self.server.script  # type: ignore[attr-defined]
        self.send_response(status)
        self.send_header(
            "Content-Type", "text/event-stream" if status == 200 else "application/json"
        )
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for piece in split(body, 50):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        if cut:  # as Envoy does when the upstream resets after the headers
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[http.server.ThreadingHTTPServer]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Script)
    httpd.requests, httpd.script = [], (200, TGI, False)  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def url(server: http.server.ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_generate_stream_sends_tgi_json_and_yields_events(server) -> None:
    events = list(
        generate_stream(
            url(server), "Hello", api_key="k", timeout=10, max_new_tokens=4, top_n_tokens=2
        )
    )
    assert events == [*TOKENS, FINAL]
    path, headers, body = server.requests[-1]
    assert (path, headers["Authorization"]) == ("/generate_stream", "Bearer k")
    assert body == {"inputs": "Hello", "parameters": {"max_new_tokens": 4, "top_n_tokens": 2}}


def test_a_cut_chunked_body_is_incomplete(server) -> None:
    server.script = (200, sse(*TOKENS), True)
    events = []
    with pytest.raises(IncompleteGenerationError) as raised:
        events.extend(generate_stream(url(server), "Hello", timeout=10))
    assert events == TOKENS and raised.value.tokens_received == 3
    assert isinstance(raised.value.__cause__, http.client.IncompleteRead)


def test_openai_streams_send_stream_true(server) -> None:
    server.script = (200, CHAT, False)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert list(chat_completions_stream(url(server) + "/", body, timeout=10)) == [
        ROLE,
        *CONTENT,
        STOP,
    ]
    path, _, sent = server.requests[-1]
    assert (path, sent) == ("/v1/chat/completions", {**body, "stream": True})
    server.script = (200, CHAT[: CHAT.index(b"[DONE]")], True)
    with pytest.raises(IncompleteGenerationError):
        list(responses_stream(url(server), {"input": "hi"}, timeout=10))


def test_refusals_raise_their_class(server) -> None:
    server.script = (
        422,
        b'{"error":"`inputs` must not be empty","error_type":"validation"}',
        False,
    )
    with pytest.raises(ValidationError, match="must not be empty"):
        list(generate_stream(url(server), "", timeout=10))
    server.script = (503, b"upstream connect error", False)  # not JSON: by status
    with pytest.raises(UnavailableError, match="HTTP 503"):
        list(generate_stream(url(server), "Hello", timeout=10))


def test_an_unreachable_server_is_unavailable() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(UnavailableError):
        list(generate_stream(f"http://127.0.0.1:{port}", "Hello", timeout=10))
