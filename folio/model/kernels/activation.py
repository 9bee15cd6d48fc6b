"""Fused SiLU-and-mul for gated MLPs: silu(gate) * up in one pass over the merged gate|up
projection, instead of three eager kernels (silu, a strided view, mul) per layer.

Rounds like `F.silu(gate) * up` in the activations' dtype: the silu result is rounded to the
dtype before the multiply, and the product once more.
"""
from __future__ import annotations

import torch

from folio.model.kernels._common import HAS_TRITON, require_triton, tl, triton
from folio.model.kernels.act_quant import FP8_MAX, INT8_MAX

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

    @triton.jit
    def _silu_mul_block(X, row_ptr, cols, mask, I):
        """silu(gate) * up for one block of a row, rounded as _silu_and_mul_kernel rounds
        (to the input dtype), in fp32."""
        gate = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(row_ptr + I + cols, mask=mask, other=0.0)
        act = (gate * tl.sigmoid(gate)).to(up.dtype).to(tl.float32)
        return (act * up.to(tl.float32)).to(up.dtype).to(tl.float32)

    @triton.jit
    def _quantize_block(v, inv, QMAX: tl.constexpr, IS_INT: tl.constexpr):
        """v (fp32) times 1 / scale, clamped and rounded as act_quant's kernel does."""
        v = tl.minimum(tl.maximum(v * inv, -QMAX), QMAX)
        if IS_INT:
            v = tl.where(v >= 0, tl.floor(v + 0.5), tl.ceil(v - 0.5))
        return v

    @triton.jit
    def _silu_and_mul_quant_kernel(X, Q, S, stride_x, stride_q, I, QMAX: tl.constexpr,
                                   IS_INT: tl.constexpr, BLOCK: tl.constexpr,
                                   ONE_BLOCK: tl.constexpr):
        # One row per program: the row's absolute maximum, then its codes. ONE_BLOCK (the
        # row fits one block): the activation stays in registers between the two. Otherwise
        # it is recomputed from a second read of gate|up (which the L2 did not keep: that
        # form ran at 1.5x the time of the one-block one on an H200).
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride_x
        q_row = Q + row * stride_q
        if ONE_BLOCK:
            cols = tl.arange(0, BLOCK)
            mask = cols < I
            act = _silu_mul_block(X, x_row, cols, mask, I)
            # the same arithmetic as act_quant's _act_quant_kernel, so the codes are its codes
            scale = tl.maximum(tl.max(tl.abs(act), axis=0) / QMAX, 1e-12)
            tl.store(S + row, scale)
            v = _quantize_block(act, 1.0 / scale, QMAX, IS_INT)
            tl.store(q_row + cols, v.to(Q.dtype.element_ty), mask=mask)
        else:
            amax = tl.zeros((BLOCK,), dtype=tl.float32)
            for c0 in range(0, I, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                mask = cols < I
                amax = tl.maximum(amax, tl.abs(_silu_mul_block(X, x_row, cols, mask, I)))
            scale = tl.maximum(tl.max(amax, axis=0) / QMAX, 1e-12)
            tl.store(S + row, scale)
            inv = 1.0 / scale
            for c0 in range(0, I, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                mask = cols < I
                v = _quantize_block(_silu_mul_block(X, x_row, cols, mask, I), inv, QMAX, IS_INT)
                tl.store(q_row + cols, v.to(Q.dtype.element_ty), mask=mask)


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


_ONE_BLOCK_MAX = 16384


def silu_and_mul_quantized(x: torch.Tensor, dtype: torch.dtype
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, 2*I] (gate|up, CUDA, 16-bit) -> the activation quantized per token for a W8A8
    product: (codes [M, I] in `dtype`, float8_e4m3fn or int8; scale [M, 1] float32), the
    same bytes as `act_quant.quantize_activations(silu_and_mul(x), dtype)` in one pass that
    never writes the 16-bit activation (at a long prefill's rows that pair of kernels moved
    three times the activation's bytes)."""
    require_triton()
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"silu_and_mul_quantized needs x [M, 2*I] with contiguous rows, got "
                         f"{tuple(x.shape)}")
    is_int = dtype == torch.int8
    if not is_int and dtype != torch.float8_e4m3fn:
        raise ValueError(f"activations quantize to float8_e4m3fn or int8, not {dtype}")
    m, inner = x.shape[0], x.shape[1] // 2
    codes = torch.empty((m, inner), dtype=dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        # A whole row in one block up to 16k columns (Llama-3-8B's 14,336: 32 fp32 values per
        # thread at 16 warps), else 2k-column blocks in two passes.
        one = triton.next_power_of_2(inner) <= _ONE_BLOCK_MAX
        block = triton.next_power_of_2(inner) if one else 2048
        _silu_and_mul_quant_kernel[(m,)](x, codes, scale, x.stride(0), codes.stride(0), inner,
                                         QMAX=INT8_MAX if is_int else FP8_MAX, IS_INT=is_int,
                                         BLOCK=block, ONE_BLOCK=one,
                                         num_warps=max(4, min(16, block // 1024)))
    return codes, scale
