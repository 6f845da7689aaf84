"""The model families textgen serves (`textgen models`, docs/models.md): each family's
name, how its attention reaches the paged engine, the engine's features its code uses, and
the tests that prove it token for token; then, for every causal LM transformers has, what
architectures.py decides from its config.json.

Only the names and the proving tests are written here. The rest is derived from the code
that decides at serving time: the way a family is served from attention_adapters.py's
`is_adapted`, its features from transformers' default config for the family
(`AutoConfig.for_model`, no weights, no modelling code imported) read by the rules the
engine and architectures.py apply, and a refusal from architectures.py's
`unserved_reason`. A feature the default config leaves off but the config class takes (a
sliding window in Phi-3's, ALiBi in Falcon's) is listed "when set".
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import textwrap
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

from .architectures import (
    ALIBI,
    CHUNKED,
    SINKS,
    has_attention,
    has_state_layers,
    no_graphs_reason,
    not_invariant_reason,
    sdpa_only_terms,
    unserved_reason,
)
from .attention_adapters import is_adapted, kv_heads

INTERFACE = "transformers' code, attention through AttentionInterface"
ADAPTER = "attention adapter (models/attention_adapters.py)"
NO_ATTENTION = "none: state layers only"

MATRIX = "tests/integration/test_family_matrix.py"  # every family through a real server
SPECIAL = "tests/engine/test_families.py"  # what the Llama-like families don't need
FALCON_QUICKSTART = "tests/integration/test_falcon_quickstart.py"  # TGI's quick start
SHARDS = "tests/integration/test_shards.py"  # on --num-shard 2 too
HYBRID = "tests/engine/test_hybrid_models.py"  # the state pool's rules
HYBRID_SHARDS = "tests/integration/test_hybrid_shards.py"  # Gated DeltaNet on 2 shards

# model_type -> (name, the tests that prove it equals transformers' generate token for
# token); the order is the table's
VERIFIED: dict[str, tuple[str, tuple[str, ...]]] = {
    "llama": ("Llama (Llama 2, Llama 3 to 3.3)", (MATRIX, SHARDS)),
    "mistral": ("Mistral", (MATRIX, SHARDS)),
    "qwen2": ("Qwen 1.5, 2, 2.5", (MATRIX, SHARDS)),
    "qwen3": ("Qwen 3", (MATRIX, SHARDS)),
    "gemma2": ("Gemma 2", (MATRIX, SHARDS)),
    "gemma3_text": ("Gemma 3 (text)", (MATRIX, SHARDS)),
    "phi": ("Phi-1, 1.5, 2", (MATRIX,)),
    "phi3": ("Phi-3, 3.5, Phi-4", (MATRIX, SHARDS)),
    "granite": ("Granite 3", (MATRIX,)),
    "cohere": ("Command R (Cohere)", (MATRIX,)),
    "cohere2": ("Command R7B, Command A (Cohere 2)", (MATRIX,)),
    "olmo2": ("OLMo 2", (MATRIX,)),
    "starcoder2": ("StarCoder2", (MATRIX,)),
    "gpt_bigcode": ("GPT-BigCode (StarCoder, SantaCoder)", (MATRIX,)),
    "gpt_neox": ("GPT-NeoX (GPT-NeoX-20B, Pythia)", (MATRIX,)),
    "gptj": ("GPT-J", (MATRIX,)),
    "gpt2": ("GPT-2", (MATRIX,)),
    "smollm3": ("SmolLM3", (MATRIX,)),
    "glm4": ("GLM-4 (0414)", (MATRIX,)),
    "exaone4": ("EXAONE 4.0", (MATRIX,)),
    "seed_oss": ("Seed-OSS", (MATRIX,)),
    "mixtral": ("Mixtral", (MATRIX,)),
    "qwen2_moe": ("Qwen 1.5, 2 MoE", (MATRIX,)),
    "qwen3_moe": ("Qwen 3 MoE", (MATRIX,)),
    "deepseek_v2": ("DeepSeek-V2", (MATRIX,)),
    "deepseek_v3": ("DeepSeek-V3, R1", (MATRIX, SHARDS)),
    "phimoe": ("Phi-3.5-MoE", (MATRIX,)),
    "olmoe": ("OLMoE", (MATRIX,)),
    "granitemoe": ("Granite 3 MoE", (MATRIX,)),
    "glm4_moe": ("GLM-4.5, 4.6", (MATRIX,)),
    "ernie4_5_moe": ("ERNIE 4.5 MoE", (MATRIX,)),
    "stablelm": ("StableLM", (MATRIX, SPECIAL)),
    "gpt_oss": ("gpt-oss", (MATRIX, SPECIAL, SHARDS)),
    "gemma4_text": ("Gemma 4 (text)", (MATRIX, SPECIAL)),
    "falcon": (
        "Falcon (RW layout: Falcon-7B/40B/180B, Falcon-RW)",
        (MATRIX, SPECIAL, FALCON_QUICKSTART),
    ),
    "bloom": ("BLOOM", (MATRIX, SPECIAL)),
    "mpt": ("MPT", (MATRIX, SPECIAL)),
    "llama4_text": ("Llama 4 (text: Scout, Maverick)", (MATRIX, SPECIAL)),
    # hybrid and state-space models: layers that keep a state per sequence (state pool)
    "qwen3_next": ("Qwen3-Next", (MATRIX, HYBRID, HYBRID_SHARDS)),
    "qwen3_5_text": ("Qwen3.5 (text)", (MATRIX, HYBRID, HYBRID_SHARDS)),
    "granitemoehybrid": ("Granite 4.0 hybrid (H-Micro, H-Tiny, H-Small)", (MATRIX, HYBRID)),
    "nemotron_h": ("Nemotron-H, Nemotron Nano 2", (MATRIX, HYBRID)),
    "jamba": ("Jamba", (MATRIX, HYBRID)),
    "falcon_h1": ("Falcon-H1", (MATRIX, HYBRID)),
    "bamba": ("Bamba", (MATRIX, HYBRID)),
    "lfm2": ("LFM2", (MATRIX, HYBRID)),
    "mamba": ("Mamba", (MATRIX, HYBRID)),
    "mamba2": ("Mamba-2 (Codestral Mamba)", (MATRIX, HYBRID)),
    "falcon_mamba": ("Falcon-Mamba", (MATRIX, HYBRID)),
    "qwen3_5_moe_text": ("Qwen3.5 MoE (text)", (MATRIX, HYBRID)),
    "qwen3_5": ("Qwen3.5 (vision-language checkpoints, served as text)", (MATRIX, HYBRID)),
    "qwen3_5_moe": ("Qwen3.5 MoE (vision-language checkpoints, served as text)", (MATRIX, HYBRID)),
    "lara_mini": ("Lara 4 Mini", (MATRIX, HYBRID)),
    "olmo_hybrid": ("OLMo Hybrid", (MATRIX, HYBRID)),
    "kimi_linear": ("Kimi Linear", (MATRIX, HYBRID)),
    "bailing_hybrid": ("Ling 3.0 (Bailing hybrid)", (MATRIX, HYBRID)),
    "lfm2_moe": ("LFM2-MoE (LFM2-8B-A1B)", (MATRIX, HYBRID)),
    "lfm3": ("LFM3", (MATRIX, HYBRID)),
    "zamba": ("Zamba", (MATRIX, HYBRID)),
    "zamba2": ("Zamba2", (MATRIX, HYBRID)),
    "zaya": ("ZAYA", (MATRIX, HYBRID)),
}


@dataclass(frozen=True)
class Family:
    model_type: str
    name: str
    served_by: str  # INTERFACE or ADAPTER
    features: tuple[str, ...]
    tests: tuple[str, ...]


@dataclass(frozen=True)
class Verdicts:
    """What architectures.py decides for each causal LM of the installed transformers that
    isn't in VERIFIED: refused (model_type -> the reason it prints), or not refused from its
    config.json yet not verified here (the loader or the engine may still fail on it), or
    unchecked (its default config doesn't build: model_type -> the error)."""

    transformers: str
    causal_lms: int
    refused: dict[str, str] = field(default_factory=dict)
    unverified: list[str] = field(default_factory=list)
    unchecked: dict[str, str] = field(default_factory=dict)


# features -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Feature:
    label: str
    uses: Callable[[object, dict], bool]  # (config, config.json) -> whether it's used
    # the options that turn it on (the first one decides whether the config takes them)
    switch: dict = field(default_factory=dict)


def _sliding(config, _) -> bool:
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return "sliding_attention" in layer_types
    return bool(getattr(config, "sliding_window", None)) and (
        getattr(config, "use_sliding_window", True) is not False
    )


def _experts(config, _) -> bool:
    names = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
    return any((getattr(config, name, None) or 0) > 0 for name in names)


def _one_kv_head(config, _) -> bool:
    return (kv_heads(config) or getattr(config, "num_key_value_heads", None)) == 1


FEATURES = (
    _Feature(
        "sliding window",
        _sliding,
        {"sliding_window": 4096, "use_sliding_window": True},
    ),
    _Feature(
        "chunked attention",
        lambda c, _: "chunked_attention" in (getattr(c, "layer_types", None) or []),
    ),
    _Feature("attention sinks", lambda _, j: sdpa_only_terms(j) == SINKS),
    _Feature("ALiBi", lambda _, j: sdpa_only_terms(j) == ALIBI, {"alibi": True}),
    _Feature(
        "softcapping",
        lambda c, _: bool(getattr(c, "attn_logit_softcapping", None)),
        {"attn_logit_softcapping": 50.0},
    ),
    _Feature("head sizes per layer", lambda c, _: bool(getattr(c, "is_heterogeneous", False))),
    _Feature(
        "KV shared across layers",
        lambda c, _: (getattr(c, "num_kv_shared_layers", None) or 0) > 0,
        {"num_kv_shared_layers": 2},
    ),
    _Feature("multi-query", _one_kv_head),
    _Feature("MLA", lambda c, _: bool(getattr(c, "kv_lora_rank", None))),
    _Feature("MoE", _experts),
    _Feature("state layers", lambda _, j: has_state_layers(j)),
)
WHEN_SET = " (when set)"
# what the engine runs only on its SDPA path: the server's own words for each
SDPA_ONLY = {
    "attention sinks": (no_graphs_reason(SINKS), not_invariant_reason(SINKS)),
    "ALiBi": (no_graphs_reason(ALIBI), not_invariant_reason(ALIBI)),
    "chunked attention": (no_graphs_reason(CHUNKED),),
}
# what a hybrid model's state layers don't run with yet (settings/preflight.py)
STATE_LAYERS_NOTE = (
    "state layers: each sequence's state in a slot of the state pool (engine/state_pool.py); "
    "prefix caching off; --speculate, --compile, CUDA graphs and --deterministic refused; "
    "--num-shard for Gated DeltaNet only (Qwen3-Next, Qwen3.5): docs/hybrid-models.md"
)


@functools.cache
def features(model_type: str) -> tuple[str, ...]:
    """The paged engine's features the family's code uses, read from its default config;
    those it takes but leaves off are marked WHEN_SET."""
    config = _default_config(model_type)
    config_json = config.to_dict()
    takes = set(inspect.signature(type(config).__init__).parameters)
    found = []
    for feature in FEATURES:
        if feature.uses(config, config_json):
            found.append(feature.label)
            continue
        options = {k: v for k, v in feature.switch.items() if k in takes}
        if next(iter(feature.switch), None) not in options:
            continue  # the config doesn't take the option that turns it on
        try:
            switched = _default_config(model_type, **options)
        except Exception:  # noqa: BLE001, S112 - a config that refuses the option (strict checks)
            continue
        if feature.uses(switched, switched.to_dict()):
            found.append(feature.label + WHEN_SET)
    return tuple(found)


# the tables -----------------------------------------------------------------------------


def served_families() -> list[Family]:
    return [
        Family(model_type, name, _served_by(model_type), features(model_type), tests)
        for model_type, (name, tests) in VERIFIED.items()
    ]


def _served_by(model_type: str) -> str:
    if is_adapted(model_type):
        return ADAPTER
    return INTERFACE if has_attention(model_type) else NO_ATTENTION


@functools.cache
def causal_lm_verdicts() -> Verdicts:
    """architectures.py's verdict on the default config of every model_type transformers
    has a causal LM for, except the verified ones."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    verdicts = Verdicts(transformers.__version__, len(names))
    for model_type in names:
        if model_type in VERIFIED:
            continue
        try:
            config_json = _default_config(model_type).to_dict()
        except Exception as exc:  # noqa: BLE001 - reported: a default config that doesn't build
            verdicts.unchecked[model_type] = f"{type(exc).__name__}: " + (
                str(exc).strip().splitlines() or [""]
            )[0].rstrip(" :")
            continue
        reason = unserved_reason(config_json)
        if reason:
            verdicts.refused[model_type] = reason
        else:
            verdicts.unverified.append(model_type)
    return verdicts


def models_table() -> str:
    """docs/models.md's tables (checked by a test): the served families, then the verdicts
    on transformers' other causal LMs."""
    rows = [
        "| model_type | family | attention | features | verified by |",
        "| --- | --- | --- | --- | --- |",
    ]
    for family in served_families():
        tests = ", ".join(f"[{_file_name(t)}](../{t})" for t in family.tests)
        used = ", ".join(family.features) or "—"
        rows.append(
            f"| `{family.model_type}` | {family.name} | {family.served_by} | {used} | {tests} |"
        )
    verdicts = causal_lm_verdicts()
    lines = [
        *rows,
        "",
        *_notes("- "),
        "",
        (
            f"Of transformers {verdicts.transformers}'s {verdicts.causal_lms} model types with a "
            f"causal LM, {len(VERIFIED)} are the families above. Refused from their config.json "
            f"({len(verdicts.refused)}):"
        ),
        "",
        "| model_type | why |",
        "| --- | --- |",
        *(f"| `{name}` | {reason} |" for name, reason in verdicts.refused.items()),
        "",
        f"{_not_refused(len(verdicts.unverified)).capitalize()}: "
        + ", ".join(f"`{name}`" for name in verdicts.unverified)
        + ".",
    ]
    if verdicts.unchecked:
        lines += [
            "",
            f"{_unchecked(len(verdicts.unchecked)).capitalize()}: "
            + "; ".join(f"`{name}` ({error})" for name, error in verdicts.unchecked.items())
            + ".",
        ]
    return "\n".join(lines) + "\n"


def _not_refused(count: int) -> str:
    return (
        f"not refused from their config.json, not verified token for token ({count}; the "
        "loader or the engine may still fail on them)"
    )


def _unchecked(count: int) -> str:
    return f"unchecked: their default config doesn't build ({count})"


_SHORT = {INTERFACE: "interface", ADAPTER: "adapter", NO_ATTENTION: "none"}


def models_text(everything: bool = False) -> str:
    """`textgen models`: the served families as aligned columns, then what the table's
    words mean; `everything` (--all): what architectures.py decides for transformers'
    other causal LMs."""
    families = served_families()
    columns = [("model_type", "family", "attention", "features", "verified by")]
    for f in families:
        tests = ", ".join(_file_name(t).removesuffix(".py") for t in f.tests)
        columns.append(
            (f.model_type, f.name, _SHORT[f.served_by], ", ".join(f.features) or "-", tests)
        )
    widths = [max(len(row[i]) for row in columns) for i in range(len(columns[0]) - 1)]
    lines = [
        "  ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[-1]]) for row in columns
    ]
    lines += [
        "",
        f"attention: {'; '.join(f'{short}: {long}' for long, short in _SHORT.items())}",
        *_notes(""),
        f"verified by: {', '.join(sorted({t for f in families for t in f.tests}))}",
    ]
    if not everything:
        lines.append(
            f"transformers {_transformers_version()} has {_causal_lm_count()} model types with "
            "a causal LM: textgen models --all says what is refused of them and why"
        )
        return "\n".join(lines) + "\n"
    verdicts = causal_lm_verdicts()
    width = max(map(len, verdicts.refused), default=0)
    lines += [
        "",
        (
            f"transformers {verdicts.transformers}: {verdicts.causal_lms} model types with a "
            f"causal LM, {len(VERIFIED)} above; refused from their config.json "
            f"({len(verdicts.refused)}):"
        ),
        *(f"  {name.ljust(width)}  {reason}" for name, reason in verdicts.refused.items()),
        f"{_not_refused(len(verdicts.unverified))}:",
        *textwrap.wrap(
            ", ".join(verdicts.unverified),
            96,
            initial_indent="  ",
            subsequent_indent="  ",
            break_on_hyphens=False,
        ),
    ]
    if verdicts.unchecked:
        lines.append(f"{_unchecked(len(verdicts.unchecked))}:")
        lines += [f"  {name}  {error}" for name, error in verdicts.unchecked.items()]
    return "\n".join(lines) + "\n"


def models_json(everything: bool = False) -> dict:
    """`textgen models --json`: models_text's content, as data."""
    report: dict = {
        "transformers": _transformers_version(),
        "families": [asdict(f) for f in served_families()],
        "sdpa_only": {feature: list(words) for feature, words in SDPA_ONLY.items()},
    }
    if everything:
        verdicts = causal_lm_verdicts()
        report.update(
            causal_lms=verdicts.causal_lms,
            refused=verdicts.refused,
            unverified=verdicts.unverified,
            unchecked=verdicts.unchecked,
        )
    return report


def _notes(bullet: str) -> list[str]:
    return [
        (
            f"{bullet}(when set): the family's config takes the option, its default config "
            "leaves it off"
        ),
        *(f"{bullet}{'; '.join(words)}" for words in SDPA_ONLY.values()),
        f"{bullet}{STATE_LAYERS_NOTE}",
    ]


def _file_name(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _causal_lm_count() -> int:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# --------------------------------------------------------------------------------------


def _default_config(model_type: str, **options):
    from transformers import AutoConfig

    with _quiet():
        return AutoConfig.for_model(model_type, **options)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers' warnings about default configs (token ids past a default vocabulary,
    deprecated options) say nothing about serving them."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
