"""Finding a model, and what it is: where its files are (a Hugging Face directory, a hub id, or
a GGUF file), its transformers config and chat template. No weights and no torch: the front end
(the API process) runs this; loader.py loads the weights in the engine core.

(transformers itself imports torch when it builds a config or tokenizer, whenever torch is
installed; folio's modules on this path import none of it.)
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelSource:
    kind: str   # "hf_dir" or "gguf"
    path: str
    # A GGUF file's config, chat template and extra end-of-turn ids (a GGUFMetadata), filled
    # by load_hf_config; the weights are read when the model is loaded.
    gguf_metadata: Any = field(default=None, repr=False)


def gguf_file_of(source: ModelSource) -> str | None:
    """The GGUF file a model's weights come from: the file itself, or the one a directory in
    folio's conversion cache (the default model's, default_model.py) was made from; None
    otherwise."""
    if source.kind == "gguf":
        return source.path
    # Only folio's own conversions (the cache, default_model.py): a copy elsewhere is a user's
    # Hugging Face directory, whose own weight files are what it means.
    from folio.model.cache_dir import folio_cache_dir
    cache = os.path.realpath(os.path.join(folio_cache_dir(), "hf"))
    if not os.path.realpath(source.path).startswith(cache + os.sep):
        return None
    marker = os.path.join(source.path, "folio_source.json")
    if os.path.isfile(marker):
        import json
        try:
            with open(marker, encoding="utf-8") as f:
                path = json.load(f).get("gguf_path")
        except (OSError, ValueError):
            return None
        if isinstance(path, str) and os.path.isfile(path):
            return path
    return None


def resolve_quantization(requested: str | None, source: ModelSource, device_type: str,
                         hf_config: Any = None) -> str:
    """The weight format a model runs with (config.QUANTIZATION_METHODS). A checkpoint quantized
    in a supported format (config.json's quantization_config: fp8, compressed-tensors, awq,
    gptq) runs with that method, and asking for another is an error naming both. Otherwise by
    default a GGUF model keeps its quantized matrices packed (CPU and CUDA); an explicit "gguf"
    without a GGUF file, "int8" off the CPU, or a checkpoint format without such a checkpoint, is an error naming the field. "int8" and "fp8" take any float checkpoint (a
    GGUF file's dequantized weights are re-quantized)."""
    from folio.model.quant.scheme import (CHECKPOINT_METHODS, checkpoint_method,
                                          parse_quant_config)
    found = checkpoint_method(hf_config) if hf_config is not None else None
    if found is not None and found != "gguf":
        if found not in CHECKPOINT_METHODS:
            raise ValueError(f"quantization_config.quant_method {found!r} is not supported; "
                             f"supported: {list(CHECKPOINT_METHODS)}")
        if requested not in (None, found):
            raise ValueError(f"quantization {requested!r} does not match the checkpoint's "
                             f"quantization_config.quant_method {found!r}; leave quantization "
                             "unset to use the checkpoint's")
        parse_quant_config(hf_config, found)   # a config folio cannot run fails here
        return found
    if requested in ("compressed-tensors", "awq", "gptq"):
        raise ValueError(f"quantization {requested!r} needs a checkpoint quantized with it "
                         "(config.json's quantization_config); this model has none")
    gguf = gguf_file_of(source)
    if requested is None:
        return "gguf" if gguf is not None else "none"
    if requested == "gguf" and gguf is None:
        raise ValueError("quantization 'gguf' needs a GGUF model (a .gguf file, or the "
                         "default model)")
    if requested == "int8" and device_type != "cpu":
        raise ValueError("quantization 'int8' runs on the CPU only so far; use "
                         "quantization 'fp8' on CUDA")
    return requested


def resolve_model_source(model: str | None, revision: str | None = None) -> ModelSource:
    """Turn the user's `model` argument into a local directory or GGUF file."""
    if model is None:
        from folio.model.default_model import default_model_path
        return ModelSource("hf_dir", default_model_path())
    if os.path.isfile(model):
        if model.endswith(".gguf"):
            return ModelSource("gguf", model)
        raise ValueError(f"model path {model!r} is a file but not a .gguf file; "
                         "give a Hugging Face model directory, a hub id, or a GGUF file")
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            ggufs = sorted(glob.glob(os.path.join(model, "*.gguf")))
            if len(ggufs) == 1:
                return ModelSource("gguf", ggufs[0])
            raise ValueError(f"model directory {model!r} has no config.json")
        return ModelSource("hf_dir", model)
    looks_like_hub_id = model.count("/") == 1 and not model.startswith((".", "/", "~"))
    if looks_like_hub_id:
        return ModelSource("hf_dir", _download_from_hub(model, revision))
    raise ValueError(f"model {model!r} not found: not a local path, and not a hub id (org/name)")


def _download_from_hub(repo_id: str, revision: str | None) -> str:
    """Fetch config, tokenizer and weights (safetensors preferred) of a hub model into the
    hub cache. Needs a network, or a cache filled earlier (HF_HUB_OFFLINE=1 then reads it)."""
    from huggingface_hub import snapshot_download
    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt",
                "*.jinja"]
    try:
        path = snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
    except Exception as exc:  # network down, no such repo, gated repo...
        raise ValueError(f"model {repo_id!r} is not a local path and could not be fetched "
                         f"from the Hugging Face hub: {exc}") from exc
    if not glob.glob(os.path.join(path, "*.safetensors")):
        # Older repos ship only PyTorch .bin files.
        path = snapshot_download(repo_id, revision=revision,
                                 allow_patterns=patterns + ["*.bin"])
    return path


