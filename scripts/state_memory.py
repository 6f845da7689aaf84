"""What a hybrid or state-space model's sequences take in memory, for the published shape of
each family served: the state one sequence holds in the state pool (engine/state_pool.py),
the KV cache one token takes in the paged pool, their sum at 1k and 8k tokens, and what one
state snapshot per 16-token KV block would cost (why prefix caching is off for hybrids).

Each model is built on the meta device (no weights, no memory) from transformers' config
class with the published values below, in bfloat16 (the serving dtype on a GPU), and
measured with the server's own functions: `probe_states` and `state_bytes_per_sequence`
(service/models/state_layers.py), `attention_layer_count`, `kv_bytes_per_token`
(service/replica/kv_sizing.py). No size comes from a formula of ours: the sums and products
below only combine those measurements (and "if all attention" scales the measured KV per
token by the layers' count).

    python scripts/state_memory.py          # print the tables
    python scripts/state_memory.py --write  # rewrite docs/hybrid-models.md's generated section
"""

from __future__ import annotations

import argparse
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from textgen.service.models.state_layers import (
    StateShape,
    attention_layer_count,
    is_state_layer_class,
    probe_states,
    state_bytes_per_sequence,
)
from textgen.service.replica.kv_sizing import KV_BLOCK_SIZE, kv_bytes_per_token
from textgen.service.settings.table import Settings
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "hybrid-models.md"
BEGIN, END = "<!-- state memory table: begin -->\n", "<!-- state memory table: end -->\n"
DTYPE = torch.bfloat16
CONTEXTS = (1024, 8192)
SLOTS = Settings().max_batch_size  # the state pool's slots by default
# The vocabulary changes neither the state nor the KV cache: a small one keeps building cheap.
VOCAB = 1024


@dataclass(frozen=True)
class Published:
    """A released model's shape: its model_type and the config options that set the sizes of
    its state and its KV cache (the rest, MLPs and experts included, left at the config
    class's defaults); `source`: where the values come from."""

    model_type: str
    options: dict
    source: str


