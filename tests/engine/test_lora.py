"""LoRA adapters in the engine: a batch mixing the base model and adapters gives each
sequence what peft's merged model generates alone, the prefix cache never serves one
adapter's K/V to another, the scheduler keeps a step within the slots, and adapters are
read and refused as peft wrote them."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch
from peft import PeftModel
from support.lora_adapters import make_adapter
from textgen.service.engine.adapters import AdapterRegistry, SlotTable
from textgen.service.engine.config import EngineConfig
from textgen.service.engine.paged_core import PagedCore
from textgen.service.engine.runners.model_runner import StepInputs
from textgen.service.engine.runners.sharded import _sizes, decode, encode
from textgen.service.engine.types import EngineError
from textgen.service.models.lora import AdapterError, read_adapter
from textgen.service.models.lora_layers import LoraLayers

from .factories import (
    VOCAB_SIZE,
    assert_idle,
    make_seq,
    random_prompt,
    reference_greedy,
    run_to_completion,
)

# (rank, target modules): the three ranks, each on other layers
ADAPTERS = {
    "r8": (8, ["q_proj", "v_proj"]),
    "r16": (16, ["o_proj", "gate_proj", "down_proj"]),
    "r64": (64, ["k_proj", "up_proj", "q_proj"]),
}
MAX_RANK = 64


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_adapter(tiny_llama, root / name, rank, targets, seed)
        for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def merged(tiny_llama, adapter_dirs) -> dict[str | None, torch.nn.Module]:
    """peft's own merged model per adapter (None: the base), the reference."""
    refs = {None: tiny_llama}
    for name, folder in adapter_dirs.items():
        model = PeftModel.from_pretrained(copy.deepcopy(tiny_llama), folder)
        refs[name] = model.merge_and_unload().eval()
    return refs


def lora_core(base, adapter_dirs, *, slots: int = 3, proposer=None, **options):
    """A core over a copy of `base` with LoRA slots and every adapter of adapter_dirs."""
    model = copy.deepcopy(base)
    layers = LoraLayers(model, slots, MAX_RANK, torch.float32, torch.device("cpu"))
    registry = AdapterRegistry(slots, MAX_RANK)
    for name, folder in adapter_dirs.items():
        registry.add(read_adapter(name, folder, layers))
    core = PagedCore(
        model,
        EngineConfig(
            max_batch_total_tokens=options.pop("total_tokens", 8192),
            max_batch_prefill_tokens=options.pop("prefill_tokens", 512),
            max_batch_size=32,
            **options,
        ),
        proposer=proposer,
        lora=layers,
        adapters=registry,
    )
    return core, registry


def with_adapter(seq, registry: AdapterRegistry, name: str | None):
    if name is not None:
        adapter = registry.lookup(name)
        seq.request = replace(seq.request, adapter_id=name, adapter_uid=adapter.uid)
    return seq


def assert_matches_merged(merged, seqs_by_adapter):
    for name, seq in seqs_by_adapter:
        expected = reference_greedy(
            merged[name], list(seq.request.prompt_ids), seq.request.stopping.max_new_tokens
        )
        assert seq.output_ids == expected, f"{seq.request_id} on {name or 'the base model'}"


def test_a_batch_mixing_adapters_and_the_base_equals_each_merged_model(
    tiny_llama, adapter_dirs, merged
):
    core, registry = lora_core(tiny_llama, adapter_dirs)
    g = torch.Generator().manual_seed(3)
    names = [None, *ADAPTERS]
    seqs = []
    for i in range(16):  # decodes and prefill chunks of every adapter in the same steps
        name = names[i % 4]
        seq = make_seq(random_prompt(3 + 11 * i, VOCAB_SIZE, g), request_id=f"s{i}")
        seqs.append((name, with_adapter(seq, registry, name)))
        core.add(seqs[-1][1])
        if i % 5 == 4:
            core.step()
    run_to_completion(core)
    assert_matches_merged(merged, seqs)
    # and the adapters matter: four models, four different answers to one prompt
    prompt = list(seqs[0][1].request.prompt_ids)
    assert len({tuple(reference_greedy(m, prompt, 8)) for m in merged.values()}) == 4
    assert_idle(core)
    assert all(registry.in_use(a.uid) == 0 for a in registry.serving())


