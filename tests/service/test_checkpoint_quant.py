"""Checkpoints that arrive quantized, and TGI's --quantize names for the libraries that own
their formats (models/checkpoint_quant.py).

On CPU: tiny checkpoints of every format whose kernels run here (GPTQ, AWQ, bitsandbytes
8-bit/nf4/fp4) or that the library widens at load (compressed-tensors, FP8, gpt-oss's MXFP4
experts), made in the test (tests/support/quantized_checkpoints.py), served by a real server
whose greedy tokens equal the library's own `generate` on the same checkpoint; bitsandbytes
quantizing a dense checkpoint as it loads, likewise. Then every refusal, at startup, with its
reason. The CUDA-only kernels (Marlin, EETQ, FP8 matmuls, MXFP4) are tested at the end, on a
GPU only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import pytest
import torch
from support import quantized_checkpoints as checkpoints
from support.servers import ServerThread, tiny_settings
from textgen.service.models import QuantizationError
from textgen.service.models import checkpoint_quant as cq
from textgen.service.models.loader import cpu_has_native_bf16
from textgen.service.proto import generate_pb2 as pb
from textgen.service.proto import text_generation_service_pb2_grpc as svc_grpc
from textgen.service.settings.preflight import preflight
from textgen.service.settings.table import SettingError
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.timeout(300)

CPU = torch.device("cpu")
PROMPT = "The quick brown fox"
NEW_TOKENS = 24


def build(kind: str, source: Path, path: Path) -> Path:
    if kind.startswith("bitsandbytes"):
        return checkpoints.build_bitsandbytes(source, path, kind.split("-")[1])
    if kind.startswith("compressed-tensors"):
        return checkpoints.build_compressed_tensors(source, path, kind.split("-")[2])
    return getattr(checkpoints, f"build_{kind}")(source, path)


def served_tokens(settings) -> tuple[list[int], list[int], object]:
    """(prompt ids, greedy ids, the replica's loaded model) from a real server."""
    server = ServerThread(settings).start()
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = svc_grpc.TextGenerationServiceStub(channel)
            params = pb.GenerateParameters(
                max_new_tokens=NEW_TOKENS, ignore_eos=True, decoder_input_details=True
            )
            out = stub.Generate(pb.GenerateRequest(inputs=PROMPT, parameters=params), timeout=120)
        loaded = server.replica.loaded
        mlp = loaded.model.model.layers[0].mlp
        info = (
            loaded.quantize,
            loaded.dtype,
            type(mlp.up_proj if hasattr(mlp, "up_proj") else mlp.experts),
            cq.stays_quantized(loaded.model),
        )
    finally:
        server.stop()
    prompt = [t.id for t in out.details.prefill]
    return prompt, [t.id for t in out.details.tokens], info


def library_generate(path: Path, prompt: list[int], dtype: torch.dtype, **load) -> list[int]:
    """The library's own greedy `generate` on the checkpoint (through transformers), EOS
    not stopping it (as ignore_eos)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **load)
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


# --dtype auto on this CPU: bfloat16 where it computes bf16 natively, else float32
AUTO = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
# gptqmodel's CPU kernel: its AVX-512 one where the CPU has AVX-512
AVX512 = "avx512f" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False
GPTQ_LAYER = "TorchCpuAvx512Linear" if AVX512 else "TorchAtenLinear"
AWQ_LAYER = "TorchCpuAvx512AwqLinear" if AVX512 else "TorchAtenAwqLinear"

# (checkpoint format, --quantize as TGI names it, the dtype it computes in here, its layers)
CPU_FORMATS = [
    ("gptq", "gptq", torch.bfloat16, GPTQ_LAYER),
    ("awq", "awq", torch.bfloat16, AWQ_LAYER),
    ("bitsandbytes-8bit", "bitsandbytes", AUTO, "Linear8bitLt"),
    ("bitsandbytes-nf4", "bitsandbytes-nf4", AUTO, "Linear4bit"),
    ("bitsandbytes-fp4", "bitsandbytes-fp4", AUTO, "Linear4bit"),
    # no CPU kernels: widened at load to the compute dtype
    ("compressed-tensors-int8", "compressed-tensors", AUTO, "Linear"),
    ("compressed-tensors-int4", "compressed-tensors", AUTO, "Linear"),
    ("compressed-tensors-fp8", "compressed-tensors", AUTO, "Linear"),
    ("fp8", "fp8", AUTO, "Linear"),
]


@pytest.mark.server
@pytest.mark.parametrize("kind, method, dtype, layer", CPU_FORMATS)
def test_served_greedy_tokens_are_the_librarys(
    kind, method, dtype, layer, tiny_model_dir, tmp_path
):
    path = build(kind, tiny_model_dir, tmp_path / kind)
    assert "quantization_config" in json.loads((path / "config.json").read_text())
    # no --quantize: the checkpoint's format applies; --dtype auto (AUTO on this CPU).
    # The weights are compared here, so the attention is the library's SDPA: in bfloat16
    # the CPU decode kernel computes in float32 and a random tiny model's near-ties may
    # round the other way (the kernel meets SDPA in tests/engine/test_cpu_decode_attention.py)
    sdpa = {"disable_custom_kernels": True}
    prompt, served, (quantize, loaded_dtype, layer_type, packed) = served_tokens(
        tiny_settings(path, dtype="auto", **sdpa)
    )
    assert (quantize, loaded_dtype, layer_type.__name__) == (method, dtype, layer)
    assert packed == (layer != "Linear")  # else widened at load: no CPU kernel
    assert served == library_generate(path, prompt, dtype)
    # naming the checkpoint's format is the same
    assert served_tokens(tiny_settings(path, dtype="auto", quantize=method, **sdpa))[1] == served


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory) -> Path:
    """A tiny gpt-oss whose experts are MXFP4 blocks and scales, as OpenAI publishes it."""
    root = tmp_path_factory.mktemp("mxfp4")
    dense = checkpoints.build_gpt_oss(root / "dense")
    return checkpoints.build_mxfp4(dense, root / "mxfp4")


def test_mxfp4_checkpoint_is_the_layout_transformers_loads(mxfp4_dir):
    """The folder as transformers reads gpt-oss-20b/120b: its own loader dequantizes the
    packed experts on CPU to exactly what they hold, close to the dense weights."""
    state = checkpoints.load_file(mxfp4_dir / "model.safetensors")
    blocks = state["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    scales = state["model.layers.0.mlp.experts.gate_up_proj_scales"]
    # [experts, 2 * intermediate, hidden / 32, 16 bytes of two E2M1 codes], one E8M0 a block
    assert (blocks.dtype, tuple(blocks.shape)) == (torch.uint8, (4, 128, 2, 16))
    assert (scales.dtype, tuple(scales.shape)) == (torch.uint8, (4, 128, 2))
    assert tuple(state["model.layers.0.mlp.experts.down_proj_blocks"].shape) == (4, 64, 2, 16)
    assert "model.layers.0.mlp.experts.gate_up_proj" not in state
    dense = AutoModelForCausalLM.from_pretrained(mxfp4_dir.parent / "dense")
    model = AutoModelForCausalLM.from_pretrained(mxfp4_dir)
    assert not getattr(model, "is_quantized", False)  # dequantized at load
    loaded = dict(model.named_parameters())
    packed = checkpoints.mxfp4_experts(mxfp4_dir)
    assert len(packed) == 4  # gate_up_proj and down_proj of each layer
    for name, original in dense.named_parameters():
        if name in packed:
            assert loaded[name].dtype == torch.float32
            assert torch.equal(loaded[name], packed[name])
            # 4-bit codes: within half the widest E2M1 step (2, between 4 and 6) times a
            # block's scale (under a third of its largest), about 12 % of the weights' norm
            error = loaded[name] - original
            assert error.abs().max() < original.abs().max() / 3
            assert error.norm() / original.norm() < 0.15
        else:
            assert torch.equal(loaded[name], original)  # the rest stays dense


@pytest.mark.server
def test_served_mxfp4_gpt_oss_greedy_tokens_are_transformers(mxfp4_dir):
    """No --quantize (TGI has no mxfp4 value): the checkpoint's format applies; no CPU
    kernel here, so the experts are dequantized at load to the compute dtype (--dtype auto
    on this CPU), as transformers' own `from_pretrained(dtype=...)` does. The attention is
    the library's formula (no CPU decode kernel, as in test_served_greedy_tokens_are_the_librarys):
    the experts are what is compared."""
    prompt, served, (quantize, dtype, experts, packed) = served_tokens(
        tiny_settings(mxfp4_dir, dtype="auto", device="cpu", disable_custom_kernels=True)
    )
    assert (quantize, experts.__name__, packed) == ("mxfp4", "GptOssExperts", False)
    assert dtype == AUTO
    assert served == library_generate(mxfp4_dir, prompt, AUTO)
    # the 4-bit experts are what runs: the dense model's tokens differ
    assert served != library_generate(mxfp4_dir.parent / "dense", prompt, AUTO)


def test_mxfp4_plans_dequantize_where_transformers_kernels_cant_run(monkeypatch):
    import transformers.utils

    library = cq.plan(None, "mxfp4", CPU, torch.float32, "auto")
    assert (library.method, library.prequantized, library.dtype) == ("mxfp4", True, torch.float32)
    assert (library.load_config, library.widened) == (
        {"dequantize": True},
        "no CPU kernel for MXFP4 here",
    )
    cuda = torch.device("cuda:0")
    capability = {"value": (7, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability["value"])
    monkeypatch.setattr(transformers.utils, "is_kernels_available", lambda: True)
    assert "compute capability 7.5+" in cq.plan(None, "mxfp4", cuda, torch.bfloat16, "auto").widened
    capability["value"] = (9, 0)
    assert "bfloat16" in cq.plan(None, "mxfp4", cuda, torch.float16, "auto").widened
    kernels = cq.plan(None, "mxfp4", cuda, torch.bfloat16, "auto")
    assert (kernels.load_config, kernels.widened) == ({"dequantize": False}, None)
    monkeypatch.setattr(transformers.utils, "is_kernels_available", lambda: False)
    widened = cq.plan(None, "mxfp4", cuda, torch.bfloat16, "auto")
    assert widened.load_config == {"dequantize": True}
    assert "need the kernels package" in widened.widened


@pytest.mark.server
@pytest.mark.parametrize("method", ["bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4"])
def test_bitsandbytes_quantizes_a_dense_checkpoint_as_it_loads(method, tiny_model_dir):
    from transformers import BitsAndBytesConfig

    prompt, served, (quantize, _, layer_type, packed) = served_tokens(
        tiny_settings(tiny_model_dir, quantize=method)
    )
    assert packed
    assert quantize == method
    assert layer_type.__module__.startswith("bitsandbytes")
    kind = method.removeprefix("bitsandbytes").lstrip("-")
    config = (
        BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind)
        if kind
        else BitsAndBytesConfig(load_in_8bit=True)
    )
    if kind:
        config.bnb_4bit_compute_dtype = torch.float32
    expected = library_generate(tiny_model_dir, prompt, torch.float32, quantization_config=config)
    assert served == expected


# --------------------------------------------------------------- the checkpoint's format


@pytest.mark.parametrize(
    "quantization_config, method",
    [
        ({"quant_method": "gptq", "bits": 4}, "gptq"),
        ({"quant_method": "awq"}, "awq"),
        ({"quant_method": "compressed-tensors"}, "compressed-tensors"),
        ({"quant_method": "fp8"}, "fp8"),
        ({"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}, "mxfp4"),
        ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "bitsandbytes"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes-fp4"),
        (
            {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
            "bitsandbytes-nf4",
        ),
        ({"quant_method": "exl2"}, "exl2"),
        (None, None),
    ],
)
def test_checkpoint_methods_have_tgis_names(quantization_config, method):
    config = {"model_type": "llama"}
    if quantization_config:
        config["quantization_config"] = quantization_config
    assert cq.checkpoint_method(config) == method
    nested = {"text_config": config}  # a multimodal model's text config
    assert cq.checkpoint_method(nested) == method


def test_a_format_textgen_does_not_load_is_refused_by_name():
    with pytest.raises(cq.CheckpointQuantizationError, match="quantized with 'hqq'"):
        cq.checkpoint_method({"quantization_config": {"quant_method": "hqq"}})


# --------------------------------------------------------------- refusals at startup


def refusal(path: Path, **overrides) -> str:
    settings = tiny_settings(path, **{"dtype": "auto", "device": "cpu", **overrides})
    with pytest.raises(SettingError) as info:
        preflight(settings)
    return str(info.value)


@pytest.fixture(scope="module")
def gptq_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return checkpoints.build_gptq(tiny_model_dir, tmp_path_factory.mktemp("gptq") / "model")


@pytest.fixture(scope="module")
def exl2_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A dense folder whose config says EXL2 (enough: the refusal reads only config.json)."""
    path = tmp_path_factory.mktemp("exl2") / "model"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "exl2", "bits": 4.0}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_cuda_kernels_are_refused_on_cpu_with_their_reason(gptq_dir, tiny_model_dir):
    assert refusal(gptq_dir, quantize="marlin") == (
        "--quantize marlin: Marlin's kernels run on CUDA GPUs only; on CPU use --quantize "
        "gptq or awq (the checkpoint's own format)"
    )
    assert "EETQ's kernels run on CUDA GPUs only" in refusal(tiny_model_dir, quantize="eetq")


