"""Batched multi-LoRA: every token of a flat batch gets its own adapter's low-rank update
y += B[slot] @ (A[slot] @ x), in two launches per projection (punica-style shrink / expand).

Adapters live in S slots: A stacked [S, R, K] (R = n_slices * rank rows, [A_q; A_k; A_v] for
a merged qkv layer, each zero-padded to the engine's max rank) and B [S, N, rank] (the merged
layer's output rows; the LoRA scaling already folded in). `token_slots` [T] int32 names each
token's slot, -1 for none; it is read on the device only, so a CUDA graph holds the calls and
the buffer can be rewritten in place between replays.

- `lora_shrink`: out [T, R] fp32 = A[slot] @ x per token (0 for slot -1).
- `lora_expand`: y[:, slice j] += B[slot][slice j rows] @ out[:, j*rank:(j+1)*rank], every
  slice in the same launch (a grid axis over slices); tokens with slot -1 are not touched.

Each has two variants, chosen by T in the wrapper (a constexpr BLOCK_M, so both compile):
- decode (T <= PER_TOKEN_MAX_T, BLOCK_M = 1): one program per token and tile of rows, a
  broadcast multiply + sum on the CUDA cores (BGMV). Few tokens leave tl.dot's 16 rows mostly
  padding, and each token may have its own adapter anyway.
- prefill (BLOCK_M = 16..64): a program owns BLOCK_M consecutive tokens. A request's tokens
  are contiguous in the flat batch, so most blocks have one slot: the lowest and highest slot
  of the block are equal and one tl.dot pass with that slot's weights serves it. A block that
  straddles requests makes one pass per distinct slot it holds (the next one is the least slot
  above the current) over all its rows, and keeps each row's result from its own slot's pass;
  a block of only slot -1 makes none (shrink stores zeros, expand returns).
"""
from __future__ import annotations

import torch

from folio.model.kernels._common import (HAS_TRITON, INTERPRET, next_pow2, pdl_launch,
                                         require_triton, tl, triton)

# Up to this many tokens, the per-token (BGMV) variant: beyond it tl.dot blocks pay off.
PER_TOKEN_MAX_T = 16
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

