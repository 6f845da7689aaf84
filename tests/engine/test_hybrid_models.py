"""Hybrid and state-space models on the state pool (engine/state_pool.py): each running
sequence's Mamba, Gated DeltaNet or convolution state in a slot of its own, carried from
prefill chunk to chunk, updated in place by every decode, given back at finish or
preemption (and recomputed after one), copied for each of a request's other choices.
Tiny random models of each family from transformers' own config classes
(tests/support/families.py's STATE_FAMILIES), float32, against their own `generate`.
The same families go through a real server in tests/integration/test_family_matrix.py."""

from __future__ import annotations

import pytest
import torch
from support.families import STATE_FAMILIES
from textgen.service.engine.kv_pool import KVCachePool
from textgen.service.engine.runners.model_runner import ModelRunner
from textgen.service.engine.types import SamplingParams
from textgen.service.models.state_layers import (
    probe_states,
    state_bytes_per_sequence,
    state_kernels,
)
from textgen.service.replica.kv_sizing import kv_bytes_per_token
from transformers import AutoConfig, AutoModelForCausalLM

from .factories import (
    VOCAB_SIZE,
    assert_idle,
    assert_matches_generate,
    make_core,
    make_seq,
    random_prompt,
    reference_greedy,
    run_to_completion,
)
from .test_choices import alone, choices

# every family of STATE_FAMILIES, by name (the families table checks each is here)
FAMILIES = [
    "qwen3_next", "qwen3_5_text", "granitemoehybrid", "nemotron_h", "jamba", "falcon_h1",
    "bamba", "lfm2", "mamba", "mamba2", "falcon_mamba", "qwen3_5_moe_text", "qwen3_5",
    "qwen3_5_moe", "lara_mini", "olmo_hybrid", "kimi_linear", "bailing_hybrid", "lfm2_moe",
    "lfm3", "zamba", "zamba2", "zaya",
]  # fmt: skip


def tiny(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB_SIZE, **STATE_FAMILIES[model_type])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def test_the_list_is_the_table():
    assert sorted(FAMILIES) == sorted(STATE_FAMILIES)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_greedy_tokens_equal_generate_through_chunks_and_preemption(model_type):
    """Prompts of 1 to 40 tokens through a 12-block pool of 8 and a prefill budget of 16:
    prompts split into chunks (a later chunk continues from the state the earlier left;
    Mamba-1's token by token), decodes run beside them, a 1-token prompt decodes from its
    first step, and growing sequences preempt others, whose state is recomputed."""
    model = tiny(model_type)
    g = torch.Generator().manual_seed(1)
    seqs = [
        make_seq(random_prompt(n, VOCAB_SIZE, g), request_id=f"r{i}", max_new_tokens=8 + i)
        for i, n in enumerate([5, 23, 40, 1, 17])
    ]
    core = make_core(model, total_tokens=96, prefill_tokens=16, batch_size=4, block_size=8)
    for seq in seqs:
        core.add(seq)
    slots_used = []
    while core.has_work():
        core.step()
        stats = core.stats()
        slots_used.append(stats.state_slots_used)
        assert stats.state_slots_used == stats.running  # one slot per running sequence
    assert_matches_generate(model, seqs)
    stats = core.stats()
    assert stats.preemptions > 0 and stats.state_slots_total == 4 and max(slots_used) == 4
    assert stats.state_slots_used == 0
    assert_idle(core)


@pytest.mark.parametrize("model_type", ["qwen3_next", "jamba"])
def test_each_choice_samples_from_a_copy_of_the_prompts_state(model_type):
    """n = 3: the prompt is computed once; each other choice forks the state after it
    into a slot of its own, and samples (seeded) what an n = 1 request with its seed
    samples alone."""
    model = tiny(model_type)
    g = torch.Generator().manual_seed(2)
    sampling = SamplingParams(do_sample=True, temperature=0.7, seed=5)
    seqs = choices(random_prompt(19, VOCAB_SIZE, g), 3, sampling=sampling)
    core = make_core(model, prefill_tokens=8, batch_size=4)
    core.add(seqs[0])
    run_to_completion(core)
    assert core.stats().state_slots_used == 0
    for seq in seqs:
        assert seq.output_ids == alone(model, seq, prefill_tokens=8, batch_size=4), seq.request_id
    assert len({tuple(s.output_ids) for s in seqs}) > 1  # the choices differ


def test_prefix_caching_is_off_and_the_state_recomputed():
    """A cached prefix would skip the state layers' pass over it: a hybrid engine caches
    nothing (its config asks for prefix caching), and a repeated prompt gets the same
    tokens."""
    model = tiny("granitemoehybrid")
    prompt = random_prompt(40, VOCAB_SIZE, torch.Generator().manual_seed(3))
    core = make_core(model, block_size=8)
    assert core.config.enable_prefix_caching and not core.block_manager.enable_prefix_caching
    seqs = [make_seq(prompt, request_id=f"r{i}") for i in range(2)]
    for seq in seqs:
        core.add(seq)
        run_to_completion(core)
    assert core.stats().prefix_cache_hit_tokens == 0
    assert_matches_generate(model, seqs)


def test_slots_bound_the_running_sequences():
    """Two slots: of four requests two run at once; the others wait for a slot."""
    model = tiny("mamba2")
    g = torch.Generator().manual_seed(4)
    seqs = [make_seq(random_prompt(9, VOCAB_SIZE, g), request_id=f"r{i}") for i in range(4)]
    core = make_core(model, batch_size=2)
    for seq in seqs:
        core.add(seq)
    core.step()
    stats = core.stats()
    assert (stats.running, stats.waiting, stats.state_slots_used) == (2, 2, 2)
    run_to_completion(core)
    assert_matches_generate(model, seqs)


