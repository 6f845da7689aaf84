"""Several replicas behind `textgen proxy` (a real Envoy, rendered front=True), all
real processes on this machine with the tiny model: load balancing, the retry of a
refused request onto another replica before its first byte (HTTP and native gRPC),
a replica killed under load, a replica draining on SIGTERM, a replica killed under the
SDK's streams (their typed end: docs/failures.md), and stored responses (OpenAI's
Responses API) reached on the replica that made them.

One `stable` replica and the proxy live for the module; each test gets a `victim`
replica on one fixed port (the proxy knows both addresses from the start, as it
would a pod's), in Envoy's rotation, and does something to it: a fresh process
unless the previous test left one running, idle, with the same flags. Every
process is stopped by PID in a fixture's teardown.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import http.client
import json
import signal
import threading
import time
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2
from support.replica_processes import Proc, Proxy, Replica, free_port, wait_until
from support.tiers import server_fixture
from textgen.envoy.clusters import NUM_RETRIES
from textgen.sdk import Client, IncompleteGenerationError, TextGenError, http_streams
from textgen.service.openai.response_store import replica_of
from textgen.service.proto import generate_pb2 as pb
from textgen.service.proto import text_generation_service_pb2 as svc_pb
from textgen.service.proto import text_generation_service_pb2_grpc as svc_grpc

pytestmark = pytest.mark.timeout(60)

# clients ------------------------------------------------------------------------------


def http_call(port: int, path: str, body: dict, timeout: float = 30) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def http_stream(port: int, tokens: int, started: threading.Event | None = None) -> str:
    """One /generate_stream of `tokens` tokens: 'ok' when every frame and the final
    details arrived, else what went wrong (never hangs: socket timeout)."""
    body = {
        "inputs": "The quick brown fox",
        "parameters": {"max_new_tokens": tokens, "ignore_eos": True},
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(
            "POST", "/generate_stream", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            return f"status {resp.status}: {resp.read()[:200]!r}"
        frames = []
        while line := resp.readline():
            if line.startswith(b"data:"):
                frames.append(json.loads(line[5:]))
                if started is not None:
                    started.set()
        if len(frames) == tokens and frames[-1].get("details"):
            return "ok"
        return f"cut after {len(frames)} frames"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return f"cut: {type(exc).__name__}"
    finally:
        conn.close()


def grpc_stream(target: str, tokens: int, started: threading.Event | None = None) -> str:
    request = pb.GenerateRequest(
        inputs="The quick brown fox",
        parameters=pb.GenerateParameters(max_new_tokens=tokens, ignore_eos=True),
    )
    with grpc.insecure_channel(target) as channel:
        stub = svc_grpc.TextGenerationServiceStub(channel)
        try:
            messages = []
            for m in stub.GenerateStream(request, timeout=30):
                messages.append(m)
                if started is not None:
                    started.set()
        except grpc.RpcError as exc:
            return f"cut: {exc.code().name}"
    ok = len(messages) == tokens and messages[-1].HasField("details")
    return "ok" if ok else f"cut after {len(messages)} messages"


class Watch:
    """When (monotonic) a replica first leaves the proxy's rotation, polled from a thread,
    and whether its process was still running at that moment."""

    def __init__(self, proxy: Proxy, port: int, process: Proc | None = None) -> None:
        self.at: float | None = None
        self.alive_at_out: bool | None = None
        self.flags = ""
        self._process = process
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(proxy, port), daemon=True)
        self._thread.start()

    def _run(self, proxy: Proxy, port: int) -> None:
        while not self._done.is_set():
            self.flags = proxy.health_flags(port)
            if "failed_active_hc" in self.flags:
                self.at = time.monotonic()
                self.alive_at_out = self._process is not None and self._process.alive()
                return
            time.sleep(0.05)

    def wait(self, timeout: float) -> float | None:
        self._thread.join(timeout)
        self._done.set()
        return self.at


def short_request(port: int, i: int, prompt: str = "hi") -> tuple[str, str | None]:
    """A short generation through the proxy, by turns HTTP unary, HTTP stream, gRPC
    unary, gRPC stream: ('ok' or the failure, x-envoy-attempt-count). The proxy routes
    by the prompt's leading bytes (prefix affinity): distinct prompts spread over the
    replicas, one prompt sticks to one."""
    params = {"max_new_tokens": 4, "ignore_eos": True}
    kind = i % 4
    if kind in (0, 1):
        path = "/generate" if kind == 0 else "/generate_stream"
        status, headers, body = http_call(port, path, {"inputs": prompt, "parameters": params})
        ok = status == 200 and (kind == 0 or body.count(b"data:") == 4)
        return ("ok" if ok else f"{path} {status}: {body[:200]!r}"), headers.get(
            "x-envoy-attempt-count"
        )
    request = pb.GenerateRequest(inputs=prompt, parameters=pb.GenerateParameters(**params))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = svc_grpc.TextGenerationServiceStub(channel)
        try:
            if kind == 2:
                _, call = stub.Generate.with_call(request, timeout=30)
                ok = True
            else:
                call = stub.GenerateStream(request, timeout=30)
                ok = len(list(call)) == 4
            attempts = dict(call.initial_metadata()).get("x-envoy-attempt-count")
        except grpc.RpcError as exc:
            return f"grpc {exc.code().name}: {exc.details()}", None
    return ("ok" if ok else "grpc stream cut"), attempts


# fixtures -----------------------------------------------------------------------------


@server_fixture(scope="module")
def stable(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("replicas") / "stable.log"
    replica = Replica(tiny_model_dir, free_port(), log)
    yield replica
    replica.stop()


@pytest.fixture(scope="module")
def victim_port() -> int:
    return free_port()


@server_fixture(scope="module")
def proxy(stable, victim_port, tmp_path_factory):
    log = tmp_path_factory.mktemp("proxy") / "proxy.log"
    front = Proxy([stable.port, victim_port], log)
    yield front
    front.stop()


class Victims:
    """The victim replica on victim_port. One that a test left running (same flags)
    serves the next test too: starting a replica is most of this file's time."""

    def __init__(self, model_dir: Path, port: int, log_dir: Path) -> None:
        self.model_dir, self.port, self.log_dir = model_dir, port, log_dir
        self.current: Replica | None = None
        self.flags: tuple[str, ...] = ()
        self.started = 0

    def get(self, flags: tuple[str, ...]) -> Replica:
        if self.current is not None and self.current.alive() and self.flags == flags:
            with contextlib.suppress(grpc.RpcError):
                if self.current.in_flight() == 0:  # left idle, as a new one would be
                    return self.current
        self.close()
        self.started += 1
        log = self.log_dir / f"victim-{self.started}.log"
        self.current, self.flags = Replica(self.model_dir, self.port, log, *flags), flags
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.current.stop(timeout=5)  # SIGTERM, then SIGKILL; by PID
            self.current = None