if HAS_TRITON:
    from folio.model.kernels._common import pdl_entry

    @triton.jit
    def _load_k(rows, offs_k, K: tl.constexpr, BLOCK_K: tl.constexpr):
        """rows [R, 1] pointers -> [R, BLOCK_K] tile; only the tile at K can be ragged."""
        if K % BLOCK_K == 0:
            tile = tl.load(rows + offs_k[None, :])
        else:
            tile = tl.load(rows + offs_k[None, :], mask=offs_k[None, :] < K, other=0.0)
        return tile

    @triton.jit
    def _next_slot(slots, current, hi):
        """The least slot of the block above `current`; hi + 1 when none is left."""
        return tl.min(tl.where(slots > current, slots, hi + 1))

    @triton.jit(do_not_specialize=["T"])
    def _shrink_kernel(X, A, SLOTS, OUT, T, stride_xt, stride_as, stride_ar, stride_ot,
                       R: tl.constexpr, K: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                       USE_PDL: tl.constexpr):
        pdl_entry(USE_PDL)
        pid_m = tl.program_id(0)
        rows_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        # Rows of A past R read a valid row (clamped) and are never stored: no row masks.
        a_off = tl.minimum(rows_r, R - 1).to(tl.int64)[:, None] * stride_ar
        if BLOCK_M == 1:
            slot = tl.load(SLOTS + pid_m)
            acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
            if slot >= 0:
                # The token's row as a [1, 1] pointer tile, broadcast against A's rows.
                x_row = X + pid_m.to(tl.int64) * stride_xt + tl.zeros((1, 1), dtype=tl.int64)
                a_rows = A + slot.to(tl.int64) * stride_as + a_off
                # Elementwise partial sums, reduced once after the loop.
                part = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    x = _load_k(x_row, offs_k, K, BLOCK_K)
                    a = _load_k(a_rows, offs_k, K, BLOCK_K)
                    part += a.to(tl.float32) * x.to(tl.float32)
                acc = tl.sum(part, axis=1)
            tl.store(OUT + pid_m.to(tl.int64) * stride_ot + rows_r, acc, mask=rows_r < R)
        else:
            rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            m_ok = rows_m < T
            slots = tl.load(SLOTS + rows_m, mask=m_ok, other=-1)
            hi = tl.max(slots)
            slot = tl.min(tl.where(slots >= 0, slots, hi + 1))
            # Tokens past T read row T - 1 (clamped) and are never stored.
            x_rows = X + tl.minimum(rows_m, T - 1).to(tl.int64)[:, None] * stride_xt
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            while slot <= hi:
                a_rows = A + slot.to(tl.int64) * stride_as + a_off
                part = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    x = _load_k(x_rows, offs_k, K, BLOCK_K)
                    a = _load_k(a_rows, offs_k, K, BLOCK_K)
                    part = tl.dot(x, tl.trans(a), part, input_precision=PRECISION)
                acc = tl.where((slots == slot)[:, None], part, acc)
                slot = _next_slot(slots, slot, hi)
            tl.store(OUT + rows_m.to(tl.int64)[:, None] * stride_ot + rows_r[None, :], acc,
                     mask=m_ok[:, None] & (rows_r < R)[None, :])

    @triton.jit(do_not_specialize=["T"])
    def _expand_kernel(BUF, B, SLOTS, Y, T, stride_ut, stride_bs, stride_bn, stride_yt,
                       SLICES: tl.constexpr, RANK: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RANK_PAD: tl.constexpr,
                       USE_PDL: tl.constexpr):
        pdl_entry(USE_PDL)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_j = tl.program_id(2)
        # This program's slice: rows [off, off + size) of y and B, buf columns pid_j * RANK...
        off = 0
        size = 0
        for j in tl.static_range(len(SLICES)):
            off = tl.where(pid_j > j, off + SLICES[j], off)
            size = tl.where(pid_j == j, SLICES[j], size)
        # The grid's column axis covers the widest slice; the others' extra programs leave.
        if pid_n * BLOCK_N >= size:
            return
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        c_ok = cols < size
        ranks = tl.arange(0, RANK_PAD)
        # Columns past the slice read a valid row of B (clamped) and are never stored.
        b_off = (off + tl.minimum(cols, size - 1)).to(tl.int64)[:, None] * stride_bn \
            + ranks[None, :]
        u_cols = pid_j * RANK + ranks
        if BLOCK_M == 1:
            slot = tl.load(SLOTS + pid_m)
            if slot >= 0:
                u_row = BUF + pid_m.to(tl.int64) * stride_ut + u_cols
                b_rows = B + slot.to(tl.int64) * stride_bs + b_off
                if RANK == RANK_PAD:
                    u = tl.load(u_row)
                    b = tl.load(b_rows)
                else:
                    u = tl.load(u_row, mask=ranks < RANK, other=0.0)
                    b = tl.load(b_rows, mask=(ranks < RANK)[None, :], other=0.0)
                delta = tl.sum(b.to(tl.float32) * u[None, :], axis=1)
                y_ptrs = Y + pid_m.to(tl.int64) * stride_yt + off + cols
                y = tl.load(y_ptrs, mask=c_ok, other=0.0)
                tl.store(y_ptrs, (y.to(tl.float32) + delta).to(Y.dtype.element_ty), mask=c_ok)
        else:
            rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            m_ok = rows_m < T
            slots = tl.load(SLOTS + rows_m, mask=m_ok, other=-1)
            hi = tl.max(slots)
            if hi >= 0:
                slot = tl.min(tl.where(slots >= 0, slots, hi + 1))
                u = tl.load(BUF + tl.minimum(rows_m, T - 1).to(tl.int64)[:, None] * stride_ut
                            + u_cols[None, :], mask=(ranks < RANK)[None, :], other=0.0)
                delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                while slot <= hi:
                    b = tl.load(B + slot.to(tl.int64) * stride_bs + b_off,
                                mask=(ranks < RANK)[None, :], other=0.0)
                    # b widens exactly to fp32; PRECISION keeps the product near fp32.
                    part = tl.dot(u, tl.trans(b.to(tl.float32)), input_precision=PRECISION)
                    delta = tl.where((slots == slot)[:, None], part, delta)
                    slot = _next_slot(slots, slot, hi)
                y_ptrs = Y + rows_m.to(tl.int64)[:, None] * stride_yt + off + cols[None, :]
                y_mask = (m_ok & (slots >= 0))[:, None] & c_ok[None, :]
                y = tl.load(y_ptrs, mask=y_mask, other=0.0)
                tl.store(y_ptrs, (y.to(tl.float32) + delta).to(Y.dtype.element_ty),
                         mask=y_mask)


