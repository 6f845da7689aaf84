"""bfloat16 RMSNorm in one op call (service/models/fused_norms.py, `textgen::rms_norm` in
avx512_bf16.cpp): the same numbers as transformers' own RMSNorm forward, only for the norms
that compute it bit for bit (not Gemma's `1 + weight`, not one rounding once, not a gated
norm, not float32), the model's logits unchanged, compiled graphs tracing transformers'
forward, and the loader adding it with the default dtype's int8 copies where the CPU
computes bfloat16 natively."""

from __future__ import annotations

import pytest
import torch
from support.tiers import needs_avx512_bf16
from support.tiny_model import build_tiny_model
from textgen.service.models import avx512_bf16, fused_norms, load_model
from textgen.service.models.fused_norms import RMS_NORM, fuse_rms_norms
from textgen.service.models.loader import LoadOptions
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated


@pytest.fixture(scope="module", autouse=True)
def kernels():
    """The op's CPU kernel, registered when the kernels are compiled or loaded (where the
    CPU has the instructions: the tests that need them say so, the rest run anywhere)."""
    if avx512_bf16.cpu_supports():
        assert avx512_bf16.available()


def llama_norm(size: int, seed: int = 0) -> LlamaRMSNorm:
    torch.manual_seed(seed)
    norm = LlamaRMSNorm(size, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(size))
    return norm


@needs_avx512_bf16
@pytest.mark.parametrize("size", [576, 64, 72, 7])  # 16-wide vectors, and tails
@pytest.mark.parametrize("leading", [(1, 1), (2, 37), (300,)])  # a decode, a chunk, threads
def test_the_op_computes_transformers_rms_norm(size, leading):
    norm = llama_norm(size)
    x = (torch.randn(*leading, size) * 3).to(torch.bfloat16)
    with torch.inference_mode():
        want, got = norm(x), RMS_NORM(x, norm.weight, 1e-5)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    # the float32 sum in another order: one bfloat16 step at most, almost always none
    step = want.float().abs() * 2**-7
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got == want).float().mean() > 0.99


class OnceRoundedRMSNorm(LlamaRMSNorm):
    """A norm multiplying by the weight in float32 and rounding once (as some families do):
    one bfloat16 step from the op on some values, so not fused."""

    def forward(self, x):
        h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
        return (self.weight.float() * h).to(x.dtype)


@needs_avx512_bf16
def test_only_the_norms_that_compute_it_are_fused():
    gemma = GemmaRMSNorm(64).to(torch.bfloat16)  # x * (1 + weight)
    gated = MambaRMSNormGated(64, group_size=64).to(torch.bfloat16)  # a gate beside its input
    once = OnceRoundedRMSNorm(64, eps=1e-5)
    once.weight.data = llama_norm(64).weight.data.float()
    model = torch.nn.ModuleList(
        [llama_norm(64), gemma, gated, LlamaRMSNorm(64), once, torch.nn.Linear(64, 64)]
    ).to(torch.bfloat16)
    model[3].float()  # a float32 norm: transformers' forward
    assert fuse_rms_norms(model) == 1
    assert [type(m).__name__ for m in model] == [
        "FusedLlamaRMSNorm",
        "GemmaRMSNorm",
        "MambaRMSNormGated",
        "LlamaRMSNorm",
        "OnceRoundedRMSNorm",
        "Linear",
    ]
    assert fuse_rms_norms(model) == 0  # once
    x = torch.randn(2, 64).to(torch.bfloat16)
    with torch.inference_mode():  # float32 input to a fused norm: transformers' forward
        assert torch.equal(model[0](x.float()), LlamaRMSNorm.forward(model[0], x.float()))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("fused_norms"))


@needs_avx512_bf16
def test_the_models_logits_are_unchanged(tiny_dir):
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16).eval()
    fused = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16).eval()
    assert fuse_rms_norms(fused) == 2 * plain.config.num_hidden_layers + 1
    ids = torch.randint(
        3, plain.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1)
    )
    with torch.inference_mode():
        want, got = plain(ids).logits.float(), fused(ids).logits.float()
    assert (got - want).abs().max() <= 2**-6 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@needs_avx512_bf16
def test_a_compiled_graph_traces_transformers_forward():
    """inductor fuses transformers' norm with its neighbours: the traced graph has no op."""
    norm = llama_norm(64)
    fuse_rms_norms(norm)
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    x = torch.randn(1, 3, 64).to(torch.bfloat16)
    with torch.inference_mode():
        got = torch.compile(norm, backend=backend, fullgraph=True)(x)
        want = RMS_NORM(x, norm.weight, 1e-5)
    assert graphs and "rms_norm" not in str(graphs[0].graph)
    assert "rsqrt" in str(graphs[0].graph)
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7).all()


@needs_avx512_bf16
def test_the_loader_fuses_them_with_the_copies_where_bf16_is_native(tiny_dir, monkeypatch):
    monkeypatch.setattr("textgen.service.models.loader.cpu_has_native_bf16", lambda: True)
    loaded = load_model(str(tiny_dir), dtype="auto", options=LoadOptions(small_step_int8=True))
    assert loaded.dtype == torch.bfloat16
    names = {type(m).__name__ for m in loaded.model.modules()}
    assert "FusedLlamaRMSNorm" in names and "LlamaRMSNorm" not in names
    # --disable-custom-kernels, or an explicit dtype (no copies): transformers' norms
    for options, dtype in [
        (LoadOptions(small_step_int8=True, custom_kernels=False), "auto"),
        (LoadOptions(), "bfloat16"),
    ]:
        loaded = load_model(str(tiny_dir), dtype=dtype, options=options)
        assert "FusedLlamaRMSNorm" not in {type(m).__name__ for m in loaded.model.modules()}


@needs_avx512_bf16
@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_bfloat16_weights_get_them_too(tiny_dir, monkeypatch, quantize):
    """--quantize computes in bfloat16 on such a CPU: its norms are fused as auto's."""
    monkeypatch.setattr("textgen.service.models.loader.cpu_has_native_bf16", lambda: True)
    loaded = load_model(str(tiny_dir), dtype="auto", quantize=quantize, options=LoadOptions())
    assert loaded.dtype == torch.bfloat16 and loaded.quantize == quantize
    assert "FusedLlamaRMSNorm" in {type(m).__name__ for m in loaded.model.modules()}


@pytest.mark.parametrize("switch", ["kernels", "env"])
def test_nothing_is_fused_where_the_kernels_are_not_available_or_off(monkeypatch, switch):
    if switch == "kernels":
        monkeypatch.setattr(avx512_bf16, "available", lambda: False)
    else:  # TEXTGEN_FUSED_NORMS=0
        monkeypatch.setattr(fused_norms, "ENABLED", False)
    norm = llama_norm(64)
    assert fused_norms.fuse_rms_norms(norm) == 0 and type(norm) is LlamaRMSNorm


def test_a_cpu_without_the_kernels_keeps_transformers_norms(tiny_dir, monkeypatch):
    """Where the kernels are unavailable (no AVX512-BF16, a failed compile), a bfloat16
    model with auto's int8 copies keeps transformers' norms."""
    monkeypatch.setattr("textgen.service.models.loader.cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(avx512_bf16, "available", lambda: False)
    loaded = load_model(str(tiny_dir), dtype="auto", options=LoadOptions(small_step_int8=True))
    names = {type(m).__name__ for m in loaded.model.modules()}
    assert loaded.dtype == torch.bfloat16 and "LlamaRMSNorm" in names
    assert not any(name.startswith("Fused") for name in names)
