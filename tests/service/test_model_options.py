"""Where the model's files come from and what changes in them as they load (LoadOptions,
from TGI's launcher flags that serve has too): --huggingface-hub-cache,
--weights-cache-override, --trust-remote-code, --rope-scaling/--rope-factor,
--tokenizer-config-path; each checked by its effect, and its refusals before loading."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from support.servers import ServerThread, tiny_settings
from textgen.sdk import Client
from textgen.service.models import LoadOptions, ModelError, load_model, resolve_model
from textgen.service.models.loader import _config
from textgen.service.settings.preflight import preflight
from textgen.service.settings.table import SettingError, Settings

pytestmark = pytest.mark.timeout(300)

SHA = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(root: Path, repo: str, source: Path) -> Path:
    """`source` laid out as the Hub cache does: models--org--name/{refs/main,snapshots/<sha>}."""
    storage = root / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / SHA
    shutil.copytree(source, snapshot)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(SHA)
    return snapshot


def test_the_hub_cache_setting_wins_over_the_environment(tmp_path, monkeypatch, tiny_model_dir):
    snapshot = fake_hub_cache(tmp_path / "mounted", "org/name", tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    resolved = resolve_model("org/name", hub_cache=tmp_path / "mounted")
    assert (resolved.path, resolved.sha) == (snapshot, SHA)
    settings = Settings(model_id="org/name", huggingface_hub_cache=str(tmp_path / "mounted"))
    assert preflight_context(settings) == 1024  # preflight reads config.json from there
    with pytest.raises(ModelError, match="elsewhere"):
        resolve_model("org/name")  # without it: HF_HUB_CACHE, which lacks the model


def preflight_context(settings: Settings) -> int:
    from dataclasses import replace

    return preflight(replace(settings, no_envoy=True, grpc_port=0)).context


def test_weights_cache_override_reads_the_folder_and_keeps_the_name(tmp_path, tiny_model_dir):
    folder = tmp_path / "weights"
    shutil.copytree(tiny_model_dir, folder)
    lm = load_model("org/not-on-any-hub", dtype="float32", options=LoadOptions(folder=str(folder)))
    assert lm.resolved.model_id == "org/not-on-any-hub" and lm.resolved.path == folder
    assert (
        preflight_context(
            Settings(model_id="org/not-on-any-hub", weights_cache_override=str(folder))
        )
        == 1024
    )
    (folder / "model.safetensors").unlink()
    with pytest.raises(SettingError, match="--weights-cache-override .*no safetensors"):
        preflight_context(Settings(weights_cache_override=str(folder)))


# --trust-remote-code ----------------------------------------------------------------------

CONFIGURATION = """
from transformers import LlamaConfig


class TinyCustomConfig(LlamaConfig):
    model_type = "textgen-tiny-custom"
"""
MODELING = """
from transformers import LlamaForCausalLM

from .configuration_tiny import TinyCustomConfig


class TinyCustomForCausalLM(LlamaForCausalLM):
    config_class = TinyCustomConfig
"""


@pytest.fixture(scope="module")
def remote_code_model(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny Llama as a model whose type only its own code knows (auto_map)."""
    folder = tmp_path_factory.mktemp("remote") / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="textgen-tiny-custom",
        architectures=["TinyCustomForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_tiny.TinyCustomConfig",
            "AutoModelForCausalLM": "modeling_tiny.TinyCustomForCausalLM",
        },
    )
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_tiny.py").write_text(CONFIGURATION)
    (folder / "modeling_tiny.py").write_text(MODELING)
    return folder


def test_a_remote_code_model_is_refused_without_trust_remote_code(remote_code_model):
    with pytest.raises(SettingError, match="auto_map.*--trust-remote-code"):
        preflight_context(Settings(model_id=str(remote_code_model)))