def test_the_prefix_cache_never_serves_one_adapters_blocks_to_another(
    tiny_llama, adapter_dirs, merged
):
    core, registry = lora_core(tiny_llama, adapter_dirs)
    prompt = random_prompt(80, VOCAB_SIZE, torch.Generator().manual_seed(4))  # 5 full blocks
    bm = core.block_manager
    runs = []
    for name in ["r8", "r16", None, "r8"]:
        before = bm.prefix_hit_tokens
        seq = with_adapter(make_seq(prompt, request_id=f"p-{name}"), registry, name)
        core.add(seq)
        run_to_completion(core)
        runs.append((name, seq))
        # only the second r8 request finds its prompt cached (the base and r16 recompute)
        assert bm.prefix_hit_tokens - before == (64 if len(runs) == 4 else 0)
    assert_matches_merged(merged, runs)
    assert runs[0][1].output_ids == runs[3][1].output_ids != runs[1][1].output_ids


def test_the_scheduler_keeps_the_running_adapters_within_the_slots(
    tiny_llama, adapter_dirs, merged
):
    """One slot and three adapters: they take turns (the slot rewritten each time), in
    arrival order, and each still equals its merged model."""
    core, registry = lora_core(tiny_llama, adapter_dirs, slots=1)
    g = torch.Generator().manual_seed(5)
    seqs = []
    for i, name in enumerate(["r8", "r16", None, "r8", "r64", "r16"]):
        seq = make_seq(random_prompt(10 + i, VOCAB_SIZE, g), request_id=f"t{i}")
        seqs.append((name, with_adapter(seq, registry, name)))
        core.add(seqs[-1][1])
    while core.has_work():
        core.step()
        running = {s.request.adapter_uid for s in core.scheduler.running} - {0}
        assert len(running) <= 1
    assert_matches_merged(merged, seqs)


def test_an_unloaded_adapter_serves_its_running_sequences_then_goes(
    tiny_llama, adapter_dirs, merged
):
    core, registry = lora_core(tiny_llama, adapter_dirs)
    prompt = random_prompt(12, VOCAB_SIZE, torch.Generator().manual_seed(6))
    running = with_adapter(make_seq(prompt, request_id="u1", max_new_tokens=12), registry, "r64")
    uid = running.request.adapter_uid
    core.add(running)
    core.step()
    assert registry.unload("r64") is not None
    assert registry.lookup("r64") is None  # new requests can't name it
    assert registry.weights(uid).name == "r64"  # the running one still reads it
    late = make_seq(prompt, request_id="u2")
    late.request = replace(late.request, adapter_id="r64", adapter_uid=uid)
    with pytest.raises(EngineError, match="not loaded"):
        core.add(late)
    run_to_completion(core)
    assert_matches_merged(merged, [("r64", running)])
    with pytest.raises(KeyError):
        registry.weights(uid)


def test_slot_table_keeps_used_slots_and_evicts_the_least_recent():
    table = SlotTable(2)
    assert table.assign({7}) == ({7: 0}, [(0, 7)])
    assert table.assign({7, 9}) == ({7: 0, 9: 1}, [(1, 9)])
    assert table.assign({9}) == ({9: 1}, [])
    assert table.assign({9, 4}) == ({9: 1, 4: 0}, [(0, 4)])  # 7 was the least recent
    with pytest.raises(RuntimeError, match="2 slots"):
        table.assign({1, 2, 3})


def test_step_inputs_cross_to_other_shards_with_their_lora_slots():
    inputs = StepInputs(
        [5, 6, 7],
        [0, 1, 9],
        [2, 1],
        [2, 10],
        [[3], [4]],
        [1, 2],
        block_copies=[(3, 8)],
        lora_slots=[1, -1],
        lora_loads=[(1, 42)],
        state_slots=[0, 3],  # a hybrid model's state slots, and a fork's copy
        state_copies=[(0, 2)],
    )
    assert decode(encode(inputs), *_sizes(inputs)) == inputs
    plain = StepInputs([5], [0], [1], [1], [[3]], [0])
    assert decode(encode(plain), *_sizes(plain)) == replace(
        plain, lora_slots=[-1], state_slots=[-1]
    )


# reading and refusing adapters -------------------------------------------------------


@pytest.fixture
def layers(tiny_llama):
    return LoraLayers(copy.deepcopy(tiny_llama), 1, 16, torch.float32, torch.device("cpu"))


def test_a_rank_above_the_slots_is_refused(layers, adapter_dirs):
    with pytest.raises(AdapterError, match="'r64'.*rank 64, above --max-lora-rank 16"):
        read_adapter("r64", adapter_dirs["r64"], layers)


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"target_modules": ["lm_head"]}, "lm_head.*which is not a LoRA weight textgen serves"),
        ({"bias": "lora_only"}, "trained biases"),
    ],
)
def test_what_textgen_does_not_serve_is_refused_naming_it(
    tiny_llama, layers, tmp_path, options, reason
):
    targets = options.pop("target_modules", ["q_proj"])
    folder = make_adapter(tiny_llama, tmp_path / "a", 4, targets, 0, **options)
    with pytest.raises(AdapterError, match=reason):
        read_adapter("a", folder, layers)


