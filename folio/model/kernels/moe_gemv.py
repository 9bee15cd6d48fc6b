"""Mixture-of-experts layer for a few tokens (decode at small batches), in two launches that
read each routed expert's weights once and do nothing else.

The grouped GEMMs of kernels/fused_moe.py sort the (token, slot) pairs into row blocks per
expert first, and run each block through tl.dot padded to 16 rows: at one token (8 pairs) that
is an alignment pass, 15 padding rows per expert, a separate SiLU-and-mul and a separate sum
over the slots, 2.6x the bytes-read floor on the H200 in a CUDA graph. Here, as in the skinny
GEMV (kernels/gemv.py), each program streams rows of one expert's weight against one row of
input on the CUDA cores:
- `_gate_up_kernel`: program (pair, column block): the pair's token row of x against its
  expert's gate and up rows, then silu(gate) * up, rounded as `activation.silu_and_mul` rounds
  (gate and up to the activations' dtype, silu(gate) once more, then the product);
- `_down_kernel`: program (token, column block): the token's k slots' activation rows against
  their experts' down rows, all slots in one tile, times the routing weights, summed over the
  slots in fp32 and rounded once, as fused_experts sums its fp32 partials.
The expert of each pair is read on the device (no host sync, so a CUDA graph holds it).
FP8 experts: the codes are widened in registers and each output row's sum is scaled once
(scales [E, 2I] / [E, H], float32).
"""
from __future__ import annotations

import torch

from folio.model.kernels._common import HAS_TRITON, INTERPRET, require_triton, tl, triton

# Up to this many tokens the few-token form is used (beyond, tokens share experts and the
# grouped GEMMs' row blocks read each expert once for all of them).
MAX_TOKENS = 4

# (BLOCK_N, BLOCK_K, num_warps): rows of a weight per program and the K slice per step.
# From `tools/gpu_bench_moe.py --sweep` (H100, Qwen3-30B-A3B expert shapes, layers chained
# in one graph): near the best of 120 configs at 1, 2 and 4 tokens alike (30.98 / 54.36 /
# 94.51 us against 33.41 / 58.05 / 99.10 for the former (4, 512, 4) + (2, 256, 4)); the
# one-row down tile puts 2,048 programs in flight at one token.
_GATE_UP_TILE = (4, 256, 4)
_DOWN_TILE = (1, 128, 4)
# FP8 experts' gate_up: two rows a program, two warps (the same sweep with --fp8: 19.19 against
# 22.47 us at one token, 60.66 against 62.55 at four).
_GATE_UP_TILE_FP8 = (2, 256, 2)
_INTERPRET_TILE = (4, 16, 4)

