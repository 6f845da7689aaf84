"""Models the paged engine can't serve are refused from their config.json, before any
weight loads (models/architectures.py, through the settings' checks), and the families it
serves pass the same rules. Configs come from transformers' own config classes; the
loaded-model side of the same rules is tests/engine/test_paged_core.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from safetensors.torch import save_file
from textgen.service.models.architectures import (
    image_family_reason,
    images_refused_reason,
    unserved_reason,
)
from textgen.service.settings.preflight import preflight
from textgen.service.settings.table import SettingError, Settings
from transformers import AutoConfig

pytestmark = pytest.mark.timeout(120)

# model_type -> what the refusal names
REFUSED = {
    "gpt_neo": "AttentionInterface",
    "xglm": "AttentionInterface",
    "axk2": "indexed_attention",  # a layer kind no pool holds
    # state kept outside transformers' cache interface, seen in the modelling code
    "xlstm": "recurrent state",
}
# families the engine serves token for token (tests/integration/test_family_matrix.py,
# tests/engine/test_families.py)
SERVED = [
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi", "phi3", "granite",
    "cohere", "cohere2", "olmo2", "starcoder2", "gpt_bigcode", "gpt_neox", "gptj", "gpt2",
    "smollm3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "phimoe",
    "olmoe", "granitemoe", "stablelm", "gpt_oss", "gemma4_text", "falcon", "bloom", "mpt",
    "llama4_text", "glm4", "exaone4", "seed_oss", "glm4_moe", "ernie4_5_moe",
    # hybrid and state-space models, on the state pool (tests/engine/test_hybrid_models.py)
    "qwen3_next", "qwen3_5_text", "granitemoehybrid", "nemotron_h", "jamba", "falcon_h1",
    "bamba", "lfm2", "mamba", "mamba2", "falcon_mamba", "qwen3_5_moe_text", "qwen3_5",
    "qwen3_5_moe", "lara_mini", "olmo_hybrid", "kimi_linear", "bailing_hybrid", "lfm2_moe",
    "lfm3", "zamba", "zamba2", "zaya",
    # vision-language, served with images (tests/integration/test_images.py)
    "llava", "llava_next", "idefics3", "smolvlm", "gemma3", "mistral3", "paligemma", "qwen2_vl",
    "qwen2_5_vl", "qwen3_vl",
]  # fmt: skip
# vision-language families not served yet (issue 47): refused by name, before loading
IMAGE_FAMILIES_NOT_YET = ["llava_onevision"]


def config_of(model_type: str) -> dict:
    """config.json as save_pretrained writes it for transformers' default config."""
    return AutoConfig.for_model(model_type).to_dict()


def write_model_folder(folder: Path, model_type: str) -> Path:
    """A model folder whose safetensors file holds no tensor: a load would fail on the
    missing weights, so a refusal that names the architecture came before any load."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_of(model_type)))
    save_file({}, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize(("model_type", "words"), sorted(REFUSED.items()))
def test_an_unserved_architecture_is_refused_from_its_config(model_type, words):
    reason = unserved_reason(config_of(model_type))
    assert reason is not None and words in reason


@pytest.mark.parametrize("model_type", SERVED)
def test_a_served_architecture_passes(model_type):
    assert unserved_reason(config_of(model_type)) is None


@pytest.mark.parametrize("model_type", IMAGE_FAMILIES_NOT_YET)
def test_a_vision_language_family_not_served_yet_is_refused_by_name(model_type):
    reason = unserved_reason(config_of(model_type))
    assert reason is not None and reason.startswith(f"{model_type} is a vision-language family")
    assert "llava" in reason  # what is served instead


def test_vision_checkpoints_served_as_text_stay_served():
    """Families transformers also loads as a causal LM keep that path (no images)."""
    for model_type in ("qwen3_5", "qwen3_5_moe", "llama4", "mllama"):
        assert image_family_reason(model_type) is None


def test_images_to_a_vision_checkpoint_served_as_text_say_so():
    """An image sent to Mllama (served as text) says its images aren't served yet; text
    models and the families served with images have no such reason."""
    assert images_refused_reason("mllama", vision=True) == (
        "mllama's images are not served yet; its text is"
    )
    assert images_refused_reason("gemma3_text", vision=False) is None
    assert images_refused_reason("gemma3", vision=True) is None


def test_preflight_refuses_an_unserved_vision_family_in_one_line(tmp_path):
    folder = write_model_folder(tmp_path / "llava_onevision", "llava_onevision")
    with pytest.raises(SettingError) as refused:
        preflight(Settings(model_id=str(folder), grpc_port=0, port=0, no_envoy=True))
    message = str(refused.value)
    assert message.startswith(f"--model-id {folder}: llava_onevision is a vision-language family")
    assert "\n" not in message


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_mrope_families_refuse_the_decode_graphs_before_loading(tmp_path, model_type):
    """Their decodes' rotary positions are index + the images' delta, laid out by the eager
    runner: --compile's decode graphs (taking token indices) are refused in one line."""
    folder = write_model_folder(tmp_path / model_type, model_type)
    settings = Settings(model_id=str(folder), grpc_port=0, port=0, no_envoy=True, compile=True)
    with pytest.raises(SettingError) as refused:
        preflight(settings)
    message = str(refused.value)
    assert message.startswith("--compile") and "M-RoPE" in message and "\n" not in message


