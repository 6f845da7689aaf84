"""vLLM's /tokenize and /detokenize bodies, as tools written for vLLM send them (token
counting, prompt budgeting), and vLLM's answers.

/tokenize: `{"prompt": ...}` (`add_special_tokens` true by default), or `{"messages":
[...]}` through the same chat template and tool descriptions as /v1/chat/completions
(`add_generation_prompt` true, `continue_final_message` and `add_special_tokens` false by
default), with `return_token_strs`; the answer is `{"count", "max_model_len", "tokens",
"token_strs"}`. A vision-language model's conversation goes through its processor, as the
chat's prompt does: each image part's placeholder expanded to its image tokens, so the
count is what the image costs (vLLM's answer since it runs the multimodal processor there).
/detokenize: `{"tokens": [...]}` -> `{"prompt": ...}`. What vLLM reads
and this can't honour (`chat_template`, `chat_template_kwargs`, `mm_processor_kwargs`)
is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..intake.images import ImageLimits, ImagePart
from .chat import chat_images, chat_messages, render_prompt
from .common import OpenAIRequestError, json_bytes
from .parse import parse_value
from .protocol import VllmTokenizeBody, VllmTokenizeChatBody
from .tools import chat_tool_plan


@dataclass(frozen=True)
class VllmTokenize:
    text: str  # the prompt, or the conversation through the chat template
    add_special_tokens: bool
    return_token_strs: bool
    images: tuple[ImagePart, ...] = ()  # the conversation's, read (chat.chat_images)


def is_vllm_tokenize(data) -> bool:
    """vLLM's body (`prompt` or `messages`) rather than TGI's (`inputs`)."""
    return (
        isinstance(data, dict) and "inputs" not in data and ("prompt" in data or "messages" in data)
    )


def parse_vllm_tokenize(
    data: dict, tokenizer, image_limits: ImageLimits | None = None
) -> VllmTokenize:
    """A decoded vLLM body (is_vllm_tokenize): the prompt, or the conversation templated
    with its images read within `image_limits` (None: the model takes none; blocking where
    it fetches a URL)."""
    if "messages" in data:
        request = parse_value(VllmTokenizeChatBody, data)
        images = chat_images(request.messages, image_limits)
        text = render_prompt(
            tokenizer,
            chat_messages(request.messages),
            chat_tool_plan(request.tools, None),
            add_generation_prompt=request.add_generation_prompt is not False,
            continue_final_message=bool(request.continue_final_message),
        )
        return VllmTokenize(
            text, bool(request.add_special_tokens), bool(request.return_token_strs), images
        )
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
