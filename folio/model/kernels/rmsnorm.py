"""Fused (residual add +) RMSNorm: one read of x (and residual), one write of each output.

Rounds like `folio.model.layers.RMSNorm`: the residual sum is rounded to the input dtype, the
statistics run in fp32, the normalized value is rounded to the input dtype before the weight
multiply, and the product is rounded once more.
"""
from __future__ import annotations

import torch

from folio.model.kernels._common import (
    HAS_TRITON, next_pow2, pdl_launch, require_triton, tl, triton, warps_configs)

if HAS_TRITON:
    from folio.model.kernels._common import autotune
    from folio.model.kernels._common import pdl_entry

if HAS_TRITON:

    @autotune(configs=warps_configs((1, 2, 4, 8)), key=["BLOCK_D"])
    @triton.jit
    def _rmsnorm_kernel(X, R, W, OUT, RES_OUT, stride_x, stride_r, stride_o, stride_ro, eps,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_RES: tl.constexpr,
                        USE_PDL: tl.constexpr):
        pdl_entry(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        mask = d < D
        x = tl.load(X + row * stride_x + d, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(R + row * stride_r + d, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
            tl.store(RES_OUT + row * stride_ro + d, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, 0) / D + eps)
        normed = (xf * rstd).to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(W + d, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + row * stride_o + d, (normed * w).to(OUT.dtype.element_ty), mask=mask)


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
            USE_PDL=pdl, launch_pdl=pdl)
    out = out.view(x.shape)
    return (out, res_out.view(x.shape)) if has_res else out
