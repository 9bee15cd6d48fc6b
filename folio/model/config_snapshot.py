"""A model's transformers config, read back on later starts without importing transformers.

Building a config through transformers (`AutoConfig`) imports most of the library: on the
H200's warm restart that was ~6 s of a 15 s start (torch.distributed's FSDP, scikit-learn,
the auto-docstring machinery), in the engine core's process as well as the front end's.
folio reads only plain attributes of the config (sizes, rope settings, layer types...), so
the config is resolved once by transformers, its public attributes (defaults filled, aliases
such as `num_experts` and properties such as `rope_scaling` resolved) are written as JSON in
folio's cache directory, and every start, the first included, reads them back as a
`ConfigSnapshot`. The key is the config's source (the config.json bytes and its path, or a
GGUF file's derived config) and the transformers version, so a changed file or library builds
a new snapshot.

Everything in the engine therefore sees the same kind of object whether the snapshot was just
written or read from disk; tests compare what folio derives from a snapshot (the
architecture spec, pooling, dtype) with what it derives from transformers' own config.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any, Callable

from folio.model.cache_dir import folio_cache_dir

logger = logging.getLogger(__name__)

# Bumped when the snapshot's layout changes: old files are then ignored.
SNAPSHOT_FORMAT = 1
_SUBCONFIG = "__config__"
# Deprecated aliases whose reading makes transformers log a warning; their targets are kept.
_SKIPPED = frozenset({"torch_dtype", "use_return_dict"})
_MISSING = object()


class ConfigSnapshot:
    """A config's attributes as plain values. Reads and writes go through the config class's
    attribute map (`num_experts` -> `num_local_experts` for Mixtral), as on the original."""

    def __init__(self, values: dict[str, Any], aliases: dict[str, str], class_name: str
                 ) -> None:
        self.__dict__["_values"] = values
        self.__dict__["_aliases"] = aliases
        self.__dict__["_class_name"] = class_name

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_values", "_aliases", "_class_name"):
            raise AttributeError(name)   # pickling and copying look these up first
        values = self.__dict__["_values"]
        value = values.get(self.__dict__["_aliases"].get(name, name), _MISSING)
        if value is _MISSING:
            if name == "torch_dtype":
                return values.get("dtype")
            raise AttributeError(f"{self._class_name} has no attribute {name!r}")
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        self._values[self._aliases.get(name, name)] = value

    def __delattr__(self, name: str) -> None:
        self._values.pop(self._aliases.get(name, name), None)

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ConfigSnapshot) and self._values == other._values
                and self._class_name == other._class_name)

    def __repr__(self) -> str:
        return f"ConfigSnapshot({self._class_name}, {len(self._values)} attributes)"

    def to_dict(self) -> dict[str, Any]:
        return {k: (v.to_dict() if isinstance(v, ConfigSnapshot) else v)
                for k, v in self._values.items()}


def _plain(value: Any) -> Any:
    """`value` as JSON-able data, or _MISSING where it is not data (a method, a module)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _MISSING if any(v is _MISSING for v in items) else items
    if isinstance(value, dict):
        items = {str(k): _plain(v) for k, v in value.items()}
        return _MISSING if any(v is _MISSING for v in items.values()) else items
    if isinstance(value, type):     # a class (e.g. a config's sub_configs map): not data
        return _MISSING
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return str(value).removeprefix("torch.")
    if hasattr(value, "to_dict") and hasattr(type(value), "model_type"):   # a sub-config
        return {_SUBCONFIG: snapshot_dict(value)}
    if hasattr(value, "to_dict") and callable(value.to_dict):   # e.g. a quantization config
        return _plain(value.to_dict())
    return _MISSING


def snapshot_dict(config: Any) -> dict[str, Any]:
    """The public attributes of a transformers config (its fields, properties and aliases),
    as JSON-able data."""
    import warnings
    values: dict[str, Any] = {}
    for name in dir(config):
        if name.startswith("_") or name in _SKIPPED:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                value = getattr(config, name)
            except Exception:   # properties that fail on this config
                continue
        if callable(value) and not hasattr(value, "to_dict"):
            continue
        plain = _plain(value)
        if plain is not _MISSING:
            values[name] = plain
    aliases = dict(getattr(type(config), "attribute_map", None) or {})
    return {"class": type(config).__name__, "aliases": aliases, "values": values}


def from_snapshot_dict(data: dict[str, Any]) -> ConfigSnapshot:
    values = {k: (from_snapshot_dict(v[_SUBCONFIG]) if isinstance(v, dict) and _SUBCONFIG in v
                  else v)
              for k, v in data["values"].items()}
    # aliases resolve to the stored name; both names were stored, so drop the alias copy
    for alias in data["aliases"]:
        values.pop(alias, None)
    return ConfigSnapshot(values, dict(data["aliases"]), data["class"])


def _transformers_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("transformers")
    except PackageNotFoundError:   # pragma: no cover - a dependency
        return "none"


def _path(key: str) -> str:
    return os.path.join(folio_cache_dir(), "configs", f"{key}.json")


def snapshot_key(source_material: Any) -> str:
    """The hash a stored snapshot must match: what the config is read from, the transformers
    version that resolves it and the snapshot format."""
    parts = [source_material, _transformers_version(), SNAPSHOT_FORMAT]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def cached_config(source_material: Any, build: Callable[[], Any]) -> ConfigSnapshot:
    """The config `build()` makes with transformers, as a snapshot: read from the cache when
    `source_material` (JSON-able) and the library match, else built, stored and returned. A
    cache directory that cannot be written only costs the next start the build."""
    key = snapshot_key(source_material)
    path = _path(key)
    try:
        with open(path, encoding="utf-8") as f:
            return from_snapshot_dict(json.load(f))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    data = snapshot_dict(build())
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError as exc:
        logger.debug("could not store the config snapshot (%s)", exc)
    # a JSON round trip, so a fresh build and a cached read give the same object
    return from_snapshot_dict(json.loads(json.dumps(data)))
