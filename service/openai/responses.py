"""/v1/responses (OpenAI's Responses API): its JSON -> a templated GenerateRequest.

`input` is a string or a list of items: messages (text parts only), `function_call`
and `function_call_output`; they become chat messages and go through the same chat
template, tool grammar (tools.py) and output formats (formats.py) as chat does.
`previous_response_id` continues a conversation kept in this replica's ResponseStore
(response_store.py), which also keeps the input items (with ids, as OpenAI lists them)
and the response object. What it cannot honour (images, files, audio, built-in tools,
reasoning, background runs, ...) is refused by name, never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..request import GenerateParameters, GenerateRequest
from .chat import render_prompt
from .common import (
    MAX_TOP_LOGPROBS,
    OpenAIRequestError,
    checked_top_logprobs,
    json_object,
    optional_field,
    refuse_unknown_fields,
    sampling_parameters,
)
from .formats import lark_answer, text_format
from .response_store import ResponseStore, StoredResponse, new_id
from .tools import Tool, ToolPlan, checked_tool, no_tools, tool_plan

# What parse_responses_request reads; anything else is refused (refuse_unknown_fields).
# Beside OpenAI's own, the extensions chat takes too (vLLM's `top_k`,
# `repetition_penalty`, `ignore_eos`, `priority`). The Responses API has no stop sequences.
RESPONSES_FIELDS = frozenset(
    {
        "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
        "tool_choice", "parallel_tool_calls", "text", "stream", "store",
        "previous_response_id", "metadata", "include", "top_logprobs", "truncation",
        "top_k", "repetition_penalty", "ignore_eos", "priority",
    }
)  # fmt: skip
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_MESSAGE_ROLES = {"user", "system", "developer", "assistant"}
_TEXT_PARTS = {"input_text", "output_text"}
# metadata: OpenAI's bounds
_METADATA_PAIRS, _METADATA_KEY, _METADATA_VALUE = 16, 64, 512


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

    def conversation_with(self, output: list[dict]) -> list[dict]:
        """The conversation this response ends: what it was given, then its output items."""
        return [*self.conversation, *items_to_messages(output, "output")]

    def stored(self, response: dict) -> StoredResponse:
        """What the store keeps of this request's completed `response` object."""
        return StoredResponse(
            response, self.items, tuple(self.conversation_with(response["output"]))
        )


def parse_responses_request(body: bytes, tokenizer, store: ResponseStore) -> ResponsesRequest:
    data = json_object(body)
    refuse_unknown_fields(data, RESPONSES_FIELDS)
    _check_truncation(data)
    previous = _previous(data, store)
    conversation = [*(previous.conversation if previous else ()), *_input(data.get("input"))]
    items = [*_previous_items(previous), *input_items(data.get("input"))]
    if not conversation:
        raise OpenAIRequestError("`input` must not be empty", "input")
    instructions = optional_field(data, "instructions", str)
    messages = [{"role": "system", "content": instructions}] if instructions else []
    tools, plan = _tools(data)
    fmt = _text(data)
    answer_format = text_format(fmt)
    prompt = render_prompt(tokenizer, [*messages, *conversation], plan, param="input")
    params, _ = sampling_parameters(data)
    params["max_new_tokens"] = optional_field(data, "max_output_tokens", int)
    logprobs, top_logprobs = _logprobs(data)
    params["top_n_tokens"] = top_logprobs or None
    if plan is None:
        params["grammar"] = answer_format
    generate = GenerateRequest(
        inputs=prompt,
        parameters=GenerateParameters(**params),
        lark=plan.lark(lark_answer(answer_format, "text")) if plan is not None else None,
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
        stream=bool(optional_field(data, "stream", bool)),
        store=_store(data, store),
        conversation=tuple(conversation),
        items=tuple(items),
        tools=plan,
        logprobs=logprobs,
        echo={
            "instructions": instructions,
            "max_output_tokens": params["max_new_tokens"],
            "metadata": _metadata(data),
            "parallel_tool_calls": _parallel(data),
            "previous_response_id": data.get("previous_response_id"),
            "temperature": _default(optional_field(data, "temperature", float), 1.0),
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": data.get("tool_choice") or "auto",
            "tools": [_tool_dict(t, s) for t, s in tools],
            "top_logprobs": top_logprobs,
            "top_p": _default(optional_field(data, "top_p", float), 1.0),
        },
    )


def _default(value, default):
    return default if value is None else value


# the conversation -------------------------------------------------------------------


def _previous(data: dict, store: ResponseStore) -> StoredResponse | None:
    """The previous response, from the store."""
    previous = optional_field(data, "previous_response_id", str)
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


