"""The FP8 KV cache's number format, shared by every attention backend (--kv-cache-dtype fp8).

A cache element holds x / scale in float8 (e4m3fn, or e5m2), the scale one float32 per KV head
of the layer (`Attention.k_scale` / `v_scale`: from the checkpoint, computed from the first
step with --calculate-kv-scales, else 1.0, as vLLM). Writing clamps to the format's largest
finite value before the cast: casts differ in what they make of a value past it (NaN in e4m3fn
for older torch's conversion, infinity in e5m2), and one such element would poison every later
read of its row. Reading is exact (float8 -> float32), then times the scale.

The torch reference (torch_paged.py) runs these functions; the C++ CPU kernel and the Triton
kernels do the same arithmetic in their own code, and the tests hold them to it.
"""
from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# --calculate-kv-scales maps the first step's largest |K| and |V| to these, vLLM's defaults
# (K_SCALE_CONSTANT, V_SCALE_CONSTANT), below e4m3's 448: keys up to 2.2x and values up to 4.5x
# the first step's largest still fit unclipped in later steps. A floating-point format loses
# no precision to the headroom; only its subnormal threshold moves (SmolLM2's perplexity with
# an e4m3 cache: the same with amax / 448).
CALCULATED_K_RANGE = 200.0
CALCULATED_V_RANGE = 100.0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value: 448 (e4m3fn), 57344 (e5m2)."""
    return float(torch.finfo(dtype).max)


def per_head_scales(scale: torch.Tensor | None, num_kv_heads: int,
                    device: torch.device) -> torch.Tensor:
    """`scale` as the kernels index it: float32, contiguous, one per KV head. None = 1.0; a
    per-tensor scale (one element) is repeated. The model's own buffers are already in this
    form and come back as they are (a captured CUDA graph keeps reading the same memory)."""
    if scale is None:
        return torch.ones(num_kv_heads, dtype=torch.float32, device=device)
    if scale.numel() == 1 and num_kv_heads != 1:
        scale = scale.reshape(1).expand(num_kv_heads)
    if scale.dtype != torch.float32 or not scale.is_contiguous() or scale.dim() != 1:
        scale = scale.reshape(-1).to(torch.float32).contiguous()
    if scale.shape != (num_kv_heads,):
        raise ValueError(f"a KV cache scale has {scale.numel()} elements; expected 1 or one per "
                         f"KV head ({num_kv_heads})")
    return scale


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., KVH, D] -> the cache's float8 values: x / scale[KVH], saturated, rounded to
    nearest even."""
    limit = fp8_max(dtype)
    return (x.to(torch.float32) / scale[:, None]).clamp(-limit, limit).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float8 cache values x [..., KVH, D] -> float32 x * scale[KVH], cast to `dtype`."""
    return (x.to(torch.float32) * scale[:, None]).to(dtype)
