"""Grouped expert GEMMs for mixture-of-experts layers, one Triton launch per projection.

The (token, slot) pairs arrive sorted by expert and padded so that every BLOCK_M-row block
belongs to one expert (folio.model.moe.dispatch.align_to_blocks). A program owns one block of
rows and BLOCK_N output columns: it gathers its rows of the input (row = pair // TOP_K for the
first projection, whose input is per token; the pair itself for the second, whose input is per
pair), streams its expert's [BLOCK_N, K] slice of the weights, and scatters the results back
to the pairs' rows of the output, optionally scaled by each pair's routing weight. Blocks past
the last used one return at once: the grid is sized by an upper bound so that the launch
needs no host sync (and a CUDA graph can hold it).

`fused_experts` chains the two projections around the activation:
  x [T, H] -> gate|up (+ bias) [T*k, 2I] -> act(gate) * up [T*k, I] -> down (+ bias),
  * weight [T*k, H] (float32)
  -> summed over each token's k slots [T, H].

FP8 experts (`scale` given: one float32 per expert row, [E, N]): each weight tile is widened to
the input's dtype for tl.dot and the block's output columns are scaled once after the K loop.
"""
from __future__ import annotations

from typing import Callable

import torch

from folio.model.kernels._common import HAS_TRITON, require_triton, tl, triton
from folio.model.kernels import moe_gemv
from folio.model.moe.dispatch import align_to_blocks

if HAS_TRITON:

    @triton.jit
    def _grouped_gemm_kernel(A, B, C, WEIGHTS, BIAS, SCALE, SORTED_PAIRS, BLOCK_EXPERT,
                             N, K, num_pairs, stride_am, stride_be, stride_bn, stride_bk,
                             stride_cm, stride_bias_e, stride_scale_e,
                             TOP_K: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                             HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
                             IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(BLOCK_EXPERT + pid_m)
        if expert < 0:
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(SORTED_PAIRS + rows)
        valid = pairs < num_pairs
        a_rows = (pairs // TOP_K).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        b_base = B + expert.to(tl.int64) * stride_be + cols[None, :].to(tl.int64) * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < K
            a = tl.load(A + a_rows[:, None] * stride_am + kk[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_base + kk[:, None] * stride_bk, mask=k_ok[:, None] & col_ok[None, :],
                        other=0.0)
            if HAS_SCALE:
                b = b.to(a.dtype)     # FP8 codes: the scale comes after the sum over K
            if IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        if HAS_SCALE:
            scale = tl.load(SCALE + expert.to(tl.int64) * stride_scale_e + cols, mask=col_ok,
                            other=0.0)
            acc = acc * scale[None, :]
        if HAS_BIAS:
            bias = tl.load(BIAS + expert.to(tl.int64) * stride_bias_e + cols, mask=col_ok,
                           other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
        if MUL_WEIGHT:
            w = tl.load(WEIGHTS + pairs, mask=valid, other=0.0)
            acc = acc * w[:, None]
        out = C + pairs[:, None].to(tl.int64) * stride_cm + cols[None, :]
        tl.store(out, acc.to(C.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


def _tiles(num_pairs: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for a batch of `num_pairs` (token, slot) pairs.
    Decode (few pairs, most experts seeing one row) wants the smallest row block tl.dot takes,
    so the padding rows cost little; prefill wants square tiles for the tensor cores."""
    if num_pairs <= 64:
        return 16, 64, 128, 4
    if num_pairs <= 1024:
        return 32, 64, 64, 4
    return 64, 128, 64, 8


def grouped_gemm(a: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, alignment,
                 top_k: int, pair_weights: torch.Tensor | None,
                 tiles: tuple[int, int, int, int], bias: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None) -> None:
    """out[pair] = (a[pair // top_k] @ weights[e]^T (* scale[e]) + bias[e])
    (* pair_weights[pair]), e the pair's expert, for every pair of `alignment`. a [rows, K]
    (last dim contiguous), weights [E, N, K] (FP8 codes where `scale` [E, N] is given), bias
    [E, N] or None."""
    block_m, block_n, block_k, warps = tiles
    n, k = weights.shape[1], weights.shape[2]
    moe_gemv.check_scale(scale, weights)
    grid = (alignment.block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, weights, out, pair_weights if pair_weights is not None else out,
        bias if bias is not None else out, scale if scale is not None else out,
        alignment.sorted_pairs, alignment.block_expert,
        n, k, alignment.num_pairs, a.stride(0), weights.stride(0), weights.stride(1),
        weights.stride(2), out.stride(0), bias.stride(0) if bias is not None else 0,
        scale.stride(0) if scale is not None else 0,
        TOP_K=top_k, MUL_WEIGHT=pair_weights is not None, HAS_BIAS=bias is not None,
        HAS_SCALE=scale is not None, IEEE=a.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=3)


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  gated: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  gate_up_bias: torch.Tensor | None = None,
                  down_bias: torch.Tensor | None = None,
                  few_tokens: bool | None = None, *,
                  gate_up_scale: torch.Tensor | None = None,
                  down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], gate_up [E, 2I, H], down [E, H, I], topk_weights [T, k] (float32), topk_ids
    [T, k] -> [T, H] in x's dtype. `gated`: [rows, 2I] (gate | up) -> [rows, I]; None =
    silu(gate) * up in one fused launch. Biases [E, 2I] / [E, H] or None. `few_tokens`: the
    two-launch form of kernels/moe_gemv.py (SiLU only); None = where it is wanted (up to
    moe_gemv.MAX_TOKENS tokens). FP8 experts: gate_up and down hold e4m3 codes and the scales
    [E, 2I] / [E, H] (float32) are given."""
    if (gate_up_scale is None) != (down_scale is None):
        raise ValueError("FP8 experts need both gate_up_scale and down_scale")
    require_triton()
    t, k = topk_ids.shape
    if few_tokens is None:
        few_tokens = gated is None and moe_gemv.wanted(x, t)
    if few_tokens:
        if gated is not None:
            raise ValueError("the few-token MoE form computes silu(gate) * up only")
        return moe_gemv.few_token_experts(x, gate_up, down, topk_weights, topk_ids,
                                          gate_up_bias, down_bias,
                                          gate_up_scale=gate_up_scale, down_scale=down_scale)
    num_experts = gate_up.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    tiles = _tiles(t * k)
    alignment = align_to_blocks(topk_ids, num_experts, tiles[0])
    inter = torch.empty((t * k, gate_up.shape[1]), dtype=x.dtype, device=x.device)
    grouped_gemm(x, gate_up, inter, alignment, k, None, tiles, gate_up_bias, gate_up_scale)
    if gated is None:
        from folio.model.kernels.activation import silu_and_mul
        act = silu_and_mul(inter)
    else:
        act = gated(inter).contiguous()
    # float32 partial outputs: the k slots are summed before the one rounding to x's dtype
    out = torch.empty((t * k, down.shape[1]), dtype=torch.float32, device=x.device)
    grouped_gemm(act, down, out, alignment, 1, topk_weights.reshape(-1).to(torch.float32)
                 .contiguous(), tiles, down_bias, down_scale)
    return out.view(t, k, -1).sum(dim=1).to(x.dtype)
