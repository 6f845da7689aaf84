"""The Anthropic Messages API bodies textgen accepts (POST /v1/messages and
/v1/messages/count_tokens), declared once as openai/protocol.py declares OpenAI's: parsed
with these models (openai/parse.py), described from them (scripts/make_openapi.py).

The same rules hold: strict JSON types; a top-level field a body doesn't declare is
refused by name (400) unless it is null; content blocks, tools, tool_choice and thinking
are told apart by `type`, and a type not declared here (`document`, `search_result`,
`server_tool_use`, a server tool such as `web_search_20250305`, `adaptive` thinking, ...)
is refused by name. Fields of a block or a tool that nobody reads (`citations`, a newer
field the SDK writes back) are ignored, as the other faces ignore them inside objects;
`cache_control` is declared and accepted everywhere Anthropic takes it (the prefix cache
keeps every prompt's blocks anyway).

Anthropic's bounds hold: `max_tokens` is required, `temperature` is in [0, 1].
Cross-field rules that need the server (the reasoning parser, the tokenizer's think tags)
are messages.py's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from ..openai.protocol import (
    COMPATIBILITY_ONLY,
    INT32_MAX,
    OpenAIBody,
    OpenAIObject,
)

# Anthropic's rule for tool names
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,128}$"
CACHING = (
    " The prefix cache keeps every prompt's blocks whatever it says: a later prompt that"
    " starts the same reads them (usage.cache_read_input_tokens)."
)


class CacheControlEphemeral(OpenAIObject):
    """A prompt-caching breakpoint (Anthropic's); accepted."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


CacheControlField = Annotated[
    CacheControlEphemeral | None, Field(description=f"{COMPATIBILITY_ONLY}{CACHING}")
]


# content blocks -----------------------------------------------------------------------


class TextBlockParam(OpenAIObject):
    type: Literal["text"]
    text: str
    cache_control: CacheControlField = None


class Base64ImageSource(OpenAIObject):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str = Field(description="The image file, base64.")


class URLImageSource(OpenAIObject):
    type: Literal["url"]
    url: str


class ImageBlockParam(OpenAIObject):
    """An image, for a vision-language model (docs/models.md): user messages only; a
    text-only model refuses it (400, naming the block)."""

    type: Literal["image"]
    source: Annotated[Base64ImageSource | URLImageSource, Field(discriminator="type")]
    cache_control: CacheControlField = None


class ToolUseBlockParam(OpenAIObject):
    """A call the assistant made earlier in the conversation (assistant messages only)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(description="The call's arguments.")
    cache_control: CacheControlField = None


ToolResultContent = (
    str | list[Annotated[TextBlockParam | ImageBlockParam, Field(discriminator="type")]]
)


class ToolResultBlockParam(OpenAIObject):
    """A call's result (user messages only), given to the chat template as a tool message."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: ToolResultContent | None = None
    is_error: bool | None = Field(
        None, description="A failed call: its content reaches the template as `Error: ...`."
    )
    cache_control: CacheControlField = None


class ThinkingBlockParam(OpenAIObject):
    """Earlier thinking (assistant messages only): accepted and left out of the prompt, as
    the chat templates leave out earlier thinking."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlockParam(OpenAIObject):
    """Another server's encrypted thinking: accepted and left out of the prompt."""

    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlockParam
    | ImageBlockParam
    | ToolUseBlockParam
    | ToolResultBlockParam
    | ThinkingBlockParam
    | RedactedThinkingBlockParam,
    Field(discriminator="type"),
]
Content = str | list[ContentBlock]


class MessageParam(OpenAIObject):
    role: Literal["user", "assistant"]
    content: Content


System = str | list[TextBlockParam]


# tools --------------------------------------------------------------------------------