def test_a_model_with_its_own_code_is_left_to_the_load():
    """auto_map: only the model's code knows; the loaded model is checked instead."""
    config = {**config_of("gpt_neo"), "auto_map": {"AutoModelForCausalLM": "x.Y"}}
    assert unserved_reason(config) is None


@pytest.mark.parametrize("model_type", ["gpt_neo", "axk2"])
def test_preflight_names_the_flag_and_the_missing_feature(tmp_path, model_type):
    folder = write_model_folder(tmp_path / model_type, model_type)
    with pytest.raises(SettingError) as refused:
        preflight(Settings(model_id=str(folder), grpc_port=0, port=0, no_envoy=True))
    assert str(refused.value).startswith(f"--model-id {folder}: ")
    assert REFUSED[model_type] in str(refused.value)


@pytest.mark.parametrize(
    ("model_type", "words"), [("gpt_oss", "attention sinks"), ("mpt", "ALiBi")]
)
def test_sdpa_only_attention_is_refused_batch_invariant(tmp_path, model_type, words):
    """gpt-oss and MPT are served, but their sinks and ALiBi have no batch-invariant
    path: --deterministic is refused before loading."""
    folder = write_model_folder(tmp_path / model_type, model_type)
    settings = Settings(model_id=str(folder), grpc_port=0, port=0, no_envoy=True)
    preflight(settings)  # without --deterministic: served
    with pytest.raises(SettingError) as refused:
        preflight(replace(settings, deterministic=True))
    assert str(refused.value).startswith("--deterministic true: ")
    assert words in str(refused.value)


@pytest.mark.parametrize(
    ("option", "value", "flag"),
    [
        ("speculate", 2, "--speculate 2"),
        ("compile", True, "--compile"),
        ("deterministic", True, "--deterministic"),
    ],
)
def test_what_state_layers_dont_run_with_is_refused_before_loading(tmp_path, option, value, flag):
    """A hybrid model (Qwen3-Next: Gated DeltaNet layers) is served, but its state layers
    run neither speculation, compiled graphs nor batch-invariant:
    each flag is refused from config.json, in one line naming it."""
    folder = write_model_folder(tmp_path / "qwen3_next", "qwen3_next")
    settings = Settings(model_id=str(folder), grpc_port=0, port=0, no_envoy=True)
    preflight(settings)  # served as it is
    with pytest.raises(SettingError) as refused:
        preflight(replace(settings, **{option: value}))
    assert str(refused.value).startswith(f"{flag}: is not supported for {folder}, a hybrid")


def test_state_layers_without_a_shard_plan_are_refused_on_shards(tmp_path):
    """Gated DeltaNet layers (Qwen3-Next, Qwen3.5) split over shards
    (tests/integration/test_hybrid_shards.py); Mamba-2's (Bamba) have no plan: refused
    before loading."""
    settings = Settings(grpc_port=0, port=0, no_envoy=True, num_shard=2, master_port=0)
    qwen = write_model_folder(tmp_path / "qwen3_next", "qwen3_next")
    assert preflight(replace(settings, model_id=str(qwen))).num_shard == 2
    bamba = write_model_folder(tmp_path / "bamba", "bamba")
    with pytest.raises(SettingError) as refused:
        preflight(replace(settings, model_id=str(bamba)))
    assert str(refused.value).startswith("--num-shard 2: bamba's state layers have no")


@pytest.mark.server  # runs `textgen serve`
def test_serve_refuses_in_one_line_and_status_2_before_loading(tmp_path):
    folder = write_model_folder(tmp_path / "gpt_neo", "gpt_neo")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TEXTGEN_")}
    started = time.monotonic()
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("textgen")), "serve", "--model-id", str(folder)],
        env={**env, "TEXTGEN_CACHE": str(tmp_path / "cache")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("textgen serve: error: --model-id")
    assert "AttentionInterface" in lines[0]
    assert time.monotonic() - started < 20.0  # a load would fail on the missing weights