def test_exl2_is_refused_everywhere(exl2_dir, tiny_model_dir):
    for path, quantize in [(exl2_dir, None), (exl2_dir, "exl2"), (tiny_model_dir, "exl2")]:
        assert "transformers has no loader for them" in refusal(path, quantize=quantize)
    assert refusal(exl2_dir).startswith("--model-id: EXL2 checkpoints")


@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors", "marlin"])
def test_checkpoint_formats_need_a_quantized_checkpoint(method, tiny_model_dir):
    assert "config.json has no quantization_config" in refusal(tiny_model_dir, quantize=method)


@pytest.mark.parametrize("method", ["int8", "awq", "bitsandbytes-nf4", "fp8"])
def test_another_format_than_the_checkpoints_is_refused(method, gptq_dir):
    assert refusal(gptq_dir, quantize=method) == (
        f"--quantize {method}: the checkpoint is already quantized (gptq: config.json's "
        f"quantization_config), so --quantize {method} can't apply; pass --quantize gptq "
        "or leave it out"
    )


@pytest.mark.parametrize("method", ["gptq", "int8", "bitsandbytes", "fp8"])
def test_an_mxfp4_checkpoint_takes_no_quantize(method, mxfp4_dir):
    assert refusal(mxfp4_dir, quantize=method) == (
        f"--quantize {method}: the checkpoint is already quantized (mxfp4: config.json's "
        f"quantization_config), so --quantize {method} can't apply; leave it out (its "
        "format applies; --quantize has no mxfp4 value)"
    )