@pytest.fixture(scope="module")
def victims(tiny_model_dir, victim_port, tmp_path_factory):
    pool = Victims(tiny_model_dir, victim_port, tmp_path_factory.mktemp("victims"))
    yield pool
    pool.close()


@pytest.fixture
def victim(request, victims, stable, proxy):
    """The second replica (flags: the test's indirect parameter), in Envoy's rotation.
    Killed or drained by the test, it is reaped at once; left running and idle, it
    may serve the next test."""
    replica = victims.get(getattr(request, "param", ()))
    try:
        stable.wait_serving()
        replica.wait_serving()
        # Both in Envoy's rotation before the test sends anything: each needs two passed
        # health checks once it serves (stable too, when it started with the proxy), and
        # a victim an earlier test killed or drained stays ejected: the base ejection
        # time (10 s) times the ejections so far, lifted at the next 5 s sweep (the
        # module's second ejection: 20-25 s).
        flags = lambda: {r.port: proxy.health_flags(r.port) for r in (stable, replica)}
        in_rotation = lambda: set(flags().values()) == {"healthy"}
        assert wait_until(in_rotation, 45), flags()
        yield replica
    finally:
        if not replica.alive():
            victims.close()


# tests --------------------------------------------------------------------------------


def test_two_replicas_share_sixteen_streams(stable, victim, proxy):
    """16 concurrent HTTP streams through the proxy all complete, and least-request
    balancing gives both replicas a share (each replica's own tgi_request_success)."""
    before = [r.counter("tgi_request_success") for r in (stable, victim)]
    with cf.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda _: http_stream(proxy.http_port, 32), range(16)))
    assert results == ["ok"] * 16
    served = [r.counter("tgi_request_success") - b for r, b in zip((stable, victim), before)]
    assert sum(served) == 16, served
    assert min(served) >= 2, f"one replica got almost nothing: {served}"


