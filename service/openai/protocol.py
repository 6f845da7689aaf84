"""The OpenAI request bodies textgen accepts, declared once (as vLLM's
entrypoints/openai/protocol.py does): each field with its JSON type, its bounds and
what it means here. parse.py validates a body with them (`model_validate_json`),
scripts/make_openapi.py describes them (`model_json_schema`), so the parser, the
refusals and envoy/openapi.json cannot drift apart. Chat, completions and vLLM's
/tokenize here; the Responses API's body in responses_protocol.py.

The rules every body follows:
- JSON types are strict: no "5" for 5, no `true` for 1, no 5.0 for an integer; numbers
  are finite; an integer fits the proto field it lands in (int32 unless it says).
- A field a body doesn't declare is refused by name, unless it is null (as good as
  absent); an object inside one ignores fields nobody reads.
- A declared field may be null too, meaning its default: pydantic keeps the None, so
  the code that reads a field with a default other than None applies it again
  (`parallel_tool_calls is not False`, `bool(request.stream)`).
- Bounds that are the server's (--max-n, --max-top-n-tokens, --max-stop-sequences,
  max_total_tokens) are the validator's (validation.py), named in the descriptions.

Cross-field rules live here too (`model_validator`s raising OpenAIRequestError); what
needs the server (the tokenizer, the response store, --max-client-batch-size) stays
with the parse functions of chat.py, completions.py, responses.py and vllm_tokenize.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import core_schema
from typing_extensions import TypeAliasType

from ..intake.validation import (
    LOGIT_BIAS_BOUND,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    PENALTY_BOUND,
)
from .common import OpenAIRequestError

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
UINT64_MAX = 2**64 - 1
MAX_TOP_LOGPROBS = 20  # OpenAI's bound (TGI's routes keep the server's --max-top-n-tokens)
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names

# How a field that is accepted but changes nothing says so (tests/integration/
# test_face_fields.py reads it): every other declared field changes the answer or is
# refused.
COMPATIBILITY_ONLY = "Accepted for compatibility only: it has no effect."


class Says:
    """Any error inside the annotated type is one error: "`field` <message>". For a
    union, where pydantic would report every alternative's failure."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __get_pydantic_core_schema__(self, source, handler):
        return core_schema.custom_error_schema(
            handler(source), "says", custom_error_message=self.message
        )


class OpenAIObject(BaseModel):
    """An object inside a body: strict JSON types, finite numbers; unknown fields ignored."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore", frozen=True)


class OpenAIBody(OpenAIObject):
    """A body (or an object of one) that refuses the fields it doesn't declare, unless null."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, None] = Field(init=False)


# the fields every route shares ------------------------------------------------------


class CommonFields(OpenAIBody):
    """What chat, completions and responses all take: OpenAI's sampling fields, the
    extensions vLLM and TGI users send (`top_k`, `repetition_penalty`, `ignore_eos`,
    `priority`), and fields accepted so that clients which always send them work."""

    model: str | None = Field(
        None,
        description="A served LoRA adapter's name (GET /v1/models lists them), or the base"
        " model (its id, `tgi`, or unset). When the server serves no adapter, any name means"
        " the base model; when it does, another name is refused with 422.",
    )
    user: str | None = Field(None, description=f"{COMPATIBILITY_ONLY} No end-user id is kept.")
    # read by the front proxy (envoy/affinity.py), which routes a conversation to the
    # replica that cached it
    prompt_cache_key: str | None = Field(
        None,
        description=f"{COMPATIBILITY_ONLY} The answer is the same; `textgen proxy` routes"
        " requests with the same key to the same replica, whose prefix cache holds their"
        " common prompt.",
    )
    temperature: float | None = Field(
        None,
        ge=0,
        description="0 means greedy decoding; otherwise sampled at this temperature.",
        examples=[1.0],
    )
    top_p: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Nucleus sampling mass (when sampling), in (0, 1]; 1 means none.",
        examples=[0.95],
    )
    top_k: int | None = Field(
        None,
        ge=-1,
        le=INT32_MAX,
        description="Sample among the top_k most probable tokens (when sampling); -1 or 0:"
        " all (vLLM's extension).",
    )
    repetition_penalty: float | None = Field(
        None,
        ge=MIN_REPETITION_PENALTY,
        le=MAX_REPETITION_PENALTY,
        description="Penalize tokens of the prompt and the output (1.0: none; TGI's and"
        " vLLM's extension).",
    )
    ignore_eos: bool | None = Field(
        False,
        description="Keep generating past EOS until max_tokens (max_output_tokens on"
        " /v1/responses; vLLM's extension, for benchmarks).",
    )
    priority: int | None = Field(
        None,
        ge=INT32_MIN,
        le=INT32_MAX,
        description="Scheduling priority (vLLM's convention): lower is served sooner, ties in"
        " arrival order; a full bounded queue refuses the lowest first. Unset: the"
        " `x-textgen-priority` header's, else 0.",
        examples=[0],
    )
    stream: bool | None = False


