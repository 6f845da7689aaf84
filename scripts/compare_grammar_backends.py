"""Compare llguidance and xgrammar on the embedded model's tokenizer: tokenizer setup, schema
compile, new matcher, and a batched mask step (32 matchers walking random valid paths
through JSON schemas, masks applied to a logits batch). How llguidance was chosen (issue 9).

Usage: python scripts/compare_grammar_backends.py llg|xgr
(xgr needs `pip install xgrammar`, which is not a dependency: it pulls triton.)"""

import json
import random
import sys
import time

import torch
from textgen.service.models.embedded import ensure_embedded
from transformers import AutoTokenizer

path = ensure_embedded()
tok = AutoTokenizer.from_pretrained(path)
VOCAB = 49152
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome"]},
            "temp": {"type": "number"},
        },
        "required": ["city"],
    },
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 5},
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string"}},
            "ok": {"type": "boolean"},
        },
        "required": ["tags", "ok"],
    },
] * 8
STEPS = 40


def walk(fill, consume, n, rng):
    """n matchers, STEPS steps; returns seconds spent in fill (mask computation)."""
    spent = 0.0
    for _ in range(STEPS):
        t = time.perf_counter()
        masks = fill()
        spent += time.perf_counter() - t
        toks = []
        for i in range(n):
            allowed = masks[i].nonzero().flatten().tolist()
            toks.append(rng.choice(allowed))
        consume(toks)
    return spent


rng = random.Random(0)
which = sys.argv[1]
if which == "llg":
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB)
    t_tok = time.perf_counter() - t
    t = time.perf_counter()
    grams = [llguidance.LLMatcher.grammar_from_json_schema(s) for s in SCHEMAS[:4]]
    ms = [llguidance.LLMatcher(lltok, g) for g in grams]
    t_compile = (time.perf_counter() - t) / 4
    t = time.perf_counter()
    matchers = [llguidance.LLMatcher(lltok, grams[i % 4]) for i in range(32)]
    t_new = (time.perf_counter() - t) / 32
    ex = llguidance.LLExecutor(num_threads=1)
    bm = lt.allocate_token_bitmask(32, VOCAB)

    def fill():
        lt.fill_next_token_bitmask_par(ex, [(m, i) for i, m in enumerate(matchers)], bm)
        logits = torch.zeros(32, VOCAB)
        lt.apply_token_bitmask_inplace(logits, bm)
        return logits == 0

    def consume(toks):
        for m, tk in zip(matchers, toks):
            assert m.consume_token(tk), m.get_error()

    fill()  # compile the torch kernel once
    spent = walk(fill, consume, 32, rng)
else:
    import xgrammar as xgr

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB)
    comp = xgr.GrammarCompiler(info)
    t_tok = time.perf_counter() - t
    t = time.perf_counter()
    compiled = [comp.compile_json_schema(json.dumps(s)) for s in SCHEMAS[:4]]
    t_compile = (time.perf_counter() - t) / 4
    t = time.perf_counter()
    matchers = [xgr.GrammarMatcher(compiled[i % 4]) for i in range(32)]
    t_new = (time.perf_counter() - t) / 32
    bm = xgr.allocate_token_bitmask(32, VOCAB)

    def fill():
        for i, m in enumerate(matchers):
            if not m.is_terminated():
                m.fill_next_token_bitmask(bm, i)
        logits = torch.zeros(32, VOCAB)
        xgr.apply_token_bitmask_inplace(logits, bm)
        return logits == 0

    def consume(toks):
        for m, tk in zip(matchers, toks):
            if m.is_terminated():
                continue
            assert m.accept_token(tk)

    fill()
    spent = walk(fill, consume, 32, rng)
print(
    f"{which}: tokenizer setup {t_tok * 1000:.0f} ms, "
    f"compile/schema {t_compile * 1000:.1f} ms, "
    f"new matcher {t_new * 1000:.2f} ms, "
    f"mask step b32 {spent / STEPS * 1000:.2f} ms"
)
