"""The Responses API's request body (/v1/responses), declared as protocol.py declares
chat's: the subset textgen honours. Its input is messages (text, and images for a
vision-language model), function calls and their outputs, and reasoning items (read and
left out of the prompt); files, audio, built-in tools, reasoning summaries and background
runs are refused by name."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator
from typing_extensions import TypeAliasType

from .common import OpenAIRequestError
from .protocol import (
    FUNCTION_NAME,
    INT32_MAX,
    MAX_TOP_LOGPROBS,
    CommonFields,
    OpenAIBody,
    OpenAIObject,
    ReasoningEffort,
    Says,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponseInputText(OpenAIObject):
    type: Literal["input_text", "output_text"]
    text: str


class ResponseInputRefusal(OpenAIObject):
    """An earlier answer's refusal, read as its text."""

    type: Literal["refusal"]
    refusal: str


class ResponseInputImage(OpenAIObject):
    """An image, for a vision-language model (docs/models.md); user messages only."""

    type: Literal["input_image"]
    image_url: str | None = Field(
        None,
        description="The image as a base64 data: URI (data:image/png;base64,...) or an http(s)"
        " URL the server fetches (any format Pillow reads).",
    )
    file_id: str | None = Field(None, description="Refused: files are not served.")
    detail: Literal["auto", "low", "high"] | None = Field(
        None,
        description="Accepted; the model's processor sets the resolution (LLaVA has one), so"
        " every value reads the image the same way.",
    )


ResponseContentPart = Annotated[
    ResponseInputText | ResponseInputRefusal | ResponseInputImage, Field(discriminator="type")
]
ResponseContent = str | list[ResponseContentPart]


class ResponseInputMessage(OpenAIObject):
    """A message (`type` may be left out)."""

    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: ResponseContent


class ResponseInputFunctionCall(OpenAIObject):
    """A function call the model made (an earlier output item)."""

    type: Literal["function_call"]
    id: str | None = None
    call_id: str
    name: str
    arguments: str


class ResponseInputFunctionCallOutput(OpenAIObject):
    """A function call's result."""

    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str
    output: ResponseContent


class ResponseReasoningText(OpenAIObject):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ResponseInputReasoning(OpenAIObject):
    """An earlier output's reasoning item (clients send `output` back as input): read,
    and left out of the prompt, as the think-tag templates leave out earlier thinking."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ResponseReasoningText] = Field(default_factory=list)
    content: list[ResponseReasoningText] | None = None
    status: str | None = None


def _item_type(item) -> str | None:
    """An input item's kind: its `type`, "message" when left out."""
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None)


ResponseInputItem = TypeAliasType(
    "ResponseInputItem",
    Annotated[
        Annotated[ResponseInputMessage, Tag("message")]
        | Annotated[ResponseInputFunctionCall, Tag("function_call")]
        | Annotated[ResponseInputFunctionCallOutput, Tag("function_call_output")]
        | Annotated[ResponseInputReasoning, Tag("reasoning")],
        Discriminator(_item_type),
    ],
)
ResponseInput = str | list[ResponseInputItem]


class ResponseFunctionTool(OpenAIObject):
    """A function tool, in the Responses API's flat shape. Built-in tools (web_search,
    file_search, code_interpreter, ...) are not served."""

    type: Annotated[
        Literal["function"],
        Says(
            'must be "function": built-in tools (web_search, file_search, code_interpreter,'
            " ...) are not served"
        ),
    ]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="A JSON schema of the arguments; the generated arguments follow it."
    )
    strict: bool | None = Field(None, description="Echoed; arguments always follow the schema.")


class ResponseNamedToolChoice(OpenAIObject):
    type: Literal["function"]
    name: str


ResponseToolChoice = TypeAliasType(
    "ResponseToolChoice",
    Annotated[
        Literal["none", "auto", "required"] | ResponseNamedToolChoice,
        Says(
            'must be "none", "auto", "required" or {"type": "function", "name": ...}'
            " (built-in tools are not served)"
        ),
    ],
)


class TextFormatText(OpenAIObject):
    type: Literal["text"]