@pytest.mark.server
def test_a_remote_code_model_serves_with_trust_remote_code(remote_code_model, tiny_model_dir):
    """Its own class loads, and it answers as the plain tiny model (the same weights)."""
    lm = load_model(str(remote_code_model), options=LoadOptions(trust_remote_code=True))
    assert type(lm.model).__name__ == "TinyCustomForCausalLM"
    tokens = []
    for model_dir, trust in ((remote_code_model, True), (tiny_model_dir, False)):
        server = ServerThread(tiny_settings(model_dir, trust_remote_code=trust)).start()
        try:
            with Client(server.target, timeout=60) as client:
                reply = client.generate("The quick brown", max_new_tokens=8, details=True)
                tokens.append([t.id for t in reply.details.tokens])
        finally:
            server.stop()
    assert tokens[0] == tokens[1]


# --rope-scaling / --rope-factor -------------------------------------------------------------


def test_rope_scaling_replaces_the_models_and_stretches_the_context(tiny_model_dir):
    plain = load_model(str(tiny_model_dir), dtype="float32")
    scaled = load_model(str(tiny_model_dir), dtype="float32", options=LoadOptions(
        rope=("linear", 2.0)))  # fmt: skip
    params = scaled.model.config.rope_parameters
    assert (params["rope_type"], params["factor"]) == ("linear", 2.0)
    assert scaled.max_position_embeddings == 2 * plain.max_position_embeddings == 2048
    # linear scaling divides every position by the factor: the rotary frequencies halve
    rotary = scaled.model.model.rotary_emb
    position = torch.tensor([[6]])
    x = torch.zeros(1, 1, 1)
    assert torch.allclose(
        rotary(x, position)[0], plain.model.model.rotary_emb(x, torch.tensor([[3]]))[0]
    )
    dynamic = _config(plain.resolved, LoadOptions(rope=("dynamic", 1.0)))
    assert dynamic.rope_parameters["rope_type"] == "dynamic"


def test_rope_scaling_is_refused_for_a_model_without_rope(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=16, n_head=2).save_pretrained(tmp_path)
    from textgen.service.models.hub import ResolvedModel

    with pytest.raises(ModelError, match="no rotary position embeddings"):
        _config(ResolvedModel("gpt2-tiny", tmp_path, None), LoadOptions(rope=("linear", 2.0)))


def test_the_rope_factor_is_what_preflight_checks_the_limits_against(tiny_model_dir):
    stretched = Settings(model_id=str(tiny_model_dir), rope_factor=2.0, max_total_tokens=2048)
    assert preflight_context(stretched) == 2048
    with pytest.raises(SettingError, match="exceeds the model's context"):
        preflight_context(Settings(model_id=str(tiny_model_dir), max_total_tokens=2048))
    assert Settings(rope_scaling="dynamic").rope == ("dynamic", 1.0)  # TGI's pairing
    assert Settings(rope_factor=3.0).rope == ("linear", 3.0)


# --tokenizer-config-path ---------------------------------------------------------------------

TEMPLATE = "{% for m in messages %}[[{{ m['role'] }}: {{ m['content'] }}]]{% endfor %}"


def test_the_tokenizer_configs_chat_template_is_used(tmp_path, tiny_model_dir):
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}))
    from textgen.service.replica.assembly import load_options

    options = load_options(Settings(tokenizer_config_path=str(path)))
    lm = load_model(str(tiny_model_dir), options=options)
    messages = [{"role": "user", "content": "hi"}]
    assert lm.tokenizer.apply_chat_template(messages, tokenize=False) == "[[user: hi]]"
    named = tmp_path / "named.json"
    named.write_text(json.dumps({"chat_template": [{"name": "default", "template": TEMPLATE}]}))
    assert load_options(Settings(tokenizer_config_path=str(named))).chat_template == {
        "default": TEMPLATE
    }


@pytest.mark.parametrize(
    ("content", "rule"),
    [(None, "cannot be read"), ("{", "is not JSON"), ('{"eos_token": "x"}', "no chat_template")],
)
def test_a_tokenizer_config_without_a_chat_template_is_refused(tmp_path, content, rule):
    path = tmp_path / "tokenizer_config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SettingError, match=f"--tokenizer-config-path .*{rule}"):
        preflight_context(Settings(tokenizer_config_path=str(path)))
