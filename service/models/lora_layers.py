"""The served model's LoRA slots: every linear layer of its decoder wrapped in a
`LoraLinear` that adds, to each row of the flattened batch, the delta of the adapter that
row's sequence asked for. A vision-language model's language model only: its vision tower
and projector stay plain (an image is encoded once for whichever requests send it).

Each wrapped layer holds `num_slots` adapters' weights stacked and zero-padded to
`max_rank`: A as `[slots, rank, in]`, scaling * B transposed as `[slots, rank, out]`. The
engine (engine/adapters.py) decides which adapter sits in which slot and writes it there
(`LoraLayers.write`); a step says which slot each token reads (`LoraStep`, bound around the
forward with `bound_lora`).

How a layer computes the deltas, Punica's two semantics:
- SGMV on CPU (and the reference): the rows of one adapter together, two small matmuls per
  adapter in the step at its own rank (`segment_delta`). A compiled decode step runs it as
  one opaque op (`textgen::lora_delta`), as it does the paged attention, so the graph is
  the same whatever adapters a step mixes.
- BGMV on CUDA: one Triton launch per layer and phase gathers each row's slot in place
  (lora_triton.py), over static buffers a CUDA graph captures.

With `--num-shard`, A and B are sliced as the layer's weight is (sharding.py's
`lora_slices`): a column-parallel layer's B keeps this rank's output rows, a row-parallel
layer's A this rank's input columns (its partial delta is summed by the layer's own
all-reduce, which wraps this module).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .lora import AdapterError

Rows = slice | torch.Tensor  # a run of the flattened batch's tokens, or their indices


class LoraLinear(torch.nn.Module):
    """A linear layer plus the LoRA delta of each row's adapter slot."""

    def __init__(
        self,
        base: torch.nn.Module,
        index: int,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.index = index  # its place in LoraLayers.by_index
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.register_buffer(
            "a", torch.zeros(num_slots, max_rank, self.in_features, dtype=dtype, device=device)
        )
        self.register_buffer(
            "b", torch.zeros(num_slots, max_rank, self.out_features, dtype=dtype, device=device)
        )
        self.ranks = [0] * num_slots  # the rank of each slot's adapter here (0: not adapted)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if torch.compiler.is_compiling():  # a compiled decode step: the op reads the step
            return y + lora_delta_op(x, self.index, self.out_features)
        step = _bound_step.get()
        if step is None:
            return y
        if step.token_slots is not None:
            from .lora_triton import bgmv_delta

            return bgmv_delta(self, x, y, step.token_slots)
        return segment_delta(self, x, y, step.segments)

    def write(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Put one adapter's (A, scaled B transposed) in `slot` (None: not adapted here)."""
        with torch.no_grad():
            self.a[slot].zero_()
            self.b[slot].zero_()
            if weights is None:
                self.ranks[slot] = 0
                return
            a, b = weights
            rank = a.shape[0]
            self.a[slot, :rank].copy_(a)
            self.b[slot, :rank].copy_(b)
            self.ranks[slot] = rank

    def extra_repr(self) -> str:
        slots, rank, _ = self.a.shape
        return f"slots={slots}, max_rank={rank}"


class LoraLayers:
    """Every LoraLinear of one model, and what each slot holds."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        slices: dict[str, tuple[slice | None, slice | None]] | None = None,
        scope: str | None = None,
    ) -> None:
        """Wrap `model`'s decoder linear layers (all but lm_head, and those whose weight
        the model's code reads instead of calling the layer: Mamba-1's dt_proj, which a
        wrapper would hide and whose delta would never apply). `slices`: per layer, the
        (output rows, input columns) of the full weight this shard holds (sharding.py).
        `scope`: the module whose layers alone are wrapped (a vision-language model's
        language model, `model.language_model`: its vision tower and projector encode an
        image once for every request that sends it, whatever adapter each asked for)."""
        if num_slots <= 0 or max_rank <= 0:
            raise ValueError("LoRA slots need num_slots > 0 and max_rank > 0")
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.dtype = dtype
        self.slices = slices or {}
        self.scope = scope
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        targets = [
            (n, m)
            for n, m in model.named_modules()
            if _is_linear(m)
            and m is not head
            and self.in_scope(n)
            and not _weight_read_directly(model, n)
        ]
        self.layers: dict[str, LoraLinear] = {}
        for index, (name, base) in enumerate(targets):
            layer = LoraLinear(base, index, num_slots, max_rank, dtype, device)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, layer)
            self.layers[name] = layer
        self.by_index = list(self.layers.values())
        self.slot_uids = [0] * num_slots  # the adapter in each slot (its registry uid; 0: none)

    def in_scope(self, name: str) -> bool:
        """Whether layer `name` is one the slots may wrap (under `scope`, where one is set)."""
        return self.scope is None or name.startswith(f"{self.scope}.")

    def prepare(
        self, name: str, a: torch.Tensor, b: torch.Tensor, scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """peft's lora_A `[r, in]` and lora_B `[out, r]` of layer `name` -> (A, scaling * B
        transposed), this shard's slice, in the slots' dtype and device; AdapterError when
        they don't fit the layer."""
        layer = self.layers[name]
        rows, cols = self.slices.get(name, (None, None))
        if rows is not None:
            b = b[rows]
        if cols is not None:
            a = a[:, cols]
        if a.shape[1] != layer.in_features or b.shape[0] != layer.out_features:
            raise AdapterError(
                f"{name}: its LoRA weights map {a.shape[1]} -> {b.shape[0]} features and the "
                f"served layer {layer.in_features} -> {layer.out_features}"
            )
        device = layer.a.device
        scaled = (b.float() * scaling).t().to(self.dtype)
        return a.to(self.dtype).contiguous().to(device), scaled.contiguous().to(device)

    def write(self, slot: int, adapter) -> None:
        """Put `adapter` (models/lora.py's LoraAdapter) in `slot`, over what was there."""
        for name, layer in self.layers.items():
            layer.write(slot, adapter.layers.get(name))
        self.slot_uids[slot] = adapter.uid


