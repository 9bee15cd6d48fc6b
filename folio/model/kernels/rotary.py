"""Rotary embedding (neox layout: the two halves of the rotary dims rotate together) for q and
k in one launch: program (token, block of up to 8 heads) over the H query heads, then the KVH
key heads.

Matches `folio.model.layers.RotaryEmbedding.forward` given its cos/sin tables [P, R] (the two
halves of each row are equal; the first half is read). Dims past R pass through unchanged.
Rotation math runs in fp32 on the input-dtype cos/sin, rounded once (torch rounds each product).

With per-head RMSNorm weights (Qwen3's q_norm/k_norm) the head is normalized first, in the same
launch, rounding as `folio.model.layers.RMSNorm` does; that saves two launches per layer.

With a `PagedKVWrite` from the attention backend, the key-head programs also write their rotated
keys and the matching values into the paged KV cache, the backend's cache write done in this
launch (one launch less per layer and step: at batch-1 decode of a 32-layer model, 32 of the
step's ~290). The bytes written are the backend's own (`triton_kernels.reshape_and_cache`): the
rotated key rounded to the activations' dtype, then for an FP8 cache divided by its scale and
clamped to the format's range.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from folio.model.kernels._common import (
    HAS_TRITON, next_pow2, pdl_launch, require_triton, tl, triton, warps_configs)

if HAS_TRITON:
    from folio.model.kernels._common import autotune
    from folio.model.kernels._common import pdl_entry

_HEADS_PER_PROGRAM = 8


@dataclass
class PagedKVWrite:
    """An attention backend's KV cache write, handed to `apply_rotary` to do in its launch.
    `value` [T, KVH, D] (head_dim contiguous); `kv_cache` [2, num_blocks, block_size, KVH, D]
    (head_dim contiguous); `slot_mapping` [T] int64, block * block_size + offset, < 0 for
    padding (skipped); `k_scale` / `v_scale` float32 [KVH] for an FP8 cache (`fp8_max` its
    largest finite value; 0.0 = not FP8, the scales then unread); `separately(key)`: the
    backend's own write, for a rotary that cannot take it into its launch (the CPU, M-RoPE)."""
    value: torch.Tensor
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    fp8_max: float
    separately: Callable[[torch.Tensor], None]


