"""`textgen models` and docs/models.md (service/models/families.py): the families served,
how, the engine's features each uses, the tests that verify them; and the verdict of
architectures.py on every other causal LM transformers has. Nothing loads weights."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from support.families import FAMILIES, STATE_FAMILIES
from textgen.service.cli import main
from textgen.service.models.architectures import unserved_reason
from textgen.service.models.families import (
    ADAPTER,
    HYBRID,
    INTERFACE,
    MATRIX,
    NO_ATTENTION,
    SPECIAL,
    VERIFIED,
    features,
    models_table,
    served_families,
)
from transformers import CONFIG_MAPPING, AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
ADAPTED = ("falcon", "bloom", "mpt", "llama4_text")
SHOWN = ("falcon", "bloom", "mpt", "llama4_text", "gpt_oss", "gemma4_text")


def textgen(capsys, *argv: str) -> str:
    assert main(["models", *argv]) == 0
    return capsys.readouterr().out


def test_the_models_doc_is_the_table():
    doc = (ROOT / "docs" / "models.md").read_text()
    block = re.search(
        r"<!-- models table: begin -->\n(.*)<!-- models table: end -->\n", doc, re.DOTALL
    )
    assert block is not None, "docs/models.md has lost its table markers"
    assert block.group(1) == models_table(), (
        "docs/models.md is stale: python scripts/make_settings_doc.py"
    )


def test_textgen_models_lists_the_families_and_loads_nothing(capsys):
    before = set(sys.modules)
    out = textgen(capsys)
    family_code = re.compile(r"transformers\.models\.(?!auto\.)\w+\.modeling_\w+$")
    loaded = {m for m in set(sys.modules) - before if family_code.match(m)}
    assert not loaded, f"textgen models imported modelling code: {sorted(loaded)}"
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    for model_type in SHOWN:
        assert model_type in rows, out
    assert "adapter" in rows["falcon"] and "interface" in rows["gpt_oss"]
    assert "attention sinks" in rows["gpt_oss"] and "chunked attention" in rows["llama4_text"]
    assert "test_families" in rows["llama4_text"]
    assert "xlstm" not in out  # the verdicts only with --all
    assert "textgen models --all" in out
    header = out.splitlines()[0]  # aligned columns: each row's cells start under the header's
    for column in ("family", "attention", "features"):
        at = header.index(column)
        for line in out.splitlines()[1 : len(VERIFIED) + 1]:
            assert line[at - 2 : at] == "  " and line[at] != " ", line


def test_textgen_models_all_names_the_refused_and_why(capsys):
    out = textgen(capsys, "--all")
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "indexed_attention" in lines["axk2"]
    assert "cache interface" in lines["xlstm"]
    assert "AttentionInterface" in lines["gpt_neo"]
    assert "AttentionInterface" in lines["xglm"]


def test_textgen_models_json(capsys):
    report = json.loads(textgen(capsys, "--json", "--all"))
    assert [f["model_type"] for f in report["families"]] == list(VERIFIED)
    assert "indexed_attention" in report["refused"]["axk2"]
    assert not set(report["refused"]) & set(VERIFIED)
    assert not set(report["unverified"]) & set(report["refused"])
    short = json.loads(textgen(capsys, "--json"))
    assert short["families"] == report["families"] and "refused" not in short


def test_every_verified_family_passes_architectures_rules():
    for model_type in VERIFIED:
        assert model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, model_type
        assert unserved_reason(AutoConfig.for_model(model_type).to_dict()) is None, model_type


def test_each_family_is_in_the_tests_it_names():
    """The matrix serves every family of support/families.py; the engine's special tests
    name the families they build, by model_type or config class."""
    special = (ROOT / SPECIAL).read_text()
    for family in served_families():
        for path in family.tests:
            assert (ROOT / path).is_file(), path
        in_matrix = family.model_type in FAMILIES or family.model_type in STATE_FAMILIES
        assert (MATRIX in family.tests) == in_matrix, family.model_type
        if HYBRID in family.tests:
            assert f'"{family.model_type}"' in (ROOT / HYBRID).read_text(), family.model_type
        if SPECIAL in family.tests:
            names = (f'"{family.model_type}"', CONFIG_MAPPING[family.model_type].__name__)
            assert any(name in special for name in names), family.model_type
    assert set(FAMILIES) | set(STATE_FAMILIES) <= set(VERIFIED)


def test_how_served_and_the_features_come_from_the_code():
    served_by = {f.model_type: f.served_by for f in served_families()}
    assert {t for t, how in served_by.items() if how == ADAPTER} == set(ADAPTED)
    assert set(served_by.values()) == {INTERFACE, ADAPTER, NO_ATTENTION}
    assert {t for t, how in served_by.items() if how == NO_ATTENTION} == {
        "mamba",
        "mamba2",
        "falcon_mamba",
    }
    expected = {
        "llama": (),
        "mistral": ("sliding window",),
        "gemma2": ("sliding window", "softcapping"),
        "gpt_oss": ("sliding window", "attention sinks", "MoE"),
        "gemma4_text": (
            "sliding window", "head sizes per layer", "KV shared across layers (when set)"
        ),
        "falcon": ("ALiBi (when set)", "multi-query"),
        "bloom": ("ALiBi",),
        "mpt": ("ALiBi",),
        "llama4_text": ("chunked attention", "MoE"),
        "deepseek_v3": ("MLA", "MoE"),
        "gpt_bigcode": ("multi-query",),
        "phi3": ("sliding window (when set)",),
        "qwen3_next": ("MoE", "state layers"),
        "mamba": ("state layers",),
    }  # fmt: skip
    for model_type, found in expected.items():
        assert features(model_type) == found, model_type
