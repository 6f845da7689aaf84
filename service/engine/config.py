"""How an engine runs, as one typed value: `EngineConfig`.

Everything `PagedCore` needs besides the model and the parts that hold state of their own
(grammar masks, the shard group, a draft model's proposer, LoRA slots and adapters):
limits, KV sizing and dtype, the runner strategy, speculation, the watermark. The server
builds it from its settings in one function (replica/assembly.py's `engine_config`);
tests and measuring scripts write one directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .block_manager import num_blocks_for_tokens
from .runners.compiled import CompileSettings
from .runners.cuda_graphs import GraphSettings
from .speculation import SpeculationSettings
from .watermark import DEFAULT_DELTA, DEFAULT_GAMMA


@dataclass(frozen=True)
class EngineConfig:
    # limits
    max_batch_total_tokens: int  # KV-cache budget in tokens, summed over all sequences
    max_batch_prefill_tokens: int  # prompt tokens computed per step (chunked prefill)
    max_batch_size: int  # sequences running at once
    # the KV cache
    block_size: int = 16  # tokens per KV block
    enable_prefix_caching: bool = True
    # the pool's storage dtype: an 8-bit float, upcast in attention; None: the model's
    kv_cache_dtype: torch.dtype | None = None
    # the runner strategy (runners/): at most one of cuda_graphs (CUDA) and compile (CPU)
    batch_invariant: bool = False  # a request's tokens the same whatever runs beside it (CPU)
    cuda_graphs: GraphSettings | None = None  # decode steps replayed from graphs per bucket
    compile: CompileSettings | None = None  # decode steps through torch.compile'd graphs
    custom_kernels: bool = True  # False: attention never takes textgen's Triton kernel
    # propose and verify up to `num_tokens` tokens per decoding sequence (speculation.py)
    speculation: SpeculationSettings | None = None
    # the green-list watermark of requests that ask for one (watermark.py)
    watermark_gamma: float = DEFAULT_GAMMA
    watermark_delta: float = DEFAULT_DELTA
    # every attention layer attends only this many last positions (`every_layer_window`):
    # a running sequence gives back the blocks before its window (block_manager.py).
    # None: every block of a sequence stays until it ends (any model with a full layer).
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.max_batch_total_tokens <= 0:
            raise ValueError(
                f"max_batch_total_tokens must be positive, got {self.max_batch_total_tokens}"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.cuda_graphs is not None and self.compile is not None:
            raise ValueError(
                "cuda_graphs and compile are two runner strategies (CUDA, CPU): pick one"
            )

    @property
    def num_blocks(self) -> int:
        """The KV pool's blocks per layer: ceil(max_batch_total_tokens / block_size)."""
        return num_blocks_for_tokens(self.max_batch_total_tokens, self.block_size)


# Families whose config has a `sliding_window` but no `layer_types`, and whose every layer
# applies that window (transformers passes `config.sliding_window` to each layer's
# attention). A family not named here keeps every block: releasing blocks a layer still
# reads would silently change its outputs.
EVERY_LAYER_SLIDING = frozenset({"mistral", "mixtral", "phi3", "starcoder2"})


def every_layer_window(config) -> int | None:
    """The sliding window of a model whose every attention layer slides (its text config:
    `sliding_window`, with `layer_types` all "sliding_attention" where the config lists
    them: Qwen2 with use_sliding_window and max_window_layers 0, ...; or a family of
    EVERY_LAYER_SLIDING), for EngineConfig.sliding_window. None where any layer is full or
    chunked (Gemma 2/3, gpt-oss, Llama 4) or nothing slides."""
    get_text_config = getattr(config, "get_text_config", None)
    text = get_text_config() if get_text_config is not None else config
    window = getattr(text, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    if getattr(text, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        return window if all(t == "sliding_attention" for t in layer_types) else None
    return window if getattr(text, "model_type", None) in EVERY_LAYER_SLIDING else None
