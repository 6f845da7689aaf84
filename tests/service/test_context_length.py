"""The context a model is served: the one its config.json states (under any of the keys
families use, MPT's max_seq_len too), else --max-total-tokens. A config that states none
(Bloom's ALiBi, Mamba's state-space layers: no positions) is refused before loading
without that flag, in one SettingError naming it; given, it is the context the settings
and the loader serve."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from textgen.service.models import LoadOptions, ModelError, load_model
from textgen.service.models.hub import stated_context
from textgen.service.models.loader import served_context
from textgen.service.settings.preflight import check_context, preflight
from textgen.service.settings.table import SettingError, Settings

pytestmark = pytest.mark.timeout(120)

# tiny configs of the families, as config.json states them (no weights are read)
CONFIGS = {
    "bloom": {"hidden_size": 64, "n_head": 4, "n_layer": 2, "vocab_size": 128},
    "mamba": {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 128},
    "mpt": {"d_model": 64, "n_heads": 4, "n_layers": 2, "vocab_size": 128, "max_seq_len": 512},
}


def config_of(model_type: str) -> dict:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **CONFIGS[model_type]).to_dict()


def model_folder(root: Path, model_type: str) -> Path:
    """config.json and a placeholder safetensors file: what preflight reads and checks."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    folder = root / model_type
    AutoConfig.for_model(model_type, **CONFIGS[model_type]).save_pretrained(folder)
    save_file({"placeholder": torch.zeros(1)}, str(folder / "model.safetensors"))
    return folder


def checked(folder: Path, **settings) -> tuple[int, int, int]:
    found = preflight(Settings(model_id=str(folder), no_envoy=True, grpc_port=0, **settings))
    return found.context, found.max_input_tokens, found.max_total_tokens


def test_mpts_max_seq_len_is_its_context():
    config = config_of("mpt")
    assert stated_context(config) == 512
    assert check_context(Settings(), "mpt", config) == 512  # no flag needed


@pytest.mark.parametrize("model_type", ["bloom", "mamba"])
def test_a_config_stating_no_context_needs_max_total_tokens(model_type):
    config = config_of(model_type)
    assert stated_context(config) is None
    for settings in (Settings(), Settings(max_input_tokens=1000)):  # only the total says it
        with pytest.raises(SettingError) as refused:
            check_context(settings, model_type, config)
        assert refused.value.flag == "--max-total-tokens"
        assert f"{model_type}'s config states no context length" in str(refused.value)
        assert "pass --max-total-tokens N" in str(refused.value)
    assert check_context(Settings(max_total_tokens=2048), model_type, config) == 2048


def test_preflight_refuses_it_before_loading_and_serves_the_flags_context(tmp_path):
    # Bloom (served through its attention adapter) states no context
    folder = model_folder(tmp_path, "bloom")
    with pytest.raises(SettingError, match=r"^--max-total-tokens: needed: .*bloom's config"):
        checked(folder)
    assert checked(folder, max_total_tokens=2048) == (2048, 2047, 2048)
    # TGI's launcher default (the whole context) is the flag's then
    assert checked(folder, max_total_tokens=2048, full_context=True) == (2048, 2047, 2048)


def test_the_loader_serves_the_settings_context_where_the_config_states_none():
    mamba, mpt = config_of("mamba"), config_of("mpt")
    assert served_context(mamba, LoadOptions(context=2048)) == 2048
    with pytest.raises(ModelError, match="pass --max-total-tokens"):
        served_context(mamba, LoadOptions())
    assert served_context(mpt, LoadOptions(context=2048)) == 512  # the config's own wins


def test_the_replica_loads_with_the_settings_context():
    from textgen.service.replica.assembly import load_options

    assert load_options(Settings(max_total_tokens=2048)).context == 2048
    assert load_options(Settings()).context is None


def test_a_loaded_mamba_serves_the_given_context(tmp_path):
    """LoadedModel.max_position_embeddings, which the replica's limits and Info read."""
    from support.tiny_model import build_tokenizer
    from transformers import MambaConfig, MambaForCausalLM

    tokenizer = build_tokenizer()
    config = MambaConfig(
        hidden_size=32,
        state_size=4,
        num_hidden_layers=1,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
    )
    MambaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32", options=LoadOptions(context=300))
    assert loaded.max_position_embeddings == 300
