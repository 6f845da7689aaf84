"""The engine thread and its bridge to asyncio.

The core runs on a thread of its own and never waits on the event loop. Requests
and aborts reach it through a thread-safe inbox; after each step it detokenizes,
matches stop strings, and hands every stream's new events to the event loop in one
`call_soon_threadsafe` (one wake-up per step, not per token).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from ..errors import ErrorType
from .detokenizer import IncrementalDetokenizer, decode_output
from .paged_core import PagedCore, StepOutput
from .sequence import Sequence
from .stopping import StopSequenceMatcher
from .types import (
    EngineError,
    EngineRequest,
    EngineStats,
    FinishInfo,
    FinishReason,
    PrefillInfo,
    TokenEvent,
    TokenInfo,
)

log = logging.getLogger("textgen.engine")

_END = object()  # closes a stream's queue

# The longest an idle engine holds the request that woke it while others keep arriving
# (`arrival_gap`): bounds the wait when requests trickle in just under the gap.
MAX_ARRIVAL_WAIT = 0.02  # seconds


@dataclass(eq=False)
class _Group:
    """The asyncio queue one request's choices feed, and how many are still open (on
    the engine thread: the queue ends when the last one finishes)."""

    queue: asyncio.Queue
    event_loop: asyncio.AbstractEventLoop
    open: int


@dataclass(eq=False)
class _Stream:
    """Engine-thread state of one sequence (one choice of a request)."""

    seq: Sequence
    group: _Group
    detokenizer: IncrementalDetokenizer
    stops: StopSequenceMatcher
    events: list = field(default_factory=list)  # produced this step, not yet delivered
    texts: list[str] = field(default_factory=list)  # TokenEvent.text sent so far
    last_token_at: float | None = None  # monotonic, for inter-token latency


class EngineLoop:
    def __init__(
        self,
        core: PagedCore,
        tokenizer,
        eos_token_ids: frozenset[int],
        metrics=None,
        torch_threads: int | None = None,
        arrival_gap: float = 0.0,
        cpus: tuple[int, ...] | None = None,
    ) -> None:
        """torch_threads: torch's intra-op threads on the engine's thread (None: torch's
        default); OpenMP keeps the count per thread, so it is set on that thread.

        cpus: the cores the engine's thread (and the OpenMP team it starts) may run on, set
        on that thread (None: the process's affinity): a shard's own cores
        (replica/shard_processes.py).

        arrival_gap: seconds. An idle engine woken by a request takes its first step once
        no other request has arrived for this long (at most MAX_ARRIVAL_WAIT after the
        first): a client's burst reaches the engine over several ms, at the pace the event
        loop validates it, and then starts in one prefill step instead of one step for the
        first request and more for the rest. 0: step at once."""
        self.core = core
        self.torch_threads = torch_threads
        self.cpus = cpus
        self.arrival_gap = arrival_gap
        self.metrics = metrics  # observability.metrics.Metrics, or None
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._special_ids = special_ids(tokenizer)
        self._inbox: deque[tuple[str, object]] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="textgen-engine", daemon=True)
        self.last_error: BaseException | None = None  # what killed the loop, if anything
        self._fault: BaseException | None = None  # test hook: raised by the next step
        self._warm = threading.Event()  # set once the core is warm (or failed to be)

    # lifecycle -----------------------------------------------------------------

    def start(self, timeout: float | None = None) -> None:
        """Start the engine thread and return once the core is warm on it (raises what
        warming up raised, e.g. out of memory for the KV pool).

        NOTE: all of torch's work happens on this one thread, warm-up included. libgomp
        gives every thread that runs a parallel region a team of its own; with more
        teams' threads than cores it throttles its spin-waits (GOMP_SPINCOUNT 300000 ->
        100), and each of the ~500 parallel regions of a decode step then pays a futex
        wake-up: measured here, one decode step of the embedded model took 30 ms on a
        second thread against 19 ms when one thread did all the work."""
        self._thread.start()
        if not self._warm.wait(timeout):
            raise TimeoutError("the engine did not warm up in time")
        if self.last_error is not None:
            raise self.last_error

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        close = getattr(self.core, "close", None)
        if close is not None:  # a sharded core releases its other ranks
            close()

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self.last_error is None

    def inject_fault(self, error: BaseException | None = None) -> None:
        """Test hook: make the next engine step raise `error`."""
        self._fault = error or RuntimeError("injected engine fault")
        self._wake.set()

    def stats(self) -> EngineStats:
        return self.core.stats()

    # asyncio side ---------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenEvent]:
        """Stream the request's tokens; with n > 1 choices, those of every choice as they
        come (TokenEvent.choice tells them apart), until all have finished. Leaving the
        iteration early (the client went away, the task was cancelled) aborts the
        sequences and frees their blocks."""
        if not self.healthy:
            raise EngineError("the engine is not running", ErrorType.UNAVAILABLE)
        choices = request.choices()
        group = _Group(asyncio.Queue(), asyncio.get_running_loop(), open=len(choices))
        streams = [self._stream(r, i, group) for i, r in enumerate(choices)]
        streams[0].seq.forks = [s.seq for s in streams[1:]]
        self._post("add", streams)
        finished = False
        try:
            while True:
                item = await group.queue.get()
                if item is _END:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                for event in item:
                    yield event
        finally:
            if not finished:
                self._post("abort", [r.request_id for r in choices])

    def _stream(self, request: EngineRequest, choice: int, group: _Group) -> _Stream:
        seq = Sequence(request, self.eos_token_ids, choice=choice)
        return _Stream(
            seq=seq,
            group=group,
            detokenizer=IncrementalDetokenizer.for_prompt(self.tokenizer, seq.num_prompt_tokens),
            stops=StopSequenceMatcher(request.stopping.stop_sequences),
        )

    def _post(self, kind: str, payload: object) -> None:
        self._inbox.append((kind, payload))
        self._wake.set()

    # engine thread --------------------------------------------------------------

    def _run(self) -> None:
        """Warms the core up, then steps until shutdown, or until a step fails for good:
        then every request in flight ends with a typed error, health turns unhealthy and
        nothing waits."""
        try:
            if self.cpus:
                os.sched_setaffinity(0, self.cpus)  # this thread only (Linux)
            if self.torch_threads:
                torch.set_num_threads(self.torch_threads)
            self.core.warm_up()
        except Exception as exc:  # noqa: BLE001 - start() raises it in the caller
            self.last_error = exc
            return
        finally:
            self._warm.set()
        try:
            while not self._stopping:
                self._drain_inbox()
                if not self.core.has_work():
                    self._wake.wait()
                    self._wake.clear()
                    self._await_arrivals()
                    continue
                started = time.perf_counter()
                outputs = self._step()
                if self.metrics is not None and outputs:
                    self._observe_step(outputs, time.perf_counter() - started)
                self._process(outputs)
                # not kept while the engine idles: the last step's finished sequences
                # (their token ids, grammar matchers) would live until the next request
                del outputs
        except Exception as exc:
            log.exception("engine step failed; the engine stops")
            self.last_error = exc
            self._fail_all(step_error(exc))
            return
        self._fail_all(EngineError("the engine is shutting down", ErrorType.UNAVAILABLE))

    def _await_arrivals(self) -> None:
        """Woken from idle by a request: wait while more keep arriving, until none has
        for `arrival_gap` or MAX_ARRIVAL_WAIT has passed (see __init__)."""
        if not self.arrival_gap or not self._inbox:
            return
        deadline = time.monotonic() + MAX_ARRIVAL_WAIT
        while not self._stopping:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._wake.wait(min(self.arrival_gap, remaining)):
                return
            self._wake.clear()

    def _step(self) -> list[StepOutput]:
        """One core step; out of device memory, the core sheds half its batch (the shed
        sequences are recomputed later) and the step is retried before anyone fails."""
        while True:
            if self._fault is not None:
                fault, self._fault = self._fault, None
                raise fault
            try:
                return self.core.step()
            except torch.OutOfMemoryError:
                shrink = getattr(self.core, "shrink_after_oom", None)
                if shrink is None or not shrink():
                    raise
                log.warning("out of memory: batch shrunk, step retried")

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "add":  # a request's choices; the first carries the others as forks
                streams = payload
                try:
                    self.core.add(streams[0].seq)
                except EngineError as exc:  # e.g. it can never fit in the KV pool
                    _send(streams[0].group, exc)
                    continue
                for stream in streams:
                    self._streams[stream.seq.request_id] = stream
            else:
                for request_id in payload:
                    stream = self._streams.pop(request_id, None)
                    if stream is not None:
                        self.core.abort(stream.seq)

    def _process(self, outputs: list[StepOutput]) -> None:
        """One event per token, in order: a speculative step may give a sequence several
        (a stop sequence met in one of them ends the stream there)."""
        touched = []
        for out in outputs:
            stream = self._streams.get(out.seq.request_id)
            if stream is None:  # finished by an earlier token of this step, or aborted
                continue
            stream.events.append(self._token_event(stream, out))
            if not touched or touched[-1] is not stream:
                touched.append(stream)
            if out.seq.is_finished and out.is_last:
                self._streams.pop(out.seq.request_id, None)
        self._deliver(touched)

    def _observe_step(self, outputs: list[StepOutput], seconds: float) -> None:
        # a step that finished some prompt is a prefill step (TGI's `method` label)
        prefill = any(o.num_tokens == o.seq.num_prompt_tokens + 1 for o in outputs)
        self.metrics.batch_forward_duration.labels("prefill" if prefill else "decode").observe(
            seconds
        )
        if hasattr(self.core, "take_encode_seconds"):  # those of steps without outputs too
            for encoded in self.core.take_encode_seconds():
                self.metrics.image_encode_duration.observe(encoded)
        if getattr(self.core, "speculation", None) is None:
            self.metrics.batch_size.observe(len(outputs))
            return
        # tokens per sequence this step: more than one when speculation kept proposals
        runs: dict[int, int] = {}
        for o in outputs:
            runs[id(o.seq)] = runs.get(id(o.seq), 0) + 1
        self.metrics.batch_size.observe(len(runs))
        for run in runs.values():  # TGI's tgi_request_skipped_tokens: tokens - 1
            self.metrics.skipped_tokens.observe(run - 1)

    def _observe_token(self, stream: _Stream) -> None:
        now = time.monotonic()
        if stream.last_token_at is None:
            self.metrics.time_to_first_token.observe(now - stream.seq.request.arrival_time)
        else:
            self.metrics.inter_token_latency.observe(now - stream.last_token_at)
        stream.last_token_at = now

    def _token_event(self, stream: _Stream, out: StepOutput) -> TokenEvent:
        seq = out.seq
        if self.metrics is not None:
            self._observe_token(stream)
        special = out.token_id in self._special_ids
        text = stream.detokenizer.step(seq.token_ids, out.num_tokens)
        visible = text.replace(self.tokenizer.decode([out.token_id]), "", 1) if special else text
        # the text-level stop reason (stopping.py); the token-level ones are the core's
        ended = seq.is_finished and out.is_last
        if not ended and stream.stops.feed(visible) is not None:
            # a stop sequence inside a speculative run: the run's later tokens go
            del seq.token_ids[out.num_tokens :]
            seq.finish(FinishReason.STOP_SEQUENCE)
            self.core.abort(seq)
            ended = True
        finish = None
        if ended:
            generated = decode_output(self.tokenizer, seq.token_ids, seq.num_prompt_tokens)
            visible = self._last_text(stream, generated, visible)
            text = text if special else visible
            finish = self._finish_info(seq, generated)
        stream.texts.append(visible)
        return TokenEvent(
            index=out.num_tokens - seq.num_prompt_tokens,
            token=TokenInfo(out.token_id, text, out.logprob, special),
            text=visible,
            top_tokens=tuple(self._token_info(i, lp) for i, lp in out.top_tokens),
            prefill=self._prefill(seq, out.prefill_logprobs),
            finish=finish,
            choice=seq.choice,
        )

    @staticmethod
    def _last_text(stream: _Stream, generated: str, visible: str) -> str:
        """The last token's text, chosen so the stream adds up to generated_text: a
        held partial character is flushed, and invalid byte runs, which the windowed
        decode can split differently, are reconciled."""
        sent = "".join(stream.texts)
        return generated[len(sent) :] if generated.startswith(sent) else visible

    def _token_info(self, token_id: int, logprob: float) -> TokenInfo:
        text = self.tokenizer.decode([token_id])
        return TokenInfo(token_id, text, logprob, token_id in self._special_ids)

    def _prefill(
        self, seq: Sequence, logprobs: list[float | None] | None
    ) -> tuple[PrefillInfo, ...]:
        if not logprobs:
            return ()
        ids = seq.token_ids[: seq.num_prompt_tokens]
        texts = self.tokenizer.batch_decode([[i] for i in ids])
        return tuple(PrefillInfo(i, t, lp) for i, t, lp in zip(ids, texts, logprobs))

    def _finish_info(self, seq: Sequence, generated_text: str) -> FinishInfo:
        now = time.monotonic()
        started = seq.first_scheduled_time or now
        return FinishInfo(
            reason=seq.finish_reason or FinishReason.LENGTH,
            generated_text=generated_text,
            generated_tokens=seq.num_output_tokens,
            input_length=seq.num_prompt_tokens,
            seed=seq.request.sampling.seed,
            queue_time=max(0.0, started - seq.request.arrival_time),
            inference_time=now - started,
            prefill_time=(seq.first_token_time or now) - started,
            cached_tokens=seq.num_cached_prompt_tokens,
        )

    def _deliver(self, streams: list[_Stream]) -> None:
        """Hand this step's events to the event loop(s): one callback per loop.

        NOTE: it does not wait for the streams to send them. Waiting (so that the event
        loop's GIL-holding work never runs beside the next forward) was measured at 32
        streams, until the streams were woken and until they had sent: no difference
        beyond this machine's noise (served / core 0.79-0.85 either way), and a slow
        client could then delay every stream's next token."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, list, bool]]] = {}
        for s in streams:
            if s.events:
                group = s.group
                if s.seq.is_finished:
                    group.open -= 1
                by_loop.setdefault(group.event_loop, []).append(
                    (group.queue, s.events, group.open == 0)
                )
                s.events = []
        for event_loop, batch in by_loop.items():
            try:
                event_loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _fail_all(self, error: EngineError) -> None:
        """End every request the engine holds or has yet to pick up with `error`."""
        streams = list(self._streams.values())
        self._streams.clear()
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "add":
                streams.extend(payload)
        groups = {}
        for s in streams:
            with contextlib.suppress(Exception):
                self.core.abort(s.seq)
            groups[id(s.group)] = s.group
        for group in groups.values():
            _send(group, error)


def special_ids(tokenizer) -> frozenset[int]:
    """The tokens TGI's `special` flag marks and generated_text leaves out: the named
    special tokens and every added token the tokenizer flags special (gpt-oss's harmony
    markers, `<|channel|>` ..., are only the latter, as decode(skip_special_tokens=True)
    counts them)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    flagged = {i for i, token in added.items() if getattr(token, "special", False)}
    return frozenset(tokenizer.all_special_ids) | flagged


def step_error(exc: Exception) -> EngineError:
    """What every request in flight is told when a step fails for good: the step's own
    typed error where it raised one (a shard gone: runners/sharded.py's ShardLost, an
    incomplete generation naming the rank), else `generation failed` with the cause."""
    if isinstance(exc, EngineError):
        return exc
    return EngineError(f"generation failed: {exc}", ErrorType.GENERATION)


def _send(group: _Group, item) -> None:
    try:
        group.event_loop.call_soon_threadsafe(group.queue.put_nowait, item)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


def _put_all(batch: list[tuple[asyncio.Queue, list, bool]]) -> None:
    for queue, events, finished in batch:
        queue.put_nowait(events)
        if finished:
            queue.put_nowait(_END)
