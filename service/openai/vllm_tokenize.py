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

from .chat import chat_messages, image_parts, render_prompt
from .common import OpenAIRequestError, json_bytes
from .parse import parse_value
from .protocol import VllmTokenizeBody, VllmTokenizeChatBody
from .tools import chat_tool_plan


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
    """A decoded vLLM body (is_vllm_tokenize): the prompt, or the conversation templated."""
    if "messages" in data:
        request = parse_value(VllmTokenizeChatBody, data)
        if names := list(image_parts(request.messages)):  # its count would leave them out
            raise OpenAIRequestError(f"`{names[0]}`: /tokenize takes no images yet", names[0])
        text = render_prompt(
            tokenizer,
            chat_messages(request.messages),
            chat_tool_plan(request.tools, None),
            add_generation_prompt=request.add_generation_prompt is not False,
            continue_final_message=bool(request.continue_final_message),
        )
        return VllmTokenize(text, bool(request.add_special_tokens), bool(request.return_token_strs))
    request = parse_value(VllmTokenizeBody, data)
    return VllmTokenize(
        request.prompt, request.add_special_tokens is not False, bool(request.return_token_strs)
    )


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