class StreamOptions(OpenAIObject):
    include_usage: bool | None = Field(
        None,
        description="If set, an additional chunk will be streamed before the data: [DONE]"
        " message. The usage field on this chunk shows the token usage statistics for the"
        " entire request, and the choices field will always be an empty array. All other"
        " chunks will also include a usage field, but with a null value.",
        examples=[True],
    )


Stop = Annotated[str | list[str], Says("must be a string or a list of strings")]
# a token id as a JSON object key (uint32 on the wire; the vocabulary bounds it)
TokenId = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]
Bias = Annotated[float, Field(ge=-LOGIT_BIAS_BOUND, le=LOGIT_BIAS_BOUND)]
LogitBias = Annotated[
    dict[TokenId, Bias], Says("maps token ids (decimal strings) to numbers in [-100, 100]")
]


class SamplingFields(CommonFields):
    """The fields chat and completions share beside CommonFields."""

    max_tokens: int | None = Field(
        None,
        gt=0,
        le=INT32_MAX,
        description="Most tokens to generate. Prompt plus max_tokens must fit max_total_tokens.",
        examples=[32],
    )
    n: int | None = Field(
        None,
        ge=1,
        le=INT32_MAX,
        description="Choices to generate (`index` 0 to n - 1), each sampled with its own seed"
        " (the request's seed + i); the prompt is computed once for all of them. At most the"
        " server's --max-n (16) and --max-batch-size; all of them at full length must fit the"
        " KV cache at once.",
    )
    frequency_penalty: float | None = Field(None, ge=-PENALTY_BOUND, le=PENALTY_BOUND)
    presence_penalty: float | None = Field(None, ge=-PENALTY_BOUND, le=PENALTY_BOUND)
    seed: int | None = Field(
        None, ge=0, le=UINT64_MAX, description="Sampling seed (unsigned 64 bits)."
    )
    stop: Stop | None = Field(
        None,
        description="Up to the server's --max-stop-sequences (4) sequences of up to 256"
        " characters; they are left out of the text.",
    )
    logit_bias: LogitBias | None = Field(
        None,
        description="Token id (a decimal string, inside the vocabulary) to a bias in [-100, 100].",
    )
    stream_options: StreamOptions | None = None


# chat -------------------------------------------------------------------------------


class ChatContentPart(OpenAIObject):
    type: Literal["text"]
    text: str


class ImageUrl(OpenAIObject):
    url: str = Field(
        description="The image as a base64 data: URI (data:image/png;base64,...) or an http(s)"
        " URL the server fetches (any format Pillow reads; docs/models.md, Images)."
    )
    detail: Literal["auto", "low", "high"] | None = Field(
        None,
        description="Accepted; the model's processor sets the resolution (LLaVA has one), so"
        " every value reads the image the same way.",
    )


class ChatImagePart(OpenAIObject):
    """An image, for a vision-language model (docs/models.md); user messages only."""

    type: Literal["image_url"]
    image_url: ImageUrl


class MessageFunctionCall(OpenAIObject):
    name: str
    arguments: str = Field("", description="The arguments, a JSON object as text.")


