"""Whether two models share a tokenizer, from their tokenizer files: the settings' checks
compare a draft model's (`--speculate-model`) with the model's before either loads, and
the draft model's loader compares the loaded tokenizers by the same rule."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path


def file_vocab(path: Path) -> dict[str, int] | None:
    """A tokenizer.json's token -> id map, added tokens included; None when the file is
    not one (a sentencepiece-only tokenizer has none)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        vocab = dict(data["model"]["vocab"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not all(isinstance(i, int) for i in vocab.values()):
        return None  # a unigram model's vocab is [token, score] pairs, ids by position
    for added in data.get("added_tokens") or []:
        vocab[added["content"]] = added["id"]
    return vocab


def vocab_mismatch(target: Mapping[str, int], draft: Mapping[str, int]) -> str | None:
    """How the draft's vocabulary differs from the target's, or None: its first differing
    id (the same words for the same files, run after run)."""
    if target == draft:
        return None
    by_id = {i: t for t, i in target.items()}
    draft_by_id = {i: t for t, i in draft.items()}
    differing = sorted(
        i for i in by_id.keys() | draft_by_id.keys() if by_id.get(i) != draft_by_id.get(i)
    )
    first = differing[0]
    return (
        f"its tokenizer differs from the model's ({len(draft)} vs {len(target)} tokens; id "
        f"{first} is {draft_by_id.get(first)!r} there, {by_id.get(first)!r} here): a draft "
        "model must share the model's tokenizer"
    )