def test_an_adapter_of_another_base_model_is_refused(tiny_llama, layers, tmp_path):
    folder = make_adapter(tiny_llama, tmp_path / "a", 4, ["q_proj"], 0)
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "meta-llama/Llama-3.1-8B"
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="trained on 'meta-llama/Llama-3.1-8B'.*'tiny/model'"):
        read_adapter("a", folder, layers, base_names=("tiny/model",))
    # the same model under another folder: its last path component
    assert read_adapter("a", folder, layers, base_names=("/x/Llama-3.1-8B",)).rank == 4


def test_pickled_weights_and_missing_folders_are_refused(tiny_llama, layers, tmp_path):
    folder = make_adapter(tiny_llama, tmp_path / "a", 4, ["q_proj"], 0)
    (tmp_path / "a" / "adapter_model.safetensors").rename(tmp_path / "a" / "adapter_model.bin")
    with pytest.raises(AdapterError, match="found adapter_model.bin.*only safetensors"):
        read_adapter("a", folder, layers)
    with pytest.raises(AdapterError, match="neither an adapter folder nor a Hub repo id"):
        read_adapter("b", str(tmp_path / "nowhere" / "x" / "y"), layers)


# the runner strategies and the CUDA kernel ---------------------------------------------


def test_the_bgmv_kernel_equals_the_segment_matmuls(tiny_llama, adapter_dirs):
    """Triton's BGMV (each token gathers its slot in place; run by the interpreter here)
    against the torch SGMV reference, on tokens of two adapters and the base, interleaved."""
    from textgen.service.models.lora_layers import LoraStep, segment_delta
    from textgen.service.models.lora_triton import bgmv_delta

    layers = LoraLayers(copy.deepcopy(tiny_llama), 2, MAX_RANK, torch.float32, torch.device("cpu"))
    registry = AdapterRegistry(2, MAX_RANK)
    for slot, name in enumerate(["r16", "r64"]):
        layers.write(slot, registry.add(read_adapter(name, adapter_dirs[name], layers)))
    entry_slots, query_lens = [0, -1, 1, 0, 1, -1], [1, 1, 3, 2, 1, 4]
    step = LoraStep.build(entry_slots, query_lens, torch.device("cpu"), kernel=True)
    g = torch.Generator().manual_seed(8)
    for name in ["model.layers.0.mlp.up_proj", "model.layers.1.mlp.down_proj"]:
        layer = layers.layers[name]
        x = torch.randn(1, sum(query_lens), layer.in_features, generator=g)
        y = torch.randn(1, sum(query_lens), layer.out_features, generator=g)
        expected = segment_delta(layer, x, y.clone(), step.segments)
        assert not torch.equal(expected, y)
        torch.testing.assert_close(bgmv_delta(layer, x, y.clone(), step.token_slots), expected)


def test_decodes_from_static_buffers_read_each_rows_slot(tiny_llama, adapter_dirs, merged):
    """The CUDA-graph strategy's static path (on CPU without a graph): each row's slot in
    the graph's own buffer, the deltas from the BGMV kernel, prefills eager."""
    from textgen.service.engine.runners.cuda_graphs import GraphSettings

    graphs = GraphSettings((1, 2, 4, 8), 16, capture=False)
    core, registry = lora_core(tiny_llama, adapter_dirs, cuda_graphs=graphs)
    core.warm_up()
    g = torch.Generator().manual_seed(9)
    names = [None, *ADAPTERS, "r8", None]
    seqs = [
        (
            n,
            with_adapter(
                make_seq(random_prompt(5 + 3 * i, VOCAB_SIZE, g), request_id=f"g{i}"), registry, n
            ),
        )
        for i, n in enumerate(names)
    ]
    for _, seq in seqs:
        core.add(seq)
    run_to_completion(core)
    assert core.runner.stats.graph_steps > 0
    assert_matches_merged(merged, seqs)


