"""/v1/chat/completions: OpenAI JSON -> a templated GenerateRequest, and engine
events -> OpenAI's `chat.completion` / `chat.completion.chunk` bytes."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from ..engine.types import FinishInfo, TokenEvent
from ..intake.images import ImageLimits, ImagePart, read_images
from ..intake.request import GenerateParameters, GenerateRequest, Grammar
from ..intake.validation import grammar_spec
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
from .protocol import (
    MAX_TOP_LOGPROBS,
    ChatCompletionBody,
    ChatContent,
    ChatImagePart,
    ChatMessage,
)
from .reasoning import (
    CONTENT,
    HARMONY,
    HarmonyParser,
    ReasoningParser,
    event_piece,
    parser_for,
    read_output,
    start_state,
    tag_tokens,
    thinks,
    with_thought,
)
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
    # where the output starts (reasoning.start_state): None without a reasoning parser
    reasoning: str | None = None


def template_kwargs(request: ChatCompletionBody) -> dict:
    """chat_template_kwargs and reasoning_effort, as the chat template's extra kwargs."""
    kwargs = dict(request.chat_template_kwargs or {})
    if request.reasoning_effort is not None:
        kwargs["reasoning_effort"] = request.reasoning_effort
    return kwargs


# an answer of any text, as a grammar's (a thinking budget's grammar holds the thinking only)
FREE_ANSWER = "start: answer\nanswer: TEXT\nTEXT: /(?s:.*)/\n"


def output_grammar(
    plan: ToolPlan | None,
    answer_format: Grammar | None,
    param: str,
    state: str | None,
    tokenizer,
    budget: int | None = None,
) -> tuple[Grammar | None, str | None, str | None]:
    """The output's grammar, as TGI's `grammar` or as a Lark one (tools), and where the
    reasoning parser starts (`state`: reasoning.start_state). A thinking model thinks
    freely first, then the grammar holds the answer (reasoning.with_thought); a regex
    format applies from the first token, so its output is all answer. `budget`: the most
    tokens the thinking may take (the closing tag forced then; Anthropic's
    budget_tokens), which needs the tags as tokens (reasoning.tag_tokens)."""
    if plan is not None:
        lark = plan.lark(lark_answer(answer_format, param))
        if thinks(state):
            lark = with_thought(lark, state, tag_tokens(tokenizer), budget)
        return None, lark, state
    if budget is not None and answer_format is None and thinks(state):
        return None, with_thought(FREE_ANSWER, state, tag_tokens(tokenizer), budget), state
    if answer_format is None or not thinks(state):
        return answer_format, None, state
    if grammar_spec(answer_format)[0] != "json":
        return answer_format, None, CONTENT
    answer = f"start: answer\nanswer: {lark_answer(answer_format, param)}\n"
    return None, with_thought(answer, state, tag_tokens(tokenizer), budget), state