def test_killed_replica_under_load(stable, victim, proxy):
    """kill -9 of the victim with streams running on both replicas: the victim's
    in-flight streams end with an error (none hangs), the stable replica's complete,
    every request sent after the kill succeeds, and Envoy's health check takes the
    victim out within ~2 s."""
    streams, firsts = [], []
    with cf.ThreadPoolExecutor(10) as pool:
        for i in range(10):
            first = threading.Event()
            firsts.append(first)
            if i % 5 == 4:
                streams.append(pool.submit(grpc_stream, f"127.0.0.1:{proxy.http_port}", 400, first))
            else:
                streams.append(pool.submit(http_stream, proxy.http_port, 400, first))
        assert all(f.wait(20) for f in firsts)
        on_victim = victim.in_flight()
        assert on_victim >= 1, "no stream landed on the victim"

        victim.popen.kill()  # SIGKILL, by PID
        killed = time.monotonic()
        watch = Watch(proxy, victim.port)
        after = [short_request(proxy.http_port, i) for i in range(16)]
        out_at = watch.wait(6)
        results = [f.result(timeout=40) for f in streams]  # none hangs

    assert [a[0] for a in after] == ["ok"] * len(after), after
    # One that met the dead replica was resent, within the retry policy's attempts.
    # Until Envoy's workers learn of its ejection (ms), the ring's bounded load can
    # send a retry back to it (clusters.py, TRAP 2); the back-offs outlast that.
    attempts = {str(n) for n in range(1, NUM_RETRIES + 2)}
    assert {a[1] for a in after} <= attempts, after
    assert out_at, watch.flags
    left_after = out_at - killed
    assert left_after < 4.0, left_after
    cut = [r for r in results if r != "ok"]
    assert all(r.startswith("cut") for r in cut), results
    # the victim's streams, and only those, were cut (a stream still waiting for its
    # first token could be retried instead; all had one here)
    assert len(cut) == on_victim, (on_victim, results)
    print(f"killed replica out of rotation after {left_after:.2f}s; streams: {results}")


@pytest.mark.parametrize(
    "victim", [("--max-concurrent-requests", "1")], indirect=True, ids=["victim-admits-1"]
)
def test_overloaded_replica_is_retried_on_the_other(stable, victim, proxy):
    """The victim admits one request, held here by a long stream straight to it. What
    the proxy sends it is refused (RESOURCE_EXHAUSTED = 429 `overloaded`, before any
    byte) and Envoy resends it to the stable replica: no client sees the 429, on the
    transcoded HTTP face as on native gRPC, unary and streaming."""
    started, held = threading.Event(), []
    holder = threading.Thread(target=lambda: held.append(grpc_stream(victim.target, 1000, started)))
    holder.start()
    try:
        assert started.wait(10)
        refused_before = victim.counter('tgi_request_failure{err="overloaded"}')
        retries_before = proxy.counter("cluster.textgen_grpc.upstream_rq_retry")
        results = []
        for face in ("http", "grpc"):
            face_start = victim.counter('tgi_request_failure{err="overloaded"}')
            for i in range(24):  # distinct prompts hash to the victim about every other time
                kind = i % 2 + (0 if face == "http" else 2)
                results.append((face, *short_request(proxy.http_port, kind, f"hi {face} {i}")))
                retried = [r for r in results if r[0] == face and r[2] == "2"]
                if len(retried) >= 2 and i >= 3:
                    break
            moved = victim.counter('tgi_request_failure{err="overloaded"}') - face_start
            assert moved >= 2, f"{face}: the victim refused nothing, no retry shown: {results}"
        assert holder.is_alive(), "the held stream ended too early: the test proved nothing"
    finally:
        holder.join(30)
    assert [r[1] for r in results] == ["ok"] * len(results), results
    refused = victim.counter('tgi_request_failure{err="overloaded"}') - refused_before
    # Every refused request was resent once, straight to the stable replica, never a
    # third attempt: a retry walks the ring away from the replica it tried
    # (previous_hosts, up to HOST_SELECTION_ATTEMPTS draws).
    assert {r[2] for r in results} <= {"1", "2"}, results
    retried = sum(r[2] == "2" for r in results)
    assert retried == refused, (retried, refused, results)
    # and Envoy's own count agrees: one retry per refusal
    retries = proxy.counter("cluster.textgen_grpc.upstream_rq_retry") - retries_before
    assert retries == refused, (retries, refused)
    assert held == ["ok"]


