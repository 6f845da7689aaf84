"""Resolve and load the served model.

`resolve_model` turns --model-id into a local Hugging Face folder (the embedded
SmolLM2 GGUF converted once, a local folder, or a Hub snapshot); `load_model` then
loads it on the chosen device and dtype, quantizing its weights when asked (quantize.py).
Nothing here reads the environment at import time.
"""

from .embedded import DEFAULT_MODEL_ID, default_cache_root, ensure_embedded, locate_gguf
from .errors import EmbeddedModelError, ModelError, ModelResolutionError
from .hub import ResolvedModel, hub_cache_dir, resolve_model
from .loader import LoadedModel, load_model, select_device, select_dtype
from .quantize import QuantizationError

__all__ = [
    "DEFAULT_MODEL_ID",
    "EmbeddedModelError",
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