class MessageToolCall(OpenAIObject):
    """A call the assistant made earlier in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall


ChatContent = Annotated[
    str | list[Annotated[ChatContentPart | ChatImagePart, Field(discriminator="type")]],
    Says(
        'must be a string or a list of text parts ({"type": "text", "text": ...}) and image'
        ' parts ({"type": "image_url", "image_url": {"url": "data:..." or "https://..."}})'
    ),
]


class ChatMessage(OpenAIObject):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: ChatContent | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(
        None, description="An assistant message's calls; ignored on other roles."
    )


class FunctionDefinition(OpenAIObject):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None,
        description="A JSON schema of the arguments; the generated arguments follow it."
        " Omitted: a function without parameters.",
    )
    strict: bool | None = Field(None, description="Accepted; arguments always follow the schema.")


class Tool(OpenAIObject):
    type: Literal["function"]
    function: FunctionDefinition


class ChatFunctionName(OpenAIObject):
    name: str


class ChatNamedToolChoice(OpenAIObject):
    type: Literal["function"]
    function: ChatFunctionName


ToolChoice = TypeAliasType(
    "ToolChoice",
    Annotated[
        Literal["none", "auto", "required"] | ChatNamedToolChoice,
        Says(
            'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        ),
    ],
)
TOOL_CHOICE = (
    "auto (default with tools): a text answer or calls; required: one or more calls; a named"
    " function: one call to it; none: a text answer."
)
ChatTools = Annotated[list[Tool], Field(min_length=1)]
ReasoningEffort = Literal["low", "medium", "high"]
# what the chat template gets from the server itself (chat.render_prompt), and
# apply_chat_template's own arguments: chat_template_kwargs may not set them
RESERVED_TEMPLATE_KWARGS = (
    "messages",
    "conversation",
    "tools",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "tokenize",
    "sanitize_control_tokens",
    "return_dict",
    "return_tensors",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
    "padding",
    "truncation",
    "max_length",
    "add_special_tokens",
    "bos_token",
    "eos_token",
    "raise_exception",
    "strftime_now",
)


class ResponseFormatJsonSchema(OpenAIObject):
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = Field(None, description="Strict or not, the output follows the schema.")


class ResponseFormat(OpenAIObject):
    """OpenAI's text / json_object / json_schema, or TGI's grammar
    ({"type": "json" | "json_schema" | "regex", "value": ...})."""

    type: Literal["text", "json_object", "json_schema", "json", "regex"]
    json_schema: ResponseFormatJsonSchema | None = None
    value: Any = Field(None, description="TGI's grammar value; with json_object, its schema.")
    schema_: Any = Field(
        None,
        alias="schema",
        description="With json_object, the schema the answer follows (LangChain's spelling"
        " of TGI's `value`).",
    )


class ChatToolFields(OpenAIBody):
    """Chat's tools, and which of them may be called."""

    tools: ChatTools | None = None
    tool_choice: ToolChoice | None = Field(None, description=TOOL_CHOICE)
    parallel_tool_calls: bool | None = True


class ChatCompletionBody(SamplingFields, ChatToolFields):
    """OpenAI's chat request; a field not listed here is refused (422) unless null."""

    messages: list[ChatMessage] = Field(
        min_length=1, description="The conversation, rendered with the model's chat template."
    )
    max_completion_tokens: int | None = Field(
        None, gt=0, le=INT32_MAX, description="Preferred over max_tokens."
    )
    logprobs: bool | None = False
    top_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="Alternatives per token, 0 to 20; needs logprobs: true.",
    )
    response_format: ResponseFormat | None = None
    tool_prompt: str | None = Field(
        None,
        description="TGI's: with tools, the words before the tools in the system message.",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="vLLM's: extra keyword arguments of the chat template (e.g."
        ' `{"enable_thinking": false}` for Qwen3). A name the server sets itself'
        f" ({', '.join(f'`{n}`' for n in RESERVED_TEMPLATE_KWARGS)}) is refused (422); one"
        " the template doesn't read changes nothing.",
    )
    reasoning_effort: ReasoningEffort | None = Field(
        None,
        description="OpenAI's: how hard a reasoning model thinks, given to the chat template"
        " as `reasoning_effort` (gpt-oss's template reads it; a template that doesn't read it"
        " is unchanged).",
    )

    @model_validator(mode="after")
    def _logprobs_for_top_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise OpenAIRequestError("`top_logprobs` requires `logprobs: true`", "top_logprobs")
        return self

    @model_validator(mode="after")
    def _template_kwargs_of_its_own(self):
        reserved = [n for n in (self.chat_template_kwargs or {}) if n in RESERVED_TEMPLATE_KWARGS]
        if reserved:
            raise OpenAIRequestError(
                f"`chat_template_kwargs` may not set `{reserved[0]}`: the server sets it",
                "chat_template_kwargs",
            )
        kwargs = self.chat_template_kwargs or {}
        effort = kwargs.get("reasoning_effort", self.reasoning_effort)
        if self.reasoning_effort is not None and effort != self.reasoning_effort:
            raise OpenAIRequestError(
                "`reasoning_effort` and `chat_template_kwargs.reasoning_effort` disagree",
                "reasoning_effort",
            )
        return self


