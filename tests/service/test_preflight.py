"""Bad settings are refused before anything loads: `textgen serve` with each one exits with
status 2 in a few seconds, one line on stderr naming the flag (or the variable), the value
and the rule, no traceback and no model load. Good settings pass the same checks."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from textgen.service.models.embedded import EMBEDDED_CONFIG, EMBEDDED_CONTEXT, converted_embedded
from textgen.service.settings.preflight import preflight
from textgen.service.settings.table import SettingError, Settings, settings_table

pytestmark = pytest.mark.timeout(120)

TEXTGEN = str(Path(sys.executable).with_name("textgen"))
ROOT = Path(__file__).resolve().parents[2]
# No model loads: the one line on stderr says so (a load logs "settings checked" first).
# The time bound is loose: checks that need torch (--quantize, --device cuda) import it,
# 1.5-2 s on a quiet machine and up to 14 s seen at a load average of 9 on 2 cores; a
# load takes 10-60 s (and logs before the one line).
NO_LOAD_S = 20.0


@pytest.fixture(scope="module")
def busy_port():
    """A port something already listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def serve(*args: str, env: dict[str, str] | None = None) -> tuple[int, list[str], float]:
    # the settings come from the arguments alone (TEXTGEN_CACHE says where models are)
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith("TEXTGEN_") or k == "TEXTGEN_CACHE"
    }
    started = time.monotonic()
    proc = subprocess.run(
        [TEXTGEN, "serve", *args],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return proc.returncode, proc.stderr.splitlines(), time.monotonic() - started


def refused(lines: list[str], *words: str) -> bool:
    return (
        len(lines) == 1
        and lines[0].startswith(("textgen serve: error: ", "textgen: error: "))
        and all(w in lines[0] for w in words)
    )


BAD = [
    (["--grpc-port", "99999"], ("--grpc-port", "99999", "1-65535")),
    (["--port", "-1"], ("--port", "-1", "port number")),
    (["--graceful-termination-timeout", "-1"], ("--graceful-termination-timeout", "0 or more")),
    (["--max-queued-requests", "-3"], ("--max-queued-requests", "-3", "0 or more")),
    (["--max-batch-size", "0"], ("--max-batch-size", "positive")),
    (["--keepalive-interval", "nan"], ("--keepalive-interval", "finite")),
    (["--arrival-gap-ms", "500"], ("--arrival-gap-ms", "at most 20")),
    (["--dtype", "float8"], ("--dtype", "float8", "bfloat16")),
    (["--device", "tpu"], ("--device", "tpu", "cuda")),
    (["--device", "cuda"], ("--device cuda", "CUDA")),
    (["--quantize", "awq"], ("--quantize", "awq", "int8")),
    (["--quantize", "fp8", "--device", "cpu"], ("--quantize fp8", "CUDA")),
    (["--quantize", "int8", "--dtype", "float32"], ("--quantize int8", "bfloat16")),
    (["--cuda-graphs", "--device", "cpu"], ("--cuda-graphs", "CUDA device")),
    (["--compile", "--deterministic"], ("--compile", "--deterministic")),
    (["--model-id", "/nonexistent"], ("--model-id /nonexistent", "model folder")),
    (["--max-total-tokens", "100000"], ("--max-total-tokens 100000", f"({EMBEDDED_CONTEXT} ")),
    (
        ["--max-input-tokens", "5000", "--max-total-tokens", "4096"],
        ("--max-input-tokens 5000", "--max-total-tokens (4096)"),
    ),
    (["--max-batch-total-tokens", "100"], ("--max-batch-total-tokens 100", "KV cache")),
    (["--api-key-file", "/nonexistent"], ("--api-key-file /nonexistent", "cannot be read")),
    (["--hostname", "no.such.host.invalid"], ("--hostname no.such.host.invalid", "resolve")),
    (["--num-shard", "2"], ("--num-shard 2", "9 attention heads", "over 2 shards")),
    (["--num-shard", "0"], ("--num-shard", "positive")),
    (["--sharded"], ("--sharded true", "--num-shard 2 or more")),
    (["--num-shard", "3", "--deterministic"], ("--deterministic", "--num-shard")),
    (["--num-shard", "3", "--local-shards", "4"], ("--local-shards 4", "more than --num-shard")),
    (["--speculate", "-1"], ("--speculate", "0 or more")),
    (
        ["--speculate", "2", "--speculate-ngram-min", "5"],
        ("--speculate-ngram-min 5", "--speculate-ngram-max (4)"),
    ),
    (["--speculate-model", "x/y"], ("--speculate-model x/y", "needs --speculate")),
    (
        ["--speculate", "2", "--speculate-model", "/nonexistent"],
        ("--speculate-model /nonexistent", "model folder"),
    ),
    (
        ["--speculate", "2", "--speculate-model", "x/y", "--num-shard", "3"],
        ("--speculate-model x/y", "--num-shard"),
    ),
    (["--log-level", "loud"], ("--log-level", "LOUD", "DEBUG")),
    # the settings TGI's launcher brought
    (["--cuda-graph-sizes", "1,2", "--device", "cpu"], ("--cuda-graph-sizes 1,2", "CUDA device")),
    (["--cuda-graph-sizes", "1,0"], ("--cuda-graph-sizes", "positive batch sizes")),
    (["--cuda-memory-fraction", "0.5", "--device", "cpu"], ("--cuda-memory-fraction 0.5", "GPU")),
    (["--cuda-memory-fraction", "0"], ("--cuda-memory-fraction", "(0, 1]")),
    (
        ["--prometheus-port", "9100", "--auth-health-and-metrics"],
        ("--prometheus-port 9100", "without an API key"),
    ),
    (["--prometheus-port", "8080"], ("--prometheus-port 8080", "is also --port")),
    (["--payload-limit", "0"], ("--payload-limit", "positive")),
    (["--cors-allow-origin", "example.com"], ("--cors-allow-origin", "not an origin")),
    (["--rope-scaling", "yarn"], ("--rope-scaling", "linear, dynamic")),
    (["--rope-factor", "-2"], ("--rope-factor", "positive")),
    (["--tokenizer-config-path", "/nonexistent"], ("--tokenizer-config-path", "cannot be read")),
    (["--weights-cache-override", "/nonexistent"], ("--weights-cache-override", "not a folder")),
    (["--lora-adapters", "a,b,a"], ("--lora-adapters", "'a' is given twice")),
    (["--lora-adapters", "x=/nonexistent/a"], ("--lora-adapters x=/nonexistent/a", "neither")),
    (["--lora-adapters", "x=/tmp"], ("--lora-adapters x=/tmp", "no adapter_config.json")),
    (["--lora-adapters", "x=/tmp", "--max-loras", "0"], ("--max-loras 0", "no slot")),
    (["--max-loras", "2", "--deterministic"], ("--deterministic", "LoRA")),
    # images (docs/models.md)
    (["--allow-private-image-urls", "10.0.0.0/33"], ("--allow-private-image-urls", "networks")),
    (["--image-fetch-timeout", "0"], ("--image-fetch-timeout", "positive")),
    (["--max-image-bytes", "0"], ("--max-image-bytes", "positive")),
    (["--max-images-per-request", "0"], ("--max-images-per-request", "positive")),
    (["--max-image-pixels", "1000000000"], ("--max-image-pixels 1000000000", "Pillow")),
    (["--no-such-flag"], ("--no-such-flag",)),
]


@pytest.mark.server
@pytest.mark.parametrize(("args", "words"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_setting_is_one_line_and_status_2_before_loading(args, words):
    status, lines, took = serve(*args)
    assert status == 2, lines
    assert refused(lines, *words), lines
    assert took < NO_LOAD_S, f"{took:.1f}s: something loaded"


@pytest.mark.server
def test_ports_in_use_are_refused(busy_port):
    for flag in ("--grpc-port", "--port"):
        status, lines, took = serve(flag, str(busy_port))
        assert status == 2 and refused(lines, flag, str(busy_port), "already in use"), lines
        assert took < NO_LOAD_S
    status, lines, _ = serve("--grpc-port", "8111", "--port", "8111")
    assert status == 2 and refused(lines, "--port 8111", "--grpc-port"), lines


@pytest.mark.server
def test_a_hub_model_missing_offline(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    status, lines, took = serve("--model-id", "someone/no-such-model", env=env)
    assert status == 2 and refused(lines, "--model-id someone/no-such-model", "offline"), lines
    assert took < NO_LOAD_S


@pytest.mark.server
def test_a_model_with_a_shorter_context(tiny_model_dir):
    # the tiny model's context is 1024: 4096 fits the embedded model, not this one
    status, lines, took = serve("--model-id", str(tiny_model_dir), "--max-total-tokens", "4096")
    assert status == 2 and refused(lines, "--max-total-tokens 4096", "(1024 tokens)"), lines
    assert took < NO_LOAD_S


@pytest.mark.server
@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"TEXTGEN_GRPC_PORT": "99999"}, ("TEXTGEN_GRPC_PORT='99999'", "1-65535")),
        ({"TEXTGEN_COMPILE": "maybe"}, ("TEXTGEN_COMPILE='maybe'", "true/false")),
        ({"TEXTGEN_MAX_BATCH_SIZE": "lots"}, ("TEXTGEN_MAX_BATCH_SIZE='lots'", "whole number")),
        ({"SPECULATE": "many"}, ("SPECULATE='many'", "whole number")),  # TGI's variable
        ({"TEXTGEN_MAX_TOTAL_TOKENS": "100000"}, ("--max-total-tokens 100000", "context")),
    ],
)
def test_the_environment_is_checked_as_the_flags_are(env, words):
    status, lines, took = serve(env=env)
    assert status == 2 and refused(lines, *words), lines
    assert took < NO_LOAD_S


