"""Whether the paged engine serves a model, decided from its config.json alone, before
any weight loads: the settings' checks (settings/preflight.py) refuse it in one line, and
the runner (engine/runners/model_runner.py) holds the same rules on the loaded model.

A model is served by its transformers code with our attention beneath, so what decides is
the code transformers runs for the config's `model_type`, read as text (never imported,
never run): whether its attention goes through `AttentionInterface` (transformers' own
heuristic, `PreTrainedModel._can_set_attn_implementation`, on the same source), whether
its attention keeps sinks (served, but not batch-invariant), which kinds of layers the
config lists, and whether layers that keep a state per sequence (Mamba, linear attention,
convolutions) keep it through transformers' cache interface (served with the state pool:
state_layers.py) or otherwise (xLSTM: refused). Families whose attention is computed
inline (Falcon, Bloom, MPT) are served through an attention adapter of ours
(attention_adapters.py).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from .attention_adapters import is_adapted, uses_alibi
from .state_layers import STATE_CALL

# The layer kinds the paged KV cache holds: attention over every earlier token, or over a
# window of them; and, where the family's adapter says the chunk size (Llama 4's), within
# chunks. Others keep a state of their own (linear attention, Mamba, convolutions).
SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
_CHUNKED_FAMILIES = frozenset({"llama4_text"})
# the kinds of a hybrid family's layers besides attention, as transformers' configs name
# them: state layers (Mamba, Gated DeltaNet, convolutions), layers holding both an
# attention and a state layer (Falcon-H1), and Nemotron-H's MLP-only and MoE-only layers
STATE_LAYER_TYPES = frozenset({"linear_attention", "conv", "mamba", "hybrid", "mlp", "moe"})


def unsupported_layer_types(model_type: str | None, layer_types) -> list[str]:
    """The kinds among `layer_types` the paged engine doesn't serve for this family."""
    served = SUPPORTED_LAYER_TYPES
    if model_type in _CHUNKED_FAMILIES:
        served = served | {"chunked_attention"}
    if model_type and keeps_state_in_cache(model_type):
        served = served | STATE_LAYER_TYPES
    return sorted(set(layer_types or []) - served)


# transformers' heuristic (modeling_utils.py, `_can_set_attn_implementation`): a modelling
# file with an `*Attention*(nn.Module)` class routes attention through the interface iff
# it calls `ALL_ATTENTION_FUNCTIONS.get_interface(`.
_ATTENTION_CLASS = re.compile(r"^class \w*Attention\w*\(nn\.Module\):", re.MULTILINE)
_INTERFACE_CALL = "ALL_ATTENTION_FUNCTIONS.get_interface("
# layers that keep a recurrent state per sequence (Mamba, linear attention, short
# convolutions, xLSTM): the names their modelling code gives that state. Pure SSMs and the
# hybrids whose configs have no `layer_types` (Jamba, Zamba, Nemotron-H, LFM2) show it here.
_RECURRENT_STATE = re.compile(r"\b(conv_states?|ssm_states?|recurrent_states?|rnn_state)\b")
# attention sinks: a learned per-head logit in the softmax's denominator (gpt-oss)
_SINKS = re.compile(r"self\.sinks\s*=\s*nn\.Parameter")


# Vision-language families served with their images (the vision tower and projector at
# prefill, engine/runners/image_encoder.py); other image-text-to-text families are refused
# until they are (issue 47). Those transformers also loads as a causal LM (Llama 4, Mllama,
# Qwen3.5) keep being served as text.
IMAGE_FAMILIES = frozenset(
    {
        "llava",
        "llava_next",
        "idefics3",
        "smolvlm",
        "gemma3",
        "mistral3",
        "paligemma",
        "qwen2_vl",
        "qwen2_5_vl",
        "qwen3_vl",
    }
)
# The families whose prompt tokens attend to each other both ways (transformers'
# token_type_ids masks at prefill), and which: each image's tokens (Gemma 3), or the whole
# prompt the processor makes, its images, bos, text and "\n" (PaliGemma's prefix-LM; the
# generated tokens are causal). The spans (engine/types.py BothWays) give the attention's
# key_limits (attention/paged.py), and one prefill chunk computes a span (scheduler.py)
BOTH_WAYS_IMAGE = "image"
BOTH_WAYS_PROMPT = "prompt"
BOTH_WAYS = {"gemma3": BOTH_WAYS_IMAGE, "paligemma": BOTH_WAYS_PROMPT}
# the position transformers gives a prompt's first token where it isn't 0 (PaliGemma's
# are 1-indexed: RoPE sees the same differences, but rounds other angles)
FIRST_POSITION = {"paligemma": 1}
# those whose processor concatenates all images' patches ([sum patches, dim]) and lists
# them per image in another input: that input's name (one row per image); the others
# give `pixel_values` a batch dim, one row per image
IMAGES_LISTED_BY = {
    "qwen2_vl": "image_grid_thw",
    "qwen2_5_vl": "image_grid_thw",
    "qwen3_vl": "image_grid_thw",
}
# those whose processor class also takes a video processor, which needs torchvision: the
# loader builds it without one (models/processors.py), for images only
IMAGES_ONLY_PROCESSORS = {
    "smolvlm": "SmolVLMProcessor",
    "qwen2_vl": "Qwen2VLProcessor",
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_vl": "Qwen3VLProcessor",
}
# those whose rotary positions are 3 rows per token from the images' grids (M-RoPE:
# engine/runners/mrope.py), not the token's index
MROPE_FAMILIES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl"})
MROPE_NO_STRATEGY = (
    "multimodal rotary positions (M-RoPE: Qwen2-VL, Qwen2.5-VL, Qwen3-VL) are laid out per step by "
    "the eager runner; the decode graphs of --cuda-graphs and --compile take token indices"
)


