"""The KV profiling run's result kept across restarts.

Sizing the KV cache on a GPU runs one forward pass at the largest step and reads the peak
memory it reached above the weights (`gpu_kv_cache_bytes`): seconds of every start (2.9 s
of a 23 s warm restart of a Qwen3-0.6B shape on the H200). That figure depends only on what
the pass runs: the engine's settings, the model's files, the GPU, folio's code and the library
versions.
So it is stored under a hash of all of them in folio's cache directory, and a start whose
hash matches reuses it instead of running the pass; anything that changes the hash profiles
again. The free memory and the memory held outside torch are always measured afresh."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

import torch

from folio.model.cache_dir import folio_cache_dir

logger = logging.getLogger(__name__)

# Files of a model directory whose contents decide the forward pass's shapes and dtypes.
_MODEL_FILES = ("config.json", "quantization_config.json")


def _model_fingerprint(path: str) -> list[Any]:
    """The model's config files' contents, and the size and modification time of every
    other file (weights: re-saved or replaced weights change them)."""
    out: list[Any] = []
    if os.path.isfile(path):
        stat = os.stat(path)
        return [os.path.abspath(path), stat.st_size, stat.st_mtime_ns]
    for name in sorted(os.listdir(path)) if os.path.isdir(path) else []:
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            continue
        if name in _MODEL_FILES:
            with open(full, "rb") as f:
                out.append([name, hashlib.sha256(f.read()).hexdigest()])
        else:
            stat = os.stat(full)
            out.append([name, stat.st_size, stat.st_mtime_ns])
    return [os.path.abspath(path), out]


def _code_fingerprint() -> str:
    """folio's own code as it is on disk (each module's path, size and modification time):
    a changed layer can change the peak, and a version number would not say so."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    entries = []
    for root, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                stat = os.stat(os.path.join(root, name))
                entries.append(f"{os.path.relpath(os.path.join(root, name), package)}:"
                               f"{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()


def profile_key(engine_config: Any, kernels: Any, model_path: str, gpu: str) -> str:
    """The hash a stored profile must match: the whole engine configuration (its repr: every
    setting), the kernel choices, the model's files, the GPU (`gpu`, from gpu_name), folio's
    code and the versions of torch and triton."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - CUDA installs have triton
        triton_version = None
    parts = [repr(engine_config), repr(kernels), _model_fingerprint(model_path),
             gpu, _code_fingerprint(), torch.__version__, torch.version.cuda, triton_version]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


def gpu_name(device: torch.device) -> str:
    """The GPU's model and compute capability, for profile_key."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm{major}{minor}"


def _path(key: str) -> str:
    return os.path.join(folio_cache_dir(), "kv_profile", f"{key}.json")


def load_activation_bytes(key: str) -> int | None:
    """The stored peak above the weights for this key, or None (not stored, unreadable)."""
    try:
        with open(_path(key), encoding="utf-8") as f:
            value = json.load(f)["activation_bytes"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, int) and value >= 0 else None


def store_activation_bytes(key: str, activation_bytes: int) -> None:
    """Keep the measured figure (written to a temporary name, then renamed: a reader never
    sees half a file). A read-only cache directory only costs the next start a profile."""
    path = _path(key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"activation_bytes": int(activation_bytes)}, f)
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("could not store the KV profiling result (%s): the next start "
                       "profiles again", exc)
