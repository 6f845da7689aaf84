"""/v1/chat/completions: OpenAI JSON -> a templated GenerateRequest, and engine
events -> OpenAI's `chat.completion` / `chat.completion.chunk` bytes."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from ..engine.types import FinishInfo, TokenEvent
from ..intake.request import GenerateParameters, GenerateRequest
from .common import (
    OpenAIRequestError,
    StopHoldback,
    finish_reason,
    json_bytes,
    sampling_parameters,
    sse_bytes,
    trim_stop,
    usage,
)
from .formats import lark_answer, response_format
from .parse import parse_body
from .protocol import MAX_TOP_LOGPROBS, ChatCompletionBody, ChatContent, ChatMessage
from .tools import (
    ToolCallParser,
    ToolPlan,
    chat_tool_plan,
    parse_output,
    prepare_messages,
    template_knows_tools,
)


@dataclass(frozen=True)
class ChatRequest:
    # the templated prompt and TGI parameters (response_format as the grammar; with
    # tools, their Lark grammar)
    generate: GenerateRequest
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    stop: tuple[str, ...]
    tools: ToolPlan | None = None  # tools the model may call


def parse_chat_request(body: bytes, tokenizer) -> ChatRequest:
    request = parse_body(ChatCompletionBody, body)
    plan = chat_tool_plan(request.tools, request.tool_choice, request.parallel_tool_calls)
    answer_format = response_format(request.response_format)
    prompt = render_prompt(tokenizer, chat_messages(request.messages), plan, request.tool_prompt)
    params = sampling_parameters(request)
    if request.max_completion_tokens is not None:
        params["max_new_tokens"] = request.max_completion_tokens
    if plan is None:
        params["grammar"] = answer_format
    top_logprobs = request.top_logprobs or 0
    if top_logprobs:
        params["top_n_tokens"] = top_logprobs
    generate = GenerateRequest(
        inputs=prompt,
        parameters=GenerateParameters(**params),
        lark=plan.lark(lark_answer(answer_format, "response_format")) if plan is not None else None,
        names=_names(request, plan),
        max_top_n_tokens=MAX_TOP_LOGPROBS,
    )
    return ChatRequest(
        generate=generate,
        stream=bool(request.stream),
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        logprobs=bool(request.logprobs),
        top_logprobs=top_logprobs,
        stop=params["stop"],
        tools=plan,
    )


def render_prompt(
    tokenizer,
    messages: list[dict],
    plan: ToolPlan | None,
    tool_prompt: str | None = None,
    param: str = "messages",
    **template_options,
) -> str:
    """The conversation (chat messages, checked) through the model's chat template, with
    the tools natively or described in the system message; `param` is blamed when the
    template refuses it. `template_options` (vLLM's /tokenize: add_generation_prompt,
    continue_final_message) go to the template; by default the answer's turn is opened."""
    native = template_knows_tools(tokenizer)
    extra = {"tools": [t.openai_dict() for t in plan.tools]} if native and plan is not None else {}
    options = {"add_generation_prompt": True, **template_options}
    try:
        return tokenizer.apply_chat_template(
            prepare_messages(messages, plan, native, tool_prompt),
            tokenize=False,
            **options,
            **extra,
        )
    except Exception as exc:
        raise OpenAIRequestError(f"cannot apply the chat template: {exc}", param) from exc