@pytest.mark.timeout(600)
def test_compiled_decodes_mix_adapters_without_recompiling(tiny_llama, adapter_dirs, merged):
    """--compile: the LoRA deltas are one opaque op in the graph, so steps of any adapters
    run through the graphs compiled at warm-up."""
    import torch._dynamo
    from textgen.service.engine.runners.compiled import CompileSettings

    core, registry = lora_core(tiny_llama, adapter_dirs, compile=CompileSettings((1, 2, 4)))
    core.warm_up()
    compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(10)
    seqs = [
        (
            n,
            with_adapter(
                make_seq(random_prompt(6 + i, VOCAB_SIZE, g), request_id=f"c{i}"), registry, n
            ),
        )
        for i, n in enumerate([None, "r8", "r16", "r64"])
    ]
    for _, seq in seqs:
        core.add(seq)
    run_to_completion(core)
    assert core.runner.stats.compiled_steps > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiles
    assert_matches_merged(merged, seqs)


def test_adapters_serve_over_quantized_layers(tiny_llama, adapter_dirs):
    """--quantize: the base layers int8 (a CPU int8 kernel, in bfloat16), the adapters in
    the model's dtype beside them: each layer adds its delta to the quantized product."""
    from textgen.service.models.lora_layers import LoraStep, bound_lora
    from textgen.service.models.quantize import QuantizedLinear, quantize_model

    model = copy.deepcopy(tiny_llama).to(torch.bfloat16)
    quantize_model(model, "int8", torch.device("cpu"))
    layers = LoraLayers(model, 1, MAX_RANK, torch.bfloat16, torch.device("cpu"))
    registry = AdapterRegistry(1, MAX_RANK)
    adapter = registry.add(read_adapter("r16", adapter_dirs["r16"], layers))
    layers.write(0, adapter)
    layer = layers.layers["model.layers.1.mlp.down_proj"]
    assert isinstance(layer.base, QuantizedLinear)  # int8: torch's or textgen's kernel
    x = torch.randn(1, 3, layer.in_features, dtype=torch.bfloat16)
    a, b = adapter.layers["model.layers.1.mlp.down_proj"]
    with bound_lora(LoraStep.build([0], [3], torch.device("cpu"))):
        out = layer(x)
    torch.testing.assert_close(out, layer.base(x) + (x @ a.T) @ b)
    core = PagedCore(
        model,
        EngineConfig(max_batch_total_tokens=1024, max_batch_prefill_tokens=256, max_batch_size=8),
        lora=layers,
        adapters=registry,
    )
    prompt = random_prompt(9, VOCAB_SIZE, torch.Generator().manual_seed(11))
    seqs = [
        with_adapter(make_seq(prompt, request_id=n or "base"), registry, n) for n in (None, "r16")
    ]
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    assert seqs[0].output_ids != seqs[1].output_ids


def test_adapters_with_speculation_and_choices_equal_each_merged_model(
    tiny_llama, adapter_dirs, merged
):
    """--speculate verifies each adapter's proposals through its LoRA rows (chunks of
    1 + N; the proposer knows each merged model's answer, one proposal in four wrong), and
    the n greedy choices of an adapter's request fork holding it: unloaded once their
    prompt is computed, it serves every choice to the end, then goes."""
    from textgen.service.engine.sequence import Sequence
    from textgen.service.engine.speculation import SpeculationSettings

    from .test_speculation import ScriptedProposer

    g = torch.Generator().manual_seed(7)
    seqs = [
        (name, make_seq(random_prompt(6 + 5 * i, VOCAB_SIZE, g), request_id=f"k{i}"))
        for i, name in enumerate([None, *ADAPTERS, "r16"])
    ]
    expected = {
        seq.request_id: reference_greedy(merged[name], list(seq.request.prompt_ids), 16)
        for name, seq in seqs
    }
    proposer = ScriptedProposer(expected)
    core, registry = lora_core(
        tiny_llama,
        adapter_dirs,
        speculation=SpeculationSettings(3, 64, adaptive=False),
        proposer=proposer,
    )
    for name, seq in seqs:
        core.add(with_adapter(seq, registry, name))
    first = make_seq(random_prompt(20, VOCAB_SIZE, g), request_id="c", max_new_tokens=10)
    request = replace(with_adapter(first, registry, "r16").request, n=3)
    choices = [Sequence(r, first.eos_token_ids, choice=i) for i, r in enumerate(request.choices())]
    choices[0].forks = choices[1:]
    core.add(choices[0])
    core.step()  # every prompt computed: the choices forked
    assert registry.in_use(request.adapter_uid) == 5  # k2, k4 and the three choices
    assert registry.unload("r16") is not None
    run_to_completion(core)
    assert core.stats().spec_accepted_tokens > 0
    assert_matches_merged(merged, seqs + [("r16", c) for c in choices])
    with pytest.raises(KeyError):
        registry.weights(request.adapter_uid)
    assert_idle(core)
