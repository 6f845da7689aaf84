"""--quantize: the flag and its env, what each device refuses at startup, the layers each
value converts, the CPU int8 layer's arithmetic, and /info and greedy generation of servers
that quantize (int8, int4) on the tiny model."""

from __future__ import annotations

import grpc
import pytest
import torch
from support.servers import ServerThread, tiny_settings
from textgen.service.cli import build_parser
from textgen.service.models import QuantizationError, avx512_bf16, load_model
from textgen.service.models import quantize as q
from textgen.service.models.int4_avx512 import Int4Avx512Linear
from textgen.service.models.int8_avx512 import Int8Avx512Linear
from textgen.service.proto import generate_pb2 as pb
from textgen.service.proto import text_generation_service_pb2 as svc
from textgen.service.proto import text_generation_service_pb2_grpc as svc_grpc
from textgen.service.settings.table import settings_from_args

pytestmark = pytest.mark.timeout(120)

CPU, CUDA = torch.device("cpu"), torch.device("cuda:0")
# bfloat16 layers take textgen's kernels where this CPU has AVX512-BF16, else torch's
OURS = avx512_bf16.cpu_supports()
INT8 = Int8Avx512Linear if OURS else q.Int8Linear


def serve_settings(*argv: str):
    return settings_from_args(build_parser().parse_args(["serve", *argv]))


# ------------------------------------------------------------------- the flag


def test_flag_and_env(monkeypatch):
    from textgen.service.settings.table import QUANTIZE_METHODS

    assert QUANTIZE_METHODS == q.QUANTIZE_METHODS
    assert serve_settings().quantize is None
    assert serve_settings("--quantize", "INT4").quantize == "int4"
    assert serve_settings("--quantize", "none").quantize is None
    monkeypatch.setenv("TEXTGEN_QUANTIZE", "int8")
    assert serve_settings().quantize == "int8"
    assert serve_settings("--quantize", "fp8").quantize == "fp8"  # the flag wins


def test_unknown_value_is_refused_by_the_parser(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_:
        serve_settings("--quantize", "hqq")
    assert exit_.value.code == 2
    assert "--quantize: 'hqq': use one of int8, int4, fp8, gptq, awq" in capsys.readouterr().err
    monkeypatch.setenv("TEXTGEN_QUANTIZE", "awq4")
    with pytest.raises(SystemExit):
        serve_settings()
    assert "TEXTGEN_QUANTIZE='awq4'" in capsys.readouterr().err
    monkeypatch.setenv("TEXTGEN_QUANTIZE", "bitsandbytes-nf4")  # TGI's names
    assert serve_settings().quantize == "bitsandbytes-nf4"


# ------------------------------------------------------------------- startup refusals


def test_cpu_refuses_fp8_and_float32_and_picks_bfloat16_for_auto():
    with pytest.raises(QuantizationError, match="fp8 needs a CUDA GPU"):
        q.check_quantize("fp8", CPU, "auto", torch.bfloat16)
    with pytest.raises(QuantizationError, match="use --dtype bfloat16 or auto"):
        q.check_quantize("int4", CPU, "float32", torch.float32)
    # auto on a CPU without native bf16 resolves to float32; the kernels need bfloat16
    assert q.check_quantize("int8", CPU, "auto", torch.float32) is torch.bfloat16
    assert q.check_quantize("int4", CPU, "bf16", torch.bfloat16) is torch.bfloat16
    assert q.check_quantize(None, CPU, "float32", torch.float32) is torch.float32
    with pytest.raises(QuantizationError, match="unknown --quantize value 'hqq'"):
        q.check_quantize("hqq", CPU, "auto", torch.bfloat16)
    with pytest.raises(QuantizationError, match="cpu and cuda devices, not mps"):
        q.check_quantize("int8", torch.device("mps"), "auto", torch.float16)


def test_cuda_refusals_follow_the_compute_capability(monkeypatch):
    capability = {"value": (7, 5)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability["value"])
    assert q.check_quantize("int8", CUDA, "float16", torch.float16) is torch.float16
    with pytest.raises(QuantizationError, match=r"int4 needs .* 8\.0\+; cuda:0 is 7\.5"):
        q.check_quantize("int4", CUDA, "auto", torch.float16)
    capability["value"] = (8, 0)
    assert q.check_quantize("int4", CUDA, "auto", torch.bfloat16) is torch.bfloat16
    with pytest.raises(QuantizationError, match=r"fp8 needs .* 8\.9\+"):
        q.check_quantize("fp8", CUDA, "auto", torch.bfloat16)
    capability["value"] = (9, 0)
    assert q.check_quantize("fp8", CUDA, "auto", torch.bfloat16) is torch.bfloat16
    with pytest.raises(QuantizationError, match="computes in bfloat16"):
        q.check_quantize("fp8", CUDA, "float16", torch.float16)


def test_load_model_refuses_before_loading(tiny_model_dir, monkeypatch):
    def no_loading(*_a, **_k):
        raise AssertionError("resolved the model before checking --quantize")

    monkeypatch.setattr("textgen.service.models.loader.resolve_model", no_loading)
    with pytest.raises(QuantizationError, match="fp8 needs a CUDA GPU"):
        load_model(str(tiny_model_dir), device="cpu", quantize="fp8")


# ------------------------------------------------------------------- the layers


def test_int4_where_the_kernel_takes_the_shape_int8_elsewhere():
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128),  # int4: N % 16 == 0, K % 32 == 0
        torch.nn.Linear(128, 100),  # N = 100: int8
        torch.nn.Linear(100, 48),  # K = 100: not for the CPU int8 kernel either
        torch.nn.Linear(48, 64),  # K = 48: int8
    ).to(torch.bfloat16)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = model(x).float()
    assert q.quantize_model(model, "int4", CPU) == {"int4": 1, "int8": 2, "dense": 1}
    assert isinstance(model[0], Int4Avx512Linear if OURS else q.Int4Linear)
    assert isinstance(model[1], INT8) and isinstance(model[3], INT8)
    assert type(model[2]) is torch.nn.Linear
    with torch.inference_mode():
        got = model(x).float()
    assert got.shape == want.shape
    assert (got - want).abs().max() < 0.1 * want.abs().max()


