"""Activation quantization for W8A8 matmuls: x [M, K] -> (codes [M, K] fp8 e4m3 or int8,
scales [M, 1] float32) with x ~= codes * scale.

Per token (dynamic): one program per row, two passes over the row (its absolute maximum, then
the codes), scale = amax / qmax. Static: the checkpoint's per-tensor scale, one pass. One launch
instead of the half-dozen elementwise torch ops the same arithmetic takes; a prefill of 8k
tokens reads and writes its activations once per projection instead of five times.
"""
from __future__ import annotations

import torch

from folio.model.kernels._common import HAS_TRITON, require_triton, tl, triton

FP8_MAX = 448.0
INT8_MAX = 127.0
# Smallest scale: an all-zero row quantizes to zeros instead of dividing by zero.
_MIN_SCALE = 1e-12

if HAS_TRITON:

    @triton.jit
    def _act_quant_kernel(X, Q, S, STATIC, stride_x, stride_q, K: tl.constexpr,
                          QMAX: tl.constexpr, IS_INT: tl.constexpr, DYNAMIC: tl.constexpr,
                          BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride_x
        q_row = Q + row * stride_q
        if DYNAMIC and K <= BLOCK:
            # the row in one block: loaded once, kept in registers for the codes
            offs = tl.arange(0, BLOCK)
            v = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(v), axis=0) / QMAX, 1e-12)
            tl.store(S + row, scale)
            v = tl.minimum(tl.maximum(v * (1.0 / scale), -QMAX), QMAX)
            if IS_INT:
                v = tl.where(v >= 0, tl.floor(v + 0.5), tl.ceil(v - 0.5))
            tl.store(q_row + offs, v.to(Q.dtype.element_ty), mask=offs < K)
        else:
            if DYNAMIC:
                amax = tl.zeros((BLOCK,), dtype=tl.float32)
                for k0 in range(0, K, BLOCK):
                    offs = k0 + tl.arange(0, BLOCK)
                    v = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
                    amax = tl.maximum(amax, tl.abs(v))
                scale = tl.maximum(tl.max(amax, axis=0) / QMAX, 1e-12)
                tl.store(S + row, scale)
            else:
                scale = tl.load(STATIC)
            inv = 1.0 / scale
            for k0 in range(0, K, BLOCK):
                offs = k0 + tl.arange(0, BLOCK)
                v = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32) * inv
                v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
                if IS_INT:
                    # round half away from zero; ties are measure-zero for real activations
                    v = tl.where(v >= 0, tl.floor(v + 0.5), tl.ceil(v - 0.5))
                tl.store(q_row + offs, v.to(Q.dtype.element_ty), mask=offs < K)


def quantize_activations(x: torch.Tensor, dtype: torch.dtype,
                         static_scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (CUDA, 16-bit) -> (codes [M, K] in `dtype` (float8_e4m3fn or int8), scale):
    scale [M, 1] float32 per row, or, given `static_scale` (a float32 [] tensor), that scale
    expanded to [M, 1]."""
    require_triton()
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"activation quantization needs x [M, K] with contiguous rows, got "
                         f"{tuple(x.shape)}")
    is_int = dtype == torch.int8
    if not is_int and dtype != torch.float8_e4m3fn:
        raise ValueError(f"activations quantize to float8_e4m3fn or int8, not {dtype}")
    m, k = x.shape
    codes = torch.empty((m, k), dtype=dtype, device=x.device)
    if static_scale is None:
        scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    else:
        scale = static_scale.reshape(1, 1).expand(m, 1)
    if m:
        block = min(triton.next_power_of_2(k), 4096)
        _act_quant_kernel[(m,)](x, codes, scale, static_scale if static_scale is not None
                                else scale, x.stride(0), codes.stride(0), K=k,
                                QMAX=INT8_MAX if is_int else FP8_MAX, IS_INT=is_int,
                                DYNAMIC=static_scale is None, BLOCK=block,
                                num_warps=4 if block <= 2048 else 8)
    return codes, scale


def quantize_activations_reference(x: torch.Tensor, dtype: torch.dtype,
                                   static_scale: torch.Tensor | None = None,
                                   per_tensor: bool = False
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in torch ops (CPU, tests, and the per-tensor dynamic strategy)."""
    is_int = dtype == torch.int8
    qmax = INT8_MAX if is_int else FP8_MAX
    xf = x.to(torch.float32)
    if static_scale is not None:
        scale = static_scale.to(torch.float32).reshape(1, 1).expand(x.shape[0], 1)
    elif per_tensor:
        scale = (xf.abs().amax() / qmax).clamp_min(_MIN_SCALE).reshape(1, 1) \
            .expand(x.shape[0], 1)
    else:
        scale = (xf.abs().amax(dim=1, keepdim=True) / qmax).clamp_min(_MIN_SCALE)
    v = (xf / scale).clamp(-qmax, qmax)
    if is_int:
        v = torch.where(v >= 0, torch.floor(v + 0.5), torch.ceil(v - 0.5))
    return v.to(dtype), scale.contiguous()