def _weight_read_directly(model: torch.nn.Module, name: str) -> bool:
    """Whether the code of the layer's parent reads `self.<layer>.weight` itself."""
    parent, _, child = name.rpartition(".")
    owner = type(model.get_submodule(parent) if parent else model)
    return f"self.{child}.weight" in _class_source(owner)


@functools.cache
def _class_source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def _is_linear(module: torch.nn.Module) -> bool:
    from .quantize import QuantizedLinear

    return type(module) is torch.nn.Linear or isinstance(module, QuantizedLinear)


# one step's rows ----------------------------------------------------------------------


@dataclass(frozen=True)
class LoraStep:
    """Which slot each token of a step reads.

    segments: (slot, rows) for each slot the step uses, rows a slice of the flattened batch
    when they are consecutive (SGMV). token_slots: `[T]` integers on the device, -1 for
    tokens of the base model, for the Triton kernels (BGMV; then segments are not read);
    None on CPU. A CUDA graph binds a step over its own static token_slots."""

    segments: tuple[tuple[int, Rows], ...]
    token_slots: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        entry_slots: list[int],
        query_lens: list[int],
        device: torch.device,
        kernel: bool = False,
    ) -> LoraStep | None:
        """From each entry's slot (-1: none) and its tokens this step; None when no entry
        reads a slot. kernel: also the per-token tensor of the Triton path."""
        if not entry_slots:  # laid out without adapters
            return None
        runs: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for slot, n in zip(entry_slots, query_lens, strict=True):
            if slot >= 0:
                spans = runs.setdefault(slot, [])
                if spans and spans[-1][1] == start:
                    spans[-1] = (spans[-1][0], start + n)
                else:
                    spans.append((start, start + n))
            start += n
        if not runs:
            return None
        segments = tuple((slot, _rows(spans, device)) for slot, spans in runs.items())
        token_slots = None
        if kernel:
            counts = torch.tensor(query_lens, device="cpu")
            slots = torch.tensor(entry_slots, dtype=torch.int32, device="cpu")
            token_slots = slots.repeat_interleave(counts).to(device)
        return cls(segments, token_slots)

    def within(self, start: int, end: int) -> LoraStep | None:
        """The step of tokens [start, end) alone, as a layer run on just those rows (a
        hybrid model's state layer, one group of sequences at a time) reads it."""
        segments = []
        for slot, rows in self.segments:
            if isinstance(rows, slice):
                first, last = max(rows.start, start), min(rows.stop, end)
                if first < last:
                    segments.append((slot, slice(first - start, last - start)))
                continue
            picked = rows[(rows >= start) & (rows < end)] - start
            if picked.numel():
                segments.append((slot, picked))
        token_slots = None if self.token_slots is None else self.token_slots[start:end]
        if not segments and (token_slots is None or not bool((token_slots >= 0).any())):
            return None
        return LoraStep(tuple(segments), token_slots)


def bound_step() -> LoraStep | None:
    """The LoRA step the running forward reads (None: none)."""
    return _bound_step.get()


def _rows(spans: list[tuple[int, int]], device: torch.device) -> Rows:
    if len(spans) == 1:
        return slice(*spans[0])
    return torch.cat([torch.arange(a, b) for a, b in spans]).to(device)


_bound_step: contextvars.ContextVar[LoraStep | None] = contextvars.ContextVar(
    "textgen_lora_step", default=None
)


@contextlib.contextmanager
def bound_lora(step: LoraStep | None) -> Iterator[None]:
    """The step's LoRA rows for every LoraLinear run inside the block (None: none)."""
    token = _bound_step.set(step)
    try:
        yield
    finally:
        _bound_step.reset(token)


# SGMV in torch --------------------------------------------------------------------------


def segment_delta(
    layer: LoraLinear, x: torch.Tensor, y: torch.Tensor, segments: tuple[tuple[int, Rows], ...]
) -> torch.Tensor:
    """y plus, for each slot's rows, their delta at the slot's own rank (in place)."""
    x2 = x.reshape(-1, layer.in_features)
    y2 = y.view(-1, layer.out_features)
    for slot, rows in segments:
        rank = layer.ranks[slot]
        if rank == 0:  # that adapter doesn't adapt this layer
            continue
        delta = F.linear(x2[rows], layer.a[slot, :rank]) @ layer.b[slot, :rank]
        if isinstance(rows, slice):
            y2[rows] += delta
        else:
            y2.index_add_(0, rows, delta)
    return y


# The bound step's layers, for the op below (set by the runner that owns them).
_layers: list[LoraLinear] = []


def register_layers(layers: LoraLayers) -> None:
    """Make `layers` the ones textgen::lora_delta reads (one served model per process)."""
    _layers[:] = layers.by_index


@torch.library.custom_op("textgen::lora_delta", mutates_args=())
def lora_delta_op(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    """The LoRA delta of layer `index` for the step bound by bound_lora() (zeros: none)."""
    out = x.new_zeros(*x.shape[:-1], out_features)
    step = _bound_step.get()
    if step is not None and step.segments:
        segment_delta(_layers[index], x, out, step.segments)
    return out


@lora_delta_op.register_fake
def _(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)
