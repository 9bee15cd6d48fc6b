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
- prefill (BLOCK_M = 32 or 64): a program owns BLOCK_M consecutive tokens. A request's
  tokens are contiguous in the flat batch, so most blocks have one slot: the lowest and
  highest slot of the block are equal and one tl.dot pass with that slot's weights serves it.
  A block that straddles requests makes one pass per distinct slot it holds (the next one is
  the least slot above the current) over all its rows, and keeps each row's result from its
  own slot's pass; a block of only slot -1 makes none (shrink stores zeros, expand returns).
  Blocks whose every token has another slot (a decode batch past PER_TOKEN_MAX_T) thus cost
  up to one pass per slot: correct, about 3x slower than one slot in shrink.

The shrink reads all of x for a few rows of output, so at few tokens its tiles are few; it
then splits K over up to _MAX_SPLIT programs per tile, and the last of them to finish sums
the fp32 partials in split order (ticket counters, as folio.model.kernels.gemv's split-K:
deterministic, one set per device, so split shrinks must not run on two streams at once).
The expand reads y once and writes it once; its rank-wide product is small next to that.
"""
from __future__ import annotations

import torch

from folio.model.kernels._common import (HAS_TRITON, INTERPRET, next_pow2, pdl_launch,
                                         require_triton, tl, triton)

# Up to this many tokens, the per-token (BGMV) variant; beyond it tl.dot blocks pay off. On an
# H200 (tools/gpu_bench_lora.py) it was the faster at 17-64 tokens of mixed slots, a decode
# batch's usual layout, and about as fast at one slot. The interpreter's tests want both
# variants at small token counts.
PER_TOKEN_MAX_T = 16 if INTERPRET else 64
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Split-K of the shrink: at most _MAX_SPLIT splits, aiming at _TARGET_PROGRAMS programs (a
# few per SM), for grids of at most _COUNTERS tiles (one ticket counter each).
_MAX_SPLIT = 16
_TARGET_PROGRAMS = 512
_COUNTERS = 1024

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

    @triton.jit
    def _shrink_store(acc, OUT, P, C, tile, pid_k, rows_m, rows_r, T, stride_ot,
                      R: tl.constexpr, SPLIT_K: tl.constexpr):
        """Store a [BLOCK_M, BLOCK_R] tile of out. Split over K, each program stores its fp32
        partial; a ticket counter per tile tells the last to finish, which sums the SPLIT_K
        partials in split order (the same bits whatever order the programs ran in: the
        atomic only counts) and resets the counter for the next launch."""
        mask = (rows_m < T)[:, None] & (rows_r < R)[None, :]
        o_ptrs = OUT + rows_m.to(tl.int64)[:, None] * stride_ot + rows_r[None, :]
        if SPLIT_K == 1:
            tl.store(o_ptrs, acc, mask=mask)
        else:
            p_off = rows_m.to(tl.int64)[:, None] * R + rows_r[None, :]
            split_stride = T.to(tl.int64) * R
            tl.store(P + pid_k * split_stride + p_off, acc, mask=mask)
            # Every thread's partial is written before the (single-thread) ticket release.
            tl.debug_barrier()
            ticket = tl.atomic_add(C + tile, 1, sem="acq_rel")
            if ticket == SPLIT_K - 1:
                total = tl.zeros_like(acc)
                for s in tl.static_range(SPLIT_K):
                    # .cg: from L2, never a stale L1 line of an earlier launch
                    total += tl.load(P + s * split_stride + p_off, mask=mask, other=0.0,
                                     cache_modifier=".cg")
                tl.store(o_ptrs, total, mask=mask)
                tl.store(C + tile, 0)

    @triton.jit(do_not_specialize=["T"])
    def _shrink_kernel(X, A, SLOTS, OUT, P, C, T, stride_xt, stride_as, stride_ar, stride_ot,
                       R: tl.constexpr, K: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr):
        pdl_entry(USE_PDL)
        pid_m = tl.program_id(0)
        pid_r = tl.program_id(1)
        pid_k = tl.program_id(2)
        rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        # Split boundaries fall on whole tiles, so only the tile at K is ragged (and a last
        # split may be empty).
        K_SPLIT: tl.constexpr = ((K + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K \
            * BLOCK_K
        k_lo = pid_k * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
        # Rows of A past R read a valid row (clamped) and are never stored: no row masks.
        a_off = tl.minimum(rows_r, R - 1).to(tl.int64)[:, None] * stride_ar
        if BLOCK_M == 1:
            slot = tl.load(SLOTS + pid_m)
            acc = tl.zeros((1, BLOCK_R), dtype=tl.float32)
            if slot >= 0:
                # The token's row as a [1, 1] pointer tile, broadcast against A's rows.
                x_row = X + pid_m.to(tl.int64) * stride_xt + tl.zeros((1, 1), dtype=tl.int64)
                a_rows = A + slot.to(tl.int64) * stride_as + a_off
                # Elementwise partial sums, reduced once after the loop.
                part = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
                for k0 in range(k_lo, k_hi, BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    x = _load_k(x_row, offs_k, K, BLOCK_K)
                    a = _load_k(a_rows, offs_k, K, BLOCK_K)
                    part += a.to(tl.float32) * x.to(tl.float32)
                acc = tl.sum(part, axis=1)[None, :]
        else:
            slots = tl.load(SLOTS + rows_m, mask=rows_m < T, other=-1)
            hi = tl.max(slots)
            slot = tl.min(tl.where(slots >= 0, slots, hi + 1))
            # Tokens past T read row T - 1 (clamped) and are never stored.
            x_rows = X + tl.minimum(rows_m, T - 1).to(tl.int64)[:, None] * stride_xt
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            while slot <= hi:
                a_rows = A + slot.to(tl.int64) * stride_as + a_off
                part = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                for k0 in range(k_lo, k_hi, BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    x = _load_k(x_rows, offs_k, K, BLOCK_K)
                    a = _load_k(a_rows, offs_k, K, BLOCK_K)
                    part = tl.dot(x, tl.trans(a), part, input_precision=PRECISION)
                acc = tl.where((slots == slot)[:, None], part, acc)
                slot = _next_slot(slots, slot, hi)
        _shrink_store(acc, OUT, P, C, pid_m * tl.num_programs(1) + pid_r, pid_k, rows_m,
                      rows_r, T, stride_ot, R, SPLIT_K)

    @triton.jit(do_not_specialize=["T"])
    def _expand_kernel(BUF, B, SLOTS, Y, T, stride_ut, stride_bs, stride_bn, stride_yt,
                       SLICES: tl.constexpr, RANK: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RANK_PAD: tl.constexpr,
                       U_SPLIT: tl.constexpr, USE_PDL: tl.constexpr):
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
                y_ptrs = Y + rows_m.to(tl.int64)[:, None] * stride_yt + off + cols[None, :]
                y_mask = (m_ok & (slots >= 0))[:, None] & c_ok[None, :]
                # y is the bulk of the bytes and waits on nothing: its load goes out first.
                y = tl.load(y_ptrs, mask=y_mask, other=0.0)
                slot = tl.min(tl.where(slots >= 0, slots, hi + 1))
                k_mask = (ranks < RANK)[None, :]
                u = tl.load(BUF + tl.minimum(rows_m, T - 1).to(tl.int64)[:, None] * stride_ut
                            + u_cols[None, :], mask=k_mask, other=0.0)
                b = tl.load(B + slot.to(tl.int64) * stride_bs + b_off, mask=k_mask, other=0.0)
                delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                while slot <= hi:
                    following = _next_slot(slots, slot, hi)
                    # The next slot's tile (if any) loads while this one's product runs.
                    b_next = tl.load(B + tl.minimum(following, hi).to(tl.int64) * stride_bs
                                     + b_off, mask=k_mask & (following <= hi), other=0.0)
                    if U_SPLIT:
                        # bf16: u as the sum of two bf16 terms (16 significant bits, the
                        # rest below y's rounding) against b as it is, accumulated in fp32:
                        # 1.3-1.4x faster on an H200 than tf32x3 on b widened to fp32.
                        u_hi = u.to(b.dtype)
                        u_lo = (u - u_hi.to(tl.float32)).to(b.dtype)
                        part = tl.dot(u_lo, tl.trans(b), tl.dot(u_hi, tl.trans(b)))
                    else:
                        # b widens exactly to fp32; PRECISION keeps the product near fp32
                        # (fp16's range would not hold every fp32 u split as above).
                        part = tl.dot(u, tl.trans(b.to(tl.float32)),
                                      input_precision=PRECISION)
                    delta = tl.where((slots == slot)[:, None], part, delta)
                    b = b_next
                    slot = following
                tl.store(y_ptrs, (y.to(tl.float32) + delta).to(Y.dtype.element_ty),
                         mask=y_mask)


def _shrink_tiles(t: int, r: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_R, BLOCK_K, SPLIT_K, num_warps) for x [t, k] against r rows of A."""
    if INTERPRET:  # small tiles: quick, and ragged against the tests' shapes
        return (1, 4, 32, 1, 4) if t <= PER_TOKEN_MAX_T else (16, 16, 32, 1, 4)
    if t <= PER_TOKEN_MAX_T:
        # A few rows of A per program, so that even one token spreads over many programs.
        block_m, block_r, block_k = 1, 8, 256
    else:
        block_m, block_r, block_k = 32 if t <= 1024 else 64, 16, 64
    # Few tiles (few tokens, a narrow A) leave SMs idle: split K until the programs cover
    # them, keeping at least two K tiles per split.
    tiles = triton.cdiv(t, block_m) * triton.cdiv(r, block_r)
    split = 1
    if tiles <= _COUNTERS:
        split = max(1, min(_MAX_SPLIT, _TARGET_PROGRAMS // tiles, k // (2 * block_k)))
    return block_m, block_r, block_k, split, 4


def _expand_tiles(t: int, rank: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for t tokens at this rank."""
    if INTERPRET:
        return (1, 16, 4) if t <= PER_TOKEN_MAX_T else (16, 16, 4)
    if t <= PER_TOKEN_MAX_T:
        return 1, min(256, max(32, 4096 // next_pow2(rank))), 4
    # y's [BLOCK_M, BLOCK_N] tile is the bytes.
    return (32, 64, 4) if t <= 256 else (32, 128, 4)


_counters: dict[tuple[str, int | None], torch.Tensor] = {}


def _split_counters(device: torch.device) -> torch.Tensor:
    """int32 ticket counters of the split-K shrink, one per tile, zero between launches (the
    last program of each tile resets its own). One set per device: split shrinks must not
    run concurrently on two streams."""
    key = (device.type, device.index)
    counters = _counters.get(key)
    if counters is None:
        counters = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
        _counters[key] = counters
    return counters


def _check_slots(token_slots: torch.Tensor, t: int) -> None:
    if token_slots.shape != (t,) or token_slots.dtype != torch.int32 \
            or not token_slots.is_contiguous():
        raise ValueError(f"token_slots must be contiguous int32 [{t}], got "
                         f"{tuple(token_slots.shape)} {token_slots.dtype}")


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor,
                out: torch.Tensor, *, pdl: bool = False,
                _config: tuple[int, int, int, int, int] | None = None) -> None:
    """x [T, K] (fp16/bf16/fp32, rows may be strided), a [S, R, K] (x's dtype; rows of each
    slot contiguous), token_slots [T] int32 (each token's slot, -1 = no adapter; not checked
    against S), out [T, R] float32 with contiguous rows, written in full: out[t] =
    a[slot[t]] @ x[t] accumulated in fp32, 0 where slot[t] = -1. `pdl`: launch with
    programmatic dependent launch where the GPU has it (kernels/_common). `_config` (tests,
    tuning) forces (BLOCK_M, BLOCK_R, BLOCK_K, SPLIT_K, num_warps); BLOCK_M is 1 or >= 16."""
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
    block_m, block_r, block_k, split, warps = _config or _shrink_tiles(t, r, k)
    grid = (triton.cdiv(t, block_m), triton.cdiv(r, block_r), split)
    if split > 1 and grid[0] * grid[1] > _COUNTERS:
        raise ValueError(f"a split shrink takes at most {_COUNTERS} tiles, got {grid[:2]}")
    # fp32 partials of a split: allocated per call (a CUDA graph keeps its own)
    partials = torch.empty((split, t, r), dtype=torch.float32, device=x.device) \
        if split > 1 else out
    pdl = pdl_launch(x, pdl)
    _shrink_kernel[grid](
        x, a, token_slots, out, partials, _split_counters(x.device), t, x.stride(0),
        a.stride(0), a.stride(1), out.stride(0), R=r, K=k,
        # fp32 stays exact in tl.dot (its default there is tf32)
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, SPLIT_K=split, USE_PDL=pdl,
        num_warps=warps, num_stages=1 if INTERPRET else 3, launch_pdl=pdl)


def lora_expand(buf: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor,
                slice_sizes: tuple[int, ...], rank: int, *, pdl: bool = False,
                _config: tuple[int, int, int] | None = None) -> None:
    """buf [T, n_slices * rank] float32 (lora_shrink's out), b [S, N, rank] (N =
    sum(slice_sizes), y's dtype, rank contiguous), y [T, N] with contiguous rows, updated in
    place: for each slice j with output rows [off_j, off_j + size_j),
    y[t, off_j:off_j + size_j] += b[slot[t], off_j:off_j + size_j, :] @ buf[t, j*rank:(j+1)*rank]
    with the product in fp32 (bf16 blocks: buf carried to 16 significant bits, b exact;
    fp16: tf32x3), added to y in fp32 and rounded once to y's dtype; tokens with
    slot -1 are left untouched. `pdl` as in lora_shrink; `_config` (tests, tuning) forces
    (BLOCK_M, BLOCK_N, num_warps)."""
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
    block_m, block_n, warps = _config or _expand_tiles(t, rank)
    # tl.dot takes at least 16 along the rank
    rank_pad = next_pow2(rank) if block_m == 1 else max(16, next_pow2(rank))
    pdl = pdl_launch(y, pdl)
    grid = (triton.cdiv(t, block_m), triton.cdiv(max(slice_sizes), block_n), len(slice_sizes))
    _expand_kernel[grid](
        buf, b, token_slots, y, t, buf.stride(0), b.stride(0), b.stride(1), y.stride(0),
        SLICES=slice_sizes, RANK=rank,
        # fp32 stays exact; for 16-bit weights tf32x3 keeps the fp32 buf's precision
        PRECISION="ieee" if y.dtype == torch.float32 else "tf32x3",
        BLOCK_M=block_m, BLOCK_N=block_n, RANK_PAD=rank_pad,
        U_SPLIT=y.dtype == torch.bfloat16, USE_PDL=pdl,
        num_warps=warps, num_stages=1, launch_pdl=pdl)