def _config_object(raw: bytes) -> dict | None:
    """config.json's top-level object; None where it is malformed (transformers reports that
    itself) or not an object."""
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _check_quantization_config_type(data: dict | None, config_file: str) -> None:
    """A `quantization_config` that is not an object (e.g. "gptq") is named here: transformers
    would fail on it with an error about a `to_dict` attribute."""
    if data is not None and "quantization_config" in data \
            and not isinstance(data["quantization_config"], (dict, type(None))):
        raise ValueError(f"{config_file}: quantization_config must be a JSON object with the "
                         f"method's settings (quant_method, bits, ...), got "
                         f"{data['quantization_config']!r}")


# Older AutoGPTQ / AutoAWQ exports keep the settings beside config.json rather than in its
# quantization_config (vLLM reads these files too). AutoAWQ's has no quant_method; its keys
# (w_bit, q_group_size, version, zero_point) say which it is.
_SIDE_QUANT_FILES = ("quantize_config.json", "quant_config.json")
_AWQ_KEYS = ("w_bit", "q_group_size", "version", "zero_point")


def _side_quantization_config(path: str, data: dict | None) -> dict | None:
    """The quantization settings in a side file, for a config.json (`data`) without any
    (neither quantization_config nor compressed-tensors' older compression_config); None
    otherwise."""
    if data is None or data.get("quantization_config") is not None \
            or data.get("compression_config") is not None:
        return None
    for name in _SIDE_QUANT_FILES:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        try:
            with open(file, encoding="utf-8") as f:
                side = json.load(f)
        except (OSError, ValueError) as exc:
            raise ValueError(f"could not read the quantization settings in {file}: {exc}"
                             ) from exc
        if not isinstance(side, dict):
            raise ValueError(f"{file} must be a JSON object with the method's settings "
                             f"(bits, group_size, ...), got {side!r}")
        if "quant_method" not in side:
            awq = any(k in side for k in _AWQ_KEYS)
            side = {**side, "quant_method": "awq" if awq else "gptq"}
        return side
    return None


def load_hf_config(source: ModelSource) -> tuple[Any, str | None]:
    """The model's config (a ConfigSnapshot of the transformers config: config_snapshot.py),
    and a chat template found beside the weights (GGUF)."""
    from folio.model.config_snapshot import cached_config
    if source.kind == "gguf":
        from folio.model.gguf_metadata import read_gguf_metadata
        if source.gguf_metadata is None:
            source.gguf_metadata = read_gguf_metadata(source.path)
        cfg_dict = dict(source.gguf_metadata.hf_config)

        def build_gguf() -> Any:
            from transformers import AutoConfig
            fields = dict(cfg_dict)
            return AutoConfig.for_model(fields.pop("model_type"), **fields)
        return (cached_config(["gguf", cfg_dict], build_gguf),
                source.gguf_metadata.chat_template)
    config_file = os.path.join(source.path, "config.json")
    try:
        with open(config_file, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ValueError(f"could not read the model config in {source.path!r}: {exc}") from exc
    data = _config_object(raw)
    _check_quantization_config_type(data, config_file)
    side = _side_quantization_config(source.path, data)
    digest = hashlib.sha256(raw + json.dumps(side, sort_keys=True).encode()).hexdigest()

    def build() -> Any:
        from transformers import AutoConfig
        try:
            config = AutoConfig.from_pretrained(source.path)
        except Exception as exc:
            raise ValueError(f"could not read the model config in {source.path!r}: {exc}"
                             ) from exc
        if side is not None:
            config.quantization_config = side
        return config
    from folio.model.families import decoder_config
    return decoder_config(cached_config(["hf_dir", os.path.abspath(source.path), digest],
                                        build)), None