def test_int8_linear_refuses_a_shape_its_kernel_would_read_past():
    with pytest.raises(ValueError, match="multiple of 16"):
        q.Int8Linear.from_linear(torch.nn.Linear(100, 64).to(torch.bfloat16))


def test_int8_linear_matches_the_wide_layer():
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 48).to(torch.bfloat16)
    layer = q.Int8Linear.from_linear(linear)
    assert layer.qweight.dtype is torch.int8 and layer.scale.dtype is torch.bfloat16
    # the stored scale is the one the weight was divided by: dequantizing gives the weight back
    # to within half a step per row
    step = layer.scale.float().unsqueeze(1)
    error = (layer.qweight.float() * step - linear.weight.float()).abs()
    assert (error <= step / 2 + 1e-6).all()
    x = torch.randn(2, 7, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        want, got = linear(x).float(), layer(x).float()
        assert got.shape == want.shape
        assert (got - want).abs().max() < 0.02 * want.abs().max()
        # a non-contiguous input (a slice of the hidden states) gives the same rows
        assert torch.equal(layer(x[:, ::2]), layer(x[:, ::2].contiguous()))


def test_tied_lm_head_is_quantized_and_the_embedding_kept():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    embedding = model.model.embed_tokens.weight.detach().clone()
    assert q.quantize_model(model, "int4", CPU) == {"int4": 7, "int8": 1}  # int8: lm_head
    assert isinstance(model.lm_head, INT8)
    assert torch.equal(model.model.embed_tokens.weight, embedding)


# ------------------------------------------------------------------- served


@pytest.mark.server
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_server_reports_it_and_generates_greedily(tiny_model_dir, method):
    reference = load_model(str(tiny_model_dir), dtype="bfloat16", quantize=method)
    assert reference.dtype is torch.bfloat16 and reference.quantize == method
    tok, model = reference.tokenizer, reference.model
    prompt = "def add ( a , b ) :"
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    expected = out[0, ids.shape[1] :].tolist()

    server = ServerThread(tiny_settings(tiny_model_dir, dtype="auto", quantize=method)).start()
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = svc_grpc.TextGenerationServiceStub(channel)
            info = stub.Info(svc.InfoRequest(), timeout=10)
            assert info.quantize == method and info.model_dtype == "bfloat16"
            params = pb.GenerateParameters(max_new_tokens=8, details=True, ignore_eos=True)
            resp = stub.Generate(pb.GenerateRequest(inputs=prompt, parameters=params), timeout=60)
    finally:
        server.stop()
    assert [t.id for t in resp.details.tokens] == expected


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_cuda_quantized_model_generates_in_the_paged_engine(tiny_model_dir, method):
    need = {"int8": (0, 0), "int4": q.INT4_CUDA_MIN_CAPABILITY, "fp8": q.FP8_MIN_CAPABILITY}
    if torch.cuda.get_device_capability() < need[method]:
        pytest.skip(f"needs a GPU of compute capability {need[method]} ({method} kernels)")
    from engine.factories import make_seq, run_to_completion
    from textgen.service.engine.config import EngineConfig
    from textgen.service.engine.paged_core import PagedCore

    loaded = load_model(str(tiny_model_dir), device="cuda", dtype="auto", quantize=method)
    wide = load_model(str(tiny_model_dir), device="cuda", dtype=str(loaded.dtype)[6:])
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]], device="cuda")
    with torch.inference_mode():
        got, want = loaded.model(ids).logits.float(), wide.model(ids).logits.float()
    assert torch.isfinite(got).all()
    # the same model, a few bits coarser: logits close to the wide model's
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.98
    core = PagedCore(
        loaded.model,
        EngineConfig(
            max_batch_total_tokens=1024,
            max_batch_prefill_tokens=256,
            max_batch_size=8,
            block_size=16,
        ),
    )
    seqs = [make_seq([5, 17, 42, 99, 7, 3][: n + 1], request_id=f"g{n}") for n in range(4)]
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    assert all(len(seq.output_ids) == 8 for seq in seqs)