def _input(value) -> list[dict]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise OpenAIRequestError("`input` must be a string or an array of items", "input")
    return items_to_messages(value, "input")


def items_to_messages(items: list, where: str) -> list[dict]:
    """Responses items (messages, function calls, their outputs) as chat messages:
    consecutive calls join one assistant message, as chat writes parallel calls."""
    messages: list[dict] = []
    for index, item in enumerate(items):
        at = f"{where}[{index}]"
        if not isinstance(item, dict):
            raise OpenAIRequestError(f"`{at}` must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, at))
        elif kind == "function_call":
            call = _function_call(item, at)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last["tool_calls"] = [*last.get("tool_calls", []), call]
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(_function_call_output(item, at))
        else:
            raise OpenAIRequestError(
                f"`{at}`: items of type {kind!r} are not supported (messages with text,"
                " function_call and function_call_output are)",
                "input",
            )
    return messages


def _message(item: dict, at: str) -> dict:
    role = item.get("role")
    if role not in _MESSAGE_ROLES:
        raise OpenAIRequestError(f"`{at}.role` must be one of {sorted(_MESSAGE_ROLES)}", "input")
    content = item.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "".join(_text_part(part, f"{at}.content[{i}]") for i, part in enumerate(content))
    else:
        raise OpenAIRequestError(
            f"`{at}.content` must be a string or an array of content parts", "input"
        )
    return {"role": "system" if role == "developer" else role, "content": text}


def _text_part(part, at: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
        return part["text"]
    if kind == "refusal" and isinstance(part.get("refusal"), str):  # an earlier answer's
        return part["refusal"]
    if kind in _TEXT_PARTS:
        raise OpenAIRequestError(f"`{at}.text` must be a string", "input")
    raise OpenAIRequestError(
        f"`{at}`: content parts of type {kind!r} are not supported (only text: input_text,"
        " output_text); images, files and audio need a model that reads them",
        "input",
    )


def _function_call(item: dict, at: str) -> dict:
    fields = {key: item.get(key) for key in ("call_id", "name", "arguments")}
    for key, value in fields.items():
        if not isinstance(value, str):
            raise OpenAIRequestError(f"`{at}.{key}` must be a string", "input")
    return {
        "id": fields["call_id"],
        "type": "function",
        "function": {"name": fields["name"], "arguments": fields["arguments"]},
    }


def _function_call_output(item: dict, at: str) -> dict:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str):
        raise OpenAIRequestError(f"`{at}.call_id` must be a string", "input")
    if isinstance(output, list):
        output = "".join(_text_part(part, f"{at}.output[{i}]") for i, part in enumerate(output))
    if not isinstance(output, str):
        raise OpenAIRequestError(
            f"`{at}.output` must be a string or an array of text parts", "input"
        )
    return {"role": "tool", "content": output, "tool_call_id": call_id}


def input_items(value) -> list[dict]:
    """`input` as OpenAI lists a response's input items: each with an id (the client's,
    else a new one) and a status; text parts as input_text (output_text for assistant
    messages). `value` has been checked by items_to_messages."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    return [_input_item(item) for item in value]


def _input_item(item: dict) -> dict:
    kind = item.get("type", "message")
    given = item.get("id") if isinstance(item.get("id"), str) and item.get("id") else None
    if kind == "function_call":
        fields = {k: item[k] for k in ("call_id", "name", "arguments")}
        return {"id": given or new_id("fc"), "type": kind, **fields, "status": "completed"}
    if kind == "function_call_output":
        output = item["output"]
        if isinstance(output, list):
            output = "".join(_text_part(part, "output") for part in output)
        return {
            "id": given or new_id("fco"),
            "type": kind,
            "call_id": item["call_id"],
            "output": output,
            "status": "completed",
        }
    role, content = item["role"], item["content"]
    parts = [{"type": "input_text", "text": content}] if isinstance(content, str) else content
    return {
        "id": given or new_id("msg"),
        "type": "message",
        "role": role,
        "content": [_item_part(part, role) for part in parts],
        "status": "completed",
    }


def _item_part(part: dict, role: str) -> dict:
    if part.get("type") == "refusal":
        return {"type": "refusal", "refusal": part["refusal"]}
    if role == "assistant":
        return {"type": "output_text", "text": part["text"], "annotations": [], "logprobs": []}
    return {"type": "input_text", "text": part["text"]}


# tools and formats --------------------------------------------------------------------


def _tools(data: dict) -> tuple[list[tuple[Tool, bool | None]], ToolPlan | None]:
    """Function tools in the Responses' flat shape ({"type": "function", "name", ...}),
    with their `strict`, and the plan; built-in tools are refused."""
    raw_tools, choice = data.get("tools"), data.get("tool_choice")
    if not raw_tools:  # OpenAI's SDK and agent frameworks send [] for no tools
        if raw_tools is not None and not isinstance(raw_tools, list):
            raise OpenAIRequestError("`tools` must be an array", "tools")
        no_tools(choice)
        return [], None
    if not isinstance(raw_tools, list):
        raise OpenAIRequestError("`tools` must be an array", "tools")
    tools = [_tool(t, i) for i, t in enumerate(raw_tools)]
    checked = tuple(t for t, _ in tools)
    if isinstance(choice, dict) and choice.get("type") == "function":
        return tools, tool_plan(checked, "function", data, function=choice.get("name"))
    if choice is None or choice in ("auto", "none", "required"):
        return tools, tool_plan(checked, choice or "auto", data)
    raise OpenAIRequestError(
        '`tool_choice` must be "none", "auto", "required" or {"type": "function", "name": ...}'
        " (built-in tools are not served)",
        "tool_choice",
    )


def _tool(t, index: int) -> tuple[Tool, bool | None]:
    where = f"tools[{index}]"
    kind = t.get("type") if isinstance(t, dict) else None
    if kind != "function":
        raise OpenAIRequestError(
            f"`{where}`: tools of type {kind!r} are not supported; only function tools"
            ' ({"type": "function", "name", "parameters", ...}) are: built-in tools'
            " (web_search, file_search, code_interpreter, ...) are not served",
            "tools",
        )
    strict = t.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise OpenAIRequestError(f"`{where}.strict` must be a boolean", "tools")
    return checked_tool(t, where), strict


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


def _parallel(data: dict) -> bool:
    parallel = data.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise OpenAIRequestError("`parallel_tool_calls` must be a boolean", "parallel_tool_calls")
    return True if parallel is None else parallel


def _text(data: dict) -> dict | None:
    """`text`: its `format` (checked by formats.text_format); `verbosity` can't be honoured."""
    text = optional_field(data, "text", dict)
    if text is None:
        return None
    unknown = sorted(k for k, v in text.items() if v is not None and k != "format")
    if unknown:
        raise OpenAIRequestError(f"`text.{unknown[0]}` is not supported", "text")
    fmt = text.get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise OpenAIRequestError("`text.format` must be an object", "text")
    return fmt


# the rest -----------------------------------------------------------------------------


def _logprobs(data: dict) -> tuple[bool, int]:
    """(logprobs asked for, top alternatives per token)."""
    include = optional_field(data, "include", list) or []
    for value in include:
        if value != LOGPROBS_INCLUDE:
            raise OpenAIRequestError(
                f"`include`: {value!r} is not supported (only {LOGPROBS_INCLUDE!r})", "include"
            )
    logprobs = LOGPROBS_INCLUDE in include
    top_logprobs = checked_top_logprobs(data)
    if top_logprobs and not logprobs:
        raise OpenAIRequestError(
            f'`top_logprobs` requires `include: ["{LOGPROBS_INCLUDE}"]`', "top_logprobs"
        )
    return logprobs, top_logprobs


def _store(data: dict, store: ResponseStore) -> bool:
    """OpenAI keeps responses unless `store: false`; a server that keeps none says so in
    the response object, and refuses an explicit `store: true`."""
    asked = optional_field(data, "store", bool)
    if asked and not store.enabled:
        raise OpenAIRequestError(
            "`store`: responses are not kept on this server (--responses-store-mb 0)", "store"
        )
    return store.enabled if asked is None else asked


def _check_truncation(data: dict) -> None:
    truncation = optional_field(data, "truncation", str)
    if truncation not in (None, "disabled"):
        raise OpenAIRequestError(
            '`truncation` must be "disabled": a conversation longer than the context is'
            " refused, never cut",
            "truncation",
        )


def _metadata(data: dict) -> dict:
    metadata = optional_field(data, "metadata", dict) or {}
    ok = len(metadata) <= _METADATA_PAIRS and all(
        isinstance(k, str)
        and len(k) <= _METADATA_KEY
        and isinstance(v, str)
        and len(v) <= _METADATA_VALUE
        for k, v in metadata.items()
    )
    if not ok:
        raise OpenAIRequestError(
            f"`metadata` holds up to {_METADATA_PAIRS} pairs of strings (keys up to"
            f" {_METADATA_KEY} characters, values up to {_METADATA_VALUE})",
            "metadata",
        )
    return metadata