def parse_chat_request(
    body: bytes,
    tokenizer,
    reasoning_parser: str | None = None,
    images: ImageLimits | None = None,
) -> ChatRequest:
    """`reasoning_parser`: the server's (reasoning.resolve_parser), None: none; `images`:
    what the model's images may be (None: it takes none). Blocking where it fetches."""
    request = parse_body(ChatCompletionBody, body)
    plan = chat_tool_plan(request.tools, request.tool_choice, request.parallel_tool_calls)
    answer_format = response_format(request.response_format)
    prompt = render_prompt(
        tokenizer,
        chat_messages(request.messages),
        plan,
        request.tool_prompt,
        **template_kwargs(request),
    )
    grammar, lark, state = output_grammar(
        plan, answer_format, "response_format", start_state(reasoning_parser, prompt), tokenizer
    )
    params = sampling_parameters(request)
    if request.max_completion_tokens is not None:
        params["max_new_tokens"] = request.max_completion_tokens
    params["grammar"] = grammar
    top_logprobs = request.top_logprobs or 0
    if top_logprobs:
        params["top_n_tokens"] = top_logprobs
    generate = GenerateRequest(
        inputs=prompt,
        parameters=GenerateParameters(**params),
        lark=lark,
        names=_names(request, plan),
        max_top_n_tokens=MAX_TOP_LOGPROBS,
        images=chat_images(request.messages, images),
    )
    return ChatRequest(
        generate=generate,
        stream=bool(request.stream),
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        logprobs=bool(request.logprobs),
        top_logprobs=top_logprobs,
        stop=params["stop"],
        tools=plan,
        reasoning=state,
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


def _text(content: ChatContent | None) -> str | list[dict]:
    """A message's content as the template takes it: text, or, with images, the parts
    ({"type": "image"} where each goes: the template writes its placeholder)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not any(isinstance(part, ChatImagePart) for part in content):
        return "".join(part.text for part in content)
    image = {"type": "image"}
    return [
        image if isinstance(part, ChatImagePart) else {"type": "text", "text": part.text}
        for part in content
    ]


def chat_images(messages: list[ChatMessage], limits: ImageLimits | None) -> tuple[ImagePart, ...]:
    """The conversation's images in order, read (URLs fetched: blocking) within `limits`
    (None: the model takes none); each error names its part."""
    sources = []
    for name, (m, part) in image_parts(messages).items():
        if m.role != "user":
            raise OpenAIRequestError(f"`{name}`: images go in user messages only", name)
        sources.append((part.image_url.url, name))
    return read_images(sources, limits)


def image_parts(messages: list[ChatMessage]) -> dict[str, tuple[ChatMessage, ChatImagePart]]:
    """The image parts by their names (messages[i].content[j].image_url), in order."""
    return {
        f"messages[{i}].content[{j}].image_url": (m, part)
        for i, m in enumerate(messages)
        for j, part in enumerate(m.content if isinstance(m.content, list) else ())
        if isinstance(part, ChatImagePart)
    }


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
        body["usage"] = self.usage(
            [events[-1].finish for events in runs],
            sum(reasoning_tokens(self.request.reasoning, events) for events in runs),
        )
        return json_bytes(body)

    def usage(self, finishes: list[FinishInfo], reasoning: int) -> dict:
        """OpenAI's usage; with a reasoning parser, the thinking's tokens among the
        completion's (`completion_tokens_details.reasoning_tokens`)."""
        out = usage(finishes)
        if self.request.reasoning is not None:
            out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return out

    def _choice(self, index: int, events: list[TokenEvent]) -> dict:
        request = self.request
        thinking, text, calls = read_answer(events, request.stop, request.reasoning, request.tools)
        message = {"role": "assistant", "content": text}
        reason = finish_reason(events[-1].finish)
        if calls is not None:
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [_call_dict(c) for c in calls.calls],
            }
            reason = tool_finish_reason(reason, calls)
        if request.reasoning is not None:  # vLLM's names, old and new
            message["reasoning_content"] = message["reasoning"] = thinking or None
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

    def reasoning_chunk(self, index: int, text: str, events: list[TokenEvent]) -> bytes:
        """Thinking, with the logprobs of the tokens that produced it."""
        delta = {"reasoning_content": text, "reasoning": text}
        return self._chunk(index, delta, None, self._logprobs(events) if events else None)

    def content_chunk(self, index: int, text: str, event: TokenEvent | None) -> bytes:
        return self.content_chunk_of(index, text, [event] if event is not None else [])

    def content_chunk_of(self, index: int, text: str, events: list[TokenEvent]) -> bytes:
        """Content with the logprobs of the tokens that produced it (may be several)."""
        logprobs = self._logprobs(events) if events else None
        return self._chunk(index, {"content": text}, None, logprobs)

    def final_chunk(self, index: int, finish: FinishInfo, reason: str | None = None) -> bytes:
        return self._chunk(index, {}, reason or finish_reason(finish), None)

    def usage_chunk(self, finishes: list[FinishInfo], reasoning: int = 0) -> bytes:
        """The totals over the choices' finishes (stream_options.include_usage);
        `reasoning`: the thinking's tokens over the choices."""
        body = self._envelope("chat.completion.chunk", [])
        body["usage"] = self.usage(finishes, reasoning)
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


