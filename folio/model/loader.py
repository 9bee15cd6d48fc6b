"""Finding a model and loading its weights: a Hugging Face directory, a hub id, or a GGUF file."""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from folio.model.attention import get_attention_backend
from folio.model.decoder import DecoderLM
from folio.model.families import ArchSpec, arch_spec_from_hf_config

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


@dataclass
class ModelSource:
    kind: str   # "hf_dir" or "gguf"
    path: str
    # A GGUF file is parsed once: the config and the weights come from the same read, and the
    # weights are dropped once loaded.
    gguf_checkpoint: Any = field(default=None, repr=False)


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


def load_hf_config(source: ModelSource) -> tuple[Any, str | None]:
    """The transformers config, and a chat template found beside the weights (GGUF)."""
    from transformers import AutoConfig
    if source.kind == "gguf":
        from folio.model.gguf_loader import read_gguf
        if source.gguf_checkpoint is None:
            source.gguf_checkpoint = read_gguf(source.path)
        cfg_dict = dict(source.gguf_checkpoint.hf_config)
        return (AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict),
                source.gguf_checkpoint.chat_template)
    try:
        return AutoConfig.from_pretrained(source.path), None
    except Exception as exc:
        raise ValueError(f"could not read the model config in {source.path!r}: {exc}") from exc


def resolve_dtype(dtype: str, hf_config: Any, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = _DTYPES.get(config_dtype, torch.float32)
    if config_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        config_dtype = torch.float32
    if device.type == "cpu" and config_dtype == torch.float16:
        return torch.bfloat16  # CPU float16 kernels are slow and narrow-ranged
    if device.type == "cuda" and config_dtype == torch.float32:
        return torch.bfloat16  # float32 halves the GPU's matmul rate and doubles the bytes
    return config_dtype


def iter_checkpoint_weights(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    if source.kind == "gguf":
        from folio.model.gguf_loader import read_gguf
        checkpoint = source.gguf_checkpoint or read_gguf(source.path)
        source.gguf_checkpoint = None
        yield from checkpoint.state_dict.items()
        return
    path = source.path
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, name) for name in files]
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        from safetensors import safe_open
        for file in files:
            try:
                with safe_open(file, framework="pt") as handle:
                    for name in handle.keys():
                        yield name, handle.get_tensor(name)
            except FileNotFoundError as exc:
                raise ValueError(f"weight file {file} is missing") from exc
            except Exception as exc:
                raise ValueError(f"could not read weight file {file}: {exc}") from exc
        return
    bins = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if not bins:
        raise ValueError(f"no weights (*.safetensors or pytorch_model*.bin) in {path!r}")
    for file in bins:
        try:
            # weights_only: a pickle can run code; only tensors are accepted.
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise ValueError(f"could not read weight file {file}: {exc}") from exc
        yield from state.items()


def load_model(source: ModelSource, hf_config: Any, dtype: torch.dtype, device: torch.device,
               max_model_len: int) -> tuple[DecoderLM, ArchSpec]:
    spec = arch_spec_from_hf_config(hf_config)
    backend = get_attention_backend(device)
    with torch.device("meta"):
        # Build on the meta device in the target dtype, then materialise once on the target
        # device: no time on random init, and no float32 copy of the weights on the way.
        model = DecoderLM(spec, hf_config, backend, max_positions=max(max_model_len, 1))
    model = model.to(dtype=dtype).to_empty(device=device)
    model.load_weights(iter_checkpoint_weights(source))  # copy_ casts each tensor on the way
    # The rotary tables were meta buffers; build them for real, in float32 (positions need
    # the precision; they are cast to the activation dtype at each use, as transformers does).
    with torch.device(device):
        rotary = type(model.layers[0].self_attn.rotary)(spec.head_dim, max(max_model_len, 1), hf_config)
    for layer in model.layers:
        layer.self_attn.rotary = rotary
    model.rotary_table = rotary
    model.eval()
    return model, spec