if HAS_TRITON:

    @autotune(configs=warps_configs((1, 2, 4)), key=["HALF_PAD", "D", "HB", "CACHE"])
    @triton.jit
    def _rotary_kernel(POS, Q, K, QO, KO, COS, SIN, QW, KW, eps,
                       V, KV, SLOTS, K_SCALE, V_SCALE,
                       stride_qt, stride_qh, stride_kt, stride_kh,
                       stride_qot, stride_qoh, stride_kot, stride_koh, stride_cos,
                       stride_vt, stride_vh, stride_c0, stride_cblk, stride_coff, stride_ch,
                       H: tl.constexpr, KVH: tl.constexpr, HB: tl.constexpr, D: tl.constexpr,
                       HALF: tl.constexpr, HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr,
                       HAS_NORM: tl.constexpr, CACHE: tl.constexpr, D_PAD: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                       USE_PDL: tl.constexpr):
        pdl_entry(USE_PDL)
        # Program (token, block of HB heads): the first ceil(H / HB) blocks are query heads,
        # the rest key heads. A block of heads rather than one head per program: at decode
        # sizes a program per head was too little work for its launch slot.
        t = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        NQB: tl.constexpr = (H + HB - 1) // HB
        hb = tl.arange(0, HB)
        if blk < NQB:
            heads = blk * HB + hb
            h_ok = heads < H
            src = Q + t * stride_qt + heads * stride_qh
            dst = QO + t * stride_qot + heads * stride_qoh
            w_ptr = QW
        else:
            heads = (blk - NQB) * HB + hb
            h_ok = heads < KVH
            src = K + t * stride_kt + heads * stride_kh
            dst = KO + t * stride_kot + heads * stride_koh
            w_ptr = KW
        pos = tl.load(POS + t).to(tl.int64)
        i = tl.arange(0, HALF_PAD)
        m = i < HALF
        mm = h_ok[:, None] & m[None, :]
        dt = Q.dtype.element_ty
        c = tl.load(COS + pos * stride_cos + i, mask=m, other=0.0).to(dt).to(tl.float32)[None, :]
        s = tl.load(SIN + pos * stride_cos + i, mask=m, other=0.0).to(dt).to(tl.float32)[None, :]
        x1 = tl.load(src[:, None] + i[None, :], mask=mm, other=0.0).to(tl.float32)
        x2 = tl.load(src[:, None] + HALF + i[None, :], mask=mm, other=0.0).to(tl.float32)
        if REST_PAD > 0:
            j = 2 * HALF + tl.arange(0, REST_PAD)
            mj = h_ok[:, None] & (j < D)[None, :]
            x3 = tl.load(src[:, None] + j[None, :], mask=mj, other=0.0).to(tl.float32)
        if HAS_NORM:
            # RMSNorm over each whole head: fp32 statistics, rounded to the dtype, times the
            # weight, rounded again (as layers.RMSNorm). The sum of squares in float64, where
            # a 16-bit value's square and their sums are exact, so its order (which follows the
            # compiled config: the variant writing the KV cache tunes its own warps) cannot
            # move rstd by an ulp (kernels/rmsnorm.py does the same).
            sq = tl.sum(x1.to(tl.float64) * x1.to(tl.float64), 1) \
                + tl.sum(x2.to(tl.float64) * x2.to(tl.float64), 1)
            if REST_PAD > 0:
                sq += tl.sum(x3.to(tl.float64) * x3.to(tl.float64), 1)
            rstd = tl.math.rsqrt((sq / D).to(tl.float32) + eps)[:, None]
            w1 = tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32)[None, :]
            w2 = tl.load(w_ptr + HALF + i, mask=m, other=0.0).to(tl.float32)[None, :]
            x1 = ((x1 * rstd).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
            x2 = ((x2 * rstd).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
            if REST_PAD > 0:
                w3 = tl.load(w_ptr + j, mask=j < D, other=0.0).to(tl.float32)[None, :]
                x3 = ((x3 * rstd).to(dt).to(tl.float32) * w3).to(dt).to(tl.float32)
        o1 = (x1 * c - x2 * s).to(dt)
        o2 = (x2 * c + x1 * s).to(dt)
        tl.store(dst[:, None] + i[None, :], o1, mask=mm)
        tl.store(dst[:, None] + HALF + i[None, :], o2, mask=mm)
        if REST_PAD > 0:  # partial rotary: the tail is not rotated
            tl.store(dst[:, None] + j[None, :], x3.to(dt), mask=mj)
        if CACHE:
            if blk >= NQB:
                slot = tl.load(SLOTS + t)
                if slot >= 0:  # a padding token's slot is negative: nothing to write
                    base = (KV + (slot // BLOCK_SIZE) * stride_cblk
                            + (slot % BLOCK_SIZE) * stride_coff + heads * stride_ch)
                    ks = tl.load(K_SCALE + heads, mask=h_ok, other=1.0)[:, None] if FP8 \
                        else 1.0
                    _cache_store(base[:, None] + i[None, :], o1, ks, mm, FP8, FP8_MAX)
                    _cache_store(base[:, None] + HALF + i[None, :], o2, ks, mm, FP8, FP8_MAX)
                    if REST_PAD > 0:
                        _cache_store(base[:, None] + j[None, :], x3.to(dt), ks, mj, FP8,
                                     FP8_MAX)
                    dd = tl.arange(0, D_PAD)
                    mv = h_ok[:, None] & (dd < D)[None, :]
                    v = tl.load(V + t * stride_vt + heads[:, None] * stride_vh + dd[None, :],
                                mask=mv, other=0.0)
                    vs = tl.load(V_SCALE + heads, mask=h_ok, other=1.0)[:, None] if FP8 \
                        else 1.0
                    _cache_store(base[:, None] + stride_c0 + dd[None, :], v, vs, mv, FP8,
                                 FP8_MAX)

    @triton.jit
    def _cache_store(ptrs, x, scale, mask, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
        """x (the activations' dtype) into the cache's dtype, as reshape_and_cache stores it:
        for FP8, x / scale by IEEE division, clamped to the format's range before the cast."""
        if FP8:
            y = tl.math.div_rn(x.to(tl.float32), tl.broadcast_to(scale, x.shape))
            y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
            tl.store(ptrs, y.to(ptrs.dtype.element_ty), mask=mask)
        else:
            tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, q_norm_weight: torch.Tensor | None = None,
                 k_norm_weight: torch.Tensor | None = None,
                 eps: float = 1e-6, pdl: bool = False,
                 kv_write: PagedKVWrite | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int, q [T, H, D], k [T, KVH, D], cos/sin [P, R] (R even, <= D).
    Returns new (q, k); inputs may be strided views (e.g. slices of a fused qkv). With
    q_norm_weight and k_norm_weight ([D] each), each head is RMS-normalized first. `pdl`:
    launch with programmatic dependent launch where the GPU has it (_common). `kv_write`:
    also write the rotated keys and the values into the paged cache (PagedKVWrite)."""
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
    has_norm = q_norm_weight is not None
    if has_norm and (k_norm_weight is None or q_norm_weight.dtype != q.dtype
                     or k_norm_weight.dtype != q.dtype):
        raise ValueError("fused qk-norm needs both weights, in the activations' dtype")
    qw = q_norm_weight if has_norm else cos
    kw = k_norm_weight if has_norm else cos
    hb = min(_HEADS_PER_PROGRAM, next_pow2(max(H, KVH)))
    pdl = pdl_launch(q, pdl)
    w = kv_write
    if w is not None:
        v, cache = w.value, w.kv_cache
        assert v.shape == k.shape and v.stride(2) == 1 and cache.dim() == 5 \
            and cache.shape[0] == 2 and cache.shape[3:] == (KVH, D) and cache.stride(4) == 1 \
            and w.slot_mapping.shape == (T,), "PagedKVWrite does not match k"
        cache_args = (v, cache, w.slot_mapping, w.k_scale, w.v_scale)
        cache_strides = (v.stride(0), v.stride(1), *cache.stride()[:4])
    else:  # never read: q stands in for the pointers
        cache_args, cache_strides = (q, q, positions, cos, cos), (0,) * 6
    _rotary_kernel[(T, triton.cdiv(H, hb) + triton.cdiv(KVH, hb))](
        positions, q, k, q_out, k_out, cos, sin, qw, kw, float(eps), *cache_args,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0),
        *cache_strides,
        H=H, KVH=KVH, HB=hb, D=D, HALF=half, HALF_PAD=next_pow2(half),
        REST_PAD=next_pow2(rest) if rest else 0, HAS_NORM=has_norm,
        CACHE=w is not None, D_PAD=next_pow2(D),
        BLOCK_SIZE=w.kv_cache.shape[2] if w is not None else 1,
        FP8=w is not None and w.fp8_max > 0, FP8_MAX=w.fp8_max if w is not None else 0.0,
        USE_PDL=pdl, launch_pdl=pdl)
    return q_out, k_out
