"""/v1/responses (OpenAI's Responses API): its JSON -> a templated GenerateRequest.

`input` is a string or a list of items: messages (text parts, and a vision-language
model's `input_image` parts in user messages), `function_call` and
`function_call_output`; they become chat messages and go through the same chat template,
tool grammar (tools.py) and output formats (formats.py) as chat does.
`previous_response_id` continues a conversation kept in this replica's ResponseStore
(response_store.py), which also keeps the input items (with ids, as OpenAI lists them)
and the response object; a kept conversation keeps its images' URLs (a data: URI as
sent; an http(s) URL is fetched again). What it cannot honour (files, audio, built-in tools,
reasoning summaries, background runs, ...) is refused by name, never ignored. A
reasoning model's thinking (reasoning.py) is a `reasoning` output item before the
message; reasoning items given back as input are left out of the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import TypeAdapter

from ..intake.images import ImageSource
from ..intake.request import GenerateParameters, GenerateRequest
from .chat import output_grammar, render_prompt
from .common import OpenAIRequestError, common_parameters
from .formats import text_format
from .parse import parse_body, parse_field
from .protocol import MAX_TOP_LOGPROBS
from .reasoning import start_state
from .response_store import ResponseStore, StoredResponse, new_id
from .responses_protocol import (
    LOGPROBS_INCLUDE,
    ResponseContent,
    ResponseInput,
    ResponseInputFunctionCall,
    ResponseInputFunctionCallOutput,
    ResponseInputImage,
    ResponseInputItem,
    ResponseInputMessage,
    ResponseInputReasoning,
    ResponseNamedToolChoice,
    ResponsesBody,
)
from .tools import Tool, ToolPlan, no_tools, plan_tool, tool_plan

# items decoded from JSON (a stored response's output): their checks are the body's
_ITEMS = TypeAdapter(list[ResponseInputItem])
_INPUT = TypeAdapter(ResponseInput)


@dataclass(frozen=True)
class ResponsesRequest:
    # the templated prompt and TGI parameters (text.format as the grammar; with tools,
    # their Lark grammar)
    generate: GenerateRequest
    stream: bool
    store: bool  # keep the conversation for a later previous_response_id
    conversation: tuple[dict, ...]  # chat messages: the previous one's, then `input`
    items: tuple[dict, ...]  # the same as OpenAI's input items, with ids
    tools: ToolPlan | None  # tools the model may call
    logprobs: bool  # include: ["message.output_text.logprobs"]
    echo: dict  # the request's settings as the response object reports them
    # the conversation's images, to read into `generate` (intake/images.read_images)
    image_sources: tuple[ImageSource, ...] = ()
    # where the output starts (reasoning.start_state): None without a reasoning parser
    reasoning: str | None = None

    def conversation_with(self, output: list[dict]) -> list[dict]:
        """The conversation this response ends: what it was given, then its output items."""
        return [*self.conversation, *items_to_messages(output, "output")]

    def stored(self, response: dict) -> StoredResponse:
        """What the store keeps of this request's completed `response` object."""
        return StoredResponse(
            response, self.items, tuple(self.conversation_with(response["output"]))
        )


def parse_responses_request(
    body: bytes, tokenizer, store: ResponseStore, reasoning_parser: str | None = None
) -> ResponsesRequest:
    """`reasoning_parser`: the server's (reasoning.resolve_parser), None: none. The
    images are named, not read (`image_sources`): the store is the event loop's, reading
    may fetch."""
    request = parse_body(ResponsesBody, body)
    previous = _previous(request.previous_response_id, store)
    given = _as_items(request.input)
    conversation = [
        *(previous.conversation if previous else ()),
        *_messages(given),
    ]
    items = [*_previous_items(previous), *_listed(given)]
    if not conversation:
        raise OpenAIRequestError("`input` must not be empty", "input")
    instructions = request.instructions
    messages = [{"role": "system", "content": instructions}] if instructions else []
    tools, plan = _tools(request)
    fmt = request.text.format if request.text is not None else None
    answer_format = text_format(fmt)
    effort = request.reasoning.effort if request.reasoning is not None else None
    extra = {"reasoning_effort": effort} if effort is not None else {}
    prompt = render_prompt(
        tokenizer, _for_template([*messages, *conversation]), plan, param="input", **extra
    )
    grammar, lark, state = output_grammar(
        plan, answer_format, "text", start_state(reasoning_parser, prompt), tokenizer
    )
    params = common_parameters(request)
    params["max_new_tokens"] = request.max_output_tokens
    logprobs = LOGPROBS_INCLUDE in (request.include or ())
    top_logprobs = request.top_logprobs or 0
    params["top_n_tokens"] = top_logprobs or None
    params["grammar"] = grammar
    generate = GenerateRequest(
        inputs=prompt,
        parameters=GenerateParameters(**params),
        lark=lark,
        names={
            "inputs": "input",
            "max_new_tokens": "max_output_tokens",
            "top_n_tokens": "top_logprobs",
            "grammar": "tools" if plan is not None else "text",
        },
        max_top_n_tokens=MAX_TOP_LOGPROBS,
    )
    return ResponsesRequest(
        generate=generate,
        image_sources=tuple(_image_sources(previous, given)),
        stream=bool(request.stream),
        store=_store(request.store, store),
        conversation=tuple(conversation),
        items=tuple(items),
        tools=plan,
        logprobs=logprobs,
        echo=_echo(request, tools, top_logprobs),
        reasoning=state,
    )