# Granite 4.0 H-Tiny's four attention layers (5, 15, 25, 35 of 40), taken for H-Small's:
# where they sit changes no size, how many does.
GRANITE_H_LAYERS = ["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)]

MODELS: dict[str, Published] = {
    "Qwen/Qwen3-Next-80B-A3B-Instruct": Published(
        "qwen3_next",
        {
            "hidden_size": 2048,
            "num_hidden_layers": 48,
            "full_attention_interval": 4,  # 12 attention layers, 36 Gated DeltaNet
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
        },
        "its config.json; transformers' defaults for the family are these values",
    ),
    "Qwen/Qwen3.5-27B": Published(
        "qwen3_5_text",
        {
            "hidden_size": 5120,
            "num_hidden_layers": 64,
            "full_attention_interval": 4,  # 16 attention layers, 48 Gated DeltaNet
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 48,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
        },
        "its config.json's text_config (transformers' defaults are a smaller shape, which its "
        "docstring calls Qwen3.5-9B style)",
    ),
    "ibm-granite/granite-4.0-h-small": Published(
        "granitemoehybrid",
        {
            "hidden_size": 4096,
            "num_hidden_layers": 40,
            "layer_types": GRANITE_H_LAYERS,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "mamba_n_heads": 128,
            "mamba_d_head": 64,
            "mamba_n_groups": 1,
            "mamba_d_state": 128,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
        },
        "its config.json; not confirmed here: the Mamba heads (128 × 64, 1 group) and the "
        "attention layers' positions (H-Tiny's 5, 15, 25, 35; positions change no size)",
    ),
    "nvidia/NVIDIA-Nemotron-Nano-9B-v2": Published(
        "nemotron_h",
        {
            "hidden_size": 4480,
            # M: Mamba-2, *: attention, -: MLP alone (27, 4 and 25 layers)
            "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
            "num_attention_heads": 40,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "mamba_num_heads": 128,
            "mamba_head_dim": 80,
            "n_groups": 8,
            "ssm_state_size": 128,
            "conv_kernel": 4,
        },
        "its config.json (transformers' defaults are a 4-layer pattern)",
    ),
    "ai21labs/Jamba-v0.1": Published(
        "jamba",
        {
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "attn_layer_period": 8,  # attention at 4, 12, 20, 28; Mamba-1 elsewhere
            "attn_layer_offset": 4,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
        },
        "its config.json; transformers' defaults for the family are these values",
    ),
    "tiiuae/Falcon-H1-7B-Instruct": Published(
        "falcon_h1",
        {
            "hidden_size": 3072,
            "num_hidden_layers": 44,  # every layer runs attention and Mamba-2 side by side
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "mamba_d_ssm": 3072,
            "mamba_n_heads": 24,
            "mamba_d_head": 128,
            "mamba_n_groups": 1,
            "mamba_d_state": 256,
            "mamba_d_conv": 4,
        },
        "layers, widths, heads and state size as in transformers' Falcon-H1 documentation "
        "table; not confirmed here: mamba_d_ssm 3072 and 1 group (its defaults are no "
        "released size)",
    ),
    "ibm-ai-platform/Bamba-9B": Published(
        "bamba",
        {
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "attn_layer_indices": [9, 18, 27],
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "mamba_n_heads": 128,
            "mamba_d_head": 64,
            "mamba_n_groups": 1,
            "mamba_d_state": 128,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
        },
        "its config.json; not confirmed here: the Mamba heads (128 × 64, 1 group)",
    ),
    "LiquidAI/LFM2-1.2B": Published(
        "lfm2",
        {
            "hidden_size": 2048,
            "num_hidden_layers": 16,
            "full_attn_idxs": [2, 5, 8, 10, 12, 14],  # short convolutions elsewhere
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "conv_L_cache": 3,
        },
        "its config.json (transformers' defaults are a larger shape)",
    ),
    "state-spaces/mamba-2.8b-hf": Published(
        "mamba",
        {
            "hidden_size": 2560,
            "num_hidden_layers": 64,
            "state_size": 16,
            "conv_kernel": 4,
            "expand": 2,
        },
        "its config.json",
    ),
    "mistralai/Mamba-Codestral-7B-v0.1": Published(
        "mamba2",
        {
            "hidden_size": 4096,
            "num_hidden_layers": 64,
            "num_heads": 128,
            "head_dim": 64,
            "n_groups": 8,
            "state_size": 128,
            "conv_kernel": 4,
            "expand": 2,
        },
        "its config.json; transformers' defaults for the family are these values (its "
        "docstring names state-spaces/mamba2-2.8b, a different shape)",
    ),
    "tiiuae/falcon-mamba-7b": Published(
        "falcon_mamba",
        # as published: its `expand` (16) disagrees with its intermediate_size, which is
        # the one the weights (and the config class, given both) follow
        {
            "hidden_size": 4096,
            "num_hidden_layers": 64,
            "state_size": 16,
            "conv_kernel": 4,
            "expand": 16,
            "intermediate_size": 8192,
        },
        "its config.json",
    ),
}


@dataclass(frozen=True)
class Measured:
    model_id: str
    config: PreTrainedConfig
    shapes: dict[int, StateShape]  # probe_states: each state layer's state per sequence
    state_bytes: int  # per sequence, all state layers
    kv_per_token: int  # bytes, all attention layers
    attention_layers: int
    mixer_layers: int  # layers with attention, a state layer or both

    @property
    def all_attention_kv_per_token(self) -> int | None:
        """The KV cache per token if every mixer layer were one of its attention layers;
        None for a model without attention."""
        if not self.attention_layers:
            return None
        return self.kv_per_token * self.mixer_layers // self.attention_layers

    @property
    def block_kv(self) -> int:
        return KV_BLOCK_SIZE * self.kv_per_token


@functools.cache
def measure(model_id: str) -> Measured:
    published = MODELS[model_id]
    config = AutoConfig.for_model(published.model_type, vocab_size=VOCAB, **published.options)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPE)
    shapes = probe_states(model)
    attention = attention_layer_indices(model)
    assert len(attention) == attention_layer_count(model), model_id
    return Measured(
        model_id=model_id,
        config=config,
        shapes=shapes,
        state_bytes=state_bytes_per_sequence(shapes),
        kv_per_token=kv_bytes_per_token(model, DTYPE),
        attention_layers=attention_layer_count(model),
        mixer_layers=len(attention | set(shapes)),
    )


def attention_layer_indices(model: torch.nn.Module) -> set[int]:
    """The layers holding an attention module: what `attention_layer_count` counts."""
    return {
        module.layer_idx
        for module in model.modules()
        if hasattr(module, "layer_idx")
        and "Attention" in type(module).__name__
        and not is_state_layer_class(type(module))
    }


def size(n: int) -> str:
    if n == 0:
        return "0"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n} B"


DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def state_layout(shape: StateShape) -> str:
    parts = []
    for name, state in (("conv", shape.conv), ("recurrent", shape.recurrent)):
        if state is not None:
            dims, dtype = state
            parts.append(f"{name} {'×'.join(map(str, dims))} {DTYPE_NAMES.get(dtype, dtype)}")
    return " + ".join(parts)