def test_sigterm_drains_without_a_failure(stable, victim, proxy):
    """SIGTERM to the victim mid-load (the drain contract: health NOT_SERVING, new
    requests UNAVAILABLE, in-flight finish, exit 0): Envoy takes it out of the
    rotation while it still runs its streams, they finish, and no request through
    the proxy fails meanwhile (the few Envoy sent it before are retried)."""
    firsts = [threading.Event() for _ in range(7)]
    with cf.ThreadPoolExecutor(8) as pool:
        # straight to the victim, and long: it is surely there and keeps it draining
        direct = pool.submit(grpc_stream, victim.target, 1000, firsts[0])
        streams = [pool.submit(http_stream, proxy.http_port, 300, e) for e in firsts[1:]]
        assert all(f.wait(20) for f in firsts)
        assert victim.in_flight() >= 1

        victim.popen.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        watch = Watch(proxy, victim.port, victim)
        # the drain contract, seen on the victim itself
        assert wait_until(
            lambda: victim.serving_status() == health_pb2.HealthCheckResponse.NOT_SERVING, 2
        )
        with pytest.raises(grpc.RpcError) as refused:
            victim.stub.Generate(
                pb.GenerateRequest(inputs="hi", parameters=pb.GenerateParameters(max_new_tokens=2)),
                timeout=10,
            )
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # meanwhile, through the proxy: nothing fails
        during, refused_by_victim = [], None
        while time.monotonic() - signalled < 3.0:
            during.append(short_request(proxy.http_port, len(during), f"hi {len(during)}"))
            with contextlib.suppress(grpc.RpcError):
                refused_by_victim = victim.counter('tgi_request_failure{err="unavailable"}')
        out_at = watch.wait(3)
        # alive when Envoy took it out, not after the 3 s above: on a fast machine its
        # 1000 tokens may all be out by then, and a drained replica exits at once
        still_draining = watch.alive_at_out
        results = [direct.result(timeout=40)] + [f.result(timeout=40) for f in streams]

    assert [d[0] for d in during] == ["ok"] * len(during), during
    assert out_at, watch.flags
    assert still_draining, "the victim exited before Envoy took it out: nothing was shown"
    assert results == ["ok"] * len(results), results
    assert victim.popen.wait(30) == 0, victim.output()[-2000:]
    exited = time.monotonic()
    print(
        f"drain: out of rotation {out_at - signalled:.2f}s after SIGTERM, exit 0 after "
        f"{exited - signalled:.2f}s; {len(during)} requests through the proxy meanwhile, "
        f"{refused_by_victim} refused by the victim (UNAVAILABLE, incl. 1 direct) and retried"
    )


def served_by(proxy: Proxy, replica: Replica, prompt: str) -> bool:
    """Whether the proxy sends `prompt` to `replica` while both replicas are idle (its
    prefix-affinity home): one short generation through the proxy, seen in the
    replica's own request count."""
    before = replica.counter("tgi_request_count")
    status, _, body = http_call(
        proxy.http_port, "/generate", {"inputs": prompt, "parameters": {"max_new_tokens": 1}}
    )
    assert status == 200, body
    return replica.counter("tgi_request_count") > before


def homes(proxy: Proxy, stable: Replica, victim: Replica) -> dict[str, list[str]]:
    """Two prompts whose home is the victim, two whose home is the stable replica."""
    found: dict[str, list[str]] = {"victim": [], "stable": []}
    for i in range(64):
        prompt = f"{i} the quick brown fox"
        side = "victim" if served_by(proxy, victim, prompt) else "stable"
        if len(found[side]) < 2:
            found[side].append(prompt)
        if all(len(p) == 2 for p in found.values()):
            return found
    raise AssertionError(f"the ring sent 64 prompts one way: {found}")


class Streamed:
    """One long stream through the proxy with the SDK, on its own thread: the events
    (TGI's over HTTP, or the gRPC messages' indices) and how it ended."""

    def __init__(self, pool: cf.Executor, face: str, port: int, prompt: str) -> None:
        self.face, self.indices, self.error = face, [], None
        self.started = threading.Event()
        self.done = pool.submit(self._run, port, prompt)

    def _run(self, port: int, prompt: str) -> None:
        options = {"max_new_tokens": 400, "ignore_eos": True}
        try:
            if self.face == "http":
                url = f"http://127.0.0.1:{port}"
                for event in http_streams.generate_stream(url, prompt, timeout=30, **options):
                    self._arrived(event["index"])
            else:
                with Client(f"127.0.0.1:{port}", timeout=30) as client:
                    for message in client.generate_stream(prompt, **options):
                        self._arrived(message.index)
        except TextGenError as exc:
            self.error = exc

    def _arrived(self, index: int) -> None:
        self.indices.append(index)
        if len(self.indices) >= 2:
            self.started.set()


