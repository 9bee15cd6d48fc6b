"""Fused SiLU-and-mul for gated MLPs: silu(gate) * up in one pass over the merged gate|up
projection, instead of three eager kernels (silu, a strided view, mul) per layer.

Rounds like `F.silu(gate) * up` in the activations' dtype: the silu result is rounded to the
dtype before the multiply, and the product once more.
"""
from __future__ import annotations

import torch

from folio.model.kernels._common import HAS_TRITON, require_triton, tl, triton

if HAS_TRITON:

    @triton.jit
    def _silu_and_mul_kernel(X, OUT, stride_x, stride_o, I, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(X + row * stride_x + I + cols, mask=mask, other=0.0)
        act = (gate * tl.sigmoid(gate)).to(up.dtype).to(tl.float32)
        tl.store(OUT + row * stride_o + cols, (act * up.to(tl.float32)).to(OUT.dtype.element_ty),
                 mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2*I] laid out as gate|up -> silu(gate) * up, [..., I]."""
    require_triton()
    two_i = x.shape[-1]
    if two_i % 2:
        raise ValueError(f"silu_and_mul needs an even last dimension, got {two_i}")
    inner = two_i // 2
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], inner), dtype=x.dtype, device=x.device)
    block = 1024
    if x2.shape[0] > 0:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inner, block))](
            x2, out, x2.stride(0), out.stride(0), inner, BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], inner)