def read_answer(
    events: list[TokenEvent], stop: tuple[str, ...], reasoning: str | None, tools: ToolPlan | None
) -> tuple[str, str, ToolCallParser | None]:
    """A whole choice's output (its events) -> its thinking ("" if none), its answer's
    text (the stop sequence left out), and its tool calls (None: the answer is text)."""
    text = trim_stop(events[-1].finish.generated_text, stop)
    thinking = ""
    if reasoning is not None:
        _, thinking, text = read_output(reasoning, events, text)
        if reasoning == HARMONY:  # read from the events: untrimmed
            text = trim_stop(text, stop)
    parsed = parse_output(tools, text) if tools else None
    return (
        thinking,
        text,
        parsed if parsed is not None and parsed.is_calls and parsed.calls else None,
    )


def reasoning_tokens(state: str | None, events: list[TokenEvent]) -> int:
    """How many of a choice's tokens were thinking (the closing tag's included)."""
    if state is None or state == CONTENT:
        return 0
    parser = parser_for(state)
    for event in events:
        parser.feed(event_piece(parser, event))
    return parser.tokens


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
    thinking: ReasoningParser | HarmonyParser | None = field(init=False)
    # counts the thinking's tokens
    counter: ReasoningParser | HarmonyParser | None = field(init=False)

    def __post_init__(self) -> None:
        self.holdback = StopHoldback(self.renderer.request.stop)
        tools = self.renderer.request.tools
        self.parser = ToolCallParser(tools) if tools is not None else None
        state = self.renderer.request.reasoning
        self.thinking = parser_for(state) if state is not None else None
        # on the engine's text, as the answer counts them (stop sequences held back aside)
        self.counter = parser_for(state) if state not in (None, CONTENT) else None

    @property
    def reasoning_tokens(self) -> int:
        return self.counter.tokens if self.counter is not None else 0

    def chunks(self, event: TokenEvent) -> list[bytes]:
        request = self.renderer.request
        final = event.finish is not None
        piece = event_piece(self.thinking, event) if self.thinking is not None else event.text
        text = self.holdback.feed(piece, final)
        out = []
        if self.counter is not None:
            self.counter.feed(event_piece(self.counter, event))
        if request.logprobs and not event.token.special:
            self.held_events.append(event)  # until the text they made is sent
        if self.thinking is not None:
            thinking = self.thinking.state != CONTENT
            reasoning, text = self.thinking.feed(text, final)
            if reasoning:  # the thinking's tokens carry their logprobs on its chunks
                if not self.started:
                    out.append(self.renderer.first_chunk(self.index))
                    self.started = True
                out.append(self.renderer.reasoning_chunk(self.index, reasoning, self.held_events))
                self.held_events = []
            if thinking and self.thinking.state != CONTENT and not final:
                return out  # still thinking
        if self.parser is None:
            if not self.started:
                out.append(self.renderer.first_chunk(self.index))
                self.started = True
            if text or self.held_events:
                out.append(self.renderer.content_chunk_of(self.index, text, self.held_events))
                self.held_events = []
        else:
            out.extend(self._tool_aware(text, final))
        if final:
            reason = finish_reason(event.finish)
            if self.parser is not None and self.parser.is_calls and self.parser.calls:
                reason = tool_finish_reason(reason, self.parser)
            out.append(self.renderer.final_chunk(self.index, event.finish, reason))
        return out

    def _tool_aware(self, text: str, final: bool) -> list[bytes]:
        deltas = self.parser.feed(text)
        if final and not deltas:  # held as a possible call's start: content after all
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