class TextFormatJsonObject(OpenAIObject):
    type: Literal["json_object"]


class TextFormatJsonSchema(OpenAIObject):
    type: Literal["json_schema"]
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = Field(None, description="Strict or not, the output follows the schema.")


TextFormat = Annotated[
    TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")
]


class ResponseTextConfig(OpenAIBody):
    """`verbosity` can't be honoured: refused, as any field but `format`."""

    format: TextFormat | None = None


class ResponseReasoningConfig(OpenAIBody):
    """`effort` only: `summary` (and `generate_summary`) can't be honoured: refused."""

    effort: ReasoningEffort | None = Field(
        None,
        description="Given to the chat template as `reasoning_effort` (gpt-oss's template reads"
        " it; a template that doesn't read it is unchanged).",
    )


Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
    Field(max_length=16),
    Says("holds up to 16 pairs of strings (keys up to 64 characters, values up to 512)"),
]


class ResponsesBody(CommonFields):
    """OpenAI's Responses API request; a field not listed here is refused (422) unless
    null. The Responses API has no stop sequences."""

    input: ResponseInput | None = Field(
        None,
        description="A user message, or the conversation as items: messages (text, and"
        " input_image parts in user messages for a vision-language model), function_call and"
        " function_call_output, and reasoning items (left out of the prompt). Files, audio"
        " and other item types are refused (422, param `input`). May be left out with"
        " previous_response_id.",
    )
    instructions: str | None = Field(
        None,
        description="A system message before the conversation; not carried over by"
        " previous_response_id.",
    )
    max_output_tokens: int | None = Field(
        None,
        gt=0,
        le=INT32_MAX,
        description="Most tokens to generate; reaching it makes the response `incomplete`"
        " (incomplete_details.reason `max_output_tokens`). Prompt plus max_output_tokens must"
        " fit max_total_tokens.",
    )
    tools: list[ResponseFunctionTool] | None = Field(
        None,
        description="Function tools; built-in tools (web_search, file_search, ...) are"
        " refused (422).",
    )
    tool_choice: ResponseToolChoice | None = Field(
        None,
        description="auto (the default): a text answer or calls; required: one or more calls;"
        " a named function: one call to it; none: a text answer.",
    )
    parallel_tool_calls: bool | None = True
    text: ResponseTextConfig | None = Field(
        None,
        description="`format`: text, json_object, or json_schema ({name, schema, strict}):"
        " the output follows the schema.",
    )
    store: bool | None = Field(
        None,
        description="Keep the conversation in this replica's memory (bounded by"
        " --responses-store-mb and --responses-store-ttl) for previous_response_id. Unset:"
        " true, unless the server keeps none (--responses-store-mb 0).",
    )
    previous_response_id: str | None = Field(
        None,
        description="Continue a stored response's conversation. Not found (store: false,"
        " expired, evicted, another replica): 422, param `previous_response_id`.",
    )
    metadata: Metadata | None = Field(None, description="Echoed in the response object.")
    reasoning: ResponseReasoningConfig | None = Field(
        None,
        description="`effort` (low, medium, high): how hard a reasoning model thinks, given"
        " to the chat template as `reasoning_effort`. A reasoning model's thinking comes back"
        " as a `reasoning` output item (--reasoning-parser); summaries are refused.",
    )
    include: list[Literal["message.output_text.logprobs"]] | None = Field(
        None, description="`message.output_text.logprobs`: the output text's token logprobs."
    )
    top_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="Alternatives per token, 0 to 20; needs include message.output_text.logprobs.",
    )
    truncation: (
        Annotated[
            Literal["disabled"],
            Says(
                'must be "disabled": a conversation longer than the context is refused, never cut'
            ),
        ]
        | None
    ) = Field(None, description="A conversation longer than the context is refused, never cut.")

    @model_validator(mode="after")
    def _include_for_top_logprobs(self):
        if self.top_logprobs and LOGPROBS_INCLUDE not in (self.include or ()):
            raise OpenAIRequestError(
                f'`top_logprobs` requires `include: ["{LOGPROBS_INCLUDE}"]`', "top_logprobs"
            )
        return self
