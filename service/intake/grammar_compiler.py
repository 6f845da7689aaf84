"""Grammar compilation, on the validation side: TGI's grammars, OpenAI's response_format
and tool calls become checked llguidance grammar strings, cached, or a `GrammarError`
(a 422) before anything reaches the engine. No torch here: the validator imports it;
the engine's half (token masks per step) is engine/grammar.py.

Why llguidance (measured on the embedded model's 49k vocabulary, 2-core CPU, 32 matchers
walking JSON schemas; scripts/compare_grammar_backends.py): a batched mask step took 5.3 ms
against xgrammar's 10.8 ms, a schema compiles in ~1 ms, it has no Python dependencies
(xgrammar pulls triton and a TVM runtime), its Lark dialect embeds JSON schemas
(`%json {...}`) so tool calls need no hand-written JSON grammar, and its batched mask
computation runs in Rust with the GIL released, so it overlaps the model's forward.
"""

from __future__ import annotations

import functools
import json

import llguidance
import llguidance.hf

COMPILED_CACHE_SIZE = 512  # distinct grammars kept compiled (validation is the costly part)
# JSON whitespace between two tokens: enough for pretty-printing a few levels deep, and a
# bound, so a model can't stall in whitespace until max_new_tokens (a known failure of
# unbounded JSON grammars). A schema's own "x-guidance" options take precedence.
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,20}"}


class GrammarError(ValueError):
    """The grammar, schema or regex can't be used; the message says why."""


class GrammarCompiler:
    """Turns user grammars into llguidance grammar strings checked against the tokenizer."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        """tokenizer: the model's fast HF tokenizer; vocab_size: the width of the logits
        (may exceed the tokenizer's size: the extra ids are never allowed)."""
        eos = sorted(eos_token_ids) or None
        # ~0.5 s: the token trie is built once per process
        self.ll_tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=eos
        )
        self.vocab_size = vocab_size
        self._check = functools.lru_cache(maxsize=COMPILED_CACHE_SIZE)(self._check_uncached)

    def json_schema(self, schema: dict | bool) -> str:
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be an object or a boolean")
        # sort_keys would reorder properties, which the generated JSON follows: keep the order
        return self._check("json", json.dumps(schema, separators=(",", ":")))

    def regex(self, pattern: str) -> str:
        return self._check("regex", pattern)

    def lark(self, grammar: str) -> str:
        return self._check("lark", grammar)

    def _check_uncached(self, kind: str, source: str) -> str:
        M = llguidance.LLMatcher
        try:
            if kind == "json":
                grammar = M.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
            elif kind == "regex":
                grammar = M.grammar_from_regex(source)
            else:
                grammar = M.grammar_from_lark(source)
        except ValueError as exc:
            raise GrammarError(str(exc)) from exc
        is_error, messages = M.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error:
            raise GrammarError(_first_line(messages[0]))
        return grammar


def _first_line(message: str) -> str:
    """llguidance's message without the source excerpt it draws: the first line and the
    `error:` line of a regex parse error."""
    lines = [line.strip() for line in message.strip().splitlines()]
    kept = [lines[0]] + [line for line in lines[1:] if line.startswith("error:")] if lines else []
    return " ".join(kept) or "invalid grammar"