def test_a_request_of_more_choices_than_slots_is_refused():
    core = make_core(tiny("lfm2"), batch_size=2)
    seqs = choices([1, 2, 3], 3)
    with pytest.raises(Exception, match="state slots"):
        core.add(seqs[0])


def test_batch_invariant_is_refused_by_the_runner():
    model = tiny("bamba")
    with pytest.raises(ValueError, match="state layers don't run batch-invariant"):
        ModelRunner(model, KVCachePool(4, 8, scratch_blocks=1), batch_invariant=True)


def test_the_state_and_kv_sizes_come_from_the_layers():
    """A sequence's state: each state layer's conv window and recurrent state, as
    transformers stores them; the KV pool's bytes per token count the attention layers
    only (none for Mamba)."""
    qwen = tiny("qwen3_next")  # a Gated DeltaNet layer, a full-attention one
    shapes = probe_states(qwen)
    assert list(shapes) == [0]
    conv, recurrent = shapes[0].conv, shapes[0].recurrent
    # q, k (2 heads of 16) and v (4 heads of 16) through a 4-tap window; per value head a
    # 16 x 16 state
    assert conv == ((2 * 32 + 64, 4), torch.float32)
    assert recurrent == ((4, 16, 16), torch.float32)
    assert state_bytes_per_sequence(shapes) == (128 * 4 + 4 * 16 * 16) * 4
    one_layer = 2 * 2 * 16 * 4  # K and V, 2 KV heads of 16, float32
    assert kv_bytes_per_token(qwen, torch.float32) == one_layer
    assert kv_bytes_per_token(tiny("mamba"), torch.float32) == 0
    # flash-linear-attention isn't installed here: the delta rule runs transformers' torch
    # code (its convolution may resolve to a package another library ships: gptqmodel's)
    assert "torch" in state_kernels(qwen).split(", ")


def test_a_state_pool_larger_than_the_cache_memory_is_refused(monkeypatch):
    """--max-batch-size slots of state must fit, with one full-length request's KV, in
    the memory the cache may use; the refusal says how many would."""
    from textgen.service.models import LoadedModel
    from textgen.service.replica import kv_sizing
    from textgen.service.settings.table import SettingError, Settings

    model = tiny("qwen3_next")
    per_sequence = state_bytes_per_sequence(probe_states(model))
    loaded = LoadedModel(None, model, None, torch.float32, torch.device("cpu"), frozenset(), 64)
    kv = 64 * kv_bytes_per_token(model, torch.float32)  # one request of 64 tokens
    share = kv + 10 * per_sequence  # room for ten slots beside it
    monkeypatch.setattr(kv_sizing, "free_memory_bytes", lambda *_: share * 10)  # a tenth
    fits = kv_sizing.kv_capacity_tokens(Settings(max_batch_size=10), loaded, 64)
    assert fits == 64  # the ten slots, then that request's KV
    with pytest.raises(SettingError, match=r"^--max-batch-size 11: .*at most 10\)"):
        kv_sizing.kv_capacity_tokens(Settings(max_batch_size=11), loaded, 64)


@pytest.mark.parametrize(
    ("model_type", "targets"),
    [
        ("qwen3_next", ["q_proj", "in_proj_qkvz", "out_proj"]),  # Gated DeltaNet's own
        ("jamba", ["in_proj", "x_proj", "out_proj", "v_proj"]),  # Mamba-1's, token by token
    ],
)
def test_lora_adapters_on_state_layers_equal_each_merged_model(model_type, targets, tmp_path):
    """Adapters on the state layers' projections (and an attention one): each group of
    sequences a state layer runs reads its own rows of the step's LoRA layout; a batch
    mixing two adapters and the base model, in chunks beside decodes, gives each
    sequence what peft's merged model generates alone."""
    import copy

    from peft import PeftModel
    from support.lora_adapters import make_adapter
    from textgen.service.engine.adapters import AdapterRegistry
    from textgen.service.engine.config import EngineConfig
    from textgen.service.engine.paged_core import PagedCore
    from textgen.service.models.lora import read_adapter
    from textgen.service.models.lora_layers import LoraLayers

    from .test_lora import with_adapter

    base = tiny(model_type)
    folders = {
        name: make_adapter(base, tmp_path / name, rank, targets, seed)
        for seed, (name, rank) in enumerate([("a", 4), ("b", 8)])
    }
    merged = {None: base}
    for name, folder in folders.items():
        peft_model = PeftModel.from_pretrained(copy.deepcopy(base), folder)
        merged[name] = peft_model.merge_and_unload().eval()
    model = copy.deepcopy(base)
    layers = LoraLayers(model, 2, 8, torch.float32, torch.device("cpu"))
    registry = AdapterRegistry(2, 8)
    for name, folder in folders.items():
        registry.add(read_adapter(name, folder, layers))
    config = EngineConfig(
        max_batch_total_tokens=2048, max_batch_prefill_tokens=16, max_batch_size=8
    )
    core = PagedCore(model, config, lora=layers, adapters=registry)
    g = torch.Generator().manual_seed(6)
    seqs = []
    for i, name in enumerate([None, "a", "b", "a", "b", None]):
        seq = make_seq(random_prompt(4 + 7 * i, VOCAB_SIZE, g), request_id=f"s{i}")
        seqs.append((name, with_adapter(seq, registry, name)))
        core.add(seq)
        if i % 2:
            core.step()
    run_to_completion(core)
    for name, seq in seqs:
        expected = reference_greedy(merged[name], list(seq.request.prompt_ids), 8)
        assert seq.output_ids == expected, f"{seq.request_id} on {name or 'the base model'}"
    prompt = list(seqs[0][1].request.prompt_ids)
    assert len({tuple(reference_greedy(m, prompt, 8)) for m in merged.values()}) == 3
