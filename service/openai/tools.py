"""OpenAI tool calling on /v1/chat/completions: `tools` and `tool_choice` in, `tool_calls` out.

One wire format for every model: the Hermes/Qwen convention most open chat models are
trained on,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and a grammar (llguidance Lark, compiled by engine/grammar.py) that makes the model keep to
it: `required` and a named function allow nothing but calls to the declared tools with
arguments valid against their schemas; `auto` allows either a plain answer (one that never
opens a `<tool_call>`) or calls; `none` adds no tools and no grammar. Because the grammar
fixes the bytes around the arguments, the stream parser below can hand out argument
deltas as they are generated, exactly in OpenAI's chunk shapes.

Templates that know tools (they mention `tools`) get them natively; for the others the
tools are described in a system message, and earlier calls and results in the
conversation are written in the same tags.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field

from . import protocol
from .common import OpenAIRequestError
from .parse import parse_value

CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "\n</tool_call>"
CALL_SEPARATOR = "\n"
_ID_ALPHABET = string.ascii_letters + string.digits

TOOLS_INTRO = "You may call one or more functions to assist with the user query."
TOOLS_SYSTEM_PROMPT = (
    """# Tools

{intro}

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within """
    """<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""
)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict  # a JSON schema of the arguments object

    def openai_dict(self) -> dict:
        function = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolPlan:
    """What the request allows: which tools, and whether calling is optional."""

    tools: tuple[Tool, ...]
    choice: str  # "auto", "required" or "function" (a named one); "none" makes no plan
    parallel: bool = True

    @property
    def allows_text(self) -> bool:
        return self.choice == "auto"

    def lark(self, answer: str | None = None) -> str:
        """The llguidance Lark grammar of the output. `answer`: the rule body a plain
        answer must follow (e.g. `%json {...}` for a response_format), None: free text."""
        calls = "call (SEP call)*" if self.parallel else "call"
        alternatives = [f"body_{i}" for i in range(len(self.tools))]
        lines = [
            "start: answer | calls" if self.allows_text else "start: calls",
            f"calls: {calls}",
            f"call: {_lark_literal(CALL_OPEN)} body {_lark_literal(CALL_CLOSE)}",
            f"SEP: {_lark_literal(CALL_SEPARATOR)}",
            f"body: {' | '.join(alternatives)}",
        ]
        for rule, tool in zip(alternatives, self.tools):
            prefix = '{"name": ' + json.dumps(tool.name) + ', "arguments": '
            # arguments in the one-line style of the prompt's examples, as most models learnt them
            compact = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
            schema = json.dumps({**tool.parameters, "x-guidance": compact}, separators=(",", ":"))
            lines.append(f'{rule}: {_lark_literal(prefix)} %json {schema} "}}"')
        if self.allows_text:
            if answer is None:
                # any text that never opens a call: a model that starts one must finish it
                lines.append("answer: TEXT")
                lines.append("TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/")
            else:
                lines.append(f"answer: {answer}")
        return "\n".join(lines) + "\n"


def parse_tools(data: dict) -> ToolPlan | None:
    """Chat's `tools`, `tool_choice` and `parallel_tool_calls` as decoded JSON -> a plan
    (chat_tool_plan)."""
    fields = parse_value(protocol.ChatToolFields, data)
    return chat_tool_plan(fields.tools, fields.tool_choice, fields.parallel_tool_calls)


def chat_tool_plan(
    tools: list[protocol.Tool] | None,
    choice: str | protocol.ChatNamedToolChoice | None,
    parallel: bool | None = None,
) -> ToolPlan | None:
    """Chat's tools and tool_choice -> a plan; None when no tool may be called (no
    tools, or tool_choice "none")."""
    if tools is None:
        return no_tools(choice)
    checked = tuple(plan_tool(t.function) for t in tools)
    if isinstance(choice, protocol.ChatNamedToolChoice):
        return tool_plan(checked, "function", parallel, function=choice.function.name)
    return tool_plan(checked, choice or "auto", parallel)


def no_tools(choice) -> None:
    """Without tools, only no tool_choice (or "none") makes sense."""
    if choice not in (None, "none"):
        raise OpenAIRequestError(
            "`tool_choice` is only allowed when `tools` are specified", "tool_choice"
        )


def tool_plan(
    tools: tuple[Tool, ...], choice: str, parallel: bool | None, function: str | None = None
) -> ToolPlan | None:
    """The plan for `tools` under `choice` ("auto", "none", "required", or "function":
    the one named `function`), with the request's `parallel_tool_calls` (null: true)."""
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise OpenAIRequestError("`tools` must have distinct function names", "tools")
    if choice == "none":
        return None
    if choice == "function":
        chosen = [t for t in tools if t.name == function]
        if not chosen:
            raise OpenAIRequestError(
                f"`tool_choice` names function {function!r}, which is not in `tools`",
                "tool_choice",
            )
        return ToolPlan(tuple(chosen), "function", parallel=False)
    return ToolPlan(tools, choice, parallel is not False)


def plan_tool(f) -> Tool:
    """A declared function (chat's protocol.FunctionDefinition, or the Responses API's
    ResponseFunctionTool: the same fields) as the plan holds it."""
    parameters = f.parameters
    if parameters is None:  # OpenAI: omitted means a function without parameters
        parameters = {"type": "object", "properties": {}, "additionalProperties": False}
    return Tool(f.name, f.description, parameters)


def _lark_literal(text: str) -> str:
    return json.dumps(text)


# prompt ------------------------------------------------------------------------------


def template_knows_tools(tokenizer) -> bool:
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: the default one, or a "tool_use" one
        return "tool_use" in template or "tools" in str(template.get("default", ""))
    return isinstance(template, str) and "tools" in template