def test_gptq_computes_in_bfloat16_on_cpu(gptq_dir):
    assert "use --dtype bfloat16 or auto" in refusal(gptq_dir, dtype="float32")
    dtype, library = cq_plan("gptq", torch.float32, "auto")
    assert (dtype, library.method, library.prequantized) == (torch.bfloat16, "gptq", True)


def cq_plan(checkpoint: str | None, dtype: torch.dtype, flag: str, method=None):
    library = cq.plan(method, checkpoint, CPU, dtype, flag)
    return (library.dtype if library else dtype), library


def test_what_a_quantized_checkpoint_is_not_served_with(gptq_dir):
    assert refusal(gptq_dir, deterministic=True).startswith(
        "--deterministic: is not supported with gptq weights (the checkpoint)"
    )
    assert refusal(gptq_dir, compile=True).startswith(
        "--compile: is not supported with gptq weights"
    )
    assert refusal(gptq_dir, num_shard=2).startswith(
        "--num-shard 2: can't shard a quantization library's weights"
    )


def test_a_missing_library_is_named(monkeypatch):
    real = cq.importlib.util.find_spec
    monkeypatch.setattr(
        cq.importlib.util, "find_spec", lambda name: None if name == "gptqmodel" else real(name)
    )
    with pytest.raises(cq.CheckpointQuantizationError, match="needs the gptqmodel package"):
        cq.plan(None, "awq", CPU, torch.bfloat16, "auto")