def _echo(request: ResponsesBody, tools: tuple[Tool, ...], top_logprobs: int) -> dict:
    """The request's settings as the response object reports them."""
    fmt = request.text.format if request.text is not None else None
    choice = request.tool_choice
    return {
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "metadata": request.metadata or {},
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "reasoning": {
            "effort": request.reasoning.effort if request.reasoning is not None else None,
            "summary": None,
        },
        "temperature": _default(request.temperature, 1.0),
        "text": {
            "format": {"type": "text"}
            if fmt is None
            else fmt.model_dump(by_alias=True, exclude_none=True)
        },
        "tool_choice": choice.model_dump()
        if isinstance(choice, ResponseNamedToolChoice)
        else choice or "auto",
        "tools": [_tool_dict(t, given.strict) for t, given in zip(tools, request.tools or ())],
        "top_logprobs": top_logprobs,
        "top_p": _default(request.top_p, 1.0),
    }


def _default(value, default):
    return default if value is None else value


# the conversation -------------------------------------------------------------------


def _previous(previous: str | None, store: ResponseStore) -> StoredResponse | None:
    """The previous response, from the store."""
    if previous is None:
        return None
    if not store.enabled:
        raise OpenAIRequestError(
            "`previous_response_id`: responses are not kept on this server"
            " (--responses-store-mb 0); send the whole conversation in `input`",
            "previous_response_id",
        )
    stored = store.get(previous)
    if stored is None:
        raise OpenAIRequestError(
            f"`previous_response_id`: response {previous!r} is not kept on this replica: it"
            f" was made with `store: false`, expired (responses are kept {store.ttl:g} s), was"
            " evicted or deleted, or its replica is gone; send the whole conversation in"
            " `input`",
            "previous_response_id",
        )
    return stored


def _previous_items(previous: StoredResponse | None) -> list[dict]:
    """The items the previous response was made from, then its output."""
    if previous is None:
        return []
    return [*previous.items, *previous.response["output"]]


def _as_items(value) -> list:
    """`input` (a string, items, or nothing) as items: a string is a user message."""
    if value is None:
        return []
    if isinstance(value, str):
        return [ResponseInputMessage(role="user", content=value)]
    return value


def items_to_messages(items: list, where: str) -> list[dict]:
    """Responses items as decoded JSON (a stored response's output; `where` names them
    in errors) as chat messages (_messages)."""
    return _messages(parse_field(_ITEMS, items, where), where)