if HAS_TRITON:

    @triton.jit
    def _gate_up_kernel(X, W, BIAS, SCALE, IDS, ACT, I, K, stride_x, stride_we, stride_wn,
                        stride_be, stride_se, stride_act, TOP_K: tl.constexpr,
                        HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pair = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(IDS + pair).to(tl.int64)
        token = pair // TOP_K
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Columns past I read row I - 1 (valid memory) and are never stored.
        cols_c = tl.minimum(cols, I - 1).to(tl.int64)
        g_rows = W + expert * stride_we + cols_c[:, None] * stride_wn
        u_rows = g_rows + I * stride_wn
        x_row = X + token.to(tl.int64) * stride_x
        ks = tl.arange(0, BLOCK_K)
        acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < K
            xk = tl.load(x_row + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            acc_g += tl.load(g_rows + kk[None, :], mask=k_ok[None, :], other=0.0) \
                .to(tl.float32) * xk
            acc_u += tl.load(u_rows + kk[None, :], mask=k_ok[None, :], other=0.0) \
                .to(tl.float32) * xk
        gate = tl.sum(acc_g, axis=1)
        up = tl.sum(acc_u, axis=1)
        if HAS_SCALE:
            s_row = SCALE + expert * stride_se
            gate = gate * tl.load(s_row + cols_c)
            up = up * tl.load(s_row + I + cols_c)
        if HAS_BIAS:
            b_row = BIAS + expert * stride_be
            gate += tl.load(b_row + cols_c).to(tl.float32)
            up += tl.load(b_row + I + cols_c).to(tl.float32)
        dt = ACT.dtype.element_ty
        gate = gate.to(dt).to(tl.float32)
        up = up.to(dt).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32)
        tl.store(ACT + pair.to(tl.int64) * stride_act + cols, (act * up).to(dt), mask=cols < I)

    @triton.jit
    def _down_kernel(ACT, W, BIAS, SCALE, IDS, WEIGHTS, OUT, H, K, stride_act, stride_we,
                     stride_wn, stride_be, stride_se, stride_out, TOP_K: tl.constexpr,
                     SLOTS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # All k slots of the token in one [SLOTS, BLOCK_N, BLOCK_K] tile per step, so each
        # program keeps k experts' rows in flight at once (a loop over the slots kept one).
        token = tl.program_id(0)
        pid_n = tl.program_id(1)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cols_c = tl.minimum(cols, H - 1).to(tl.int64)
        slots = tl.arange(0, SLOTS)
        slot_ok = slots < TOP_K
        pairs = token * TOP_K + tl.minimum(slots, TOP_K - 1)    # padding slots: the last one
        experts = tl.load(IDS + pairs).to(tl.int64)
        rows = W + experts[:, None, None] * stride_we + cols_c[None, :, None] * stride_wn
        a_rows = ACT + pairs.to(tl.int64)[:, None] * stride_act
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((SLOTS, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < K
            a = tl.load(a_rows + kk[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.load(rows + kk[None, None, :], mask=k_ok[None, None, :], other=0.0) \
                .to(tl.float32) * a[:, None, :]
        part = tl.sum(acc, axis=2)                                  # [SLOTS, BLOCK_N]
        if HAS_SCALE:
            part = part * tl.load(SCALE + experts[:, None] * stride_se + cols_c[None, :])
        if HAS_BIAS:
            part += tl.load(BIAS + experts[:, None] * stride_be + cols_c[None, :]) \
                .to(tl.float32)
        w = tl.load(WEIGHTS + pairs, mask=slot_ok, other=0.0)      # padding slots weigh 0
        total = tl.sum(part * w[:, None], axis=0)
        tl.store(OUT + token.to(tl.int64) * stride_out + cols,
                 total.to(OUT.dtype.element_ty), mask=cols < H)


def check_scale(scale: torch.Tensor | None, weight: torch.Tensor) -> None:
    """FP8 experts' scales: [E, N] float32 rows the kernels index by column (stride 1)."""
    if scale is not None and (scale.shape != weight.shape[:2] or scale.stride(1) != 1):
        raise ValueError("FP8 expert scales must be [E, N] with contiguous rows")


def wanted(x: torch.Tensor, num_tokens: int) -> bool:
    """Whether the few-token form should serve a step of `num_tokens` tokens."""
    return HAS_TRITON and 0 < num_tokens <= MAX_TOKENS and (x.is_cuda or INTERPRET)


def few_token_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      gate_up_bias: torch.Tensor | None = None,
                      down_bias: torch.Tensor | None = None, *,
                      gate_up_scale: torch.Tensor | None = None,
                      down_scale: torch.Tensor | None = None,
                      _config: dict | None = None) -> torch.Tensor:
    """fused_experts with silu(gate) * up, for a few tokens: x [T, H], gate_up [E, 2I, H]
    (gate rows first), down [E, H, I] (both with contiguous rows), topk_weights [T, k],
    topk_ids [T, k], biases [E, 2I] / [E, H] or None -> [T, H] in x's dtype; FP8 experts
    with their scales [E, 2I] / [E, H] (float32). `_config`
    (tile sweeps, tools/gpu_bench_moe.py): {"gate_up": (BLOCK_N, BLOCK_K, num_warps),
    "down": (...), "stages": num_stages}, each key optional."""
    require_triton()
    t, k = topk_ids.shape
    h, inter = x.shape[1], down.shape[2]
    if gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError("expert weights need contiguous rows")
    check_scale(gate_up_scale, gate_up)
    check_scale(down_scale, down)
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty((t * k, inter), dtype=x.dtype, device=x.device)
    config = _config or {}
    stages = config.get("stages", 2)
    default = _GATE_UP_TILE_FP8 if gate_up_scale is not None else _GATE_UP_TILE
    bn, bk, warps = config.get("gate_up", _INTERPRET_TILE if INTERPRET else default)
    _gate_up_kernel[(t * k, triton.cdiv(inter, bn))](
        x, gate_up, gate_up_bias if gate_up_bias is not None else x,
        gate_up_scale if gate_up_scale is not None else x, ids, act, inter, h,
        x.stride(0), gate_up.stride(0), gate_up.stride(1),
        gate_up_bias.stride(0) if gate_up_bias is not None else 0,
        gate_up_scale.stride(0) if gate_up_scale is not None else 0, act.stride(0),
        TOP_K=k, HAS_BIAS=gate_up_bias is not None, HAS_SCALE=gate_up_scale is not None,
        BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps, num_stages=stages)
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    bn, bk, warps = config.get("down", _INTERPRET_TILE if INTERPRET else _DOWN_TILE)
    _down_kernel[(t, triton.cdiv(h, bn))](
        act, down, down_bias if down_bias is not None else act,
        down_scale if down_scale is not None else act, ids, weights, out, h, inter,
        act.stride(0), down.stride(0), down.stride(1),
        down_bias.stride(0) if down_bias is not None else 0,
        down_scale.stride(0) if down_scale is not None else 0, out.stride(0),
        TOP_K=k, SLOTS=triton.next_power_of_2(k), HAS_BIAS=down_bias is not None,
        HAS_SCALE=down_scale is not None, BLOCK_N=bn,
        BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return out
