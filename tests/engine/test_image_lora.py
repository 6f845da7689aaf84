"""LoRA adapters on a vision-language model (a tiny LLaVA) through the engine core: an
adapter peft trained on the whole model, on its language model's layers, gives what
peft's PeftModel generates from transformers' processor's inputs, image and all (and the
base model's requests in the same batch the base model's answer); an adapter saved with
transformers 4's layer names (`language_model.model.layers...`) is the same adapter; one
on the vision tower is refused naming its layer."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from support.lora_adapters import make_adapter
from textgen.service.engine.adapters import AdapterRegistry
from textgen.service.engine.config import EngineConfig
from textgen.service.engine.paged_core import PagedCore
from textgen.service.models.lora import WEIGHTS_NAME, AdapterError, read_adapter
from textgen.service.models.lora_layers import LoraLayers
from textgen.service.models.sharding import language_model

from .factories import run_to_completion
from .test_images import BLUE, RED, load, picture, prompt, reference, sequence

pytestmark = pytest.mark.timeout(120)

RANK = 8
# the language model's attention and MLP (a regex: the CLIP tower has q_proj too)
LANGUAGE_TARGETS = r".*language_model.*\.(q_proj|v_proj|o_proj|gate_proj|down_proj)"


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from support.tiny_vlm import build_tiny_llava

    return load(build_tiny_llava(tmp_path_factory.mktemp("llava")))


@pytest.fixture(scope="module")
def adapter_dir(llava, tmp_path_factory) -> str:
    model, _ = llava
    folder = tmp_path_factory.mktemp("adapter") / "language"
    return make_adapter(model, folder, RANK, LANGUAGE_TARGETS, seed=3, std=0.3)


def slots_of(model) -> LoraLayers:
    """The language model's LoRA slots, as the loader gives a vision-language model."""
    return LoraLayers(
        model, 2, RANK, torch.float32, torch.device("cpu"), scope=language_model(model)
    )


def test_an_adapter_on_the_language_model_equals_peft(llava, adapter_dir):
    model, processor = llava
    served = copy.deepcopy(model)
    layers = slots_of(served)
    assert layers.layers and all(n.startswith("model.language_model.") for n in layers.layers)
    registry = AdapterRegistry(2, RANK)
    adapter = registry.add(read_adapter("lang", adapter_dir, layers))
    core = PagedCore(
        served,
        EngineConfig(
            max_batch_total_tokens=4096, max_batch_prefill_tokens=12, max_batch_size=8, block_size=4
        ),
        lora=layers,
        adapters=registry,
    )
    text = prompt(processor)
    adapted = sequence(processor, text, [picture(RED)], "adapted")
    adapted.request = replace(adapted.request, adapter_id="lang", adapter_uid=adapter.uid)
    base = sequence(processor, text, [picture(RED)], "base")
    other = sequence(processor, text, [picture(BLUE)], "other")
    other.request = replace(other.request, adapter_id="lang", adapter_uid=adapter.uid)
    for seq in (adapted, base, other):
        core.add(seq)
    run_to_completion(core)
    peft = PeftModel.from_pretrained(copy.deepcopy(model), adapter_dir).eval()
    assert adapted.output_ids == reference(peft, processor, text, [picture(RED)])
    assert other.output_ids == reference(peft, processor, text, [picture(BLUE)])
    assert base.output_ids == reference(model, processor, text, [picture(RED)])
    assert adapted.output_ids != base.output_ids  # the adapter reaches the answer


def test_transformers_4_layer_names_are_the_same_adapter(llava, adapter_dir, tmp_path):
    """peft's keys as an adapter trained under transformers 4 has them."""
    import shutil

    model, _ = llava
    old = tmp_path / "old"
    shutil.copytree(adapter_dir, old)
    tensors = load_file(old / WEIGHTS_NAME)
    renamed = {
        k.replace(
            "base_model.model.model.language_model.", "base_model.model.language_model.model."
        ): v
        for k, v in tensors.items()
    }
    assert renamed.keys() != tensors.keys()
    save_file(renamed, old / WEIGHTS_NAME)
    layers = slots_of(copy.deepcopy(model))
    now, then = (read_adapter(n, str(f), layers) for n, f in (("now", adapter_dir), ("then", old)))
    assert now.layers.keys() == then.layers.keys()
    for name, (a, b) in now.layers.items():
        assert torch.equal(a, then.layers[name][0]) and torch.equal(b, then.layers[name][1])


def test_an_adapter_on_the_vision_tower_is_refused_by_name(llava, tmp_path):
    model, _ = llava
    folder = make_adapter(model, tmp_path / "vision", RANK, ["q_proj"], seed=4)  # CLIP's too
    with pytest.raises(AdapterError) as refused:
        read_adapter("vision", folder, slots_of(copy.deepcopy(model)))
    message = str(refused.value)
    assert "model.vision_tower." in message and "vision tower or projector" in message
