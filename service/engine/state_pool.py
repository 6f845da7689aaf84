"""The state pool: beside the paged KV cache, the fixed-size state of a hybrid model's
state layers (models/state_layers.py), one slot per running sequence.

Each state layer has a tensor per kind of state, `[num_slots, *shape]` (its convolution
window; its recurrent state, unless it is a plain convolution), preallocated at start-up
from `probe_states`, zero-filled, in the dtypes transformers keeps them in. The scheduler
hands a sequence a slot when it is admitted and takes it back when it finishes or is
preempted (state_slots.py); a preempted sequence recomputes its state with its K/V.

A forward is one flattened batch (`[1, T]` tokens of many sequences): the attention layers
read the paged pool per sequence through their metadata, and a state layer must likewise
advance each sequence's own state. `install` puts a forward of ours on each state layer
that splits the step's tokens into `StateGroup`s (laid out once per step by `StateStep`):
- the decodes, all at once: `[b, 1, H]`, their states gathered from their slots;
- each prefill chunk alone, `[1, q, H]`: one that starts its sequence with no state (the
  layer's own prefill form, as `generate` runs it), a later one from its slot's state. A
  layer whose multi-token form can't start from a state (Mamba-1's) runs a later chunk
  token by token through its one-token form.
For each group the layer's own forward runs with `SlotStates`, a cache that presents the
group's gathered states through transformers' cache interface and keeps what the layer
stores; the group's states then go back to their slots. LoRA adapters on the layer's
projections read the group's own rows of the step's LoRA layout (`LoraStep.within`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models.lora_layers import LoraStep, bound_lora, bound_step
from ..models.state_layers import ORIGINAL_FORWARD, StateShape, continues_chunks, state_layers


class StatePool:
    """Per state layer, `[num_slots, *shape]` tensors of its conv and recurrent states."""

    def __init__(self, shapes: dict[int, StateShape], num_slots: int, device) -> None:
        self.num_slots = num_slots
        self.shapes = shapes
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        for layer_idx, shape in shapes.items():
            if shape.conv is not None:
                self.conv[layer_idx] = _zeros(num_slots, shape.conv, device)
            if shape.recurrent is not None:
                self.recurrent[layer_idx] = _zeros(num_slots, shape.recurrent, device)

    @property
    def bytes_per_slot(self) -> int:
        return sum(shape.nbytes for shape in self.shapes.values())

    def copy_slots(self, copies: list[tuple[int, int]]) -> None:
        """Copy every layer's state of slot `source` into slot `destination`, for each
        (source, destination): a fork's own copy of its parent's state."""
        if not copies:
            return
        for pool in (*self.conv.values(), *self.recurrent.values()):
            pairs = torch.tensor(copies, dtype=torch.long, device=pool.device)
            pool.index_copy_(0, pairs[:, 1], pool.index_select(0, pairs[:, 0]))


def _zeros(num_slots: int, shape_dtype, device) -> torch.Tensor:
    shape, dtype = shape_dtype
    return torch.zeros(num_slots, *shape, dtype=dtype, device=device)


@dataclass(eq=False)
class StateGroup:
    """Tokens [start, end) of the flattened batch: one prefill chunk (`batched` False) or
    the step's decodes, one token per sequence (`batched`)."""

    start: int
    end: int
    slots: torch.Tensor  # [b] long: the sequences' slots
    fresh: bool  # the chunk starts its sequence: no state to read
    batched: bool


@dataclass(eq=False)
class StateStep:
    """How one step's tokens split into the state layers' groups, and the pool they use."""

    pool: StatePool
    groups: list[StateGroup]

    @classmethod
    def build(
        cls,
        pool: StatePool,
        query_lens: list[int],
        context_lens: list[int],
        slots: list[int],
        device,
    ) -> StateStep:
        """Entries in batch order (the runner's layout puts the decodes first)."""
        groups: list[StateGroup] = []
        decodes: list[int] = []
        start = 0

        def close_decodes(at: int) -> None:
            if decodes:
                index = torch.tensor(decodes, dtype=torch.long, device=device)
                groups.append(StateGroup(at - len(decodes), at, index, False, True))
                decodes.clear()

        for query_len, context_len, slot in zip(query_lens, context_lens, slots):
            fresh = context_len == query_len
            if query_len == 1 and not fresh:
                decodes.append(slot)
            else:
                close_decodes(start)
                index = torch.tensor([slot], dtype=torch.long, device=device)
                groups.append(StateGroup(start, start + query_len, index, fresh, False))
            start += query_len
        close_decodes(start)
        return cls(pool, groups)


_STEP: contextvars.ContextVar[StateStep | None] = contextvars.ContextVar(
    "textgen_state_step", default=None
)