def test_load_model_refuses_sharding_a_quantized_checkpoint(gptq_dir):
    from textgen.service.models import load_model
    from textgen.service.models.loader import ModelShard

    with pytest.raises(QuantizationError, match="can't be sharded"):
        load_model(str(gptq_dir), device="cpu", shard=ModelShard(0, 2, None))


def test_cuda_capability_rules(monkeypatch):
    capability = {"value": (7, 5)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability["value"])
    cuda = torch.device("cuda:0")
    with pytest.raises(cq.CheckpointQuantizationError, match=r"marlin needs .* 8\.0\+"):
        cq.plan("marlin", "gptq", cuda, torch.float16, "auto")
    capability["value"] = (8, 0)
    marlin = cq.plan("marlin", "gptq", cuda, torch.float16, "auto")
    assert (marlin.method, marlin.load_config) == ("marlin", {"backend": "marlin"})


# --------------------------------------------------------------- CUDA-only kernels


@pytest.mark.gpu
@pytest.mark.server
def test_marlin_serves_a_gptq_checkpoint_as_the_library_does(gptq_dir):
    if torch.cuda.get_device_capability() < cq.MARLIN_MIN_CAPABILITY:
        pytest.skip("needs a GPU of compute capability 8.0+ (Marlin's kernels)")
    from transformers import GPTQConfig

    prompt, served, (quantize, _, _, packed) = served_tokens(
        tiny_settings(gptq_dir, dtype="float16", device="cuda", quantize="marlin")
    )
    assert packed
    assert quantize == "marlin"
    config = GPTQConfig(bits=4, backend="marlin")
    expected = library_generate(
        gptq_dir, prompt, torch.float16, device_map="cuda", quantization_config=config
    )
    assert served == expected


