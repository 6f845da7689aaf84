"""/v1/messages and /v1/messages/count_tokens: Anthropic's JSON -> a templated
GenerateRequest, on chat's machinery (openai/chat.py's render_prompt and output_grammar,
openai/tools.py's plan and grammar, openai/reasoning.py's start state).

The conversation becomes chat messages as OpenAI's chat route hands them to the template:
`system` (its blocks joined) is the system message; an assistant turn's text blocks are
its content and its tool_use blocks its tool calls (`input` as the arguments' JSON); a
user turn's tool_result blocks are tool messages (a failed call's content as `Error:
...`), its text and image blocks a user message. Text blocks are joined with a blank
line. Consecutive turns of one role are joined into one, as Anthropic does. Earlier
thinking is left out, as the templates leave it out. A conversation that ends with an
assistant turn is continued from its text (prefill).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..intake.images import ImageLimits, ImagePart, ImageSource, read_images
from ..intake.request import GenerateParameters, GenerateRequest
from ..openai.chat import output_grammar, render_prompt
from ..openai.common import OpenAIRequestError, sampler_parameters
from ..openai.parse import parse_body
from ..openai.reasoning import start_state, tag_tokens
from ..openai.tools import Tool as PlannedTool
from ..openai.tools import ToolPlan, no_tools, tool_plan
from .protocol import (
    ConversationFields,
    CountTokensBody,
    ImageBlockParam,
    MessagesBody,
    RedactedThinkingBlockParam,
    TextBlockParam,
    ThinkingBlockParam,
    ThinkingConfigEnabled,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlockParam,
    ToolUseBlockParam,
)

BLOCK_SEPARATOR = "\n\n"  # between the text blocks of one turn (or of `system`)


@dataclass(frozen=True)
class MessagesRequest:
    # the templated prompt and TGI parameters (with tools or a thinking budget, their
    # Lark grammar)
    generate: GenerateRequest
    stream: bool
    stop: tuple[str, ...]
    tools: ToolPlan | None = None  # tools the model may call
    # where the output starts (reasoning.start_state): None without a reasoning parser
    reasoning: str | None = None


@dataclass(frozen=True)
class _Prompt:
    text: str
    images: tuple[ImagePart, ...]
    plan: ToolPlan | None
    state: str | None  # reasoning.start_state
    budget: int | None  # thinking.budget_tokens


def parse_messages_request(
    body: bytes, tokenizer, reasoning_parser: str | None = None, images: ImageLimits | None = None
) -> MessagesRequest:
    """`reasoning_parser`: the server's (reasoning.resolve_parser), None: none; `images`:
    what the model's images may be (None: it takes none). Blocking where it fetches."""
    request = parse_body(MessagesBody, body)
    prompt = _prompt(request, tokenizer, reasoning_parser, images)
    if prompt.budget is not None and prompt.budget >= request.max_tokens:
        raise OpenAIRequestError(
            f"`thinking.budget_tokens` must be less than `max_tokens` ({request.max_tokens})."
            f" Given: {prompt.budget}",
            "thinking",
        )
    grammar, lark, state = output_grammar(
        prompt.plan, None, "tools", prompt.state, tokenizer, prompt.budget
    )
    params = sampler_parameters(request.temperature, request.top_p, request.top_k)
    stop = tuple(request.stop_sequences or ())
    params.update(
        model=request.model, max_new_tokens=request.max_tokens, stop=stop, grammar=grammar
    )
    generate = GenerateRequest(
        inputs=prompt.text,
        parameters=GenerateParameters(**params),
        lark=lark,
        names=_names(prompt.plan),
        images=prompt.images,
    )
    return MessagesRequest(
        generate=generate,
        stream=bool(request.stream),
        stop=stop,
        tools=prompt.plan,
        reasoning=state,
    )