class ToolParam(OpenAIObject):
    """A client tool; Anthropic's server tools (`bash_...`, `web_search_...`, ...) are
    refused by their `type`."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any] = Field(
        description="A JSON schema of the input object; the generated input follows it."
    )
    cache_control: CacheControlField = None


PARALLEL = Field(
    None, description="At most one tool_use block in the answer (by default, one or more)."
)


class ToolChoiceAuto(OpenAIObject):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = PARALLEL


class ToolChoiceAny(OpenAIObject):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = PARALLEL


class ToolChoiceTool(OpenAIObject):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = PARALLEL


class ToolChoiceNone(OpenAIObject):
    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
    Field(discriminator="type"),
]
TOOL_CHOICE = (
    "auto (default with tools): a text answer or tool_use blocks; any: one or more calls;"
    " tool: one call to the named tool; none: a text answer (the tools are left out of the"
    " prompt)."
)


# thinking -----------------------------------------------------------------------------


class ThinkingConfigEnabled(OpenAIObject):
    type: Literal["enabled"]
    budget_tokens: int = Field(
        ge=1,
        le=INT32_MAX,
        description="The most tokens the thinking takes: then its closing tag is forced."
        " Less than max_tokens. Needs a reasoning model whose think tags are tokens of its"
        " vocabulary (Qwen3, QwQ, DeepSeek-R1, ...); Anthropic's minimum of 1024 is not"
        " enforced.",
    )


class ThinkingConfigDisabled(OpenAIObject):
    type: Literal["disabled"]


Thinking = Annotated[ThinkingConfigEnabled | ThinkingConfigDisabled, Field(discriminator="type")]
THINKING = (
    "A reasoning model's thinking (--reasoning-parser): `enabled` gives the chat template"
    " `enable_thinking: true` and holds the thinking to budget_tokens; `disabled` gives it"
    " `enable_thinking: false` (Qwen3's template then writes an empty thinking block; a"
    " template that doesn't read it thinks anyway). The thinking is answered as `thinking`"
    " blocks. Refused (400) when the server has no reasoning parser."
)


class MetadataParam(OpenAIBody):
    user_id: str | None = Field(None, description=f"{COMPATIBILITY_ONLY} No end-user id is kept.")


# the bodies ---------------------------------------------------------------------------


class ConversationFields(OpenAIBody):
    """What create and count_tokens both take: the prompt, rendered the same way."""

    model: str = Field(
        description="A served LoRA adapter's name (GET /v1/models lists them), or the base"
        " model (its id, `tgi`, or any name when the server serves no adapter); another name"
        " is refused with 404 `not_found_error` when adapters are served.",
        examples=["tgi"],
    )
    messages: list[MessageParam] = Field(
        min_length=1,
        description="The conversation, rendered with the model's chat template: consecutive"
        " turns of one role are joined; tool_use blocks become the assistant's tool calls,"
        " tool_result blocks tool messages. A last assistant message is continued"
        " (prefill).",
    )
    system: System | None = Field(None, description="The system prompt (blocks joined).")
    tools: list[ToolParam] | None = Field(
        None,
        description="Tools the model may call: the answer is then either text or tool_use"
        " blocks, each input valid against its tool's input_schema (a grammar holds it).",
    )
    tool_choice: ToolChoice | None = Field(None, description=TOOL_CHOICE)
    thinking: Thinking | None = Field(None, description=THINKING)
    cache_control: CacheControlField = None


class MessagesBody(ConversationFields):
    """Anthropic's create-a-message body; a field not listed here is refused (400) unless
    null."""

    max_tokens: int = Field(
        gt=0,
        le=INT32_MAX,
        description="Most tokens to generate (required). The prompt's tokens plus max_tokens"
        " must fit max_total_tokens.",
        examples=[32],
    )
    stop_sequences: list[str] | None = Field(
        None,
        description="Up to the server's --max-stop-sequences (4) sequences of up to 256"
        " characters; the one generated is `stop_sequence`, left out of the text.",
    )
    stream: bool | None = Field(False, description="Answer as Anthropic's server-sent events.")
    temperature: float | None = Field(
        None,
        ge=0,
        le=1,
        description="0 means greedy decoding; otherwise sampled at this temperature (1.0).",
        examples=[1.0],
    )
    top_p: float | None = Field(
        None, gt=0, le=1, description="Nucleus sampling mass (when sampling); 1 means none."
    )
    top_k: int | None = Field(
        None,
        ge=0,
        le=INT32_MAX,
        description="Sample among the top_k most probable tokens (when sampling); 0: all.",
    )
    metadata: MetadataParam | None = None


class CountTokensBody(ConversationFields):
    """Anthropic's count_tokens body: a create body's prompt fields; others are refused
    (400) unless null."""

    model: str = Field(
        description=f"{COMPATIBILITY_ONLY} The count is the served tokenizer's, which the"
        " base model and its LoRA adapters share.",
        examples=["tgi"],
    )
