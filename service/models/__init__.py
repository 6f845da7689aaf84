"""Resolve and load the served model.

`resolve_model` turns --model-id into a local Hugging Face folder (the embedded
SmolLM2 GGUF converted once, a local folder, or a Hub snapshot); `load_model` then
loads it on the chosen device and dtype, quantizing its weights when asked (quantize.py).
Nothing here reads the environment at import time, and importing the package imports
no torch: the loader and the quantizer (which need it) are imported when first named,
so the settings' checks (settings/preflight.py) can read a model's config in a fraction of a second.
"""

import importlib

from .embedded import DEFAULT_MODEL_ID, default_cache_root, ensure_embedded, locate_gguf
from .errors import EmbeddedModelError, ModelError, ModelResolutionError
from .hub import ResolvedModel, hub_cache_dir, resolve_model

_LAZY = {
    "LoadedModel": "loader",
    "LoadOptions": "loader",
    "load_model": "loader",
    "select_device": "loader",
    "select_dtype": "loader",
    "QuantizationError": "quantize",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_MODEL_ID",
    "EmbeddedModelError",
    "LoadOptions",
    "LoadedModel",
    "ModelError",
    "ModelResolutionError",
    "QuantizationError",
    "ResolvedModel",
    "default_cache_root",
    "ensure_embedded",
    "hub_cache_dir",
    "load_model",
    "locate_gguf",
    "resolve_model",
    "select_device",
    "select_dtype",
]
