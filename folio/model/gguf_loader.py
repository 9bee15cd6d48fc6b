"""Read a llama-family GGUF file into a Hugging Face style config + float32 state dict.

The config, chat template and tokenizer come from gguf_metadata.py (torch-free, read by the
front end too); this module adds the weights: every tensor dequantized to float32 under its
Hugging Face name, with llama.cpp's Q/K row reordering undone — or, with `keep_quantized`, the
matrices of the types the CPU multiplies quantized kept so (4-bit planes: Q4_0/Q4_1/Q5_0/Q5_1/
Q4_K/Q5_K, folio.model.quant.gguf_planes; int8 codes: Q8_0/Q6_K, gguf_int8), the rest
dequantized.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from folio.model.gguf_metadata import (ROPE_FREQS, SUPPORTED_ARCHITECTURES, dequantize_array,
                                       hf_tensor_name, load_gguf_tokenizer,
                                       metadata_from_reader, read_with)

__all__ = ["GGUFCheckpoint", "read_gguf", "load_gguf_tokenizer", "SUPPORTED_ARCHITECTURES"]

@dataclass
class GGUFCheckpoint:
    """Everything folio needs from a GGUF file, in Hugging Face vocabulary."""

    hf_config: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    chat_template: str | None
    # Metadata that doesn't belong in config.json: end-of-turn ids beyond eos_token_id (for
    # generation_config.json), and the model's name.
    extra_eos_token_ids: list[int] = field(default_factory=list)
    name: str | None = None
    # With keep_quantized: HF name -> the weight kept quantized, a PlaneSum or Int8Rows
    # (folio.model.quant); those names are not in state_dict.
    quantized: dict[str, Any] = field(default_factory=dict)


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row reordering (interleaved-pair rope -> rotate-half).

    The converter views rows as (head, 2, half) and swaps to (head, half, 2),
    so that the two halves rotated together by HF end up adjacent. Reversing it:
    view as (head, half, 2) and swap back. Works for weights and biases alike.
    """
    rows = w.shape[0]
    half = rows // n_head // 2
    if half * 2 * n_head != rows:
        raise ValueError(f"cannot un-permute {rows} rows into {n_head} heads")
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _dequantize(t, path: str) -> torch.Tensor:
    return torch.from_numpy(dequantize_array(t, path))


def read_gguf(path: str, keep_quantized: bool = False) -> GGUFCheckpoint:
    """Parse `path` and return an HF-layout config and float32 state dict (with
    `keep_quantized`, the matrices of the types folio multiplies quantized kept so instead)."""
    return read_with(path, lambda *args: _build_checkpoint(*args, keep_quantized=keep_quantized))


def _quantized_of(t, n_heads: int | None):
    """A 2-D tensor of a type kept quantized (KEPT_TYPES) as its PlaneSum or Int8Rows, rows
    un-permuted like the float weight's."""
    import numpy as np

    from folio.model.quant.gguf_int8 import INT8_TYPES, int8_from_blocks
    from folio.model.quant.gguf_planes import PlaneSum, planes_from_blocks
    k = int(t.shape[0])
    n = int(np.prod([int(d) for d in t.shape[1:]]))
    name, raw = t.tensor_type.name, np.asarray(t.data)
    matrix = (int8_from_blocks(name, raw, (n, k)) if name in INT8_TYPES
              else PlaneSum(planes_from_blocks(name, raw, (n, k))))
    if n_heads is not None:
        matrix = matrix.take_rows(_unpermute_rows(torch.arange(n), n_heads).numpy())
    return matrix


def _build_checkpoint(reader, path: str, arch: str, spec,
                      keep_quantized: bool = False) -> GGUFCheckpoint:
    # The config first: it also rejects tensors folio would silently drop.
    meta = metadata_from_reader(reader, path, arch, spec)
    cfg = meta.hf_config
    n_layers, n_heads, n_kv = (cfg["num_hidden_layers"], cfg["num_attention_heads"],
                               cfg["num_key_value_heads"])
    from folio.model.quant.gguf_int8 import INT8_TYPES
    from folio.model.quant.gguf_planes import PLANE_TYPES
    kept_types = PLANE_TYPES | INT8_TYPES
    state_dict: dict[str, torch.Tensor] = {}
    quantized: dict[str, Any] = {}
    for name, t in {t.name: t for t in reader.tensors}.items():
        if name == ROPE_FREQS:
            continue
        hf = hf_tensor_name(name, n_layers, arch)
        permuted = spec.qk_permuted and (".attn_q." in name or ".attn_k." in name)
        heads = (n_heads if ".attn_q." in name else n_kv) if permuted else None
        if keep_quantized and t.tensor_type.name in kept_types and len(t.shape) == 2:
            quantized[hf] = _quantized_of(t, heads)
            continue
        w = _dequantize(t, path)
        if permuted:
            w = _unpermute_rows(w, heads)
        if spec.norm_shift and hf.endswith("norm.weight"):
            w = w - spec.norm_shift
        state_dict[hf] = w
    return GGUFCheckpoint(hf_config=cfg, state_dict=state_dict, chat_template=meta.chat_template,
                          extra_eos_token_ids=meta.extra_eos_token_ids, name=meta.name,
                          quantized=quantized)