def _shrink_tiles(t: int, r: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_R, BLOCK_K, num_warps, num_stages) for x [t, k] against r rows of A."""
    if INTERPRET:  # small tiles: quick, and ragged against the tests' shapes
        return (1, 4, 32, 4, 1) if t <= PER_TOKEN_MAX_T else (16, 16, 32, 4, 1)
    if t <= PER_TOKEN_MAX_T:
        # A few rows of A per program: enough programs to stream A at one token.
        return 1, 4 if r <= 64 else 8, min(512, max(16, next_pow2(k))), 4, 2
    # The block's x tile is the bulk of the bytes: cover all of R in one tile (up to 128
    # rows) so x is read once, and keep blocks short enough to fill the GPU.
    block_m = 16 if t <= 1024 else 32 if t <= 8192 else 64
    return block_m, min(128, max(16, next_pow2(r))), 64, 4, 3


def _expand_tiles(t: int, rank: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, RANK_PAD, num_warps) for t tokens at this rank."""
    if INTERPRET:
        return (1, 16, next_pow2(rank), 4) if t <= PER_TOKEN_MAX_T \
            else (16, 16, max(16, next_pow2(rank)), 4)
    if t <= PER_TOKEN_MAX_T:
        rank_pad = next_pow2(rank)
        return 1, min(256, max(32, 4096 // rank_pad)), rank_pad, 4
    # tl.dot takes at least 16 along the rank; y's [BLOCK_M, BLOCK_N] tile is the bytes.
    block_m = 16 if t <= 256 else 32 if t <= 1024 else 64
    return block_m, 128, max(16, next_pow2(rank)), 4 if block_m <= 32 else 8


def _check_slots(token_slots: torch.Tensor, t: int) -> None:
    if token_slots.shape != (t,) or token_slots.dtype != torch.int32 \
            or not token_slots.is_contiguous():
        raise ValueError(f"token_slots must be contiguous int32 [{t}], got "
                         f"{tuple(token_slots.shape)} {token_slots.dtype}")


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor,
                out: torch.Tensor, *, pdl: bool = False) -> None:
    """x [T, K] (fp16/bf16/fp32, rows may be strided), a [S, R, K] (x's dtype; rows of each
    slot contiguous), token_slots [T] int32 (each token's slot, -1 = no adapter; not checked
    against S), out [T, R] float32 with contiguous rows, written in full: out[t] =
    a[slot[t]] @ x[t] accumulated in fp32, 0 where slot[t] = -1. `pdl`: launch with
    programmatic dependent launch where the GPU has it (kernels/_common)."""
    require_triton()
    if x.dim() != 2 or a.dim() != 3 or a.shape[2] != x.shape[1]:
        raise ValueError(f"lora_shrink needs x [T, K] and a [S, R, K], got {tuple(x.shape)} "
                         f"and {tuple(a.shape)}")
    if x.dtype not in _DTYPES or a.dtype != x.dtype:
        raise ValueError(f"x and a must share a float dtype, got {x.dtype} and {a.dtype}")
    t, k = x.shape
    r = a.shape[1]
    _check_slots(token_slots, t)
    if out.shape != (t, r) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be float32 [{t}, {r}] with contiguous rows, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if a.stride(2) != 1:
        raise ValueError("lora_shrink needs a's rows contiguous")
    if t == 0:
        return
    if x.stride(1) != 1:
        x = x.contiguous()
    block_m, block_r, block_k, warps, stages = _shrink_tiles(t, r, k)
    pdl = pdl_launch(x, pdl)
    _shrink_kernel[(triton.cdiv(t, block_m), triton.cdiv(r, block_r))](
        x, a, token_slots, out, t, x.stride(0), a.stride(0), a.stride(1), out.stride(0),
        R=r, K=k,
        # fp32 stays exact in tl.dot (its default there is tf32)
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, USE_PDL=pdl,
        num_warps=warps, num_stages=stages, launch_pdl=pdl)


def lora_expand(buf: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor,
                slice_sizes: tuple[int, ...], rank: int, *, pdl: bool = False) -> None:
    """buf [T, n_slices * rank] float32 (lora_shrink's out), b [S, N, rank] (N =
    sum(slice_sizes), y's dtype, rank contiguous), y [T, N] with contiguous rows, updated in
    place: for each slice j with output rows [off_j, off_j + size_j),
    y[t, off_j:off_j + size_j] += b[slot[t], off_j:off_j + size_j, :] @ buf[t, j*rank:(j+1)*rank]
    with the product in fp32, added to y in fp32 and rounded once to y's dtype; tokens with
    slot -1 are left untouched. `pdl` as in lora_shrink."""
    require_triton()
    slice_sizes = tuple(int(s) for s in slice_sizes)
    if not slice_sizes or min(slice_sizes) < 1 or rank < 1:
        raise ValueError(f"lora_expand needs slices and a rank >= 1, got {slice_sizes}, {rank}")
    n = sum(slice_sizes)
    if y.dim() != 2 or y.shape[1] != n or b.dim() != 3 or b.shape[1:] != (n, rank):
        raise ValueError(f"lora_expand needs y [T, {n}] and b [S, {n}, {rank}], got "
                         f"{tuple(y.shape)} and {tuple(b.shape)}")
    t = y.shape[0]
    if buf.shape != (t, len(slice_sizes) * rank) or buf.dtype != torch.float32:
        raise ValueError(f"buf must be float32 [{t}, {len(slice_sizes) * rank}], got "
                         f"{tuple(buf.shape)} {buf.dtype}")
    if y.dtype not in _DTYPES or b.dtype != y.dtype:
        raise ValueError(f"y and b must share a float dtype, got {y.dtype} and {b.dtype}")
    _check_slots(token_slots, t)
    if y.stride(1) != 1 or buf.stride(1) != 1 or b.stride(2) != 1:
        raise ValueError("lora_expand needs contiguous rows of y, buf and b")
    if t == 0:
        return
    block_m, block_n, rank_pad, warps = _expand_tiles(t, rank)
    pdl = pdl_launch(y, pdl)
    grid = (triton.cdiv(t, block_m), triton.cdiv(max(slice_sizes), block_n), len(slice_sizes))
    _expand_kernel[grid](
        buf, b, token_slots, y, t, buf.stride(0), b.stride(0), b.stride(1), y.stride(0),
        SLICES=slice_sizes, RANK=rank,
        # fp32 stays exact; for 16-bit weights tf32x3 keeps the fp32 buf's precision
        PRECISION="ieee" if y.dtype == torch.float32 else "tf32x3",
        BLOCK_M=block_m, BLOCK_N=block_n, RANK_PAD=rank_pad, USE_PDL=pdl,
        num_warps=warps, num_stages=1, launch_pdl=pdl)
