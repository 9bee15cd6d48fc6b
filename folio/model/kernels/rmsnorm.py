"""Fused (residual add +) RMSNorm: one read of x (and residual), one write of each output.

Rounds like `folio.model.layers.RMSNorm`: the residual sum is rounded to the input dtype, the
statistics run in fp32, the normalized value is rounded to the input dtype before the weight
multiply, and the product is rounded once more.

`rms_norm_quantized` also quantizes the normed row per token for a W8A8 projection after it
(q/k/v, gate/up): the codes and scale `act_quant.quantize_activations` would give the 16-bit
norm output, bit for bit, without writing that output and reading it back (at an 8,000-token
prefill of Llama-3-8B shapes, 65 MB each way per norm, and a launch).
"""
from __future__ import annotations

import torch

from folio.model.kernels._common import (
    HAS_TRITON, INTERPRET, next_pow2, pdl_launch, require_triton, tl, triton)

if HAS_TRITON:
    from folio.model.kernels._common import pdl_entry


def _num_warps(block_d: int) -> int:
    """Warps per row, one rule for both kernels: rms_norm_quantized must round the very values
    rms_norm does (so the codes are those quantize_activations makes of rms_norm's output),
    and the reduction order follows the warp count (the float64 sum of squares in
    `_normed_row` makes the order all but irrelevant; one count keeps it so)."""
    return 1 if INTERPRET else max(1, min(8, block_d // 1024))

if HAS_TRITON:

    @triton.jit
    def _normed_row(X, R, W, RES_OUT, row, stride_x, stride_r, stride_ro, eps,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_RES: tl.constexpr):
        """One row's norm (the residual sum stored first, where given): its float32 product
        with the weight before the output's rounding, the columns and their mask. One body
        for both kernels, so both round the same values (and `_add_norm_row_chunked` as
        they do)."""
        d = tl.arange(0, BLOCK_D)
        mask = d < D
        x = tl.load(X + row * stride_x + d, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(R + row * stride_r + d, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
            tl.store(RES_OUT + row * stride_ro + d, x, mask=mask)
        xf = x.to(tl.float32)
        # The sum of squares in float64: a 16-bit value's square is exact there, and so is
        # nearly every sum of them, whatever order the compiled kernel adds them in. In
        # float32 the order (which follows the register layout the compiler picks for each
        # kernel: rms_norm_quantized's one-byte stores gave it another) moved rstd by an ulp
        # in ~3 rows of 8,000 on an H200, and a code with it.
        x64 = xf.to(tl.float64)
        var = (tl.sum(x64 * x64, 0) / D).to(tl.float32)
        rstd = tl.math.rsqrt(var + eps)
        normed = (xf * rstd).to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(W + d, mask=mask, other=0.0).to(tl.float32)
        return normed * w, d, mask

    @triton.jit
    def _add_norm_row_chunked(X, R, W, OUT, RES_OUT, row, stride_x, stride_r, stride_o,
                              stride_ro, eps, D, CHUNK: tl.constexpr):
        """`_normed_row` with the residual, stored (OUT, RES_OUT), walking the row in chunks
        of CHUNK columns: the skinny GEMV's norm epilogue (kernels/gemv.py), whose one program
        must not hold a whole row in registers. X was written by other programs of the
        launch (.cg loads: never a stale L1 line). The same roundings as `_normed_row`, and
        the float64 sum of squares is exact, so the chunking cannot move it."""
        sq = tl.zeros((CHUNK,), dtype=tl.float64)
        for c0 in range(0, D, CHUNK):
            d = c0 + tl.arange(0, CHUNK)
            mask = d < D
            x = tl.load(X + row * stride_x + d, mask=mask, other=0.0, cache_modifier=".cg")
            r = tl.load(R + row * stride_r + d, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
            tl.store(RES_OUT + row * stride_ro + d, x, mask=mask)
            x64 = x.to(tl.float32).to(tl.float64)
            sq += x64 * x64
        rstd = tl.math.rsqrt((tl.sum(sq, 0) / D).to(tl.float32) + eps)
        # this program's sums stored above are read back below by its other threads
        tl.debug_barrier()
        for c0 in range(0, D, CHUNK):
            d = c0 + tl.arange(0, CHUNK)
            mask = d < D
            x = tl.load(RES_OUT + row * stride_ro + d, mask=mask, other=0.0,
                        cache_modifier=".cg")
            normed = (x.to(tl.float32) * rstd).to(X.dtype.element_ty).to(tl.float32)
            w = tl.load(W + d, mask=mask, other=0.0).to(tl.float32)
            tl.store(OUT + row * stride_o + d, (normed * w).to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _rmsnorm_kernel(X, R, W, OUT, RES_OUT, stride_x, stride_r, stride_o, stride_ro, eps,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_RES: tl.constexpr,
                        USE_PDL: tl.constexpr):
        pdl_entry(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        y, d, mask = _normed_row(X, R, W, RES_OUT, row, stride_x, stride_r, stride_ro, eps,
                                 D, BLOCK_D, HAS_RES)
        tl.store(OUT + row * stride_o + d, y.to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _rmsnorm_quant_kernel(X, R, W, Q, S, RES_OUT, stride_x, stride_r, stride_q, stride_ro,
                              eps, D: tl.constexpr, BLOCK_D: tl.constexpr,
                              HAS_RES: tl.constexpr, QMAX: tl.constexpr, IS_INT: tl.constexpr,
                              USE_PDL: tl.constexpr):
        pdl_entry(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        y, d, mask = _normed_row(X, R, W, RES_OUT, row, stride_x, stride_r, stride_ro, eps,
                                 D, BLOCK_D, HAS_RES)
        # the norm's 16-bit output, as rms_norm rounds it; then act_quant's one-block arithmetic
        y = y.to(X.dtype.element_ty).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(y), axis=0) / QMAX, 1e-12)
        tl.store(S + row, scale)
        v = tl.minimum(tl.maximum(y * (1.0 / scale), -QMAX), QMAX)
        if IS_INT:
            v = tl.where(v >= 0, tl.floor(v + 0.5), tl.ceil(v - 0.5))
        tl.store(Q + row * stride_q + d, v.to(Q.dtype.element_ty), mask=mask)


def rms_norm_quantized(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype,
                       residual: torch.Tensor | None = None, pdl: bool = False):
    """The norm of `rms_norm` (x [M, D], weight in x's dtype) quantized per token to `dtype`
    (float8_e4m3fn or int8): returns (codes [M, D], scale [M, 1] float32, x + residual or
    None), equal to `act_quant.quantize_activations(rms_norm(...), dtype)` and rms_norm's
    residual output."""
    from folio.model.kernels.act_quant import FP8_MAX, INT8_MAX
    require_triton()
    is_int = dtype == torch.int8
    if not is_int and dtype != torch.float8_e4m3fn:
        raise ValueError(f"the norm quantizes to float8_e4m3fn or int8, not {dtype}")
    if x.dim() != 2 or weight.dtype != x.dtype:
        raise ValueError("rms_norm_quantized needs x [M, D] and a weight in x's dtype")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, D = x.shape
    codes = torch.empty((m, D), dtype=dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    has_res = residual is not None
    if has_res:
        r2 = residual.reshape(m, D)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty_like(x)
    else:
        r2, res_out = x, x  # unused by the kernel
    if m:
        pdl = pdl_launch(x, pdl)
        _rmsnorm_quant_kernel[(m,)](
            x, r2, weight, codes, scale, res_out, x.stride(0), r2.stride(0), codes.stride(0),
            res_out.stride(0), eps, D=D, BLOCK_D=next_pow2(D), HAS_RES=has_res,
            QMAX=INT8_MAX if is_int else FP8_MAX, IS_INT=is_int, USE_PDL=pdl, launch_pdl=pdl,
            num_warps=_num_warps(next_pow2(D)))
    return codes, scale, (res_out if has_res else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, pdl: bool = False):
    """x [..., D]. Without residual returns norm(x); with it returns (norm(x + residual),
    x + residual), like `RMSNorm.forward`. Output dtype: the promotion of weight and x.
    `pdl`: launch with programmatic dependent launch where the GPU has it (_common)."""
    require_triton()
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    has_res = residual is not None
    if has_res:
        r2 = residual.reshape(-1, D)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty_like(x2)
    else:
        r2, res_out = x2, out  # unused by the kernel
    if x2.shape[0] > 0:
        pdl = pdl_launch(x2, pdl)
        _rmsnorm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0), out.stride(0),
            res_out.stride(0), eps, D=D, BLOCK_D=next_pow2(D), HAS_RES=has_res,
            USE_PDL=pdl, launch_pdl=pdl, num_warps=_num_warps(next_pow2(D)))
    out = out.view(x.shape)
    return (out, res_out.view(x.shape)) if has_res else out