@pytest.mark.timeout(180)
def test_killed_replica_ends_its_streams_typed(stable, victim, proxy):
    """kill -9 of the victim while an HTTP and a gRPC stream run on it through the
    proxy (and one of each on the stable replica, which also keeps the ring's bounded
    load from moving the victim's): each of the victim's streams ends with the SDK's
    IncompleteGenerationError saying how many tokens arrived, and every one of those
    arrived, in order. Envoy can only cut them (HTTP: a chunked body cut short; gRPC:
    RST_STREAM, INTERNAL): docs/failures.md. The stable replica's streams complete."""
    prompts = homes(proxy, stable, victim)
    with cf.ThreadPoolExecutor(4) as pool:
        # one at a time, stable, victim, stable, victim: neither replica is ever more
        # than one stream ahead, so each stream stays on its prompt's home
        streams = []
        for i, face in enumerate(("http", "grpc")):
            for side in ("stable", "victim"):
                streams.append(Streamed(pool, face, proxy.http_port, prompts[side][i]))
                assert streams[-1].started.wait(60), (face, side, streams[-1].error)
        assert victim.in_flight() == 2 and stable.in_flight() == 2
        victim.popen.kill()  # SIGKILL, by PID
        for s in streams:
            s.done.result(timeout=60)  # none hangs

    on_stable, on_victim = streams[0::2], streams[1::2]
    assert [(s.error, len(s.indices)) for s in on_stable] == [(None, 400)] * 2
    for s in on_victim:
        assert isinstance(s.error, IncompleteGenerationError), (s.face, s.error)
        # every token that arrived, in order, and the error says how many
        received = len(s.indices)
        assert s.indices == list(range(1, received + 1)) and 2 <= received < 400
        assert s.error.tokens_received == received, (s.face, s.error)
    http_error, grpc_error = (s.error for s in on_victim)
    assert isinstance(http_error.__cause__, http.client.IncompleteRead), http_error
    # the status as the transport made it up: INTERNAL through Envoy (RST_STREAM)
    assert grpc_error.code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
    print(f"killed mid-stream: {[repr(s.error) for s in on_victim]}")


@pytest.mark.timeout(120)  # alone, it also starts the replicas and the proxy
def test_stored_responses_are_reached_on_the_replica_that_made_them(stable, victim, proxy):
    """A replica keeps the responses it made; their ids name it (the address the proxy
    reached it at), and the proxy sends a retrieval, an input-item listing, a deletion or
    a previous_response_id there, whatever the ring would pick (HTTP and native gRPC).
    Once that replica is gone, the other answers a typed 404 that names it."""
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{proxy.http_port}/v1", api_key="-", max_retries=0, timeout=30
    )
    short = {"model": "tgi", "max_output_tokens": 2, "temperature": 0}
    replicas = {f"127.0.0.1:{r.port}": r for r in (stable, victim)}
    made = {}
    for i in range(40):  # cache keys spread over the ring: until each replica made one
        out = client.responses.create(
            input=f"Question {i}", extra_body={"prompt_cache_key": f"key-{i}"}, **short
        )
        made.setdefault(replica_of(out.id), out)
        if set(made) == set(replicas):
            break
    assert set(made) == set(replicas), set(made)
    for address, out in made.items():
        other = next(r for a, r in replicas.items() if a != address)
        with pytest.raises(grpc.RpcError) as elsewhere:  # kept by its replica only
            other.stub.GetResponse(svc_pb.GetResponseRequest(response_id=out.id), timeout=10)
        assert elsewhere.value.code() == grpc.StatusCode.NOT_FOUND
        for _ in range(4):  # the ring alone would send about half of these to the other
            assert client.responses.retrieve(out.id).id == out.id
        with grpc.insecure_channel(f"127.0.0.1:{proxy.http_port}") as channel:
            body = svc_grpc.TextGenerationServiceStub(channel).GetResponse(
                svc_pb.GetResponseRequest(response_id=out.id), timeout=10
            )
        assert json.loads(body.data)["id"] == out.id
        after = client.responses.create(previous_response_id=out.id, input="More?", **short)
        assert replica_of(after.id) == address  # continued where the conversation is kept
        texts = [i.content[0].text for i in client.responses.input_items.list(after.id)]
        assert texts[-1] == out.output_text or texts[-1].startswith("Question")
        assert client.responses.delete(after.id) is None
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(after.id)
    # the victim leaves, and its responses with it: the answer says where they were
    gone = made[f"127.0.0.1:{victim.port}"]
    victim.stop()
    assert wait_until(lambda: proxy.health_flags(victim.port) != "healthy", 20)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(gone.id)
    assert f"stored by replica 127.0.0.1:{victim.port}" in info.value.body["message"]
