"""Incremental detokenization: the streamed deltas add up to the full decode (in the
prompt's context) and never contain a broken character, for byte-level BPE and for
sentencepiece-style byte fallback, on emoji, CJK and accented text. Stop strings match
across tokens."""

from __future__ import annotations

import pytest
from support.tiny_model import build_tokenizer
from textgen.service.engine.detokenizer import IncrementalDetokenizer, decode_output
from textgen.service.engine.stopping import StopSequenceMatcher
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

TEXTS = [
    "Hello, world!",
    "emoji 🎉🚀👩‍👩‍👧 and more 🤗",
    "日本語のテキスト、中文文本，한국어",
    "accents: café, naïve, Ångström, Ærøskøbing",
    "mixed 🎉 中文 café\nnew line\ttab",
]


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-style tokenizer: sentencepiece BPE over a small vocabulary, with every
    byte as a <0xNN> token to fall back on, so rare characters split into bytes."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in [
        "▁",
        "e",
        "l",
        "o",
        "H",
        ",",
        "!",
        "w",
        "r",
        "d",
        "▁w",
        "or",
        "ld",
        "a",
        "c",
        "f",
        "é",
    ]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[("▁", "w"), ("o", "r"), ("l", "d")],
            byte_fallback=True,
            unk_token="<unk>",
        )
    )
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module", params=["byte-level BPE", "byte fallback"])
def tokenizer(request):
    return build_tokenizer() if request.param == "byte-level BPE" else byte_fallback_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_stream_adds_up_to_the_full_decode(tokenizer, text):
    prompt = tokenizer("Answer:", add_special_tokens=False)["input_ids"]
    output = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(output) > len(text) // 4  # the text really is split into many tokens
    detok = IncrementalDetokenizer.for_prompt(tokenizer, len(prompt))
    ids = list(prompt)
    deltas = []
    for token in output:
        ids.append(token)
        deltas.append(detok.step(ids))
    assert "".join(deltas) == decode_output(tokenizer, ids, len(prompt))
    # in context the text is the plain decode, but for the leading space that
    # sentencepiece drops from a sequence decoded on its own
    assert "".join(deltas).lstrip(" ") == tokenizer.decode(output).lstrip(" ")
    assert all("\ufffd" not in d for d in deltas)  # a partial character is held, not shown


def test_stop_sequence_across_token_boundaries():
    matcher = StopSequenceMatcher(("STOP", "中文"))
    assert [matcher.feed(t) for t in ["ab", "cS", "TO"]] == [None, None, None]
    assert matcher.feed("P!") == "STOP"
    matcher = StopSequenceMatcher(("中文",))
    assert matcher.feed("x中") is None and matcher.feed("文y") == "中文"
