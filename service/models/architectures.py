"""Whether the paged engine serves a model, decided from its config.json alone, before
any weight loads: the settings' checks (settings/preflight.py) refuse it in one line, and
the runner (engine/runners/model_runner.py) holds the same rules on the loaded model.

A model is served by its transformers code with our attention beneath, so what decides is
the code transformers runs for the config's `model_type`, read as text (never imported,
never run): whether its attention goes through `AttentionInterface` (transformers' own
heuristic, `PreTrainedModel._can_set_attn_implementation`, on the same source), whether
its attention keeps sinks (served, but not batch-invariant), and which kinds of layers the
config lists.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

# The layer kinds the paged KV cache holds: attention over every earlier token, or over a
# window of them. Others keep a state of their own (linear attention, Mamba, convolutions)
# or attend in chunks.
SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})

# transformers' heuristic (modeling_utils.py, `_can_set_attn_implementation`): a modelling
# file with an `*Attention*(nn.Module)` class routes attention through the interface iff
# it calls `ALL_ATTENTION_FUNCTIONS.get_interface(`.
_ATTENTION_CLASS = re.compile(r"^class \w*Attention\w*\(nn\.Module\):", re.MULTILINE)
_INTERFACE_CALL = "ALL_ATTENTION_FUNCTIONS.get_interface("
# attention sinks: a learned per-head logit in the softmax's denominator (gpt-oss)
_SINKS = re.compile(r"self\.sinks\s*=\s*nn\.Parameter")


def unserved_reason(config: dict) -> str | None:
    """Why the paged engine can't serve the model `config` (a config.json) describes, or
    None when it can, or when only the model's own code would tell (auto_map)."""
    text = config.get("text_config") or config
    model_type = text.get("model_type") or config.get("model_type")
    if not model_type or config.get("auto_map"):
        return None
    layer_types = text.get("layer_types") or []
    unsupported = sorted(set(layer_types) - SUPPORTED_LAYER_TYPES)
    if unsupported:
        return layer_types_reason(model_type, unsupported)
    source = modeling_source(model_type)
    if source is None:
        return None  # transformers has no code for it: the loader says so
    if _ATTENTION_CLASS.search(source) and _INTERFACE_CALL not in source:
        return interface_reason(model_type)
    return None


def has_sinks(config: dict) -> bool:
    """Whether the model's attention keeps sinks (gpt-oss), from its config.json."""
    text = config.get("text_config") or config
    model_type = text.get("model_type") or config.get("model_type")
    source = modeling_source(model_type) if model_type else None
    return bool(source and _SINKS.search(source))


def module_has_sinks(model) -> bool:
    """Whether a loaded model's attention keeps sinks."""
    return any(getattr(module, "sinks", None) is not None for module in model.modules())


def interface_reason(name: str) -> str:
    return (
        f"{name} does not route attention through transformers' AttentionInterface "
        "(e.g. Falcon, Bloom): the paged engine can't serve it"
    )


SINKS_NOT_INVARIANT = "attention sinks (gpt-oss) have no batch-invariant attention path"


def layer_types_reason(name: str, unsupported: list[str]) -> str:
    if unsupported == ["chunked_attention"]:
        return (
            f"{name} has layers of type {unsupported} (attention within chunks of "
            "attention_chunk_size tokens), which paged attention doesn't implement"
        )
    return f"{name} has layers of type {unsupported}, which keep state the paged cache can't hold"


def modeling_source(model_type: str) -> str | None:
    """The text of transformers' modelling file for `model_type`, or None."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    models = Path(next(iter(spec.submodule_search_locations))) / "models"
    for name in _module_names(model_type):
        path = models / name / f"modeling_{name}.py"
        if path.is_file():
            return path.read_text(encoding="utf-8")
    return None


def _module_names(model_type: str) -> list[str]:
    """The folder names transformers may keep `model_type`'s code under: its own, and,
    for a multimodal model's text part (`gemma3_text`, `llama4_text`), the family's."""
    name = model_type.replace("-", "_")
    names = [name]
    if name.endswith("_text"):
        names.append(name.removesuffix("_text"))
    return names
