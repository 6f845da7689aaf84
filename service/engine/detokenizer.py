"""Incremental detokenization: token ids -> text deltas.

Decoding token by token breaks multi-byte characters (byte-fallback tokens, emoji,
CJK split across tokens) and loses the spaces that sentencepiece-style tokenizers
attach to the previous token. So each step decodes a short window that starts a
few tokens back (`prefix_offset`), and emits only what the new tokens add beyond
the window's already-emitted part (`read_offset`); text that ends in an incomplete
character (U+FFFD) is held until the character is complete. The concatenated
deltas equal `decode_output`: the generated text as it reads after the prompt
(sentencepiece tokenizers strip a leading space when decoding a sequence on its own,
which a continuation must keep).
"""

from __future__ import annotations

from dataclasses import dataclass

# Tokens of the prompt kept as left context for the first window.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


def decode_output(
    tokenizer, token_ids: list[int], num_prompt_tokens: int, skip_special_tokens: bool = True
) -> str:
    """The text of token_ids[num_prompt_tokens:] in the context of the prompt's tail."""
    start = max(num_prompt_tokens - _PROMPT_CONTEXT, 0)
    prefix = tokenizer.decode(
        token_ids[start:num_prompt_tokens], skip_special_tokens=skip_special_tokens
    )
    full = tokenizer.decode(token_ids[start:], skip_special_tokens=skip_special_tokens)
    if full.startswith(prefix):
        return full[len(prefix) :]
    return tokenizer.decode(token_ids[num_prompt_tokens:], skip_special_tokens=skip_special_tokens)


@dataclass(slots=True)
class IncrementalDetokenizer:
    tokenizer: object
    prefix_offset: int
    read_offset: int
    skip_special_tokens: bool = False

    @classmethod
    def for_prompt(cls, tokenizer, num_prompt_tokens: int, **kw) -> IncrementalDetokenizer:
        return cls(tokenizer, max(num_prompt_tokens - _PROMPT_CONTEXT, 0), num_prompt_tokens, **kw)

    def step(self, token_ids: list[int], end: int | None = None) -> str:
        """The text the last token(s) of `token_ids[:end]` complete; "" while a character is
        partial. `end`: a token inside the list (a speculative step appends several)."""
        end = len(token_ids) if end is None else end
        decode = self.tokenizer.decode
        prefix = decode(
            token_ids[self.prefix_offset : self.read_offset],
            skip_special_tokens=self.skip_special_tokens,
        )
        full = decode(
            token_ids[self.prefix_offset : end], skip_special_tokens=self.skip_special_tokens
        )
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = end
        return full[len(prefix) :]