@contextlib.contextmanager
def bound_state_step(step: StateStep | None) -> Iterator[None]:
    """Make `step` the state layers' layout for the forwards run inside."""
    token = _STEP.set(step)
    try:
        yield
    finally:
        _STEP.reset(token)


class SlotStates:
    """transformers' cache interface (LinearAttentionLayer's) over one group's slots of
    one layer: the states gathered (None for a fresh chunk), updated as the layer stores
    them (or in place, by its one-token kernels), then written back (`store`)."""

    def __init__(self, pool: StatePool, layer_idx: int, group: StateGroup) -> None:
        self.pool, self.layer_idx, self.slots = pool, layer_idx, group.slots
        conv, recurrent = pool.conv.get(layer_idx), pool.recurrent.get(layer_idx)
        fresh = group.fresh
        self.conv = None if fresh or conv is None else conv.index_select(0, self.slots)
        self.recurrent = (
            None if fresh or recurrent is None else recurrent.index_select(0, self.slots)
        )

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.recurrent

    def is_recording_past(self, layer_idx: int | None = None) -> bool:
        return False

    def update_conv_state(
        self, states: torch.Tensor, layer_idx: int | None = None, conv_kernel_size=None, **_
    ) -> torch.Tensor:
        """As LinearAttentionLayer: the window before the new tokens (zeros for a fresh
        chunk shorter than the kernel) followed by them; the last `width` kept."""
        width = conv_kernel_size or self.pool.conv[self.layer_idx].shape[-1]
        if self.conv is None:
            full = states
            if full.shape[-1] < width:
                full = F.pad(full, (width - full.shape[-1], 0))
        else:
            full = torch.cat([self.conv, states], dim=-1)
        self.conv = full[..., -width:]
        return full

    def update_recurrent_state(self, states: torch.Tensor, layer_idx=None, **_) -> torch.Tensor:
        self.recurrent = states
        return states

    def store(self) -> None:
        """Write the group's states back into their slots."""
        for pools, states in ((self.pool.conv, self.conv), (self.pool.recurrent, self.recurrent)):
            pool = pools.get(self.layer_idx)
            if pool is not None and states is not None:
                pool.index_copy_(0, self.slots, states.to(pool.dtype))


def install(model: torch.nn.Module) -> bool:
    """Put the group-splitting forward on each of the model's state layers; -> whether
    it has any. Outside a bound StateStep the layer's own forward runs (as in
    transformers)."""
    layers = state_layers(model)
    for layer in layers.values():
        if not hasattr(layer, ORIGINAL_FORWARD):
            setattr(layer, ORIGINAL_FORWARD, layer.forward)
            layer.forward = functools.partial(_state_layer_forward, layer)
    return bool(layers)


def _state_layer_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    step = _STEP.get()
    own = getattr(layer, ORIGINAL_FORWARD)
    if step is None:
        return own(hidden_states, *args, **kwargs)
    stepwise = not continues_chunks(type(layer))
    lora = bound_step()  # LoRA rows of the whole step: each call reads its own tokens'
    outputs = []
    for group in step.groups:
        x = hidden_states[:, group.start : group.end]
        states = SlotStates(step.pool, layer.layer_idx, group)
        if group.batched:  # [1, b, H] -> b sequences of one token
            with _lora_rows(lora, group.start, group.end):
                out = own(x.transpose(0, 1).contiguous(), cache=states)
            out = _each(out, lambda t: t.transpose(0, 1))
        elif stepwise and not group.fresh:
            tokens = range(x.shape[1])
            out = _joined([_one_token(own, x, i, states, lora, group) for i in tokens])
        else:
            with _lora_rows(lora, group.start, group.end):
                out = own(x, cache=states)
        states.store()
        outputs.append(out)
    return _joined(outputs)


def _each(out, change):
    """`change` applied to a layer's output: a tensor, or a tuple of them (ZAYA's
    projection returns its query, key and value), each `[batch, tokens, ...]`."""
    return tuple(change(t) for t in out) if isinstance(out, tuple) else change(out)


def _joined(outputs: list):
    """The groups' outputs as one, along the tokens."""
    if len(outputs) == 1:
        return outputs[0]
    if isinstance(outputs[0], tuple):
        return tuple(torch.cat(parts, dim=1) for parts in zip(*outputs, strict=True))
    return torch.cat(outputs, dim=1)


def _one_token(own, x: torch.Tensor, i: int, states: SlotStates, lora, group: StateGroup):
    with _lora_rows(lora, group.start + i, group.start + i + 1):
        return own(x[:, i : i + 1], cache=states)


def _lora_rows(lora: LoraStep | None, start: int, end: int):
    """The LoRA rows of tokens [start, end) bound, for a call on those tokens alone."""
    return bound_lora(lora.within(start, end) if lora is not None else None)