def has_mrope(config: dict) -> bool:
    """Whether `config` (a config.json) is a family served with M-RoPE positions."""
    return is_image_family(config) and config.get("model_type") in MROPE_FAMILIES


def images_refused_reason(model_type: str | None, vision: bool) -> str | None:
    """Why a model served as text takes no images (Llama 4, Mllama): None for a text model
    (no vision config) and for a family served with images."""
    if not vision or model_type in IMAGE_FAMILIES:
        return None
    return f"{model_type}'s images are not served yet; its text is"


def is_image_family(config: dict) -> bool:
    """Whether `config` (a config.json) is a vision-language model served with images."""
    return config.get("model_type") in IMAGE_FAMILIES and not config.get("auto_map")


def image_family_reason(model_type: str | None) -> str | None:
    """Why an image-text-to-text family that is no causal LM isn't served, or None."""
    if not model_type or model_type in IMAGE_FAMILIES:
        return None
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    if model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return None
    served = ", ".join(sorted(IMAGE_FAMILIES))
    return (
        f"{model_type} is a vision-language family textgen doesn't serve yet "
        f"(images are served for: {served})"
    )


def unserved_reason(config: dict) -> str | None:
    """Why the paged engine can't serve the model `config` (a config.json) describes, or
    None when it can, or when only the model's own code would tell (auto_map)."""
    if not config.get("auto_map") and (reason := image_family_reason(config.get("model_type"))):
        return reason
    text = config.get("text_config") or config
    model_type = text.get("model_type") or config.get("model_type")
    if not model_type or config.get("auto_map"):
        return None
    unsupported = unsupported_layer_types(model_type, text.get("layer_types"))
    if unsupported:
        return layer_types_reason(model_type, unsupported)
    if is_adapted(model_type):
        return None
    source = modeling_source(model_type)
    if source is None:
        return None  # transformers has no code for it: the loader says so
    if keeps_recurrent_state(model_type) and not keeps_state_in_cache(model_type):
        return state_reason(model_type)
    if _ATTENTION_CLASS.search(source) and _INTERFACE_CALL not in source:
        return interface_reason(model_type)
    return None


def sdpa_only_terms(config: dict) -> str | None:
    """What the model's attention adds to its scores that only the SDPA path computes
    (attention sinks, ALiBi), from its config.json; None: nothing."""
    text = config.get("text_config") or config
    model_type = text.get("model_type") or config.get("model_type")
    if model_type in ("bloom", "mpt") or (model_type == "falcon" and text.get("alibi")):
        return ALIBI
    source = modeling_source(model_type) if model_type else None
    return SINKS if source and _SINKS.search(source) else None


def module_sdpa_only_terms(model) -> str | None:
    """sdpa_only_terms() of a loaded model."""
    if any(getattr(module, "sinks", None) is not None for module in model.modules()):
        return SINKS
    if uses_alibi(model.config):
        return ALIBI
    return None


SINKS = "attention sinks (gpt-oss)"
ALIBI = "ALiBi (Bloom, MPT, Falcon-RW)"


def not_invariant_reason(terms: str) -> str:
    return f"{terms}: no batch-invariant attention path"


def no_graphs_reason(terms: str) -> str:
    return f"{terms} run on the SDPA path, which CUDA graphs don't replay"


def module_sdpa_only_layers(model) -> str | None:
    """A loaded model's layer kind that only the SDPA path attends (chunked attention,
    Llama 4's), or None; unlike sinks and ALiBi it has a batch-invariant path."""
    layer_types = getattr(model.config.get_text_config(), "layer_types", None) or []
    return CHUNKED if "chunked_attention" in layer_types else None


CHUNKED = "chunked local attention (Llama 4)"


def interface_reason(name: str) -> str:
    return (
        f"{name} does not route attention through transformers' AttentionInterface "
        "(e.g. GPT-Neo, XGLM): the paged engine can't serve it"
    )


def keeps_recurrent_state(model_type: str) -> bool:
    """Whether transformers' code for `model_type` keeps a recurrent state per sequence."""
    source = modeling_source(model_type)
    return bool(source and _RECURRENT_STATE.search(source))


def has_attention(model_type: str) -> bool:
    """Whether transformers' code for `model_type` has an attention class (a pure
    state-space model, Mamba's, has none)."""
    source = modeling_source(model_type)
    return bool(source and re.search(r"^class \w*Attention\w*\(", source, re.MULTILINE))


def has_state_layers(config: dict) -> bool:
    """Whether the model `config` (a config.json) describes has layers that keep a state
    per sequence and are served with the state pool (a hybrid or state-space model)."""
    text = config.get("text_config") or config
    model_type = text.get("model_type") or config.get("model_type")
    return bool(model_type and not config.get("auto_map") and keeps_state_in_cache(model_type))


def keeps_state_in_cache(model_type: str) -> bool:
    """Whether transformers' code for `model_type` keeps its layers' state through the
    cache interface the state pool serves (`update_conv_state`: state_layers.py)."""
    source = modeling_source(model_type)
    return bool(source and STATE_CALL in source)


def state_reason(name: str) -> str:
    return (
        f"{name} has layers that keep a recurrent state per sequence outside transformers' "
        "cache interface (e.g. xLSTM), which the state pool can't hold"
    )


def layer_types_reason(name: str, unsupported: list[str]) -> str:
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
