"""vLLM's /tokenize and /detokenize bodies, as tools written for vLLM send them (token
counting, prompt budgeting), and vLLM's answers.

/tokenize: `{"prompt": ...}` (`add_special_tokens` true by default), or `{"messages":
[...]}` through the same chat template and tool descriptions as /v1/chat/completions
(`add_generation_prompt` true, `continue_final_message` and `add_special_tokens` false by
default), with `return_token_strs`; the answer is `{"count", "max_model_len", "tokens",
"token_strs"}`. /detokenize: `{"tokens": [...]}` -> `{"prompt": ...}`. What vLLM reads
and this can't honour (`chat_template`, `chat_template_kwargs`, `mm_processor_kwargs`)
is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from .chat import chat_messages, render_prompt
from .common import (
    OpenAIRequestError,
    json_bytes,
    optional_field,
    refuse_unknown_fields,
    required_field,
)
from .tools import parse_tools

# vLLM's TokenizeCompletionRequest and TokenizeChatRequest, less what is refused.
PROMPT_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
CHAT_FIELDS = frozenset(
    {
        "model", "messages", "add_generation_prompt", "continue_final_message",
        "add_special_tokens", "return_token_strs", "tools",
    }
)  # fmt: skip


@dataclass(frozen=True)
class VllmTokenize:
    text: str  # the prompt, or the conversation through the chat template
    add_special_tokens: bool
    return_token_strs: bool


def is_vllm_tokenize(data) -> bool:
    """vLLM's body (`prompt` or `messages`) rather than TGI's (`inputs`)."""
    return (
        isinstance(data, dict) and "inputs" not in data and ("prompt" in data or "messages" in data)
    )


def parse_vllm_tokenize(data: dict, tokenizer) -> VllmTokenize:
    if "messages" in data:
        refuse_unknown_fields(data, CHAT_FIELDS)
        messages = chat_messages(required_field(data, "messages", list))
        if not messages:
            raise OpenAIRequestError("`messages` must not be empty", "messages")
        generation = _flag(data, "add_generation_prompt", True)
        continuation = _flag(data, "continue_final_message", False)
        if generation and continuation:
            raise OpenAIRequestError(
                "`continue_final_message` continues the last message: it needs"
                " `add_generation_prompt: false`",
                "continue_final_message",
            )
        text = render_prompt(
            tokenizer,
            messages,
            parse_tools(data),
            add_generation_prompt=generation,
            continue_final_message=continuation,
        )
        return VllmTokenize(text, _flag(data, "add_special_tokens", False), _strs(data))
    refuse_unknown_fields(data, PROMPT_FIELDS)
    prompt = required_field(data, "prompt", str)
    return VllmTokenize(prompt, _flag(data, "add_special_tokens", True), _strs(data))


def tokenize_answer(ids: list[int], max_model_len: int, token_strs: list[str] | None) -> bytes:
    return json_bytes(
        {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": token_strs}
    )


def check_token_ids(tokens: list[int], vocab_size: int) -> list[int]:
    """/detokenize's ids, each one of the model's."""
    for index, token in enumerate(tokens):
        if not 0 <= token < vocab_size:
            raise OpenAIRequestError(
                f"`tokens[{index}]`: {token} is not a token id of the model (0 to"
                f" {vocab_size - 1})",
                "tokens",
            )
    return list(tokens)


def _flag(data: dict, key: str, default: bool) -> bool:
    value = optional_field(data, key, bool)
    return default if value is None else value


def _strs(data: dict) -> bool:
    return _flag(data, "return_token_strs", False)
