"""The layers of a hybrid or state-space model that keep a fixed-size state per sequence
instead of a growing KV cache: Gated DeltaNet (Qwen3-Next, Qwen3.5), Mamba-2 (Granite 4's
hybrid, Nemotron-H, Falcon-H1, Bamba), Mamba-1 (Jamba, Mamba, Falcon-Mamba), short
convolutions (LFM2).

transformers' code for every one of them keeps its state through one cache interface
(`cache_utils.LinearAttentionLayer`): `get_conv_state` / `get_recurrent_state` to read it,
`update_conv_state` / `update_recurrent_state` to store it, `is_recording_past`. So a
state layer is found by that (its class's source calls `update_conv_state`), its state's
shape is what it stores (`probe_states`: one token through it), and the engine serves it
by handing it a cache of its own over the state pool's slots (engine/state_pool.py): the
family's own code runs unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from dataclasses import dataclass

import torch

# what a state layer's forward calls on its cache (transformers' LinearAttentionLayer)
STATE_CALL = "update_conv_state"


@dataclass(frozen=True)
class StateShape:
    """One layer's state per sequence: a convolution window and, unless the layer is a
    plain short convolution (LFM2), a recurrent state; each `(shape, dtype)` without the
    batch dimension, as transformers stores them."""

    conv: tuple[tuple[int, ...], torch.dtype] | None
    recurrent: tuple[tuple[int, ...], torch.dtype] | None

    @property
    def nbytes(self) -> int:
        return sum(
            _numel(state[0]) * state[1].itemsize
            for state in (self.conv, self.recurrent)
            if state is not None
        )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@functools.cache
def is_state_layer_class(cls: type) -> bool:
    """Whether `cls`'s code keeps a per-sequence state through the cache interface."""
    if not issubclass(cls, torch.nn.Module) or cls.__module__.startswith("torch."):
        return False
    try:
        return STATE_CALL in inspect.getsource(cls)
    except (OSError, TypeError):
        return False


@functools.cache
def continues_chunks(cls: type) -> bool:
    """Whether the layer's multi-token form starts from a cached state (a prefill chunk
    after the first). Mamba-1's (Jamba, Mamba, Falcon-Mamba) always starts from zero: a
    later chunk of it runs token by token, through its one-token form. A convolution with
    no recurrent state (LFM2) continues through its cached window."""
    source = inspect.getsource(cls)
    return "update_recurrent_state" not in source or "initial_state" in source


def state_layers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The model's state layers by their `layer_idx`, in order."""
    found = {
        module.layer_idx: module
        for module in model.modules()
        if hasattr(module, "layer_idx") and is_state_layer_class(type(module))
    }
    return dict(sorted(found.items()))


def has_state_layers(model: torch.nn.Module) -> bool:
    return bool(state_layers(model))


def attention_layer_count(model: torch.nn.Module) -> int:
    """The attention layers of a hybrid model (its KV pool's layers): its attention
    modules, or where one module is shared by several layers (Zamba's, whose layer_idx is
    None or -1: each hybrid layer passes its own), the layers running it."""
    modules = [
        module
        for module in model.modules()
        if hasattr(module, "layer_idx")
        and "Attention" in type(module).__name__
        and not is_state_layer_class(type(module))
    ]
    if any(module.layer_idx in (None, -1) for module in modules):
        text = model.config.get_text_config()
        kinds = getattr(text, "layers_block_type", None) or getattr(text, "layer_types", [])
        return sum(1 for kind in kinds if kind == "hybrid")
    return len(modules)


class _Recorder:
    """A cache that records what a state layer stores: its shapes and dtypes."""

    def __init__(self) -> None:
        self.conv = self.recurrent = None

    def get_conv_state(self, layer_idx, state_idx=0):
        return None

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return None

    def is_recording_past(self, layer_idx=None) -> bool:
        return False

    def update_conv_state(self, states, layer_idx=None, conv_kernel_size=None, **kwargs):
        width = conv_kernel_size or states.shape[-1]
        self.conv = ((*states.shape[1:-1], width), states.dtype)
        if states.shape[-1] < width:
            states = torch.nn.functional.pad(states, (width - states.shape[-1], 0))
        return states

    def update_recurrent_state(self, states, layer_idx=None, **kwargs):
        self.recurrent = (tuple(states.shape[1:]), states.dtype)
        raise _Recorded  # the rest of the layer (its output projection) is not needed


class _Recorded(Exception):
    """The recurrent state is stored last: the probe stops the layer there. A sharded
    layer's output projection all-reduces, which a probe on one rank must never reach."""


@torch.inference_mode()
def probe_states(model: torch.nn.Module) -> dict[int, StateShape]:
    """Each state layer's state per sequence, from one token run through the layer alone
    (its weights on any device, `meta` included: only shapes matter), up to where it
    stores its recurrent state."""
    hidden = model.config.get_text_config().hidden_size
    param = next(model.parameters())
    shapes = {}
    for layer_idx, layer in state_layers(model).items():
        recorder = _Recorder()
        x = torch.zeros(1, 1, hidden, dtype=param.dtype, device=param.device)
        with contextlib.suppress(_Recorded):
            _original_forward(layer)(x, cache=recorder)
        shapes[layer_idx] = StateShape(recorder.conv, recorder.recurrent)
    return shapes


def state_bytes_per_sequence(shapes: dict[int, StateShape]) -> int:
    return sum(shape.nbytes for shape in shapes.values())


ORIGINAL_FORWARD = "_textgen_state_forward"


def _original_forward(layer: torch.nn.Module):
    """The layer's own forward (engine/state_pool.py installs one of ours over it)."""
    return getattr(layer, ORIGINAL_FORWARD, layer.forward)


def state_kernels(model: torch.nn.Module) -> str:
    """What the state layers' kernel functions run: "torch" (transformers' reference
    code) and/or the packages transformers found for them when it imported the family
    (causal_conv1d, mamba_ssm, fla), e.g. "causal_conv1d, torch"."""
    found = set()
    for cls in {type(layer) for layer in state_layers(model).values()}:
        names = inspect.unwrap(cls.forward).__code__.co_names
        functions = vars(sys.modules[cls.__module__])
        for name in names:
            choice = _kernel_choice(functions.get(name))
            if choice is not None:
                found.add(choice)
    return ", ".join(sorted(found)) or "torch"


def _kernel_choice(function) -> str | None:
    """For transformers' kernel-with-fallback wrapper (`use_kernel_func_from_hub_with_
    fallback`): "torch", or the package its implementation comes from; None otherwise."""
    if not inspect.isfunction(function):
        return None
    names = inspect.getclosurevars(function).nonlocals
    if "implementation" not in names or "torch_function" not in names:
        return None
    implementation = names["implementation"]
    if implementation is names["torch_function"]:
        return "torch"
    return implementation.__module__.split(".")[0]