def parse_count_tokens_request(
    body: bytes, tokenizer, reasoning_parser: str | None = None, images: ImageLimits | None = None
) -> GenerateRequest:
    """The prompt (and its images) a create body with these fields would have."""
    request = parse_body(CountTokensBody, body)
    prompt = _prompt(request, tokenizer, reasoning_parser, images)
    return GenerateRequest(inputs=prompt.text, names=_names(prompt.plan), images=prompt.images)


def _names(plan: ToolPlan | None) -> dict[str, str]:
    """TGI's fields as Anthropic calls them (request.GenerateRequest.names)."""
    return {
        "inputs": "messages",
        "max_new_tokens": "max_tokens",
        "stop": "stop_sequences",
        "grammar": "tools" if plan is not None else "thinking",
    }


def _prompt(
    request: ConversationFields, tokenizer, reasoning_parser: str | None, limits
) -> _Prompt:
    plan = _tool_plan(request)
    options, budget = _thinking(request.thinking, reasoning_parser, tokenizer)
    messages, sources = conversation(request.system, request.messages)
    if messages[-1]["role"] == "assistant":
        options.update(add_generation_prompt=False, continue_final_message=True)
    text = render_prompt(tokenizer, messages, plan, None, "messages", **options)
    images = read_images(sources, limits)
    return _Prompt(text, images, plan, start_state(reasoning_parser, text), budget)


# the conversation ---------------------------------------------------------------------


def conversation(system, messages) -> tuple[list[dict], list[ImageSource]]:
    """`system` and `messages` (protocol.py's) as chat messages, and their images in
    order (not read yet); a block in the wrong turn is refused, naming it."""
    out: list[dict] = []
    if system:
        out.append({"role": "system", "content": _joined(_blocks(system))})
    images: list[ImageSource] = []
    for i, message in enumerate(messages):
        blocks = _blocks(message.content)
        turn = _assistant(i, blocks) if message.role == "assistant" else _user(i, blocks, images)
        out.extend(turn)
    out = _joined_turns(out)
    last = out[-1] if out else None
    if last is not None and last["role"] == "assistant":
        if last.get("tool_calls"):
            raise OpenAIRequestError(
                "`messages`: the last turn is the assistant's tool_use: send each call's"
                " tool_result in a user turn after it",
                "messages",
            )
        if not last["content"]:  # nothing to continue: the answer's turn opens as usual
            out.pop()
    if not any(m["role"] != "system" for m in out):
        raise OpenAIRequestError("`messages` must hold a user turn", "messages")
    return out, images


def _blocks(content) -> list:
    return [TextBlockParam(type="text", text=content)] if isinstance(content, str) else content


def _assistant(i: int, blocks: list) -> list[dict]:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlockParam):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlockParam):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": arguments},
                }
            )
        elif not isinstance(block, (ThinkingBlockParam, RedactedThinkingBlockParam)):
            _misplaced(i, j, block, "user")
    message = {"role": "assistant", "content": BLOCK_SEPARATOR.join(texts)}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _user(i: int, blocks: list, images: list[ImageSource]) -> list[dict]:
    out: list[dict] = []
    parts: list = []  # the user message's text and images, in order
    for j, block in enumerate(blocks):
        name = f"messages[{i}].content[{j}]"
        if isinstance(block, TextBlockParam):
            parts.append(block.text)
        elif isinstance(block, ImageBlockParam):
            images.append(_image(block, name))
            parts.append({"type": "image"})
        elif isinstance(block, ToolResultBlockParam):
            if parts:
                out.append({"role": "user", "content": _content(parts)})
                parts = []
            out.append(
                {"role": "tool", "content": _result(block, name), "tool_call_id": block.tool_use_id}
            )
        else:
            _misplaced(i, j, block, "assistant")
    if parts or not out:
        out.append({"role": "user", "content": _content(parts)})
    return out


def _misplaced(i: int, j: int, block, role: str):
    name = f"messages[{i}].content[{j}]"
    raise OpenAIRequestError(f"`{name}`: a {block.type} block goes in {role} turns only", name)