def _messages(items: list, where: str = "input") -> list[dict]:
    """Responses items (messages, function calls, their outputs) as chat messages:
    consecutive calls join one assistant message, as chat writes parallel calls. `where`
    names the items in errors."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        if isinstance(item, ResponseInputFunctionCall):
            call = _function_call(item)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last["tool_calls"] = [*last.get("tool_calls", []), call]
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, ResponseInputReasoning):
            continue  # earlier thinking: the templates leave it out
        elif isinstance(item, ResponseInputFunctionCallOutput):
            output = _text(item.output, f"{where}[{i}].output")
            messages.append({"role": "tool", "content": output, "tool_call_id": item.call_id})
        else:
            role = "system" if item.role == "developer" else item.role
            content = _content(item.content, f"{where}[{i}].content", item.role)
            messages.append({"role": role, "content": content})
    return messages


def _content(content: ResponseContent, name: str, role: str) -> str | list[dict]:
    """A message's content: its text, or, with images (user messages only), the parts
    as chat's template takes them, each image's URL kept (the store keeps it for a
    continuation; _for_template leaves it out)."""
    if isinstance(content, str) or not any(_is_image(part) for part in content):
        return _text(content, name)
    parts = []
    for j, part in enumerate(content):
        if not _is_image(part):
            parts.append({"type": "text", "text": _text([part], name)})
            continue
        if role != "user":
            raise OpenAIRequestError(f"`{name}[{j}]`: images go in user messages only", name)
        if part.image_url is None:
            param = f"{name}[{j}].file_id" if part.file_id is not None else f"{name}[{j}]"
            raise OpenAIRequestError(
                f"`{param}`: files are not served; send the image in `image_url` (a data: URI"
                " or an http(s) URL)",
                param,
            )
        parts.append({"type": "image", "image_url": part.image_url})
    return parts


def _is_image(part) -> bool:
    return isinstance(part, ResponseInputImage)


def _text(content: ResponseContent, name: str) -> str:
    """Text parts (and an earlier answer's refusal) as one text; no images here."""
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if _is_image(part):
            raise OpenAIRequestError(f"`{name}[{j}]`: an image is not served here", name)
    return "".join(part.refusal if part.type == "refusal" else part.text for part in content)


def _for_template(messages: list[dict]) -> list[dict]:
    """The messages as the chat template takes them: an image part is {"type": "image"}
    (its URL is no business of the template's)."""
    return [
        {**m, "content": [{"type": "image"} if p["type"] == "image" else p for p in m["content"]]}
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]


def _image_sources(previous: StoredResponse | None, given: list) -> list[ImageSource]:
    """The conversation's images in prompt order: the previous response's (kept with its
    conversation), then `input`'s, each named as the client sent it."""
    sources = [
        ImageSource(part["image_url"], f"previous_response_id (image {k})", "previous_response_id")
        for k, part in enumerate(
            (
                part
                for m in (previous.conversation if previous else ())
                if isinstance(m["content"], list)
                for part in m["content"]
                if part["type"] == "image"
            ),
            1,
        )
    ]
    for i, item in enumerate(given):
        if isinstance(item, ResponseInputMessage) and not isinstance(item.content, str):
            name = f"input[{i}].content"
            sources += [
                ImageSource(part.image_url, f"{name}[{j}].image_url")
                for j, part in enumerate(item.content)
                if _is_image(part)
            ]
    return sources


def _function_call(item: ResponseInputFunctionCall) -> dict:
    return {
        "id": item.call_id,
        "type": "function",
        "function": {"name": item.name, "arguments": item.arguments},
    }


def input_items(value) -> list[dict]:
    """`input` as decoded JSON (a string or items) as OpenAI lists a response's input
    items (_listed)."""
    return _listed(_as_items(parse_field(_INPUT, value, "input")))


def _listed(items: list) -> list[dict]:
    """Items as OpenAI lists a response's input items: each with an id (the client's,
    else a new one) and a status; text parts as input_text (output_text for assistant
    messages)."""
    return [_input_item(item) for item in items]


def _input_item(item) -> dict:
    if isinstance(item, ResponseInputReasoning):
        return {**item.model_dump(exclude_none=True), "id": item.id or new_id("rs")}
    if isinstance(item, ResponseInputFunctionCall):
        fields = {"call_id": item.call_id, "name": item.name, "arguments": item.arguments}
        return {"id": item.id or new_id("fc"), "type": item.type, **fields, "status": "completed"}
    if isinstance(item, ResponseInputFunctionCallOutput):
        return {
            "id": item.id or new_id("fco"),
            "type": item.type,
            "call_id": item.call_id,
            "output": _text(item.output, "output"),
            "status": "completed",
        }
    return {
        "id": item.id or new_id("msg"),
        "type": "message",
        "role": item.role,
        "content": _item_parts(item.content, item.role),
        "status": "completed",
    }


def _item_parts(content: ResponseContent, role: str) -> list[dict]:
    if isinstance(content, str):
        return [_text_part(content, role)]
    return [_item_part(part, role) for part in content]


def _item_part(part, role: str) -> dict:
    if _is_image(part):
        fields = {"image_url": part.image_url, "file_id": part.file_id}
        return {"type": "input_image", "detail": part.detail or "auto", **fields}
    if part.type == "refusal":
        return {"type": "refusal", "refusal": part.refusal}
    return _text_part(part.text, role)


def _text_part(text: str, role: str) -> dict:
    if role == "assistant":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "input_text", "text": text}


# tools and the rest -------------------------------------------------------------------


def _tools(request: ResponsesBody) -> tuple[tuple[Tool, ...], ToolPlan | None]:
    """Function tools (protocol.ResponseFunctionTool) as the plan holds them, and the
    plan. No tools: OpenAI's SDK and agent frameworks send [] for none."""
    if not request.tools:
        no_tools(request.tool_choice)
        return (), None
    tools = tuple(plan_tool(t) for t in request.tools)
    choice, parallel = request.tool_choice, request.parallel_tool_calls
    if isinstance(choice, ResponseNamedToolChoice):
        return tools, tool_plan(tools, "function", parallel, function=choice.name)
    return tools, tool_plan(tools, choice or "auto", parallel)


def _tool_dict(tool: Tool, strict: bool | None) -> dict:
    """A function tool as the response object reports it. Its arguments always follow
    its schema (the tool grammar): strict unless the request said otherwise."""
    return {
        "type": "function",
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters,
        "strict": True if strict is None else strict,
    }


def _store(asked: bool | None, store: ResponseStore) -> bool:
    """OpenAI keeps responses unless `store: false`; a server that keeps none says so in
    the response object, and refuses an explicit `store: true`."""
    if asked and not store.enabled:
        raise OpenAIRequestError(
            "`store`: responses are not kept on this server (--responses-store-mb 0)", "store"
        )
    return store.enabled if asked is None else asked
