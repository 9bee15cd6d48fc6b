"""Rotary embedding (neox layout: the two halves of the rotary dims rotate together) for q and
k in one launch: program (token, head) over the H query heads and KVH key heads.

Matches `folio.model.layers.RotaryEmbedding.forward` given its cos/sin tables [P, R] (the two
halves of each row are equal; the first half is read). Dims past R pass through unchanged.
Rotation math runs in fp32 on the input-dtype cos/sin, rounded once (torch rounds each product).
"""
from __future__ import annotations

import torch

from folio.model.kernels._common import (
    HAS_TRITON, next_pow2, require_triton, tl, triton, warps_configs)

if HAS_TRITON:

    @triton.autotune(configs=warps_configs((1, 2, 4)), key=["HALF_PAD", "D"])
    @triton.jit
    def _rotary_kernel(POS, Q, K, QO, KO, COS, SIN,
                       stride_qt, stride_qh, stride_kt, stride_kh,
                       stride_qot, stride_qoh, stride_kot, stride_koh, stride_cos,
                       H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                       HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        if h < H:
            src = Q + t * stride_qt + h * stride_qh
            dst = QO + t * stride_qot + h * stride_qoh
        else:
            src = K + t * stride_kt + (h - H) * stride_kh
            dst = KO + t * stride_kot + (h - H) * stride_koh
        pos = tl.load(POS + t).to(tl.int64)
        i = tl.arange(0, HALF_PAD)
        m = i < HALF
        dt = Q.dtype.element_ty
        c = tl.load(COS + pos * stride_cos + i, mask=m, other=0.0).to(dt).to(tl.float32)
        s = tl.load(SIN + pos * stride_cos + i, mask=m, other=0.0).to(dt).to(tl.float32)
        x1 = tl.load(src + i, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + i, mask=m, other=0.0).to(tl.float32)
        tl.store(dst + i, (x1 * c - x2 * s).to(dt), mask=m)
        tl.store(dst + HALF + i, (x2 * c + x1 * s).to(dt), mask=m)
        if REST_PAD > 0:  # partial rotary: copy the untouched tail
            j = 2 * HALF + tl.arange(0, REST_PAD)
            mj = j < D
            tl.store(dst + j, tl.load(src + j, mask=mj), mask=mj)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int, q [T, H, D], k [T, KVH, D], cos/sin [P, R] (R even, <= D).
    Returns new (q, k); inputs may be strided views (e.g. slices of a fused qkv)."""
    require_triton()
    T, H, D = q.shape
    KVH = k.shape[1]
    R = cos.shape[-1]
    assert R % 2 == 0 and R <= D and q.stride(2) == 1 and k.stride(2) == 1
    assert cos.stride(-1) == 1 and sin.stride() == cos.stride()
    q_out, k_out = torch.empty_like(q, memory_format=torch.contiguous_format), \
        torch.empty_like(k, memory_format=torch.contiguous_format)
    if T == 0:
        return q_out, k_out
    half = R // 2
    rest = D - R
    _rotary_kernel[(T, H + KVH)](
        positions, q, k, q_out, k_out, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0),
        H=H, D=D, HALF=half, HALF_PAD=next_pow2(half), REST_PAD=next_pow2(rest) if rest else 0)
    return q_out, k_out