def _image(block: ImageBlockParam, name: str) -> ImageSource:
    """The block's image as a URL: its url, or its base64 data as a data: URI."""
    source = block.source
    if source.type == "url":
        return ImageSource(source.url, name)
    return ImageSource(f"data:{source.media_type};base64,{source.data}", name)


def _result(block: ToolResultBlockParam, name: str) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        for k, part in enumerate(content):
            if isinstance(part, ImageBlockParam):
                where = f"{name}.content[{k}]"
                raise OpenAIRequestError(
                    f"`{where}`: images in a tool_result are not supported", where
                )
        text = _joined(content)
    return f"Error: {text}" if block.is_error else text


def _joined(blocks: list[TextBlockParam]) -> str:
    return BLOCK_SEPARATOR.join(block.text for block in blocks)


def _content(parts: list) -> str | list[dict]:
    """A user message's content: its text, or, with images, the parts ({"type": "image"}
    where each goes: the template writes its placeholder)."""
    if all(isinstance(part, str) for part in parts):
        return BLOCK_SEPARATOR.join(parts)
    return [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]


def _joined_turns(messages: list[dict]) -> list[dict]:
    """Consecutive user (or assistant) messages as one."""
    out: list[dict] = []
    for m in messages:
        last = out[-1] if out else None
        if last is None or last["role"] != m["role"] or m["role"] not in ("user", "assistant"):
            out.append(m)
            continue
        joined = {"role": m["role"], "content": _join(last["content"], m["content"])}
        calls = [*last.get("tool_calls", ()), *m.get("tool_calls", ())]
        if calls:
            joined["tool_calls"] = calls
        out[-1] = joined
    return out


def _join(a: str | list[dict], b: str | list[dict]) -> str | list[dict]:
    if isinstance(a, str) and isinstance(b, str):
        return BLOCK_SEPARATOR.join(t for t in (a, b) if t)
    return _parts(a) + _parts(b)


def _parts(content: str | list[dict]) -> list[dict]:
    if isinstance(content, list):
        return content
    return [{"type": "text", "text": content}] if content else []


# tools and thinking -------------------------------------------------------------------


def _tool_plan(request: ConversationFields) -> ToolPlan | None:
    """Anthropic's tools and tool_choice as chat's plan (openai/tools.py)."""
    choice = request.tool_choice
    if not request.tools:
        no_tools(None if choice is None else choice.type)
        return None
    tools = tuple(PlannedTool(t.name, t.description, t.input_schema) for t in request.tools)
    if choice is None:
        return tool_plan(tools, "auto", True)
    if isinstance(choice, ToolChoiceNone):
        return tool_plan(tools, "none", True)
    parallel = choice.disable_parallel_tool_use is not True
    if isinstance(choice, ToolChoiceTool):
        return tool_plan(tools, "function", parallel, function=choice.name)
    return tool_plan(tools, "required" if isinstance(choice, ToolChoiceAny) else "auto", parallel)


def _thinking(thinking, reasoning_parser: str | None, tokenizer) -> tuple[dict, int | None]:
    """The chat template's kwargs for `thinking`, and the thinking's budget."""
    if thinking is None:
        return {}, None
    if not isinstance(thinking, ThinkingConfigEnabled):
        return {"enable_thinking": False}, None
    if reasoning_parser is None:
        raise OpenAIRequestError(
            "`thinking`: this model does not think (the server tells no thinking apart:"
            " its chat template writes no <think>, and --reasoning-parser is none)",
            "thinking",
        )
    if tag_tokens(tokenizer) is None:
        raise OpenAIRequestError(
            "`thinking.budget_tokens`: this model's thinking can't be held to a budget (its"
            " think tags are not tokens of its vocabulary); leave `thinking` out to let it"
            " think as its template says",
            "thinking",
        )
    return {"enable_thinking": True}, thinking.budget_tokens