def layers_column(m: Measured) -> str:
    states = len(m.shapes)
    if m.attention_layers and m.attention_layers + states > m.mixer_layers:
        return f"{m.mixer_layers}, each both"
    return f"{m.attention_layers} / {states}"


def ratio(m: Measured) -> float:
    """One state snapshot against one KV block's bytes (a model with attention)."""
    return m.state_bytes / m.block_kv


def times(x: float) -> str:
    return f"{x:.0f}x" if x >= 10 else f"{x:.1f}x"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def memory_table(measured: list[Measured]) -> str:
    contexts = [f"{n // 1024}k" for n in CONTEXTS]
    header = ["model", "model_type", "layers: attention / state", "state", "KV per token"]
    for c in contexts:
        header += [f"KV at {c}", f"state + KV at {c}"]
    header += [f"KV at {contexts[-1]} if all attention", f"state pool, {SLOTS} slots"]
    rows = []
    for m in measured:
        row = [
            f"`{m.model_id}`",
            f"`{MODELS[m.model_id].model_type}`",
            layers_column(m),
            size(m.state_bytes),
            size(m.kv_per_token),
        ]
        for tokens in CONTEXTS:
            kv = tokens * m.kv_per_token
            row += [size(kv), size(m.state_bytes + kv)]
        full = m.all_attention_kv_per_token
        row += ["—" if full is None else size(CONTEXTS[-1] * full), size(SLOTS * m.state_bytes)]
        rows.append(row)
    return table(header, rows)


def snapshot_table(measured: list[Measured]) -> str:
    blocks = CONTEXTS[-1] // KV_BLOCK_SIZE
    header = [
        "model",
        "state layers × each one's state",
        f"KV of a {KV_BLOCK_SIZE}-token block",
        "one state snapshot",
        "snapshot ÷ block KV",
        f"snapshots at an {CONTEXTS[-1] // 1024}k prompt's {blocks} block boundaries",
    ]
    rows = []
    for m in measured:
        layouts: dict[str, int] = {}
        for shape in m.shapes.values():
            layouts[state_layout(shape)] = layouts.get(state_layout(shape), 0) + 1
        rows.append(
            [
                f"`{m.model_id}`",
                "; ".join(f"{n} × {layout}" for layout, n in layouts.items()),
                size(m.block_kv),
                size(m.state_bytes),
                times(ratio(m)) if m.block_kv else "— (no KV)",
                size(blocks * m.state_bytes),
            ]
        )
    return table(header, rows)


def render() -> str:
    """docs/hybrid-models.md's generated section (between its markers)."""
    measured = [measure(model_id) for model_id in MODELS]
    sources = "\n".join(
        f"- `{model_id}` (`{p.model_type}`): {p.source}" for model_id, p in MODELS.items()
    )
    hybrids = sorted((m for m in measured if m.kv_per_token), key=ratio)
    low, rest = hybrids[0], hybrids[1:]
    return f"""\
Written by `python scripts/state_memory.py --write`; a test fails when it is stale. Each
model is built on the meta device (no weights) from transformers' config class with its
published shape (the table in the script; the sources below), in bfloat16, and measured
with the server's own functions: the state by `probe_states` (one token through each state
layer: the shapes and dtypes transformers stores its state in), the KV cache by
`kv_bytes_per_token` (the attention layers only). KiB, MiB, GiB: 2^10, 2^20, 2^30 bytes;
1k, 8k: 1024, 8192 tokens.

Per sequence. "If all attention": the KV cache of the same model with an attention layer
like its own in place of each state layer. The state pool: one slot per sequence at the
default `--max-batch-size` ({SLOTS}), reserved at startup.

{memory_table(measured)}
Prefix caching: a state snapshot at each {KV_BLOCK_SIZE}-token KV block boundary (what a
prefix-cache hit would need) against that block's own KV cache. For the hybrids it costs
{times(ratio(rest[0]))} to {times(ratio(rest[-1]))} the block's KV, except \
`{low.model_id}` ({times(ratio(low))}: its whole state is {size(low.state_bytes)}).

{snapshot_table(measured)}
Where the values come from (only the options that set these sizes; the vocabulary, MLPs
and experts, which change neither, are left at the config class's defaults); none was read
from the Hub here:

{sources}
"""


def write(text: str) -> None:
    doc = DOC.read_text()
    block = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.DOTALL)
    if not block.search(doc):
        raise SystemExit(f"{DOC} has lost its markers: {BEGIN.strip()} ... {END.strip()}")
    DOC.write_text(block.sub(lambda _: BEGIN + text + END, doc))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {DOC.name}'s section")
    args = parser.parse_args()
    text = render()
    if args.write:
        write(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