# completions ---------------------------------------------------------------------------


class CompletionBody(SamplingFields):
    """OpenAI's (legacy) completions request; a field not listed here is refused (422)
    unless null."""

    prompt: Annotated[
        str | Annotated[list[str], Field(min_length=1)],
        Says("must be a string or a non-empty list of strings"),
    ] = Field(
        description="A prompt, or up to the server's max_client_batch_size (4) prompts: one"
        " choice each."
    )
    echo: bool | None = False
    logprobs: int | None = Field(
        None,
        ge=0,
        le=INT32_MAX,
        description="Alternatives per token in the legacy logprobs object, up to the server's"
        " --max-top-n-tokens (5).",
    )
    suffix: Annotated[str, Field(max_length=0), Says("is not supported")] | None = Field(
        None,
        description="Fill-in-the-middle is not supported: a non-empty suffix is refused (422).",
    )
    best_of: int | None = Field(
        None,
        ge=1,
        le=INT32_MAX,
        description="Choices to sample per prompt (at least n; unset: n); the n with the"
        " highest summed token logprob are answered. Streamed only when it equals n. At most"
        " the server's --max-n (16).",
    )

    @model_validator(mode="after")
    def _best_of_rules(self):
        """OpenAI's: at least n, and only streamed when it is n."""
        n = self.n or 1
        if self.best_of is not None and self.best_of < n:
            raise OpenAIRequestError(
                f"`best_of` must be >= `n` ({n}). Given: {self.best_of}", "best_of"
            )
        if self.best_of is not None and self.best_of > n and self.stream:
            raise OpenAIRequestError("`best_of` > `n` can't be streamed", "best_of")
        return self


# vLLM's /tokenize ------------------------------------------------------------------------


class VllmTokenizeBody(OpenAIBody):
    """vLLM's /tokenize body for a prompt."""

    model: str | None = Field(None, description=COMPATIBILITY_ONLY)
    prompt: str
    add_special_tokens: bool | None = Field(
        True, description="Add the tokenizer's special tokens (BOS)."
    )
    return_token_strs: bool | None = Field(
        False, description="Also answer each token's text (`token_strs`)."
    )


class VllmTokenizeChatBody(OpenAIBody):
    """vLLM's /tokenize body for a conversation, through the model's chat template (and
    its tool descriptions), as /v1/chat/completions prompts it. What vLLM reads and this
    can't honour (`chat_template`, `chat_template_kwargs`, `mm_processor_kwargs`) is
    refused by name."""

    model: str | None = Field(None, description=COMPATIBILITY_ONLY)
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool | None = Field(True, description="Open the assistant's turn.")
    continue_final_message: bool | None = Field(
        False,
        description="Leave the last message open, to be continued (needs"
        " add_generation_prompt false).",
    )
    add_special_tokens: bool | None = Field(
        False, description="Add special tokens beside the template's own."
    )
    return_token_strs: bool | None = Field(
        False, description="Also answer each token's text (`token_strs`)."
    )
    tools: ChatTools | None = None

    @model_validator(mode="after")
    def _continue_without_generation_prompt(self):
        if self.continue_final_message and self.add_generation_prompt is not False:
            raise OpenAIRequestError(
                "`continue_final_message` continues the last message: it needs"
                " `add_generation_prompt: false`",
                "continue_final_message",
            )
        return self
