"""What a quantized model's decode step reads, for the benches' rooflines: the bits per
projection weight of the model's quantization scheme (codes plus their share of scales and zero
points) and the KV cache's bytes per element. Read from the model's config.json and the flags,
as the engine resolves them (folio.model.quant.scheme), without loading anything."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

# Bits of one scale or zero point as the formats store them: bf16/fp16 group scales (INT4),
# float32 row scales (FP8, INT8).
_GROUP_SCALE_BITS = 16
_ROW_SCALE_BITS = 32


def projection_bits(model_path: str, quantization: str | None) -> float | None:
    """Bits per projection weight (None: the model dtype's, unquantized)."""
    from folio.model.quant.scheme import checkpoint_method, normalize_method, parse_quant_config
    config_path = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_path):
        return None
    with open(config_path, encoding="utf-8") as f:
        raw = json.load(f)
    hf = SimpleNamespace(quantization_config=raw.get("quantization_config"))
    method = checkpoint_method(hf) if hf.quantization_config else None
    if method is None:
        method = normalize_method(quantization) if quantization else None
    if method not in ("fp8", "compressed-tensors", "awq", "gptq"):
        return None
    scheme = parse_quant_config(hf if hf.quantization_config else SimpleNamespace(), method).scheme
    hidden = int(raw.get("hidden_size", 4096))
    if scheme.weight in ("fp8", "int8"):
        return 8 + _ROW_SCALE_BITS / hidden
    group = scheme.group_size or hidden
    return 4 + _GROUP_SCALE_BITS * (1 if scheme.symmetric else 2) / group


def kv_dtype_bytes(cache_dtype: str | None, dtype_bytes: int) -> int:
    """Bytes per KV cache element for --kv-cache-dtype (auto: the model's)."""
    name = (cache_dtype or "auto").lower()
    if name.startswith("fp8"):
        return 1
    return {"float32": 4, "bfloat16": 2, "float16": 2}.get(name, dtype_bytes)


def packed_weight_bytes(worker: Any) -> int | None:
    """The bytes of the weights a model runs on, counted from its tensors, each storage once,
    where no formula of the config gives them:
    - a model on its GGUF file's packed weights (quantization "gguf"): the file's types differ
      in bits per weight (the default model: 4-bit planes for the projections, int8 rows for
      the tied embedding);
    - a quantized model on the CPU, which keeps some methods as they are stored and widens
      others (FP8 weights run dequantized there, so 8 bits a weight would flatter it).
    None for every other model (the formula's bits are what the device reads)."""
    method = getattr(worker, "quantization", None)
    on_cpu = str(getattr(worker, "device", "")).startswith("cpu")
    if method != "gguf" and not (on_cpu and method not in (None, "none")):
        return None
    model = worker.model
    seen: set[int] = set()   # (an untied embedding counted whole: roofline.py's convention)
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen and tensor.device.type != "meta":
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