@pytest.mark.server
def test_debug_shows_the_traceback():
    proc = subprocess.run(
        [TEXTGEN, "--log-level", "debug", "serve", "--max-total-tokens", "100000"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and "Traceback" in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("textgen serve: error: --max-total-tokens")


# good settings pass the same checks ------------------------------------------------------


def test_good_settings_pass(tiny_model_dir, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# ops\nsecret\n")
    checked = preflight(
        Settings(
            model_id=str(tiny_model_dir),
            grpc_port=0,
            port=0,
            max_total_tokens=1024,
            max_input_tokens=1000,
            max_batch_total_tokens=1024,
            api_key_file=str(keys),
            graceful_termination_timeout=0,
        )
    )
    assert (checked.context, checked.max_input_tokens, checked.max_total_tokens) == (
        1024,
        1000,
        1024,
    )
    assert checked.device == "cpu"


def test_a_key_file_without_keys_is_refused(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# nobody yet\n\n")
    with pytest.raises(SettingError, match="holds no key"):
        preflight(Settings(api_key_file=str(keys), grpc_port=0, port=0))


@pytest.mark.slow  # converts the embedded model when its cache is empty
def test_the_embedded_context_is_its_config():
    """The embedded model's context and heads are known before its conversion; they must
    be the ones its converted config states."""
    from textgen.service.models import ensure_embedded
    from textgen.service.models.hub import config_json, context_length

    ensure_embedded()
    folder = converted_embedded()
    assert folder is not None
    config = config_json(None)[1]
    assert context_length(config) == EMBEDDED_CONTEXT
    assert {key: config[key] for key in EMBEDDED_CONFIG} == EMBEDDED_CONFIG


@pytest.mark.server
def test_shards_are_checked_before_the_embedded_model_is_converted(tmp_path):
    """A fresh machine (nothing converted yet) gets the same one-line refusal, not a
    conversion and a load first."""
    status, lines, took = serve("--num-shard", "2", env={"TEXTGEN_CACHE": str(tmp_path)})
    assert status == 2 and refused(lines, "--num-shard 2", "9 attention heads"), lines
    assert took < NO_LOAD_S
    assert not list(tmp_path.glob("models/*")), "something was converted"


def test_the_settings_doc_is_the_table():
    doc = (ROOT / "docs" / "settings.md").read_text()
    assert settings_table() in doc, "docs/settings.md is stale: python scripts/make_settings_doc.py"


@pytest.mark.server
def test_lora_adapters_are_checked_before_loading(tiny_model_dir, tmp_path):
    """An adapter's config is read before the model loads: its rank against
    --max-lora-rank, its base model against the served one; a good one sizes the slots."""
    import json

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    get_peft_model(model, LoraConfig(r=32, target_modules=["q_proj"])).save_pretrained(
        tmp_path / "a"
    )
    adapter = f"a={tmp_path / 'a'}"
    status, lines, took = serve(
        "--model-id", str(tiny_model_dir), "--lora-adapters", adapter, "--max-lora-rank", "16"
    )
    assert status == 2 and refused(lines, f"--lora-adapters {adapter}", "rank 32"), lines
    assert took < NO_LOAD_S
    settings = Settings(model_id=str(tiny_model_dir), grpc_port=0, port=0, no_envoy=True)
    checked = preflight(replace(settings, lora_adapters=(("a", str(tmp_path / "a")),)))
    assert (checked.lora.slots, checked.lora.max_rank) == (1, 32)
    assert preflight(replace(settings, max_loras=4)).lora.max_rank == 16  # run-time loads only
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "Qwen/Qwen3-8B"
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(SettingError, match="trained on 'Qwen/Qwen3-8B'"):
        preflight(replace(settings, lora_adapters=(("a", str(tmp_path / "a")),)))


def test_a_draft_model_with_another_tokenizer_is_refused_before_loading(tiny_model_dir, tmp_path):
    """--speculate-model's tokenizer.json against the model's, before either loads: the
    same words for the same files, run after run (the first differing id)."""
    from support.tiny_model import build_tokenizer

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    build_tokenizer(300).save_pretrained(other)
    settings = Settings(
        model_id=str(tiny_model_dir), grpc_port=0, port=0, speculate=2, speculate_model=str(other)
    )
    messages = set()
    for _ in range(2):
        with pytest.raises(SettingError) as refused:
            preflight(settings)
        messages.add(str(refused.value))
    (message,) = messages
    assert message.startswith(f"--speculate-model {other}: its tokenizer differs")
    assert "id " in message
    same = tmp_path / "same"
    shutil.copytree(tiny_model_dir, same)
    preflight(replace(settings, speculate_model=str(same)))