@pytest.mark.gpu
@pytest.mark.server
def test_fp8_checkpoint_runs_on_fp8_gpus(tiny_model_dir, tmp_path):
    if torch.cuda.get_device_capability() < cq.FP8_MIN_CAPABILITY:
        pytest.skip("needs a GPU of compute capability 8.9+ (FP8 matmuls)")
    path = checkpoints.build_fp8(tiny_model_dir, tmp_path / "fp8")
    prompt, served, (quantize, _, _, packed) = served_tokens(
        tiny_settings(path, dtype="bfloat16", device="cuda")
    )
    assert quantize == "fp8" and packed  # fp8 weights on the GPU, not widened
    assert served == library_generate(path, prompt, torch.bfloat16, device_map="cuda")


@pytest.mark.gpu
@pytest.mark.server
def test_mxfp4_checkpoint_on_cuda(mxfp4_dir):
    """transformers' MXFP4 kernels where it finds what they need, else dequantized to
    bfloat16 on the GPU; the same tokens as transformers' `generate` either way."""
    from transformers import Mxfp4Config

    library = cq.plan(None, "mxfp4", torch.device("cuda"), torch.bfloat16, "bfloat16")
    prompt, served, (quantize, dtype, _, packed) = served_tokens(
        tiny_settings(mxfp4_dir, dtype="bfloat16", device="cuda")
    )
    assert (quantize, dtype, packed) == ("mxfp4", torch.bfloat16, library.widened is None)
    config = Mxfp4Config(**library.load_config)
    expected = library_generate(
        mxfp4_dir, prompt, torch.bfloat16, device_map="cuda", quantization_config=config
    )
    assert served == expected