def prepare_messages(
    messages: list[dict], plan: ToolPlan | None, native: bool, tool_prompt: str | None = None
) -> list[dict]:
    """The conversation as the template gets it. Native templates get OpenAI's shapes
    (arguments as objects, as transformers' templates expect); the others get calls and
    results written in the tags, and the tools described in the system message.
    `tool_prompt` (TGI's): when tools are offered, the system message's words before the
    tools (for a native template, they are added to its system message)."""
    if native:
        out = [_native(m) for m in messages]
        return _with_system(out, tool_prompt) if plan is not None and tool_prompt else out
    out: list[dict] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = CALL_SEPARATOR.join(_written_call(c) for c in m["tool_calls"])
            content = f"{m['content']}\n{calls}" if m["content"] else calls
            out.append({"role": "assistant", "content": content})
        elif m["role"] == "tool":
            result = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "_tool_results": True})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    for m in out:
        m.pop("_tool_results", None)
    if plan is not None:
        described = TOOLS_SYSTEM_PROMPT.format(
            intro=tool_prompt or TOOLS_INTRO,
            tools="\n".join(json.dumps(t.openai_dict()) for t in plan.tools),
        )
        out = _with_system(out, described)
    return out


def _with_system(messages: list[dict], text: str) -> list[dict]:
    """`text` at the end of the system message (a new one first if there is none)."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _native(m: dict) -> dict:
    if m["role"] != "assistant" or not m.get("tool_calls"):
        return m
    calls = []
    for c in m["tool_calls"]:
        arguments = c["function"]["arguments"]
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
        calls.append({**c, "function": {"name": c["function"]["name"], "arguments": arguments}})
    return {**m, "tool_calls": calls}


def _written_call(call: dict) -> str:
    f = call["function"]
    name = json.dumps(f["name"])
    arguments = f["arguments"] or "{}"
    return f'{CALL_OPEN}{{"name": {name}, "arguments": {arguments}}}{CALL_CLOSE}'


# output ------------------------------------------------------------------------------


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass
class _Call:
    index: int
    id: str
    name: str
    arguments: str = ""
    complete: bool = False


@dataclass
class ToolCallParser:
    """Splits generated text into content or tool calls, incrementally. feed() returns the
    deltas to stream, in OpenAI's shapes: {"content": ...} for a plain answer, or
    {"tool_calls": [...]} with the call's id, type and name first, then argument pieces."""

    plan: ToolPlan
    calls: list[_Call] = field(default_factory=list)
    content: str = ""
    _text: str = ""
    _pos: int = 0  # how far _text has been consumed
    _mode: str = "undecided"  # -> "text" or "calls"
    _depth: int = 0  # JSON nesting inside the current call's arguments
    _in_string: bool = False
    _escaped: bool = False

    @property
    def is_calls(self) -> bool:
        return self._mode == "calls"

    def feed(self, text: str) -> list[dict]:
        self._text += text
        if self._mode == "undecided":
            if not self.plan.allows_text or self._text.startswith(CALL_OPEN.strip()):
                self._mode = "calls"
            elif not CALL_OPEN.strip().startswith(self._text):
                self._mode = "text"
            else:
                return []  # could still be the start of a call: hold it
        if self._mode == "text":
            delta, self._pos = self._text[self._pos :], len(self._text)
            self.content += delta
            return [{"content": delta}] if delta else []
        return self._scan_calls()

    def flush(self) -> list[dict]:
        """At the end: text held as a possible call's start is content after all."""
        if self._mode != "undecided":
            return []
        self._mode = "text"
        return self.feed("")

    def _scan_calls(self) -> list[dict]:
        deltas: list[dict] = []
        while True:
            current = self.calls[-1] if self.calls and not self.calls[-1].complete else None
            if current is None:
                started = self._start_call()
                if started is None:
                    return deltas
                deltas.append(started)
                continue
            piece, done = self._scan_arguments()
            if piece:
                current.arguments += piece
                deltas.append(
                    {"tool_calls": [{"index": current.index, "function": {"arguments": piece}}]}
                )
            if not done:
                return deltas
            current.complete = True

    def _start_call(self) -> dict | None:
        """Consume [the previous call's end] `<tool_call>\\n{"name": "X", "arguments": `
        once it is all there."""
        rest = self._text[self._pos :]
        match = _CALL_HEAD.match(rest)
        if match is None:
            return None
        self._pos += match.end()
        self._depth, self._in_string, self._escaped = 0, False, False
        call = _Call(len(self.calls), new_call_id(), json.loads(match.group(1)))
        self.calls.append(call)
        return {
            "tool_calls": [
                {
                    "index": call.index,
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }
            ]
        }

    def _scan_arguments(self) -> tuple[str, bool]:
        """Advance over the arguments JSON; returns (the new part, whether it is complete)."""
        start = self._pos
        text = self._text
        i = start
        while i < len(text):
            ch = text[i]
            i += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._pos = i
                    return text[start:i], True
            elif self._depth == 0 and ch.isspace() and i - 1 == start:
                start += 1  # whitespace before the object
        self._pos = i
        return text[start:i], False


# what comes before a call's arguments (the grammar writes exactly this): the end of the
# previous call and the separator, if any, then the head of this one
_CALL_HEAD = re.compile(
    "(?:"
    + re.escape("}" + CALL_CLOSE + CALL_SEPARATOR)
    + ")?"
    + re.escape(CALL_OPEN)
    + r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ',
    re.DOTALL,
)


def parse_output(plan: ToolPlan, text: str) -> ToolCallParser:
    """The whole generated text, parsed as the stream would be."""
    parser = ToolCallParser(plan)
    parser.feed(text)
    parser.flush()
    return parser