def _names(request: ChatCompletionBody, plan: ToolPlan | None) -> dict[str, str]:
    """TGI's fields as this chat request calls them (request.GenerateRequest.names)."""
    return {
        "inputs": "messages",
        "max_new_tokens": (
            "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        ),
        "top_n_tokens": "top_logprobs",
        "grammar": "tools" if plan is not None else "response_format",
    }


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """`messages` as the chat template takes them."""
    return [_message(m) for m in messages]


def _message(m: ChatMessage) -> dict:
    out = {"role": "system" if m.role == "developer" else m.role, "content": _text(m.content)}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.role == "assistant" and m.tool_calls:
        out["tool_calls"] = [call.model_dump(exclude_none=True) for call in m.tool_calls]
    return out


def _text(content: ChatContent | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


# responses ------------------------------------------------------------------------


def logprob_entry(event: TokenEvent) -> dict:
    token = event.token
    return {
        "token": token.text,
        "logprob": token.logprob,
        "bytes": list(token.text.encode()),
        "top_logprobs": [
            {"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())}
            for t in event.top_tokens
        ],
    }


@dataclass
class ChatRenderer:
    """Renders one request's answer; ids and timestamps are fixed at creation."""

    model: str
    fingerprint: str
    request: ChatRequest
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def completion(self, runs: list[list[TokenEvent]]) -> bytes:
        """The answer: each choice's events, in choice order."""
        body = self._envelope("chat.completion", [self._choice(i, e) for i, e in enumerate(runs)])
        body["usage"] = usage([events[-1].finish for events in runs])
        return json_bytes(body)

    def _choice(self, index: int, events: list[TokenEvent]) -> dict:
        finish = events[-1].finish
        text = trim_stop(finish.generated_text, self.request.stop)
        message = {"role": "assistant", "content": text}
        reason = finish_reason(finish)
        parsed = parse_output(self.request.tools, text) if self.request.tools else None
        if parsed is not None and parsed.is_calls and parsed.calls:
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [_call_dict(c) for c in parsed.calls],
            }
            reason = tool_finish_reason(reason, parsed)
        return {
            "index": index,
            "message": message,
            "logprobs": self._logprobs(events),
            "finish_reason": reason,
        }

    def first_chunk(self, index: int) -> bytes:
        return self._chunk(index, {"role": "assistant", "content": ""}, None, None)

    def delta_chunk(self, index: int, delta: dict) -> bytes:
        return self._chunk(index, delta, None, None)

    def content_chunk(self, index: int, text: str, event: TokenEvent | None) -> bytes:
        return self.content_chunk_of(index, text, [event] if event is not None else [])

    def content_chunk_of(self, index: int, text: str, events: list[TokenEvent]) -> bytes:
        """Content with the logprobs of the tokens that produced it (may be several)."""
        logprobs = self._logprobs(events) if events else None
        return self._chunk(index, {"content": text}, None, logprobs)

    def final_chunk(self, index: int, finish: FinishInfo, reason: str | None = None) -> bytes:
        return self._chunk(index, {}, reason or finish_reason(finish), None)

    def usage_chunk(self, finishes: list[FinishInfo]) -> bytes:
        """The totals over the choices' finishes (stream_options.include_usage)."""
        body = self._envelope("chat.completion.chunk", [])
        body["usage"] = usage(finishes)
        return sse_bytes(body)

    def _chunk(self, index: int, delta: dict, reason: str | None, logprobs) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        body = self._envelope("chat.completion.chunk", [choice])
        if self.request.include_usage:
            body["usage"] = None
        return sse_bytes(body)

    def _envelope(self, obj: str, choices: list) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }

    def _logprobs(self, events: list[TokenEvent]):
        if not self.request.logprobs:
            return None
        return {"content": [logprob_entry(e) for e in events if not e.token.special]}


def tool_finish_reason(reason: str, parsed: ToolCallParser) -> str:
    """An answer whose calls are all complete ends with "tool_calls"; one cut short (by
    max_tokens or a stop sequence inside the arguments) keeps its own reason."""
    return "tool_calls" if parsed.calls[-1].complete else reason


def _call_dict(call) -> dict:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


@dataclass
class ChatStream:
    """One choice's engine events -> chat.completion.chunk bytes: stop sequences held
    back, and with tools, text told apart from calls before the first chunk says which it
    is. The stream's end (usage, `[DONE]`) is the caller's, once every choice is done."""

    renderer: ChatRenderer
    index: int = 0  # the choice
    holdback: StopHoldback = field(init=False)
    parser: ToolCallParser | None = field(init=False)
    started: bool = False
    held_events: list[TokenEvent] = field(default_factory=list)  # logprobs not yet sent

    def __post_init__(self) -> None:
        self.holdback = StopHoldback(self.renderer.request.stop)
        tools = self.renderer.request.tools
        self.parser = ToolCallParser(tools) if tools is not None else None

    def chunks(self, event: TokenEvent) -> list[bytes]:
        request = self.renderer.request
        final = event.finish is not None
        text = self.holdback.feed(event.text, final)
        out = []
        if self.parser is None:
            if not self.started:
                out.append(self.renderer.first_chunk(self.index))
                self.started = True
            if text or (request.logprobs and not event.token.special):
                logprobs_of = event if request.logprobs else None
                out.append(self.renderer.content_chunk(self.index, text, logprobs_of))
        else:
            out.extend(self._tool_aware(text, final, event))
        if final:
            reason = finish_reason(event.finish)
            if self.parser is not None and self.parser.is_calls and self.parser.calls:
                reason = tool_finish_reason(reason, self.parser)
            out.append(self.renderer.final_chunk(self.index, event.finish, reason))
        return out

    def _tool_aware(self, text: str, final: bool, event: TokenEvent) -> list[bytes]:
        if self.renderer.request.logprobs and not event.token.special:
            self.held_events.append(event)  # until the text they made is sent
        deltas = self.parser.feed(text)
        if final and not deltas and not self.started:
            deltas = self.parser.flush()
        out = []
        for delta in deltas:
            if not self.started:
                self.started = True
                if "tool_calls" in delta:  # OpenAI's first chunk of a call carries its head
                    head = {"role": "assistant", "content": None, **delta}
                    out.append(self.renderer.delta_chunk(self.index, head))
                    continue
                out.append(self.renderer.first_chunk(self.index))
            if "content" in delta:
                out.append(
                    self.renderer.content_chunk_of(self.index, delta["content"], self.held_events)
                )
                self.held_events = []
            else:
                out.append(self.renderer.delta_chunk(self.index, delta))
        if final and not self.started:  # an empty answer still opens with the role
            self.started = True
            out.append(self.renderer.first_chunk(self.index))
        return out
